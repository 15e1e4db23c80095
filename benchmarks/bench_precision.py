"""AdamW's precision modes side by side in one run: bytes per param and step time of each, against
the float32 fused step and optax's AdamW, on the GPT-2-small tree (148 leaves, 124M params).

Each row times, under jax.jit with params and state donated (in the order the step returns them),
a step on gradients of the params' dtype:
  optax fp32          optax.adamw (update + apply_updates) on float32 params
  fused <mode>        jaxfuse.fused_step with jaxfuse.adamw in that mode (in place)
and prints ms/step, the speed-up over optax and over the fused fp32 step, from jaxfuse.report the
bytes per param the step moves and the state bytes per param it keeps, the step time the bytes
predict (the fp32 fused step's time scaled by the modes' bytes ratio) and the effective GB/s and
its fraction of the copy rate measured at the fp32 step's footprint. Usage:

  python3 benchmarks/bench_precision.py [--quick] [--out results.md]
"""

from __future__ import annotations

import argparse
import math
import sys

import jax
import jax.numpy as jnp
import optax

import jaxfuse
from _common import copy_bandwidth, emit_table, gpt2_small_shapes
from bench_optim import make_tree, time_step

LR = 1e-3

# name, params dtype, jaxfuse.adamw options (None: optax.adamw)
MODES = [
    ("optax fp32", jnp.float32, None),
    ("fused fp32", jnp.float32, {}),
    ("fused bf16 moments", jnp.float32, dict(mu_dtype=jnp.bfloat16, nu_dtype=jnp.bfloat16)),
    ("fused 8-bit moments", jnp.float32, dict(moment_bits=8)),
    ("fused bf16 params + remainders, 8-bit moments", jnp.bfloat16,
     dict(master_weights="remainder", moment_bits=8)),
    ("fused bf16 params + fp32 master", jnp.bfloat16, dict(master_weights=True)),
    ("fused bf16 params + remainders", jnp.bfloat16, dict(master_weights="remainder")),
    ("fused bf16 params + remainders, bf16 moments", jnp.bfloat16,
     dict(master_weights="remainder", mu_dtype=jnp.bfloat16, nu_dtype=jnp.bfloat16)),
    ("fused bf16 params + stochastic rounding", jnp.bfloat16, dict(stochastic_rounding=True)),
    ("fused bf16 params, nearest", jnp.bfloat16, {}),
]


def measure(shapes, dtype, options):
  """(ms per step, report) of one mode."""
  params = jax.tree.map(lambda x: x.astype(dtype), make_tree(shapes))
  grads = jax.tree.map(lambda x: x * 0.5 + jnp.asarray(1e-3, x.dtype), params)
  if options is None:
    tx = optax.adamw(LR, weight_decay=0.1)

    def fn(p, s, g):
      u, s = tx.update(g, s, p)
      return optax.apply_updates(p, u), s
  else:
    tx = jaxfuse.adamw(LR, weight_decay=0.1, **options)
    fn = lambda p, s, g: jaxfuse.fused_step(tx, g, s, p)
  step = jax.jit(fn, donate_argnums=(0, 1))
  state = tx.init(params)
  report = jaxfuse.report(step, params, state, grads)
  return time_step(step, params, state, grads)[0], report


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--quick", action="store_true", help="a 4M-param tree")
  parser.add_argument("--out", help="also write the table to this file")
  args = parser.parse_args()
  label, shapes = (("4M, 8 leaves", [(512, 1024)] * 8) if args.quick
                   else ("GPT-2 small", gpt2_small_shapes()))
  n = sum(math.prod(s) for s in shapes)
  device = jax.devices()[0]
  copy_bw = 1e9 * copy_bandwidth(device, 4 * n * 5)  # the fp32 step's footprint
  print(f"{label}: copy rate {copy_bw / 1e9:.1f} GB/s", file=sys.stderr, flush=True)
  results = {}
  rows = []
  for name, dtype, options in MODES:
    ms, report = measure(shapes, dtype, options)
    results[name] = ms, report
    fp32_ms, fp32_report = results.get("fused fp32", (ms, report))
    moved = report.bytes_moved / n
    predicted = fp32_ms * report.bytes_moved / fp32_report.bytes_moved
    gbs = report.bytes_moved / (ms * 1e-3) / 1e9
    rows.append(f"| {name} | {ms:.1f} | {results['optax fp32'][0] / ms:.2f}x | "
                f"{fp32_ms / ms:.2f}x | {moved:.1f} | {report.state_bytes_per_param:.1f} | "
                f"{predicted:.1f} | {gbs:.1f} | {100 * gbs * 1e9 / copy_bw:.0f}% | "
                f"{report.launches} |")
    print(rows[-1], file=sys.stderr, flush=True)
  header = [f"{label} ({n / 1e6:.0f}M params), device: {device}; jax {jax.__version__}; "
            f"copy rate {copy_bw / 1e9:.1f} GB/s", "",
            "| step | ms | vs optax fp32 | vs fused fp32 | B/param moved | state B/param "
            "| ms the bytes predict | GB/s | % of copy rate | launches |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
  emit_table("\n".join(header + rows), args.out)


if __name__ == "__main__":
  main()
