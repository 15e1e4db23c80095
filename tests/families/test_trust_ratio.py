"""jaxfuse's lamb and lars (the trust-ratio families) against optax's, through the optax protocol
and the fused step (two passes: per-leaf sums, then the step with each leaf's ratio)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxfuse
from jaxfuse._optim.families import lamb as _lamb
from jaxfuse._optim.families import lars as _lars
from helpers import assert_trees_close, count_custom_calls, random_tree
from optimizer_cases import (DTYPES, F32_RTOL, PATHS, SHAPES, assert_matches_optax,
                             check_clip_folded_in, check_grad_scale, check_inject_hyperparams,
                             check_master_weights, check_multi_steps, check_skip_nonfinite, grads,
                             jit_optax_step, jit_step, run_both)

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
  check_clip_folded_in(*pair(config), f"jaxfuse_{family}", device,
                       extra_calls=[f"jaxfuse_{family}_trust_sums"])


@pytest.mark.parametrize("path", PATHS)
def test_grad_scale(device, path):
  """The loss scale is taken out before the direction (and its norm) is formed."""
  check_grad_scale(*pair("lamb_eps"), path, device, rtol=4 * F32_RTOL)


@pytest.mark.parametrize("path", PATHS)
def test_skip_nonfinite(device, path):
  tx = jaxfuse.lars(optax.linear_schedule(0.1, 0.0, 10), skip_nonfinite=True)
  check_skip_nonfinite(tx, path, device, count=lambda s: s[2].count)


@pytest.mark.parametrize("path", PATHS)
def test_master_weights(device, path):
  """The math, the param norm included, runs on the fp32 master; params are its rounding."""
  check_master_weights(jaxfuse.lamb(0.01, weight_decay=0.1, master_weights=True),
                       optax.lamb(0.01, weight_decay=0.1), path, device)


def test_inject_hyperparams(device):
  check_inject_hyperparams(
      optax.inject_hyperparams(jaxfuse.lars)(learning_rate=0.05, trust_coefficient=0.01),
      optax.inject_hyperparams(optax.lars)(learning_rate=0.05, trust_coefficient=0.01),
      {"trust_coefficient": 0.05}, device, steps=6)


@pytest.mark.parametrize("path", PATHS)
def test_multi_steps(device, path):
  check_multi_steps(jaxfuse.lamb(0.01), optax.lamb(0.01), path, device)


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
  real = {"w": jnp.ones((3,)), "z": jnp.ones((2,))}
  tx = make(0.1)
  with pytest.raises(ValueError, match=f"jaxfuse.{family}: update\\(\\) needs params"):
    tx.update(real, tx.init(real))
  with pytest.raises(ValueError, match=r"leaf \['z'\] has shape \(3,\) in grads"):
    jit_step(tx)(real, tx.init(real), {"w": jnp.ones((3,)), "z": jnp.ones((3,))})
