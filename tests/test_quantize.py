"""Weight-only int8 / fp8 decoding: jaxfuse.quantize's error bound, and the quantized persistent
decoder against decoder_reference on the same quantized weights (every dtype and architecture
feature, every fp8 code). Quantized matrices split across GEMV work items: test_decoder.py;
quantized Hugging Face models against their unquantized selves: test_hf.py; generation with one:
test_generate.py."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxfuse
from jaxfuse import DecoderConfig, RopeScaling, decoder_reference, persistent_decoder
from jaxfuse._decode.quantize import MATRICES, quantize_matrix
from helpers import (DECODER_TOL, assert_bitwise_equal, assert_decoder_matches_reference, f32,
                     fused_decoder as fused, random_decoder_problem, reference_decoder as reference,
                     rel_err, small_decoder_problem, stable_seed)

FORMATS = ["int8", "fp8"]
QMAX = {"int8": 127.0, "fp8": 448.0}

def heavy_tailed(rng, shape):
  """Normal values times 10^u, u uniform in [-7, 0]: every binade of e4m3 below a column's
  maximum is populated, subnormal codes included."""
  return rng.standard_normal(shape) * 10.0 ** rng.uniform(-7, 0, shape)


def format_bound(quantization, w, s):
  """The largest |dequantized - w| of weights w of scales s, before fp32 roundings: int8, half a
  step of the column's uniform grid; fp8, half an ulp of 3 mantissa bits, or of the subnormal
  spacing 2^-9 (in units of scale)."""
  return (np.broadcast_to(s / 2, w.shape) if quantization == "int8"
          else np.maximum(np.abs(w) * 2.0**-4, s * 2.0**-10))


# ---- the scheme ---------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("quantization", FORMATS)
def test_error_within_the_format_bound(quantization, dtype):
  rng = np.random.default_rng(stable_seed(quantization))
  w = heavy_tailed(rng, (2, 96, 40))
  w[0, :, 3] = 0.0  # an all-zero column: scale 1, codes 0
  w[1, :, 5] = 1e-30 * rng.standard_normal(96)  # a column far below e4m3's own range
  w = jnp.asarray(w, dtype)
  q, scale = quantize_matrix(w, quantization)
  assert q.dtype == jaxfuse._decode.config.QUANTIZED_DTYPES[quantization] and q.shape == w.shape
  assert scale.dtype == jnp.float32 and scale.shape == (2, 40)
  w, s = f32(w), f32(scale)[:, None, :]
  err = np.abs(f32(q) * s - w)  # the float32 matrix (q, scale) stands for
  # Plus the fp32 roundings of w / scale and of q * scale (2^-24 relative each).
  assert np.all(err <= format_bound(quantization, w, s) * (1 + 2.0**-20) + np.abs(w) * 2.0**-22)
  # Each nonzero column's largest weight lands on the grid's end; the zero column stays zero.
  amax = np.abs(f32(q)).max(axis=1)
  np.testing.assert_array_equal(np.delete(amax[0], 3), QMAX[quantization])
  assert amax[0, 3] == 0 and f32(scale)[0, 3] == 1.0


@pytest.mark.parametrize("quantization", FORMATS)
def test_head_scales_are_per_row(quantization):
  """The LM head [V, D] gets a scale per row: the codes and scales of its transpose's columns."""
  w = jnp.asarray(heavy_tailed(np.random.default_rng(4), (30, 48)), jnp.bfloat16)
  q, scale = quantize_matrix(w, quantization, -1)
  q_t, scale_t = quantize_matrix(w.T[None], quantization)
  assert q.shape == w.shape and scale.shape == (30,)
  np.testing.assert_array_equal(f32(q), f32(q_t[0]).T)
  np.testing.assert_array_equal(f32(scale), f32(scale_t[0]))


def test_quantize_model_keeps_the_rest():
  cfg = DecoderConfig(2, 64, 4, 2, 16, 96, 16, qkv_bias=True, qk_norm=True)
  _, w, _ = random_decoder_problem(cfg, 1, jnp.bfloat16, seed=3)
  embed = jnp.asarray(np.random.default_rng(3).standard_normal((50, 64)), jnp.bfloat16)
  model = jaxfuse.DecoderModel(cfg, w, embed, jnp.ones(64, jnp.bfloat16))
  q = jaxfuse.quantize(model, "fp8")
  assert q.config == dataclasses.replace(cfg, quantization="fp8") and q.config.quantized
  for name in MATRICES:
    assert getattr(q.layers, name).dtype == jnp.float8_e4m3fn
    assert getattr(q.layers, name + "_scale").shape == (2, getattr(w, name).shape[-1])
  for name in ("attn_norm", "mlp_norm", "q_bias", "k_bias", "v_bias", "q_norm", "k_norm"):
    assert getattr(q.layers, name) is getattr(w, name)
  assert q.embed is model.embed and q.final_norm is model.final_norm
  # The tied head becomes its own fp8 rows; head=False keeps it tied, in bf16.
  assert q.head_quantized and not q.tied
  assert_bitwise_equal((q.lm_head, q.lm_head_scale), quantize_matrix(embed, "fp8", -1),
                       "the tied head's own fp8 rows")
  kept = jaxfuse.quantize(model, "fp8", head=False)
  assert kept.tied and not kept.head_quantized and kept.layers.wq.dtype == jnp.float8_e4m3fn


@pytest.mark.parametrize("quantization", FORMATS)
def test_head_error_within_the_format_bound(quantization):
  """Each logit of the quantized head is within the sum over d of |input[d]| times its weight's
  bound (test_error_within_the_format_bound's), plus fp32 summation rounding."""
  cfg = DecoderConfig(1, 64, 4, 2, 16, 96, 16)
  _, w, _ = random_decoder_problem(cfg, 1, jnp.float32, seed=5)
  rng = np.random.default_rng(6)
  model = jaxfuse.DecoderModel(cfg, w, jnp.asarray(rng.standard_normal((40, 64)), jnp.float32),
                               jnp.asarray(1 + 0.1 * rng.standard_normal(64), jnp.float32),
                               jnp.asarray(heavy_tailed(rng, (40, 64)), jnp.float32))
  q = jaxfuse.quantize(model, quantization)
  h = jnp.asarray(rng.standard_normal((3, 64)), jnp.float32)
  a = np.abs(f32(jaxfuse._decode.reference._ref_rmsnorm(h, model.final_norm, cfg.rms_norm_eps)))
  head = f32(model.lm_head)
  bound = format_bound(quantization, head, f32(q.lm_head_scale)[:, None])
  err = np.abs(f32(q.logits(h)) - f32(model.logits(h)))
  rounding = 1e-5 * (a @ np.abs(head).T)
  assert np.all(err <= a @ bound.T * (1 + 2.0**-20) + rounding)
  assert np.max(err) > 0  # (the head did change)


# ---- the kernel against the reference, on the same quantized weights ---------------------------

LLAMA3 = RopeScaling("llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                     original_max_position_embeddings=16)
CASES = {  # config, batch
    "gqa2_b1": (DecoderConfig(2, 128, 4, 2, 32, 160, 24), 1),
    "mha_bias_norm_llama3_b3": (DecoderConfig(2, 64, 4, 4, 16, 96, 40, qkv_bias=True,
                                              qk_norm=True, rope_scaling=LLAMA3), 3),
    "mqa_linear_rope_b5": (DecoderConfig(1, 96, 6, 1, 32, 200, 33,
                                         rope_scaling=RopeScaling("linear", 2.0)), 5),
}


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16],
                         ids=["f32", "bf16", "f16"])
@pytest.mark.parametrize("quantization", FORMATS)
@pytest.mark.parametrize("case", CASES)
def test_kernel_matches_reference(device, case, quantization, dtype):
  cfg, batch = CASES[case]
  cfg = dataclasses.replace(cfg, quantization=quantization)
  x, w, cache = random_decoder_problem(cfg, batch, dtype, seed=stable_seed(case), device=device)
  assert w.wq.dtype == cfg.matrix_dtype(dtype) and w.w_down_scale.dtype == jnp.float32
  pos = jax.device_put(np.arange(batch, dtype=np.int32) * 7 % cfg.max_seq_len, device)
  assert_decoder_matches_reference(x, pos, w, cache, cfg, dtype)


def test_every_fp8_code(device):
  """Matrices holding all 254 finite e4m3 codes (subnormals and both zeros included) through the
  kernel's widening, against the reference's (XLA's conversion)."""
  cfg = DecoderConfig(1, 128, 4, 2, 32, 128, 8)
  x, w, cache = random_decoder_problem(cfg, 2, jnp.float32, seed=5)
  rng = np.random.default_rng(11)
  w = w._replace(**{name: jnp.asarray(heavy_tailed(rng, getattr(w, name).shape), jnp.float32)
                    for name in MATRICES})
  w = w._replace(wq=w.wq.at[0, 0, :2].set(jnp.array([0.0, -0.0])))  # (the column max is not 0)
  w, cfg = jaxfuse.quantize_weights(w, cfg, "fp8")
  codes = np.unique(np.asarray(w.wq).view(np.uint8))
  assert codes.size == 254 and not np.isin([0x7f, 0xff], codes).any()
  x, w, cache, pos = jax.device_put((x, w, cache, np.array([0, 5], np.int32)), device)
  assert rel_err(fused(x, pos, w, cache, cfg)[0], reference(x, pos, w, cache, cfg)[0]) < 1e-4


# The whole-model step with the head quantized too (a tied head quantized into its own rows): the
# kernel's logits and draws against the reference's on the same weights.
@pytest.mark.parametrize("quantization,dtype,tied", [("int8", jnp.float32, True),
                                                     ("fp8", jnp.bfloat16, False)],
                         ids=["int8-f32-tied", "fp8-bf16-untied"])
def test_whole_model_step_with_quantized_head(device, quantization, dtype, tied):
  cfg = DecoderConfig(2, 64, 4, 2, 16, 96, 16)
  _, w, _ = random_decoder_problem(cfg, 1, dtype, seed=7)
  rng = np.random.default_rng(8)
  rows = lambda: jnp.asarray(rng.standard_normal((70, 64)), dtype)
  model = jaxfuse.DecoderModel(cfg, w, rows(), jnp.ones(64, dtype), None if tied else rows())
  model = jax.device_put(jaxfuse.quantize(model, quantization), device)
  assert model.lm_head.dtype == model.layers.wq.dtype and model.lm_head_scale.shape == (70,)
  cache = jaxfuse.init_cache(model, 3, 16)
  tokens, positions = jnp.asarray([3, 69, 40], jnp.int32), jnp.asarray([0, 7, 15], jnp.int32)
  got, _ = jax.jit(jaxfuse.decode_step)(model, tokens, positions, cache)
  want, _ = jaxfuse.decode_step(model, tokens, positions, cache, decoder="reference")
  assert rel_err(got, want) < DECODER_TOL[dtype]
  cfg = jaxfuse._decode.generation._cache_config(model, cache)
  _, drawn, _, _ = jax.jit(jaxfuse._decode.generation._model_step, static_argnums=(1, 5))(
      model, cfg, tokens, positions, cache, 0.0, jnp.zeros(2, jnp.uint32))
  np.testing.assert_array_equal(drawn, jnp.argmax(got, -1))


def test_every_fp8_code_of_a_head(device):
  """A head whose row v holds fp8 code v at one column (all 254 finite codes; scales 1): each
  logit is one input times one code's value, in the kernel's widening as in XLA's; one that
  flushes subnormals (the CPU's denormals-are-zero mode) would write zeros for 14 of them."""
  cfg = DecoderConfig(1, 64, 4, 2, 16, 64, 8)
  _, w, _ = random_decoder_problem(cfg, 1, jnp.float32, seed=9)
  rng = np.random.default_rng(9)
  codes = np.setdiff1d(np.arange(256, dtype=np.uint8), [0x7f, 0xff])
  rows = np.zeros((codes.size, 64), np.uint8)
  rows[np.arange(codes.size), np.arange(codes.size) % 64] = codes
  model = jaxfuse.DecoderModel(cfg, w, jnp.asarray(rng.standard_normal((codes.size, 64)),
                                                   jnp.float32), jnp.ones(64, jnp.float32))
  model = jaxfuse.quantize(model, "fp8", head=False)
  model = dataclasses.replace(model, lm_head=jnp.asarray(rows.view(jnp.float8_e4m3fn)),
                              lm_head_scale=jnp.ones(codes.size, jnp.float32))
  model = jax.device_put(model, device)
  cache = jaxfuse.init_cache(model, 2, 8)
  tokens, positions = jnp.asarray([5, 200], jnp.int32), jnp.asarray([0, 3], jnp.int32)
  got, _ = jax.jit(jaxfuse.decode_step)(model, tokens, positions, cache)
  want, _ = jaxfuse.decode_step(model, tokens, positions, cache, decoder="reference")
  subnormal = (codes & 0x78) == 0
  assert np.all(f32(want)[:, subnormal & (codes & 7 != 0)] != 0)
  np.testing.assert_allclose(f32(got), f32(want), rtol=1e-4, atol=0)


# ---- errors -------------------------------------------------------------------------------------

def test_bad_quantized_operands():
  # bf16 activations: a bf16 scale (of x's dtype) is refused all the same.
  cfg, x, pos, w, cache = small_decoder_problem(jax.devices("cpu")[0], "int8", jnp.bfloat16)
  with pytest.raises(TypeError, match=r"wq has dtype bfloat16, expected int8 "
                                      r"\(cfg.quantization='int8'\)"):
    persistent_decoder(x, pos, w._replace(wq=w.wq.astype(jnp.bfloat16)), cache, cfg)
  fp8 = dataclasses.replace(cfg, quantization="fp8")
  with pytest.raises(TypeError, match=r"w_up has dtype int8, expected float8_e4m3fn"):
    persistent_decoder(x, pos, w._replace(**{n: getattr(w, n).astype(jnp.float8_e4m3fn)
                                             for n in MATRICES if n != "w_up"}), cache, fp8)
  with pytest.raises(TypeError, match=r"wo_scale has dtype bfloat16, expected float32 "
                                      r"\(quantization scales are float32\)"):
    persistent_decoder(x, pos, w._replace(wo_scale=w.wo_scale.astype(jnp.bfloat16)), cache, cfg)
  for fn in (persistent_decoder, decoder_reference):
    with pytest.raises(ValueError, match=rf"{fn.__name__}: w.wk_scale is None, but "
                                         r"cfg.quantized is set"):
      fn(x, pos, w._replace(wk_scale=None), cache, cfg)
    plain = dataclasses.replace(cfg, quantization=None)
    with pytest.raises(ValueError, match=rf"{fn.__name__}: w.wq_scale is given, but "
                                         r"cfg.quantized is False"):
      fn(x, pos, w, cache, plain)


def test_bad_quantize_calls():
  with pytest.raises(ValueError, match="quantization must be None, 'int8' or 'fp8', got 'int4'"):
    DecoderConfig(1, 64, 4, 4, 16, 64, 8, quantization="int4")
  cfg = DecoderConfig(2, 64, 4, 2, 16, 96, 16)
  _, w, _ = random_decoder_problem(cfg, 1, jnp.float32, seed=2)
  with pytest.raises(ValueError, match="quantization must be 'int8' or 'fp8', got 'nf4'"):
    jaxfuse.quantize_weights(w, cfg, "nf4")
  wq, qcfg = jaxfuse.quantize_weights(w, cfg, "int8")
  with pytest.raises(ValueError, match=r"already quantized \(cfg.quantization='int8'\)"):
    jaxfuse.quantize_weights(wq, qcfg, "fp8")
  with pytest.raises(ValueError, match=r"w.wo has non-finite values \(layer 1\)"):
    jaxfuse.quantize_weights(w._replace(wo=w.wo.at[1, 3, 4].set(jnp.nan)), cfg, "int8")
  with pytest.raises(ValueError, match=r"w.w_up has shape \(2, 64, 95\), expected \(2, 64, 96\)"):
    jaxfuse.quantize_weights(w._replace(w_up=w.w_up[..., :-1]), cfg, "int8")
  with pytest.raises(TypeError, match="expected a jaxfuse.DecoderModel"):
    jaxfuse.quantize(w, "int8")
  with pytest.raises(ValueError, match="load_hf: quantize must be None, 'int8' or 'fp8'"):
    jaxfuse.load_hf("/nonexistent", quantize="int4")


def test_bad_quantized_heads():
  cfg = DecoderConfig(1, 64, 4, 2, 16, 96, 16)
  _, w, _ = random_decoder_problem(cfg, 1, jnp.bfloat16, seed=2)
  embed = jnp.asarray(np.random.default_rng(2).standard_normal((30, 64)), jnp.bfloat16)
  model = jaxfuse.DecoderModel(cfg, w, embed, jnp.ones(64, jnp.bfloat16))
  q = jaxfuse.quantize(model, "int8")
  step = lambda m: jaxfuse.decode_step(m, jnp.zeros(1, jnp.int32), jnp.zeros(1, jnp.int32),
                                       jaxfuse.init_cache(m, 1, 4))
  for error, message, replaced in [
      (ValueError, "model.lm_head_scale is given but the layers are not quantized",
       dict(config=cfg, layers=w)),
      (ValueError, "model.lm_head_scale is given but model.lm_head is None", dict(lm_head=None)),
      (TypeError, r"model.lm_head has dtype bfloat16, expected int8 \(the quantized head takes "
                  r"the layers' format", dict(lm_head=embed)),
      (ValueError, r"model.lm_head_scale is float32\[29\], expected float32\[30\]",
       dict(lm_head_scale=q.lm_head_scale[1:])),
      (TypeError, r"model.lm_head_scale must be a float32 array \[30\], got list",
       dict(lm_head_scale=[1.0] * 30))]:
    with pytest.raises(error, match=message):
      step(dataclasses.replace(q, **replaced))
  with pytest.raises(ValueError, match="quantize: the model's LM head is already quantized"):
    jaxfuse.quantize(q, "fp8")
  with pytest.raises(ValueError, match=r"quantize: model.embed \(the tied LM head\) has "
                                       r"non-finite values$"):
    jaxfuse.quantize(dataclasses.replace(model, embed=embed.at[4, 2].set(jnp.inf)), "int8")


def test_subnormal_fp8_codes_are_not_flushed(device):
  """Keys made only from subnormal e4m3 codes (|Q| < 2^-6): the attention norm is zero but at one
  input row, whose wk weights are the 16 subnormal codes, so each new key element is that row's
  activation times one code's value. A widening that flushes float subnormals would write zeros."""
  cfg = DecoderConfig(1, 64, 2, 2, 16, 64, 4)
  x, w, cache = random_decoder_problem(cfg, 1, jnp.float32, seed=6)
  w, cfg = jaxfuse.quantize_weights(w, cfg, "fp8")
  codes = np.array([0x01, 0x81, 0x02, 0x82, 0x03, 0x83, 0x04, 0x84,
                    0x05, 0x85, 0x06, 0x86, 0x07, 0x87, 0x07, 0x01], np.uint8)
  wk = np.asarray(w.wk).view(np.uint8).copy()
  wk[0, 5, :16], wk[0, 5, 16:] = codes, codes[::-1]
  w = w._replace(wk=jnp.asarray(wk.view(jnp.float8_e4m3fn)),
                 attn_norm=jnp.zeros_like(w.attn_norm).at[0, 5].set(1.0))
  x, w, cache, pos = jax.device_put((x, w, cache, np.array([2], np.int32)), device)
  got, want = (f32(step(x, pos, w, cache, cfg)[1].k)[0, 0, 2] for step in (fused, reference))
  assert np.all(want != 0)
  np.testing.assert_allclose(got, want, rtol=1e-6)
