"""Host cost of a training step against the number of leaves: where a many-leaf model's time goes.

A flax ``TrainState`` step (gradients from ``jax.value_and_grad`` in the same jit, then
``apply_gradients``, the state donated) on models of 10, 100, 1000 and 10,000 leaves of mixed
shapes (about 3.6K params per leaf), per way of running the optimizer:

  optax            tx = optax.adamw, flax's TrainState (tx.update + optax.apply_updates)
  drop-in          tx = jaxfuse.adamw, flax's TrainState (the same XLA program as optax's)
  fused            jaxfuse.flax.TrainState: jaxfuse.fused_step in place
  fused packed     the same with jaxfuse.adamw(..., packed=True): the moments as one flat buffer
                   per dtype, so the optimizer state is a handful of arrays for any tree
  packed params    the params themselves packed (jaxfuse.pack), unpacked into views inside the step

Columns: ms per step (a loop of jitted calls, the median of interleaved rounds), dispatch ms (the
time the jitted call takes to return while the device is idle: flattening the arguments and
enqueueing the program; on the CPU backend the call also runs much of the program before it
returns), arguments ms (a jitted function that takes the same arguments and computes nothing:
the host's cost of passing these arrays, which a GPU host pays too), the jit's argument arrays
and the optimizer state's, and the seconds to lower and compile the step. Usage:

  python3 benchmarks/bench_host.py [--leaves 10,100,1000,10000] [--quick] [--out table.md]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxfuse
from _common import emit_table, versions_line

try:
  from flax.training import train_state as flax_train_state
except ImportError:  # flax is an optional extra
  sys.exit("bench_host.py needs flax (pip install 'jaxfuse[flax]')")

import jaxfuse.flax as jf_flax  # noqa: E402  (after the flax check)

LR, WD = 1e-3, 0.1
# A layer's leaves: two matrices with their biases and a norm scale (about 3.6K params a leaf).
SHAPES = [(64, 128), (128,), (96, 64), (64,), (64,)]


def mixed_tree(leaves: int, seed: int = 0) -> dict:
  rng = np.random.default_rng(seed)
  return {
      f"p{i:05d}": jnp.asarray(rng.standard_normal(SHAPES[i % len(SHAPES)], np.float32) * 0.1)
      for i in range(leaves)}


def loss_fn(params, x):
  # Elementwise in each leaf: the gradients cost one pass, so the optimizer's share shows. One
  # sum of the leaves' sums (a chain of 10,000 additions would dominate the compile).
  return jnp.sum(jnp.stack([jnp.sum(jnp.tanh(p * x)) for p in jax.tree.leaves(params)]))


def packed_loss_fn(packed, x):
  return loss_fn(jaxfuse.unpack(packed), x)


def variants():
  """(name, TrainState class, tx, pack the params) of each way to run the step."""
  return [("optax", flax_train_state.TrainState, optax.adamw(LR, weight_decay=WD), False),
          ("drop-in", flax_train_state.TrainState, jaxfuse.adamw(LR, weight_decay=WD), False),
          ("fused", jf_flax.TrainState, jaxfuse.adamw(LR, weight_decay=WD), False),
          ("fused packed", jf_flax.TrainState, jaxfuse.adamw(LR, weight_decay=WD, packed=True),
           False),
          ("packed params", jf_flax.TrainState, jaxfuse.adamw(LR, weight_decay=WD), True)]


def make_step(loss):
  def step(state, x):
    value, grads = jax.value_and_grad(loss)(state.params, x)
    return state.apply_gradients(grads=grads), value
  return step


def arguments_ms(args, calls: int = 20) -> float:
  """ms per call of a jitted function that takes these arguments and computes nothing (XLA keeps
  them, keep_unused): the host's cost of passing these arrays to a jit."""
  f = jax.jit(lambda a: jnp.zeros((), jnp.int32), keep_unused=True)
  out = f(args)
  jax.block_until_ready(out)
  t0 = time.perf_counter()
  for _ in range(calls):
    out = f(args)
  jax.block_until_ready(out)
  return 1e3 * (time.perf_counter() - t0) / calls


def time_interleaved(runs: list, x, min_time: float, rounds: int = 5) -> list:
  """Per run (compiled step, state): (ms/step samples, dispatch ms samples), the runs
  interleaved round by round so that drift in the machine's speed falls on all of them alike.
  The steps donate their states."""
  one = []
  for i, (compiled, state) in enumerate(runs):
    for _ in range(2):  # warm up, then one timed step
      t0 = time.perf_counter()
      state, value = compiled(state, x)
      jax.block_until_ready((state, value))
    one.append(time.perf_counter() - t0)
    runs[i] = (compiled, state)
  iters = int(max(2, min(50, min_time / rounds / max(one))))
  samples = [([], []) for _ in runs]
  for _ in range(rounds):
    for i, (compiled, state) in enumerate(runs):
      t0 = time.perf_counter()
      for _ in range(iters):
        state, value = compiled(state, x)
      jax.block_until_ready((state, value))
      samples[i][0].append(1e3 * (time.perf_counter() - t0) / iters)
      for _ in range(3):  # the call alone, the device idle
        t0 = time.perf_counter()
        state, value = compiled(state, x)
        samples[i][1].append(1e3 * (time.perf_counter() - t0))
        jax.block_until_ready((state, value))
      runs[i] = (compiled, state)
  return samples


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--leaves", default="10,100,1000,10000")
  parser.add_argument("--quick", action="store_true", help="short timings")
  parser.add_argument("--variants", default=None, help="comma-separated names (default: all)")
  parser.add_argument("--out", default=None, help="also write the table to this file")
  args = parser.parse_args(argv)
  min_time = 0.5 if args.quick else 3.0
  print(versions_line(), flush=True)
  rows = ["| leaves | params | variant | ms/step | vs optax | dispatch ms | arguments ms "
          "| argument arrays | state arrays | compile s |",
          "|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
  chosen = None if args.variants is None else set(args.variants.split(","))
  for leaves in [int(n) for n in args.leaves.split(",")]:
    params = mixed_tree(leaves)
    n = sum(p.size for p in jax.tree.leaves(params))
    x = jnp.float32(0.5)
    names, runs, facts = [], [], []
    for name, cls, tx, pack in variants():
      if chosen is not None and name not in chosen:
        continue
      p = jaxfuse.pack(params) if pack else jax.tree.map(jnp.copy, params)
      state = cls.create(apply_fn=None, params=p, tx=tx)
      arrays = len(jax.tree.leaves((state, x)))
      state_arrays = len(jax.tree.leaves(state.opt_state))
      step = make_step(packed_loss_fn if pack else loss_fn)
      t0 = time.perf_counter()
      compiled = jax.jit(step, donate_argnums=0).lower(state, x).compile()
      compile_s = time.perf_counter() - t0
      facts.append((arrays, state_arrays, compile_s, arguments_ms((state, x))))
      names.append(name)
      runs.append((compiled, state))
      print(f"# {leaves} leaves, {name}: compiled in {compile_s:.1f} s", flush=True)
    samples = time_interleaved(runs, x, min_time)
    del runs
    base = None
    for name, (steps, dispatches), (arrays, state_arrays, compile_s, ident) in zip(
        names, samples, facts):
      ms, dispatch = statistics.median(steps), statistics.median(dispatches)
      base = base or ms
      rows.append(f"| {leaves} | {n / 1e6:.2f}M | {name} | {ms:.2f} | {base / ms:.2f}x | "
                  f"{dispatch:.2f} | {ident:.2f} | {arrays} | {state_arrays} | {compile_s:.1f} |")
      print(rows[-1], flush=True)
  emit_table("\n".join(rows), args.out)


if __name__ == "__main__":
  main()
