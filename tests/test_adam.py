"""jaxfuse.adam / adamw and fused_step against optax, on fresh random pytrees."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxfuse
from jaxfuse._core import ffi as _ffi
from jaxfuse._optim import kernel_path as _kernel_path
from helpers import (UNPACKED, assert_trees_close, count_custom_calls, init_beside, random_tree,
                     ulp)

SHAPES = [(), (0,), (1,), (3,), (1023,), (65537,), (3, 7, 5), (2, 0, 4)]
F32_EPS = ulp(jnp.float32)
# One step of Adam is ~10 fp32 operations; XLA and the kernel may differ in FMA contraction and
# in pow(): a few ulp of the result per step.
STEP_RTOL = 16 * F32_EPS


def _grads(seed, params, scale=1.0):
  rng = np.random.default_rng(seed)
  return jax.tree.map(
      lambda p: jax.device_put(
          jnp.asarray(scale * rng.standard_normal(p.shape), p.dtype), p.devices().pop()), params)


def jit_step(tx, **kwargs):
  """A jitted fused step donating params and state. The donated arguments come in the order of
  the outputs (params, state): jax pairs donated inputs with outputs of the same shape in order,
  so another order would alias params to moments and force copies."""
  return jax.jit(lambda p, s, g: jaxfuse.fused_step(tx, g, s, p, **kwargs), donate_argnums=(0, 1))


def _on_cpu(tree):
  """The reference (optax) runs on the CPU: XLA's GPU code may keep a bf16 intermediate in fp32
  (excess precision), so optax on a GPU is not the strictly rounded math the kernels compute
  (measured on an H100: optax with mu_dtype=bf16, GPU against CPU, after 5 steps 58% of the
  elements differ, by up to 9e-3 of the leaf's largest)."""
  return jax.device_put(tree, jax.devices("cpu")[0])


def _run_both(fused_tx, optax_tx, params, steps, seed=1, grad_scale=1.0, rtol=STEP_RTOL):
  """Runs both transforms on the same gradients through the optax protocol (optax on the
  CPU); compares each step's updates and state (error bound growing with the step), and returns
  the final params and states of both."""
  upd_f = jax.jit(fused_tx.update)
  upd_o = jax.jit(optax_tx.update)
  pf, po = params, _on_cpu(params)
  sf, so = fused_tx.init(pf), init_beside(optax_tx, po)
  lr_scale = 1.0
  for t in range(steps):
    g = _grads(seed * 1000 + t, params, grad_scale)
    uf, sf = upd_f(g, sf, pf)
    uo, so = upd_o(_on_cpu(g), so, po)
    assert_trees_close(uf, uo, rtol=rtol * (t + 1), atol=1e-9 * lr_scale, what=f"step {t} updates")
    assert_trees_close(sf, so, rtol=rtol * (t + 1), atol=1e-12, what=f"step {t} state")
    pf, po = optax.apply_updates(pf, uf), optax.apply_updates(po, uo)
  return pf, po, sf, so


CONFIGS = {
    "adam": (lambda m: m.adam(1e-2), {}),
    "adamw": (lambda m: m.adamw(3e-3, weight_decay=0.1), {}),
    "adamw_schedule": (lambda m: m.adamw(optax.warmup_cosine_decay_schedule(0.0, 1e-2, 10, 60),
                                         weight_decay=0.05), {}),
    "nesterov": (lambda m: m.adamw(1e-2, nesterov=True), {}),
    "eps_root": (lambda m: m.adam(1e-2, eps=1e-6, eps_root=1e-8, b1=0.8, b2=0.99), {}),
    # A one-ulp fp32 difference can round the stored bf16 mu one bf16 ulp apart.
    "mu_bf16": (lambda m: m.adamw(1e-2, mu_dtype=jnp.bfloat16), {"rtol": ulp(jnp.bfloat16)}),
    "mask_tree": (lambda m: m.adamw(1e-2, weight_decay=0.3,
                                    mask=lambda p: {k: i % 2 == 0 for i, k in enumerate(sorted(p))}), {}),
    "wd_schedule": (lambda m: m.adamw(1e-2, weight_decay=optax.linear_schedule(0.1, 0.0, 30)), {}),
}


@pytest.mark.parametrize("config", list(CONFIGS))
def test_matches_optax_many_shapes(device, config):
  make, tol = CONFIGS[config]
  params = random_tree(0, SHAPES, device=device)
  pf, po, sf, so = _run_both(make(jaxfuse), make(optax), params, steps=50, **tol)
  assert jax.tree.structure(sf) == jax.tree.structure(so)
  assert_trees_close(pf, po, rtol=50 * tol.get("rtol", STEP_RTOL), atol=0, what="final params")


@pytest.mark.slow
def test_large_leaf(device):
  params = random_tree(3, [(3_000_017,), (5,)], device=device)
  pf, po, _, _ = _run_both(jaxfuse.adamw(1e-3), optax.adamw(1e-3), params, steps=3)
  assert_trees_close(pf, po, rtol=1e-6, atol=1e-8)


def test_state_structure_matches_optax():
  params = {"w": jnp.ones((3, 4)), "b": jnp.ones((4,)), "nested": [jnp.ones(()), jnp.ones((2,))]}
  cases = [
      (jaxfuse.adam(1e-3), optax.adam(1e-3)),
      (jaxfuse.adamw(1e-3), optax.adamw(1e-3)),
      (jaxfuse.adamw(optax.constant_schedule(1e-3), mask={"w": True, "b": False, "nested": True}),
       optax.adamw(optax.constant_schedule(1e-3), mask={"w": True, "b": False, "nested": True})),
      (jaxfuse.adamw(1e-3, mu_dtype=jnp.bfloat16), optax.adamw(1e-3, mu_dtype=jnp.bfloat16)),
  ]
  for tf, to in cases:
    sf, so = tf.init(params), to.init(params)
    assert jax.tree.structure(sf) == jax.tree.structure(so)
    for a, b in zip(jax.tree.leaves(sf), jax.tree.leaves(so)):
      assert a.shape == b.shape and a.dtype == b.dtype


@pytest.mark.parametrize("writer", ["optax", "jaxfuse"])
def test_checkpoint_moves_between_optax_and_jaxfuse(device, writer):
  """A state written by one library continues under the other exactly as under the writer."""
  params = random_tree(5, [(17,), (4, 3)], device=device)
  txs = {"optax": optax.adamw(1e-2), "jaxfuse": jaxfuse.adamw(1e-2)}
  s = txs[writer].init(params)
  p = params
  for t in range(5):
    u, s = txs[writer].update(_grads(t, params), s, p)
    p = optax.apply_updates(p, u)
  # Continue 5 steps with each library from the same state.
  runs = {name: (p, s) for name in txs}
  for t in range(5, 10):
    g = _grads(t, params)
    for name, tx in txs.items():
      pp, ss = runs[name]
      u, ss = tx.update(g, ss, pp)
      runs[name] = (optax.apply_updates(pp, u), ss)
  assert_trees_close(runs["jaxfuse"][0], runs["optax"][0], rtol=1e-6, atol=1e-8)
  assert int(runs["jaxfuse"][1][0].count) == 10


@pytest.mark.parametrize("config", ["adamw", "nesterov", "mask_tree", "adamw_schedule"])
def test_fused_step_matches_optax(device, config):
  make, _ = CONFIGS[config]
  params = random_tree(7, SHAPES, device=device)
  tf, to = make(jaxfuse), make(optax)
  step = jit_step(tf)
  upd_o = jax.jit(to.update)
  sf, so = tf.init(params), to.init(params)
  pf = jax.tree.map(jnp.copy, params)
  po = params
  for t in range(30):
    g = _grads(100 + t, params)
    pf, sf = step(pf, sf, g)
    u, so = upd_o(g, so, po)
    po = optax.apply_updates(po, u)
    assert_trees_close(pf, po, rtol=STEP_RTOL * (t + 1), atol=1e-9 * (t + 1), what=f"step {t}")
  assert_trees_close(sf, so, rtol=1e-5, atol=1e-10)


def test_fused_step_updates_in_place(device):
  params = random_tree(8, [(1000,), (33, 3)], device=device)
  tx = jaxfuse.adamw(1e-2)
  state = tx.init(params)
  step = jit_step(tx)
  g = _grads(0, params)
  params, state = step(params, state, g)  # first call: buffers now owned by the step's outputs
  before = [x.unsafe_buffer_pointer() for x in jax.tree.leaves((params, state[0].mu, state[0].nu))]
  params, state = step(params, state, g)
  after = [x.unsafe_buffer_pointer() for x in jax.tree.leaves((params, state[0].mu, state[0].nu))]
  assert before == after, "params / moments were not updated in place"
  # The step is one custom call, and XLA copies no parameter-sized buffer around it.
  text = step.lower(params, state, g).compile().as_text()
  assert count_custom_calls(text, "jaxfuse_adam") == 1
  assert not [l for l in text.splitlines() if " copy(" in l and "f32[1000]" in l], text


def test_no_recompile_across_steps_and_schedules(device):
  params = random_tree(10, [(64,), (8, 8)], device=device)
  tx = jaxfuse.adamw(optax.exponential_decay(1e-2, 10, 0.5))
  traces = []

  def fn(p, s, g):
    traces.append(1)  # runs once per trace
    return jaxfuse.fused_step(tx, g, s, p)

  step = jax.jit(fn, donate_argnums=(0, 1))
  state = tx.init(params)
  for t in range(6):
    params, state = step(params, state, _grads(t, params))
  assert len(traces) == 1


# ---- low precision ------------------------------------------------------------------------


def _reference_low_precision(optax_tx, grads, state, params):
  """optax's math in fp32 on upcast inputs, state rounded back to its storage dtypes: what the
  kernel computes (it never does arithmetic in bf16/fp16)."""
  f32 = lambda t: jax.tree.map(lambda x: x.astype(jnp.float32) if jnp.issubdtype(x.dtype, jnp.floating) else x, t)
  u, s = optax_tx.update(f32(grads), f32(state), f32(params))
  s = jax.tree.map(lambda new, old: new.astype(old.dtype), s, state)
  return u, s


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_low_precision_params(device, dtype):
  params = random_tree(11, SHAPES, dtype=dtype, device=device)
  tf, to = jaxfuse.adamw(1e-2, weight_decay=0.1), optax.adamw(1e-2, weight_decay=0.1)
  state = tf.init(params)
  upd = jax.jit(tf.update)
  ref = jax.jit(lambda g, s, p: _reference_low_precision(to, g, s, p))
  p = params
  for t in range(20):
    g = _grads(200 + t, params)
    u, new_state = upd(g, state, p)
    u_ref, s_ref = ref(g, state, p)
    # fp32 math then one rounding to the storage dtype: within one storage ulp of the reference.
    assert_trees_close(new_state, s_ref, rtol=ulp(dtype), atol=0, what=f"step {t} state")
    assert_trees_close(u, u_ref, rtol=ulp(dtype), atol=1e-2 * ulp(dtype) * 1e-2, what=f"step {t} u")
    assert all(x.dtype == y.dtype for x, y in zip(jax.tree.leaves(new_state), jax.tree.leaves(state)))
    state, p = new_state, optax.apply_updates(p, u)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("grad_dtype", [jnp.float32, "same"])
@pytest.mark.parametrize("mu_dtype", [None, jnp.bfloat16])
def test_master_weights(device, dtype, grad_dtype, mu_dtype):
  """Low-precision params with an fp32 master copy: the master follows fp32 optax exactly and the
  params are its rounding."""
  shapes = [(), (5,), (1023,), (3, 17)]
  master0 = random_tree(12, shapes, device=device)
  params = jax.tree.map(lambda x: x.astype(dtype), master0)
  master0 = jax.tree.map(lambda x: x.astype(jnp.float32), params)
  tf = jaxfuse.adamw(1e-2, mu_dtype=mu_dtype, weight_decay=0.1, master_weights=True)
  to = optax.adamw(1e-2, mu_dtype=mu_dtype, weight_decay=0.1)
  sf, so = tf.init(params), init_beside(to, _on_cpu(master0))
  extra = sf[-1]
  assert isinstance(extra, jaxfuse.AdamExtraState)
  assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(extra.master_params))
  assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(sf[0].nu))
  step = jit_step(tf)
  upd_o = jax.jit(to.update)
  pf, po = params, _on_cpu(master0)
  gd = dtype if grad_dtype == "same" else grad_dtype
  for t in range(20):
    g = jax.tree.map(lambda x: x.astype(gd), _grads(300 + t, master0))
    pf, sf = step(pf, sf, g)
    u, so = upd_o(_on_cpu(jax.tree.map(lambda x: x.astype(jnp.float32), g)), so, po)
    po = optax.apply_updates(po, u)
  master = sf[-1].master_params
  # A bf16 mu may round one bf16 ulp apart in the two runs: each step's update then differs by
  # up to ~lr * ulp(bf16).
  atol = 20 * 1e-2 * (ulp(mu_dtype) if mu_dtype is not None else STEP_RTOL)
  assert_trees_close(master, po, rtol=20 * STEP_RTOL, atol=atol, what="master")
  for p, m in zip(jax.tree.leaves(pf), jax.tree.leaves(master)):
    assert p.dtype == dtype
    np.testing.assert_array_equal(np.asarray(p.astype(jnp.float32)),
                                  np.asarray(m.astype(dtype).astype(jnp.float32)))


def test_master_weights_optax_path(device):
  params = random_tree(13, [(7,), (2, 9)], dtype=jnp.bfloat16, device=device)
  tf = jaxfuse.adamw(1e-2, master_weights=True)
  state = tf.init(params)
  p = params
  for t in range(5):
    u, state = tf.update(_grads(t, params), state, p)
    # optax's rule: updates have the grads' dtype; the bf16 update is the exact step from the
    # params onto the master's rounding, so apply_updates lands there bitwise.
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(u))
    p = optax.apply_updates(p, u)
  for a, m in zip(jax.tree.leaves(p), jax.tree.leaves(state[-1].master_params)):
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(m.astype(jnp.bfloat16), np.float32))


def test_mixed_dtype_tree_one_call(device):
  params = random_tree(14, [(9,), (9,), (4, 4)], dtype=[jnp.float32, jnp.bfloat16, jnp.float16],
                       device=device)
  tf = jaxfuse.adam(1e-2)
  state = tf.init(params)
  fused = jax.jit(lambda g, s, p: jaxfuse.fused_step(tf, g, s, p))
  assert count_custom_calls(fused.lower(_grads(0, params), state, params).as_text(),
                            "jaxfuse_adam") == 1
  # the optax protocol leaves the element math to XLA (it fuses with apply_updates)
  assert count_custom_calls(jax.jit(tf.update).lower(_grads(0, params), state, params).as_text(),
                            "jaxfuse_adam") == 0
  u, _ = jax.jit(tf.update)(_grads(0, params), state, params)
  u_ref, _ = _reference_low_precision(optax.adam(1e-2), _grads(0, params), state, params)
  assert_trees_close(u, u_ref, rtol=ulp(jnp.bfloat16), atol=0)


# ---- optax wrappers -----------------------------------------------------------------------


def test_inside_optax_chain(device):
  params = random_tree(15, [(11,), (3, 3)], device=device)
  tf = optax.chain(optax.scale_by_trust_ratio(), jaxfuse.adamw(1e-2), optax.scale(0.5))
  to = optax.chain(optax.scale_by_trust_ratio(), optax.adamw(1e-2), optax.scale(0.5))
  pf, po, _, _ = _run_both(tf, to, params, steps=10)
  assert_trees_close(pf, po, rtol=1e-6, atol=1e-8)


def test_inject_hyperparams(device):
  params = random_tree(16, [(13,), (2, 5)], device=device)
  tf = optax.inject_hyperparams(jaxfuse.adamw)(learning_rate=1e-2, b1=0.9, weight_decay=0.1)
  to = optax.inject_hyperparams(optax.adamw)(learning_rate=1e-2, b1=0.9, weight_decay=0.1)
  sf, so = tf.init(params), to.init(params)
  traces = []
  upd_f = jax.jit(lambda *a: (traces.append(1), tf.update(*a))[1])
  upd_o = jax.jit(to.update)
  pf = po = params
  for t in range(8):
    if t == 4:  # change hyperparameters mid-run, without recompiling
      for s in (sf, so):
        s.hyperparams["learning_rate"] = jax.lax.full_like(s.hyperparams["learning_rate"], 3e-3)
        s.hyperparams["b1"] = jax.lax.full_like(s.hyperparams["b1"], 0.8)
    g = _grads(t, params)
    uf, sf = upd_f(g, sf, pf)
    uo, so = upd_o(g, so, po)
    pf, po = optax.apply_updates(pf, uf), optax.apply_updates(po, uo)
  assert_trees_close(pf, po, rtol=1e-6, atol=1e-8)
  assert len(traces) == 1


def test_multi_steps(device):
  params = random_tree(17, [(21,), (4, 2)], device=device)
  tf = optax.MultiSteps(jaxfuse.adamw(1e-2), every_k_schedule=3)
  to = optax.MultiSteps(optax.adamw(1e-2), every_k_schedule=3)
  pf, po, _, _ = _run_both(tf, to, params, steps=9)
  assert_trees_close(pf, po, rtol=1e-6, atol=1e-8)


def test_apply_if_finite(device):
  params = random_tree(18, [(6,), (3, 2)], device=device)
  tf = optax.apply_if_finite(jaxfuse.adamw(1e-2), max_consecutive_errors=5)
  to = optax.apply_if_finite(optax.adamw(1e-2), max_consecutive_errors=5)
  sf, so = tf.init(params), to.init(params)
  pf = po = params
  for t in range(6):
    g = _grads(t, params)
    if t in (2, 3):
      g = jax.tree.map(lambda x: x.at[0].set(jnp.nan) if x.ndim else jnp.nan, g)
    uf, sf = jax.jit(tf.update)(g, sf, pf)
    uo, so = jax.jit(to.update)(g, so, po)
    pf, po = optax.apply_updates(pf, uf), optax.apply_updates(po, uo)
  assert_trees_close(pf, po, rtol=1e-6, atol=1e-8)
  assert int(sf.notfinite_count) == int(so.notfinite_count) == 0 and int(sf.total_notfinite) == 2


def test_flax_train_state(device):
  flax_ts = pytest.importorskip("flax.training.train_state")
  params = random_tree(19, [(5,), (5, 3)], device=device)
  apply_fn = lambda p, x: jnp.sum(x @ p["leaf0001"]) + jnp.sum(p["leaf0000"] * x)
  states = {name: flax_ts.TrainState.create(apply_fn=apply_fn, params=params, tx=mod.adamw(1e-2))
            for name, mod in (("jaxfuse", jaxfuse), ("optax", optax))}
  x = jnp.arange(5.0)

  @jax.jit
  def train_step(state):
    grads = jax.grad(lambda p: state.apply_fn(p, x) ** 2)(state.params)
    return state.apply_gradients(grads=grads)

  for _ in range(5):
    states = {k: train_step(s) for k, s in states.items()}
  assert_trees_close(states["jaxfuse"].params, states["optax"].params, rtol=1e-6, atol=1e-8)


# ---- bad input ----------------------------------------------------------------------------


def test_rejects_non_float_leaves():
  params = {"w": jnp.ones((3,)), "steps": jnp.ones((2,), jnp.int32)}
  with pytest.raises(TypeError, match=r"params leaf \['steps'\] has dtype int32"):
    jaxfuse.adamw(1e-3).init(params)
  good = {"w": jnp.ones((3,))}
  tx = jaxfuse.adamw(1e-3)
  with pytest.raises(TypeError, match=r"grads leaf \['w'\] has dtype int32"):
    tx.update({"w": jnp.ones((3,), jnp.int32)}, tx.init(good), good)


def test_rejects_mismatched_trees():
  params = {"w": jnp.ones((3,)), "b": jnp.ones((2,))}
  tx = jaxfuse.adamw(1e-3)
  state = tx.init(params)
  with pytest.raises(ValueError, match=r"different tree structures.*only in params: \['b'\]"):
    tx.update({"w": jnp.ones((3,))}, state, params)
  with pytest.raises(ValueError, match=r"leaf \['b'\] has shape \(3,\) in grads but \(2,\) in params"):
    tx.update({"w": jnp.ones((3,)), "b": jnp.ones((3,))}, state, params)
  with pytest.raises(ValueError, match=r"leaf \['b'\] has shape \(3,\) in grads"):
    jit_step(tx)(params, state, {"w": jnp.ones((3,)), "b": jnp.ones((3,))})


def test_rejects_state_of_another_optimizer():
  params = {"w": jnp.ones((3,))}
  tx = jaxfuse.adamw(1e-3)
  with pytest.raises(ValueError, match="opt_state does not match"):
    tx.update(params, optax.sgd(1e-3, momentum=0.9).init(params), params)
  with pytest.raises(ValueError, match="opt_state does not match"):
    tx.update(params, jaxfuse.adamw(1e-3).init({"v": jnp.ones((3,))}), params)
  with pytest.raises(ValueError, match=r"opt_state leaf .*mu.* has float32\[4\], expected float32\[3\]"):
    tx.update(params, jaxfuse.adamw(1e-3).init({"w": jnp.ones((4,))}), params)


def test_rejects_unfusable_transform():
  params = {"w": jnp.ones((3,))}
  tx = optax.adamw(1e-3)
  with pytest.raises(TypeError, match="no jaxfuse optimizer ran in this transform"):
    jaxfuse.fused_step(tx, params, tx.init(params), params)


def test_adamw_update_without_params_is_an_error():
  """As optax's adamw (adam takes none: test_dtypes.py)."""
  params = {"w": jnp.ones((3,))}
  tx = jaxfuse.adamw(1e-3)
  with pytest.raises(ValueError, match="needs params"):
    tx.update(params, tx.init(params))


def test_nonfinite_grads_do_not_touch_state_in_skip_mode(device):
  params = random_tree(20, [(10,), (2, 3)], device=device)
  tx = jaxfuse.adamw(1e-2, skip_nonfinite=True)
  state = tx.init(params)
  step = jax.jit(lambda p, s, g: jaxfuse.fused_step(tx, g, s, p))  # no donation: compare after
  params, state = step(params, state, _grads(0, params))
  for bad in (jnp.nan, jnp.inf, -jnp.inf):
    g = jax.tree.map(lambda x: x.at[(0,) * x.ndim].set(bad), _grads(1, params))
    new_params, new_state = step(params, state, g)
    for a, b in zip(jax.tree.leaves((new_params, new_state[0])), jax.tree.leaves((params, state[0]))):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert int(new_state[-1].skipped_steps) == int(state[-1].skipped_steps) + 1
    state = new_state
  assert int(state[0].count) == 1 and int(state[-1].skipped_steps) == 3


def test_handler_rejects_inconsistent_calls():
  """The FFI handler validates what it receives and fails with a message, never a crash."""
  xs = [jnp.ones((4,))] * 4  # grads, params, mu, nu of one tensor
  layout = _ffi.contract("jaxfuse_adam").names
  count = jnp.zeros((), jnp.int32)
  hyper, grad_ctrl = jnp.zeros((len(layout["hyper"]),)), jnp.zeros((len(layout["grad_ctrl"]),))
  results = [jax.ShapeDtypeStruct((), jnp.int32)] + [jax.ShapeDtypeStruct((4,), jnp.float32)] * 3
  call = jax.ffi.ffi_call(_ffi.target("jaxfuse_adam"), results, vmap_method="sequential")
  attrs = dict(flags=np.int64(0), master=False, remainders=False, stochastic_rounding=False,
               quantized_states=False, tensor_flags=np.zeros(1, np.uint8), **UNPACKED)
  one = dict(attrs, num_tensors=np.int64(1))
  with pytest.raises(Exception, match="do not fit num_tensors=2"):
    jax.block_until_ready(call(count, hyper, grad_ctrl, *xs, num_tensors=np.int64(2),
                               **dict(attrs, tensor_flags=np.zeros(2, np.uint8))))
  with pytest.raises(Exception, match="hyper has 3 elements"):
    jax.block_until_ready(call(count, jnp.zeros((3,)), grad_ctrl, *xs, **one))
  with pytest.raises(Exception, match="not aliased"):  # params, mu, nu updated in place
    jax.block_until_ready(call(count, hyper, grad_ctrl, *xs, **one))
  with pytest.raises(Exception, match="flags 2 has bits beyond"):
    jax.block_until_ready(call(count, hyper, grad_ctrl, *xs, **dict(one, flags=np.int64(2))))
  call = jax.ffi.ffi_call(_ffi.target("jaxfuse_adam"), results,
                          input_output_aliases={4: 1, 5: 2, 6: 3})
  with pytest.raises(Exception, match="list 'params' has 4 elements, list 'grads' has 5"):
    jax.block_until_ready(call(count, hyper, grad_ctrl, jnp.ones((5,)), *xs[1:], **one))


def test_vmap_over_an_ensemble(device):
  """vmap over a leading ensemble axis (the FFI call is applied per member)."""
  params = random_tree(22, [(3, 5), (5,)], device=device)
  params = jax.tree.map(lambda x: jnp.stack([x, 2 * x, -x]), params)
  grads = jax.tree.map(lambda x: jnp.cos(x), params)
  tf, to = jaxfuse.adamw(1e-2), optax.adamw(1e-2)
  uf, sf = jax.jit(jax.vmap(tf.update))(grads, jax.vmap(tf.init)(params), params)
  uo, so = jax.vmap(to.update)(grads, jax.vmap(to.init)(params), params)
  assert_trees_close(uf, uo, rtol=STEP_RTOL, atol=0)
  assert_trees_close(sf, so, rtol=STEP_RTOL, atol=0)


@pytest.mark.parametrize("param_dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("grad_dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("mu_dtype", [None, jnp.float32, jnp.bfloat16])
def test_update_dtypes_match_optax(device, param_dtype, grad_dtype, mu_dtype):
  """The optax protocol returns updates of optax's dtype (grads and moments promoted)."""
  params = random_tree(23, [(7,), (3, 4)], dtype=param_dtype, device=device)
  grads = random_tree(30, [(7,), (3, 4)], dtype=grad_dtype, scale=0.5, device=device)
  tf, to = jaxfuse.adamw(1e-2, mu_dtype=mu_dtype), optax.adamw(1e-2, mu_dtype=mu_dtype)
  uf, _ = tf.update(grads, tf.init(params), params)
  uo, _ = to.update(grads, to.init(params), params)
  assert [x.dtype for x in jax.tree.leaves(uf)] == [x.dtype for x in jax.tree.leaves(uo)]
  # A few ulp of the least precise dtype the step stores (params, grads or moments) apart.
  coarsest = max(ulp(d) for d in (param_dtype, grad_dtype, mu_dtype or param_dtype))
  assert_trees_close(uf, uo, rtol=max(4 * coarsest, STEP_RTOL), atol=0)


def test_master_weights_with_fp32_leaves(device):
  """A tree mixing bf16 and fp32 params with master weights, through the donated fused step."""
  params = random_tree(24, [(9,), (4, 4)], dtype=[jnp.bfloat16, jnp.float32], device=device)
  tf = jaxfuse.adamw(1e-2, master_weights=True)
  to = optax.adamw(1e-2)
  step = jit_step(tf)
  sf = tf.init(params)
  master0 = jax.tree.map(lambda x: x.astype(jnp.float32), params)
  po, so = master0, to.init(master0)
  pf = jax.tree.map(jnp.copy, params)
  for t in range(5):
    g = _grads(400 + t, master0)
    pf, sf = step(pf, sf, g)
    u, so = to.update(g, so, po)
    po = optax.apply_updates(po, u)
  assert_trees_close(sf[-1].master_params, po, rtol=5 * STEP_RTOL, atol=0)
  assert pf["leaf0000"].dtype == jnp.bfloat16 and pf["leaf0001"].dtype == jnp.float32


def test_fused_step_over_several_calls(device, monkeypatch):
  """More leaves than one FFI call takes: every call updates its leaves in place, with clipping
  and the non-finite skip deciding for the whole tree. The calls are cut at 16 leaves here (the
  same splitting at a size that compiles in seconds); test_report.py and families/test_trust_ratio.py step
  trees past the real MAX_LEAVES_PER_CALL."""
  monkeypatch.setattr(_kernel_path, "MAX_LEAVES_PER_CALL", 16)
  rng = np.random.default_rng(25)
  params = random_tree(26, [(int(rng.integers(1, 50)),) for _ in range(2 * 16 + 7)], device=device)
  tf = optax.chain(jaxfuse.clip_by_global_norm(1.0), jaxfuse.adamw(1e-2, skip_nonfinite=True))
  to = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2))
  step = jit_step(tf)

  @jax.jit
  def optax_step(p, s, g):
    u, s = to.update(g, s, p)
    return optax.apply_updates(p, u), s

  # Jitted inits: eagerly, every leaf shape would be a dispatch and a compile of its own.
  sf, so = jax.jit(tf.init)(params), jax.jit(to.init)(params)
  assert count_custom_calls(step.lower(params, sf, params).as_text(), "jaxfuse_adam") == 3
  pf, po = jax.tree.map(jnp.copy, params), params
  for t in range(3):
    g = _grads(500 + t, params, scale=0.3)
    pf, sf = step(pf, sf, g)
    po, so = optax_step(po, so, g)
  assert_trees_close(pf, po, rtol=3 * 32 * F32_EPS, atol=0)
  # A NaN in the last leaf (in the last call) stops the update of the first leaf too.
  g = _grads(600, params)
  last = sorted(g)[-1]
  g[last] = g[last].at[0].set(jnp.nan)
  before = np.asarray(pf["leaf0000"])
  pf, sf = step(pf, sf, g)
  np.testing.assert_array_equal(np.asarray(pf["leaf0000"]), before)
  assert int(sf[1][-1].skipped_steps) == 1 and int(sf[1][0].count) == 3


def test_fused_step_on_a_one_transform_chain(device):
  params = random_tree(27, [(5,), (2, 3)], device=device)
  grads = _grads(0, params)
  tf, to = optax.chain(jaxfuse.adamw(1e-2)), optax.chain(optax.adamw(1e-2))
  pf, sf = jaxfuse.fused_step(tf, grads, tf.init(params), params)
  u, so = to.update(grads, to.init(params), params)
  assert jax.tree.structure(sf) == jax.tree.structure(so)
  assert_trees_close(pf, optax.apply_updates(params, u), rtol=STEP_RTOL, atol=0)


def test_grad_scale_without_skip(device):
  """A bare loss scale needs no global-norm pass: one custom call, same step as unscaled grads."""
  params = random_tree(28, [(33,), (4, 4)], device=device)
  g = _grads(29, params)
  S = jnp.float32(1024.0)
  g_scaled = jax.tree.map(lambda x: x * S, g)
  tf, to = jaxfuse.adamw(1e-2), optax.adamw(1e-2)
  fn = lambda p, s, g: jaxfuse.fused_step(tf, g, s, p, grad_scale=S)
  lowered = jax.jit(fn).lower(params, tf.init(params), g_scaled)
  assert count_custom_calls(lowered.as_text(), "jaxfuse_global_norm") == 0
  assert count_custom_calls(lowered.as_text(), "jaxfuse_adam") == 1
  pf, _ = lowered.compile()(params, tf.init(params), g_scaled)
  u, _ = to.update(g, to.init(params), params)
  assert_trees_close(pf, optax.apply_updates(params, u), rtol=2 * STEP_RTOL, atol=0)
  u2, _ = tf.update(g_scaled, tf.init(params), params, grad_scale=S)  # optax protocol
  assert_trees_close(u2, u, rtol=2 * STEP_RTOL, atol=0)
