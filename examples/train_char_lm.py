"""Train a small Llama-style character-level language model with jaxfuse's fused AdamW.

The model is plain JAX (pure functions over a dict of arrays, no flax): RMSNorm, rotary position
embeddings, causal multi-head attention with grouped-query KV heads, a SwiGLU MLP, and an untied
(or, with ``--tie-embeddings``, tied) embedding and LM head. The layer weights are stacked with a
leading layer axis and the forward pass runs ``lax.scan`` over them.

The training text needs no download: it is the Python standard library's own source code, read
as bytes (vocabulary of 256). The optimizer is

    optax.chain(jaxfuse.clip_by_global_norm(1.0),
                jaxfuse.adamw(optax.warmup_cosine_decay_schedule(...), weight_decay=0.1,
                              mask=weight_decay_mask))   # no decay on the RMSNorm gains

applied with ``jaxfuse.fused_step`` inside one jitted train step that donates params and
optimizer state: one global-norm reduction over all gradients, then one multi-tensor AdamW
kernel (clip scale, moments, weight decay and the update folded in) that writes params and
moments in place. The gradient norm comes back as a by-product, and the loop reads it and the
loss from the device only every ``--log-every`` steps.

    python3 examples/train_char_lm.py            # default run: 2-3 minutes on a 2-core CPU
    python3 examples/train_char_lm.py --quick    # ~15-second smoke run

Outputs in ``--out-dir`` (default ``examples/out/``): ``loss.png`` (train/val loss and gradient
norm), ``params.npz`` and ``config.json`` (reload with :func:`load_params`). The functions here
(``build_model_config``, ``init_params``, ``forward``, ``load_corpus``, ``train``, ...) are meant
to be imported by other scripts: ``generate.py`` decodes text from the trained model and
``main.py`` runs training and generation end to end.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
import random
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from optax.contrib import MuonDimensionNumbers

import jaxfuse

Params = dict[str, Any]


# ---------------------------------------------------------------------------------------------
# Model
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  vocab_size: int
  dim: int
  n_layers: int
  n_heads: int
  n_kv_heads: int
  head_dim: int
  hidden_dim: int  # SwiGLU intermediate size
  max_seq_len: int
  rope_theta: float = 10000.0
  norm_eps: float = 1e-5
  tie_embeddings: bool = False


def build_model_config(*, vocab_size: int = 256, dim: int = 128, n_layers: int = 4,
                       n_heads: int = 4, n_kv_heads: int = 2, max_seq_len: int = 128,
                       hidden_dim: int | None = None, tie_embeddings: bool = False,
                       multiple_of: int = 32) -> ModelConfig:
  """A Llama-style config. The SwiGLU width defaults to Llama's rule: 2/3 of 4*dim, rounded up to
  a multiple of `multiple_of`."""
  if dim % n_heads:
    raise ValueError(f"dim={dim} is not divisible by n_heads={n_heads}")
  if n_heads % n_kv_heads:
    raise ValueError(f"n_heads={n_heads} is not divisible by n_kv_heads={n_kv_heads}")
  if hidden_dim is None:
    hidden_dim = multiple_of * math.ceil(int(2 * 4 * dim / 3) / multiple_of)
  return ModelConfig(vocab_size=vocab_size, dim=dim, n_layers=n_layers, n_heads=n_heads,
                     n_kv_heads=n_kv_heads, head_dim=dim // n_heads, hidden_dim=hidden_dim,
                     max_seq_len=max_seq_len, tie_embeddings=tie_embeddings)


def init_params(cfg: ModelConfig, key: jax.Array) -> Params:
  """fp32 params. Layer weights are stacked [n_layers, ...]; matrices act as `x @ w`.

  Weights are N(0, 0.02); the two projections that write into the residual stream (wo, w_down)
  are further scaled by 1/sqrt(2 * n_layers) (GPT-2) so the residual variance does not grow with
  depth. Norm gains start at 1.
  """
  L, D, V, I = cfg.n_layers, cfg.dim, cfg.vocab_size, cfg.hidden_dim
  q_dim, kv_dim = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
  std, out_std = 0.02, 0.02 / math.sqrt(2 * L)
  k = iter(jax.random.split(key, 9))
  normal = lambda shape, s: s * jax.random.normal(next(k), shape, jnp.float32)
  params = {
      "embed": normal((V, D), std),
      "layers": {
          "attn_norm": jnp.ones((L, D), jnp.float32),
          "wq": normal((L, D, q_dim), std),
          "wk": normal((L, D, kv_dim), std),
          "wv": normal((L, D, kv_dim), std),
          "wo": normal((L, q_dim, D), out_std),
          "mlp_norm": jnp.ones((L, D), jnp.float32),
          "w_gate": normal((L, D, I), std),
          "w_up": normal((L, D, I), std),
          "w_down": normal((L, I, D), out_std),
      },
      "final_norm": jnp.ones((D,), jnp.float32),
  }
  if not cfg.tie_embeddings:
    params["lm_head"] = normal((D, V), std)
  return params


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
  return x * lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * weight


def rope_tables(positions: jax.Array, head_dim: int, theta: float) -> tuple[jax.Array, jax.Array]:
  """cos and sin tables [T, head_dim] at integer `positions` [T], for the rotate-half (Llama / HF)
  form of RoPE: frequency i (of head_dim / 2) is theta ** (-2i / head_dim), and dimensions i and
  i + head_dim / 2 form a rotated pair."""
  inv_freq = 1.0 / theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)
  angles = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]          # [T, hd/2]
  angles = jnp.concatenate([angles, angles], axis=-1)                             # [T, hd]
  return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
  """x: [B, T, heads, hd]; cos, sin: [T, hd]. x * cos + rotate_half(x) * sin."""
  x1, x2 = jnp.split(x, 2, axis=-1)
  rotated = jnp.concatenate([-x2, x1], axis=-1)
  return x * cos[:, None, :] + rotated * sin[:, None, :]


def attention(x: jax.Array, lp: Params, cos: jax.Array, sin: jax.Array,
              cfg: ModelConfig) -> jax.Array:
  """Causal grouped-query attention. Query head h reads KV head h // (n_heads // n_kv_heads),
  as Llama's repeat_kv does, without materializing the repeated K and V."""
  B, T, _ = x.shape
  H, KV, hd = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
  G = H // KV
  q = apply_rope((x @ lp["wq"]).reshape(B, T, H, hd), cos, sin)
  k = apply_rope((x @ lp["wk"]).reshape(B, T, KV, hd), cos, sin)
  v = (x @ lp["wv"]).reshape(B, T, KV, hd)
  q = q.reshape(B, T, KV, G, hd)
  scores = jnp.einsum("bqkgd,bskd->bkgqs", q, k) / math.sqrt(hd)  # [B, KV, G, T, T]
  causal = jnp.tril(jnp.ones((T, T), jnp.bool_))
  scores = jnp.where(causal, scores, -jnp.inf)
  probs = jax.nn.softmax(scores, axis=-1)
  out = jnp.einsum("bkgqs,bskd->bqkgd", probs, v).reshape(B, T, H * hd)
  return out @ lp["wo"]


def swiglu_mlp(x: jax.Array, lp: Params) -> jax.Array:
  return (jax.nn.silu(x @ lp["w_gate"]) * (x @ lp["w_up"])) @ lp["w_down"]


def lm_logits(params: Params, x: jax.Array, cfg: ModelConfig) -> jax.Array:
  """Final RMSNorm and LM head: hidden states [..., dim] -> logits [..., vocab_size]."""
  x = rms_norm(x, params["final_norm"], cfg.norm_eps)
  head = params["embed"].T if cfg.tie_embeddings else params["lm_head"]
  return x @ head


def forward(params: Params, tokens: jax.Array, cfg: ModelConfig) -> jax.Array:
  """tokens: int [B, T] -> logits fp32 [B, T, vocab_size].

  Each layer is exactly the math of jaxfuse's decoder step (see jaxfuse/_decode/decoder.py), applied
  causally to all T positions at once, so the trained ``params["layers"]`` are a
  ``jaxfuse.DecoderWeights`` as they are (generate.py decodes with them).
  """
  cos, sin = rope_tables(jnp.arange(tokens.shape[1]), cfg.head_dim, cfg.rope_theta)
  x = params["embed"][tokens]

  def layer(x, lp):  # lp: one layer's slice of params["layers"]
    x = x + attention(rms_norm(x, lp["attn_norm"], cfg.norm_eps), lp, cos, sin, cfg)
    x = x + swiglu_mlp(rms_norm(x, lp["mlp_norm"], cfg.norm_eps), lp)
    return x, None

  x, _ = lax.scan(layer, x, params["layers"])
  return lm_logits(params, x, cfg)


def loss_fn(params: Params, batch: jax.Array, cfg: ModelConfig) -> jax.Array:
  """Mean next-token cross-entropy (nats) of a batch of windows [B, T + 1]."""
  inputs, targets = batch[:, :-1], batch[:, 1:]
  logits = forward(params, inputs, cfg)
  return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


def count_params(params: Params) -> int:
  return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))


def weight_decay_mask(params: Params) -> Params:
  """True where AdamW's decoupled weight decay applies: every matrix (embeddings included), not
  the RMSNorm gains. (The model has no biases; they would be excluded the same way.)"""
  return jax.tree_util.tree_map_with_path(
      lambda path, _: not path[-1].key.endswith(("norm", "bias")), params)


# ---------------------------------------------------------------------------------------------
# Data
# ---------------------------------------------------------------------------------------------


def load_corpus(max_bytes: int = 4 << 20, seed: int = 0) -> bytes:
  """Python standard library source code as one byte string, at most `max_bytes` long.

  The .py files under the stdlib directory (site-packages excluded) are listed in sorted order,
  shuffled with a fixed seed (so a capped corpus mixes many modules rather than the first few
  alphabetically) and concatenated, each preceded by a header line with its path. The result
  depends only on the Python installation and `seed`.
  """
  root = os.path.dirname(os.__file__)
  skip = {"site-packages", "dist-packages", "__pycache__"}
  paths = []
  for dirpath, dirnames, filenames in os.walk(root):
    dirnames[:] = sorted(d for d in dirnames if d not in skip)
    paths += [os.path.join(dirpath, f) for f in sorted(filenames) if f.endswith(".py")]
  random.Random(seed).shuffle(paths)
  chunks, total = [], 0
  for path in paths:
    with open(path, "rb") as f:
      text = f.read()
    chunk = b"# file: " + os.path.relpath(path, root).encode() + b"\n" + text + b"\n"
    chunks.append(chunk[: max_bytes - total])
    total += len(chunks[-1])
    if total >= max_bytes:
      break
  return b"".join(chunks)


def sample_batch(data: jax.Array, key: jax.Array, batch: int, seq_len: int) -> jax.Array:
  """`batch` random windows of seq_len + 1 bytes from the device-resident corpus, as int32."""
  starts = jax.random.randint(key, (batch,), 0, data.shape[0] - seq_len)  # last start: N-T-1
  idx = starts[:, None] + jnp.arange(seq_len + 1)
  return data[idx].astype(jnp.int32)


def eval_batches(val: np.ndarray, batch: int, seq_len: int, max_batches: int) -> list[np.ndarray]:
  """Fixed validation windows [batch, seq_len + 1], spread evenly over the whole split (the
  split's files differ a lot: code, tests, codec tables), at most `max_batches` batches."""
  n = min((len(val) - 1) // seq_len, batch * max_batches) // batch * batch
  starts = np.linspace(0, len(val) - seq_len - 1, n).astype(np.int64)
  windows = val[starts[:, None] + np.arange(seq_len + 1)].astype(np.int32)
  return [windows[i: i + batch] for i in range(0, n, batch)]


# ---------------------------------------------------------------------------------------------
# Training
# ---------------------------------------------------------------------------------------------


def muon_dimension_numbers(params: Params) -> Params:
  """Muon's matrices: the layers' stacked [n_layers, in, out] weights, each layer's matrix
  orthogonalized on its own (the layer axis is a batch axis); None (AdamW) for the embedding,
  the LM head and the norm gains, as Muon's authors train them. (optax also calls this on trees
  whose other group's leaves are masked out: it reads only shapes.)"""
  layer_matrix = MuonDimensionNumbers(reduction_axis=1, output_axis=2)
  return {k: jax.tree.map(lambda x: layer_matrix if len(getattr(x, "shape", ())) == 3 else None,
                          v) if k == "layers" else None for k, v in params.items()}


def make_optimizer(lr: float, steps: int, warmup: int, weight_decay: float = 0.1,
                   optimizer: str = "adamw"):
  """Global-norm clipping at 1.0, then AdamW (or Muon for the layers' matrices, AdamW for the
  rest) with linear warmup and cosine decay to lr / 10. Muon's updates are scaled to AdamW's
  RMS (consistent_rms=0.2, Liu et al., 2025), so one learning rate serves both groups.
  Returns (tx, schedule)."""
  schedule = optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=lr, warmup_steps=warmup, decay_steps=steps, end_value=lr / 10)
  if optimizer == "muon":
    inner = jaxfuse.muon(schedule, weight_decay=weight_decay, adam_b2=0.95, consistent_rms=0.2,
                         muon_weight_dimension_numbers=muon_dimension_numbers)
  else:
    inner = jaxfuse.adamw(schedule, b1=0.9, b2=0.95, weight_decay=weight_decay,
                          mask=weight_decay_mask)
  return optax.chain(jaxfuse.clip_by_global_norm(1.0), inner), schedule


def split_corpus(corpus: bytes, batch: int, seq_len: int, eval_max_batches: int,
                 val_fraction: float, device: jax.Device):
  """Holds out the tail of the corpus for validation. The training split lives on the device and
  batches are sampled there, so a step needs nothing from the host."""
  data = np.frombuffer(corpus, np.uint8)
  n_val = int(len(data) * val_fraction)
  train_data = jax.device_put(data[:-n_val], device)
  val_sets = [jax.device_put(b, device)
              for b in eval_batches(data[-n_val:], batch, seq_len, eval_max_batches)]
  return train_data, val_sets


def make_train_step(cfg: ModelConfig, tx, batch: int, seq_len: int):
  """The whole step as one jitted function: sample a batch, forward + backward, then clipping
  and AdamW through fused_step. params and opt_state are donated, so fused_step's kernels update
  them in place; the global gradient norm is a by-product of the clip."""

  @functools.partial(jax.jit, donate_argnums=(0, 1))
  def train_step(params, opt_state, rng, data):
    rng, key = jax.random.split(rng)
    tokens = sample_batch(data, key, batch, seq_len)
    loss, grads = jax.value_and_grad(loss_fn)(params, tokens, cfg)
    params, opt_state, grad_norm = jaxfuse.fused_step(tx, grads, opt_state, params,
                                                      return_grad_norm=True)
    return params, opt_state, rng, loss, grad_norm

  return train_step


def record_steps(history: dict[str, Any], pending: list, step: int, lrs: np.ndarray) -> str:
  """Reads the queued (loss, grad_norm) device scalars of the steps up to `step` into history
  (the loop's only host sync: it waits for every step so far); returns the log line's start."""
  values = np.asarray(jax.device_get(pending))  # [n, 2]: loss, grad_norm
  first = step - len(pending) + 1
  history["step"] += list(range(first, step + 1))
  history["loss"] += values[:, 0].tolist()
  history["grad_norm"] += values[:, 1].tolist()
  history["lr"] += lrs[first - 1: step].tolist()
  return (f"step {step:5d} | loss {values[:, 0].mean():.4f} | "
          f"grad norm {values[:, 1].mean():6.3f} | lr {lrs[step - 1]:.2e}")


def train(cfg: ModelConfig, corpus: bytes, *, steps: int, batch: int, seq_len: int,
          lr: float = 3e-3, warmup: int | None = None, log_every: int = 25,
          eval_every: int | None = None, eval_max_batches: int = 16, val_fraction: float = 0.05,
          seed: int = 0, device: jax.Device | None = None,
          optimizer: str = "adamw") -> tuple[Params, dict[str, Any]]:
  """Trains from scratch with `optimizer` ("adamw" or "muon": make_optimizer); returns (params,
  history).

  history holds, for every step, "step", "loss" and "grad_norm" (computed in that step, before
  its update) and "lr" (used by its update); "val_step"/"val_loss" (after that many updates;
  step 0 is the initial model); and the timings "compile_s", "ms_per_step", "tokens_per_s"
  (steady state: the first, compiling step excluded, evaluation excluded).
  """
  if seq_len > cfg.max_seq_len:
    raise ValueError(f"seq_len={seq_len} exceeds max_seq_len={cfg.max_seq_len}")
  device = device or jax.devices()[0]
  warmup = warmup if warmup is not None else max(1, steps // 10)
  # By default, evaluate about eight times, at log steps (evaluation syncs with the host anyway).
  eval_every = eval_every or log_every * max(1, round(steps / 8 / log_every))
  train_data, val_sets = split_corpus(corpus, batch, seq_len, eval_max_batches, val_fraction,
                                      device)
  tx, schedule = make_optimizer(lr, steps, warmup, optimizer=optimizer)
  lrs = np.asarray(jax.jit(jax.vmap(schedule))(jnp.arange(steps)))  # step s uses lrs[s - 1]
  # Commit everything the step takes to the device: an uncommitted input (tx.init's step count
  # is one) would make the second call compile again for the committed outputs of the first.
  params = jax.device_put(init_params(cfg, jax.random.key(seed)), device)
  opt_state = jax.device_put(tx.init(params), device)
  rng = jax.device_put(jax.random.key(seed + 1), device)
  train_step = make_train_step(cfg, tx, batch, seq_len)
  eval_loss = jax.jit(functools.partial(loss_fn, cfg=cfg))
  evaluate = lambda p: float(np.mean(jax.device_get([eval_loss(p, b) for b in val_sets])))

  history: dict[str, Any] = {"step": [], "loss": [], "grad_norm": [], "lr": [],
                             "val_step": [0], "val_loss": [evaluate(params)]}
  print(f"step {0:5d} | val loss {history['val_loss'][0]:.4f}", flush=True)
  pending: list[tuple[jax.Array, jax.Array]] = []  # (loss, grad_norm) device scalars, unread
  next_eval, timed_steps, timed_s = eval_every, 0, 0.0
  t0 = time.perf_counter()
  for step in range(1, steps + 1):
    params, opt_state, rng, loss, grad_norm = train_step(params, opt_state, rng, train_data)
    pending.append((loss, grad_norm))
    if step == 1:  # the first call compiles: time it alone, start the steady-state clock after
      jax.block_until_ready(loss)
      history["compile_s"] = time.perf_counter() - t0
      window_start, window_steps = time.perf_counter(), 0
    else:
      window_steps += 1
    if step % log_every and step != steps:
      continue
    msg = record_steps(history, pending, step, lrs)
    window_s, pending = time.perf_counter() - window_start, []
    if window_steps:
      timed_steps, timed_s = timed_steps + window_steps, timed_s + window_s
      ms = 1e3 * window_s / window_steps
      msg += f" | {ms:6.1f} ms/step | {1e3 * batch * seq_len / ms:8.0f} tok/s"
    if step >= next_eval or step == steps:
      history["val_step"].append(step)
      history["val_loss"].append(evaluate(params))
      msg += f" | val loss {history['val_loss'][-1]:.4f}"
      next_eval += eval_every * (1 + (step - next_eval) // eval_every)
    print(msg, flush=True)
    window_start, window_steps = time.perf_counter(), 0  # evaluation time is not counted

  history["ms_per_step"] = 1e3 * timed_s / max(1, timed_steps)
  history["tokens_per_s"] = batch * seq_len * timed_steps / max(timed_s, 1e-9)
  return params, history


# ---------------------------------------------------------------------------------------------
# Outputs
# ---------------------------------------------------------------------------------------------


def save_params(params: Params, cfg: ModelConfig, out_dir: str) -> str:
  """Writes params.npz (keys like "layers/wq") and config.json; returns the .npz path."""
  os.makedirs(out_dir, exist_ok=True)
  flat = {jax.tree_util.keystr(path, simple=True, separator="/"): np.asarray(x)
          for path, x in jax.tree_util.tree_flatten_with_path(params)[0]}
  path = os.path.join(out_dir, "params.npz")
  np.savez(path, **flat)
  with open(os.path.join(out_dir, "config.json"), "w") as f:
    json.dump(dataclasses.asdict(cfg), f, indent=2)
  return path


def load_params(out_dir: str) -> tuple[Params, ModelConfig]:
  """Reads what save_params wrote: (params as numpy arrays, config)."""
  with open(os.path.join(out_dir, "config.json")) as f:
    cfg = ModelConfig(**json.load(f))
  params: Params = {}
  with np.load(os.path.join(out_dir, "params.npz")) as npz:
    for name in npz.files:
      *parents, leaf = name.split("/")
      node = params
      for p in parents:
        node = node.setdefault(p, {})
      node[leaf] = npz[name]
  return params, cfg


def plot_history(history: dict[str, Any], path: str, title: str = "") -> str:
  """Loss (train per step, its moving average, validation points) over gradient norm and lr."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  steps = np.asarray(history["step"])
  loss = np.asarray(history["loss"])
  k = max(1, len(loss) // 50)  # moving-average window
  smooth = np.convolve(loss, np.ones(k) / k, mode="valid")

  fig, (ax_loss, ax_norm) = plt.subplots(2, 1, figsize=(9, 7), sharex=True,
                                         gridspec_kw={"height_ratios": [2, 1]})
  ax_loss.plot(steps, loss, color="tab:blue", alpha=0.25, lw=0.8, label="train (per step)")
  ax_loss.plot(steps[k - 1:], smooth, color="tab:blue", lw=1.8, label=f"train ({k}-step mean)")
  ax_loss.plot(history["val_step"], history["val_loss"], "o-", color="tab:red", ms=5,
               label="validation")
  ax_loss.set_ylabel("cross-entropy (nats / byte)")
  ax_loss.grid(alpha=0.3)
  ax_loss.legend()
  if title:
    ax_loss.set_title(title, fontsize=10)

  ax_norm.plot(steps, history["grad_norm"], color="tab:green", lw=0.8, label="grad norm")
  ax_norm.axhline(1.0, color="tab:green", ls="--", lw=0.8, alpha=0.6, label="clip threshold")
  ax_norm.set_yscale("log")
  ax_norm.set_ylabel("global grad norm")
  ax_norm.set_xlabel("step")
  ax_norm.grid(alpha=0.3)
  ax_lr = ax_norm.twinx()
  ax_lr.plot(steps, history["lr"], color="tab:gray", ls=":", lw=1.2, label="learning rate")
  ax_lr.set_ylabel("learning rate")
  lines = ax_norm.get_lines()[:2] + ax_lr.get_lines()
  ax_norm.legend(lines, [l.get_label() for l in lines], loc="upper right")

  fig.tight_layout()
  os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return path


# ---------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------

# Sizes for the default run (2-3 minutes on a 2-core CPU: ~140-250 ms/step; train loss 5.6 -> 1.5)
# and for --quick (~15 seconds). Flags given on the command line override either preset.
PRESETS = {
    "default": dict(steps=700, batch=16, seq_len=128, layers=4, dim=128, heads=4, kv_heads=2,
                    log_every=25),
    "quick": dict(steps=200, batch=16, seq_len=64, layers=2, dim=64, heads=4, kv_heads=2,
                  log_every=20),
}


def main() -> None:
  here = os.path.dirname(os.path.abspath(__file__))
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--quick", action="store_true", help="~15-second smoke run")
  preset_flags = {"steps": "optimizer steps", "batch": "sequences per batch",
                  "seq_len": "bytes per sequence", "layers": "decoder layers",
                  "dim": "model width", "heads": "query heads",
                  "kv_heads": "key/value heads (divides --heads)",
                  "log_every": "steps between log lines (loss and grad-norm reads)"}
  for name, what in preset_flags.items():
    parser.add_argument("--" + name.replace("_", "-"), type=int,
                        help=f"{what} (default {PRESETS['default'][name]}, "
                             f"--quick {PRESETS['quick'][name]})")
  parser.add_argument("--eval-every", type=int,
                      help="steps between validation evals (default: about steps / 8)")
  parser.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (3e-3)")
  parser.add_argument("--optimizer", choices=["adamw", "muon"], default="adamw",
                      help="jaxfuse.adamw, or jaxfuse.muon for the layers' matrices (adamw)")
  parser.add_argument("--tie-embeddings", action="store_true",
                      help="use embed.T as the LM head instead of a separate lm_head")
  parser.add_argument("--corpus-mb", type=float, default=4.0, help="corpus size cap in MiB (4)")
  parser.add_argument("--seed", type=int, default=0, help="init, sampling and corpus seed (0)")
  parser.add_argument("--out-dir", default=os.path.join(here, "out"),
                      help="where loss.png, params.npz and config.json go (examples/out)")
  args = parser.parse_args()
  for name, value in PRESETS["quick" if args.quick else "default"].items():
    if getattr(args, name) is None:
      setattr(args, name, value)

  device = jax.devices()[0]
  print(f"device: {device} ({device.platform}, {device.device_kind})")
  print(f"jaxfuse {jaxfuse.__version__} backends: {jaxfuse.backends()}")

  corpus = load_corpus(int(args.corpus_mb * (1 << 20)), seed=args.seed)
  print(f"corpus: {len(corpus) / 2**20:.2f} MiB of Python stdlib source "
        f"({os.path.dirname(os.__file__)}), byte-level vocab 256")

  cfg = build_model_config(vocab_size=256, dim=args.dim, n_layers=args.layers,
                           n_heads=args.heads, n_kv_heads=args.kv_heads,
                           max_seq_len=args.seq_len, tie_embeddings=args.tie_embeddings)
  n_params = count_params(jax.eval_shape(functools.partial(init_params, cfg), jax.random.key(0)))
  print(f"model: {cfg}")
  print(f"params: {n_params / 1e6:.2f} M fp32 | steps {args.steps} | batch {args.batch} x "
        f"seq {args.seq_len} = {args.batch * args.seq_len} tokens/step | peak lr {args.lr}")

  t0 = time.perf_counter()
  params, history = train(cfg, corpus, steps=args.steps, batch=args.batch,
                          seq_len=args.seq_len, lr=args.lr, log_every=args.log_every,
                          eval_every=args.eval_every, seed=args.seed, device=device,
                          optimizer=args.optimizer)
  total_s = time.perf_counter() - t0

  print(f"done in {total_s:.1f} s (first step, with compilation: {history['compile_s']:.1f} s)")
  print(f"steady state: {history['ms_per_step']:.1f} ms/step, "
        f"{history['tokens_per_s']:.0f} tokens/s")
  print(f"train loss {history['loss'][0]:.3f} -> {np.mean(history['loss'][-args.log_every:]):.3f}"
        f" (mean of last {args.log_every} steps); val loss {history['val_loss'][0]:.3f} -> "
        f"{history['val_loss'][-1]:.3f}")
  title = (f"char LM on Python stdlib: {n_params / 1e6:.2f}M params, L={cfg.n_layers} "
           f"D={cfg.dim} H={cfg.n_heads} KV={cfg.n_kv_heads}, {args.batch}x{args.seq_len} "
           f"tokens/step, jaxfuse {args.optimizer} on {device.platform}")
  print(f"loss plot: {plot_history(history, os.path.join(args.out_dir, 'loss.png'), title)}")
  print(f"params:    {save_params(params, cfg, args.out_dir)}")


if __name__ == "__main__":
  main()
