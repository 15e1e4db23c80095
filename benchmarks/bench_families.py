"""Every fused optimizer family against optax, side by side in one run.

For each family and tree it times, under jax.jit with params and state donated (in the order the
step returns them):
  optax     optax's transform (update + apply_updates)
  jaxfuse   jaxfuse.fused_step on the jaxfuse twin (in place)
and prints ms/step, jaxfuse's speed-up over optax, from jaxfuse.report the bytes per fp32 param
each step moves (the fused step: params, grads and each state list read, params and state
written, 20 for one state list, 28 for two; LAMB and LARS read grads, params and states once
more for their per-leaf sums) and its launches, and the fused step's GB/s at its count with its
fraction of the copy rate measured at the same footprint. Every variant of every family (the
family list, jaxfuse/_optim/families), each beside its optax twin. Trees: GPT-2 small's 148
leaves (124M params) and 1000 small leaves. Usage:

  python3 benchmarks/bench_families.py [--quick] [--out results.md]
"""

from __future__ import annotations

import argparse
import math
import sys

import jax
import numpy as np
import optax

import jaxfuse
from jaxfuse._optim import families
from _common import copy_bandwidth, emit_table, gpt2_small_shapes
from bench_optim import make_tree, time_step

def thousand_leaves() -> list[tuple[int, ...]]:
  rng = np.random.default_rng(0)
  return [(int(rng.integers(100, 2000)),) for _ in range(1000)]


def bench(label, shapes, variant, rows, copy_bw):
  params = make_tree(shapes)
  grads = jax.tree.map(lambda x: x * 0.5 + 1e-3, params)
  n = sum(math.prod(s) for s in shapes)

  def optax_step(p, s, g):
    u, s = tx_optax.update(g, s, p)
    return optax.apply_updates(p, u), s

  tx_optax, tx_jf = variant.spec().optax_twin(), variant()
  fused = lambda p, s, g: jaxfuse.fused_step(tx_jf, g, s, p)
  times, reports = {}, {}
  for name, tx, fn in (("optax", tx_optax, optax_step), ("jaxfuse", tx_jf, fused)):
    p = jax.tree.map(lambda x: x.copy(), params)
    step = jax.jit(fn, donate_argnums=(0, 1))
    s = tx.init(p)
    reports[name] = jaxfuse.report(step, p, s, grads)
    times[name] = time_step(step, p, s, grads)[0]
  gbs = reports["jaxfuse"].bytes_moved / (times["jaxfuse"] * 1e-3) / 1e9
  rows.append(f"| {label} | {variant.label} | {times['optax']:.2f} | {times['jaxfuse']:.2f} | "
              f"{times['optax'] / times['jaxfuse']:.2f}x | "
              f"{reports['optax'].bytes_moved / n:.1f} | {reports['jaxfuse'].bytes_moved / n:.1f} | "
              f"{gbs:.1f} | {100 * gbs * 1e9 / copy_bw:.0f}% | {reports['optax'].launches} | "
              f"{reports['jaxfuse'].launches} |")
  print(rows[-1], file=sys.stderr, flush=True)


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--quick", action="store_true", help="a 4M-param tree only")
  parser.add_argument("--out", help="also write the table to this file")
  args = parser.parse_args()
  trees = ([("4M, 8 leaves", [(512, 1024)] * 8)] if args.quick else
           [("GPT-2 small", gpt2_small_shapes()), ("1000 leaves", thousand_leaves())])
  device = jax.devices()[0]
  rows, copy_rates = [], []
  for label, shapes in trees:
    n = sum(math.prod(s) for s in shapes)
    copy_bw = 1e9 * copy_bandwidth(device, 4 * n * 5)  # B/s; the footprint of params, grads, 3 states
    copy_rates.append(f"{label}: copy rate {copy_bw / 1e9:.1f} GB/s")
    print(f"{label}: copy rate {copy_bw / 1e9:.1f} GB/s", file=sys.stderr, flush=True)
    for family in families.registered():
      for variant in family.variants:
        bench(label, shapes, variant, rows, copy_bw)
  header = [f"device: {device}; jax {jax.__version__}; " + "; ".join(copy_rates), "",
            "| tree | family variant | optax ms | jaxfuse ms | speed-up | optax B/param moved "
            "| jaxfuse B/param moved | jaxfuse GB/s | % of copy rate | optax launches "
            "| jaxfuse launches |",
            "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
  emit_table("\n".join(header + rows), args.out)


if __name__ == "__main__":
  main()
