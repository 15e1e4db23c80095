"""jaxfuse.persistent_decoder against the pure-JAX reference, on every available backend."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.experimental import checkify

from jaxfuse import (DecoderConfig, DecoderWeights, KVCache, RopeScaling, decoder_reference,
                     persistent_decoder)
from jaxfuse._core import ffi as _ffi
from helpers import (DECODER_TOL, SPLIT_CONFIG, assert_bitwise_equal,
                     assert_decoder_matches_reference, assert_timeline_in_order, f32,
                     fused_decoder as fused, random_decoder_problem, reference_decoder as reference,
                     rel_err, small_decoder_problem as _small, stable_seed)


def positions_for(batch, S):
  base = [0, S - 1, S // 2, 1, S - 2, 3, S // 3, 2]
  return np.array([base[i % len(base)] for i in range(batch)], np.int32)


def assert_near_ref(step, ref, dtype=jnp.float32):
  """A step's (out, cache) within DECODER_TOL of the reference's: the output and the new keys."""
  assert rel_err(step[0], ref[0]) < DECODER_TOL[dtype]
  assert rel_err(step[1].k, ref[1].k) < DECODER_TOL[dtype]


# (num_layers, hidden, heads, kv_heads, head_dim, intermediate, max_seq_len)
CONFIGS = {
    "mha_hd32": (2, 64, 4, 4, 32, 96, 24),          # GQA ratio 1
    "gqa2_hd64": (2, 128, 4, 2, 64, 160, 40),       # ratio 2
    "gqa4_hd32": (2, 96, 8, 2, 32, 128, 33),        # ratio 4
    "mqa_hd32": (1, 64, 6, 1, 32, 64, 20),          # multi-query (ratio 6, two head chunks)
    "gqa2_hd128": (1, 128, 2, 1, 128, 256, 17),     # head_dim 128
    "mqa_many": (1, 64, 12, 1, 16, 64, 70),         # 12 query heads on one kv head
}


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("name,batch", [("mha_hd32", 1), ("gqa2_hd64", 3), ("gqa4_hd32", 8),
                                        ("mqa_hd32", 2), ("gqa2_hd128", 4), ("mqa_many", 5)])
def test_matches_reference(device, name, batch, dtype):
  cfg = DecoderConfig(*CONFIGS[name], rms_norm_eps=1e-5, rope_theta=10000.0)
  x, w, cache = random_decoder_problem(cfg, batch, dtype, seed=stable_seed(name), device=device)
  pos = jax.device_put(positions_for(batch, cfg.max_seq_len), device)
  assert_decoder_matches_reference(x, pos, w, cache, cfg, dtype)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_schedules_give_the_same_bits(device, dtype):
  """The stage kernels run the persistent kernel's work split over the same grid: the same bits,
  out and cache (on the CPU, whose handler has one schedule, the attribute's way through)."""
  cfg = DecoderConfig(*CONFIGS["gqa2_hd64"], rms_norm_eps=1e-5, rope_theta=10000.0)
  x, w, cache = random_decoder_problem(cfg, 3, dtype, seed=5, device=device)
  pos = jax.device_put(positions_for(3, cfg.max_seq_len), device)
  step = jax.jit(persistent_decoder, static_argnums=(4,), static_argnames=("schedule",))
  assert_bitwise_equal(step(x, pos, w, cache, cfg, schedule="stage_kernels"),
                       step(x, pos, w, cache, cfg), "stage kernels against the persistent kernel")


# helpers.SPLIT_CONFIG in each dtype, and with int8 / fp8 matrices (bf16 activations).
@pytest.mark.parametrize("quantization,dtype", [
    (None, jnp.float32), (None, jnp.bfloat16), (None, jnp.float16), ("int8", jnp.bfloat16),
    ("fp8", jnp.bfloat16)], ids=["f32", "bf16", "f16", "int8-bf16", "fp8-bf16"])
@pytest.mark.parametrize("batch", [1, 17])
def test_matches_reference_across_splits(device, batch, quantization, dtype):
  cfg = dataclasses.replace(SPLIT_CONFIG, quantization=quantization)
  x, w, cache = random_decoder_problem(cfg, batch, dtype, seed=batch, device=device)
  pos = jax.device_put(positions_for(batch, cfg.max_seq_len), device)
  out, _ = assert_decoder_matches_reference(x, pos, w, cache, cfg, dtype)
  # The splits' partial sums are added in a fixed order, whichever thread finishes last.
  for _ in range(3):
    np.testing.assert_array_equal(np.asarray(fused(x, pos, w, cache, cfg)[0]), np.asarray(out))


LLAMA3 = RopeScaling("llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                     original_max_position_embeddings=64)


# The architecture features, each on its own and all together: q/k/v biases (Qwen2), per-head
# q/k RMSNorm (Qwen3), scaled RoPE (Llama 3.1: positions past the original context of 64 here).
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("features", [
    dict(qkv_bias=True), dict(qk_norm=True), dict(rope_scaling=LLAMA3),
    dict(qkv_bias=True, qk_norm=True, rope_scaling=RopeScaling("linear", factor=4.0))],
    ids=["qkv_bias", "qk_norm", "llama3_rope", "all"])
def test_architecture_features(device, features, dtype):
  cfg = DecoderConfig(2, 64, 8, 2, 32, 96, 200, rope_theta=500000.0, **features)
  x, w, cache = random_decoder_problem(cfg, 3, dtype, seed=stable_seed(str(features)),
                                       device=device)
  w = w._replace(wk=w.wk * 3)  # keys of RMS ~3, so that the per-head k RMSNorm matters
  pos = jax.device_put(np.array([0, 70, 199], np.int32), device)
  _, new = assert_decoder_matches_reference(x, pos, w, cache, cfg, dtype)
  # Each feature changes the new keys (the kernel does not ignore it).
  plain = dataclasses.replace(cfg, qkv_bias=False, qk_norm=False, rope_scaling=None)
  _, plain_cache = reference(x, pos, w._replace(q_bias=None, k_bias=None, v_bias=None, q_norm=None,
                                                k_norm=None), cache, plain)
  new_keys = (f32(c.k)[:, np.arange(3), np.asarray(pos)] for c in (new, plain_cache))
  assert rel_err(*new_keys) > 10 * DECODER_TOL[dtype]


def test_rope_scaling_rules():
  """The frequency table of each rule, against the rule written out element by element."""
  table = lambda scaling=None: DecoderConfig(1, 64, 4, 4, 128, 64, 8, rope_theta=500000.0,
                                             rope_scaling=scaling).rope_inv_freq()
  inv = table()
  assert inv.dtype == np.float32 and inv.shape == (64,)
  np.testing.assert_allclose(table(RopeScaling("linear", factor=4.0)), inv / 4.0, rtol=1e-7)
  got = table(RopeScaling("llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                          original_max_position_embeddings=8192))
  f = 500000.0 ** (-np.arange(0, 128, 2) / 128.0)
  wavelength = 2 * np.pi / f
  smooth = (8192 / wavelength - 1.0) / (4.0 - 1.0)
  band = np.where(wavelength < 8192 / 4.0, 0, np.where(wavelength > 8192 / 1.0, 1, 2))
  want = np.choose(band, [f, f / 8.0, (1 - smooth) * f / 8.0 + smooth * f])  # kept/scaled/blended
  np.testing.assert_allclose(got, want, rtol=1e-7)
  np.testing.assert_allclose(inv, f, rtol=1e-7)
  assert set(band) == {0, 1, 2}  # every branch of the rule is exercised
  with pytest.raises(ValueError, match="rope_type 'yarn' is not supported"):
    RopeScaling("yarn", factor=4.0)
  with pytest.raises(ValueError, match="high_freq_factor=1.0 must exceed low_freq_factor=1.0"):
    RopeScaling("llama3", factor=8.0, high_freq_factor=1.0)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16],
                         ids=["f32", "bf16", "f16"])
def test_consecutive_steps_feed_cache(device, dtype):
  cfg = DecoderConfig(2, 64, 4, 2, 32, 96, 16)
  x, w, cache = random_decoder_problem(cfg, 3, dtype, 3, device)
  pos = np.array([0, 5, 12], np.int32)
  (h_fused, c_fused), (h_ref, c_ref) = (x, cache), (x, cache)
  for step in range(4):
    p = jax.device_put(pos + step, device)
    h_fused, c_fused = fused(h_fused, p, w, c_fused, cfg)
    h_ref, c_ref = reference(h_ref, p, w, c_ref, cfg)
    # Feed the reference's own output back into both, so errors do not compound across steps.
    assert rel_err(h_fused, h_ref) < DECODER_TOL[dtype], step
    h_fused = h_ref
  assert rel_err(c_fused.k, c_ref.k) < DECODER_TOL[dtype]
  assert rel_err(c_fused.v, c_ref.v) < DECODER_TOL[dtype]


def test_prefill_reference_matches_steps(device):
  """decoder_reference's multi-token prefill equals T single-token fused steps."""
  cfg = DecoderConfig(2, 64, 4, 1, 16, 64, 12)
  _, w, cache = random_decoder_problem(cfg, 2, jnp.float32, 11, device)
  T = 5
  xs = jax.device_put(np.random.default_rng(0).standard_normal((2, T, 64)).astype(np.float32),
                      device)
  positions = np.array([[0], [4]], np.int32) + np.arange(T, dtype=np.int32)  # rows from 0 and 4
  ref, ref_cache = decoder_reference(xs, jnp.asarray(positions), w, cache, cfg)
  c = cache
  for t in range(T):
    out, c = fused(xs[:, t], jax.device_put(positions[:, t], device), w, c, cfg)
    assert rel_err(out, ref[:, t]) < DECODER_TOL[jnp.float32]
  np.testing.assert_allclose(np.asarray(c.k), np.asarray(ref_cache.k), rtol=1e-5, atol=1e-5)


def test_future_positions_not_read(device):
  """Cache slots after p hold NaN: a kernel reading past p would produce NaN."""
  cfg = DecoderConfig(2, 64, 4, 2, 32, 96, 40)
  x, w, cache = random_decoder_problem(cfg, 4, jnp.float32, 5, device)
  pos = np.array([0, 17, 39, 8], np.int32)
  future = (np.arange(cfg.max_seq_len) > pos[:, None])[None, :, :, None, None]  # [1, B, S, 1, 1]
  cache = jax.tree.map(lambda a: jnp.where(future, jnp.nan, a), cache)
  # A finite output, and the NaN slots bitwise kept.
  assert_decoder_matches_reference(x, jax.device_put(pos, device), w, cache, cfg, jnp.float32)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_out_of_range_positions(device, dtype):
  """Traced (jitted) positions out of range: NaN rows, their cache bitwise unchanged."""
  cfg = DecoderConfig(2, 64, 4, 2, 32, 96, 16)
  x, w, cache = random_decoder_problem(cfg, 4, dtype, 9, device)
  pos = np.array([-1, 16, 7, -2147483648], np.int32)
  out, new = fused(x, jax.device_put(pos, device), w, cache, cfg)
  out = np.asarray(out, np.float32)
  assert np.all(np.isnan(out[[0, 1, 3]]))
  bad_rows = lambda c: jax.tree.map(lambda a: a[:, [0, 1, 3]], c)
  assert_bitwise_equal(bad_rows(new), bad_rows(cache), "the cache of the rows with a bad position")
  ref, ref_cache = reference(x, jax.device_put(pos, device), w, cache, cfg)
  assert rel_err(out[2], ref[2]) < DECODER_TOL[dtype]  # the valid row is unaffected
  assert rel_err(new.k[:, 2], ref_cache.k[:, 2]) < DECODER_TOL[dtype]


def test_concrete_out_of_range_positions_raise():
  """Concrete positions are checked at call time: the first bad row, its position, the range."""
  cfg = DecoderConfig(2, 64, 4, 2, 32, 96, 16)
  x, w, cache = random_decoder_problem(cfg, 4, jnp.float32, 9, jax.devices("cpu")[0])
  cases = [([-1, 3, 5, 2], 0), ([3, 16, 5, 2], 1), ([3, 5, 2, -7], 3), ([16, 99, -1, 2], 0),
           ([0, 15, 7, -2147483648], 3)]
  for positions, row in cases:
    message = (rf"persistent_decoder: positions\[{row}\] = {positions[row]} is outside \[0, 16\) "
               r"\(max_seq_len\)")
    for given in (np.array(positions, np.int32), jnp.array(positions, jnp.int32), positions):
      with pytest.raises(ValueError, match=message):
        persistent_decoder(x, given, w, cache, cfg)
    # A NumPy constant inside a jitted function is concrete too: refused while tracing.
    with pytest.raises(ValueError, match=message):
      jax.jit(lambda x: persistent_decoder(x, np.array(positions, np.int32), w, cache, cfg))(x)
  # int64 positions are checked before the conversion to int32 (which would wrap 2^32 + 5 to 5).
  with pytest.raises(ValueError, match=r"positions\[1\] = 4294967301 is outside"):
    persistent_decoder(x, np.array([3, 2**32 + 5, 1, 2], np.int64), w, cache, cfg)
  # The ends of the range are accepted.
  good = np.array([0, 15, 7, 1], np.int32)
  assert_near_ref(persistent_decoder(x, good, w, cache, cfg), reference(x, good, w, cache, cfg))


def test_checkify_positions(device):
  """check_positions=True under checkify(jit(...)) reports the first bad row; a good batch passes
  and decodes as the reference; vmapped, each mapped call names its own row."""
  cfg = DecoderConfig(2, 64, 4, 2, 32, 96, 16)
  x, w, cache = random_decoder_problem(cfg, 3, jnp.float32, 12, device)
  step = functools.partial(persistent_decoder, cfg=cfg, check_positions=True)
  checked = checkify.checkify(jax.jit(step))
  good = jax.device_put(np.array([0, 15, 6], np.int32), device)
  err, got = checked(x, good, w, cache)
  assert err.get() is None
  assert_near_ref(got, reference(x, good, w, cache, cfg))
  for bad, row in (([0, 16, 6], 1), ([-3, 15, -1], 0)):
    err, (out, _) = checked(x, jax.device_put(np.array(bad, np.int32), device), w, cache)
    with pytest.raises(checkify.JaxRuntimeError, match=rf"persistent_decoder: positions\[{row}\] = "
                       rf"{bad[row]} is outside \[0, 16\) \(max_seq_len\)"):
      err.throw()
    assert np.isnan(np.asarray(out)[row]).all()  # the program itself is unchanged
  xs, caches = jnp.stack([x, x]), jax.tree.map(lambda a: jnp.stack([a, a]), cache)
  mapped = checkify.checkify(jax.jit(jax.vmap(step, in_axes=(0, 0, None, 0))))
  bad = jax.device_put(np.array([[1, 2, 3], [4, 5, 16]], np.int32), device)
  err, _ = mapped(xs, bad, w, caches)
  with pytest.raises(checkify.JaxRuntimeError, match=r"positions\[2\] = 16 is outside"):
    err.throw()


def test_position_checks_not_traced_by_default():
  """Without check_positions the traced program has no check (nor the ops computing it)."""
  cfg, x, pos, w, cache = _small(jax.devices("cpu")[0])

  def primitives(check_positions):
    step = functools.partial(persistent_decoder, cfg=cfg, check_positions=check_positions)
    return {e.primitive.name for e in jax.make_jaxpr(step)(x, pos, w, cache).eqns}

  assert {"check", "argmin"} <= primitives(True)
  assert not {"check", "argmin"} & primitives(False)


def test_vmap_folds_into_batch(device):
  cfg = DecoderConfig(2, 64, 4, 2, 32, 96, 16)
  V, B = 3, 2
  xs, ws, caches = zip(*(random_decoder_problem(cfg, B, jnp.float32, 20 + i, device)
                         for i in range(V)))
  x, w = jnp.stack(xs), ws[-1]
  cache = jax.tree.map(lambda *a: jnp.stack(a), *caches)
  pos = jax.device_put(np.array([[0, 3], [15, 9], [4, 4]], np.int32), device)
  out, new = jax.jit(jax.vmap(persistent_decoder, in_axes=(0, 0, None, 0, None)),
                     static_argnums=(4,))(x, pos, w, cache, cfg)
  assert out.shape == (V, B, 64) and new.k.shape == (V,) + cfg.cache_shape(B)
  for i in range(V):
    assert_near_ref(jax.tree.map(lambda a: a[i], (out, new)),
                    reference(xs[i], pos[i], w, caches[i], cfg))
  # Mapped on a non-leading axis, with an unmapped (shared) cache.
  out2, _ = jax.vmap(persistent_decoder, in_axes=(1, None, None, None, None), out_axes=1)(
      jnp.moveaxis(x, 0, 1), pos[0], w, caches[0], cfg)
  for i in range(V):
    ref, _ = reference(xs[i], pos[0], w, caches[0], cfg)
    assert rel_err(out2[:, i], ref) < DECODER_TOL[jnp.float32]
  with pytest.raises(NotImplementedError, match="vmap over the weights"):
    jax.vmap(persistent_decoder, in_axes=(0, 0, 0, 0, None))(
        x, pos, jax.tree.map(lambda a: jnp.stack([a] * V), w), cache, cfg)


def test_scan_and_while_loop(device):
  cfg = DecoderConfig(2, 64, 4, 2, 32, 96, 16)
  x, w, cache = random_decoder_problem(cfg, 2, jnp.float32, 30, device)
  pos0 = jax.device_put(np.array([0, 6], np.int32), device)

  def step(step_fn, carry):  # (h, cache, positions) -> the next ones, and h
    h, c, p = carry
    h, c = step_fn(h, p, w, c, cfg)
    return (h, c, p + 1), h

  def run(step_fn):  # 5 steps in a scan
    return jax.jit(lambda *carry: lax.scan(lambda s, _: step(step_fn, s), carry, None, length=5))(
        x, cache, pos0)

  (h_f, c_f, _), hs_f = run(persistent_decoder)
  (h_r, c_r, _), hs_r = run(decoder_reference)
  assert rel_err(hs_f, hs_r) < 1e-3  # 5 chained steps of a fp32 computation
  assert rel_err(c_f.k, c_r.k) < 1e-3
  h_w, c_w, p_w = jax.jit(lambda: lax.while_loop(
      lambda s: s[2][0] < 5, lambda s: step(persistent_decoder, s)[0], (x, cache, pos0)))()
  assert int(p_w[0]) == 5
  assert rel_err(h_w, h_f) < 1e-5


def test_jit_with_donation(device):
  cfg = DecoderConfig(2, 64, 4, 2, 32, 96, 16)
  x, w, cache = random_decoder_problem(cfg, 2, jnp.bfloat16, 40, device)
  pos = jax.device_put(np.array([2, 11], np.int32), device)
  ref = reference(x, pos, w, cache, cfg)
  # (a numpy view of the cache itself would hold an external reference and block donation)
  snapshot = jax.tree.map(lambda a: np.asarray(jnp.copy(a)), cache)
  step = jax.jit(persistent_decoder, static_argnums=(4,), donate_argnums=(3,))
  out, new = step(x, pos, w, cache, cfg)
  assert_near_ref((out, new), ref, jnp.bfloat16)
  assert cache.k.is_deleted() and cache.v.is_deleted()  # the buffers were reused in place
  written = np.zeros(cfg.cache_shape(2)[:3], bool)
  written[:, [0, 1], [2, 11]] = True
  assert_bitwise_equal(np.asarray(new.v)[~written], snapshot.v[~written], "cache.v, not written")


# ---- errors -----------------------------------------------------------------------------------

@pytest.mark.parametrize("field", DecoderWeights._fields)
def test_misshaped_or_mistyped_weight(field):
  # The scales exist only in a quantized stack (tests/test_quantize.py: its matrices' dtypes).
  quantization = "int8" if field.endswith("_scale") else None
  cfg, x, pos, w, cache = _small(jax.devices("cpu")[0], quantization)
  bad = getattr(w, field)
  with pytest.raises(ValueError, match=rf"persistent_decoder: {field} has shape \(.*\), expected"):
    persistent_decoder(x, pos, w._replace(**{field: bad[..., :-1]}), cache, cfg)
  with pytest.raises(TypeError, match=rf"persistent_decoder: {field} has dtype bfloat16, "
                                      "expected float32"):
    persistent_decoder(x, pos, w._replace(**{field: bad.astype(jnp.bfloat16)}), cache, cfg)


def test_bad_arguments():
  cfg, x, pos, w, cache = _small(jax.devices("cpu")[0])
  operands = dict(x=x, positions=pos, w=w, cache=cache, cfg=cfg)
  for error, message, replaced in [
      (ValueError, r"x has shape \(2, 63\), expected \(B, 64\)", dict(x=x[:, :-1])),
      (ValueError, r"x has shape", dict(x=x[None])),
      (TypeError, "x has dtype int32", dict(x=x.astype(jnp.int32))),
      (TypeError, "positions has dtype float32, expected int32",
       dict(positions=pos.astype(jnp.float32))),
      (TypeError, "positions has dtype uint32, expected int32",
       dict(positions=pos.astype(jnp.uint32))),
      (ValueError, r"positions has shape \(3,\), expected \(2,\)",
       dict(positions=jnp.array([1, 2, 3], jnp.int32))),
      (ValueError, r"cache.k has shape .*expected \(2, 2, 16, 2, 32\)",
       dict(cache=cache._replace(k=cache.k[:, :, :-1]))),
      (ValueError, r"cache.v has shape", dict(cache=cache._replace(v=cache.v[:, :1]))),
      (TypeError, "cache.k has dtype bfloat16",
       dict(cache=cache._replace(k=cache.k.astype(jnp.bfloat16)))),
      (TypeError, "w must be a jaxfuse.DecoderWeights", dict(w=tuple(w))),
      (TypeError, "cache must be a jaxfuse.KVCache", dict(cache=tuple(cache))),
      (TypeError, "cfg must be a jaxfuse.DecoderConfig", dict(cfg=None))]:
    with pytest.raises(error, match=message):
      persistent_decoder(**(operands | replaced))
  plain = DecoderConfig(2, 64, 4, 2, 32, 96, 16, qk_norm=True)
  for fn in (persistent_decoder, decoder_reference):
    with pytest.raises(ValueError, match=f"{fn.__name__}: w.q_bias is given, but cfg.qkv_bias "
                                         "is False"):
      fn(x, pos, w, cache, plain)
    with pytest.raises(ValueError, match=f"{fn.__name__}: w.k_norm is None, but cfg.qk_norm "
                                         "is set"):
      fn(x, pos, w._replace(k_norm=None), cache, cfg)
  with pytest.raises(NotImplementedError, match="not differentiable"):
    jax.grad(lambda x: persistent_decoder(x, pos, w, cache, cfg)[0].sum())(x)
  for schedule in ("megakernel", None, 1):
    with pytest.raises(ValueError, match=r"persistent_decoder: schedule must be one of "
                       r"\('persistent', 'stage_kernels'\), got"):
      persistent_decoder(x, pos, w, cache, cfg, schedule=schedule)


def test_bad_config():
  for message, args, kwargs in [
      ("num_heads=6 must be a multiple of num_kv_heads=4", (1, 64, 6, 4, 16, 64, 8), {}),
      ("head_dim=15 must be even", (1, 64, 4, 4, 15, 64, 8), {}),
      ("max_seq_len must be a positive integer", (1, 64, 4, 4, 16, 64, 0), {}),
      ("rope_theta", (1, 64, 4, 4, 16, 64, 8), dict(rope_theta=-1.0)),
      ("qk_norm must be a bool", (1, 64, 4, 4, 16, 64, 8), dict(qk_norm=1)),
      ("rope_scaling must be None or a jaxfuse.RopeScaling", (1, 64, 4, 4, 16, 64, 8),
       dict(rope_scaling={"rope_type": "llama3"}))]:
    with pytest.raises(ValueError, match=message):
      DecoderConfig(*args, **kwargs)
  assert hash(DecoderConfig(1, 64, 4, 4, 16, 64, 8)) == hash(DecoderConfig(1, 64, 4, 4, 16, 64, 8))


def test_handler_validates_buffers(device):
  """The FFI handler itself rejects inconsistent buffers with an error, not a crash: the
  whole-model step's operands and attributes (the layers': test_ffi_validation.py)."""
  cfg, x, pos, w, cache = _small(device, "int8")  # every optional weight present
  pos = jax.device_put(pos, device)
  from jaxfuse._decode.contract import _attributes, _workspace_bytes
  attrs = _attributes(cfg)
  assert (attrs["qkv_bias"], attrs["qk_norm"], attrs["quantized"]) == (True, True, True)
  caches = 3 + len(w)  # the operand index of k_cache
  D, B = 64, x.shape[0]
  no_scale = jnp.zeros((0,), jnp.float32)
  layers_only = (jnp.zeros((0,), jnp.int32), jnp.zeros((0, D), x.dtype), jnp.zeros((0,), x.dtype),
                 jnp.zeros((0, D), x.dtype), no_scale, jnp.zeros((0,), jnp.uint32))

  def call(ws_bytes, first=x, model=layers_only, logits=(B, 0), sampled=0, **over):
    a = dict(attrs, **over)
    shapes = tuple(jax.ShapeDtypeStruct(*s) for s in (
        ((B, D), x.dtype), (cache.k.shape, x.dtype), (cache.v.shape, x.dtype),
        (logits, jnp.float32), ((sampled,), jnp.int32), ((ws_bytes,), jnp.uint8)))
    f = jax.ffi.ffi_call(_ffi.target("jaxfuse_decoder"), shapes,
                         input_output_aliases={caches: 1, caches + 1: 2})
    inv_freq = jnp.asarray(cfg.rope_inv_freq())
    return jax.jit(lambda *args: f(*args, **a))(first, pos, inv_freq, *w, cache.k, cache.v, *model)

  good = _workspace_bytes(cfg, 2, jnp.float32)
  jax.block_until_ready(call(good))
  # The whole-model step's operands: a vocabulary of 5, a tied head, sampled.
  V = 5
  tokens = jax.device_put(jnp.array([1, 4], jnp.int32), device)
  embed = jnp.ones((V, D), x.dtype)
  step = dict(first=jnp.zeros((B, 0), x.dtype), logits=(B, V), sampled=B,
              model_step=np.bool_(True), sample=np.bool_(True), temperature=np.float32(0.5))
  model = (tokens, embed, jnp.ones((D,), x.dtype), jnp.zeros((0, D), x.dtype), no_scale,
           jnp.array([0, 7], jnp.uint32))
  swap = lambda i, *new: model[:i] + new + model[i + len(new):]  # model operands i, i + 1, ...

  def refused(message, ws_bytes=good, model=model, **over):  # a model step with `over` changed
    with pytest.raises(Exception, match=message):
      jax.block_until_ready(call(ws_bytes, model=model, **dict(step, **over)))

  jax.block_until_ready(call(good, model=model, **step))
  refused(r"x must have shape \[B, 0\]", first=x)
  refused(r"tokens must have shape \[2\]", model=swap(0, tokens[:1]))
  refused(r"lm_head does not have shape \[5,64\]", model=swap(3, jnp.ones((4, D), x.dtype)))
  refused(r"sample_key must have shape \[2\]", model=swap(5, jnp.zeros((0,), jnp.uint32)))
  refused(r"logits does not have shape \[2,5\]", logits=(B, 4))
  refused("temperature=-1 must be finite and >= 0", temperature=np.float32(-1))
  refused("sample needs model_step", model_step=np.bool_(False))
  # A filtered draw: its workspace holds each row's search; bad filters are named.
  filtered = _workspace_bytes(cfg, 2, jnp.float32, sample_filter=True)
  assert filtered > good
  jax.block_until_ready(call(filtered, model=model, **dict(step, top_k=np.int64(2))))
  refused(f"workspace has {good} bytes, expected {filtered}", top_p=np.float32(0.5))
  for bad, message in ((dict(top_k=np.int64(-1)), r"top_k=-1 must be in \[0, "),
                       (dict(top_p=np.float32(0)), r"top_p=0 must be in \(0, 1\]"),
                       (dict(top_p=np.float32(np.nan)), r"top_p=nan must be in \(0, 1\]"),
                       (dict(top_k=np.int64(3), temperature=np.float32(0)),
                        "top_k and top_p filter a draw: they need sample and temperature > 0")):
    refused(message, filtered, **bad)
  # A quantized head: rows in the matrices' int8 and a float32 scale per row.
  head = (jnp.ones((V, D), jnp.int8), jnp.ones((V,), jnp.float32))
  jax.block_until_ready(call(good, model=swap(3, *head), **step))
  refused("lm_head must have dtype int8", model=swap(3, embed, head[1]))
  refused(r"lm_head_scale does not have shape \[5\]", model=swap(3, head[0], head[1][:4]))
  refused(r"lm_head_scale does not have shape \[0\]", model=swap(4, jnp.ones((2, 5))))


def test_a_contract_mismatch_raises_at_the_decoders_first_use(monkeypatch):
  """The C++ contract is checked at import, against what jaxfuse/_decode passes, and a
  disagreement (a stale build) named at the decoder's first use: `import jaxfuse` and the
  optimizers keep working."""
  from jaxfuse._decode import kernel
  assert kernel._contract_problems(kernel._CONTRACT) == []
  names = dict(kernel._CONTRACT.names, results=kernel._CONTRACT.names["results"][:-1])
  problems = kernel._contract_problems(dataclasses.replace(kernel._CONTRACT, names=names))
  assert len(problems) == 1 and problems[0].startswith("results (")
  monkeypatch.setattr(kernel, "_CONTRACT_PROBLEMS", problems)
  # A config no other test builds: the decode step is cached per config once it is made.
  cfg = DecoderConfig(1, 64, 2, 1, 32, 96, 11)
  x, w, cache = random_decoder_problem(cfg, 1, jnp.float32, seed=2)
  with pytest.raises(RuntimeError, match=r"jaxfuse_decoder disagrees with jaxfuse/_decode: "
                                         r"results \("):
    persistent_decoder(x, jnp.zeros((1,), jnp.int32), w, cache, cfg)


def test_stage_timeline_on_the_cpu_handler():
  """A call that records the stage timeline returns the same bits as one that does not, and
  records every stage of the layers (and of a whole-model step, the head and the draw) once, in
  order, as one block that never waits."""
  from jaxfuse._decode import generation, timeline
  from test_generate import random_model

  cfg = SPLIT_CONFIG
  x, w, cache = random_decoder_problem(cfg, 2, jnp.float32, seed=21)
  positions = jnp.asarray([3, 7], jnp.int32)
  out, new_cache, tl = timeline.layers_timeline(x, positions, w, cache, cfg)
  assert_bitwise_equal((out, new_cache), persistent_decoder(x, positions, w, cache, cfg),
                       "the step recording its timeline")
  layer_names = [f"{l}.{s}" for l in range(cfg.num_layers) for s in timeline.LAYER_STAGES]
  assert_timeline_in_order(tl, ["embed", *layer_names], blocks=1)
  assert (tl.ready == -1).all()
  assert "| gate_up |" in tl.summary()
  with pytest.raises(ValueError, match="layers_timeline: a step of 0 rows"):
    timeline.layers_timeline(x[:0], positions[:0], w, KVCache(cache.k[:, :0], cache.v[:, :0]), cfg)
  with pytest.raises(ValueError, match=r"positions\[1\] = 8 is outside \[0, 8\)"):
    timeline.layers_timeline(x, jnp.asarray([3, 8], jnp.int32), w, cache, cfg)

  model = random_model(jnp.bfloat16, seed=22)
  model_cache = generation.init_cache(model, 2, 16)
  tokens = jnp.asarray([5, 40], jnp.int32)
  logits, _, tl = timeline.model_timeline(model, tokens, positions, model_cache)
  cfg = generation._cache_config(model, model_cache)
  want = generation._model_step(model, cfg, tokens, positions, model_cache, 0.0,
                                jnp.zeros((2,), jnp.uint32))
  np.testing.assert_array_equal(np.asarray(logits), np.asarray(want[0]))
  layer_names = [f"{l}.{s}" for l in range(cfg.num_layers) for s in timeline.LAYER_STAGES]
  assert_timeline_in_order(tl, ["embed", *layer_names, "head", "sample"], blocks=1)
