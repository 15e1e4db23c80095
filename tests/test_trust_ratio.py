"""jaxfuse's lamb and lars (the trust-ratio families) against optax's, through the optax protocol
and the fused step (two passes: per-leaf sums, then the step with each leaf's ratio)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxfuse
from jaxfuse import _lamb, _lars
from helpers import assert_trees_close, count_custom_calls, random_tree, ulp
from optimizer_cases import (DTYPES, PATHS, SHAPES, assert_matches_optax, grads, jit_optax_step,
                             jit_step, run_both)

F32_RTOL = 8 * ulp(jnp.float32)
EVEN_LEAVES = {f"leaf{i:04d}": i % 2 == 0 for i in range(len(SHAPES))}


def _every_third(params):
  return {k: i % 3 != 0 for i, k in enumerate(sorted(params))}


# name: (family, make(module)); the module is optax or the jaxfuse family's.
CONFIGS = {
    "lamb": ("lamb", lambda m: m.lamb(1e-2)),
    "lamb_decay_mask": ("lamb", lambda m: m.lamb(optax.linear_schedule(1e-2, 1e-3, 15),
                                                 weight_decay=0.1, mask=_every_third)),
    "lamb_eps": ("lamb", lambda m: m.lamb(1e-2, b1=0.8, eps=1e-3, eps_root=1e-8)),
    "lars": ("lars", lambda m: m.lars(0.1)),
    "lars_masks": ("lars", lambda m: m.lars(0.1, weight_decay=0.05,
                                            weight_decay_mask=EVEN_LEAVES,
                                            trust_coefficient=0.02, eps=1e-3,
                                            trust_ratio_mask=_every_third)),
    "lars_nesterov": ("lars", lambda m: m.lars(optax.linear_schedule(0.2, 0.01, 15),
                                               momentum=0.8, nesterov=True)),
    "lars_no_momentum": ("lars", lambda m: m.lars(0.1, weight_decay=0.01, momentum=0.0)),
}
MODULES = {"lamb": _lamb, "lars": _lars}


def pair(config):
  family, make = CONFIGS[config]
  return make(MODULES[family]), make(optax)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("config", list(CONFIGS))
def test_matches_optax(device, config, dtype, path):
  if config in ("lamb_eps", "lars_no_momentum") and dtype in (jnp.float16, jnp.float64):
    pytest.skip("the float32 and bfloat16 runs cover this option; the suite stays fast")
  with jax.enable_x64(dtype == jnp.float64):
    params = random_tree(0, SHAPES, dtype, device=device)
    assert_matches_optax(*pair(config), params, path)


@pytest.mark.parametrize("config", list(CONFIGS))
def test_state_structure_matches_optax(config):
  params = {"w": jnp.ones((3, 4)), "b": jnp.ones((4,)), "nested": [jnp.ones(()), jnp.ones((0,))]}
  if config == "lars_masks":
    pytest.skip("its masks are written for the SHAPES tree")
  tf, to = pair(config)
  sf, so = tf.init(params), to.init(params)
  assert jax.tree.structure(sf) == jax.tree.structure(so)
  for a, b in zip(jax.tree.leaves(sf), jax.tree.leaves(so)):
    assert a.shape == b.shape and a.dtype == b.dtype
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("config", ["lamb", "lars"])
def test_zero_norm_leaves_keep_ratio_one(device, config, path):
  """A leaf of zero params (or zero direction) takes ratio 1, as optax's."""
  params = {"zero": jnp.zeros((6,)), "w": jnp.ones((4,))}
  g = {"zero": jnp.arange(6.0) - 2.5, "w": jnp.zeros((4,))}
  tf, to = pair(config)
  po, _ = jit_optax_step(to)(params, to.init(params), g)
  step = jit_step(tf) if path == "fused" else jit_optax_step(tf)
  pf, _ = step(params, tf.init(params), g)  # donated last
  assert_trees_close(pf, po, rtol=F32_RTOL, atol=0)
  assert float(jnp.max(jnp.abs(pf["zero"]))) > 0  # it moved


@pytest.mark.parametrize("config", ["lamb", "lars"])
def test_two_passes_with_clip_folded_in(device, config):
  family = CONFIGS[config][0]
  params = random_tree(3, SHAPES, device=device)
  tf_inner, to_inner = pair(config)
  tf = optax.chain(jaxfuse.clip_by_global_norm(0.5), tf_inner)
  to = optax.chain(optax.clip_by_global_norm(0.5), to_inner)
  g = grads(4, params, scale=3.0)
  fn = lambda p, s, g: jaxfuse.fused_step(tf, g, s, p, return_grad_norm=True)
  hlo = jax.jit(fn).lower(params, tf.init(params), g).as_text()
  assert count_custom_calls(hlo, f"jaxfuse_{family}") == 1
  assert count_custom_calls(hlo, f"jaxfuse_{family}_trust_sums") == 1
  pf, sf, norm = jax.jit(fn)(params, tf.init(params), g)
  po, so = jit_optax_step(to)(params, to.init(params), g)
  np.testing.assert_allclose(norm, optax.tree.norm(g), rtol=2 * F32_RTOL)
  assert_trees_close((pf, sf), (po, so), rtol=4 * F32_RTOL, atol=0)


@pytest.mark.parametrize("path", PATHS)
def test_grad_scale(device, path):
  """The loss scale is taken out before the direction (and its norm) is formed."""
  params = random_tree(5, [(33,), (4, 4)], device=device)
  g = grads(6, params)
  scale = jnp.float32(1024.0)
  g_scaled = jax.tree.map(lambda x: x * scale, g)
  tf, to = pair("lamb_eps")
  if path == "fused":
    pf, sf = jax.jit(lambda p, s, g: jaxfuse.fused_step(tf, g, s, p, grad_scale=scale))(
        params, tf.init(params), g_scaled)
  else:
    u, sf = tf.update(g_scaled, tf.init(params), params, grad_scale=scale)
    pf = optax.apply_updates(params, u)
  po, so = jit_optax_step(to)(params, to.init(params), g)
  assert_trees_close((pf, sf), (po, so), rtol=4 * F32_RTOL, atol=0)


@pytest.mark.parametrize("path", PATHS)
def test_skip_nonfinite(device, path):
  params = random_tree(7, [(10,), (2, 3)], device=device)
  tx = jaxfuse.lars(optax.linear_schedule(0.1, 0.0, 10), skip_nonfinite=True)
  step = jax.jit(lambda p, s, g: jaxfuse.fused_step(tx, g, s, p)) if path == "fused" \
      else jit_optax_step(tx)  # no donation: compared afterwards
  params, state = step(params, tx.init(params), grads(8, params))
  g = jax.tree.map(lambda x: x.at[(0,) * x.ndim].set(jnp.inf), grads(9, params))
  new_params, new_state = step(params, state, g)
  for a, b in zip(jax.tree.leaves((new_params, new_state[:-1])),
                  jax.tree.leaves((params, state[:-1]))):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert int(new_state[2].count) == 1 and int(new_state[-1].skipped_steps) == 1


@pytest.mark.parametrize("path", PATHS)
def test_master_weights(device, path):
  """The math, the param norm included, runs on the fp32 master; params are its rounding."""
  params = random_tree(10, [(), (5,), (301,)], jnp.bfloat16, device=device)
  tf, to = jaxfuse.lamb(0.01, weight_decay=0.1, master_weights=True), optax.lamb(
      0.01, weight_decay=0.1)
  pf, sf, po, _ = run_both(tf, to, params, path)
  master = sf[-1].master_params
  assert all(x.dtype == jnp.float32 for x in jax.tree.leaves((master, sf[0].mu)))
  assert_trees_close(master, po, rtol=20 * F32_RTOL, atol=0, what="master")
  if path == "fused":
    for p, m in zip(jax.tree.leaves(pf), jax.tree.leaves(master)):
      np.testing.assert_array_equal(np.asarray(p, np.float32),
                                    np.asarray(m.astype(jnp.bfloat16), np.float32))


def test_inject_hyperparams(device):
  params = random_tree(11, [(13,), (2, 5)], device=device)
  tf = optax.inject_hyperparams(jaxfuse.lars)(learning_rate=0.05, trust_coefficient=0.01)
  to = optax.inject_hyperparams(optax.lars)(learning_rate=0.05, trust_coefficient=0.01)
  traces = []
  step_f = jax.jit(lambda p, s, g: (traces.append(1), jaxfuse.fused_step(tf, g, s, p))[1])
  step_o = jit_optax_step(to)
  pf = po = params
  sf, so = tf.init(params), to.init(params)
  for t in range(6):
    if t == 3:
      for s in (sf, so):
        s.hyperparams["trust_coefficient"] = jnp.full_like(s.hyperparams["trust_coefficient"],
                                                           0.05)
    g = grads(t, params)
    pf, sf = step_f(pf, sf, g)
    po, so = step_o(po, so, g)
  assert_trees_close(pf, po, rtol=8 * F32_RTOL, atol=0)
  assert len(traces) == 1


@pytest.mark.parametrize("path", PATHS)
def test_multi_steps(device, path):
  params = random_tree(12, [(21,), (4, 2)], device=device)
  tf = jaxfuse.multi_steps(jaxfuse.lamb(0.01), every_k_schedule=3)
  to = optax.MultiSteps(optax.lamb(0.01), every_k_schedule=3)
  pf, sf, po, _ = run_both(tf, to, params, path, steps=9)
  assert int(sf.gradient_step) == 3
  assert_trees_close(pf, po, rtol=9 * F32_RTOL, atol=0)


def test_many_leaves_take_several_calls(device):
  """More leaves than one call takes (256): each call's sums are its own leaves'."""
  params = random_tree(13, [(3 + i % 5,) for i in range(300)], device=device)
  tf, to = pair("lamb_decay_mask")
  hlo = jax.jit(jit_step(tf)).lower(params, tf.init(params), grads(1, params)).as_text()
  assert count_custom_calls(hlo, "jaxfuse_lamb_trust_sums") == 2
  pf, sf, po, so = run_both(tf, to, params, "fused", steps=3)
  assert_trees_close((pf, sf), (po, so), rtol=3 * F32_RTOL, atol=0)


@pytest.mark.parametrize("family", ["lamb", "lars"])
def test_rejects_bad_input(family):
  make = getattr(jaxfuse, family)
  params = {"w": jnp.ones((3,)), "z": jnp.ones((2,), jnp.complex64)}
  with pytest.raises(TypeError, match=r"params leaf \['z'\] is complex64; .*real leaves only"):
    make(0.1).init(params)
  real = {"w": jnp.ones((3,)), "z": jnp.ones((2,))}
  tx = make(0.1)
  with pytest.raises(ValueError, match=f"jaxfuse.{family}: update\\(\\) needs params"):
    tx.update(real, tx.init(real))
  with pytest.raises(ValueError, match=r"leaf \['z'\] has shape \(3,\) in grads"):
    jit_step(tx)(real, tx.init(real), {"w": jnp.ones((3,)), "z": jnp.ones((3,))})
