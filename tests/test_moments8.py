"""8-bit block-wise moments (moment_bits=8): the quantizer's error bounds, the same bits on the
kernels and the XLA twin, convergence against float32 AdamW, the state (layout, checkpoints,
conversion, report) and every way a step runs."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxfuse
from jaxfuse._optim import moments as _moments
from helpers import assert_bitwise_equal, random_tree
from lockstep import jit_fused, jit_step

BLOCK = 128
QUANTIZED = [(32, 128), (3, 5, 512), (4096,), (64, 100), (5, 3, 3, 64, 64)]
FLOAT = [(), (3,), (4095,), (33, 129)]  # too small, or no whole blocks
SHAPES = QUANTIZED + FLOAT


def _blocks(rng, n_blocks):
  """Blocks of moments as they come: normal, log-uniform over 12 decades, with zeros."""
  normal = rng.standard_normal((n_blocks, BLOCK))
  spread = rng.choice([-1, 1], (n_blocks, BLOCK)) * 10.0 ** rng.uniform(-12, 0, (n_blocks, BLOCK))
  x = np.where(np.arange(n_blocks)[:, None] % 2 == 0, normal, spread).astype(np.float32)
  x[3, ::7] = 0.0
  return x


@pytest.mark.parametrize("signed", [True, False])
def test_round_trip_error_bounds(signed):
  """Per element: at most half an 8-bit ulp relative (2^-4 signed E4M3, 2^-5 non-negative E4M4)
  above the formats' smallest normal; below it at most half the subnormal step of the block's
  scale; non-negative values that are not zero never decode to zero."""
  x = _blocks(np.random.default_rng(7), 64)
  if not signed:
    x = np.abs(x)
  q = _moments.quantize(jnp.asarray(x), signed, BLOCK)
  back = np.asarray(_moments.dequantize(q))
  scale = np.asarray(q.scales)  # [blocks, 1]: one block per row
  m = 3 if signed else 4
  normal = np.abs(x) >= scale * 2.0 ** -14
  err = np.abs(back - x)
  slack = 2.0 ** -22  # the division by the rounded scale
  assert np.all(err[normal] <= (2.0 ** -(m + 1) + slack) * np.abs(x[normal]))
  step = 2.0 ** -(14 + m) * np.broadcast_to(scale, x.shape)[~normal]
  # half a subnormal step; a non-negative value below the smallest code rounds up to it
  bound = 0.5 * step if signed else np.maximum(0.5 * step, step - np.abs(x[~normal]))
  assert np.all(err[~normal] <= bound * (1 + 2 ** -20))
  if not signed:
    assert not np.any((back == 0) & (x > 0))
  else:
    assert np.all((np.sign(back) == np.sign(x)) | (back == 0))
  # the block's largest magnitude decodes to within a float32 rounding or two of itself
  np.testing.assert_allclose(np.abs(back).max(axis=1), np.abs(x).max(axis=1), rtol=2 ** -22)


def test_non_finite_blocks_decode_to_nan():
  x = np.random.default_rng(1).standard_normal((2, BLOCK)).astype(np.float32)
  x[0, 5], x[1, 9] = np.nan, np.inf
  back = np.asarray(_moments.dequantize(_moments.quantize(jnp.asarray(x), True, BLOCK)))
  assert np.all(np.isnan(back))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_kernels_and_twin_store_the_same_codes(dtype):
  """With b1 = b2 = 0 the moments are g and g^2 exactly on both paths, so the stored codes and
  scales are the quantizer's alone: the fused kernels' equal the XLA twin's bit for bit, a block
  with a NaN (the canonical NaN scale) included."""
  params, grads = random_tree(1, SHAPES, dtype), random_tree(2, SHAPES, dtype, scale=0.3)
  grads["leaf0001"] = grads["leaf0001"].at[0, 0, 5].set(jnp.nan)
  tx = jaxfuse.adam(1e-3, b1=0.0, b2=0.0, moment_bits=8)
  state = tx.init(params)
  (_, fused), (_, twin) = (jit_step(path, tx)(params, state, grads) for path in ("fused", "optax"))
  assert_bitwise_equal(fused[0], twin[0], "moments: kernels vs XLA twin")
  expected = _moments.quantize(grads["leaf0000"].astype(jnp.float32), True, BLOCK)
  assert_bitwise_equal(fused[0].mu["leaf0000"], expected, "mu codes of g")


def test_state_layout_and_report():
  params = random_tree(3, SHAPES, jnp.float32)
  state = jaxfuse.adamw(1e-3, moment_bits=8).init(params)
  for name, shape in zip(sorted(params), SHAPES):
    mu, nu = state[0].mu[name], state[0].nu[name]
    if shape in QUANTIZED:
      assert mu.codes.dtype == jnp.int8 and nu.codes.dtype == jnp.uint8
      assert mu.codes.shape == shape and nu.scales.shape == mu.scales.shape
      # blocks along the fewest trailing dimensions that hold whole blocks
      lead = {(32, 128): 1, (3, 5, 512): 2, (4096,): 0, (64, 100): 0, (5, 3, 3, 64, 64): 3}[shape]
      assert mu.scales.shape == (*shape[:lead], np.prod(shape[lead:]) // BLOCK)
    else:
      assert mu.dtype == nu.dtype == jnp.float32 and mu.shape == shape
  big = {"w": jnp.ones((512, 1024), jnp.float32)}
  tx = jaxfuse.adamw(1e-3, moment_bits=8)
  report = jaxfuse.report(jit_fused(tx), big, tx.init(big), big)
  assert report.params == 512 * 1024
  assert report.state_bytes_per_param == pytest.approx(2 + 2 * 4 / BLOCK, abs=1e-4)
  # read g, p, m, v codes and scales; write p, codes and scales
  assert report.bytes_moved / report.params == pytest.approx(4 + 4 + 2 * (1 + 4 / BLOCK) + 4 +
                                                             2 * (1 + 4 / BLOCK), rel=0.01)


@pytest.mark.parametrize("path", ["fused", "optax"])
def test_converges_like_float32_adamw(path):
  """A two-layer regression trained for 300 steps: the final loss within 3% of float32 AdamW."""
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.standard_normal((256, 128)), jnp.float32)
  teacher = jnp.asarray(rng.standard_normal((128, 1)), jnp.float32)
  y = jnp.broadcast_to(jnp.sin(x @ teacher), (256, 128))
  w0 = {"a": jnp.asarray(rng.standard_normal((128, 256)) * 0.1, jnp.float32),
        "b": jnp.asarray(rng.standard_normal((256, 128)) * 0.1, jnp.float32)[:, :1].repeat(128, 1)
        / 128}
  loss = lambda w: jnp.mean((jnp.tanh(x @ w["a"]) @ w["b"] - y) ** 2)

  def train(tx, path):
    inner = jit_step(path, tx)
    step = jax.jit(lambda w, s: inner(w, s, jax.grad(loss)(w)))
    w, s = w0, tx.init(w0)
    for _ in range(300):
      w, s = step(w, s)
    return float(loss(w))

  reference = train(optax.adamw(3e-3, weight_decay=0.01), "optax")
  quantized = train(jaxfuse.adamw(3e-3, weight_decay=0.01, moment_bits=8), path)
  initial = float(loss(w0))
  assert reference < 0.5 * initial
  assert abs(quantized - reference) <= 0.03 * reference, (quantized, reference)


MODES = {
    "master": dict(master_weights=True),
    "remainder": dict(master_weights="remainder"),
    "stochastic": dict(stochastic_rounding=True, seed=3),
    "skip": dict(skip_nonfinite=True, nu_dtype=jnp.bfloat16),
    "nesterov": dict(nesterov=True),
}


@pytest.mark.parametrize("mode", sorted(MODES))
def test_modes_fused_and_optax_agree(mode):
  """Every other opt-in with 8-bit moments, clip folded in and a loss scale: the fused step and
  the optax protocol agree to the moments' own precision, and a non-finite step changes nothing."""
  dtype = jnp.bfloat16 if mode in ("remainder", "stochastic") else jnp.float32
  params = random_tree(4, SHAPES, dtype)
  tx = optax.chain(jaxfuse.clip_by_global_norm(1.0),
                   jaxfuse.adamw(1e-3, weight_decay=0.1, moment_bits=8, **MODES[mode]))
  fused, twin = (jit_step(path, tx, grad_scale=jnp.float32(2.0)) for path in ("fused", "optax"))
  pf, sf = pt, st = params, tx.init(params)
  for t in range(5):
    g = random_tree(10 + t, SHAPES, dtype)
    pf, sf = fused(pf, sf, g)
    pt, st = twin(pt, st, g)
  # The two paths moved the params alike: within a few ulps of the params, plus 1/16 of how
  # far they moved (an 8-bit code one apart, where the paths' float moments round differently).
  ulp = 2.0 ** -7 if dtype == jnp.bfloat16 else 2.0 ** -20
  for a, b, p in zip(jax.tree.leaves(pf), jax.tree.leaves(pt), jax.tree.leaves(params)):
    a, b, p = (np.asarray(x, np.float32) for x in (a, b, p))
    np.testing.assert_allclose(a, b, atol=5 * ulp * np.abs(b).max()
                               + 2.0 ** -4 * np.abs(b - p).max() + 1e-7)
  moments = lambda s: _moments.dequantize_tree((s[1][0].mu, s[1][0].nu))
  for a, b in zip(jax.tree.leaves(moments(sf)), jax.tree.leaves(moments(st))):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    np.testing.assert_allclose(a, b, atol=2.0 ** -3 * np.abs(b).max() + 1e-6)
  if mode == "skip":
    bad = jax.tree.map(lambda x: x.at[(0,) * x.ndim].set(jnp.nan), random_tree(20, SHAPES, dtype))
    p2, s2 = fused(pf, sf, bad)
    assert_bitwise_equal((p2, s2[1][:-1]), (pf, sf[1][:-1]), "a skipped step")
    assert int(s2[1][-1].skipped_steps) == 1


def test_convert_state_both_ways():
  params = random_tree(8, SHAPES, jnp.float32)
  ref = optax.adamw(1e-3)
  state = ref.update(random_tree(9, SHAPES, jnp.float32), ref.init(params), params)[1]
  tx8 = jaxfuse.adamw(1e-3, moment_bits=8)
  p8, s8 = jaxfuse.convert_state(state, params, tx8)
  assert jax.tree.structure(s8) == jax.tree.structure(tx8.init(params))
  _, back = jaxfuse.convert_state(s8, p8, ref)
  for a, b in zip(jax.tree.leaves(back[0].mu), jax.tree.leaves(state[0].mu)):
    np.testing.assert_allclose(a, b, rtol=2.0 ** -4, atol=2.0 ** -17 * np.abs(b).max())
  assert_bitwise_equal(p8, params, "params")


def test_bad_configurations_raise():
  with pytest.raises(ValueError, match="moment_bits=4"):
    jaxfuse.adamw(1e-3, moment_bits=4)
  params = random_tree(14, QUANTIZED[:1], jnp.float32)
  state32 = jaxfuse.adamw(1e-3).init(params)
  with pytest.raises(ValueError, match="opt_state"):
    jaxfuse.fused_step(jaxfuse.adamw(1e-3, moment_bits=8), params, state32, params)


def test_inject_hyperparams_with_static_moment_bits():
  """moment_bits shapes the state: static under inject_hyperparams (a traced value is refused)."""
  params = random_tree(17, QUANTIZED[:1], jnp.float32)
  tx = optax.inject_hyperparams(jaxfuse.adamw, static_args=("moment_bits",))(
      learning_rate=1e-3, moment_bits=8)
  _, state = jit_step("fused", tx)(params, tx.init(params), params)
  assert isinstance(state.inner_state[0].mu["leaf0000"], jaxfuse.QuantizedMoment)
  with pytest.raises(ValueError, match="static_args"):
    optax.inject_hyperparams(jaxfuse.adamw)(learning_rate=1e-3, moment_bits=8).init(params)
