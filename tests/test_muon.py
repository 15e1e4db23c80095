"""jaxfuse.muon against optax.contrib.muon (optax's own Muon tests run against it in
test_optax_suite.py), and its batched Newton-Schulz against optax's per-matrix one.

Newton-Schulz is a polynomial of high degree (3**5 in the matrix for 5 iterations) evaluated by
matmuls: the batched chain sums its products in another order than optax's per-matrix one, so
orthogonalized values agree to NS_RTOL relative to a leaf's largest element, not to the few ulps
of the element-wise families."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from optax.contrib import MuonDimensionNumbers
from optax.contrib import _muon as optax_muon

import jaxfuse
from helpers import assert_trees_close, normal_grads as grads, random_tree, ulp
from jaxfuse._optim import newton_schulz
from lockstep import copy_tree, jit_fused, jit_step, lockstep

NS_RTOL = 64 * ulp(jnp.float32)

# Matrices of three stacked shapes ((24, 40) twice, wide and tall; (16, 16) twice; (8, 40, 24),
# which under 3-D dimension numbers is 8 matrices), beside AdamW leaves (a vector, a scalar).
SHAPES = {"a": (24, 40), "b": (40, 24), "c": (16, 16), "d": (16, 16), "e": (40,), "f": ()}


def _params(device, dtype=jnp.float32):
  tree = random_tree(3, list(SHAPES.values()), dtype=dtype, device=device)
  return dict(zip(SHAPES, jax.tree.leaves(tree)))


@pytest.mark.parametrize("preconditioning", newton_schulz.PRECONDITIONINGS)
def test_batched_newton_schulz_matches_optax_per_matrix(preconditioning):
  """A stack of one wide and one tall matrix (stacked as its transpose), orthogonalized in one
  batched chain, equals optax's orthogonalization of each; Gram Newton-Schulz gets as close to
  orthogonal as the standard iteration on the same stack."""
  rng = np.random.default_rng(0)
  wide, tall = (jnp.asarray(rng.standard_normal(s), jnp.float32) for s in ((24, 56), (56, 24)))
  dims = MuonDimensionNumbers()
  shapes = [newton_schulz.matrices(x.shape, dims, name) for x, name in ((wide, "w"), (tall, "t"))]
  coeffs = jnp.asarray(jaxfuse._optim.families.muon.NS_PRESETS["standard"])
  # eps 1e-3: optax reads it where it preconditions by a norm, and not in AOL's and Schatten's
  # first iterations.
  ours, gram = (newton_schulz.orthogonalize_leaves([wide, tall], shapes, coeffs, 5,
                                                   preconditioning, 1e-3, method)
                for method in ("standard", "gram"))
  for x, o in zip((wide, tall), ours):
    ref = optax_muon.orthogonalize_via_newton_schulz(x, coeffs, 5, preconditioning, 1e-3, dims)
    assert_trees_close(o, ref, rtol=NS_RTOL, atol=0, what=preconditioning)
  for o, g in zip(ours, gram):
    assert_trees_close(g, o, rtol=1e-4, atol=0, what=f"{preconditioning} gram")
    sv_o, sv_g = (np.linalg.svd(np.asarray(x), compute_uv=False) for x in (o, g))
    np.testing.assert_allclose(sv_g, sv_o, atol=1e-4)
    assert 0.6 < sv_o.min() and sv_o.max() < 1.3  # the quintic's band around 1


# Each option through one path (the element passes are the same math on both; the fused path
# against a reference also in test_fused_step_with_clip_scale_and_nonfinite_skip).
OPTIONS = {
    "defaults": ("optax", dict()),
    "no nesterov, decay masked, adaptive": ("fused", dict(
        nesterov=False, weight_decay=0.1, adaptive=True,
        weight_decay_mask=lambda p: {k: k != "a" for k in p})),
    "dion rows, consistent rms, adam group's own": ("optax", dict(
        ns_coeffs="dion", consistent_rms=0.2, adam_learning_rate=3e-3,
        adam_weight_decay=optax.constant_schedule(0.01),
        adam_b2=0.99, learning_rate=optax.linear_schedule(2e-2, 1e-2, 10))),
    "3-D leaves by dimension numbers": ("fused", dict(
        muon_weight_dimension_numbers=lambda p: {  # optax also passes masked trees: shapes only
            k: (MuonDimensionNumbers(1, 2) if k == "g" else MuonDimensionNumbers()
                if len(getattr(x, "shape", ())) == 2 else None) for k, x in p.items()})),
}


@pytest.mark.parametrize("option,path", [(name, path) for name, (path, _) in OPTIONS.items()])
def test_matches_optax(device, option, path):
  kwargs = {"learning_rate": 2e-2, **OPTIONS[option][1]}
  params = _params(device)
  if "dimension" in option:
    params["g"] = random_tree(4, [(8, 40, 24)], device=device)["leaf0000"]
  p, s = lockstep(jaxfuse.muon(**kwargs), optax.contrib.muon(**kwargs), params, 4, path=path,
                  algorithm_rtol=NS_RTOL)
  assert int(s.inner_states["muon"].inner_state[0].count) == 4


def test_state_is_optax_state_both_ways(device):
  """optax's state continues under jaxfuse and jaxfuse's under optax: same structure, shapes and
  dtypes (bf16 params: bf16 momentum in both groups, as optax)."""
  params = _params(device, jnp.bfloat16)
  ours, ref = jaxfuse.muon(1e-2), optax.contrib.muon(1e-2)
  s_ref, s_ours = ref.init(params), ours.init(params)
  as_shapes = lambda t: jax.tree.map(lambda x: (x.shape, x.dtype), t)
  assert as_shapes(s_ref) == as_shapes(s_ours)
  g = grads(1, params)
  _, s1 = jax.jit(ours.update)(g, s_ref, params)
  _, s2 = jax.jit(ref.update)(g, s1, params)
  assert as_shapes(s2) == as_shapes(s_ref)


def test_fused_step_with_clip_scale_and_nonfinite_skip(device):
  """A jaxfuse clip before muon folds into both groups' kernels and the momentum's reads of the
  gradients, from one global-norm call; a loss scale divides them; a step with an inf in one
  AdamW leaf's gradient leaves every leaf and both groups' momentum untouched."""
  params = _params(device)
  tx = optax.chain(jaxfuse.clip_by_global_norm(0.5), jaxfuse.muon(2e-2, skip_nonfinite=True))
  ref = optax.chain(optax.clip_by_global_norm(0.5), jaxfuse.muon(2e-2, skip_nonfinite=True))
  step, ref_step = jit_fused(tx, grad_scale=jnp.float32(4.0)), jit_step("optax", ref)
  p, s, p_r, s_r = jax.tree.map(jnp.copy, params), tx.init(params), params, ref.init(params)
  for t in range(3):
    g = grads(10 + t, params, scale=4.0)
    if t == 1:
      g["e"] = g["e"].at[3].set(jnp.inf)
    p, s = step(p, s, g)
    p_r, s_r = ref_step(p_r, s_r, jax.tree.map(lambda x: x / 4.0, g))
    assert_trees_close(p, p_r, rtol=NS_RTOL, atol=NS_RTOL, what=f"step {t}")
  inner = s[1].inner_states
  assert [int(inner[k].inner_state[-1].skipped_steps) for k in ("muon", "adam")] == [1, 1]
  assert int(inner["muon"].inner_state[0].count) == 2
  assert "jaxfuse_muon" in step.lower(p, s, grads(0, params)).as_text()


def test_master_weights_and_gram_in_bf16(device):
  """bf16 params with a float32 master (the math on the master, params its rounding), Gram
  Newton-Schulz in bfloat16: fused and the optax protocol agree to a bf16 rounding of the
  orthogonalized update, and the params stay the master's rounding."""
  params = _params(device, jnp.bfloat16)
  kw = dict(master_weights=True, ns_method="gram", ns_dtype=jnp.bfloat16)
  tx = jaxfuse.muon(2e-2, **kw)
  step, protocol = jit_fused(tx), jit_step("optax", tx)
  p, s, p_o, s_o = jax.tree.map(jnp.copy, params), tx.init(params), params, tx.init(params)
  for t in range(3):
    g = grads(20 + t, params)
    p, s = step(p, s, g)
    p_o, s_o = protocol(p_o, s_o, g)
  master = jaxfuse.master_params(p, s)
  assert jax.tree.map(lambda x: x.dtype, master) == jax.tree.map(lambda _: jnp.float32, params)
  assert_trees_close(p, jax.tree.map(lambda m: m.astype(jnp.bfloat16), master), rtol=0, atol=0,
                     what="params are the master's rounding")
  assert_trees_close(master, jaxfuse.master_params(p_o, s_o), rtol=2 * ulp(jnp.bfloat16) * 2e-2,
                     atol=0, what="fused vs protocol")


def test_8bit_momentum(device):
  """moment_bits=8: the large matrices' momentum (and AdamW's moments) in 8 bits; three fused
  steps move the params as the float steps do, to the codes' rounding."""
  params = _params(device)
  params["big"] = random_tree(5, [(64, 128)], device=device)["leaf0000"]
  with pytest.warns(UserWarning, match="moment_bits=8"):
    tx = jaxfuse.muon(2e-2, moment_bits=8)
    state = tx.init(params)
  mu = state.inner_states["muon"].inner_state[0].mu
  assert mu["big"].codes.dtype == jnp.int8 and mu["a"].dtype == jnp.float32
  floats = jaxfuse.muon(2e-2)
  step, ref = jit_fused(tx), jit_fused(floats)
  p, s, p_f, s_f = copy_tree(params), state, copy_tree(params), floats.init(params)
  for t in range(3):
    g = grads(40 + t, params)
    p, s = step(p, s, g)
    p_f, s_f = ref(p_f, s_f, g)
  moved = lambda new: jax.tree.map(lambda a, b: a - b, new, params)
  assert_trees_close(moved(p), moved(p_f), rtol=0.05, atol=0, what="8-bit vs float momentum")


def test_inject_hyperparams_and_multi_steps(device):
  """Hyperparameters from optax.inject_hyperparams' state (changed mid-run, no retrace), inside
  jaxfuse.multi_steps: optax's Muon under the same wrappers."""
  params = _params(device)
  make = lambda muon: optax.inject_hyperparams(muon, static_args=("ns_steps",))(
      learning_rate=2e-2, beta=0.9)
  tx = jaxfuse.multi_steps(make(jaxfuse.muon), 2)
  ref = optax.MultiSteps(make(optax.contrib.muon), 2)
  traces = []
  step = jax.jit(lambda p, s, g: (traces.append(1), jaxfuse.fused_step(tx, g, s, p))[1],
                 donate_argnums=(0, 1))
  ref_step = jit_step("optax", ref)
  p, s, p_r, s_r = jax.tree.map(jnp.copy, params), tx.init(params), params, ref.init(params)
  for t in range(4):
    if t == 2:
      for state in (s.inner_opt_state, s_r.inner_opt_state):
        state.hyperparams["learning_rate"] = jnp.asarray(1e-2, jnp.float32)
    g = grads(30 + t, params)
    p, s = step(p, s, g)
    p_r, s_r = ref_step(p_r, s_r, g)
  assert len(traces) == 1
  assert_trees_close(p, p_r, rtol=NS_RTOL, atol=NS_RTOL)


@pytest.mark.parametrize("kwargs, match", [
    (dict(learning_rate="1e-3"), r"jaxfuse.muon: learning_rate='1e-3' is a str"),
    (dict(preconditioning="qr"), r"preconditioning='qr'; expected one of"),
    (dict(ns_method="svd"), r"ns_method='svd'"),
    (dict(ns_coeffs="fast"), r"ns_coeffs='fast'; the presets are"),
    (dict(ns_coeffs=((1.0, 2.0),)), r"ns_coeffs has shape \(1, 2\)"),
    (dict(ns_steps=0), r"ns_steps=0"),
    (dict(mu_dtype=jnp.int8), r"mu_dtype int8 is not supported"),
    (dict(moment_bits=4), r"moment_bits=4"),
    (dict(ns_dtype=jnp.complex64), r"ns_dtype complex64 is not a real float dtype"),
    (dict(seed=-1), r"seed=-1"),
])
def test_bad_arguments_are_refused_by_name(kwargs, match):
  with pytest.raises((TypeError, ValueError), match=match):
    jaxfuse.muon(**{"learning_rate": 1e-3, **kwargs})


def test_bad_leaves_are_refused_by_name():
  params = {"w": jnp.ones((4, 6)), "v": jnp.ones(5)}
  dims = {"w": MuonDimensionNumbers(), "v": MuonDimensionNumbers()}
  with pytest.raises(ValueError, match=r"leaf \['v'\] has shape \(5,\); Muon orthogonalizes"):
    jaxfuse.muon(1e-3, muon_weight_dimension_numbers=dims).init(params)
  tx = jaxfuse.muon(1e-3)
  with pytest.raises(ValueError, match="update\\(\\) needs params"):
    tx.update(params, tx.init(params))
  with pytest.raises(ValueError, match="grads"):
    tx.update({"w": jnp.ones((4, 6))}, tx.init(params), params)
  with pytest.raises(ValueError, match="opt_state is not a Muon state"):
    tx.update(params, optax.adam(1e-3).init(params), params)
  with pytest.raises(ValueError, match="momentum has 1 leaves, these params 2 matrices"):
    tx.update({**params, "u": jnp.ones((3, 3))}, tx.init(params), {**params, "u": jnp.ones((3, 3))})
