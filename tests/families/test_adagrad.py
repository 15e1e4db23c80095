"""jaxfuse's adagrad against optax.adagrad, through the optax protocol and the fused step."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxfuse import adagrad
from jaxfuse._optim.families import adagrad as _adagrad
from helpers import random_tree
from optimizer_cases import (DTYPES, PATHS, SHAPES, assert_matches_optax, check_clip_folded_in,
                             check_grad_scale, check_inject_hyperparams, check_master_weights,
                             check_multi_steps, check_skip_nonfinite, jit_optax_step, jit_step)


CONFIGS = {
    "default": lambda m: m.adagrad(0.1),
    "options": lambda m: m.adagrad(0.05, initial_accumulator_value=0.5, eps=1e-3),
    "zero_start": lambda m: m.adagrad(optax.linear_schedule(0.1, 0.01, 15),
                                      initial_accumulator_value=0.0),
}


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("config", list(CONFIGS))
def test_matches_optax(device, config, dtype, path):
  make = CONFIGS[config]
  with jax.enable_x64(dtype == jnp.float64):
    params = random_tree(0, SHAPES, dtype, device=device)
    assert_matches_optax(make(_adagrad), make(optax), params, path)


@pytest.mark.parametrize("path", PATHS)
def test_zero_gradient_on_zero_start(device, path):
  """s stays 0: the update is 0 (optax's s > 0 guard), not 0 / sqrt(eps)."""
  params = {"w": jnp.ones((5,))}
  tx = adagrad(0.1, initial_accumulator_value=0.0)
  step = jit_step(tx) if path == "fused" else jit_optax_step(tx)
  p, s = step(params, tx.init(params), {"w": jnp.zeros((5,))})
  np.testing.assert_array_equal(np.asarray(p["w"]), np.ones(5))
  np.testing.assert_array_equal(np.asarray(s[0].sum_of_squares["w"]), np.zeros(5))


@pytest.mark.parametrize("config", list(CONFIGS))
def test_state_structure_matches_optax(config):
  params = {"w": jnp.ones((3, 4)), "b": jnp.ones((4,)), "nested": [jnp.ones(()), jnp.ones((0,))]}
  sf, so = CONFIGS[config](_adagrad).init(params), CONFIGS[config](optax).init(params)
  assert jax.tree.structure(sf) == jax.tree.structure(so)
  for a, b in zip(jax.tree.leaves(sf), jax.tree.leaves(so)):
    assert a.shape == b.shape and a.dtype == b.dtype
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_clip_and_grad_norm_folded_in(device):
  check_clip_folded_in(adagrad(0.1), optax.adagrad(0.1), "jaxfuse_adagrad", device)


@pytest.mark.parametrize("path", PATHS)
def test_grad_scale(device, path):
  check_grad_scale(adagrad(0.1), optax.adagrad(0.1), path, device)


@pytest.mark.parametrize("path", PATHS)
def test_skip_nonfinite(device, path):
  tx = adagrad(optax.linear_schedule(0.1, 0.0, 10), skip_nonfinite=True)
  check_skip_nonfinite(tx, path, device, count=lambda s: s[1].count)


@pytest.mark.parametrize("path", PATHS)
def test_master_weights(device, path):
  check_master_weights(adagrad(0.01, master_weights=True), optax.adagrad(0.01), path, device)


def test_inject_hyperparams(device):
  check_inject_hyperparams(optax.inject_hyperparams(adagrad)(learning_rate=0.05, eps=1e-6),
                           optax.inject_hyperparams(optax.adagrad)(learning_rate=0.05, eps=1e-6),
                           {"learning_rate": 0.01}, device, steps=6)


@pytest.mark.parametrize("path", PATHS)
def test_multi_steps(device, path):
  check_multi_steps(adagrad(0.1), optax.adagrad(0.1), path, device)


def test_rejects_a_real_state_for_complex_params():
  params = {"w": jnp.ones((3,)), "z": jnp.ones((2,), jnp.complex64)}
  real = {"w": jnp.ones((3,)), "z": jnp.ones((2,))}
  tx = adagrad(0.1)
  with pytest.raises(ValueError, match=r"sum_of_squares\['z'\] has float32\[2\], expected "
                                       r"complex64\[2\]"):
    jax.jit(tx.update)(params, tx.init(real), params)


def test_rejects_mismatched_trees():
  params = {"w": jnp.ones((3,)), "b": jnp.ones((2,))}
  tx = adagrad(0.1)
  state = tx.init(params)
  with pytest.raises(ValueError, match=r"only in params: \['b'\]"):
    tx.update({"w": jnp.ones((3,))}, state, params)
  with pytest.raises(ValueError, match=r"leaf \['b'\] has shape \(3,\) in grads"):
    jit_step(tx)(params, state, {"w": jnp.ones((3,)), "b": jnp.ones((3,))})
