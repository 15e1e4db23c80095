"""The conformance suite: every check every optimizer family must pass, run for each family in
the registry (jaxfuse/_optim/families) on its configurations (cases.py), against optax's twin
in lockstep (tests/lockstep.py: each step from jaxfuse's own params and state, element-wise
bounds of one step's rounding) on inputs at training's magnitudes. A family's own file keeps
only what is its own."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxfuse
from jaxfuse._core import packing as _packing
from jaxfuse._optim import families
from cases import CASES, family_configs, first, optax_function
from helpers import assert_bitwise_equal, count_custom_calls
from lockstep import jit_step, lockstep, state_leaves, training_params, training_tree

FAMILIES = {f.name: f for f in families.registered()}
SHAPES = [(), (0,), (1,), (3,), (7, 5), (301,)]
QUANTIZED_SHAPES = SHAPES + [(32, 128)]  # one leaf of 8-bit moments (4096 elements)
STEPS = 4  # bias corrections and schedules move over these; bounds do not grow with them
PATHS = ["fused", "optax"]

CONFIGS = [pytest.param(f, name, id=f"{f}-{name}") for f in FAMILIES
           for name in family_configs(FAMILIES[f])]


def _near_zero(family, config):
  make = CASES[family].near_zero
  return None if make is None else make(config.kwargs.get("b1", 0.9))


def test_every_family_has_cases():
  assert sorted(CASES) == sorted(FAMILIES)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("family,name", CONFIGS)
def test_matches_optax(device, family, name, path):
  config = family_configs(FAMILIES[family])[name]
  params = training_params(1, SHAPES, jnp.float32, device)
  p, s = lockstep(config.ours(), config.twin(), params, STEPS, path=path, seed=2,
                  near_zero=_near_zero(family, config))
  assert jax.tree.map(lambda x: x.dtype, p) == jax.tree.map(lambda x: x.dtype, params)


DTYPES = [jnp.bfloat16, jnp.float16, jnp.float64, jnp.complex64, jnp.complex128]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("family", FAMILIES)
def test_dtypes(device, family, dtype, path):
  """16-bit params stored as one rounding of the float32 step; float64 and complex in optax's
  math (the state in optax's dtypes); complex params refused, by init and by the step, where
  optax's twin takes none."""
  if dtype == jnp.complex64 and not FAMILIES[family].takes_complex:
    tx, params = first(FAMILIES[family]).ours(), training_params(0, [(3,)], dtype)
    real = tx.init(training_params(0, [(3,)], jnp.float32))
    for refused in (lambda: tx.init(params), lambda: jit_step(path, tx)(params, real, params)):
      with pytest.raises(TypeError, match=r"params leaf \['leaf0000'\] is complex64"):
        refused()
    return
  if jnp.issubdtype(dtype, jnp.complexfloating) and not FAMILIES[family].takes_complex:
    pytest.skip("complex64 shows the refusal")
  if dtype in (jnp.float16, jnp.complex128) and path == "optax":
    pytest.skip("the optax protocol's code for it is bf16's and complex64's")
  config = first(FAMILIES[family])
  with jax.enable_x64(dtype in (jnp.float64, jnp.complex128)):
    params = training_params(3, SHAPES, dtype, device)
    p, s = lockstep(config.ours(), config.twin(), params, STEPS, path=path, seed=4,
                    near_zero=_near_zero(family, config))
    assert jax.tree.map(lambda x: x.dtype, p) == jax.tree.map(lambda x: x.dtype, params)
    twin = jax.eval_shape(config.twin().init, params)
    assert [x.dtype for x in state_leaves(s)] == [x.dtype for x in jax.tree.leaves(twin)]


@pytest.mark.parametrize("family,name", CONFIGS)
def test_state_is_optax_state(family, name):
  """The state has optax's structure, shapes, dtypes and initial values (a jaxfuse-only storage
  option: its own dtypes, optax's structure)."""
  config = family_configs(FAMILIES[family])[name]
  params = {"w": jnp.ones((3, 4)), "b": jnp.ones((4,), jnp.bfloat16),
            "nested": [jnp.ones(()), jnp.ones((0,))]}
  ours, theirs = config.ours().init(params), config.twin().init(params)
  assert jax.tree.structure(ours) == jax.tree.structure(theirs)
  for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(theirs)):
    assert a.shape == b.shape
    if config.optax_layout:
      assert a.dtype == b.dtype
      np.testing.assert_array_equal(np.asarray(a, np.float64), np.asarray(b, np.float64))


@pytest.mark.parametrize("family", FAMILIES)
def test_optax_checkpoint_continues(device, family):
  """A state optax wrote goes on under jaxfuse (lockstep shows the other way at every step)."""
  config = first(FAMILIES[family])
  params = training_params(5, SHAPES, jnp.float32, device)
  tx = config.twin()
  p, s = params, tx.init(params)
  for t in range(2):
    p, s = jit_step("optax", tx)(p, s, training_tree(50 + t, params))
  lockstep(config.ours(), tx, p, 2, path="fused", seed=6, state=s,
           near_zero=_near_zero(family, config))


# ---- the options every family takes ----------------------------------------------------------

@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("family", FAMILIES)
def test_master_weights(device, family, path):
  """bf16 params with a float32 master, beside float32 params (their own master): the master
  follows float32 optax, the params are its rounding (through the optax protocol the bf16
  update lands on it where the step is at most the param's size, Sterbenz; elsewhere within one
  bf16 rounding)."""
  config = first(FAMILIES[family])
  bf16, f32 = jnp.bfloat16, jnp.float32
  params = training_params(7, SHAPES, [bf16, f32, bf16, f32, bf16, bf16], device)
  p, s = lockstep(config.ours(master_weights=True), config.twin(), params, STEPS, path=path,
                  seed=8, near_zero=_near_zero(family, config))
  assert jax.tree.map(lambda x: x.dtype, p) == jax.tree.map(lambda x: x.dtype, params)
  master = jaxfuse.master_params(p, s)
  assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(master))
  if path == "fused":  # the optax protocol's params: lockstep checks them each step
    rounded = jax.tree.map(lambda m, x: m.astype(x.dtype), master, p)
    assert_bitwise_equal(p, rounded, "params vs the master's rounding")


@pytest.mark.parametrize("family", FAMILIES)
def test_remainders_packed(device, family):
  """Param remainders (the float32 master in bf16 params and int16 halves; a master copy in
  the trust-ratio families, which take no remainders) in packed state lists, on a tree of bf16
  and float32 leaves (which keep no remainders): the master follows float32 optax; the state is
  a handful of buffers."""
  config = first(FAMILIES[family])
  params = training_params(9, SHAPES, [jnp.bfloat16, jnp.float32] * (len(SHAPES) // 2), device)
  master = True if FAMILIES[family].trust_ratio else "remainder"
  tx = config.ours(master_weights=master, packed=True)
  s0 = tx.init(params)
  assert all(isinstance(x, _packing.Packed) or x.ndim == 0
             for x in jax.tree.leaves(s0, is_leaf=_packing.is_packed))
  lockstep(tx, config.twin(), params, STEPS, path="fused", seed=10,
           near_zero=_near_zero(family, config))


@pytest.mark.parametrize("family", FAMILIES)
def test_stochastic_rounding(device, family):
  """bf16 params rounded stochastically: each the float32 step's value rounded down or up."""
  config = first(FAMILIES[family])
  params = training_params(11, SHAPES, jnp.bfloat16, device)
  lockstep(config.ours(stochastic_rounding=True, seed=3), config.twin(), params, STEPS,
           path="fused", seed=12, stochastic=True, near_zero=_near_zero(family, config))


@pytest.mark.parametrize("family", [f for f in FAMILIES if FAMILIES[f].takes("moment_bits")])
def test_8bit_moments(device, family):
  """moment_bits=8: each stored code the one the float32 step's moment encodes to (or, at a
  code boundary, its neighbour), under block scales of the step's largest magnitudes."""
  config = first(FAMILIES[family])
  params = training_params(13, QUANTIZED_SHAPES, jnp.float32, device)
  tx = config.ours(moment_bits=8)
  assert any(jaxfuse.QuantizedMoment is type(x) for x in jax.tree.leaves(
      tx.init(params), is_leaf=lambda x: isinstance(x, jaxfuse.QuantizedMoment)))
  lockstep(tx, config.twin(), params, STEPS, path="fused", seed=14,
           near_zero=_near_zero(family, config))


def _clipped(near_zero, max_norm):
  """A near_zero mask of the grads the family sees after the clip."""
  if near_zero is None:
    return None
  clip = optax.clip_by_global_norm(max_norm)
  return lambda g, s: near_zero(clip.update(g, optax.EmptyState())[0], s)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("family", FAMILIES)
def test_clip_scale_and_skip(device, family, path):
  """jaxfuse.clip_by_global_norm folded into the family's kernel (one norm call, one call of
  the family's op), a loss scale taken out first, skip_nonfinite: optax's clip then the family
  on the unscaled grads; then a NaN and an Inf gradient leave params and state bitwise as they
  were, each counted."""
  fam, config = FAMILIES[family], first(FAMILIES[family])
  max_norm, scale = 1.0, jnp.float32(1024.0)
  tx = optax.chain(jaxfuse.clip_by_global_norm(max_norm), config.ours(skip_nonfinite=True))
  twin = optax.chain(optax.clip_by_global_norm(max_norm), config.twin())
  params = training_params(15, SHAPES, jnp.float32, device)
  g = training_tree(16, params)
  step = jit_step(path, tx, grad_scale=scale)
  if path == "fused":
    text = step.lower(params, tx.init(params), g).as_text()
    assert count_custom_calls(text, "jaxfuse_global_norm") == 1
    assert count_custom_calls(text, fam.spec.op) == 1
  p, s = lockstep(tx, twin, params, 3, path=path, seed=17, grad_scale=scale,
                  near_zero=_clipped(_near_zero(family, config), max_norm))
  for t, bad in enumerate((jnp.nan, jnp.inf)):
    g = jax.tree.map(lambda x: x.at[(0,) * x.ndim].set(bad) if x.size else x,
                     training_tree(18 + t, params))
    new_p, new_s = step(p, s, g)
    assert_bitwise_equal((new_p, new_s[1][:-1]), (p, s[1][:-1]), f"{bad} grads")
    assert int(new_s[1][-1].skipped_steps) == t + 1
    p, s = new_p, new_s


@pytest.mark.parametrize("family", FAMILIES)
def test_multi_steps(device, family):
  """jaxfuse.multi_steps (every 3 steps) is optax.MultiSteps."""
  config = first(FAMILIES[family])
  params = training_params(19, SHAPES, jnp.float32, device)
  with jax.enable_x64(True):  # the twin's accumulator as wide as the reference's floats
    twin = optax.MultiSteps(config.twin(), every_k_schedule=3, accumulator_dtype=jnp.float64)
  _, s = lockstep(jaxfuse.multi_steps(config.ours(), every_k_schedule=3), twin, params, 6,
                  path="fused", seed=20, near_zero=_near_zero(family, config))
  assert int(s.gradient_step) == 2


@pytest.mark.parametrize("family", FAMILIES)
def test_inject_hyperparams(device, family):
  """Hyperparameters in the state (optax.inject_hyperparams), changed halfway without a new
  trace (lockstep checks that the step traces once): optax's steps with them."""
  fn = first(FAMILIES[family]).function
  kwargs, changes = CASES[family].inject
  tx = optax.inject_hyperparams(getattr(jaxfuse, fn))(**kwargs)
  twin = optax.inject_hyperparams(optax_function(fn))(**kwargs)
  def change(t, s):
    if t == STEPS // 2:
      for name, value in changes.items():
        s.hyperparams[name] = jnp.full_like(s.hyperparams[name], value)
    return s

  params = training_params(21, SHAPES, jnp.float32, device)
  lockstep(tx, twin, params, STEPS, path="fused", seed=22, on_step=change,
           near_zero=_near_zero(family, first(FAMILIES[family])))


# ---- bad input -------------------------------------------------------------------------------

@pytest.mark.parametrize("family", FAMILIES)
def test_rejects_bad_input(family):
  """Each bad input is a Python exception at trace time naming what is wrong."""
  config = first(FAMILIES[family])
  fn = getattr(jaxfuse, config.function)
  params = {"w": jnp.ones((3,)), "b": jnp.ones((2,))}
  tx = config.ours()
  state = tx.init(params)
  with pytest.raises(ValueError, match=r"different tree structures.*only in params: \['b'\]"):
    tx.update({"w": jnp.ones((3,))}, state, params)
  with pytest.raises(ValueError, match=r"leaf \['b'\] has shape \(3,\) in grads"):
    jit_step("fused", tx)(params, state, {"w": jnp.ones((3,)), "b": jnp.ones((3,))})
  other = optax.adamw(1e-3) if family != "adam" else optax.sgd(1e-3, momentum=0.9)
  with pytest.raises(ValueError, match="opt_state does not match"):
    tx.update(params, other.init(params), params)
  with pytest.raises(TypeError, match=r"params leaf \['n'\] has dtype int32"):
    tx.init({"n": jnp.ones((2,), jnp.int32)})
  with pytest.raises(TypeError, match=f"jaxfuse.{fn.__name__}: learning_rate='1e-3' is a str"):
    fn(**dict(config.kwargs, learning_rate="1e-3"))
  with pytest.raises(TypeError, match="skip_nonfinite='yes' is a str"):
    config.ours(skip_nonfinite="yes")
  # The optax protocol needs params where optax's does (weight decay, trust ratios, Lion's
  # decay) and where master weights are kept.
  needs = config.ours(master_weights=True)
  with pytest.raises(ValueError, match="update\\(\\) needs params"):
    needs.update(params, needs.init(params))


def test_an_option_a_family_lacks_is_refused():
  for name, family in FAMILIES.items():
    if not family.takes("moment_bits"):
      with pytest.raises(TypeError, match="moment_bits"):
        first(family).ours(moment_bits=8)

