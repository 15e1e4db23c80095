"""jaxfuse's sgd against optax.sgd, through the optax protocol and the fused in-place step."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxfuse
from jaxfuse import _sgd
from jaxfuse import sgd
from helpers import assert_trees_close, count_custom_calls, random_tree, ulp
from optimizer_cases import (DTYPES, PATHS, SHAPES, assert_matches_optax, grads, jit_optax_step,
                             jit_step, on_cpu_copy, run_both)

F32_RTOL = 8 * ulp(jnp.float32)

CONFIGS = {
    "plain": (lambda m: m.sgd(0.1), 0.0),
    "momentum": (lambda m: m.sgd(0.05, momentum=0.9), 0.0),
    "nesterov": (lambda m: m.sgd(0.05, momentum=0.9, nesterov=True), 0.0),
    # optax rounds momentum * trace to the trace's bf16 (a Python float is weakly typed),
    # jaxfuse computes it in float32: the traces, and through them the params, drift apart by
    # up to a bf16 ulp per step.
    "trace_bf16": (lambda m: m.sgd(0.05, momentum=0.8, accumulator_dtype=jnp.bfloat16),
                   ulp(jnp.bfloat16)),
    "schedule": (lambda m: m.sgd(optax.linear_schedule(0.1, 0.01, 15), momentum=0.5), 0.0),
}


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("config", list(CONFIGS))
def test_matches_optax(device, config, dtype, path):
  if config in ("trace_bf16", "schedule") and dtype in (jnp.float16, jnp.float64):
    pytest.skip("the float32 and bfloat16 runs cover this option; the suite stays fast")
  make, extra_rtol = CONFIGS[config]
  with jax.enable_x64(dtype == jnp.float64):
    params = random_tree(0, SHAPES, dtype, device=device)
    assert_matches_optax(make(_sgd), make(optax), params, path, extra_rtol)


@pytest.mark.parametrize("path", PATHS)
def test_complex_leaves(device, path):
  """The math is linear: complex leaves are stepped per real and imaginary part, as optax."""
  params = random_tree(1, [(), (5,), (3, 4)], jnp.complex64, device=device)
  make = CONFIGS["nesterov"][0]
  assert_matches_optax(make(_sgd), make(optax), params, path, steps=5)


@pytest.mark.parametrize("config", list(CONFIGS))
def test_state_structure_matches_optax(config):
  make, _ = CONFIGS[config]
  params = {"w": jnp.ones((3, 4)), "b": jnp.ones((4,)), "nested": [jnp.ones(()), jnp.ones((0,))]}
  sf, so = make(_sgd).init(params), make(optax).init(params)
  assert jax.tree.structure(sf) == jax.tree.structure(so)
  for a, b in zip(jax.tree.leaves(sf), jax.tree.leaves(so)):
    assert a.shape == b.shape and a.dtype == b.dtype
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("writer", ["optax", "jaxfuse"])
def test_checkpoint_moves_between_optax_and_jaxfuse(device, writer):
  """A state written by one library continues under the other."""
  params = random_tree(2, [(17,), (4, 3)], device=device)
  txs = {"optax": optax.sgd(0.05, 0.9, nesterov=True), "jaxfuse": sgd(0.05, 0.9, nesterov=True)}
  p, s = params, txs[writer].init(params)
  for t in range(3):
    p, s = jit_optax_step(txs[writer])(p, s, grads(t, params))
  ends = {}
  for name, tx in txs.items():
    pp, ss = p, s
    for t in range(3, 6):
      pp, ss = jit_optax_step(tx)(pp, ss, grads(t, params))
    ends[name] = pp
  assert_trees_close(ends["jaxfuse"], ends["optax"], rtol=6 * F32_RTOL, atol=0)


def test_clip_and_grad_norm_folded_in(device):
  """jaxfuse.clip_by_global_norm before sgd: one norm call and one sgd call, optax's step."""
  params = random_tree(3, SHAPES, device=device)
  tf = optax.chain(jaxfuse.clip_by_global_norm(0.5), sgd(0.1, momentum=0.9))
  to = optax.chain(optax.clip_by_global_norm(0.5), optax.sgd(0.1, momentum=0.9))
  g = grads(4, params)
  fn = lambda p, s, g: jaxfuse.fused_step(tf, g, s, p, return_grad_norm=True)
  text = jax.jit(fn).lower(params, tf.init(params), g).as_text()
  assert count_custom_calls(text, "jaxfuse_sgd") == 1
  assert count_custom_calls(text, "jaxfuse_global_norm") == 1
  pf, sf, norm = jax.jit(fn)(params, tf.init(params), g)
  po, so = jit_optax_step(to)(params, to.init(params), g)
  np.testing.assert_allclose(norm, optax.tree.norm(g), rtol=2 * F32_RTOL)
  assert_trees_close(pf, po, rtol=4 * F32_RTOL, atol=0)
  assert_trees_close(sf, so, rtol=4 * F32_RTOL, atol=0)


@pytest.mark.parametrize("path", PATHS)
def test_grad_scale(device, path):
  """Loss-scaled gradients with their scale give the step of the unscaled ones."""
  params = random_tree(5, [(33,), (4, 4)], device=device)
  g = grads(6, params)
  scale = jnp.float32(1024.0)
  g_scaled = jax.tree.map(lambda x: x * scale, g)
  tf, to = sgd(0.1, momentum=0.9), optax.sgd(0.1, momentum=0.9)
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
  """A non-finite gradient leaves params, trace and count bitwise as they were, and is
  counted."""
  params = random_tree(7, [(10,), (2, 3)], device=device)
  tx = sgd(optax.linear_schedule(0.1, 0.0, 10), momentum=0.9, skip_nonfinite=True)
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
  assert int(state[1].count) == 1 and int(state[-1].skipped_steps) == 2


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("momentum", [None, 0.9])
def test_master_weights(device, path, momentum):
  """bf16 params with a float32 master: the master follows float32 optax, the params are its
  rounding."""
  master0 = random_tree(10, [(), (5,), (301,)], jnp.bfloat16, device=device)
  master0 = jax.tree.map(lambda x: x.astype(jnp.float32), master0)
  params = jax.tree.map(lambda x: x.astype(jnp.bfloat16), master0)
  tf, to = sgd(0.05, momentum, master_weights=True), optax.sgd(0.05, momentum)
  pf, sf, po, _ = run_both(tf, to, params, path)
  master = sf[-1].master_params
  assert all(x.dtype == jnp.float32 for x in jax.tree.leaves((master, sf[0])))
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


def test_inject_hyperparams(device):
  """Hyperparameters in the state, changed mid-run without recompiling."""
  params = random_tree(11, [(13,), (2, 5)], device=device)
  tf = optax.inject_hyperparams(sgd)(learning_rate=0.05, momentum=0.9)
  to = optax.inject_hyperparams(optax.sgd)(learning_rate=0.05, momentum=0.9)
  traces = []
  step_f = jax.jit(lambda p, s, g: (traces.append(1), jaxfuse.fused_step(tf, g, s, p))[1])
  step_o = jit_optax_step(to)
  pf = po = params
  sf, so = tf.init(params), to.init(params)
  for t in range(8):
    if t == 4:
      for s in (sf, so):
        s.hyperparams["learning_rate"] = jnp.full_like(s.hyperparams["learning_rate"], 0.01)
        s.hyperparams["momentum"] = jnp.full_like(s.hyperparams["momentum"], 0.5)
    g = grads(t, params)
    pf, sf = step_f(pf, sf, g)
    po, so = step_o(po, so, g)
  assert_trees_close(pf, po, rtol=8 * F32_RTOL, atol=0)
  assert len(traces) == 1


@pytest.mark.parametrize("path", PATHS)
def test_multi_steps(device, path):
  params = random_tree(12, [(21,), (4, 2)], device=device)
  tf = jaxfuse.multi_steps(sgd(0.1, momentum=0.9), every_k_schedule=3)
  to = optax.MultiSteps(optax.sgd(0.1, momentum=0.9), every_k_schedule=3)
  pf, sf, po, so = run_both(tf, to, params, path, steps=9)
  assert int(sf.gradient_step) == 3
  assert_trees_close(pf, po, rtol=9 * F32_RTOL, atol=0)


def test_rejects_mismatched_trees():
  params = {"w": jnp.ones((3,)), "b": jnp.ones((2,))}
  tx = sgd(0.1, momentum=0.9)
  state = tx.init(params)
  with pytest.raises(ValueError, match=r"only in params: \['b'\]"):
    tx.update({"w": jnp.ones((3,))}, state, params)
  with pytest.raises(ValueError, match=r"leaf \['b'\] has shape \(3,\) in grads"):
    jit_step(tx)(params, state, {"w": jnp.ones((3,)), "b": jnp.ones((3,))})
  with pytest.raises(ValueError, match="opt_state does not match"):
    tx.update(params, optax.sgd(0.1).init(params), params)


def test_rejects_accumulator_dtype_that_does_not_fit():
  params = {"z": jnp.ones((3,), jnp.complex64)}
  with pytest.raises(ValueError, match=r"accumulator_dtype bfloat16 does not fit params leaf "
                                       r"\['z'\] \(complex64\)"):
    sgd(0.1, momentum=0.9, accumulator_dtype=jnp.bfloat16).init(params)
  with pytest.raises(ValueError, match="accumulator_dtype int32 is not supported"):
    sgd(0.1, momentum=0.9, accumulator_dtype=jnp.int32).init({"w": jnp.ones((3,))})
