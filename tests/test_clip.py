"""jaxfuse.global_norm, clip_by_global_norm and the fused clip+Adam step against optax."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxfuse
from helpers import (assert_trees_close, count_custom_calls, init_beside, normal_grads,
                     random_tree, ulp)
from lockstep import jit_fused, lockstep

SHAPES = [(), (0,), (1,), (3,), (1023,), (65537,), (3, 7, 5)]
F32_EPS = ulp(jnp.float32)
CLIP_ADAMW = lambda m: optax.chain(m.clip_by_global_norm(1.0), m.adamw(1e-2))  # m: jaxfuse, optax


def _np_norm(tree, scale=1.0):
  """Reference global norm in float64."""
  return math.sqrt(sum(float(np.sum((np.asarray(x, np.float64) / scale) ** 2))
                       for x in jax.tree.leaves(tree)))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16, "mixed"])
def test_global_norm_matches_optax(device, dtype):
  dts = ([jnp.float32, jnp.bfloat16, jnp.float16] * 3)[:len(SHAPES)] if dtype == "mixed" else dtype
  tree = random_tree(0, SHAPES, dtype=dts, device=device)
  norm = jax.jit(jaxfuse.global_norm)(tree)
  assert norm.dtype == jnp.float32 and norm.shape == ()
  # Both norms in float64 from exact squares (16- and 32-bit values square exactly): each sum
  # of n squares within n * eps64 / 2 relative, its root half that plus eps64 / 2; then the
  # float32 rounding, eps32 / 2. First order eps32 / 2 + (n + 2) * eps64 / 2; twice the float64
  # part covers the second-order terms.
  n = sum(x.size for x in jax.tree.leaves(tree))
  eps64 = ulp(jnp.float64)
  np.testing.assert_allclose(float(norm), _np_norm(tree), rtol=F32_EPS / 2 + (n + 2) * eps64)
  if dtype == jnp.float32:
    # optax sums the squares in float32: ~n * eps32 relative in the worst case, ~sqrt(n) typical.
    np.testing.assert_allclose(float(norm), float(optax.tree.norm(tree)),
                               rtol=math.sqrt(n) * F32_EPS)


def test_global_norm_is_deterministic(device):
  tree = random_tree(1, [(3_000_001,), (77,), (1000, 3)], device=device)
  norms = [jax.jit(jaxfuse.global_norm)(tree), jax.jit(jaxfuse.global_norm)(tree),
           jaxfuse.global_norm(tree)]
  assert len({np.asarray(x).tobytes() for x in norms}) == 1


def test_global_norm_empty_and_zero(device):
  assert float(jaxfuse.global_norm({})) == 0.0
  zeros = jax.device_put({"a": jnp.zeros((5,)), "b": jnp.zeros((0, 3))}, device)
  assert float(jaxfuse.global_norm(zeros)) == 0.0


def test_global_norm_fp16_no_overflow(device):
  """Squares of fp16 values above 256 overflow fp16; jaxfuse accumulates in fp32."""
  tree = random_tree(2, [(4096,), (17,)], scale=1e4, device=device)
  tree = jax.tree.map(lambda x: jnp.clip(x, -6e4, 6e4).astype(jnp.float16), tree)
  assert not np.isfinite(float(optax.tree.norm(tree)))  # optax squares in fp16
  norm = float(jaxfuse.global_norm(tree))
  assert np.isfinite(norm) and norm > 1e5
  np.testing.assert_allclose(norm, _np_norm(tree), rtol=1e-5)


def test_global_norm_with_grad_scale(device):
  tree = random_tree(3, [(100,), (3, 3)], device=device)
  np.testing.assert_allclose(float(jaxfuse.global_norm(tree, grad_scale=jnp.float32(1024.0))),
                             _np_norm(tree, 1024.0), rtol=1e-6)


def _grads_with_norm(seed, params, target_norm):
  g = normal_grads(seed, params)
  return jax.tree.map(lambda x: x * (target_norm / _np_norm(g)), g)


def test_clip_at_threshold(device):
  """norm == max_norm is not < max_norm: optax scales by max_norm / norm (== 1)."""
  params = random_tree(6, [(31,), (4, 4)], device=device)
  g = _grads_with_norm(7, params, 3.0)
  norm = jaxfuse.global_norm(g)
  uf, _ = jaxfuse.clip_by_global_norm(norm).update(g, optax.EmptyState())
  # scaled by max_norm / norm == 1: the gradients to XLA's rounding of (t / n) * n
  for a, t in zip(jax.tree.leaves(uf), jax.tree.leaves(g)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(t), rtol=2 * ulp(jnp.float32), atol=0)


def test_clip_zero_gradients(device):
  g = jax.device_put({"a": jnp.zeros((7,)), "b": jnp.zeros(())}, device)
  uf, _ = jaxfuse.clip_by_global_norm(1.0).update(g, optax.EmptyState())
  assert all(np.all(np.asarray(a) == 0) for a in jax.tree.leaves(uf))


@pytest.mark.parametrize("path", ["optax", "fused"])
def test_unclipped_chain_matches_optax(device, path):
  """Gradients whose norm is below the threshold (left alone), in lockstep (clipped ones, and a
  skipped non-finite step: the conformance suite, for every family)."""
  params = random_tree(8, SHAPES, device=device)
  make = lambda m: optax.chain(m.clip_by_global_norm(1.0), m.adamw(1e-2, weight_decay=0.1))
  lockstep(make(jaxfuse), make(optax), params, 6, path=path,
           grads=lambda t, p: _grads_with_norm(100 + t, p, 0.3 * (1 + 0.1 * t)))


def test_fused_clip_step_launches_and_no_host_traffic(device):
  params = random_tree(9, [(64,), (8, 8), ()], device=device)
  tx = optax.chain(jaxfuse.clip_by_global_norm(1.0), jaxfuse.adamw(optax.cosine_decay_schedule(1e-3, 100)))
  state = init_beside(tx, params)
  step = jit_fused(tx, return_grad_norm=True)
  g = jax.tree.map(lambda x: x * 10, params)
  lowered = step.lower(params, state, g)
  compiled_text = lowered.compile().as_text()
  assert count_custom_calls(compiled_text, "jaxfuse_global_norm") == 1
  assert count_custom_calls(compiled_text, "jaxfuse_adam") == 1
  for text in (lowered.as_text(), compiled_text):
    for banned in ("outfeed", "infeed", "send(", "recv(", "host_callback", "xla_python_cpu_callback",
                   "xla_ffi_python_cpu_callback", "xla_python_gpu_callback", "S(5)"):
      assert banned not in text, banned
  g = jax.device_put(g, device)
  with jax.transfer_guard("disallow"):
    for _ in range(3):
      params, state, norm = step(params, state, g)
  assert norm.shape == () and norm.dtype == jnp.float32


@pytest.mark.parametrize("bad", [jnp.nan, jnp.inf])
def test_nonfinite_without_skip_matches_optax(device, bad):
  params = random_tree(10, [(9,), (2, 2)], device=device)
  tf, to = CLIP_ADAMW(jaxfuse), CLIP_ADAMW(optax)
  g = jax.tree.map(lambda x: x.at[(0,) * x.ndim].set(bad), _grads_with_norm(11, params, 2.0))
  pf, sf = jax.jit(lambda p, s, g: jaxfuse.fused_step(tf, g, s, p))(params, tf.init(params), g)
  uo, so = to.update(g, to.init(params), params)
  po = optax.apply_updates(params, uo)
  assert_trees_close((pf, sf), (po, so), rtol=1e-6, atol=0)  # NaNs in the same places


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.float32])
def test_loss_scaling(device, dtype):
  """Gradients of a loss scaled by S, with grad_scale=S, step like the unscaled gradients."""
  S = 2.0 ** 12
  params = random_tree(17, [(33,), (5, 5)], device=device)
  g = _grads_with_norm(18, params, 4.0)
  g_scaled = jax.tree.map(lambda x: (x * S).astype(dtype), g)
  g_ref = jax.tree.map(lambda x: x.astype(jnp.float32) / S, g_scaled)  # what the kernel sees
  tf, to = CLIP_ADAMW(jaxfuse), CLIP_ADAMW(optax)
  pf, _, norm = jax.jit(lambda p, s, g, c: jaxfuse.fused_step(tf, g, s, p, grad_scale=c,
                                                              return_grad_norm=True))(
      params, tf.init(params), g_scaled, jnp.float32(S))
  po = optax.apply_updates(params, to.update(g_ref, to.init(params), params)[0])
  np.testing.assert_allclose(float(norm), float(optax.tree.norm(g_ref)), rtol=1e-5)
  assert_trees_close(pf, po, rtol=64 * F32_EPS, atol=0)
  # The optax protocol with the grad_scale extra argument gives the same step.
  u, _ = tf.update(g_scaled, tf.init(params), params, grad_scale=jnp.float32(S))
  assert_trees_close(optax.apply_updates(params, u), po, rtol=64 * F32_EPS, atol=0)


def test_clip_rejects_bad_leaves():
  with pytest.raises(TypeError, match=r"grads leaf \['n'\] has dtype int32"):
    jaxfuse.global_norm({"x": jnp.ones(3), "n": jnp.ones(3, jnp.int32)})
  with pytest.raises(TypeError, match="not an array"):
    jaxfuse.clip_by_global_norm(1.0).update({"x": "a string"}, optax.EmptyState())


def test_fused_rejects_wrong_chain_state():
  params = {"w": jnp.ones((3,))}
  tx = optax.chain(jaxfuse.clip_by_global_norm(1.0), jaxfuse.adamw(1e-3))
  # optax.chain itself refuses a state that is not its own
  with pytest.raises(ValueError, match="number of updates and states"):
    jaxfuse.fused_step(tx, params, jaxfuse.adamw(1e-3).init(params), params)


def test_global_norm_many_leaves(device):
  """More leaves than one kernel-parameter table holds: several launches share the slots."""
  rng = np.random.default_rng(20)
  tree = random_tree(21, [(int(rng.integers(1, 40)),) for _ in range(2500)], device=device)
  norm = jax.jit(jaxfuse.global_norm)(tree)
  np.testing.assert_allclose(float(norm), _np_norm(tree), rtol=1e-5)
  assert np.asarray(norm).tobytes() == np.asarray(jax.jit(jaxfuse.global_norm)(tree)).tobytes()


def test_clip_with_infinite_max_norm_follows_optax(device):
  """max_norm = inf is an ordinary threshold, as in optax (an inf norm is not < inf)."""
  g = jax.device_put({"a": jnp.array([1.0, jnp.inf, 2.0])}, device)
  uf, _ = jaxfuse.clip_by_global_norm(jnp.inf).update(g, optax.EmptyState())
  uo, _ = optax.clip_by_global_norm(jnp.inf).update(g, optax.EmptyState())
  assert_trees_close(uf, uo, rtol=0, atol=0)  # NaN where optax has NaN, equal elsewhere
  finite = random_tree(31, [(7,), (2, 3)], device=device)  # any finite norm is < inf: unchanged
  uf, _ = jaxfuse.clip_by_global_norm(jnp.inf).update(finite, optax.EmptyState())
  assert_trees_close(uf, finite, rtol=0, atol=0)


def test_axis_name_outside_shard_map_is_refused():
  """axis_name names the mesh axes inside a shard_map body; elsewhere the shardings come from the
  arrays, and passing it is an error that says so (at trace time)."""
  tree = random_tree(41, [(3, 4)])
  with pytest.raises(ValueError, match="axis_name is for calls inside jax.shard_map"):
    jaxfuse.global_norm(tree, axis_name="fsdp")
  tx = optax.chain(jaxfuse.clip_by_global_norm(1.0, axis_name="fsdp"), jaxfuse.adamw(1e-3))
  with pytest.raises(ValueError, match="axis_name is for calls inside jax.shard_map"):
    jax.jit(lambda g, s, p: jaxfuse.fused_step(tx, g, s, p))(tree, tx.init(tree), tree)
