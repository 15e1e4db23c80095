"""Optimizer-step benchmark: jaxfuse vs optax, side by side in one run.

For each parameter tree it times, under jax.jit with params and state donated:
  optax        optax.adamw                                  (update + apply_updates)
  jf-optax     jaxfuse.adamw through the optax protocol     (update + apply_updates)
  jf-fused     jaxfuse.fused_step(jaxfuse.adamw)            (in place, 28 B/param fp32)
and the same with clipping, optax.chain(clip_by_global_norm(1.0), adamw):
  optax+clip   the optax chain
  jf-fused+clip  jaxfuse.fused_step on the jaxfuse chain      (32 B/param fp32)

and, for the state precisions users pick to save memory:
  optax bf16-mu  optax.adamw(mu_dtype=bfloat16)                (fp32 params, bf16 first moment)
  jf-fused 8-bit jaxfuse.adamw(moment_bits=8), fused           (~16 B/param fp32)
and for many leaves (the step's host cost grows with its arrays):
  jf-fused packed         jaxfuse.adamw(packed=True), fused (a buffer per moment)
  jf-fused packed params  the same on jaxfuse.pack(params) and packed grads (7 arrays in all)
and on a bf16 copy of each tree (bf16 params and grads):
  optax bf16       optax.adamw on bf16 params (bf16 moments)
  jf-fused master  jaxfuse.adamw(master_weights=True), fused (fp32 master and moments)

It prints ms/step (wall time per step in a loop of jitted calls), the device time per step
(the kernels' durations from the profiler's trace, GPU only: where the wall time is far above
it the step is host-bound), the ratio to optax, the bytes a step must move (the minimum for the
fused kernels: 28 or 32 bytes per fp32 param), effective GB/s at that byte count, the fraction
of the device's measured copy bandwidth, and from jaxfuse.report (one implementation of the
counting): the bytes each step moves, its XLA kernels, custom calls and jaxfuse's CUDA launches.

It also saves a plot (PNG, needs matplotlib) of achieved GB/s (the report's bytes over the time)
against tensor size for the single-tensor trees: jaxfuse, optax and the copy reference at the
same memory footprint. Usage:

  python3 benchmarks/bench_optim.py                 # default device, default set of trees
  python3 benchmarks/bench_optim.py --quick         # small trees only (smoke test)
  python3 benchmarks/bench_optim.py --trees "GPT-2 small,1000 leaves"   # some of the trees
  python3 benchmarks/bench_optim.py --trees "1000 leaves" --variants "optax,jf-fused packed"
  python3 benchmarks/bench_optim.py --out results.md --plot bandwidth.png
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxfuse
from _common import copy_bandwidth, device_ms_per_call, emit_table
from _common import gpt2_medium_shapes, gpt2_small_shapes


def make_tree(shapes, seed=0, dtype=jnp.float32):
  rng = np.random.default_rng(seed)
  return {f"p{i:04d}": jnp.asarray(rng.standard_normal(s, np.float32) * 0.02, dtype) for i, s in
          enumerate(shapes)}


def time_step(step, params, state, grads, min_time=1.0, max_iters=200):
  """(median ms per step over repeated timed loops, device ms per step or None, params, state);
  the step donates params and state."""
  params, state = step(params, state, grads)[:2]  # compile + warm up
  jax.block_until_ready((params, state))
  t0 = time.perf_counter()
  params, state = step(params, state, grads)[:2]
  jax.block_until_ready((params, state))
  one = time.perf_counter() - t0
  iters = int(max(1, min(max_iters, min_time / 5 / max(one, 1e-6))))
  samples = []
  for _ in range(5):
    t0 = time.perf_counter()
    for _ in range(iters):
      params, state = step(params, state, grads)[:2]
    jax.block_until_ready((params, state))
    samples.append((time.perf_counter() - t0) / iters)
  carry = [params, state]

  def run(calls):
    for _ in range(calls):
      carry[:] = step(*carry, grads)[:2]
    jax.block_until_ready(carry)

  device_ms = device_ms_per_call(run, min(iters, 20))
  return 1e3 * statistics.median(samples), device_ms, *carry


LR, WD = 1e-3, 0.1


def optax_step(tx):
  """(tx, step) through the optax protocol: update, then apply_updates."""
  def step(p, s, g):
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s
  return tx, step


def fused(tx):
  """(tx, step) of jaxfuse's in-place step."""
  return tx, lambda p, s, g: jaxfuse.fused_step(tx, g, s, p)


def variants():
  lr, wd = LR, WD
  return [
      ("optax", 28, optax_step(optax.adamw(lr, weight_decay=wd))),
      ("jf-optax", 28, optax_step(jaxfuse.adamw(lr, weight_decay=wd))),
      ("jf-fused", 28, fused(jaxfuse.adamw(lr, weight_decay=wd))),
      ("optax+clip", 32, optax_step(optax.chain(optax.clip_by_global_norm(1.0),
                                                optax.adamw(lr, weight_decay=wd)))),
      ("jf-fused+clip", 32, fused(optax.chain(jaxfuse.clip_by_global_norm(1.0),
                                              jaxfuse.adamw(lr, weight_decay=wd)))),
      # Lower-precision states on fp32 params: optax's bf16 first moment (24 B/param), the
      # fused 8-bit step (g, p read and p written: 12; both moments' codes read and written: 4)
      ("optax bf16-mu", 24, optax_step(optax.adamw(lr, weight_decay=wd, mu_dtype=jnp.bfloat16))),
      ("jf-fused 8-bit", 16, fused(jaxfuse.adamw(lr, weight_decay=wd, moment_bits=8))),
      # The state packed (a buffer per moment), then the params and grads too (PACKED_PARAMS):
      # the step's arrays from 3 per leaf to 3 + 1 per leaf to 7.
      ("jf-fused packed", 28, fused(jaxfuse.adamw(lr, weight_decay=wd, packed=True))),
      ("jf-fused packed params", 28, fused(jaxfuse.adamw(lr, weight_decay=wd))),
  ]


# Variants whose params and grads are packed (jaxfuse.pack) before the step.
PACKED_PARAMS = {"jf-fused packed params"}


def bf16_variants():
  """On bf16 params and grads: optax keeps bf16 moments (14 B/param in place); jaxfuse's fused
  step keeps an fp32 master and moments (g, p 2+2, master and moments 3 x 8: 28 B/param)."""
  return [("optax bf16", 14, optax_step(optax.adamw(LR, weight_decay=WD))),
          ("jf-fused master", 28, fused(jaxfuse.adamw(LR, weight_decay=WD, master_weights=True)))]


def bench_tree(label, shapes, copy_bw, rows, progress, dtype=jnp.float32, chosen=None):
  params = make_tree(shapes, dtype=dtype)
  n = sum(math.prod(s) for s in shapes)
  grads = jax.tree.map(lambda x: x * 0.5 + 1e-3, params)
  base = {}
  for name, bytes_per_param, (tx, fn) in (variants() if dtype == jnp.float32
                                          else bf16_variants()):
    if chosen is not None and name not in chosen:
      continue
    progress(f"  {label}: {name} ...")
    p = jax.tree.map(jnp.copy, params)
    g = grads
    if name in PACKED_PARAMS:
      p, g = jaxfuse.pack(p), jaxfuse.pack(grads)
    s = tx.init(p)
    step = jax.jit(fn, donate_argnums=(0, 1))
    report = jaxfuse.report(step, p, s, g)
    ms, device_ms, p, s = time_step(step, p, s, g)
    del p, s
    base[name] = ms
    # Against optax's same computation: the clipped chain, else plain (fp32 or bf16) AdamW.
    baseline = next((v for v in ("optax+clip", "optax bf16", "optax")
                     if v in base and (v != "optax+clip" or name.endswith("+clip"))), name)
    min_bytes = bytes_per_param * n
    gbs = min_bytes / (ms * 1e-3) / 1e9
    rows.append({
        "tree": label, "params": n, "leaves": len(shapes), "variant": name, "ms": ms,
        "device_ms": device_ms, "vs_optax": base[baseline] / ms, "bytes": min_bytes, "gbs": gbs,
        "frac_copy": gbs * 1e9 / copy_bw, "moved": report.bytes_moved,
        "achieved_gbs": report.bytes_moved / (ms * 1e-3) / 1e9, "xla_kernels": report.xla_kernels,
        "custom_calls": report.custom_calls, "cuda_launches": report.jaxfuse_cuda_launches,
    })
    device = "" if device_ms is None else f"  (device {device_ms:.3f} ms)"
    progress(f"    {ms:9.3f} ms/step{device}  {gbs:7.1f} GB/s  "
             f"x{base[baseline] / ms:.2f} vs {baseline}")


def format_table(rows, copy_bw, device):
  lines = [
      f"device: {device}; jax {jax.__version__}; measured copy bandwidth {copy_bw / 1e9:.1f} GB/s",
      "",
      "| tree | params | leaves | variant | ms/step | device ms/step | speedup vs optax's same step | min bytes/step | GB/s at min bytes | % of copy BW | bytes moved (report) | achieved GB/s | XLA kernels | custom calls | jaxfuse CUDA launches |",
      "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
  ]
  for r in rows:
    device = "-" if r["device_ms"] is None else f"{r['device_ms']:.3f}"
    lines.append(
        f"| {r['tree']} | {r['params'] / 1e6:.1f}M | {r['leaves']} | {r['variant']} | {r['ms']:.3f} "
        f"| {device} "
        f"| {r['vs_optax']:.2f}x | {r['bytes'] / 1e6:.0f} MB | {r['gbs']:.1f} | "
        f"{100 * r['frac_copy']:.0f}% | {r['moved'] / 1e6:.0f} MB | {r['achieved_gbs']:.1f} | "
        f"{r['xla_kernels']} | {r['custom_calls']} | {r['cuda_launches'] or '-'} |")
  return "\n".join(lines)


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--quick", action="store_true", help="small trees only")
  ap.add_argument("--sizes", type=str, default=None,
                  help="comma-separated single-tensor sizes in millions (default: 0.0625 to 64 on CPU, "
                       "to 256 on GPU)")
  ap.add_argument("--skip-gpt2", action="store_true")
  ap.add_argument("--tensors-only", action="store_true",
                  help="only the single-tensor trees of --sizes (no GPT-2, no 1000 leaves)")
  ap.add_argument("--trees", type=str, default=None,
                  help="comma-separated beginnings of tree labels to keep, e.g. 'GPT-2 small,256M' "
                       "(GPT-2 small fp32 and bf16, the 256M tensor: tools/gpu_check.sh quick)")
  ap.add_argument("--variants", type=str, default=None,
                  help="comma-separated variant names to run (default: all), e.g. "
                       "'optax,jf-fused,jf-fused packed,jf-fused packed params'")
  ap.add_argument("--compile-times", action="store_true",
                  help="only time compiling the clipped step for 1000 and 3000 leaves")
  ap.add_argument("--out", type=str, default=None, help="also write the markdown table here")
  ap.add_argument("--plot", type=str, default=None,
                  help="PNG of achieved GB/s against tensor size (default: "
                       "benchmarks/optim_bandwidth_<platform>.png)")
  args = ap.parse_args(argv)
  progress = lambda msg: print(msg, file=sys.stderr, flush=True)
  device = jax.devices()[0]
  on_gpu = device.platform == "gpu"
  progress(f"device {device} ({device.device_kind}); jaxfuse backends {jaxfuse.backends()}")
  if args.compile_times:
    emit_table(compile_times([1000, 3000], progress), args.out)
    return
  copy_bw = 1e9 * copy_bandwidth(device, 1 << (24 if args.quick else 28))
  progress(f"copy bandwidth {copy_bw / 1e9:.1f} GB/s")

  trees = []
  if args.quick:
    trees.append(("1000 leaves x 4K", [(64, 64)] * 1000 if on_gpu else [(32, 32)] * 200))
    trees.append(("1M tensor", [(1 << 20,)]))
  else:
    if not (args.skip_gpt2 or args.tensors_only):
      trees.append(("GPT-2 small", gpt2_small_shapes()))
    if not (args.skip_gpt2 or args.tensors_only):
      trees.append(("GPT-2 small bf16", gpt2_small_shapes(), jnp.bfloat16))
      if on_gpu:
        trees.append(("GPT-2 medium", gpt2_medium_shapes()))
    if not args.tensors_only:
      trees.append(("1000 leaves x 4K", [(64, 64)] * 1000))
      if on_gpu or "10000" in (args.trees or ""):  # on the CPU when asked for: minutes to compile
        trees.append(("10000 leaves x 1K", [(32, 32)] * 10000))
    sizes = args.sizes or ("0.0625,0.25,1,4,16,64,256" if on_gpu else "0.0625,0.25,1,4,16,64")
    for m in sizes.split(","):
      trees.append((f"{m}M tensor", [(int(float(m) * (1 << 20)),)]))
  if args.trees:
    keep = [name.strip() for name in args.trees.split(",")]
    trees = [t for t in trees if any(t[0].startswith(name) for name in keep)]
    if not trees:
      sys.exit(f"bench_optim: no tree label begins with any of {keep}")
  rows = []
  for label, shapes, *dtype in trees:
    progress(f"{label}: {len(shapes)} leaves")
    chosen = None if args.variants is None else set(args.variants.split(","))
    bench_tree(label, shapes, copy_bw, rows, progress, *dtype, chosen=chosen)
  emit_table(format_table(rows, copy_bw, f"{device.device_kind} ({device.platform})"), args.out)
  plot_bandwidth(rows, device, args.plot or os.path.join(
      os.path.dirname(os.path.abspath(__file__)), f"optim_bandwidth_{device.platform}.png"),
      progress)


def compile_times(leaf_counts, progress):
  """Seconds to lower and compile the clipped AdamW step, jaxfuse fused vs optax, per tree size
  (64x64 leaves): what bounds the leaves per jaxfuse call."""
  lines = ["| leaves | variant | lower s | compile s |", "|---:|---|---:|---:|"]
  for leaves in leaf_counts:
    params = make_tree([(64, 64)] * leaves)
    for name, _, (tx, fn) in variants():
      if not name.endswith("+clip"):
        continue
      t0 = time.perf_counter()
      lowered = jax.jit(fn, donate_argnums=(0, 1)).lower(params, tx.init(params), params)
      t1 = time.perf_counter()
      lowered.compile()
      t2 = time.perf_counter()
      lines.append(f"| {leaves} | {name} | {t1 - t0:.2f} | {t2 - t1:.2f} |")
      progress(lines[-1])
  return "\n".join(lines)


def plot_bandwidth(rows, device, path, progress):
  """Achieved GB/s against tensor size (single-tensor trees) for jaxfuse's fused step, optax and
  the in-place copy at the same footprint (p, g, m, v: 16 bytes per param)."""
  try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:
    progress("matplotlib is not installed: no plot")
    return
  single = [r for r in rows if r["leaves"] == 1]
  if not single:
    return
  fig, ax = plt.subplots(figsize=(7, 4.5))
  for variant, style in (("jf-fused", "o-"), ("optax", "s-"), ("jf-fused+clip", "o--"),
                         ("optax+clip", "s--")):
    points = sorted((r["params"], r["achieved_gbs"]) for r in single if r["variant"] == variant)
    if points:
      ax.plot(*zip(*points), style, label=variant)
  sizes = sorted({r["params"] for r in single})
  copy = [copy_bandwidth(device, 16 * n) for n in sizes]
  ax.plot(sizes, copy, "k:", marker="^", label="copy (x + 1 in place)")
  ax.set_xscale("log")
  ax.set_xlabel("fp32 parameters in the tensor")
  ax.set_ylabel("achieved GB/s (bytes moved per jaxfuse.report / time)")
  ax.set_title(f"AdamW step bandwidth, {device.device_kind} ({device.platform}), jax {jax.__version__}")
  ax.grid(True, which="both", alpha=0.3)
  ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  progress(f"plot: {path}")


if __name__ == "__main__":
  main()
