"""jaxfuse's sgd against optax.sgd, through the optax protocol and the fused in-place step."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxfuse import sgd
from jaxfuse._optim.families import sgd as _sgd
from helpers import assert_trees_close, random_tree, ulp
from optimizer_cases import (DTYPES, F32_RTOL, PATHS, SHAPES, assert_matches_optax,
                             check_clip_folded_in, check_grad_scale, check_inject_hyperparams,
                             check_master_weights, check_multi_steps, check_skip_nonfinite, grads,
                             jit_optax_step, jit_step)


CONFIGS = {
    "plain": (lambda m: m.sgd(0.1), 0.0),
    "momentum": (lambda m: m.sgd(0.05, momentum=0.9), 0.0),
    "nesterov": (lambda m: m.sgd(0.05, momentum=0.9, nesterov=True), 0.0),
    # optax rounds momentum * trace to the trace's bf16 (a Python float is weakly typed),
    # jaxfuse computes it in float32: the traces, and through them the params, drift apart by
    # up to a bf16 ulp per step.
    "trace_bf16": (lambda m: m.sgd(0.05, momentum=0.8, accumulator_dtype=jnp.bfloat16),
                   ulp(jnp.bfloat16)),
    "schedule": (lambda m: m.sgd(optax.linear_schedule(0.1, 0.01, 15), momentum=0.5), 0.0),
}


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("config", list(CONFIGS))
def test_matches_optax(device, config, dtype, path):
  if config in ("trace_bf16", "schedule") and dtype in (jnp.float16, jnp.float64):
    pytest.skip("the float32 and bfloat16 runs cover this option; the suite stays fast")
  make, extra_rtol = CONFIGS[config]
  with jax.enable_x64(dtype == jnp.float64):
    params = random_tree(0, SHAPES, dtype, device=device)
    assert_matches_optax(make(_sgd), make(optax), params, path, extra_rtol)


@pytest.mark.parametrize("path", PATHS)
def test_complex_leaves(device, path):
  """The math is linear: complex leaves are stepped per real and imaginary part, as optax."""
  params = random_tree(1, [(), (5,), (3, 4)], jnp.complex64, device=device)
  make = CONFIGS["nesterov"][0]
  assert_matches_optax(make(_sgd), make(optax), params, path, steps=5)


@pytest.mark.parametrize("config", list(CONFIGS))
def test_state_structure_matches_optax(config):
  make, _ = CONFIGS[config]
  params = {"w": jnp.ones((3, 4)), "b": jnp.ones((4,)), "nested": [jnp.ones(()), jnp.ones((0,))]}
  sf, so = make(_sgd).init(params), make(optax).init(params)
  assert jax.tree.structure(sf) == jax.tree.structure(so)
  for a, b in zip(jax.tree.leaves(sf), jax.tree.leaves(so)):
    assert a.shape == b.shape and a.dtype == b.dtype
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("writer", ["optax", "jaxfuse"])
def test_checkpoint_moves_between_optax_and_jaxfuse(device, writer):
  """A state written by one library continues under the other."""
  params = random_tree(2, [(17,), (4, 3)], device=device)
  txs = {"optax": optax.sgd(0.05, 0.9, nesterov=True), "jaxfuse": sgd(0.05, 0.9, nesterov=True)}
  p, s = params, txs[writer].init(params)
  for t in range(3):
    p, s = jit_optax_step(txs[writer])(p, s, grads(t, params))
  ends = {}
  for name, tx in txs.items():
    pp, ss = p, s
    for t in range(3, 6):
      pp, ss = jit_optax_step(tx)(pp, ss, grads(t, params))
    ends[name] = pp
  assert_trees_close(ends["jaxfuse"], ends["optax"], rtol=6 * F32_RTOL, atol=0)


def test_clip_and_grad_norm_folded_in(device):
  check_clip_folded_in(sgd(0.1, momentum=0.9), optax.sgd(0.1, momentum=0.9), "jaxfuse_sgd", device)


@pytest.mark.parametrize("path", PATHS)
def test_grad_scale(device, path):
  check_grad_scale(sgd(0.1, momentum=0.9), optax.sgd(0.1, momentum=0.9), path, device)


@pytest.mark.parametrize("path", PATHS)
def test_skip_nonfinite(device, path):
  tx = sgd(optax.linear_schedule(0.1, 0.0, 10), momentum=0.9, skip_nonfinite=True)
  check_skip_nonfinite(tx, path, device, count=lambda s: s[1].count)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("momentum", [None, 0.9])
def test_master_weights(device, path, momentum):
  check_master_weights(sgd(0.05, momentum, master_weights=True), optax.sgd(0.05, momentum), path,
                       device)


def test_inject_hyperparams(device):
  check_inject_hyperparams(optax.inject_hyperparams(sgd)(learning_rate=0.05, momentum=0.9),
                           optax.inject_hyperparams(optax.sgd)(learning_rate=0.05, momentum=0.9),
                           {"learning_rate": 0.01, "momentum": 0.5}, device)


@pytest.mark.parametrize("path", PATHS)
def test_multi_steps(device, path):
  check_multi_steps(sgd(0.1, momentum=0.9), optax.sgd(0.1, momentum=0.9), path, device)


def test_rejects_mismatched_trees():
  params = {"w": jnp.ones((3,)), "b": jnp.ones((2,))}
  tx = sgd(0.1, momentum=0.9)
  state = tx.init(params)
  with pytest.raises(ValueError, match=r"only in params: \['b'\]"):
    tx.update({"w": jnp.ones((3,))}, state, params)
  with pytest.raises(ValueError, match=r"leaf \['b'\] has shape \(3,\) in grads"):
    jit_step(tx)(params, state, {"w": jnp.ones((3,)), "b": jnp.ones((3,))})
  with pytest.raises(ValueError, match="opt_state does not match"):
    tx.update(params, optax.sgd(0.1).init(params), params)


def test_rejects_accumulator_dtype_that_does_not_fit():
  params = {"z": jnp.ones((3,), jnp.complex64)}
  with pytest.raises(ValueError, match=r"accumulator_dtype bfloat16 does not fit params leaf "
                                       r"\['z'\] \(complex64\)"):
    sgd(0.1, momentum=0.9, accumulator_dtype=jnp.bfloat16).init(params)
  with pytest.raises(ValueError, match="accumulator_dtype int32 is not supported"):
    sgd(0.1, momentum=0.9, accumulator_dtype=jnp.int32).init({"w": jnp.ones((3,))})
