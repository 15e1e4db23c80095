"""Muon benchmark: jaxfuse.muon against optax.contrib.muon on a GPT-2-shaped tree, side by side.

The tree is GPT-2's 148 leaves at width --width (768 is GPT-2 small; the CPU default, 256, keeps
a step's Newton-Schulz flops, which grow as width**3, to about a second); the embeddings and the
1-D leaves go to AdamW, the 48 matrices to Muon, as usual in training. Variants, each a jitted
step with params and state donated:

  optax            optax.contrib.muon: tx.update + optax.apply_updates (48 Newton-Schulz chains)
  protocol         jaxfuse.muon, tx.update + optax.apply_updates (3 batched chains, one per shape)
  fused            jaxfuse.muon under jaxfuse.fused_step (the element passes in place)
  fused, gram      the same with ns_method="gram"
  fused, bf16 NS   the same with ns_dtype=bfloat16 (the iterations' matmuls in bf16; --bf16-ns)
  adamw fused      jaxfuse.adamw under fused_step: the element-wise step Muon is measured against

With --fsdp N (the CPU: N fake devices) it instead compiles the optax-protocol step of both on an
FSDP mesh (every matrix's rows split over the N devices, Auto axes) and counts the collectives
in the compiled HLO, for 5 and 7 Newton-Schulz iterations: jaxfuse's owner compute (each device
orthogonalizes whole matrices of its own) against optax's partitioned iterations.

It prints ms/step (best of --reps loops), the device time (GPU: the kernels' summed durations),
from jaxfuse.report the kernels launched, XLA's flops and the bytes moved, and the largest
difference of each variant's params after the steps from optax's, relative to the largest
update. A second table times the Newton-Schulz chain alone on the largest stack (the 24
(width, 4 * width) matrices), standard against Gram, with how far Gram's result is from the
standard one's. Usage:

  python3 benchmarks/bench_muon.py [--width 256] [--steps 3] [--reps 3] [--bf16-ns] [--out f.md]
  python3 benchmarks/bench_muon.py --fsdp 8 [--width 256]
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time

if "--fsdp" in sys.argv:  # before jax starts its backend
  _n = sys.argv[sys.argv.index("--fsdp") + 1]
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                             f" --xla_force_host_platform_device_count={_n}")

import jax
import jax.numpy as jnp
import numpy as np
import optax
from optax.contrib import MuonDimensionNumbers

import jaxfuse
from _common import (best_seconds, device_ms_per_call, emit_table, fused_step, gpt2_shapes,
                     optax_step, versions_line)
from jaxfuse._optim import newton_schulz
from jaxfuse._optim.families.muon import NS_PRESETS

LR = 2e-2


def gpt2_tree(width: int, seed: int = 0):
  """(params, Muon's dimension numbers) of GPT-2's 148 leaves at `width`: the embeddings (the
  first two leaves) and the 1-D leaves AdamW's, the matrices Muon's."""
  rng = np.random.default_rng(seed)
  shapes = gpt2_shapes(width, 12)
  params = {f"p{i:03d}": jnp.asarray(rng.standard_normal(s, np.float32) * 0.02)
            for i, s in enumerate(shapes)}
  dims = {k: (MuonDimensionNumbers() if i >= 2 and len(s) == 2 else None)
          for i, (k, s) in enumerate(zip(params, shapes))}
  return params, dims


def _timed(step, params, state, grads, steps: int, reps: int):
  """(ms per step, device ms per step or None, params after `steps` steps from `params`)."""
  p = jax.tree.map(jnp.copy, params)
  s = state
  for _ in range(steps):
    p, s = step(p, s, grads)
  jax.block_until_ready(p)
  after = jax.tree.map(np.asarray, p)
  box = [p, s]

  def run(calls):
    for _ in range(calls):
      box[0], box[1] = step(box[0], box[1], grads)
    jax.block_until_ready(box[0])

  return best_seconds(run, reps, steps) * 1e3, device_ms_per_call(run, steps), after


def step_table(width: int, steps: int, reps: int, bf16_ns: bool) -> str:
  params, dims = gpt2_tree(width)
  rng = np.random.default_rng(1)
  grads = jax.tree.map(lambda p: jnp.asarray(rng.standard_normal(p.shape, np.float32) * 0.01),
                       params)
  muon = lambda **kw: jaxfuse.muon(LR, muon_weight_dimension_numbers=dims, **kw)
  variants = [("optax", optax.contrib.muon(LR, muon_weight_dimension_numbers=dims), optax_step),
              ("protocol", muon(), optax_step), ("fused", muon(), fused_step),
              ("fused, gram", muon(ns_method="gram"), fused_step)]
  if bf16_ns:
    variants.append(("fused, bf16 NS", muon(ns_dtype=jnp.bfloat16), fused_step))
  variants.append(("adamw fused", jaxfuse.adamw(LR), fused_step))
  rows, reference, u_max = [], None, None
  for name, tx, make in variants:
    step = make(tx)
    state = tx.init(params)
    report = jaxfuse.report(step, params, state, grads)
    t0 = time.perf_counter()
    ms, device_ms, after = _timed(step, params, tx.init(params), grads, steps, reps)
    if reference is None:
      reference = after
      u_max = max(float(np.max(np.abs(a - np.asarray(p))))
                  for a, p in zip(jax.tree.leaves(after), jax.tree.leaves(params)))
    gap = max(float(np.max(np.abs(a - b)))
              for a, b in zip(jax.tree.leaves(after), jax.tree.leaves(reference)))
    diff = "-" if name.startswith("adamw") else f"{gap / u_max:.1e}"
    rows.append((name, ms, device_ms, report, diff))
    print(f"  {name}: {ms:.1f} ms/step ({time.perf_counter() - t0:.0f} s)", flush=True)
  base = rows[0][1]
  dev = lambda v: "-" if v is None else f"{v:.2f}"
  lines = [f"Muon step, GPT-2-shaped tree at width {width} (148 leaves, "
           f"{sum(p.size for p in jax.tree.leaves(params)) / 1e6:.1f}M params; 48 matrices "
           "Muon's), fp32, donated",
           "",
           "| variant | ms/step | device ms | vs optax | kernels launched | XLA GFLOP "
           "| bytes moved | params vs optax (of max update) |",
           "|---|---:|---:|---:|---:|---:|---:|---:|"]
  for name, ms, device_ms, report, diff in rows:
    flops = "-" if report.xla_flops is None else f"{report.xla_flops / 1e9:.1f}"
    lines.append(f"| {name} | {ms:.1f} | {dev(device_ms)} | {base / ms:.2f}x | {report.launches} "
                 f"| {flops} | {report.bytes_moved / 1e6:.0f} MB | {diff} |")
  return "\n".join(lines)


def newton_schulz_table(width: int, reps: int, dtypes: list) -> str:
  """The largest stack alone: standard against Gram Newton-Schulz."""
  rng = np.random.default_rng(2)
  coeffs = jnp.asarray(NS_PRESETS["standard"])
  lines = [f"Newton-Schulz alone on the largest stack, 24 x ({width}, {4 * width}), 5 iterations",
           "", "| dtype | standard ms | gram ms | gram speedup | XLA GFLOP standard / gram "
           "| max abs(gram - standard) |", "|---|---:|---:|---:|---:|---:|"]
  for dtype in dtypes:
    x = jnp.asarray(rng.standard_normal((24, width, 4 * width), np.float32), dtype)
    results, times, flops = {}, {}, {}
    for method in ("standard", "gram"):
      f = jax.jit(lambda x, m=method: newton_schulz.orthogonalize(x, coeffs, 5, "frobenius",
                                                                  1e-8, m))
      flops[method] = jaxfuse.report(f, x).xla_flops or 0.0
      results[method] = np.asarray(f(x).astype(jnp.float32))
      best = float("inf")
      for _ in range(reps):
        t0 = time.perf_counter()
        f(x).block_until_ready()
        best = min(best, time.perf_counter() - t0)
      times[method] = best * 1e3
    gap = float(np.max(np.abs(results["gram"] - results["standard"])))
    lines.append(f"| {jnp.dtype(dtype).name} | {times['standard']:.1f} | {times['gram']:.1f} | "
                 f"{times['standard'] / times['gram']:.2f}x | {flops['standard'] / 1e9:.1f} / "
                 f"{flops['gram'] / 1e9:.1f} | {gap:.1e} |")
  return "\n".join(lines)


COLLECTIVES = ("all-gather", "all-reduce", "all-to-all", "collective-permute")


def fsdp_table(width: int, devices: int) -> str:
  """Collectives per step of the optax-protocol step on an FSDP mesh, both optimizers."""
  from jax.sharding import NamedSharding, PartitionSpec as P
  params, dims = gpt2_tree(width)
  mesh = jax.make_mesh((devices,), ("fsdp",), axis_types=(jax.sharding.AxisType.Auto,))
  spec = lambda x: P("fsdp") if x.ndim == 2 and x.shape[0] % devices == 0 else P()
  lines = [f"Collectives per step on {devices} devices, FSDP (matrices' rows split), GPT-2-shaped "
           f"tree at width {width}, tx.update (Auto mesh)", "",
           "| optimizer | NS iterations | " + " | ".join(COLLECTIVES) + " | compile s |",
           "|---|---:|" + "---:|" * (len(COLLECTIVES) + 1)]
  with jax.set_mesh(mesh):
    p = jax.device_put(params, jax.tree.map(lambda x: NamedSharding(mesh, spec(x)), params))
    for name, make in (("optax", optax.contrib.muon), ("jaxfuse", jaxfuse.muon)):
      for steps in (5, 7):
        tx = make(LR, ns_steps=steps, muon_weight_dimension_numbers=dims)
        t0 = time.perf_counter()
        text = jax.jit(tx.update).lower(p, tx.init(p), p).compile().as_text()
        counts = [len(re.findall(rf"\b{op}(-start)?\(", text)) for op in COLLECTIVES]
        lines.append(f"| {name} | {steps} | " + " | ".join(map(str, counts)) +
                     f" | {time.perf_counter() - t0:.1f} |")
        print(lines[-1], flush=True)
  return "\n".join(lines)


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  gpu = jax.default_backend() == "gpu"
  ap.add_argument("--width", type=int, default=768 if gpu else 256)
  ap.add_argument("--steps", type=int, default=5 if gpu else 3)
  ap.add_argument("--reps", type=int, default=3)
  ap.add_argument("--bf16-ns", action="store_true", default=gpu,
                  help="also time ns_dtype=bfloat16 (default on a GPU)")
  ap.add_argument("--fsdp", type=int, help="count collectives on this many (fake) devices")
  ap.add_argument("--out", help="also write the markdown tables to this file")
  args = ap.parse_args()
  if args.fsdp:
    emit_table("\n\n".join([versions_line(), fsdp_table(args.width, args.fsdp)]), args.out)
    return
  tables = [versions_line(), step_table(args.width, args.steps, args.reps, args.bf16_ns),
            newton_schulz_table(args.width, args.reps,
                                [jnp.float32] + ([jnp.bfloat16] if args.bf16_ns else []))]
  emit_table("\n\n".join(tables), args.out)


if __name__ == "__main__":
  main()
