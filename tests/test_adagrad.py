"""jaxfuse's adagrad against optax.adagrad, through the optax protocol and the fused step."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxfuse
from jaxfuse import _adagrad
from jaxfuse import adagrad
from helpers import assert_trees_close, count_custom_calls, random_tree, ulp
from optimizer_cases import (DTYPES, PATHS, SHAPES, assert_matches_optax, grads, jit_optax_step,
                             jit_step, run_both)

F32_RTOL = 8 * ulp(jnp.float32)

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
  params = random_tree(3, SHAPES, device=device)
  tf = optax.chain(jaxfuse.clip_by_global_norm(0.5), adagrad(0.1))
  to = optax.chain(optax.clip_by_global_norm(0.5), optax.adagrad(0.1))
  g = grads(4, params)
  fn = lambda p, s, g: jaxfuse.fused_step(tf, g, s, p, return_grad_norm=True)
  assert count_custom_calls(jax.jit(fn).lower(params, tf.init(params), g).as_text(),
                            "jaxfuse_adagrad") == 1
  pf, sf, norm = jax.jit(fn)(params, tf.init(params), g)
  po, so = jit_optax_step(to)(params, to.init(params), g)
  np.testing.assert_allclose(norm, optax.tree.norm(g), rtol=2 * F32_RTOL)
  assert_trees_close((pf, sf), (po, so), rtol=4 * F32_RTOL, atol=0)


@pytest.mark.parametrize("path", PATHS)
def test_grad_scale(device, path):
  params = random_tree(5, [(33,), (4, 4)], device=device)
  g = grads(6, params)
  scale = jnp.float32(1024.0)
  g_scaled = jax.tree.map(lambda x: x * scale, g)
  tf, to = adagrad(0.1), optax.adagrad(0.1)
  if path == "fused":
    pf, sf = jax.jit(lambda p, s, g: jaxfuse.fused_step(tf, g, s, p, grad_scale=scale))(
        params, tf.init(params), g_scaled)
  else:
    u, sf = tf.update(g_scaled, tf.init(params), params, grad_scale=scale)
    pf = optax.apply_updates(params, u)
  po, so = jit_optax_step(to)(params, to.init(params), g)
  assert_trees_close((pf, sf), (po, so), rtol=2 * F32_RTOL, atol=0)


@pytest.mark.parametrize("path", PATHS)
def test_skip_nonfinite(device, path):
  params = random_tree(7, [(10,), (2, 3)], device=device)
  tx = adagrad(optax.linear_schedule(0.1, 0.0, 10), skip_nonfinite=True)
  step = jax.jit(lambda p, s, g: jaxfuse.fused_step(tx, g, s, p)) if path == "fused" \
      else jit_optax_step(tx)  # no donation: compared afterwards
  params, state = step(params, tx.init(params), grads(8, params))
  g = jax.tree.map(lambda x: x.at[(0,) * x.ndim].set(jnp.nan), grads(9, params))
  new_params, new_state = step(params, state, g)
  for a, b in zip(jax.tree.leaves((new_params, new_state[:-1])),
                  jax.tree.leaves((params, state[:-1]))):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert int(new_state[1].count) == 1 and int(new_state[-1].skipped_steps) == 1


@pytest.mark.parametrize("path", PATHS)
def test_master_weights(device, path):
  master0 = random_tree(10, [(), (5,), (301,)], jnp.bfloat16, device=device)
  params = master0
  tf, to = adagrad(0.01, master_weights=True), optax.adagrad(0.01)
  pf, sf, po, _ = run_both(tf, to, params, path)
  master = sf[-1].master_params
  assert all(x.dtype == jnp.float32 for x in jax.tree.leaves((master, sf[0])))
  assert_trees_close(master, po, rtol=20 * F32_RTOL, atol=0, what="master")
  if path == "fused":  # the params are the master's rounding
    for p, m in zip(jax.tree.leaves(pf), jax.tree.leaves(master)):
      np.testing.assert_array_equal(np.asarray(p, np.float32),
                                    np.asarray(m.astype(jnp.bfloat16), np.float32))


def test_inject_hyperparams(device):
  params = random_tree(11, [(13,), (2, 5)], device=device)
  tf = optax.inject_hyperparams(adagrad)(learning_rate=0.05, eps=1e-6)
  to = optax.inject_hyperparams(optax.adagrad)(learning_rate=0.05, eps=1e-6)
  traces = []
  step_f = jax.jit(lambda p, s, g: (traces.append(1), jaxfuse.fused_step(tf, g, s, p))[1])
  step_o = jit_optax_step(to)
  pf = po = params
  sf, so = tf.init(params), to.init(params)
  for t in range(6):
    if t == 3:
      for s in (sf, so):
        s.hyperparams["learning_rate"] = jnp.full_like(s.hyperparams["learning_rate"], 0.01)
    g = grads(t, params)
    pf, sf = step_f(pf, sf, g)
    po, so = step_o(po, so, g)
  assert_trees_close(pf, po, rtol=8 * F32_RTOL, atol=0)
  assert len(traces) == 1


@pytest.mark.parametrize("path", PATHS)
def test_multi_steps(device, path):
  params = random_tree(12, [(21,), (4, 2)], device=device)
  tf = jaxfuse.multi_steps(adagrad(0.1), every_k_schedule=3)
  to = optax.MultiSteps(optax.adagrad(0.1), every_k_schedule=3)
  pf, sf, po, _ = run_both(tf, to, params, path, steps=9)
  assert int(sf.gradient_step) == 3
  assert_trees_close(pf, po, rtol=9 * F32_RTOL, atol=0)


def test_rejects_complex_leaves():
  params = {"w": jnp.ones((3,)), "z": jnp.ones((2,), jnp.complex64)}
  with pytest.raises(TypeError, match=r"params leaf \['z'\] is complex64; .*real leaves only"):
    adagrad(0.1).init(params)
  real = {"w": jnp.ones((3,)), "z": jnp.ones((2,))}
  tx = adagrad(0.1)
  with pytest.raises(TypeError, match=r"params leaf \['z'\] is complex64"):
    jax.jit(tx.update)(params, tx.init(real), params)


def test_rejects_mismatched_trees():
  params = {"w": jnp.ones((3,)), "b": jnp.ones((2,))}
  tx = adagrad(0.1)
  state = tx.init(params)
  with pytest.raises(ValueError, match=r"only in params: \['b'\]"):
    tx.update({"w": jnp.ones((3,))}, state, params)
  with pytest.raises(ValueError, match=r"leaf \['b'\] has shape \(3,\) in grads"):
    jit_step(tx)(params, state, {"w": jnp.ones((3,)), "b": jnp.ones((3,))})
