"""Everything optax accepts, jaxfuse accepts, beyond each family's float64 and complex leaves
(families/test_conformance.py): NumPy and Python leaves, trees mixing dtypes in one call per
dtype class, the norm's and the clip's dtypes; plus the parity bugs found by running jaxfuse
against optax (zero weight decay, update without params, state dtype checks, traced masks) and the
master-weights update dtype."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxfuse
from jaxfuse._core import ffi as _ffi
from helpers import assert_trees_close, count_custom_calls, random_tree, stable_seed, ulp
from lockstep import jit_step, lockstep

SHAPES = [(7,), (3, 5), (), (0,), (33, 17)]
LR = 1e-2
# One float32 step against optax's: each side rounds its few ops (moments, bias corrections,
# sqrt, divide) in another order or fusion, so they differ by a few ulps, not by a sum over steps.
F32_RTOL = 4 * ulp(jnp.float32)


def grads_for(step, params):
  """Fresh random gradients for `step`, shaped and typed like params."""
  return random_tree(stable_seed("grads", step), [jnp.shape(p) for p in params.values()],
                     [p.dtype for p in params.values()])


def test_mixed_tree_one_call_per_family(device):
  """float32/bf16/f16 leaves share a call; float64, complex64 and complex128 leaves take one
  each: four jaxfuse_adam calls in the fused step; each leaf as optax's, the optax protocol."""
  with jax.enable_x64(True):
    params = random_tree(21, [(9,), (4, 4), (5,), (6,), (3,), (8,), ()],
                         [jnp.float32, jnp.bfloat16, jnp.float64, jnp.complex64, jnp.complex128,
                          jnp.float16, jnp.float64], device=device)
    tx = jaxfuse.adamw(LR, weight_decay=0.1)
    state, grads = tx.init(params), grads_for(0, params)
    fused = jax.jit(lambda g, s, p: jaxfuse.fused_step(tx, g, s, p))
    assert count_custom_calls(fused.lower(grads, state, params).as_text(), "jaxfuse_adam") == 4
    # the optax protocol leaves the element math to XLA (it fuses with apply_updates)
    update = jax.jit(tx.update)
    assert count_custom_calls(update.lower(grads, state, params).as_text(), "jaxfuse_adam") == 0
    updates, _ = update(grads, state, params)
    ref, _ = optax.adamw(LR, weight_decay=0.1).update(grads, optax.adamw(LR).init(params), params)
    for key, u in updates.items():
      assert u.dtype == ref[key].dtype, key
      # 16-bit leaves: optax computes in 16 bits, jaxfuse in float32 and rounds once.
      eps = ulp(u.dtype) if jnp.dtype(u.dtype).itemsize > 2 else 2 * ulp(u.dtype)
      assert_trees_close(u, ref[key], rtol=8 * eps, atol=0, what=key)


def test_numpy_and_python_leaves():
  """NumPy arrays and Python/NumPy scalars are leaves, as in optax (JAX's dtype rules apply:
  NumPy float64 is float32 without jax_enable_x64)."""
  params = {"a": np.linspace(-1, 1, 6), "b": 1.5, "c": np.float32(-2.0)}
  grads = {"a": np.linspace(0.3, -0.2, 6), "b": 0.25, "c": np.float32(0.5)}
  ours, ref = jaxfuse.adamw(LR), optax.adamw(LR)
  (u, s), (u_ref, s_ref) = (tx.update(grads, tx.init(params), params) for tx in (ours, ref))
  assert_trees_close((u, s), (u_ref, s_ref), rtol=F32_RTOL, atol=0)
  norm = jaxfuse.global_norm(grads)
  assert norm.dtype == jnp.float32
  np.testing.assert_allclose(norm, optax.tree.norm(grads), rtol=ulp(jnp.float32))
  new_params, _ = jaxfuse.fused_step(ours, grads, ours.init(params), params)
  assert_trees_close(new_params, optax.apply_updates(params, u_ref), rtol=F32_RTOL, atol=0)


@pytest.mark.parametrize("dtype", [jnp.float64, jnp.complex64, jnp.complex128])
def test_global_norm_and_clip_dtypes(dtype, device):
  """The norm of |x|^2 (complex: re^2 + im^2) in optax's result dtype; the clip in the leaves'."""
  with jax.enable_x64(dtype != jnp.complex64):
    tree = jax.device_put(random_tree(22, SHAPES, dtype), device)
    norm, ref = jaxfuse.global_norm(tree), optax.tree.norm(tree)
    assert norm.dtype == ref.dtype
    np.testing.assert_allclose(norm, ref, rtol=4 * ulp(ref.dtype))
    clipped, _ = jax.jit(jaxfuse.clip_by_global_norm(0.5).update)(tree, optax.EmptyState())
    clipped_ref, _ = optax.clip_by_global_norm(0.5).update(tree, optax.EmptyState())
    assert jax.tree.map(lambda x: x.dtype, clipped) == jax.tree.map(lambda x: x.dtype, tree)
    assert_trees_close(clipped, clipped_ref, rtol=4 * ulp(dtype), atol=0)


@pytest.mark.parametrize("size", [10**6, 3 * 10**7])
def test_global_norm_of_large_constant_leaf(size):
  """Accumulated in float64, the norm of a large constant fp32 leaf is its exact norm rounded
  once (fp32 accumulation in blocks was off by about 1e-5 relative)."""
  value = np.float32(0.1)
  exact = math.sqrt(size) * float(value)
  norm = float(jaxfuse.global_norm({"w": jnp.full((size,), value)}))
  assert abs(norm - exact) <= ulp(jnp.float32) * exact  # the rounding of the result, no more


# ---- parity bugs -------------------------------------------------------------------------------

NAN_PARAMS = {"w": jnp.array([jnp.nan, jnp.inf, 1.0]), "b": jnp.array([-jnp.inf, 2.0])}
GRADS = {"w": jnp.full((3,), 0.1), "b": jnp.full((2,), -0.1)}


@pytest.mark.parametrize("make", [
    lambda m: m.adamw(1e-3, weight_decay=0.0),
    lambda m: m.adamw(1e-3, weight_decay=0.1, mask={"w": False, "b": False}),
    lambda m: optax.chain(m.clip_by_global_norm(1e9), m.adamw(1e-3, weight_decay=0.0)),
], ids=["zero_weight_decay", "mask_off", "clip_not_triggered"])
def test_no_multiply_by_zero_on_nonfinite_params(make, device):
  """optax adds no weight-decay term for a Python zero or a masked-off leaf, and clipping below
  the threshold leaves gradients alone: a NaN or Inf param keeps a finite update."""
  params, grads = jax.device_put((NAN_PARAMS, GRADS), device)
  ours, ref = make(jaxfuse), make(optax)
  u, _ = jax.jit(ours.update)(grads, ours.init(params), params)
  u_ref, _ = ref.update(grads, ref.init(params), params)
  assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(u))
  assert_trees_close(u, u_ref, rtol=F32_RTOL, atol=0)
  new_params, _ = jaxfuse.fused_step(ours, grads, ours.init(params), params)
  assert_trees_close(new_params, optax.apply_updates(params, u_ref), rtol=F32_RTOL, atol=0)


def test_weight_decay_schedule_reaching_zero_matches_optax():
  """A schedule's weight decay is multiplied in even at 0, as optax does: 0 * inf is NaN."""
  schedule = lambda count: 0.0 * count
  ours, ref = (m.adamw(1e-3, weight_decay=schedule) for m in (jaxfuse, optax))
  u, u_ref = (tx.update(GRADS, tx.init(NAN_PARAMS), NAN_PARAMS)[0] for tx in (ours, ref))
  assert_trees_close(u, u_ref, rtol=F32_RTOL, atol=0)
  assert np.isnan(np.asarray(u["w"][:2])).all()


def test_adam_update_without_params():
  params = random_tree(24, [(5,), (2, 3)])
  grads = grads_for(0, params)
  for ours, ref in [(jaxfuse.adam(LR), optax.adam(LR)), (jaxfuse.nadam(LR), optax.nadam(LR))]:
    u, s = ours.update(grads, ours.init(params))
    u_ref, s_ref = ref.update(grads, ref.init(params))
    assert_trees_close((u, s), (u_ref, s_ref), rtol=F32_RTOL, atol=0)
  # optax.partition hands its inner transforms no params when update() gets none.
  labels = {"leaf0000": "adam", "leaf0001": "sgd"}
  tx = optax.partition({"adam": jaxfuse.adam(LR), "sgd": optax.sgd(LR)}, labels)
  u, _ = jax.jit(tx.update)(grads, tx.init(params))
  u_ref, _ = optax.partition({"adam": optax.adam(LR), "sgd": optax.sgd(LR)}, labels).update(
      grads, tx.init(params))
  assert_trees_close(u, u_ref, rtol=F32_RTOL, atol=0)
  with pytest.raises(ValueError, match="jaxfuse.adamw: update\\(\\) needs params"):
    jaxfuse.adamw(LR).update(grads, jaxfuse.adamw(LR).init(params))
  tx = jaxfuse.adam(LR, master_weights=True)
  with pytest.raises(ValueError, match="jaxfuse.adam: update\\(\\) needs params \\(for master weights"):
    tx.update(grads, tx.init(params))


_REAL, _COMPLEX = {"w": jnp.ones(3)}, {"z": jnp.ones(3, jnp.complex64)}


@pytest.mark.parametrize("fn, kwargs, params, match", [
    # Refused when the transform is made (params None), or by init naming the leaf.
    ("adam", dict(mu_dtype=jnp.int32), None, "mu_dtype int32 is not supported"),
    ("adamw", dict(mu_dtype=jnp.float8_e4m3fn), None, "mu_dtype float8_e4m3fn is not supported"),
    ("adam", dict(mu_dtype=jnp.complex64), _REAL,
     r"mu_dtype complex64 does not fit params leaf \['w'\]"),
    ("adam", dict(mu_dtype=jnp.bfloat16), _COMPLEX,
     r"mu_dtype bfloat16 does not fit params leaf \['z'\]"),
    ("adam", dict(nu_dtype=jnp.int8), _REAL, "nu_dtype int8 is not supported"),
    ("adam", dict(nu_dtype=jnp.bfloat16), _COMPLEX,
     r"nu_dtype bfloat16 does not fit params leaf \['z'\]"),
    ("sgd", dict(momentum=0.9, accumulator_dtype=jnp.int32), _REAL,
     "accumulator_dtype int32 is not supported"),
    ("sgd", dict(momentum=0.9, accumulator_dtype=jnp.bfloat16), _COMPLEX,
     r"accumulator_dtype bfloat16 does not fit params leaf \['z'\] \(complex64\)"),
])
def test_a_state_dtype_that_does_not_fit_is_refused(fn, kwargs, params, match):
  with pytest.raises(ValueError, match=match):
    tx = getattr(jaxfuse, fn)(LR, **kwargs)
    if params is not None:
      tx.init(params)


def test_traced_mask_gets_jaxfuse_message():
  params = {"w": jnp.ones((2, 2)), "b": jnp.ones(2)}
  tx = jaxfuse.adamw(LR, mask=lambda p: jax.tree.map(lambda x: jnp.all(x > 0), p))
  with pytest.raises(TypeError, match=r"weight-decay mask entry for \['b'\] is traced"):
    jax.jit(tx.init)(params)
  state = jaxfuse.adamw(LR, mask={"w": True, "b": False}).init(params)
  with pytest.raises(TypeError, match="is traced; masks must be static"):
    jax.jit(tx.update)(params, state, params)


# ---- master weights: updates in the grads' dtype, as optax's rule says ---------------------------

def test_master_weights_under_lax_cond_and_apply_if_finite():
  params = random_tree(25, [(7,), (2, 9)], dtype=jnp.bfloat16)
  tx = jaxfuse.adamw(LR, master_weights=True)

  @jax.jit
  def cond_step(pred, grads, state, params):
    return jax.lax.cond(pred, lambda: tx.update(grads, state, params),
                        lambda: (jax.tree.map(jnp.zeros_like, grads), state))

  state = tx.init(params)
  u, _ = cond_step(True, grads_for(0, params), state, params)
  assert jax.tree.map(lambda x: x.dtype, u) == jax.tree.map(lambda x: x.dtype, params)
  u0, _ = cond_step(False, grads_for(0, params), state, params)
  assert all(not np.asarray(x, np.float32).any() for x in jax.tree.leaves(u0))

  # apply_if_finite: a non-finite step changes nothing; the others run as without it.
  guarded = optax.apply_if_finite(tx, max_consecutive_errors=2)
  step, clean = jit_step("optax", guarded), jit_step("optax", tx)
  bad = jax.tree.map(lambda g: g.at[0].set(jnp.nan), grads_for(1, params))
  p, s, p_clean, s_clean = params, guarded.init(params), params, tx.init(params)
  for t, grads in enumerate([grads_for(0, params), bad, grads_for(2, params)]):
    p, s = step(p, s, grads)
    if t != 1:
      p_clean, s_clean = clean(p_clean, s_clean, grads)
  assert_trees_close(p, p_clean, rtol=0, atol=0)  # equal (NaNs in the same places)
  assert int(s.notfinite_count) == 0 and int(s.total_notfinite) == 1


def test_complex_leaf_over_a_chunk_in_a_trust_ratio_family(device):
  """The trust sums keep a partial per chunk of scalars, two per complex element: a complex leaf
  over half a chunk's elements takes one chunk more than its element count says."""
  chunk = _ffi.contract("jaxfuse_lamb_trust_sums").numbers["chunk_scalars"]
  params = jax.device_put(random_tree(5, [(chunk // 2 + 3,)], [jnp.complex64]), device)
  lockstep(jaxfuse.lamb(LR), optax.lamb(LR), params, 2, path="fused")
