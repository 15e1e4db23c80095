"""jaxfuse's RMSprop against optax.rmsprop, in lockstep (tests/family_helpers.py), on fresh
random trees. The kernels compute 1 / sqrt where optax calls lax.rsqrt (both correctly rounded
on the CPU): a step differs from optax's by a few roundings."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxfuse
from jaxfuse import rmsprop
from family_helpers import (fused_step_fn, grads_like, inject_hyperparams_run, lockstep,
                            rtol_for, upcast)
from helpers import assert_bitwise_equal, assert_trees_close, random_tree, ulp

SHAPES = [(), (0,), (1,), (3,), (7, 5), (301,)]
STEPS = 20
PATHS = ["optax", "fused"]
F32 = rtol_for(jnp.float32)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16, jnp.float64])
def test_matches_optax(device, path, dtype):
  with jax.enable_x64(dtype == jnp.float64):
    params = random_tree(1, SHAPES, dtype=dtype, device=device)
    kwargs = dict(learning_rate=1e-2, centered=True, momentum=0.9)
    p, _ = lockstep(rmsprop(**kwargs), optax.rmsprop(**kwargs), params, STEPS, path=path,
                    seed=2, rtol=rtol_for(dtype))
    assert jax.tree.map(lambda x: x.dtype, p) == jax.tree.map(lambda x: x.dtype, params)


OPTIONS = {
    "plain": dict(),
    "centered": dict(centered=True),
    "momentum": dict(momentum=0.9),
    "nesterov": dict(momentum=0.9, nesterov=True),
    "eps_outside_sqrt": dict(eps_in_sqrt=False, eps=1e-3),
    "bias_correction": dict(bias_correction=True, momentum=0.5),
    # Centered with bias correction: at step 1 the variance is 0 up to rounding; a large eps
    # keeps the step well conditioned (optax's own result is rounding noise otherwise).
    "centered_bias_correction": dict(centered=True, bias_correction=True, eps=0.1),
    "initial_scale": dict(initial_scale=1.0, decay=0.8),
    "schedule": dict(learning_rate=optax.linear_schedule(1e-2, 1e-3, 8), bias_correction=True),
}


# Every option through the kernels; the ones that change the XLA element math through both.
@pytest.mark.parametrize("option,path", [(o, "fused") for o in OPTIONS] +
                         [(o, "optax") for o in ("nesterov", "eps_outside_sqrt")])
def test_options(device, option, path):
  kwargs = dict(dict(learning_rate=1e-2), **OPTIONS[option])
  params = random_tree(3, SHAPES, device=device)
  lockstep(rmsprop(**kwargs), optax.rmsprop(**kwargs), params, 8, path=path, seed=4, rtol=F32)


def test_state_structure_matches_optax():
  params = {"w": jnp.ones((3, 4)), "b": jnp.ones((4,), jnp.bfloat16), "n": [jnp.ones(())]}
  for kwargs in (dict(), dict(centered=True), dict(momentum=0.9), dict(bias_correction=True),
                 dict(centered=True, momentum=0.9, bias_correction=True, initial_scale=0.5),
                 dict(learning_rate=optax.constant_schedule(1e-3), momentum=0.9)):
    kwargs = dict(dict(learning_rate=1e-3), **kwargs)
    sf, so = rmsprop(**kwargs).init(params), optax.rmsprop(**kwargs).init(params)
    assert jax.tree.structure(sf) == jax.tree.structure(so), kwargs
    assert [(x.shape, x.dtype) for x in jax.tree.leaves(sf)] == \
        [(x.shape, x.dtype) for x in jax.tree.leaves(so)], kwargs
    np.testing.assert_array_equal(np.asarray(sf[0].nu["w"]), np.asarray(so[0].nu["w"]))


def test_optax_state_continues_under_jaxfuse(device):
  """A checkpoint written by optax.rmsprop goes on under jaxfuse.rmsprop (the lockstep tests
  show the other direction at every step)."""
  params = random_tree(5, [(17,), (4, 3)], device=device)
  kwargs = dict(learning_rate=1e-2, centered=True, momentum=0.9, bias_correction=True, eps=0.1)
  to, tf = optax.rmsprop(**kwargs), rmsprop(**kwargs)
  p, s = params, to.init(params)
  for t in range(3):
    u, s = to.update(grads_like(t, params), s, p)
    p = optax.apply_updates(p, u)
  _, s = lockstep(tf, to, p, 2, path="fused", seed=3, rtol=F32, state=s)
  assert int(s[0].count) == 5


def test_fused_clip_and_grad_norm(device):
  params = random_tree(7, [(), (0,), (301,)], device=device)
  tf = optax.chain(jaxfuse.clip_by_global_norm(1.0), rmsprop(1e-2, momentum=0.9))
  to = optax.chain(optax.clip_by_global_norm(1.0), optax.rmsprop(1e-2, momentum=0.9))
  lockstep(tf, to, params, 5, path="fused", rtol=4 * F32)
  step = fused_step_fn(tf, return_grad_norm=True)
  g = grads_like(8, params)
  _, _, norm = step(params, tf.init(params), g)
  np.testing.assert_allclose(norm, optax.global_norm(g), rtol=4 * ulp(jnp.float32))


@pytest.mark.parametrize("path", PATHS)
def test_grad_scale(device, path):
  params = random_tree(9, SHAPES, device=device)
  lockstep(rmsprop(1e-2, momentum=0.9), optax.rmsprop(1e-2, momentum=0.9), params, 3,
           path=path, seed=10, rtol=F32, grad_scale=jnp.float32(1024.0))


def test_skip_nonfinite(device):
  params = random_tree(11, [(10,), (2, 3)], device=device)
  tx = rmsprop(1e-2, centered=True, momentum=0.9, bias_correction=True, skip_nonfinite=True)
  step = jax.jit(lambda p, s, g: jaxfuse.fused_step(tx, g, s, p))  # no donation: compared after
  params, state = step(params, tx.init(params), grads_like(0, params))
  for bad in (jnp.nan, -jnp.inf):
    g = jax.tree.map(lambda x: x.at[(0,) * x.ndim].set(bad), grads_like(1, params))
    new_params, new_state = step(params, state, g)
    assert_bitwise_equal((new_params, new_state[:-1]), (params, state[:-1]), f"{bad} grads")
    assert int(new_state[-1].skipped_steps) == int(state[-1].skipped_steps) + 1
    state = new_state
  assert int(state[0].count) == 1 and int(state[-1].skipped_steps) == 2


@pytest.mark.parametrize("path", PATHS)
def test_master_weights(device, path):
  """bf16 params with an fp32 master: the master follows optax.rmsprop on float32, step by
  step, and the params are its rounding."""
  params = random_tree(12, [(), (5,), (301,), (3, 17)], dtype=jnp.bfloat16, device=device)
  kwargs = dict(learning_rate=1e-2, centered=True, momentum=0.9)
  tf, to = rmsprop(**kwargs, master_weights=True), optax.rmsprop(**kwargs)
  state = tf.init(params)
  assert all(x.dtype == jnp.float32 for x in jax.tree.leaves((state[0], state[2], state[-1])))
  p = jax.tree.map(jnp.copy, params)  # donated
  upd_o = jax.jit(lambda g, s, p: (lambda u, s: (optax.apply_updates(p, u), s))(
      *to.update(upcast(g), s, p)))
  for t in range(5):
    g = grads_like(13 + t, params)
    master_r, s_r = upd_o(g, state[:-1], state[-1].master_params)
    if path == "fused":
      p, state = fused_step_fn(tf)(p, state, g)
    else:
      u, state = tf.update(g, state, p)
      p = optax.apply_updates(p, u)
    assert_trees_close(state[-1].master_params, master_r, rtol=F32, atol=F32, what=f"step {t}")
    assert_trees_close(state[:-1], s_r, rtol=F32, atol=F32, what=f"step {t} state")
    rounded = jax.tree.map(lambda x: x.astype(jnp.bfloat16), state[-1].master_params)
    if path == "fused":
      assert_bitwise_equal(p, rounded, "params vs the master's rounding")
    else:  # exact only within a factor 2 of the old params (see test_lion.py)
      assert_trees_close(p, rounded, rtol=ulp(jnp.bfloat16), atol=ulp(jnp.bfloat16) * 1e-2)


def test_inject_hyperparams(device):
  params = random_tree(14, [(13,), (2, 5)], device=device)
  pf, po, traces = inject_hyperparams_run(
      rmsprop, optax.rmsprop, dict(learning_rate=1e-2, decay=0.9, momentum=0.9),
      dict(learning_rate=3e-3, decay=0.8), params)
  assert_trees_close(pf, po, rtol=6 * F32, atol=0)
  assert traces == 1


def test_multi_steps(device):
  params = random_tree(16, [(21,), (4, 2)], device=device)
  tf = jaxfuse.multi_steps(rmsprop(1e-2, momentum=0.9), every_k_schedule=3)
  to = optax.MultiSteps(optax.rmsprop(1e-2, momentum=0.9), every_k_schedule=3)
  step = fused_step_fn(tf)
  upd_o = jax.jit(to.update)
  pf, sf, po, so = jax.tree.map(jnp.copy, params), tf.init(params), params, to.init(params)
  for t in range(7):
    g = grads_like(17 + t, params)
    pf, sf = step(pf, sf, g)
    u, so = upd_o(g, so, po)
    po = optax.apply_updates(po, u)
  assert_trees_close(pf, po, rtol=4 * F32, atol=0)
  assert_trees_close(sf, so, rtol=4 * F32, atol=4 * F32)


def test_rejects_bad_input():
  params = {"w": jnp.ones((3,)), "b": jnp.ones((2,))}
  tx = rmsprop(1e-3)
  state = tx.init(params)
  with pytest.raises(ValueError, match=r"nu\['w'\] has float32\[3\], expected complex64\[3\]"):
    c = {"w": jnp.ones((3,), jnp.complex64)}
    tx.update(c, tx.init({"w": jnp.ones((3,))}), c)
  with pytest.raises(ValueError, match=r"different tree structures.*only in params: \['b'\]"):
    tx.update({"w": jnp.ones((3,))}, state, params)
  with pytest.raises(ValueError, match=r"leaf \['b'\] has shape \(3,\) in grads"):
    fused_step_fn(tx)(params, state, {"w": jnp.ones((3,)), "b": jnp.ones((3,))})
  with pytest.raises(ValueError, match="opt_state does not match"):
    tx.update(params, rmsprop(1e-3, momentum=0.9).init(params), params)
