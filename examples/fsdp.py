"""The main example's character model trained FSDP-style on 8 devices (fake CPU devices by
default): params, gradients and AdamW state split over a mesh axis, each device updating only its
own shards with jaxfuse's fused clip+AdamW, beside the same training with everything replicated.

    python3 examples/fsdp.py             # ~1 minute on a 2-core CPU
    python3 examples/fsdp.py --steps 20  # shorter

Prints the loss of both runs (the same computation, so the same losses up to summation order),
the optimizer-state bytes each device holds, the per-device argument and temporary memory of the
compiled steps (``memory_analysis``) and the step times.
"""

from __future__ import annotations

import argparse
import functools
import os
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P  # noqa: E402

import jaxfuse  # noqa: E402
from train_char_lm import (build_model_config, count_params, init_params, load_corpus,  # noqa: E402
                           loss_fn, make_optimizer, sample_batch)


def fsdp_spec(x: jax.Array, devices: int) -> P:
  """Split the largest dimension the mesh divides; replicate leaves with none (norm gains)."""
  dims = sorted(range(x.ndim), key=lambda d: -x.shape[d])
  for d in dims:
    if x.shape[d] % devices == 0:
      return P(*[None] * d, "fsdp")
  return P()


def make_step(cfg, tx, batch: int, seq_len: int, mesh):
  @functools.partial(jax.jit, donate_argnums=(0, 1))
  def step(params, opt_state, key, data):
    tokens = jax.lax.with_sharding_constraint(sample_batch(data, key, batch, seq_len),
                                              NamedSharding(mesh, P("fsdp")))  # data parallel
    loss, grads = jax.value_and_grad(loss_fn)(params, tokens, cfg)
    params, opt_state = jaxfuse.fused_step(tx, grads, opt_state, params)
    return params, opt_state, loss
  return step


def device0_bytes(tree) -> int:
  """Bytes of the tree's shards that live on the first device."""
  first = jax.devices()[0]
  return sum(s.data.nbytes for x in jax.tree.leaves(tree) for s in x.addressable_shards
             if s.device == first)


def run(name: str, sharded: bool, cfg, args, mesh, data) -> dict:
  tx, _ = make_optimizer(args.lr, args.steps, warmup=args.steps // 10)
  params = init_params(cfg, jax.random.key(0))
  n = mesh.devices.size
  specs = jax.tree.map(lambda x: fsdp_spec(x, n) if sharded else P(), params)
  params = jax.tree.map(lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), params, specs)
  state = tx.init(params)  # eagerly: the moments take the params' shardings
  step = make_step(cfg, tx, args.batch, args.seq_len, mesh)
  key = jax.random.key(1)
  memory = step.lower(params, state, key, data).compile().memory_analysis()
  state_bytes = device0_bytes(state)
  losses, times = [], []
  for i in range(args.steps):
    t0 = time.perf_counter()
    params, state, loss = step(params, state, jax.random.fold_in(key, i), data)
    losses.append(float(loss))  # waits for the step
    times.append(time.perf_counter() - t0)
    if (i + 1) % max(1, args.steps // 5) == 0:
      print(f"  {name:10s} step {i + 1:4d}  loss {losses[-1]:.4f}", flush=True)
  return dict(losses=losses, ms=1e3 * float(np.median(times[1:] or times)),
              state_bytes=state_bytes, args_bytes=memory.argument_size_in_bytes,
              temp_bytes=memory.temp_size_in_bytes)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--steps", type=int, default=60)
  parser.add_argument("--batch", type=int, default=16)
  parser.add_argument("--seq-len", type=int, default=64)
  parser.add_argument("--lr", type=float, default=3e-3)
  args = parser.parse_args()

  devices = jax.devices()
  mesh = jax.make_mesh((len(devices),), ("fsdp",), axis_types=(AxisType.Auto,))
  cfg = build_model_config(dim=128, n_layers=4, n_heads=4, n_kv_heads=2, max_seq_len=args.seq_len)
  corpus = np.frombuffer(load_corpus(1 << 20), np.uint8)
  data = jax.device_put(corpus, NamedSharding(mesh, P()))
  print(f"{len(devices)} {devices[0].platform} devices; model "
        f"{count_params(init_params(cfg, jax.random.key(0))) / 1e6:.2f}M params", flush=True)
  with jax.set_mesh(mesh):
    results = {name: run(name, sharded, cfg, args, mesh, data)
               for name, sharded in (("fsdp", True), ("replicated", False))}
  fsdp, rep = results["fsdp"], results["replicated"]
  drift = max(abs(a - b) for a, b in zip(fsdp["losses"], rep["losses"]))
  print(f"\nlargest loss difference between the runs over {args.steps} steps: {drift:.2e}")
  print(f"{'per device':38s} {'fsdp':>12s} {'replicated':>12s} {'ratio':>7s}")
  for label, key, unit in (("optimizer state (mu, nu), KiB", "state_bytes", 1024),
                           ("step arguments (memory_analysis), KiB", "args_bytes", 1024),
                           ("step temporaries, KiB", "temp_bytes", 1024),
                           ("step time, ms (median)", "ms", 1)):
    a, b = fsdp[key] / unit, rep[key] / unit
    print(f"{label:38s} {a:12.1f} {b:12.1f} {a / b:7.3f}")


if __name__ == "__main__":
  main()
