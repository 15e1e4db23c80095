"""jaxfuse.prefill's stack (jaxfuse/_decode/prefill.py) against decoder_reference. With
``activation_dtype`` set to the model's dtype, decoder_reference rounds the same values at the
same places as the prefill (matrix and attention inputs, fp32 sums), so the two differ only in
summation order: about sqrt(K) fp32 ulps of the largest output before the final rounding to the
model's dtype, hence at most one ulp of a 16-bit dtype. Against the fp32-activation oracle a
16-bit prefill differs by the rounding of its inputs (2^-8 relative for bf16, compounding over
the layers). The kernel's decode step on a prefilled cache: test_generate.py's
test_decode_step_logits."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxfuse
from jaxfuse._decode import prefill as prefill_module
from jaxfuse._decode.prefill import prefill_stack
from helpers import f32, random_decoder_problem, ulp

FEATURES = {
    "gqa": {},
    "mha_bias_norm": {"num_kv_heads": 4, "qkv_bias": True, "qk_norm": True},
    "llama3_rope": {"rope_scaling": jaxfuse.RopeScaling("llama3", 8.0, 1.0, 4.0, 16)},
    "linear_rope": {"num_kv_heads": 1, "rope_scaling": jaxfuse.RopeScaling("linear", 2.0)},
    "int8_bias_norm": {"quantization": "int8", "qkv_bias": True, "qk_norm": True},
    "fp8": {"quantization": "fp8"},
}
DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]


def config(L=3, **features):
  return jaxfuse.DecoderConfig(**{**dict(num_layers=L, hidden_size=64, num_heads=4,
                                         num_kv_heads=2, head_dim=16, intermediate_size=96,
                                         max_seq_len=20), **features})


def problem(cfg, dtype, B=3, T=11, seed=0):
  _, w, cache = random_decoder_problem(cfg, B, dtype, seed)
  x = jnp.asarray(np.random.default_rng(seed + 1).standard_normal((B, T, cfg.hidden_size)), dtype)
  lengths = np.array([T, 1, T // 2 + 1, T - 2][:B], np.int32)
  return x, jnp.asarray(lengths), w, cache


def reference(x, lengths, w, cache, cfg, activation_dtype):
  T = x.shape[1]
  positions = jnp.asarray(np.where(valid_rows(lengths, T), np.arange(T)[None], -1), jnp.int32)
  return jaxfuse.decoder_reference(x, positions, w, cache, cfg, activation_dtype=activation_dtype)


def valid_rows(lengths, T):
  return np.arange(T)[None] < np.asarray(lengths)[:, None]


run = jax.jit(prefill_stack, static_argnums=4)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("features", FEATURES.values(), ids=FEATURES.keys())
def test_prefill_matches_reference(dtype, features):
  cfg = config(**features)
  x, lengths, w, cache = problem(cfg, dtype)
  h, new = run(x, lengths, w, cache, cfg)
  assert h.dtype == dtype and new.k.dtype == dtype
  valid = valid_rows(lengths, x.shape[1])
  same, same_cache = reference(x, lengths, w, cache, cfg, dtype)
  oracle, _ = reference(x, lengths, w, cache, cfg, None)
  scale = np.abs(f32(oracle)[valid]).max()
  # Summation order (fp32: ~sqrt(K) ulps of the largest term), or a flipped final rounding.
  tol = max(1e-5, 2 * ulp(dtype))
  np.testing.assert_allclose(f32(h)[valid], f32(same)[valid], rtol=0, atol=tol * scale)
  for got, want in ((new.k, same_cache.k), (new.v, same_cache.v)):
    np.testing.assert_allclose(f32(got), f32(want), rtol=0, atol=tol * np.abs(f32(want)).max())
  # Against the fp32-activation oracle: the input roundings, over 3 layers.
  tol = 1e-5 if dtype == jnp.float32 else 8 * ulp(dtype)
  np.testing.assert_allclose(f32(h)[valid], f32(oracle)[valid], rtol=0, atol=tol * scale)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["float32", "bfloat16"])
def test_query_blocks(monkeypatch, dtype):
  """Queries in blocks of 4 (3 blocks for 11 tokens, the last padded) as in one block."""
  cfg = config(**FEATURES["mha_bias_norm"])
  x, lengths, w, cache = problem(cfg, dtype)
  whole, whole_cache = run(x, lengths, w, cache, cfg)
  monkeypatch.setattr(prefill_module, "_QUERY_BLOCK", 4)
  # A function jax has not traced: jit(prefill_stack) again would reuse the unblocked trace.
  blocked, blocked_cache = jax.jit(lambda *a: prefill_stack(*a), static_argnums=4)(
      x, lengths, w, cache, cfg)
  valid = valid_rows(lengths, x.shape[1])
  tol = max(1e-5, 2 * ulp(dtype))
  np.testing.assert_allclose(f32(blocked)[valid], f32(whole)[valid], rtol=0,
                             atol=tol * np.abs(f32(whole)).max())
  np.testing.assert_allclose(f32(blocked_cache.v), f32(whole_cache.v), rtol=0,
                             atol=tol * np.abs(f32(whole_cache.v)).max())


def test_padding_and_later_positions_never_cached():
  cfg = config()
  x, lengths, w, cache = problem(cfg, jnp.bfloat16)
  _, new = prefill_stack(x, lengths, w, cache, cfg)
  T = x.shape[1]
  for got, old in ((new.k, cache.k), (new.v, cache.v)):
    got, old = np.asarray(got.view(jnp.uint16)), np.asarray(old.view(jnp.uint16))
    for b, n in enumerate(np.asarray(lengths)):
      np.testing.assert_array_equal(got[:, b, n:], old[:, b, n:])  # padding and beyond T
      assert not np.array_equal(got[:, b, :n], old[:, b, :n])
  assert T < cache.k.shape[2]


def test_program_does_not_grow_with_depth():
  """One scan over the layers: the same HLO for 2 and 12 layers (but the layer count)."""
  def hlo_ops(L):
    cfg = config(L)
    x, lengths, w, cache = problem(cfg, jnp.bfloat16)
    text = run.lower(x, lengths, w, cache, cfg).as_text()
    return sum(1 for line in text.splitlines() if " = " in line)

  assert hlo_ops(2) == hlo_ops(12)


def test_prefill_validates_layers():
  model_cfg = config()
  _, w, _ = random_decoder_problem(model_cfg, 1, jnp.float32, 0)
  model = jaxfuse.DecoderModel(model_cfg, w, jnp.ones((10, 64)), jnp.ones(64))
  cache = jaxfuse.init_cache(model, 2, 8)
  bad = dataclasses.replace(model, layers=w._replace(wq=w.wq[:, :, :32]))
  with pytest.raises(ValueError, match=r"prefill: wq has shape \(3, 64, 32\), expected"):
    jaxfuse.prefill(bad, np.zeros((2, 4), np.int32), [4, 2], cache)
  half = jaxfuse.KVCache(cache.k.astype(jnp.bfloat16), cache.v.astype(jnp.bfloat16))
  with pytest.raises(TypeError, match=r"prefill: cache.k has dtype bfloat16, expected float32"):
    jaxfuse.prefill(model, np.zeros((2, 4), np.int32), [4, 2], half)
