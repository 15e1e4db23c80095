"""Shared by the tests of the element-wise optimizer families (test_sgd.py, test_adagrad.py): a
jaxfuse transform against its optax twin on fresh random trees, through the optax protocol or
the fused in-place step."""

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxfuse
from helpers import assert_trees_close, count_custom_calls, random_tree, ulp

SHAPES = [(), (0,), (1,), (3,), (257,), (3, 7, 5)]
DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16, jnp.float64]
STEPS = 20
PATHS = ["optax", "fused"]


def grads(seed, params, scale=1.0):
  """Random normal gradients shaped, typed and placed like `params`."""
  rng = np.random.default_rng(seed)
  return jax.tree.map(
      lambda p: jax.device_put(jnp.asarray(scale * rng.standard_normal(p.shape), p.dtype),
                               p.devices().pop()), params)


def reference_dtype(dtype):
  """optax runs on float32 copies of 16-bit leaves: jaxfuse computes those in float32 and rounds
  once, optax rounds every operation to 16 bits, so optax in 16 bits is the less exact side."""
  return jnp.float32 if jnp.finfo(dtype).bits == 16 else dtype


def step_rtol(dtype):
  """The error allowed per step, relative to a leaf's largest element: a few roundings of the
  compute type (XLA and the kernels may differ by an ulp, e.g. rsqrt), or for 16-bit leaves the
  rounding of the stored params and state once per step."""
  return ulp(dtype) if jnp.finfo(dtype).bits == 16 else 8 * ulp(dtype)


def jit_step(tx, **kwargs):
  """A jitted fused step donating params and state (in the order of the outputs)."""
  return jax.jit(lambda p, s, g: jaxfuse.fused_step(tx, g, s, p, **kwargs),
                 donate_argnums=(0, 1))


def jit_optax_step(tx):
  """A jitted optax-protocol step: tx.update then optax.apply_updates."""
  def step(p, s, g):
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s
  return jax.jit(step)


def on_cpu_copy(tree, dtype=None):
  """A fresh copy of `tree` on the CPU (optax's reference runs there: XLA's GPU code may keep
  16-bit intermediates in float32), optionally cast."""
  cpu = jax.devices("cpu")[0]
  return jax.tree.map(lambda x: jax.device_put(jnp.array(x, dtype=dtype, copy=True), cpu), tree)


def run_both(tf, to, params, path, steps=STEPS, seed=1):
  """`steps` steps of the jaxfuse transform (through `path`) and of optax (on reference-dtype
  copies) on the same gradients: (jaxfuse params, state, optax params, state)."""
  dtype = jax.tree.leaves(params)[0].dtype
  ref = on_cpu_copy(params, reference_dtype(dtype))
  sf, so = tf.init(params), to.init(ref)
  step_f = jit_step(tf) if path == "fused" else jit_optax_step(tf)
  step_o = jit_optax_step(to)
  # The fused step donates its params: a copy, so that the caller's stay valid.
  pf, po = jax.tree.map(lambda x: jnp.array(x, copy=True), params), ref
  for t in range(steps):
    g = grads(seed * 1000 + t, params)
    pf, sf = step_f(pf, sf, g)
    po, so = step_o(po, so, on_cpu_copy(g, reference_dtype(dtype)))
  return pf, sf, po, so


def assert_matches_optax(tf, to, params, path, extra_rtol=0.0, steps=STEPS):
  """After `steps` steps params and state are optax's within the dtype's precision (plus
  `extra_rtol` per step), and the state has optax's structure."""
  dtype = jax.tree.leaves(params)[0].dtype
  pf, sf, po, so = run_both(tf, to, params, path, steps)
  assert jax.tree.structure(sf) == jax.tree.structure(so)
  rtol = steps * (step_rtol(dtype) + extra_rtol)
  assert_trees_close(pf, po, rtol=rtol, atol=0, what="params")
  assert_trees_close(sf, so, rtol=rtol, atol=0, what="state")
  for a, b in zip(jax.tree.leaves((pf, sf)), jax.tree.leaves((params, tf.init(params)))):
    assert a.dtype == b.dtype


# ---- checks every family passes (each family's test file calls them with its transforms) -----

F32_RTOL = 8 * ulp(jnp.float32)


def check_clip_folded_in(tf_inner, to_inner, op: str, device, extra_calls=()):
  """jaxfuse.clip_by_global_norm before the family under fused_step: one norm call, one call of
  `op` (and of each of `extra_calls`), optax's step and norm."""
  params = random_tree(3, SHAPES, device=device)
  tf = optax.chain(jaxfuse.clip_by_global_norm(0.5), tf_inner)
  to = optax.chain(optax.clip_by_global_norm(0.5), to_inner)
  g = grads(4, params, scale=3.0)
  fn = lambda p, s, g: jaxfuse.fused_step(tf, g, s, p, return_grad_norm=True)
  text = jax.jit(fn).lower(params, tf.init(params), g).as_text()
  for target in ("jaxfuse_global_norm", op, *extra_calls):
    assert count_custom_calls(text, target) == 1, target
  pf, sf, norm = jax.jit(fn)(params, tf.init(params), g)
  po, so = jit_optax_step(to)(params, to.init(params), g)
  np.testing.assert_allclose(norm, optax.tree.norm(g), rtol=2 * F32_RTOL)
  assert_trees_close((pf, sf), (po, so), rtol=4 * F32_RTOL, atol=0)


def check_grad_scale(tf, to, path, device, rtol=2 * F32_RTOL):
  """Loss-scaled gradients with their scale give the step of the unscaled ones."""
  params = random_tree(5, [(33,), (4, 4)], device=device)
  g = grads(6, params)
  scale = jnp.float32(1024.0)
  g_scaled = jax.tree.map(lambda x: x * scale, g)
  if path == "fused":
    pf, sf = jax.jit(lambda p, s, g: jaxfuse.fused_step(tf, g, s, p, grad_scale=scale))(
        params, tf.init(params), g_scaled)
  else:
    u, sf = tf.update(g_scaled, tf.init(params), params, grad_scale=scale)
    pf = optax.apply_updates(params, u)
  po, so = jit_optax_step(to)(params, to.init(params), g)
  assert_trees_close((pf, sf), (po, so), rtol=rtol, atol=0)


def check_skip_nonfinite(tx, path, device, count):
  """A NaN, then an Inf gradient leave params and state bitwise as they were (the schedule's
  `count(state)` included), and each is counted."""
  params = random_tree(7, [(10,), (2, 3)], device=device)
  step = jax.jit(lambda p, s, g: jaxfuse.fused_step(tx, g, s, p)) if path == "fused" \
      else jit_optax_step(tx)  # no donation: compared afterwards
  params, state = step(params, tx.init(params), grads(8, params))
  for bad in (jnp.nan, jnp.inf):
    g = jax.tree.map(lambda x: x.at[(0,) * x.ndim].set(bad), grads(9, params))
    new_params, new_state = step(params, state, g)
    for a, b in zip(jax.tree.leaves((new_params, new_state[:-1])),
                    jax.tree.leaves((params, state[:-1]))):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert int(new_state[-1].skipped_steps) == int(state[-1].skipped_steps) + 1
    state = new_state
  assert int(count(state)) == 1 and int(state[-1].skipped_steps) == 2


def check_master_weights(tf, to, path, device):
  """bf16 params with a float32 master (and float32 state): the master follows float32 optax,
  the params are its rounding."""
  params = random_tree(10, [(), (5,), (301,)], jnp.bfloat16, device=device)
  pf, sf, po, _ = run_both(tf, to, params, path)
  master = sf[-1].master_params
  floats = [x for x in jax.tree.leaves((master, sf[:-1])) if jnp.issubdtype(x.dtype, jnp.floating)]
  assert all(x.dtype == jnp.float32 for x in floats)
  assert_trees_close(master, po, rtol=20 * F32_RTOL, atol=0, what="master")
  for p, m in zip(jax.tree.leaves(pf), jax.tree.leaves(master)):
    assert p.dtype == jnp.bfloat16
    p, rounded = np.asarray(p, np.float32), np.asarray(m.astype(jnp.bfloat16), np.float32)
    if path == "fused":
      np.testing.assert_array_equal(p, rounded)
    else:
      # The optax protocol's bf16 update lands exactly on the master's rounding only where the
      # step is at most the param's size (Sterbenz); a param near zero can end an ulp apart.
      np.testing.assert_allclose(p, rounded, rtol=2 * ulp(jnp.bfloat16))


def check_inject_hyperparams(tf, to, changes: dict, device, steps=8):
  """Hyperparameters in the state (optax.inject_hyperparams), set to `changes` halfway through
  without recompiling: optax's steps."""
  params = random_tree(11, [(13,), (2, 5)], device=device)
  traces = []
  step_f = jax.jit(lambda p, s, g: (traces.append(1), jaxfuse.fused_step(tf, g, s, p))[1])
  step_o = jit_optax_step(to)
  pf = po = params
  sf, so = tf.init(params), to.init(params)
  for t in range(steps):
    if t == steps // 2:
      for s in (sf, so):
        for name, value in changes.items():
          s.hyperparams[name] = jnp.full_like(s.hyperparams[name], value)
    g = grads(t, params)
    pf, sf = step_f(pf, sf, g)
    po, so = step_o(po, so, g)
  assert_trees_close(pf, po, rtol=8 * F32_RTOL, atol=0)
  assert len(traces) == 1


def check_multi_steps(tf_inner, to_inner, path, device):
  """jaxfuse.multi_steps (every 3 steps) is optax.MultiSteps."""
  params = random_tree(12, [(21,), (4, 2)], device=device)
  tf = jaxfuse.multi_steps(tf_inner, every_k_schedule=3)
  to = optax.MultiSteps(to_inner, every_k_schedule=3)
  pf, sf, po, _ = run_both(tf, to, params, path, steps=9)
  assert int(sf.gradient_step) == 3
  assert_trees_close(pf, po, rtol=9 * F32_RTOL, atol=0)
