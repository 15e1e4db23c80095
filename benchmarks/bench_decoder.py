"""Decode-step benchmark: jaxfuse.persistent_decoder vs a plain-JAX decoder, side by side.

Both run under jax.jit with the KV cache donated (updated in place), one token per batch row per
step, every row at position context-1 (so each step reads `context` cache positions per layer).
Two plain-JAX baselines are timed, and the speedup is against the faster of them:
  plain-bf16: jaxfuse.decoder_reference(activation_dtype=bf16): GEMV inputs in the storage dtype,
              fp32 accumulation (how a JAX decoder is usually written);
  plain-f32:  jaxfuse.decoder_reference(): fp32 activations like the kernel (XLA converts the
              weights to fp32 inside the step).

On a GPU: Llama-3.2-1B layer shapes (16 layers, D 2048, 32 heads, 8 kv heads, hd 64, I 8192, bf16),
batch 1/4/16, context 1k/4k/16k. On CPU a small config, batch 1/4/8/16, context 128/512
(`--quick`: fewer cases and steps). `--long-context`: batch 1 at contexts 128 to 8k on the CPU,
1k to 32k on a GPU, the time per token against the length of the cache it reads.

`--quantized`: the same bf16 model with int8 and fp8 (e4m3) matrices (jaxfuse.quantize_weights),
side by side, on weights larger than the caches (CPU: 8 x D2048, 16/4 heads, hd 128, I 6144,
0.77 GB in bf16; GPU: the Llama-3.2-1B layers), batch 1 and 4 at a short context, so the step is
bound by the weight bytes: ms/token, the speedup over bf16, and the fraction of the copy rate and
of XLA's own read rate (a sum over a bf16 array) on the bytes each step actually reads (its
weights, scales included, and the cache rows), all timed in interleaved rounds. Also the
LM head alone in XLA (Llama-3.2-1B's 128256 x 2048, outside the decoder): bf16, and int8 widened
by XLA before its dot, which is what quantizing the head would give without a fused kernel.

Bytes moved per step = all layer weights + the K and V cache read (B * context * kv_dim * 2 per
layer); effective GB/s = bytes / time; "% copy" compares with a device copy measured here (read +
write of a large array with jnp). Kernels per step come from jaxfuse.report (on the CPU a jaxfuse
call is one XLA thunk; on a GPU the report counts the decoder's one cooperative launch).

  python benchmarks/bench_decoder.py [--quick] [--out results.md] [--device cpu|gpu]
"""

from __future__ import annotations

import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import jaxfuse
from _common import copy_bandwidth, device_arguments, emit_table, read_bandwidth
from jaxfuse import DecoderConfig, DecoderWeights, KVCache, decoder_reference, persistent_decoder


def log(*a):
  print(*a, file=sys.stderr, flush=True)


def pick_device(name):
  if name:
    return jax.devices(name)[0]
  try:
    if jaxfuse.backends()["cuda"]["usable"]:
      return jax.devices("gpu")[0]
  except RuntimeError:
    pass
  return jax.devices("cpu")[0]


def make_weights(cfg, dtype, device, seed=0):
  shapes = cfg.weight_shapes()
  keys = jax.random.split(jax.random.PRNGKey(seed), len(shapes))

  @jax.jit
  def init():
    out = {}
    for k, (name, shape) in zip(keys, shapes.items()):
      if "norm" in name:
        a = 1.0 + 0.1 * jax.random.normal(k, shape, jnp.float32)
      else:
        a = jax.random.normal(k, shape, jnp.float32) / np.sqrt(shape[1])
      out[name] = a.astype(dtype)
    return DecoderWeights(**out)

  # Committed to the device like every other argument (committed-ness is part of jit's cache key).
  with jax.default_device(device):
    return jax.block_until_ready(jax.device_put(init(), device))


def time_steps(step, x, pos, w, cache, steps, warmup):
  for _ in range(warmup):
    x2, cache = step(x, pos, w, cache)
  jax.block_until_ready((x2, cache))
  t0 = time.perf_counter()
  for _ in range(steps):
    x2, cache = step(x, pos, w, cache)
  jax.block_until_ready((x2, cache))
  return (time.perf_counter() - t0) / steps, cache


# Llama-3.2-1B's layer shapes, what the GPU runs.
LLAMA_1B_LAYERS = dict(num_layers=16, hidden_size=2048, num_heads=32, num_kv_heads=8, head_dim=64,
                       intermediate_size=8192)


def plan(args, on_gpu):
  """What to measure on this device: shapes, batches, contexts, steps, copy-reference size."""
  if on_gpu:
    p = dict(base=LLAMA_1B_LAYERS,
             batches=[1, 4, 16], contexts=[1024, 4096, 16384], steps=args.steps or 50, warmup=5,
             title="Llama-3.2-1B layer shapes (16 x D2048, 32/8 heads, hd 64, I 8192), bf16",
             copy_bytes=1 << 30, copy_reps=10)
    if args.quick:  # tools/gpu_check.sh quick: issue 40's batch rows at context 1k
      p.update(batches=[1, 4, 16], contexts=[1024], steps=args.steps or 20)
    if args.long_context:
      p.update(batches=[1], contexts=[1024, 4096, 16384, 32768])
    return p
  p = dict(base=dict(num_layers=4, hidden_size=512, num_heads=8, num_kv_heads=2, head_dim=64,
                     intermediate_size=1536),
           batches=[1, 16] if args.quick else [1, 4, 8, 16],
           contexts=[128] if args.quick else [128, 512],
           steps=args.steps or (3 if args.quick else 8), warmup=2,
           title="small config (4 x D512, 8/2 heads, hd 64, I 1536), bf16",
           copy_bytes=1 << 28, copy_reps=5)
  if args.long_context:
    p.update(batches=[1], contexts=[128, 256, 512, 1024, 2048, 4096, 8192])
  return p


def measure_case(cfg, w, B, ctx, dtype, device, steps, warmup, copy_gbs):
  """One (batch, context) case: jaxfuse and both plain-JAX baselines, cache donated; a row."""
  fused = jax.jit(lambda x, p, w, c: persistent_decoder(x, p, w, c, cfg), donate_argnums=(3,))
  plain16 = jax.jit(lambda x, p, w, c: decoder_reference(x, p, w, c, cfg, activation_dtype=dtype),
                    donate_argnums=(3,))
  plain32 = jax.jit(lambda x, p, w, c: decoder_reference(x, p, w, c, cfg), donate_argnums=(3,))
  rng = np.random.default_rng(B)
  x = jax.device_put(jnp.asarray(rng.standard_normal((B, cfg.hidden_size)), dtype), device)
  pos = jax.device_put(np.full((B,), ctx - 1, np.int32), device)

  def fresh_cache():
    with jax.default_device(device):
      k = jax.random.normal(jax.random.PRNGKey(1), cfg.cache_shape(B), jnp.float32).astype(dtype)
      return jax.device_put(KVCache(k, k * 0.5), device)

  times = {}
  for name, fn in (("jaxfuse", fused), ("plain-bf16", plain16), ("plain-f32", plain32)):
    times[name], c = time_steps(fn, x, pos, w, fresh_cache(), steps, warmup)
    del c
    log(f"  {name:10s} {times[name] * 1e3:8.3f} ms/step")
  t_fused, t_plain = times["jaxfuse"], min(times["plain-bf16"], times["plain-f32"])
  # Kernels launched per step (jaxfuse.report; compiled, not run: the cache is abstract).
  cache = KVCache(*[jax.ShapeDtypeStruct(cfg.cache_shape(B), dtype)] * 2)
  launches = [jaxfuse.report(fn, x, pos, w, cache).launches for fn in (fused, plain16)]
  weight_bytes = sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(w))
  kv_bytes = cfg.num_layers * B * ctx * cfg.kv_dim * 2 * jnp.dtype(dtype).itemsize
  moved = weight_bytes + kv_bytes
  gbs = moved / t_fused / 1e9
  return (B, ctx, t_fused * 1e3, times["plain-bf16"] * 1e3, times["plain-f32"] * 1e3,
          t_plain / t_fused, B / t_fused, moved / 1e9, gbs, 100 * gbs / copy_gbs,
          moved / t_plain / 1e9, *launches)


def quantized_plan(args, on_gpu):
  if on_gpu:
    title = "Llama-3.2-1B layer shapes (16 x D2048, 32/8 heads, hd 64, I 8192)"
    return dict(base=LLAMA_1B_LAYERS, title=title, context=1024,
                steps=args.steps or (20 if args.quick else 50), warmup=5,
                rounds=2 if args.quick else 5, bandwidth_bytes=1 << 30)
  base = dict(num_layers=8, hidden_size=2048, num_heads=16, num_kv_heads=4, head_dim=128,
              intermediate_size=6144)
  title = "8 x D2048, 16/4 heads, hd 128, I 6144 (0.77 GB of bf16 weights)"
  return dict(base=base, title=title, context=128, steps=args.steps or (4 if args.quick else 5),
              warmup=2, rounds=3 if args.quick else 7, bandwidth_bytes=1 << 30)


def median(values):
  return float(np.median(values))


def measure_quantized(p, device):
  """bf16, int8 and fp8 matrices of one model (quantized_plan `p`), batch 1 and 4, timed in
  interleaved rounds with the copy and read references (the machine's bandwidth drifts; each is
  the median of its rounds). Returns the rows of the quantized table and the two references."""
  cfg = DecoderConfig(**p["base"], max_seq_len=p["context"])
  log("initializing bf16 weights ...")
  weights = {"bf16": (make_weights(cfg, jnp.bfloat16, device), cfg)}
  for fmt in ("int8", "fp8"):
    log(f"quantizing to {fmt} ...")
    weights[fmt] = jax.block_until_ready(jaxfuse.quantize_weights(weights["bf16"][0], cfg, fmt))
  cases = {}  # (B, fmt) -> [step function, its arguments, the cache it updates, bytes read]
  for B in (1, 4):
    for fmt, (w, qcfg) in weights.items():
      fused = jax.jit(lambda x, p, w, c, cfg=qcfg: persistent_decoder(x, p, w, c, cfg),
                      donate_argnums=(3,))
      x = jax.device_put(jnp.ones((B, cfg.hidden_size), jnp.bfloat16), device)
      pos = jax.device_put(np.full((B,), p["context"] - 1, np.int32), device)
      weight_bytes = sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(w))
      read = weight_bytes + cfg.num_layers * B * p["context"] * cfg.kv_dim * 2 * 2
      cases[B, fmt] = [fused, (x, pos, w), fresh_cache(cfg, B, device), read, weight_bytes]
  copies, reads, times = [], [], {key: [] for key in cases}
  for r in range(p["rounds"]):
    copies.append(copy_bandwidth(device, p["bandwidth_bytes"], 3))
    reads.append(read_bandwidth(device, p["bandwidth_bytes"], 3))
    for key, case in cases.items():
      fused, (x, pos, w), cache = case[:3]
      t, case[2] = time_steps(fused, x, pos, w, cache, p["steps"], p["warmup"])
      times[key].append(t)
    log(f"  round {r + 1}/{p['rounds']}: copy {copies[-1]:.1f} GB/s, read {reads[-1]:.1f} GB/s, "
        + ", ".join(f"B{B} {fmt} {times[B, fmt][-1] * 1e3:.2f} ms" for B, fmt in cases))
  copy_gbs, read_gbs = median(copies), median(reads)
  rows = []
  for (B, fmt), (_, (x, pos, w), _, read, weight_bytes) in cases.items():
    t = median(times[B, fmt])
    t_plain, _ = time_steps(jax.jit(lambda x, p, w, c, cfg=weights[fmt][1]: decoder_reference(
        x, p, w, c, cfg, activation_dtype=jnp.bfloat16), donate_argnums=(3,)),
        x, pos, w, fresh_cache(cfg, B, device), 3, 1)
    log(f"  batch {B} {fmt:5s} jaxfuse {t * 1e3:8.2f} ms  plain {t_plain * 1e3:8.2f} ms")
    rows.append((B, fmt, weight_bytes / 1e9, t * 1e3, median(times[B, "bf16"]) / t, read / t / 1e9,
                 100 * read / t / 1e9 / copy_gbs, 100 * read / t / 1e9 / read_gbs,
                 t_plain * 1e3, t_plain / t))
  return rows, copy_gbs, read_gbs


def fresh_cache(cfg, B, device):
  return jax.device_put(KVCache(*(jnp.full(cfg.cache_shape(B), v, jnp.bfloat16)
                                  for v in (0.5, 1.0))), device)


def measure_head(device, steps):
  """The LM head of Llama-3.2-1B (128256 x 2048) in XLA at batch 1: bf16 and int8 (per-row
  scales, widened to bf16 by XLA before the dot). Returns ms per call of each."""
  V, D = 128256, 2048
  head = jax.device_put(jax.random.normal(jax.random.PRNGKey(3), (V, D), jnp.bfloat16), device)
  q, scale = jaxfuse._decode.quantize.quantize_matrix(head.T[None], "int8")
  q, scale = jax.device_put((q[0].T, scale[0]), device)  # [V, D] int8, [V]
  h = jax.device_put(jnp.ones((1, D), jnp.bfloat16), device)
  bf16 = jax.jit(lambda h, w: jnp.einsum("bd,vd->bv", h, w, preferred_element_type=jnp.float32))
  int8 = jax.jit(lambda h, w, s: jnp.einsum("bd,vd->bv", h, w.astype(jnp.bfloat16),
                                            preferred_element_type=jnp.float32) * s)
  out = {}
  for name, fn, args in (("bf16", bf16, (h, head)), ("int8", int8, (h, q, scale))):
    jax.block_until_ready(fn(*args))
    t0 = time.perf_counter()
    for _ in range(steps):
      r = fn(*args)
    jax.block_until_ready(r)
    out[name] = (time.perf_counter() - t0) / steps * 1e3
  return out


def quantized_table(rows, p, head, device, copy_gbs, read_gbs):
  lines = [
      f"### persistent decoder with int8 / fp8 weights, {p['title']}",
      f"device: {device.device_kind} ({device.platform}); medians of {p['rounds']} interleaved "
      f"rounds of {p['steps']} steps, with the references measured in each round: copy "
      f"(x + 1, read + write) {copy_gbs:.1f} GB/s, XLA read (a bf16 sum) {read_gbs:.1f} GB/s; "
      f"context {p['context']}; bf16 activations and cache; plain: "
      f"decoder_reference(activation_dtype=bf16) on the same weights under jit",
      "",
      "| batch | matrices | weight GB | jaxfuse ms/token | vs bf16 | GB/s read | % of copy BW | "
      "% of XLA read | plain ms/token | jaxfuse vs plain |",
      "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
  ]
  for r in rows:
    lines.append(f"| {r[0]} | {r[1]} | {r[2]:.3f} | {r[3]:.2f} | {r[4]:.2f}x | {r[5]:.1f} | "
                 f"{r[6]:.0f}% | {r[7]:.0f}% | {r[8]:.2f} | {r[9]:.2f}x |")
  lines += ["", f"LM head alone in XLA (128256 x 2048, batch 1): bf16 {head['bf16']:.2f} ms, int8 "
            f"widened by XLA {head['int8']:.2f} ms ({head['bf16'] / head['int8']:.2f}x)"]
  return "\n".join(lines)


def table(rows, title, device, copy_gbs, steps):
  lines = [
      f"### persistent decoder, {title}",
      f"device: {device.device_kind} ({device.platform}); copy bandwidth measured here: "
      f"{copy_gbs:.1f} GB/s; baselines: decoder_reference under jit with bf16 / fp32 activations; "
      f"speedup vs the faster baseline; cache donated everywhere; {steps} timed steps",
      "",
      "| batch | context | jaxfuse ms/step | plain-bf16 ms/step | plain-f32 ms/step | speedup | "
      "tokens/s | GB moved | jaxfuse GB/s | % of copy BW | best plain GB/s | "
      "kernels/step jaxfuse / plain-bf16 |",
      "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
  ]
  for r in rows:
    lines.append(f"| {r[0]} | {r[1]} | {r[2]:.3f} | {r[3]:.3f} | {r[4]:.3f} | {r[5]:.2f}x | {r[6]:.0f} | "
                 f"{r[7]:.3f} | {r[8]:.1f} | {r[9]:.0f}% | {r[10]:.1f} | {r[11]} / {r[12]} |")
  return "\n".join(lines)


def main():
  ap = device_arguments(__doc__, "fewer cases and steps (CPU < 1 min)")
  ap.add_argument("--steps", type=int, default=None)
  ap.add_argument("--quantized", action="store_true",
                  help="bf16 vs int8 vs fp8 matrices on weights larger than the caches")
  ap.add_argument("--long-context", action="store_true",
                  help="batch 1 over a range of contexts (CPU 128..8k, GPU 1k..32k): the time per "
                       "token against the cache length")
  args = ap.parse_args()
  device = pick_device(args.device)
  if args.quantized:
    p = quantized_plan(args, device.platform == "gpu")
    rows, copy_gbs, read_gbs = measure_quantized(p, device)
    head = measure_head(device, p["steps"])
    emit_table(quantized_table(rows, p, head, device, copy_gbs, read_gbs), args.out)
    return
  p = plan(args, device.platform == "gpu")
  dtype = jnp.bfloat16
  log(f"device: {device} ({device.device_kind}); {p['title']}")
  copy_gbs = copy_bandwidth(device, p["copy_bytes"], p["copy_reps"])
  log(f"measured copy bandwidth: {copy_gbs:.1f} GB/s")
  rows, w = [], None
  for ctx in p["contexts"]:
    cfg = DecoderConfig(**p["base"], max_seq_len=ctx)
    if w is None:  # the weights do not depend on the context
      log("initializing weights ...")
      w = make_weights(cfg, dtype, device)
    for B in p["batches"]:
      log(f"context {ctx}, batch {B}: ...")
      rows.append(measure_case(cfg, w, B, ctx, dtype, device, p["steps"], p["warmup"], copy_gbs))
  emit_table(table(rows, p["title"], device, copy_gbs, p["steps"]), args.out)


if __name__ == "__main__":
  main()
