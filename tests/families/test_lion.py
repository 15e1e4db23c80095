"""What is Lion's own: the sign of a zero and of a NaN; what every family passes is
test_conformance.py (complex params refused, as optax.lion takes none, among them), where the
elements whose sign may flip within rounding are left out (cases.py)."""

import jax
import jax.numpy as jnp
import numpy as np

from jaxfuse import lion
from helpers import assert_bitwise_equal, random_tree
from lockstep import jit_fused


def test_sign_of_zero_and_nan(device):
  """sign(+-0) = +-0: zero gradients on a zero momentum leave the params as they are; a NaN
  gradient makes its element (only) NaN, as in optax."""
  params = random_tree(6, [(5,), (4,)], device=device)
  tx = lion(1e-2, weight_decay=0.0)
  state = tx.init(params)
  zeros = jax.tree.map(jnp.zeros_like, params)
  step = jit_fused(tx)
  p, s = step(jax.tree.map(jnp.copy, params), state, zeros)
  assert_bitwise_equal(p, params, "params after zero grads")
  g = {"leaf0000": zeros["leaf0000"].at[2].set(jnp.nan), "leaf0001": zeros["leaf0001"]}
  p, s = step(p, s, g)
  assert np.isnan(np.asarray(p["leaf0000"])).tolist() == [False, False, True, False, False]
  assert_bitwise_equal(p["leaf0001"], params["leaf0001"], "params of the finite leaf")

