"""Shared benchmark helpers."""

import argparse
import time

import jax
import jax.numpy as jnp


def best_seconds(run, reps: int, calls: int) -> float:
  """The best over `reps` tries of the seconds per call of run(calls), which makes `calls` calls
  and waits for the last."""
  best = float("inf")
  for _ in range(reps):
    t0 = time.perf_counter()
    run(calls)
    best = min(best, (time.perf_counter() - t0) / calls)
  return best


def copy_bandwidth(device, nbytes: int, reps: int = 5) -> float:
  """Device copy bandwidth in GB/s: y = x + 1 over nbytes of fp32, in place (the input is
  donated, so no fresh output buffer is allocated and first-touched each time), counting the
  read and the write."""
  f = jax.jit(lambda x: x + jnp.float32(1.0), donate_argnums=0)
  x = [f(jax.device_put(jnp.zeros((nbytes // 4,), jnp.float32), device))]

  def run(calls):
    for _ in range(calls):
      x[0] = f(x[0])
    x[0].block_until_ready()

  run(1)
  return 2 * nbytes / best_seconds(run, reps, 5) / 1e9


def read_bandwidth(device, nbytes: int, reps: int = 5) -> float:
  """Device read bandwidth in GB/s: a sum of nbytes of bf16 in XLA (fp32 accumulation), counting
  the bytes read: how fast XLA itself streams an operand it only reads."""
  f = jax.jit(lambda x: jnp.sum(x, dtype=jnp.float32))
  x = jax.device_put(jnp.ones((nbytes // 2,), jnp.bfloat16), device)

  def run(calls):
    for _ in range(calls):
      s = f(x)
    s.block_until_ready()

  run(1)
  return nbytes / best_seconds(run, reps, 3) / 1e9


def optax_step(tx):
  """A jitted optax-protocol step (params, state, grads) -> (params, state): tx.update, then
  optax.apply_updates; params and state donated."""
  import optax

  def step(params, state, grads):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state
  return jax.jit(step, donate_argnums=(0, 1))


def fused_step(tx):
  """A jitted jaxfuse.fused_step (params, state, grads) -> (params, state), params and state
  donated."""
  import jaxfuse
  return jax.jit(lambda p, s, g: jaxfuse.fused_step(tx, g, s, p), donate_argnums=(0, 1))


def device_arguments(doc: str, quick_help: str) -> argparse.ArgumentParser:
  """The arguments the decoder benchmarks share: --quick, --out (a markdown file for the
  tables) and --device (cpu or gpu; default gpu when usable); add the script's own to it."""
  ap = argparse.ArgumentParser(description=doc,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--quick", action="store_true", help=quick_help)
  ap.add_argument("--out", help="also write the markdown tables to this file")
  ap.add_argument("--device", choices=["cpu", "gpu"], help="default: gpu when usable")
  return ap


def versions_line() -> str:
  """What a train-step table was measured with: the device, jax, optax and jaxfuse."""
  import optax
  import jaxfuse
  return (f"# device: {jax.devices()[0].device_kind} ({jax.default_backend()}), jax "
          f"{jax.__version__}, optax {optax.__version__}, jaxfuse {jaxfuse.__version__}")


def emit_table(table: str, out_path=None) -> None:
  """Prints a result table and, if asked, writes it to a file (for RESULTS.md)."""
  print(table)
  if out_path:
    with open(out_path, "w") as f:
      f.write(table + "\n")


def gpt2_small_shapes() -> list[tuple[int, ...]]:
  """The 148 parameter shapes of GPT-2 small (124M parameters)."""
  return gpt2_shapes(768, 12)


def gpt2_medium_shapes() -> list[tuple[int, ...]]:
  """The 292 parameter shapes of GPT-2 medium (355M parameters)."""
  return gpt2_shapes(1024, 24)


def gpt2_shapes(d: int, layers: int) -> list[tuple[int, ...]]:
  vocab, n_ctx = 50257, 1024
  shapes = [(vocab, d), (n_ctx, d)]
  for _ in range(layers):
    shapes += [(d,), (d,), (d, 3 * d), (3 * d,), (d, d), (d,), (d,), (d,), (d, 4 * d), (4 * d,),
               (4 * d, d), (d,)]
  return shapes + [(d,), (d,)]


def device_ms_per_call(run, calls: int) -> float | None:
  """Device time per call from the profiler's trace: the summed durations of the events on the
  GPU's stream timelines (kernels and copies, as CUPTI records them) while run(calls) makes
  `calls` calls and waits for the last, over `calls`. Kernel time only: gaps between kernels
  and the host's dispatch are not in it, so a step whose wall time is far above it is
  host-bound. None where there is no device timeline (the CPU)."""
  import glob
  import gzip
  import json
  import tempfile

  if jax.devices()[0].platform != "gpu":
    return None

  with tempfile.TemporaryDirectory() as log_dir:
    with jax.profiler.trace(log_dir, create_perfetto_trace=True):
      run(calls)
    paths = glob.glob(f"{log_dir}/**/perfetto_trace.json.gz", recursive=True)
    if not paths:
      return None
    with gzip.open(paths[0]) as f:
      trace = json.load(f)
  events = trace["traceEvents"] if isinstance(trace, dict) else trace
  gpus = {e["pid"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"
          and "GPU" in e["args"].get("name", "")}
  streams = {(e["pid"], e["tid"]) for e in events
             if e.get("ph") == "M" and e.get("name") == "thread_name" and e["pid"] in gpus
             and e["args"].get("name", "").startswith("Stream")}
  busy_us = sum(e.get("dur", 0) for e in events
                if e.get("ph") == "X" and (e.get("pid"), e.get("tid")) in streams)
  return busy_us / 1e3 / calls if streams else None
