"""Fewer bytes per parameter (their bytes: test_report.py): 16-bit second moments (nu_dtype),
stochastic rounding of 16-bit params, and param remainders (master_weights="remainder"),
through the optax protocol and the fused step, against references on fresh random inputs."""

import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxfuse
from jaxfuse._optim import rounding as _rounding
from helpers import assert_bitwise_equal, count_custom_calls, random_tree
from helpers import normal_grads as grads
from lockstep import copy_tree, jit_step

PATHS = ["optax", "fused"]


def _run(tx, params, path, steps, seed=1, grad_fn=grads, **kwargs):
  step = jit_step(path, tx, **kwargs)
  p, s = copy_tree(params), tx.init(params)
  for t in range(steps):
    p, s = step(p, s, grad_fn(seed * 1000 + t, params))
  return p, s


def _once(tx, params, g, path="fused"):
  """One step of `tx` from its initial state: (params, state)."""
  return jit_step(path, tx)(params, tx.init(params), g)


def _bits(x):
  x = np.asarray(x)
  return x.view(np.dtype(f"uint{8 * x.dtype.itemsize}"))


# ---- stochastic rounding ---------------------------------------------------------------------

def _tiny_step(dtype, value, n, fraction, device):
  """n params equal to `value` and SGD's step lr * g of `fraction` of an ulp of the value, on
  `device`: (params, grads, the exact new value, the ulp)."""
  value = float(jnp.asarray(value, dtype))
  ulp_v = float(jnp.finfo(dtype).eps) * 2.0 ** np.floor(np.log2(abs(value)))
  if abs(value) < float(jnp.finfo(dtype).tiny):  # subnormal: a fixed ulp
    ulp_v = float(jnp.finfo(dtype).smallest_subnormal)
  params = {"w": jnp.full((n,), value, dtype)}
  g = {"w": jnp.full((n,), -fraction * ulp_v / 1e-3, jnp.float32)}
  return (*jax.device_put((params, g), device), value + fraction * ulp_v, ulp_v)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype,value", [(jnp.bfloat16, 1.5), (jnp.bfloat16, -3e-3),
                                         (jnp.float16, 0.75), (jnp.float16, 3e-6)])
def test_stochastic_rounding_is_unbiased(device, path, dtype, value):
  """A step of 0.3 ulp: plain rounding loses it, stochastic rounding keeps it on average: the
  mean of 2**16 params is the exact value within 4 standard errors."""
  n, fraction = 1 << 16, 0.3
  params, g, exact, ulp_v = _tiny_step(dtype, value, n, fraction, device)
  p_plain, _ = _once(jaxfuse.sgd(1e-3), params, g, path)
  np.testing.assert_array_equal(np.asarray(p_plain["w"]), np.asarray(params["w"]))
  p, _ = _once(jaxfuse.sgd(1e-3, stochastic_rounding=True, seed=7), params, g, path)
  values = np.asarray(p["w"], np.float64)
  start = float(params["w"][0])
  assert set(np.unique(values)) <= {start, start + ulp_v}
  standard_error = ulp_v * np.sqrt(fraction * (1 - fraction) / n)
  assert abs(values.mean() - exact) < 4 * standard_error


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_stochastic_rounding_mean_over_steps_tracks_the_exact_path(device, dtype):
  """100 SGD steps of 0.1 ulp each on 4096 params: the params' mean moves 10 ulps (within 4
  standard errors of the sum of 100 roundings); round-to-nearest does not move at all."""
  n, fraction, steps = 4096, 0.1, 100
  params, g, _, ulp_v = _tiny_step(dtype, 0.625, n, fraction, device)
  tx = jaxfuse.sgd(1e-3, stochastic_rounding=True, seed=3)
  p, _ = _run(tx, params, "fused", steps, grad_fn=lambda t, p: g)
  drift = (np.asarray(p["w"], np.float64).mean() - 0.625) / ulp_v
  # Each step's rounding error has variance at most 1/4 ulp^2 per element.
  assert abs(drift - steps * fraction) < 4 * np.sqrt(steps * 0.25 / n)


def test_stochastic_rounding_is_deterministic_and_the_paths_agree_bitwise(device):
  params = random_tree(5, [(4099,), (3, 7, 5), ()], [jnp.bfloat16, jnp.float16, jnp.bfloat16],
                       device=device)
  g = jax.tree.map(lambda x: x.astype(jnp.float32), grads(6, params))
  tx = jaxfuse.adamw(1e-3, stochastic_rounding=True, seed=11)
  fused, xla, again = (_once(tx, params, g, path)[0] for path in ("fused", "optax", "fused"))
  assert_bitwise_equal(fused, xla, "fused step against optax protocol")
  assert_bitwise_equal(again, fused, "a second call")
  p_other, _ = _once(jaxfuse.adamw(1e-3, stochastic_rounding=True, seed=2**32 - 1), params, g)
  differ = np.mean(_bits(p_other["leaf0000"]) != _bits(fused["leaf0000"]))
  assert 0.05 < differ < 0.95  # another seed draws other bits


_PROCESS_SCRIPT = """
import hashlib, jax, jax.numpy as jnp, numpy as np, jaxfuse
p = {"w": jnp.linspace(-2, 2, 5000, dtype=jnp.float32).astype(jnp.bfloat16)}
g = {"w": jnp.cos(jnp.arange(5000, dtype=jnp.float32))}
tx = jaxfuse.adamw(1e-3, stochastic_rounding=True, seed=5)
out, _ = jax.jit(lambda p, s, g: jaxfuse.fused_step(tx, g, s, p))(p, tx.init(p), g)
print(hashlib.sha256(np.asarray(out["w"]).tobytes()).hexdigest())
"""


def test_stochastic_rounding_is_the_same_in_another_process():
  results = [subprocess.run([sys.executable, "-c", _PROCESS_SCRIPT], capture_output=True,
                            text=True, check=True).stdout.strip() for _ in range(2)]
  namespace = {}
  exec(_PROCESS_SCRIPT.replace("print(", "result = ("), namespace)
  assert results[0] == results[1] == namespace["result"]


def test_stochastic_rounding_leaves_float32_leaves_as_plain_rounding(device):
  params = random_tree(7, [(65,), (8, 3)], device=device)
  g = grads(8, params)
  a, _ = _once(jaxfuse.adamw(1e-2, stochastic_rounding=True), params, g)
  b, _ = _once(jaxfuse.adamw(1e-2), params, g)
  assert_bitwise_equal(a, b, "float32 params")


def test_stochastic_rounding_elements_follow_the_counter_based_bits(device):
  """Each stored param is one of the two neighbours of its exact value, the upper one exactly
  when the hash's bits say so (rounding.h, computed here in NumPy from the documented key)."""
  w = jnp.linspace(0.5, 0.9, 777, dtype=jnp.float32).astype(jnp.bfloat16)
  params, g = jax.device_put(({"a": jnp.zeros(3), "w": w},
                              {"a": jnp.ones(3), "w": jnp.full((777,), 0.37, jnp.float32)}), device)
  p, _ = _once(jaxfuse.sgd(1e-3, stochastic_rounding=True, seed=2024), params, g, "optax")
  exact = np.asarray(params["w"], np.float32) - np.float32(1e-3) * np.float32(0.37)
  bits = np.asarray(_rounding.element_bits(_rounding.stream(2024, 1, 0, jnp.int32(0)), (777,)))
  low = exact.view(np.uint32) & 0xFFFF
  up = low + (bits >> 16) >= 0x10000
  expected = ((exact.view(np.uint32) & 0xFFFF0000) + up * 0x10000).astype(np.uint32)
  np.testing.assert_array_equal(np.asarray(p["w"], np.float32).view(np.uint32), expected)


# ---- param remainders ------------------------------------------------------------------------

def _clipped_run(tx, params, path, first):
  """5 steps of clip + `tx` on grads scaled by 8 (seeds first + t), a NaN per leaf at step 2."""
  def grad_fn(t, p):
    g = grads(first + t, p, scale=8.0)
    return jax.tree.map(lambda x: x.at[(0,) * x.ndim].set(jnp.nan), g) if t == 2 else g
  return _run(optax.chain(jaxfuse.clip_by_global_norm(0.5), tx), params, path, 5, seed=0,
              grad_fn=grad_fn, grad_scale=jnp.float32(8.0))


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("clip", [False, True], ids=["100 steps", "clip scale skip"])
def test_remainders_reproduce_the_float32_master_bit_for_bit(device, path, clip):
  """AdamW on bf16 params with remainders and with a float32 master runs the same float32 math:
  params joined to remainders are the master, bit for bit, and the params its rounding (ties
  away from zero); over 100 steps, or under jaxfuse's clip, a loss scale and a skipped step."""
  params = random_tree(9, [(4099,), (3, 7, 5), ()], jnp.bfloat16, device=device)
  def run(mode):
    tx = jaxfuse.adamw(3e-3, weight_decay=0.1, master_weights=mode, skip_nonfinite=clip)
    return _clipped_run(tx, params, path, 17) if clip else _run(tx, params, path, 100)
  (p_r, s_r), (_, s_m) = run("remainder"), run(True)
  adam_r, adam_m = (s[-1] if clip else s for s in (s_r, s_m))
  assert all(r.dtype == jnp.int16 for r in jax.tree.leaves(adam_r[-1].param_remainders))
  masters = jaxfuse.master_params(p_r, s_r)
  assert_bitwise_equal(masters, adam_m[-1].master_params, "params joined to remainders")
  for p, m in zip(jax.tree.leaves(p_r), jax.tree.leaves(masters)):
    bits = np.asarray(m).view(np.uint32)
    nearest = ((bits + 0x8000) & 0xFFFF0000).astype(np.uint32)  # ties away from zero
    np.testing.assert_array_equal(np.asarray(p, np.float32).view(np.uint32), nearest)
  assert_bitwise_equal(adam_r[0], adam_m[0], "moments")
  if clip:
    assert int(adam_r[-1].skipped_steps) == int(adam_m[-1].skipped_steps) == 1


def test_remainders_split_and_join_every_float32_pattern_class():
  x = np.concatenate([np.random.default_rng(0).standard_normal(10000).astype(np.float32),
                      np.float32([0.0, -0.0, 1.0, -1.0, 3.4e38, -3.4e38, 1e-40, -1e-40,
                                  np.inf, -np.inf])])
  finite = x[np.isfinite(x)]
  x = np.concatenate([x, ((finite.view(np.uint32) & 0xFFFF0000) | 0x8000).view(np.float32)])
  param, remainder = _rounding.split_remainder(jnp.asarray(x))
  assert param.dtype == jnp.bfloat16 and remainder.dtype == jnp.int16
  np.testing.assert_array_equal(np.asarray(_rounding.join_remainder(param, remainder))
                                .view(np.uint32), x.view(np.uint32))
  finite = np.isfinite(np.asarray(param, np.float32))
  error = np.abs(np.asarray(param, np.float64)[finite] - x.astype(np.float64)[finite])
  spacing = np.abs(np.spacing(np.asarray(param, np.float32)[finite]).astype(np.float64)) * 2**16
  assert np.all(error <= spacing / 2)


def test_remainders_in_a_tree_with_float32_leaves(device):
  """Remainders for the bf16 leaves only, in a call of their own (the values in lockstep: the
  conformance suite's remainders on mixed trees)."""
  params = jax.device_put({"w": random_tree(12, [(301,)], jnp.bfloat16)["leaf0000"],
                           "b": random_tree(13, [(17,)])["leaf0000"]}, device)
  tx = jaxfuse.adamw(1e-2, master_weights="remainder")
  state = tx.init(params)
  assert state[-1].param_remainders["b"].shape == (0,)
  text = jit_step("fused", tx).lower(params, state, grads(14, params)).as_text()
  assert count_custom_calls(text, "jaxfuse_adam") == 2  # bf16 with remainders, float32 without


def test_remainder_and_rounding_options_are_checked():
  with pytest.raises(TypeError, match=r"params leaf \['h'\] is float16"):
    jaxfuse.adamw(1e-3, master_weights="remainder").init({"h": jnp.ones(3, jnp.float16)})
  with pytest.raises(ValueError, match="not supported by trust-ratio families"):
    jaxfuse.lamb(1e-3, master_weights="remainder")
  with pytest.raises(ValueError, match="master_weights='fp32'"):
    jaxfuse.sgd(1e-3, master_weights="fp32")
  with pytest.raises(ValueError, match="stochastic_rounding rounds params that have no master"):
    jaxfuse.adamw(1e-3, master_weights=True, stochastic_rounding=True)
  with pytest.raises(ValueError, match="seed=-1"):
    jaxfuse.adamw(1e-3, stochastic_rounding=True, seed=-1)
  tx = jaxfuse.adamw(1e-3, stochastic_rounding=True)
  with pytest.raises(ValueError, match=r"needs params \(for stochastic rounding\)"):
    tx.update({"w": jnp.ones(2)}, tx.init({"w": jnp.ones(2)}))


# ---- conversions -----------------------------------------------------------------------------

def test_convert_state_between_optax_master_and_remainders(device):
  params = random_tree(15, [(257,), (3, 4)], jnp.bfloat16, device=device)
  master_tx = jaxfuse.adamw(1e-2, master_weights=True)
  p, s = _run(master_tx, params, "fused", steps=3)
  compact = jaxfuse.adamw(1e-2, master_weights="remainder", nu_dtype=jnp.bfloat16)
  p_c, s_c = jaxfuse.convert_state(s, p, compact)
  assert jax.tree.structure(s_c) == jax.tree.structure(compact.init(params))
  assert_bitwise_equal(jaxfuse.master_params(p_c, s_c), s[-1].master_params, "master")
  _, s_back = jaxfuse.convert_state(s_c, p_c, master_tx)
  assert_bitwise_equal(s_back[-1].master_params, s[-1].master_params, "master again")
  # Leaving 16 bits: float32 params for optax's AdamW are the master itself.
  p_o, s_o = jaxfuse.convert_state(s_c, p_c, optax.adamw(1e-2), jnp.float32)
  assert_bitwise_equal(p_o, s[-1].master_params, "float32 params")
  assert jax.tree.structure(s_o) == jax.tree.structure(optax.adamw(1e-2).init(p_o))
  with pytest.raises(ValueError, match="not one of this transform's optimizer"):
    jaxfuse.convert_state(s_c, p_c, jaxfuse.sgd(1e-2, momentum=0.9))


def test_convert_state_inside_a_chain(device):
  """optax's clip + AdamW on float32 params onward with jaxfuse's on bf16 params and remainders:
  the master is the float32 params, bit for bit, the moments carry over; and back."""
  params = random_tree(22, [(300,), (5, 6)], device=device)
  chain = lambda opt: optax.chain(optax.clip_by_global_norm(1.0), opt)
  source = chain(optax.adamw(1e-2))
  p, s = _run(source, params, "optax", steps=3)
  target = chain(jaxfuse.adamw(1e-2, master_weights="remainder", skip_nonfinite=True))
  p16, s16 = jaxfuse.convert_state(s, p, target, jnp.bfloat16)
  assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(p16))
  assert jax.tree.structure(s16) == jax.tree.structure(target.init(p16))
  assert_bitwise_equal(jaxfuse.master_params(p16, s16), p, "master")
  assert_bitwise_equal(s16[1][0].mu, s[1][0].mu, "first moment")
  p_back, s_back = jaxfuse.convert_state(s16, p16, source, jnp.float32)
  assert_bitwise_equal(p_back, p, "float32 params")
  assert jax.tree.structure(s_back) == jax.tree.structure(s)


# ---- every mode through the generic features -------------------------------------------------

def test_stochastic_rounding_paths_agree_under_clip_loss_scale_and_skip(device):
  """XLA's math and the kernels' may differ by an ulp of float32, which moves a 16-bit value to
  its other neighbour now and then: the paths agree within one 16-bit ulp."""
  params = random_tree(18, [(513,), (6, 5)], [jnp.bfloat16, jnp.float16], device=device)
  tx = jaxfuse.adamw(1e-2, stochastic_rounding=True, seed=9, skip_nonfinite=True)
  results = {path: _clipped_run(tx, params, path, 19) for path in PATHS}
  for leaf in results["fused"][0]:
    fused, xla = (_bits(results[k][0][leaf]).astype(np.int64) for k in ("fused", "optax"))
    assert np.mean(fused != xla) < 0.05
    assert np.max(np.abs(fused - xla)) <= 2  # neighbours (no sign changes at these sizes)
  assert int(results["fused"][1][-1][-1].skipped_steps) == 1


_MODES = {
    "nu_bf16": dict(nu_dtype=jnp.bfloat16, mu_dtype=jnp.bfloat16),
    "remainder": dict(master_weights="remainder"),
    "stochastic": dict(stochastic_rounding=True, seed=1),
    "8-bit": dict(moment_bits=8, master_weights=True),
}


@pytest.mark.parametrize("mode", sorted(_MODES))
def test_modes_under_multi_steps_and_in_a_flax_train_state(device, mode):
  """jaxfuse.multi_steps and jaxfuse.flax.TrainState give each mode's fused step's params."""
  flax = pytest.importorskip("jaxfuse.flax")
  params = random_tree(20, [(64,), (8, 128)], jnp.bfloat16, device=device)  # 8 blocks of 128
  tx = jaxfuse.adamw(1e-2, **_MODES[mode])
  state = flax.TrainState.create(apply_fn=None, params=params, tx=tx)
  step = jax.jit(lambda st, g: st.apply_gradients(grads=g))
  for t in range(3):
    state = step(state, grads(21 + t, params))
  p_ref, _ = _run(tx, params, "fused", steps=3, seed=0, grad_fn=lambda s, p: grads(21 + s, p))
  assert_bitwise_equal(state.params, p_ref, "TrainState params")
  accumulated = jaxfuse.multi_steps(tx, every_k_schedule=2)
  g = lambda s, p: grads(21 + s // 2, p)  # each gradient twice: their mean is the gradient
  p_acc, s_acc = _run(accumulated, params, "fused", steps=6, seed=0, grad_fn=g)
  assert int(s_acc.gradient_step) == 3
  assert_bitwise_equal(p_acc, p_ref, "multi_steps params")
