"""What is Adagrad's own; what every family passes is test_conformance.py."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxfuse import adagrad
from lockstep import jit_step


@pytest.mark.parametrize("path", ["fused", "optax"])
def test_zero_gradient_on_zero_start(device, path):
  """s stays 0: the update is 0 (optax's s > 0 guard), not 0 / sqrt(eps)."""
  params = jax.device_put({"w": jnp.ones((5,))}, device)
  tx = adagrad(0.1, initial_accumulator_value=0.0)
  p, s = jit_step(path, tx)(params, tx.init(params), {"w": jnp.zeros((5,))})
  np.testing.assert_array_equal(np.asarray(p["w"]), np.ones(5))
  np.testing.assert_array_equal(np.asarray(s[0].sum_of_squares["w"]), np.zeros(5))


def test_rejects_a_real_state_for_complex_params():
  params = {"w": jnp.ones((3,)), "z": jnp.ones((2,), jnp.complex64)}
  real = {"w": jnp.ones((3,)), "z": jnp.ones((2,))}
  tx = adagrad(0.1)
  with pytest.raises(ValueError, match=r"sum_of_squares\['z'\] has float32\[2\], expected "
                                       r"complex64\[2\]"):
    jax.jit(tx.update)(params, tx.init(real), params)
