"""Sharded optimizer step: jaxfuse vs optax on 8 devices, side by side in one run.

FSDP (the default): params, grads and AdamW moments split over 8 devices (fake CPU devices
unless the machine has 8 of its own) along each leaf's largest dimension the mesh divides, the
rest replicated. Data parallelism (--data-parallel): params and grads replicated, the state
replicated or split (ZeRO's first stage). Under jax.jit with params and state donated, on Auto
and Explicit meshes:
  optax+clip              optax.chain(clip_by_global_norm(1.0), adamw)
  jf-fused+clip           jaxfuse.fused_step on the jaxfuse chain (each device its own shards)
  jf-fused+clip packed    (--data-parallel) the state packed, replicated
  jf-fused+clip split     (--data-parallel) the state packed and split over the devices
It prints ms/step, the ratio to optax, and the collectives and per-device argument bytes of the
compiled step. On a 2-core CPU eight fake devices share two cores: the ratio is what carries over.

  python3 benchmarks/bench_sharded.py [--out results.md] [--gpt2] [--data-parallel]
"""

from __future__ import annotations

import argparse
import os
import re

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                             + " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402
import optax  # noqa: E402
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P  # noqa: E402

import jaxfuse  # noqa: E402
from _common import emit_table, fused_step, gpt2_small_shapes, optax_step  # noqa: E402
from bench_optim import make_tree, time_step  # noqa: E402


def mlp_shapes():
  """A 6-layer MLP with 25M params (weights and biases)."""
  dims = [2048] * 7
  return [s for a, b in zip(dims, dims[1:]) for s in ((a, b), (b,))]


def fsdp_spec(shape, n):
  for d in sorted(range(len(shape)), key=lambda d: -shape[d]):
    if shape[d] % n == 0:
      return P(*[None] * d, "fsdp")
  return P()


def place(tree, mesh, data_parallel=False):
  spec = lambda x: P() if data_parallel else fsdp_spec(x.shape, mesh.size)
  return {k: jax.device_put(x, NamedSharding(mesh, spec(x))) for k, x in tree.items()}


def collectives(text):
  return {name: len(re.findall(rf"\b{name}(-start)?\(", text))
          for name in ("all-gather", "all-reduce")}


def bench(label, shapes, kind, rows, data_parallel=False):
  axis_type = AxisType.Explicit if kind == "explicit" else AxisType.Auto
  mesh = jax.make_mesh((len(jax.devices()),), ("fsdp",), axis_types=(axis_type,))
  jf = lambda **o: optax.chain(jaxfuse.clip_by_global_norm(1.0), jaxfuse.adamw(1e-3, **o))
  variants = {
      "optax+clip": (optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3)), optax_step),
      "jf-fused+clip": (jf(), fused_step),
  }
  if data_parallel:
    variants["jf-fused+clip packed"] = (jf(packed=True), fused_step)
    variants["jf-fused+clip split"] = (jf(packed="fsdp"), fused_step)
  base = None
  with jax.set_mesh(mesh):
    for name, (tx, make) in variants.items():
      params, grads = (place(make_tree(shapes, seed), mesh, data_parallel) for seed in (0, 1))
      state = tx.init(params)  # eagerly: the moments take the params' shardings
      step = make(tx)
      compiled = step.lower(params, state, grads).compile()
      ms = time_step(step, params, state, grads)[0]
      base = base or ms
      c = collectives(compiled.as_text())
      rows.append((label, kind, name, ms, base / ms, c["all-gather"], c["all-reduce"],
                   compiled.memory_analysis().argument_size_in_bytes / 2**20))
      print(f"  {label} {kind} {name}: {ms:.1f} ms", flush=True)


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--out", help="also write the table here")
  ap.add_argument("--gpt2", action="store_true", help="add the GPT-2-small tree (124M params)")
  ap.add_argument("--data-parallel", action="store_true",
                  help="params and grads replicated; the state replicated, packed or split")
  args = ap.parse_args(argv)
  trees = [("MLP 25M", mlp_shapes())] + ([("GPT-2 small", gpt2_small_shapes())] if args.gpt2
                                          else [])
  if args.data_parallel:  # many small leaves: one all-gather per dtype
    trees.append(("1000 leaves x 4K", [(64, 64)] * 1000))
  rows = []
  for label, shapes in trees:
    for kind in ("auto", "explicit"):
      bench(label, shapes, kind, rows, args.data_parallel)
  devices = jax.devices()
  lines = [f"{len(devices)} x {devices[0].device_kind} ({devices[0].platform}), jax "
           f"{jax.__version__}, optax {optax.__version__}", "",
           "| tree | mesh | step | ms/step | vs optax | all-gathers | all-reduces | "
           "args MiB/device |", "|---|---|---|---:|---:|---:|---:|---:|"]
  lines += [f"| {t} | {k} | {n} | {ms:.1f} | {r:.2f}x | {g} | {a} | {mib:.1f} |"
            for t, k, n, ms, r, g, a, mib in rows]
  emit_table("\n".join(lines), args.out)


if __name__ == "__main__":
  main()
