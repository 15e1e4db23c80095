"""Optimizer-step benchmark: jaxfuse vs optax, side by side in one run.

For each parameter tree it times, under jax.jit with params and state donated:
  optax        optax.adamw                                  (update + apply_updates)
  jf-optax     jaxfuse.adamw through the optax protocol     (update + apply_updates)
  jf-fused     jaxfuse.fused_step(jaxfuse.adamw)            (in place, 28 B/param fp32)
and the same with clipping, optax.chain(clip_by_global_norm(1.0), adamw):
  optax+clip   the optax chain
  jf-fused+clip  jaxfuse.fused_step on the jaxfuse chain      (32 B/param fp32)

It prints ms/step, the ratio to optax, the bytes a step must move (the minimum for the fused
kernels: 28 or 32 bytes per fp32 param), effective GB/s at that byte count, the fraction of the
device's measured copy bandwidth, and from jaxfuse.report (one implementation of the counting):
the bytes each step moves, its XLA kernels, custom calls and jaxfuse's CUDA launches.

It also saves a plot (PNG, needs matplotlib) of achieved GB/s (the report's bytes over the time)
against tensor size for the single-tensor trees: jaxfuse, optax and the copy reference at the
same memory footprint. Usage:

  python3 benchmarks/bench_optim.py                 # default device, default set of trees
  python3 benchmarks/bench_optim.py --quick         # small trees only (smoke test)
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
from _common import copy_bandwidth, emit_table
from _common import gpt2_small_shapes


def make_tree(shapes, seed=0):
  rng = np.random.default_rng(seed)
  return {f"p{i:04d}": jnp.asarray(rng.standard_normal(s, np.float32) * 0.02) for i, s in
          enumerate(shapes)}


def time_step(step, params, state, grads, min_time=1.0, max_iters=200):
  """Median ms per step over repeated timed loops (the step donates params and state)."""
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
  return 1e3 * statistics.median(samples), params, state


def variants():
  lr, wd = 1e-3, 0.1

  def optax_step(tx):
    def step(p, s, g):
      u, s = tx.update(g, s, p)
      return optax.apply_updates(p, u), s
    return tx, step

  def fused(tx):
    return tx, lambda p, s, g: jaxfuse.fused_step(tx, g, s, p)

  return [
      ("optax", 28, optax_step(optax.adamw(lr, weight_decay=wd))),
      ("jf-optax", 28, optax_step(jaxfuse.adamw(lr, weight_decay=wd))),
      ("jf-fused", 28, fused(jaxfuse.adamw(lr, weight_decay=wd))),
      ("optax+clip", 32, optax_step(optax.chain(optax.clip_by_global_norm(1.0),
                                                optax.adamw(lr, weight_decay=wd)))),
      ("jf-fused+clip", 32, fused(optax.chain(jaxfuse.clip_by_global_norm(1.0),
                                              jaxfuse.adamw(lr, weight_decay=wd)))),
  ]


def bench_tree(label, shapes, copy_bw, rows, progress):
  params = make_tree(shapes)
  n = sum(math.prod(s) for s in shapes)
  grads = jax.tree.map(lambda x: x * 0.5 + 1e-3, params)
  base = {}
  for name, bytes_per_param, (tx, fn) in variants():
    progress(f"  {label}: {name} ...")
    p = jax.tree.map(jnp.copy, params)
    s = tx.init(p)
    step = jax.jit(fn, donate_argnums=(0, 1))
    report = jaxfuse.report(step, p, s, grads)
    ms, p, s = time_step(step, p, s, grads)
    del p, s
    base.setdefault(bytes_per_param, ms)  # optax is first in each group
    min_bytes = bytes_per_param * n
    gbs = min_bytes / (ms * 1e-3) / 1e9
    rows.append({
        "tree": label, "params": n, "leaves": len(shapes), "variant": name, "ms": ms,
        "vs_optax": base[bytes_per_param] / ms, "bytes": min_bytes, "gbs": gbs,
        "frac_copy": gbs * 1e9 / copy_bw, "moved": report.bytes_moved,
        "achieved_gbs": report.bytes_moved / (ms * 1e-3) / 1e9, "xla_kernels": report.xla_kernels,
        "custom_calls": report.custom_calls, "cuda_launches": report.jaxfuse_cuda_launches,
    })
    progress(f"    {ms:9.3f} ms/step  {gbs:7.1f} GB/s  x{base[bytes_per_param] / ms:.2f} vs optax")


def format_table(rows, copy_bw, device):
  lines = [
      f"device: {device}; jax {jax.__version__}; measured copy bandwidth {copy_bw / 1e9:.1f} GB/s",
      "",
      "| tree | params | leaves | variant | ms/step | speedup vs optax | min bytes/step | GB/s at min bytes | % of copy BW | bytes moved (report) | achieved GB/s | XLA kernels | custom calls | jaxfuse CUDA launches |",
      "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
  ]
  for r in rows:
    lines.append(
        f"| {r['tree']} | {r['params'] / 1e6:.1f}M | {r['leaves']} | {r['variant']} | {r['ms']:.3f} "
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
    if not args.tensors_only:
      trees.append(("1000 leaves x 4K", [(64, 64)] * 1000))
    sizes = args.sizes or ("0.0625,0.25,1,4,16,64,256" if on_gpu else "0.0625,0.25,1,4,16,64")
    for m in sizes.split(","):
      trees.append((f"{m}M tensor", [(int(float(m) * (1 << 20)),)]))
  rows = []
  for label, shapes in trees:
    progress(f"{label}: {len(shapes)} leaves")
    bench_tree(label, shapes, copy_bw, rows, progress)
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
