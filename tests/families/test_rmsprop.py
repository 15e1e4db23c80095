"""What is RMSprop's own (its variants, centered ones included, run through
test_conformance.py from the registry and cases.py)."""

import jax.numpy as jnp
import pytest

from jaxfuse import rmsprop


def test_rejects_a_real_state_for_complex_params():
  tx = rmsprop(1e-3)
  c = {"w": jnp.ones((3,), jnp.complex64)}
  with pytest.raises(ValueError, match=r"nu\['w'\] has float32\[3\], expected complex64\[3\]"):
    tx.update(c, tx.init({"w": jnp.ones((3,))}), c)
