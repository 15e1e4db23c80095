"""What is Lion's own: the sign of a zero and of a NaN, complex params refused (optax.lion takes
none); what every family passes is test_conformance.py, where the elements whose sign may flip
within rounding are left out (cases.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxfuse import lion
from helpers import assert_bitwise_equal, random_tree
from lockstep import jit_fused as fused_step_fn


def test_sign_of_zero_and_nan(device):
  """sign(+-0) = +-0: zero gradients on a zero momentum leave the params as they are; a NaN
  gradient makes its element (only) NaN, as in optax."""
  params = random_tree(6, [(5,), (4,)], device=device)
  tx = lion(1e-2, weight_decay=0.0)
  state = tx.init(params)
  zeros = jax.tree.map(jnp.zeros_like, params)
  p, s = fused_step_fn(tx)(jax.tree.map(jnp.copy, params), state, zeros)
  assert_bitwise_equal(p, params, "params after zero grads")
  g = {"leaf0000": zeros["leaf0000"].at[2].set(jnp.nan), "leaf0001": zeros["leaf0001"]}
  p, s = fused_step_fn(tx)(p, s, g)
  assert np.isnan(np.asarray(p["leaf0000"])).tolist() == [False, False, True, False, False]
  assert_bitwise_equal(p["leaf0001"], params["leaf0001"], "params of the finite leaf")


def test_rejects_complex_params():
  params = {"w": jnp.ones((3,)), "z": jnp.ones((2,), jnp.complex64)}
  with pytest.raises(TypeError, match=r"jaxfuse.lion: params leaf \['z'\] is complex64"):
    lion(1e-3).init(params)
  real = {"w": jnp.ones((3,)), "z": jnp.ones((2,))}
  tx = lion(1e-3)
  with pytest.raises(TypeError, match=r"params leaf \['z'\] is complex64"):
    tx.update(params, tx.init(real), params)
