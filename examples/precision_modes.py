"""Optimizer-state precision, side by side: the same training in every jaxfuse precision mode
against float32 AdamW, on two models: the main example's character LM (train_char_lm.py) and an
MLP classifier on a synthetic teacher-student task.

Modes (jaxfuse.adamw with clip_by_global_norm(1.0), warmup + cosine schedule, weight decay 0.1,
under jaxfuse.fused_step):

  fp32                 float32 params and moments: the reference (and again from another
                       initialization, to show how far two fp32 runs end apart)
  bf16 moments         float32 params, both moments stored in bfloat16 (mu_dtype, nu_dtype)
  8-bit moments        float32 params, both moments block-wise in 8 bits (moment_bits=8) in
                       every leaf of at least 4096 elements (a multiple of 128)
  bf16 + fp32 master   bfloat16 params, a float32 master copy in the state (master_weights=True)
  bf16 + remainders    bfloat16 params and their int16 remainders (master_weights="remainder"):
                       the fp32 master exactly, in 2 bytes instead of 4
  bf16 + stochastic    bfloat16 params rounded stochastically, no master
  bf16 nearest         bfloat16 params rounded to nearest, no master: the failure the modes fix

Without a master the moments have the params' dtype (as optax's): bf16 params keep bf16
moments. Every mode computes the forward and backward in float32 from its params (so what
differs is the optimizer's storage), sees the same batches and starts from the same weights.
Prints a table (final validation loss, its difference to fp32, and from jaxfuse.report the state
bytes per param and the bytes the optimizer step (clip + AdamW) moves per param) and saves
precision_modes.png with every mode's loss curves.

    python3 examples/precision_modes.py            # ~18 minutes on a 2-core CPU
    python3 examples/precision_modes.py --quick    # ~2 minutes
"""

from __future__ import annotations

import argparse
import functools
import os
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxfuse
from train_char_lm import (build_model_config, init_params, load_corpus, loss_fn, sample_batch,
                           split_corpus, weight_decay_mask)

MODES = {
    "fp32": (jnp.float32, {}),
    "fp32, init seed 1": (jnp.float32, {}),  # the spread one init seed gives, for scale
    "bf16 moments": (jnp.float32, dict(mu_dtype=jnp.bfloat16, nu_dtype=jnp.bfloat16)),
    "8-bit moments": (jnp.float32, dict(moment_bits=8)),
    "bf16 + fp32 master": (jnp.bfloat16, dict(master_weights=True)),
    "bf16 + remainders": (jnp.bfloat16, dict(master_weights="remainder")),
    "bf16 + stochastic": (jnp.bfloat16, dict(stochastic_rounding=True, seed=0)),
    "bf16 nearest": (jnp.bfloat16, {}),
}


class Task:
  """A model to train: init(key) -> float32 params, loss(params, batch), batch(step) -> a
  batch, the validation batches and the weight-decay mask."""

  def __init__(self, name: str, init: Callable, loss: Callable, batch: Callable,
               val: list, mask: Any):
    self.name, self.init, self.loss, self.batch, self.val, self.mask = (
        name, init, loss, batch, val, mask)


def char_lm_task(quick: bool) -> Task:
  cfg = build_model_config(vocab_size=256, dim=64 if quick else 128, n_layers=2 if quick else 4,
                           n_heads=4, n_kv_heads=2, max_seq_len=64 if quick else 128)
  seq_len, batch = cfg.max_seq_len, 16
  train_data, val = split_corpus(load_corpus(seed=0), batch, seq_len, 8, 0.05,
                                 jax.devices()[0])
  batch_at = jax.jit(lambda step: sample_batch(train_data, jax.random.key(step), batch, seq_len))
  return Task(f"char LM ({'L2 D64' if quick else 'L4 D128'}, Python stdlib bytes)",
              lambda key: init_params(cfg, key), functools.partial(loss_fn, cfg=cfg), batch_at,
              val, weight_decay_mask)


def mlp_task(quick: bool) -> Task:
  """Classify 64-dim Gaussian points into the 10 classes a random teacher MLP assigns."""
  dims = [64, 256, 256, 10]
  teacher = [jax.random.normal(jax.random.key(100 + i), (a, b)) / np.sqrt(a)
             for i, (a, b) in enumerate(zip(dims[:-1], dims[1:]))]

  def data(key, n):
    x = jax.random.normal(key, (n, dims[0]))
    h = x
    for w in teacher[:-1]:
      h = jnp.tanh(h @ w)
    return x, jnp.argmax(h @ teacher[-1], axis=-1)

  def init(key):
    keys = jax.random.split(key, len(dims) - 1)
    return {f"layer{i}": {"w": jax.random.normal(k, (a, b)) * np.sqrt(2.0 / a),
                          "b": jnp.zeros((b,))}
            for i, (k, a, b) in enumerate(zip(keys, dims[:-1], dims[1:]))}

  def loss(params, batch):
    x, y = batch
    for i in range(len(dims) - 1):
      layer = params[f"layer{i}"]
      x = x @ layer["w"] + layer["b"]
      if i < len(dims) - 2:
        x = jax.nn.gelu(x)
    return optax.softmax_cross_entropy_with_integer_labels(x, y).mean()

  batch_at = jax.jit(lambda step: data(jax.random.key(step), 256))
  mask = lambda p: jax.tree.map(lambda x: x.ndim == 2, p)
  return Task("MLP classifier (64-256-256-10, teacher labels)", init, loss, batch_at,
              [data(jax.random.key(10**6), 4096)], mask)


def optimizer(task: Task, steps: int, lr: float, options: dict) -> optax.GradientTransformation:
  schedule = optax.warmup_cosine_decay_schedule(0.0, lr, max(1, steps // 10), steps, lr / 10)
  return optax.chain(jaxfuse.clip_by_global_norm(1.0),
                     jaxfuse.adamw(schedule, b1=0.9, b2=0.95, weight_decay=0.1, mask=task.mask,
                                   **options))


def train(task: Task, dtype: Any, options: dict, steps: int, lr: float,
          init_seed: int = 0) -> dict[str, Any]:
  """Trains `task` in one mode: per-step train losses, validation losses and the report."""
  tx = optimizer(task, steps, lr, options)
  wide = lambda p: jax.tree.map(lambda x: x.astype(jnp.float32), p)
  params = jax.tree.map(lambda x: x.astype(dtype), task.init(jax.random.key(init_seed)))
  state = tx.init(params)

  def step(params, state, batch):
    loss, grads = jax.value_and_grad(lambda p: task.loss(wide(p), batch))(params)
    params, state = jaxfuse.fused_step(tx, grads, state, params)
    return params, state, loss

  step_fn = jax.jit(step, donate_argnums=(0, 1))
  grads = jax.tree.map(jnp.ones_like, params)
  report = jaxfuse.report(jax.jit(lambda p, s, g: jaxfuse.fused_step(tx, g, s, p),
                                  donate_argnums=(0, 1)), params, state, grads)
  evaluate = jax.jit(lambda p: jnp.mean(jnp.stack([task.loss(wide(p), b) for b in task.val])))
  losses, val = [], [(0, float(evaluate(params)))]
  for s in range(steps):
    params, state, loss = step_fn(params, state, task.batch(s))
    losses.append(loss)
    if (s + 1) % max(1, steps // 8) == 0 or s + 1 == steps:
      val.append((s + 1, float(evaluate(params))))
  n = sum(x.size for x in jax.tree.leaves(params))
  return {"loss": np.asarray(jax.device_get(losses)), "val": val, "report": report,
          "params": n}


def print_table(task: Task, results: dict[str, dict]) -> None:
  ref = results["fp32"]["val"][-1][1]
  print(f"\n== {task.name}: {results['fp32']['params'] / 1e6:.2f} M params")
  print(f"  {'mode':20s} {'final val loss':>14s} {'vs fp32':>8s} {'state B/param':>14s} "
        f"{'optimizer B/param/step':>22s}")
  for mode, r in results.items():
    final = r["val"][-1][1]
    state = r["report"].state_bytes_per_param
    moved = r["report"].bytes_moved / r["params"]
    print(f"  {mode:20s} {final:14.4f} {100 * (final / ref - 1):+7.2f}% {state:14.1f} "
          f"{moved:22.1f}")


def plot(all_results: list[tuple[Task, dict]], path: str) -> str:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, axes = plt.subplots(1, len(all_results), figsize=(7 * len(all_results), 5))
  for ax, (task, results) in zip(np.atleast_1d(axes), all_results):
    for mode, r in results.items():
      loss = r["loss"]
      k = max(1, len(loss) // 40)
      smooth = np.convolve(loss, np.ones(k) / k, mode="valid")
      line, = ax.plot(np.arange(k, len(loss) + 1), smooth, lw=1.4, label=f"{mode} (train)")
      steps, vals = zip(*r["val"])
      ax.plot(steps, vals, "o--", ms=3, lw=0.8, color=line.get_color())
    ax.set_title(task.name, fontsize=10)
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (train: moving mean; o: validation)")
    ax.set_yscale("log")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
  fig.suptitle("jaxfuse AdamW: optimizer-state precision modes against float32", fontsize=11)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return path


def main() -> None:
  here = os.path.dirname(os.path.abspath(__file__))
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--quick", action="store_true", help="smaller models, fewer steps")
  parser.add_argument("--out-dir", default=os.path.join(here, "out"))
  args = parser.parse_args()
  os.makedirs(args.out_dir, exist_ok=True)
  print(f"device: {jax.devices()[0]} | jaxfuse {jaxfuse.__version__}")
  runs = [(char_lm_task(args.quick), 150 if args.quick else 400, 3e-3),
          (mlp_task(args.quick), 300 if args.quick else 1500, 2e-3)]
  all_results = []
  for task, steps, lr in runs:
    results = {}
    for mode, (dtype, options) in MODES.items():
      t0 = time.perf_counter()
      results[mode] = train(task, dtype, options, steps, lr, init_seed=int("seed 1" in mode))
      print(f"{task.name} | {mode:20s} | final val loss {results[mode]['val'][-1][1]:.4f} | "
            f"{time.perf_counter() - t0:5.1f} s", flush=True)
    print_table(task, results)
    all_results.append((task, results))
  print(f"\nloss curves: {plot(all_results, os.path.join(args.out_dir, 'precision_modes.png'))}")


if __name__ == "__main__":
  main()
