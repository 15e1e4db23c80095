"""What is SGD's own; what every family passes is test_conformance.py."""

import jax.numpy as jnp
import pytest

from jaxfuse import sgd


def test_rejects_accumulator_dtype_that_does_not_fit():
  params = {"z": jnp.ones((3,), jnp.complex64)}
  with pytest.raises(ValueError, match=r"accumulator_dtype bfloat16 does not fit params leaf "
                                       r"\['z'\] \(complex64\)"):
    sgd(0.1, momentum=0.9, accumulator_dtype=jnp.bfloat16).init(params)
  with pytest.raises(ValueError, match="accumulator_dtype int32 is not supported"):
    sgd(0.1, momentum=0.9, accumulator_dtype=jnp.int32).init({"w": jnp.ones((3,))})
