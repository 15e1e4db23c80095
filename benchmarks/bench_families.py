"""Every fused optimizer family against optax, side by side in one run.

For each family and tree it times, under jax.jit with params and state donated (in the order the
step returns them):
  optax     optax's transform (update + apply_updates)
  jaxfuse   jaxfuse.fused_step on the jaxfuse twin (in place)
and prints ms/step, jaxfuse's speed-up over optax, the bytes per fp32 param the fused step must
move (params, grads and each state list read, params and state written: 20 for one state list,
28 for two; LAMB and LARS read grads, params and states once more for their per-leaf sums), the
effective GB/s at that count, its fraction of the copy rate measured at the same
footprint, and from jaxfuse.report the bytes each step moves and its launches. Trees: GPT-2
small's 148 leaves (124M params) and 1000 small leaves. Usage:

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
from _common import copy_bandwidth, emit_table, gpt2_small_shapes
from bench_optim import make_tree, time_step

LR = 1e-3

# name, bytes per fp32 param in place, jaxfuse transform, optax transform
FAMILIES = [
    ("adamw", 28, lambda m: m.adamw(LR, weight_decay=0.1)),
    ("sgd momentum", 20, lambda m: m.sgd(LR, momentum=0.9)),
    ("lion", 20, lambda m: m.lion(LR)),
    ("adagrad", 20, lambda m: m.adagrad(LR)),
    ("rmsprop", 20, lambda m: m.rmsprop(LR)),
    ("rmsprop centered", 28, lambda m: m.rmsprop(LR, centered=True)),
    # Two passes: the per-leaf sums read grads, params and the states the direction needs.
    ("lamb", 16 + 28, lambda m: m.lamb(LR, weight_decay=0.1)),
    ("lars", 8 + 20, lambda m: m.lars(LR, weight_decay=0.1)),
]


def thousand_leaves() -> list[tuple[int, ...]]:
  rng = np.random.default_rng(0)
  return [(int(rng.integers(100, 2000)),) for _ in range(1000)]


def bench(label, shapes, family, bytes_per_param, make, rows, copy_bw):
  params = make_tree(shapes)
  grads = jax.tree.map(lambda x: x * 0.5 + 1e-3, params)
  n = sum(math.prod(s) for s in shapes)

  def optax_step(p, s, g):
    u, s = tx_optax.update(g, s, p)
    return optax.apply_updates(p, u), s

  tx_optax, tx_jf = make(optax), make(jaxfuse)
  fused = lambda p, s, g: jaxfuse.fused_step(tx_jf, g, s, p)
  times, reports = {}, {}
  for name, tx, fn in (("optax", tx_optax, optax_step), ("jaxfuse", tx_jf, fused)):
    p = jax.tree.map(lambda x: x.copy(), params)
    step = jax.jit(fn, donate_argnums=(0, 1))
    s = tx.init(p)
    reports[name] = jaxfuse.report(step, p, s, grads)
    times[name] = time_step(step, p, s, grads)[0]
  gbs = bytes_per_param * n / (times["jaxfuse"] * 1e-3) / 1e9
  rows.append(f"| {label} | {family} | {times['optax']:.2f} | {times['jaxfuse']:.2f} | "
              f"{times['optax'] / times['jaxfuse']:.2f}x | {bytes_per_param} | {gbs:.1f} | "
              f"{100 * gbs * 1e9 / copy_bw:.0f}% | {reports['optax'].bytes_moved / n:.1f} | "
              f"{reports['jaxfuse'].bytes_moved / n:.1f} | {reports['optax'].launches} | "
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
    for family, bytes_per_param, make in FAMILIES:
      bench(label, shapes, family, bytes_per_param, make, rows, copy_bw)
  header = [f"device: {device}; jax {jax.__version__}; " + "; ".join(copy_rates), "",
            "| tree | family | optax ms | jaxfuse ms | speed-up | floor B/param | GB/s at floor "
            "| % of copy rate | optax B/param moved | jaxfuse B/param moved | optax launches "
            "| jaxfuse launches |",
            "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
  emit_table("\n".join(header + rows), args.out)


if __name__ == "__main__":
  main()
