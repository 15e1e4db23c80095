"""The fused step's mechanics, on jaxfuse.adam / adamw: in place, one call per
MAX_LEAVES_PER_CALL leaves, inside optax's wrappers, vmap, the updates' dtypes (one call per
dtype class: test_dtypes.py; flax: test_frameworks.py; the handler's own checks:
test_ffi_validation.py). What every family must pass is families/test_conformance.py, with
lockstep's check that the step traces once."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxfuse
from jaxfuse._optim import kernel_path as _kernel_path
from helpers import assert_trees_close, count_custom_calls, normal_grads, random_tree, ulp
from lockstep import jit_fused, jit_step, lockstep, training_params

# One step of Adam is ~10 fp32 operations; XLA and the kernel may differ in FMA contraction and
# in pow(): a few ulp of the result per step.
STEP_RTOL = 16 * ulp(jnp.float32)


@pytest.mark.slow
def test_large_leaf(device):
  params = random_tree(3, [(3_000_017,), (5,)], device=device)
  lockstep(jaxfuse.adamw(1e-3), optax.adamw(1e-3), params, 2, path="fused")


def test_fused_step_updates_in_place(device):
  params = random_tree(8, [(1000,), (33, 3)], device=device)
  tx = jaxfuse.adamw(1e-2)
  state, step, g = tx.init(params), jit_fused(tx), normal_grads(0, params)
  params, state = step(params, state, g)  # first call: buffers now owned by the step's outputs
  before = [x.unsafe_buffer_pointer() for x in jax.tree.leaves((params, state[0].mu, state[0].nu))]
  params, state = step(params, state, g)
  after = [x.unsafe_buffer_pointer() for x in jax.tree.leaves((params, state[0].mu, state[0].nu))]
  assert before == after, "params / moments were not updated in place"
  # The step is one custom call, and XLA copies no parameter-sized buffer around it.
  text = step.lower(params, state, g).compile().as_text()
  assert count_custom_calls(text, "jaxfuse_adam") == 1
  assert not [l for l in text.splitlines() if " copy(" in l and "f32[1000]" in l], text


@pytest.mark.parametrize("wrapper", ["chain", "multi_steps"])
def test_inside_optax_wrappers(device, wrapper):
  """Through the optax protocol inside optax.chain (between transforms) and optax.MultiSteps."""
  params = training_params(15, [(11,), (3, 3)], jnp.float32, device)
  if wrapper == "chain":
    make = lambda m: optax.chain(optax.scale_by_trust_ratio(), m.adamw(1e-2), optax.scale(0.5))
    lockstep(make(jaxfuse), make(optax), params, 4, path="optax")
  else:
    with jax.enable_x64(True):  # the twin's accumulator as wide as the reference (lockstep.py)
      twin = optax.MultiSteps(optax.adamw(1e-2), 3, accumulator_dtype=jnp.float64)
    lockstep(optax.MultiSteps(jaxfuse.adamw(1e-2), 3), twin, params, 6, path="optax")


def test_rejects_integer_grads_and_a_state_of_other_params():
  """Integer grads; a state of other params (integer params and another optimizer's state: the
  conformance suite, for every family)."""
  params = {"w": jnp.ones((3,))}
  tx = jaxfuse.adamw(1e-3)
  with pytest.raises(TypeError, match=r"grads leaf \['w'\] has dtype int32"):
    tx.update({"w": jnp.ones((3,), jnp.int32)}, tx.init(params), params)
  with pytest.raises(ValueError, match="opt_state does not match"):
    tx.update(params, jaxfuse.adamw(1e-3).init({"v": jnp.ones((3,))}), params)
  with pytest.raises(ValueError, match=r"opt_state leaf .*mu.* has float32\[4\], expected float32\[3\]"):
    tx.update(params, jaxfuse.adamw(1e-3).init({"w": jnp.ones((4,))}), params)


def test_vmap_over_an_ensemble(device):
  """The optax protocol vmapped over a leading ensemble axis (XLA's math: the fused step under
  vmap is test_first_use.py's)."""
  params = random_tree(22, [(3, 5), (5,)], device=device)
  params = jax.tree.map(lambda x: jnp.stack([x, 2 * x, -x]), params)
  grads = jax.tree.map(lambda x: jnp.cos(x), params)
  tf, to = jaxfuse.adamw(1e-2), optax.adamw(1e-2)
  uf, sf = jax.jit(jax.vmap(tf.update))(grads, jax.vmap(tf.init)(params), params)
  uo, so = jax.vmap(to.update)(grads, jax.vmap(to.init)(params), params)
  assert_trees_close((uf, sf), (uo, so), rtol=STEP_RTOL, atol=0)


@pytest.mark.parametrize("param_dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("grad_dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("mu_dtype", [None, jnp.float32, jnp.bfloat16])
def test_update_dtypes_match_optax(device, param_dtype, grad_dtype, mu_dtype):
  """The optax protocol returns updates of optax's dtype (grads and moments promoted)."""
  params = random_tree(23, [(7,), (3, 4)], dtype=param_dtype, device=device)
  grads = random_tree(30, [(7,), (3, 4)], dtype=grad_dtype, scale=0.5, device=device)
  tf, to = jaxfuse.adamw(1e-2, mu_dtype=mu_dtype), optax.adamw(1e-2, mu_dtype=mu_dtype)
  uf, uo = (tx.update(grads, tx.init(params), params)[0] for tx in (tf, to))
  assert [x.dtype for x in jax.tree.leaves(uf)] == [x.dtype for x in jax.tree.leaves(uo)]
  # A few ulp of the least precise dtype the step stores (params, grads or moments) apart.
  coarsest = max(ulp(d) for d in (param_dtype, grad_dtype, mu_dtype or param_dtype))
  assert_trees_close(uf, uo, rtol=max(4 * coarsest, STEP_RTOL), atol=0)


def test_fused_step_over_several_calls(device, monkeypatch):
  """More leaves than one FFI call takes: every call updates its leaves in place, with clipping
  and the non-finite skip deciding for the whole tree. The calls are cut at 16 leaves here (the
  same splitting at a size that compiles in seconds); test_report.py and
  families/test_trust_ratio.py step trees past the real MAX_LEAVES_PER_CALL."""
  monkeypatch.setattr(_kernel_path, "MAX_LEAVES_PER_CALL", 16)
  # Sizes 1 to 49, five of them: the calls' boundaries cut odd sizes, and the reference's
  # operations on five shapes compile once each (lockstep.py evaluates them one by one).
  params = random_tree(26, [(1 + 12 * (i % 5),) for i in range(2 * 16 + 7)], device=device)
  tf = optax.chain(jaxfuse.clip_by_global_norm(1.0), jaxfuse.adamw(1e-2, skip_nonfinite=True))
  to = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2))
  step = jit_fused(tf)
  sf = jax.jit(tf.init)(params)  # eagerly, every leaf shape would be a compile of its own
  assert count_custom_calls(step.lower(params, sf, params).as_text(), "jaxfuse_adam") == 3
  pf, sf = lockstep(tf, to, params, 3, path="fused", seed=5, state=sf)
  # A NaN in the last leaf (in the last call) stops the update of the first leaf too.
  g = normal_grads(600, params)
  last = sorted(g)[-1]
  g[last] = g[last].at[0].set(jnp.nan)
  before = np.asarray(pf["leaf0000"])
  pf, sf = step(pf, sf, g)
  np.testing.assert_array_equal(np.asarray(pf["leaf0000"]), before)
  assert int(sf[1][-1].skipped_steps) == 1 and int(sf[1][0].count) == 3


def test_grad_scale_without_skip(device):
  """A bare loss scale needs no global-norm pass: one custom call, same step as unscaled grads."""
  params = random_tree(28, [(33,), (4, 4)], device=device)
  g = normal_grads(29, params)
  S = jnp.float32(1024.0)
  g_scaled = jax.tree.map(lambda x: x * S, g)
  tf, to = jaxfuse.adamw(1e-2), optax.adamw(1e-2)
  lowered = jit_step("fused", tf, grad_scale=S).lower(params, tf.init(params), g_scaled)
  assert count_custom_calls(lowered.as_text(), "jaxfuse_global_norm") == 0
  assert count_custom_calls(lowered.as_text(), "jaxfuse_adam") == 1
  pf, _ = lowered.compile()(params, tf.init(params), g_scaled)
  u, _ = to.update(g, to.init(params), params)
  assert_trees_close(pf, optax.apply_updates(params, u), rtol=2 * STEP_RTOL, atol=0)
  u2, _ = tf.update(g_scaled, tf.init(params), params, grad_scale=S)  # optax protocol
  assert_trees_close(u2, u, rtol=2 * STEP_RTOL, atol=0)
