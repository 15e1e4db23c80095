"""Train-step benchmark: a flax TrainState step with jaxfuse against optax, side by side.

What a flax user runs: ``grads`` from ``jax.value_and_grad`` inside the same jit, then
``state.apply_gradients(grads=grads)``, with the state donated. Per model it times:

  optax            flax TrainState, tx = optax.adamw / optax.chain(clip_by_global_norm, adamw)
  jaxfuse drop-in  flax TrainState, tx = the jaxfuse transforms (tx.update + apply_updates)
  jaxfuse fused    jaxfuse.flax.TrainState (apply_gradients runs jaxfuse.fused_step in place)

Models:
  mlp25m   a 6-layer MLP (2048 wide, 25.2M fp32 params), batch 8, squared error;
  gpt2     the GPT-2-small parameter tree (148 leaves, 124M fp32 params) with a quadratic loss,
           so that the step is mostly optimizer (its gradients are still computed in the jit).

It prints ms/step (wall time per step in a loop of jitted calls), the device time per step (the
kernels' durations from the profiler's trace, GPU only: a step whose wall time is far above it is
host-bound), the speedups over optax, and from jaxfuse.report the bytes each step moves and the
kernels it launches. Usage:

  python3 benchmarks/bench_train_step.py [--quick] [--models mlp25m,gpt2] [--out table.md]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxfuse
from _common import device_ms_per_call, emit_table, gpt2_small_shapes, versions_line

try:
  from flax.training import train_state as flax_train_state
except ImportError:  # flax is an optional extra
  sys.exit("bench_train_step.py needs flax (pip install 'jaxfuse[flax]')")

import jaxfuse.flax as jf_flax  # noqa: E402  (after the flax check)

LR, WD, CLIP = 1e-3, 0.1, 1.0


def mlp_model(width: int, layers: int, batch: int, seed: int = 0):
  """(params, batch, apply_fn, loss_fn) of an MLP with tanh between layers."""
  rng = np.random.default_rng(seed)
  params = {f"layer{i}": {"kernel": jnp.asarray(rng.standard_normal((width, width), np.float32)
                                                / np.sqrt(width)),
                          "bias": jnp.asarray(rng.standard_normal((width,), np.float32) * 0.01)}
            for i in range(layers)}
  data = (jnp.asarray(rng.standard_normal((batch, width), np.float32)),
          jnp.asarray(rng.standard_normal((batch, width), np.float32)))

  def apply_fn(p, x):
    for i in range(layers):
      x = x @ p[f"layer{i}"]["kernel"] + p[f"layer{i}"]["bias"]
      if i < layers - 1:
        x = jnp.tanh(x)
    return x

  def loss_fn(p, batch):
    x, y = batch
    return jnp.mean((apply_fn(p, x) - y) ** 2)

  return params, data, apply_fn, loss_fn


def gpt2_tree_model(batch: int = 4, seed: int = 0):
  """The GPT-2-small tree, each leaf a layer of its own over a batch of `batch` rows: matrices
  y = x @ W, vectors y = x * b, loss the mean of sin(y) over all of them. Its gradients come
  from dots and batch reductions, as a real model's do, so XLA cannot fold their computation
  into the optimizer; the forward and backward passes read each weight once and write each
  gradient once."""
  rng = np.random.default_rng(seed)
  shapes = gpt2_small_shapes()
  params = {f"p{i:03d}": jnp.asarray(rng.standard_normal(s, np.float32) * 0.02)
            for i, s in enumerate(shapes)}
  data = {k: jnp.asarray(rng.standard_normal((batch, v.shape[0]), np.float32))
          for k, v in params.items()}

  def loss_fn(p, x):
    total = 0.0
    for k, w in p.items():
      y = x[k] @ w if w.ndim == 2 else x[k] * w
      total = total + jnp.mean(jnp.sin(y))
    return total

  return params, data, (lambda p, x: x), loss_fn


MODELS = {"mlp25m": lambda quick: mlp_model(512 if quick else 2048, 6, 8),
          "gpt2": lambda quick: gpt2_tree_model()}


def make_step(loss_fn):
  def step(state, batch):
    loss, grads = jax.value_and_grad(loss_fn)(state.params, batch)
    return state.apply_gradients(grads=grads), loss
  return jax.jit(step, donate_argnums=0)


def variants(clip: bool):
  """(name, TrainState class, tx) of the three ways to run one step."""
  def make(mod):
    adamw = mod.adamw(LR, weight_decay=WD)
    return optax.chain(mod.clip_by_global_norm(CLIP), adamw) if clip else adamw

  suffix = "+clip" if clip else ""
  return [(f"optax{suffix}", flax_train_state.TrainState, make(optax)),
          (f"jaxfuse drop-in{suffix}", flax_train_state.TrainState, make(jaxfuse)),
          (f"jaxfuse fused{suffix}", jf_flax.TrainState, make(jaxfuse))]


def time_interleaved(step, states: list, batch, min_time: float, rounds: int = 7):
  """Median ms per step of each state's run, the runs interleaved round by round so that drift
  in the machine's speed (other load, memory placement) falls on all of them alike. The step
  donates its state; returns the times and the last states."""
  one = []
  for i, state in enumerate(states):  # compile + warm up, then one timed step
    for _ in range(2):
      t0 = time.perf_counter()
      state, loss = step(state, batch)
      jax.block_until_ready((state, loss))
    one.append(time.perf_counter() - t0)
    states[i] = state
  iters = int(max(1, min(100, min_time / rounds / max(one))))
  samples = [[] for _ in states]
  for _ in range(rounds):
    for i, state in enumerate(states):
      t0 = time.perf_counter()
      for _ in range(iters):
        state, loss = step(state, batch)
      jax.block_until_ready((state, loss))
      samples[i].append((time.perf_counter() - t0) / iters)
      states[i] = state
  device_ms = []
  for i in range(len(states)):
    def run(calls):
      for _ in range(calls):
        states[i], loss = step(states[i], batch)
      jax.block_until_ready((states[i], loss))
    device_ms.append(device_ms_per_call(run, min(iters, 20)))
  return [1e3 * statistics.median(x) for x in samples], device_ms, states


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--quick", action="store_true", help="small models, short timings")
  parser.add_argument("--models", default="mlp25m,gpt2")
  parser.add_argument("--out", default=None, help="also write the table to this file")
  args = parser.parse_args(argv)
  min_time = 0.5 if args.quick else 6.0
  print(versions_line(), flush=True)
  rows = ["| model | params | leaves | variant | ms/step | device ms/step | vs optax "
          "| device vs optax | bytes moved (report) | XLA kernels | custom calls |",
          "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
  for model in args.models.split(","):
    params, batch, apply_fn, loss_fn = MODELS[model](args.quick)
    n = sum(x.size for x in jax.tree.leaves(params))
    leaves = len(jax.tree.leaves(params))
    step = make_step(loss_fn)
    for clip in (False, True):
      runs = variants(clip)
      states = [cls.create(apply_fn=apply_fn, params=jax.tree.map(jnp.copy, params), tx=tx)
                for _, cls, tx in runs]
      reports = [jaxfuse.report(step, state, batch) for state in states]
      times, device_ms, states = time_interleaved(step, states, batch, min_time)
      del states
      for (name, _, _), ms, dev, rep in zip(runs, times, device_ms, reports):
        device = ("-", "-") if dev is None else (f"{dev:.2f}", f"{device_ms[0] / dev:.2f}x")
        rows.append(f"| {model} | {n / 1e6:.1f}M | {leaves} | {name} | {ms:.2f} | {device[0]} | "
                    f"{times[0] / ms:.2f}x | {device[1]} | {rep.bytes_moved / 1e6:.0f} MB | "
                    f"{rep.xla_kernels} | {rep.custom_calls} |")
        print(rows[-1], flush=True)
  emit_table("\n".join(rows), args.out)


if __name__ == "__main__":
  main()
