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
device's measured copy bandwidth, and the ops in the compiled step (XLA fusions + custom calls:
on a GPU each is at least one kernel launch). Usage:

  python3 benchmarks/bench_optim.py                 # default device, default set of trees
  python3 benchmarks/bench_optim.py --quick         # small trees only (smoke test)
  python3 benchmarks/bench_optim.py --out results.md
"""

from __future__ import annotations

import argparse
import math
import re
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxfuse
from _common import copy_bandwidth, emit_table
from jaxfuse.adam import MAX_LEAVES_PER_CALL


def gpt2_small_shapes() -> list[tuple[int, ...]]:
  """The 148 parameter shapes of GPT-2 small (124M)."""
  d, v, n_ctx, layers = 768, 50257, 1024, 12
  shapes = [(v, d), (n_ctx, d)]
  for _ in range(layers):
    shapes += [(d,), (d,), (d, 3 * d), (3 * d,), (d, d), (d,), (d,), (d,), (d, 4 * d), (4 * d,),
               (4 * d, d), (d,)]
  shapes += [(d,), (d,)]
  return shapes


def make_tree(shapes, seed=0):
  rng = np.random.default_rng(seed)
  return {f"p{i:04d}": jnp.asarray(rng.standard_normal(s, np.float32) * 0.02) for i, s in
          enumerate(shapes)}


def count_ops(compiled_text: str) -> tuple[int, int]:
  """(fusions, custom calls) in the entry computation of compiled HLO."""
  entry = compiled_text[compiled_text.find("ENTRY"):]
  entry = entry[:entry.find("\n}\n")]
  fusions = len(re.findall(r"= [^\n]*\bfusion\(", entry))
  customs = len(re.findall(r"custom-call\(", entry))
  return fusions, customs


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


def expected_launches(name, leaves):
  """Kernel launches per step of jaxfuse's variants on a GPU (multi-tensor driver)."""
  adam = math.ceil(leaves / MAX_LEAVES_PER_CALL)
  return {"jf-fused": adam, "jf-fused+clip": adam + 2}.get(name)


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
    fusions, customs = count_ops(step.lower(p, s, grads).compile().as_text())
    ms, p, s = time_step(step, p, s, grads)
    del p, s
    base.setdefault(bytes_per_param, ms)  # optax is first in each group
    min_bytes = bytes_per_param * n
    gbs = min_bytes / (ms * 1e-3) / 1e9
    rows.append({
        "tree": label, "params": n, "leaves": len(shapes), "variant": name, "ms": ms,
        "vs_optax": base[bytes_per_param] / ms, "bytes": min_bytes, "gbs": gbs,
        "frac_copy": gbs * 1e9 / copy_bw, "fusions": fusions, "custom_calls": customs,
        "gpu_launches": expected_launches(name, len(shapes)),
    })
    progress(f"    {ms:9.3f} ms/step  {gbs:7.1f} GB/s  x{base[bytes_per_param] / ms:.2f} vs optax")


def format_table(rows, copy_bw, device):
  lines = [
      f"device: {device}; jax {jax.__version__}; measured copy bandwidth {copy_bw / 1e9:.1f} GB/s",
      "",
      "| tree | params | leaves | variant | ms/step | speedup vs optax | min bytes/step | GB/s at min bytes | % of copy BW | XLA fusions | custom calls | jaxfuse GPU launches |",
      "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
  ]
  for r in rows:
    lines.append(
        f"| {r['tree']} | {r['params'] / 1e6:.1f}M | {r['leaves']} | {r['variant']} | {r['ms']:.3f} "
        f"| {r['vs_optax']:.2f}x | {r['bytes'] / 1e6:.0f} MB | {r['gbs']:.1f} | "
        f"{100 * r['frac_copy']:.0f}% | {r['fusions']} | {r['custom_calls']} | "
        f"{r['gpu_launches'] if r['gpu_launches'] is not None else '-'} |")
  return "\n".join(lines)


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--quick", action="store_true", help="small trees only")
  ap.add_argument("--sizes", type=str, default=None,
                  help="comma-separated single-tensor sizes in millions (default: 1,16,64 on CPU, "
                       "1,16,64,256 on GPU)")
  ap.add_argument("--skip-gpt2", action="store_true")
  ap.add_argument("--out", type=str, default=None, help="also write the markdown table here")
  args = ap.parse_args(argv)
  progress = lambda msg: print(msg, file=sys.stderr, flush=True)
  device = jax.devices()[0]
  on_gpu = device.platform == "gpu"
  progress(f"device {device} ({device.device_kind}); jaxfuse backends {jaxfuse.backends()}")
  copy_bw = 1e9 * copy_bandwidth(device, 1 << (24 if args.quick else 28))
  progress(f"copy bandwidth {copy_bw / 1e9:.1f} GB/s")

  trees = []
  if args.quick:
    trees.append(("1000 leaves x 4K", [(64, 64)] * 1000 if on_gpu else [(32, 32)] * 200))
    trees.append(("1M tensor", [(1 << 20,)]))
  else:
    if not args.skip_gpt2:
      trees.append(("GPT-2 small", gpt2_small_shapes()))
    trees.append(("1000 leaves x 4K", [(64, 64)] * 1000))
    sizes = args.sizes or ("1,16,64,256" if on_gpu else "1,16,64")
    for m in sizes.split(","):
      trees.append((f"{m}M tensor", [(int(float(m) * (1 << 20)),)]))
  rows = []
  for label, shapes in trees:
    progress(f"{label}: {len(shapes)} leaves")
    bench_tree(label, shapes, copy_bw, rows, progress)
  emit_table(format_table(rows, copy_bw, f"{device.device_kind} ({device.platform})"), args.out)


if __name__ == "__main__":
  main()
