"""jaxfuse.report on a GPT-2-small clip+AdamW step: jaxfuse's fused step against optax's chain.

Both steps are compiled for the default device, not run (the arrays are abstract, so it needs no
memory); it prints launches, bytes and peak memory side by side (see docs/report.md). Usage:

  python3 benchmarks/report_gpt2.py
"""

from __future__ import annotations

import argparse
import sys

import jax
import numpy as np
import optax

import jaxfuse
from _common import gpt2_small_shapes


def optimizer_steps(shapes, max_norm: float = 1.0, learning_rate: float = 1e-3,
                    weight_decay: float = 0.1):
  """(jaxfuse step, optax step, params, jaxfuse state, optax state, grads) for a clip+AdamW
  step over a tree of ``shapes`` (abstract: nothing is allocated). Each step donates params and
  state and returns them in that order."""
  params = {f"p{i:04d}": jax.ShapeDtypeStruct(s, np.float32) for i, s in enumerate(shapes)}
  jf_tx = optax.chain(jaxfuse.clip_by_global_norm(max_norm),
                      jaxfuse.adamw(learning_rate, weight_decay=weight_decay))
  optax_tx = optax.chain(optax.clip_by_global_norm(max_norm),
                         optax.adamw(learning_rate, weight_decay=weight_decay))

  def jf_step(p, s, g):
    return jaxfuse.fused_step(jf_tx, g, s, p)

  def optax_step(p, s, g):
    updates, s = optax_tx.update(g, s, p)
    return optax.apply_updates(p, updates), s

  donate = dict(donate_argnums=(0, 1))
  return (jax.jit(jf_step, **donate), jax.jit(optax_step, **donate), params,
          jax.eval_shape(jf_tx.init, params), jax.eval_shape(optax_tx.init, params), params)


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(
      description="Launches, bytes and memory of a GPT-2-small clip+AdamW step: jaxfuse's "
                  "fused step against optax's chain (compiled, not run).")
  parser.parse_args(argv)
  print(f"compiling both steps for {jax.devices()[0]} ...", file=sys.stderr, flush=True)
  jf_step, optax_step, params, jf_state, optax_state, grads = optimizer_steps(gpt2_small_shapes())
  r = jaxfuse.report(jf_step, params, jf_state, grads,
                     baseline=(optax_step, (params, optax_state, grads)))
  r.label, r.baseline.label = "jaxfuse", "optax"
  print(r)


if __name__ == "__main__":
  main()
