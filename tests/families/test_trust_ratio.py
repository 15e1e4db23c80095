"""What is LAMB's and LARS's own (the trust-ratio families: a first pass of per-leaf sums, then
the step with each leaf's ratio); what every family passes is test_conformance.py."""

import jax
import jax.numpy as jnp
import optax
import pytest

import jaxfuse
from helpers import count_custom_calls, random_tree
from lockstep import jit_fused, lockstep, training_tree


@pytest.mark.parametrize("path", ["fused", "optax"])
@pytest.mark.parametrize("family", ["lamb", "lars"])
def test_zero_norm_leaves_keep_ratio_one(device, family, path):
  """A leaf of zero params (or of a zero direction) takes ratio 1, as optax's."""
  params = jax.device_put({"zero": jnp.zeros((6,)), "w": jnp.ones((4,))}, device)
  g = {"zero": jnp.arange(6.0) - 2.5, "w": jnp.zeros((4,))}
  p, _ = lockstep(getattr(jaxfuse, family)(1e-2), getattr(optax, family)(1e-2), params, 1,
                  path=path, grads=lambda t, p: jax.device_put(g, device))
  assert float(jnp.max(jnp.abs(p["zero"]))) > 0  # it moved


def test_many_leaves_take_several_calls(device):
  """More leaves than one call takes (256): each call's sums are its own leaves'."""
  params = random_tree(13, [(3 + i % 5,) for i in range(300)], device=device)
  make = lambda m: m.lamb(1e-2, weight_decay=0.1, mask=lambda p: jax.tree.map(
      lambda x: x.shape[0] % 2 == 0, p))
  tx = make(jaxfuse)
  state = jax.jit(tx.init)(params)
  hlo = jit_fused(tx).lower(params, state, training_tree(1, params)).as_text()
  assert count_custom_calls(hlo, "jaxfuse_lamb_trust_sums") == 2
  lockstep(tx, make(optax), params, 1, path="fused", state=state)


