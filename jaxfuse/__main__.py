"""``python -m jaxfuse``: what this install holds and whether it runs.

Prints the versions, what each backend's handlers were built from and whether it is usable (or
why not), then runs one fused optimizer step and one global norm on each usable backend against
plain JAX. Exits non-zero when a usable backend's handlers fail or disagree.
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxfuse
from jaxfuse._core import install


def self_test(device: jax.Device) -> str:
  """One AdamW step in place and one global norm on `device`, each against its reference;
  returns what differs ("" when nothing does)."""
  keys = jax.random.split(jax.random.key(0), 2)
  params = {"w": jax.random.normal(keys[0], (64, 33)), "b": jnp.linspace(-1.0, 1.0, 7)}
  grads = jax.tree.map(lambda p: 0.1 * jnp.cos(p), params)
  params, grads = jax.device_put((params, grads), device)
  tx = jaxfuse.adamw(1e-2)
  expected = optax.apply_updates(params, tx.update(grads, tx.init(params), params)[0])
  step = jax.jit(lambda g, s, p: jaxfuse.fused_step(tx, g, s, p), donate_argnums=(1, 2))
  got, _ = step(grads, tx.init(params), jax.tree.map(jnp.copy, params))
  norm = jax.jit(jaxfuse.global_norm)(grads)
  problems = []
  for name in params:
    if not np.allclose(got[name], expected[name], rtol=1e-6, atol=1e-7):
      problems.append(f"the fused AdamW step differs from the optax protocol on leaf {name}")
  if not np.isclose(norm, optax.global_norm(grads), rtol=1e-6):
    problems.append(f"global_norm gave {float(norm)}, expected {float(optax.global_norm(grads))}")
  return "; ".join(problems)


def main() -> int:
  backends = jaxfuse.backends()
  print(install.summary(backends))
  failed = not backends["cpu"]["usable"]
  for name, platform in (("cpu", "cpu"), ("cuda", "cuda")):
    if not backends[name]["usable"]:
      continue
    device = jax.devices(platform)[0]
    try:
      problem = self_test(device)
    except Exception as e:  # what a user would see at their first call, in one line
      problem = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    print(f"  {name} self-test on {device}: {problem or 'ok'}")
    failed |= bool(problem)
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main())
