"""Prefill benchmark: jaxfuse.prefill's stack against the prefill it replaced, side by side.

  new:  jaxfuse/_decode/prefill.py: one lax.scan over the layers, matrix and attention inputs in the
        model's dtype with fp32 sums, causal attention among the prompt's own tokens;
  old:  jaxfuse.decoder_reference over the prompt (what jaxfuse.prefill ran before): fp32
        activations, the layers unrolled in Python, every token attending over the whole cache.

Two tables: compile time (jit lower + compile) against the number of layers, on a small config;
and time per prefill (best of --repeats, compiled ahead, the two interleaved) on a larger one, batch 1 and 4, with the
prompt tokens per second. The cache is twice the prompt (room to generate as many tokens).

  python benchmarks/bench_prefill.py [--quick] [--out results.md] [--device cpu|gpu]
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp

import jaxfuse
from _common import device_arguments, emit_table
from bench_decoder import log, make_weights, pick_device
from jaxfuse._decode.prefill import prefill_stack

PRESETS = {
    # Compile: small layers, many of them. Speed: layers whose weights leave the caches.
    "cpu": dict(compile_cfg=dict(hidden_size=256, num_heads=8, num_kv_heads=2, head_dim=32,
                                 intermediate_size=704), layers=(2, 4, 8, 16, 32), compile_T=64,
                speed_cfg=dict(num_layers=8, hidden_size=1024, num_heads=16, num_kv_heads=4,
                               head_dim=64, intermediate_size=2816), T=(128, 512), batch=(1, 4)),
    "gpu": dict(compile_cfg=dict(hidden_size=2048, num_heads=32, num_kv_heads=8, head_dim=64,
                                 intermediate_size=8192), layers=(2, 4, 8, 16, 32), compile_T=128,
                speed_cfg=dict(num_layers=16, hidden_size=2048, num_heads=32, num_kv_heads=8,
                               head_dim=64, intermediate_size=8192), T=(512, 2048), batch=(1, 4)),
}


def new_prefill(x, lengths, w, cache, cfg):
  return prefill_stack(x, lengths, w, cache, cfg)


def old_prefill(x, lengths, w, cache, cfg):
  T = x.shape[1]
  t = jnp.arange(T, dtype=jnp.int32)
  positions = jnp.where(t[None, :] < lengths[:, None], t[None, :], -1)
  return jaxfuse.decoder_reference(x, positions, w, cache, cfg)


IMPLEMENTATIONS = {"new": new_prefill, "old": old_prefill}


def inputs(cfg, batch, T, dtype, device):
  w = make_weights(cfg, dtype, device)
  with jax.default_device(device):
    x = jax.random.normal(jax.random.PRNGKey(1), (batch, T, cfg.hidden_size), jnp.float32)
    x = jax.device_put(x.astype(dtype), device)
    cache = jax.device_put(jaxfuse.KVCache(*[jnp.zeros(cfg.cache_shape(batch), dtype)] * 2),
                           device)
    lengths = jax.device_put(jnp.full((batch,), T, jnp.int32), device)
  return x, lengths, w, cache


def compile_seconds(fn, args, cfg):
  t0 = time.perf_counter()
  jax.jit(fn, static_argnums=4).lower(*args, cfg).compile()
  return time.perf_counter() - t0


def best_seconds(compiled: dict, args, repeats):
  """Best time of each compiled function, their runs interleaved (this machine's speed drifts
  between minutes; alternating keeps the comparison fair)."""
  for fn in compiled.values():
    jax.block_until_ready(fn(*args))
  best = dict.fromkeys(compiled, float("inf"))
  for _ in range(repeats):
    for name, fn in compiled.items():
      t0 = time.perf_counter()
      jax.block_until_ready(fn(*args))
      best[name] = min(best[name], time.perf_counter() - t0)
  return best


def compile_table(p, dtype, device):
  rows = ["| layers | new: compile s | old: compile s | old / new |", "|---:|---:|---:|---:|"]
  for L in p["layers"]:
    cfg = jaxfuse.DecoderConfig(num_layers=L, max_seq_len=2 * p["compile_T"], **p["compile_cfg"])
    args = inputs(cfg, 1, p["compile_T"], dtype, device)
    new, old = (compile_seconds(IMPLEMENTATIONS[k], args, cfg) for k in ("new", "old"))
    log(f"compile L={L}: new {new:.2f} s, old {old:.2f} s")
    rows.append(f"| {L} | {new:.2f} | {old:.2f} | {old / new:.1f}x |")
  return "\n".join(rows)


def speed_table(p, dtype, device, repeats):
  rows = ["| batch | prompt | new: ms | old: ms | speedup | new: tokens/s |",
          "|---:|---:|---:|---:|---:|---:|"]
  for T in p["T"]:
    cfg = jaxfuse.DecoderConfig(max_seq_len=2 * T, **p["speed_cfg"])
    for batch in p["batch"]:
      args = inputs(cfg, batch, T, dtype, device)
      compiled = {name: jax.jit(fn, static_argnums=4).lower(*args, cfg).compile()
                  for name, fn in IMPLEMENTATIONS.items()}
      ms = {name: 1e3 * t for name, t in best_seconds(compiled, args, repeats).items()}
      log(f"B={batch} T={T}: new {ms['new']:.1f} ms, old {ms['old']:.1f} ms")
      rows.append(f"| {batch} | {T} | {ms['new']:.1f} | {ms['old']:.1f} | "
                  f"{ms['old'] / ms['new']:.2f}x | {batch * T / ms['new'] * 1e3:,.0f} |")
  return "\n".join(rows)


def main():
  ap = device_arguments(__doc__, "fewer cases (CPU: about 2 minutes)")
  ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
  ap.add_argument("--repeats", type=int, default=3)
  args = ap.parse_args()
  device = pick_device(args.device)
  p = dict(PRESETS["gpu" if device.platform == "gpu" else "cpu"])
  if args.quick:
    p.update(layers=p["layers"][:3], T=p["T"][:1], batch=p["batch"][:1])
  dtype = jnp.dtype(args.dtype)
  title = (f"Prefill on {device.device_kind} ({device.platform}), {dtype.name}, jax "
           f"{jax.__version__}")
  c = p["compile_cfg"]
  s = p["speed_cfg"]
  emit_table(f"{title}\n\nCompile time against depth (D {c['hidden_size']}, prompt "
             f"{p['compile_T']}):\n\n{compile_table(p, dtype, device)}\n\nTime per prefill "
             f"({s['num_layers']} layers x D {s['hidden_size']}, I {s['intermediate_size']}, "
             f"{s['num_heads']}/{s['num_kv_heads']} heads; best of {args.repeats}):\n\n"
             f"{speed_table(p, dtype, device, args.repeats)}", args.out)


if __name__ == "__main__":
  main()
