"""jaxfuse's Lion against optax.lion, in lockstep (family_helpers.py), on fresh random trees.

Lion's update is sign(x), x = (1 - b1) * g + b1 * mu: where x is within a few roundings of zero,
a multiply-add contracted differently (the kernels and XLA fuse as they see fit) may flip the
sign, and both results are right. Those elements, and only those, are left out of the update
and params comparison (`near_zero`); the momentum does not depend on the sign and is always
compared. With random normal inputs they are about one in a million elements."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxfuse
from jaxfuse import lion
from family_helpers import (fused_step_fn, grads_like, inject_hyperparams_run, lockstep,
                            rtol_for, upcast)
from helpers import assert_bitwise_equal, assert_trees_close, random_tree, ulp

SHAPES = [(), (0,), (1,), (3,), (7, 5), (301,)]
STEPS = 20
PATHS = ["optax", "fused"]


def near_zero(b1=0.9, mu=lambda s: s[0].mu):
  """The masks of elements whose x is within a few roundings of 0 (see the module docstring)."""

  def masks(g, state):
    def leaf(g, m):
      g, m = np.asarray(g, np.float64), np.asarray(m, np.float64)
      a, b = (1.0 - b1) * g, b1 * m
      eps = 8 * ulp(jnp.float32)  # the compute type of 16- and 32-bit leaves; float64 is finer
      return np.abs(a + b) <= eps * (np.abs(a) + np.abs(b))
    return jax.tree.map(leaf, g, mu(state))

  return masks


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16, jnp.float64])
def test_matches_optax(device, path, dtype):
  with jax.enable_x64(dtype == jnp.float64):
    params = random_tree(1, SHAPES, dtype=dtype, device=device)
    p, s = lockstep(lion(1e-2, weight_decay=0.1), optax.lion(1e-2, weight_decay=0.1), params,
                    STEPS, path=path, seed=2, rtol=rtol_for(dtype), near_zero=near_zero())
    assert jax.tree.map(lambda x: x.dtype, p) == jax.tree.map(lambda x: x.dtype, params)
    assert int(s[0].count) == STEPS


def _mask_every_other(params):
  return {k: i % 2 == 0 for i, k in enumerate(sorted(params))}


OPTIONS = {
    # bf16 momentum: x is formed from the bf16 mu in both; mu rounds once to bf16.
    "mu_bf16": dict(kwargs=dict(mu_dtype=jnp.bfloat16), rtol=ulp(jnp.bfloat16)),
    "mask_callable": dict(kwargs=dict(weight_decay=0.3, mask=_mask_every_other)),
    "mask_tree": dict(kwargs=dict(weight_decay=0.3, mask={f"leaf{i:04d}": i < 3
                                                         for i in range(len(SHAPES))})),
    "no_weight_decay": dict(kwargs=dict(weight_decay=0.0)),
    "schedules": dict(kwargs=dict(learning_rate=optax.linear_schedule(1e-2, 1e-3, 8),
                                  weight_decay=optax.linear_schedule(0.1, 0.0, 8), b1=0.8,
                                  b2=0.95)),
}


# Every option through the kernels; the ones that change the XLA element math through both.
@pytest.mark.parametrize("option,path", [(o, "fused") for o in OPTIONS] +
                         [("mu_bf16", "optax"), ("mask_callable", "optax")])
def test_options(device, option, path):
  case = OPTIONS[option]
  kwargs = dict(dict(learning_rate=1e-2), **case["kwargs"])
  params = random_tree(3, SHAPES, device=device)
  lockstep(lion(**kwargs), optax.lion(**kwargs), params, 8, path=path, seed=4,
           rtol=case.get("rtol", rtol_for(jnp.float32)),
           near_zero=near_zero(kwargs.get("b1", 0.9)))


def test_state_structure_matches_optax():
  params = {"w": jnp.ones((3, 4)), "b": jnp.ones((4,), jnp.bfloat16), "n": [jnp.ones(())]}
  for kwargs in (dict(), dict(weight_decay=0.0), dict(mu_dtype=jnp.bfloat16),
                 dict(mask={"w": True, "b": False, "n": True}),
                 dict(learning_rate=optax.constant_schedule(1e-3),
                      weight_decay=optax.constant_schedule(0.1))):
    kwargs = dict(dict(learning_rate=1e-3), **kwargs)
    sf, so = lion(**kwargs).init(params), optax.lion(**kwargs).init(params)
    assert jax.tree.structure(sf) == jax.tree.structure(so), kwargs
    assert [(x.shape, x.dtype) for x in jax.tree.leaves(sf)] == \
        [(x.shape, x.dtype) for x in jax.tree.leaves(so)], kwargs


def test_optax_state_continues_under_jaxfuse(device):
  """A checkpoint written by optax.lion goes on under jaxfuse.lion (the lockstep tests show the
  other direction: optax continues from jaxfuse's state at every step)."""
  params = random_tree(5, [(17,), (4, 3)], device=device)
  to, tf = optax.lion(1e-2), lion(1e-2)
  p, s = params, to.init(params)
  for t in range(3):
    u, s = to.update(grads_like(t, params), s, p)
    p = optax.apply_updates(p, u)
  _, s = lockstep(tf, to, p, 2, path="fused", seed=3, rtol=rtol_for(jnp.float32),
                  near_zero=near_zero(), state=s)
  assert int(s[0].count) == 5


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


def test_fused_clip_and_grad_norm(device):
  params = random_tree(7, [(), (0,), (301,)], device=device)
  tf = optax.chain(jaxfuse.clip_by_global_norm(1.0), lion(1e-2))
  to = optax.chain(optax.clip_by_global_norm(1.0), optax.lion(1e-2))
  clip = jax.jit(lambda g: optax.clip_by_global_norm(1.0).update(g, optax.EmptyState())[0])
  masks = near_zero(mu=lambda s: s[1][0].mu)
  lockstep(tf, to, params, 5, path="fused", rtol=4 * rtol_for(jnp.float32),
           near_zero=lambda g, s: masks(clip(g), s))
  step = fused_step_fn(tf, return_grad_norm=True)
  g = grads_like(8, params)
  _, _, norm = step(params, tf.init(params), g)
  np.testing.assert_allclose(norm, optax.global_norm(g), rtol=4 * ulp(jnp.float32))


@pytest.mark.parametrize("path", PATHS)
def test_grad_scale(device, path):
  """A loss scale of a power of two: g / scale is exact, the step that of the unscaled grads."""
  params = random_tree(9, SHAPES, device=device)
  lockstep(lion(1e-2), optax.lion(1e-2), params, 3, path=path, seed=10,
           rtol=rtol_for(jnp.float32), near_zero=near_zero(), grad_scale=jnp.float32(1024.0))


def test_skip_nonfinite(device):
  params = random_tree(11, [(10,), (2, 3)], device=device)
  tx = lion(1e-2, skip_nonfinite=True)
  step = jax.jit(lambda p, s, g: jaxfuse.fused_step(tx, g, s, p))  # no donation: compared after
  params, state = step(params, tx.init(params), grads_like(0, params))
  for bad in (jnp.nan, jnp.inf):
    g = jax.tree.map(lambda x: x.at[(0,) * x.ndim].set(bad), grads_like(1, params))
    new_params, new_state = step(params, state, g)
    assert_bitwise_equal((new_params, new_state[:-1]), (params, state[:-1]), f"{bad} grads")
    assert int(new_state[-1].skipped_steps) == int(state[-1].skipped_steps) + 1
    u, optax_state = jax.jit(tx.update)(g, state, params)  # the optax protocol skips too
    assert not any(np.any(np.asarray(x)) for x in jax.tree.leaves(u))
    assert int(optax_state[-1].skipped_steps) == int(new_state[-1].skipped_steps)
    state = new_state
  assert int(state[0].count) == 1 and int(state[-1].skipped_steps) == 2


@pytest.mark.parametrize("path", PATHS)
def test_master_weights(device, path):
  """bf16 params with an fp32 master: the master follows optax.lion on float32, step by step,
  and the params are its rounding."""
  params = random_tree(12, [(), (5,), (301,), (3, 17)], dtype=jnp.bfloat16, device=device)
  tf, to = lion(1e-2, weight_decay=0.1, master_weights=True), optax.lion(1e-2, weight_decay=0.1)
  state = tf.init(params)
  assert all(x.dtype == jnp.float32 for x in jax.tree.leaves((state[0].mu, state[-1].master_params)))
  p = jax.tree.map(jnp.copy, params)  # donated
  masks = near_zero()
  upd_o = jax.jit(lambda g, s, p: (lambda u, s: (optax.apply_updates(p, u), s))(
      *to.update(upcast(g), s, p)))
  for t in range(5):
    g = grads_like(13 + t, params)
    master = state[-1].master_params
    master_r, s_r = upd_o(g, state[:-1], master)
    if path == "fused":
      p, state = fused_step_fn(tf)(p, state, g)
    else:
      u, state = tf.update(g, state, p)
      assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(u))  # optax's rule: grads'
      p = optax.apply_updates(p, u)
    m = jax.tree.map(lambda x, r, k: np.where(k, r, x), state[-1].master_params, master_r,
                     masks(g, state))
    assert_trees_close(m, master_r, rtol=rtol_for(jnp.float32), atol=0, what=f"step {t} master")
    assert_trees_close(state[0].mu, s_r[0].mu, rtol=rtol_for(jnp.float32), atol=0)
    rounded = jax.tree.map(lambda x: x.astype(jnp.bfloat16), state[-1].master_params)
    if path == "fused":
      assert_bitwise_equal(p, rounded, "params vs the master's rounding")
    else:
      # The bf16 update is the exact step onto the master's rounding only where the old and new
      # params are within a factor 2 (Sterbenz); a step of lr across a small param is not, and
      # apply_updates then lands within one bf16 rounding of it.
      assert_trees_close(p, rounded, rtol=ulp(jnp.bfloat16), atol=ulp(jnp.bfloat16) * 1e-2)


def test_inject_hyperparams(device):
  params = random_tree(14, [(13,), (2, 5)], device=device)
  pf, po, traces = inject_hyperparams_run(
      lion, optax.lion, dict(learning_rate=1e-2, b1=0.9, weight_decay=0.1),
      dict(learning_rate=3e-3, b1=0.8), params)
  # Independent runs: with these seeds no x falls near zero (a flip would show as 2 * lr).
  assert_trees_close(pf, po, rtol=6 * rtol_for(jnp.float32), atol=0)
  assert traces == 1


def test_multi_steps(device):
  params = random_tree(16, [(21,), (4, 2)], device=device)
  tf = jaxfuse.multi_steps(lion(1e-2), every_k_schedule=3)
  to = optax.MultiSteps(optax.lion(1e-2), every_k_schedule=3)
  step = fused_step_fn(tf)
  upd_o = jax.jit(to.update)
  pf, sf, po, so = jax.tree.map(jnp.copy, params), tf.init(params), params, to.init(params)
  for t in range(7):
    g = grads_like(17 + t, params)
    pf, sf = step(pf, sf, g)
    u, so = upd_o(g, so, po)
    po = optax.apply_updates(po, u)
  # Independent runs, as in test_inject_hyperparams.
  assert_trees_close(pf, po, rtol=4 * rtol_for(jnp.float32), atol=0)
  assert_trees_close(sf, so, rtol=4 * rtol_for(jnp.float32), atol=0)


def test_rejects_complex_params():
  params = {"w": jnp.ones((3,)), "z": jnp.ones((2,), jnp.complex64)}
  with pytest.raises(TypeError, match=r"jaxfuse.lion: params leaf \['z'\] is complex64"):
    lion(1e-3).init(params)
  real = {"w": jnp.ones((3,)), "z": jnp.ones((2,))}
  tx = lion(1e-3)
  with pytest.raises(TypeError, match=r"params leaf \['z'\] is complex64"):
    tx.update(params, tx.init(real), params)


def test_rejects_bad_input():
  params = {"w": jnp.ones((3,)), "b": jnp.ones((2,))}
  tx = lion(1e-3)
  state = tx.init(params)
  with pytest.raises(ValueError, match=r"different tree structures.*only in params: \['b'\]"):
    tx.update({"w": jnp.ones((3,))}, state, params)
  with pytest.raises(ValueError, match=r"leaf \['b'\] has shape \(3,\) in grads"):
    fused_step_fn(tx)(params, state, {"w": jnp.ones((3,)), "b": jnp.ones((3,))})
  with pytest.raises(ValueError, match="opt_state does not match"):
    tx.update(params, optax.adamw(1e-3).init(params), params)
  with pytest.raises(ValueError, match="needs params"):
    tx.update(params, state)
  with pytest.raises(ValueError, match="mu_dtype int32 is not supported"):
    lion(1e-3, mu_dtype=jnp.int32)
