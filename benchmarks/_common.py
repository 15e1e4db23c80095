"""Shared benchmark helpers."""

import time

import jax
import jax.numpy as jnp


def copy_bandwidth(device, nbytes: int, reps: int = 5) -> float:
  """Device copy bandwidth in GB/s: y = x + 1 over nbytes of fp32, in place (the input is
  donated, so no fresh output buffer is allocated and first-touched each time), counting the
  read and the write."""
  f = jax.jit(lambda x: x + jnp.float32(1.0), donate_argnums=0)
  x = f(jax.device_put(jnp.zeros((nbytes // 4,), jnp.float32), device))
  x.block_until_ready()
  best = float("inf")
  for _ in range(reps):
    t0 = time.perf_counter()
    for _ in range(5):
      x = f(x)
    x.block_until_ready()
    best = min(best, (time.perf_counter() - t0) / 5)
  return 2 * nbytes / best / 1e9


def emit_table(table: str, out_path=None) -> None:
  """Prints a result table and, if asked, writes it to a file (for RESULTS.md)."""
  print(table)
  if out_path:
    with open(out_path, "w") as f:
      f.write(table + "\n")


def gpt2_small_shapes() -> list[tuple[int, ...]]:
  """The 148 parameter shapes of GPT-2 small (124M parameters)."""
  d, vocab, n_ctx, layers = 768, 50257, 1024, 12
  shapes = [(vocab, d), (n_ctx, d)]
  for _ in range(layers):
    shapes += [(d,), (d,), (d, 3 * d), (3 * d,), (d, d), (d,), (d,), (d,), (d, 4 * d), (4 * d,),
               (4 * d, d), (d,)]
  return shapes + [(d,), (d,)]
