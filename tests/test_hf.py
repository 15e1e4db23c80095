"""jaxfuse.load_hf on tiny Hugging Face checkpoints: the logits of the loaded model against an
independent NumPy forward pass of the HF tensors (hf_checkpoints.hf_forward), and every way a
checkpoint is refused."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxfuse
from hf_checkpoints import (ARCHITECTURES, ROPES, hf_forward, hf_rope_inv_freq, read_config,
                            save_tensors, write_checkpoint, write_json)
from helpers import assert_bitwise_equal, reference_logits, rel_err

# Tolerance on max|logits - hf_forward| / max|hf_forward| (float64). fp32: the loader copies
# weights exactly and the decoder computes in fp32, so only summation order and fp32 RoPE tables
# differ (~4e-7 measured). bf16: weights are exact (stored bf16), but the decoder rounds its
# output and the cached k/v to bf16 and the head multiplies bf16 activations (2^-8 = 4e-3 per
# rounding, a few compounding over 2 layers; ~3e-3 measured).
TOL = {"float32": 1e-4, "bfloat16": 2e-2}

TOKENS = np.array([[1, 5, 17, 42, 96, 3], [2, 0, 64, 8, 8, 31]], np.int32)  # B=2, T=6
LLAMA, MISTRAL, QWEN2, QWEN3 = ARCHITECTURES


def refused(directory, message, error=ValueError, **kwargs):
  """load_hf(directory, **kwargs) raises `error` matching `message`."""
  with pytest.raises(error, match=message):
    jaxfuse.load_hf(directory, **kwargs)


# ---- loading and logits ------------------------------------------------------------------------

CASES = {  # (arch, rope, dtype, tied, sharded, config_style): each axis covered both ways
    "llama3.1-fp32": (LLAMA, "llama3", "float32", False, False, "new"),
    "llama3.2-bf16-tied-sharded": (LLAMA, "llama3", "bfloat16", True, True, "old"),
    "llama2-bf16-sharded": (LLAMA, "default", "bfloat16", False, True, "old"),
    "llama-linear-fp32-tied": (LLAMA, "linear", "float32", True, False, "old"),
    "mistral-fp32-sharded": (MISTRAL, "default", "float32", False, True, "new"),
    "qwen2-fp32-tied": (QWEN2, "default", "float32", True, False, "old"),
    "qwen2-bf16-sharded": (QWEN2, "default", "bfloat16", False, True, "new"),
    "qwen3-fp32-sharded": (QWEN3, "default", "float32", False, True, "old"),
    "qwen3-bf16-tied": (QWEN3, "default", "bfloat16", True, False, "new"),
}


@pytest.mark.parametrize("arch, rope, dtype, tied, sharded, config_style", CASES.values(),
                         ids=CASES)
def test_logits_match_hf(tmp_path, arch, rope, dtype, tied, sharded, config_style):
  tensors = write_checkpoint(tmp_path, arch, dtype=dtype, tied=tied, sharded=sharded, rope=rope,
                             config_style=config_style)
  hf_config = read_config(tmp_path)
  model = jaxfuse.load_hf(tmp_path)

  config = model.config
  theta, scaling = ROPES[rope]
  assert config == jaxfuse.DecoderConfig(
      2, 64, 4, 2, 32 if arch == QWEN3 else 16, 96, 128, rms_norm_eps=1e-6, rope_theta=theta,
      qkv_bias=arch == QWEN2, qk_norm=arch == QWEN3,
      rope_scaling=scaling and jaxfuse.RopeScaling(**scaling))
  assert model.dtype == jnp.dtype(dtype) and model.tied == tied and model.stop_tokens == (2,)
  assert model.embed.shape == (97, 64) and model.final_norm.shape == (64,)
  assert model.lm_head is None if tied else model.lm_head.shape == (97, 64)
  for field, value in model.layers._asdict().items():  # the fields the config uses; others None
    shape = config.weight_shapes().get(field)
    assert value is None if shape is None else (value.shape, value.dtype) == (shape, dtype), field
  # One matrix bit for bit: [out, in] transposed to [in, out], in its layer slot.
  np.testing.assert_array_equal(np.asarray(model.layers.w_down[1]),
                                tensors["model.layers.1.mlp.down_proj.weight"].T)

  want = hf_forward(tensors, hf_config, TOKENS)
  assert rel_err(reference_logits(model, jnp.asarray(TOKENS)), want) < TOL[dtype]
  if scaling is not None:  # a loader ignoring the scaling rule would fail (7e-2 to 0.2 here)
    unscaled = {k: v for k, v in hf_config.items() if k not in ("rope_scaling", "rope_parameters")}
    assert rel_err(hf_forward(tensors, unscaled, TOKENS), want) > 2 * TOL[dtype]


def test_llama3_fixture_covers_all_three_bands():
  """The llama3 checkpoints keep some frequencies, divide some by the factor and interpolate the
  rest, so the logits test sees every branch of the rule."""
  theta, scaling = ROPES["llama3"]
  base = hf_rope_inv_freq({"rope_theta": theta}, 16)
  ratio = base / hf_rope_inv_freq({"rope_scaling": {**scaling, "rope_theta": theta}}, 16)
  kept, divided = np.isclose(ratio, 1.0), np.isclose(ratio, scaling["factor"])
  assert kept.any() and divided.any() and (~kept & ~divided).any()


def test_dtype_argument_converts(tmp_path):
  tensors = write_checkpoint(tmp_path, QWEN2, dtype="bfloat16")
  model = jaxfuse.load_hf(tmp_path, dtype=jnp.float32)
  assert all(a.dtype == jnp.float32 for a in jax.tree.leaves(model))
  np.testing.assert_array_equal(np.asarray(model.layers.q_bias[0]),  # bf16 -> fp32 is exact
                                tensors["model.layers.0.self_attn.q_proj.bias"].astype(np.float32))
  for name in ("bfloat16", "float16"):
    converted = jaxfuse.load_hf(tmp_path, dtype=name)
    assert all(a.dtype == jnp.dtype(name) for a in jax.tree.leaves(converted))


def test_mixed_dtypes_follow_config_torch_dtype(tmp_path):
  tensors = write_checkpoint(tmp_path, LLAMA, dtype="bfloat16")
  tensors["model.norm.weight"] = tensors["model.norm.weight"].astype(np.float32)
  save_tensors(tmp_path, tensors)
  assert jaxfuse.load_hf(tmp_path).dtype == jnp.bfloat16  # config.json torch_dtype
  edit_config(tmp_path, torch_dtype=None)
  refused(tmp_path, r"several dtypes \(BF16, F32\).*pass dtype=")
  assert jaxfuse.load_hf(tmp_path, dtype="float32").final_norm.dtype == jnp.float32


def test_max_seq_len_caps_max_position_embeddings(tmp_path):
  write_checkpoint(tmp_path, LLAMA)
  assert jaxfuse.load_hf(tmp_path, max_seq_len=40).config.max_seq_len == 40
  assert jaxfuse.load_hf(tmp_path, max_seq_len=1000).config.max_seq_len == 128
  refused(tmp_path, "max_seq_len must be a positive integer", max_seq_len=0)


def test_ignored_tensors(tmp_path):
  """Old Llama checkpoints' rotary inv_freq buffers, and a tied checkpoint's own lm_head (tied
  means the embedding, as in transformers), are not errors, and their dtype does not count."""
  tensors = write_checkpoint(tmp_path, LLAMA, dtype="bfloat16", tied=True)
  tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = np.ones(8, np.float32)
  tensors["lm_head.weight"] = np.zeros((97, 64), np.float32)
  save_tensors(tmp_path, tensors)
  edit_config(tmp_path, torch_dtype=None)
  model = jaxfuse.load_hf(tmp_path)
  assert model.lm_head is None and model.dtype == jnp.bfloat16


# ---- stop tokens -------------------------------------------------------------------------------

# An int eos_token_id in config.json (the checkpoints' 2): test_logits_match_hf checks it.
STOP_TOKENS = {  # id: (config.json eos_token_id, generation_config.json, the stop tokens)
    "config-list": ([7, 9], None, (7, 9)),
    "config-null": (None, None, ()),
    "generation-list": (2, {"eos_token_id": [2, 5]}, (2, 5)),
    "generation-int": (2, {"eos_token_id": 6}, (6,)),
    "generation-without-eos": (2, {"bos_token_id": 1}, (2,)),  # no eos there: config.json's
}


@pytest.mark.parametrize("config_eos, generation, want", STOP_TOKENS.values(), ids=STOP_TOKENS)
def test_stop_tokens(tmp_path, config_eos, generation, want):
  write_checkpoint(tmp_path, QWEN3, eos_token_id=config_eos)
  if generation is not None:
    write_json(tmp_path / "generation_config.json", generation)
  assert jaxfuse.load_hf(tmp_path).stop_tokens == want


def test_bad_stop_token(tmp_path):
  write_checkpoint(tmp_path, LLAMA, eos_token_id="</s>")
  refused(tmp_path, "config.json eos_token_id='</s>' must be a token id")


# ---- refused checkpoints -----------------------------------------------------------------------

def edit_config(directory, **changes):
  """Sets (or, with None, removes) config.json fields."""
  config = {**read_config(directory), **changes}
  write_json(os.path.join(directory, "config.json"),
             {k: v for k, v in config.items() if v is not None or k not in changes})


UNSUPPORTED = {  # id: (arch, config.json overrides, message)
    "yarn": (LLAMA, dict(rope_scaling=dict(rope_type="yarn", factor=4.0,
                                          original_max_position_embeddings=32)),
             r"rope_scaling.rope_type='yarn' is not supported.*default, linear, llama3"),
    "dynamic-old-type-key": (LLAMA, dict(rope_scaling=dict(type="dynamic", factor=2.0)),
                             r"rope_scaling.rope_type='dynamic' is not supported"),
    "longrope-new-keys": (QWEN2, dict(rope_parameters=dict(rope_type="longrope", rope_theta=1e4)),
                          r"rope_parameters.rope_type='longrope' is not supported"),
    "unknown-rope-key": (
        LLAMA, dict(rope_scaling=dict(rope_type="linear", factor=2.0, beta_fast=32)),
        r"rope_scaling has keys \['beta_fast'\] that RoPE type 'linear' does not read"),
    "llama3-keys": (LLAMA, dict(rope_scaling=dict(rope_type="llama3", factor=8.0)),
                    r"rope_scaling \(RoPE type 'llama3'\) lacks \['low_freq_factor'"),
    "rope_type-vs-type": (LLAMA, dict(rope_scaling=dict(rope_type="linear", type="dynamic",
                                                        factor=2.0)),
                          r"rope_type='linear' but type='dynamic'"),
    "two-rope-dicts": (LLAMA, dict(rope_parameters=dict(rope_type="default", rope_theta=1e4),
                                   rope_scaling=dict(rope_type="linear", factor=2.0)),
                       r"rope_parameters and rope_scaling disagree on 'rope_type'"),
    "partial-rotary": (MISTRAL, dict(partial_rotary_factor=0.5),
                       r"partial_rotary_factor=0.5 is not supported"),
    "partial-rotary-in-rope_parameters": (QWEN3, dict(rope_parameters=dict(
        rope_type="default", rope_theta=1e4, partial_rotary_factor=0.25)),
        r"partial_rotary_factor=0.25 is not supported"),
    "gelu": (MISTRAL, dict(hidden_act="gelu"), r"hidden_act='gelu' is not supported"),
    "llama-attention_bias": (LLAMA, dict(attention_bias=True),
                             r"attention_bias=True is not supported: .*o_proj bias"),
    "mistral-attention_bias": (MISTRAL, dict(attention_bias=True), r"attention_bias=True"),
    "qwen3-attention_bias": (QWEN3, dict(attention_bias=True), r"attention_bias=True"),
    "mlp_bias": (LLAMA, dict(mlp_bias=True), r"mlp_bias=True is not supported"),
    "quantized": (QWEN2, dict(quantization_config=dict(quant_method="awq", bits=4)),
                  r"quantization_config=.* is not supported"),
    "linear_attention-layers": (QWEN3, dict(layer_types=["full_attention", "linear_attention"]),
                                r"layer_types=.*'linear_attention' layers"),
    "sliding-layers-without-window": (QWEN3, dict(layer_types=["full_attention",
                                                               "sliding_attention"]),
                                      r"layer_types=.*need a sliding_window"),
}


@pytest.mark.parametrize("arch, overrides, message", UNSUPPORTED.values(), ids=UNSUPPORTED)
def test_unsupported_config(tmp_path, arch, overrides, message):
  write_checkpoint(tmp_path, arch, **overrides)
  refused(tmp_path, message)


@pytest.mark.parametrize("architectures, message", [
    (["GPT2LMHeadModel"], r"architecture 'GPT2LMHeadModel' is not supported; supported: "
     r"LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM"),
    ([], r'config.json names no architecture \("architectures"\); supported: LlamaForCausalLM'),
    (None, r"names no architecture"),
], ids=["gpt2", "empty-list", "absent"])
def test_unknown_architecture(tmp_path, architectures, message):
  write_checkpoint(tmp_path, LLAMA)
  edit_config(tmp_path, architectures=architectures)
  refused(tmp_path, message)


def test_attention_bias_is_ignored_by_qwen2(tmp_path):
  """Qwen2's q/k/v biases are unconditional and its o_proj has none, whatever attention_bias
  says (transformers' Qwen2Attention does not read it)."""
  write_checkpoint(tmp_path, QWEN2, attention_bias=True)
  assert jaxfuse.load_hf(tmp_path).config.qkv_bias


SLIDING = [  # (arch, config overrides, window, the field named)
    (MISTRAL, dict(sliding_window=32), 32, "sliding_window"),
    (QWEN2, dict(use_sliding_window=True, sliding_window=64), 64, "use_sliding_window"),
    (QWEN3, dict(layer_types=["full_attention", "sliding_attention"], sliding_window=48), 48,
     "layer_types"),
]


@pytest.mark.parametrize("arch, overrides, window, field", SLIDING,
                         ids=[arch for arch, *_ in SLIDING])
def test_sliding_window(tmp_path, arch, overrides, window, field):
  write_checkpoint(tmp_path, arch, **overrides)
  refused(tmp_path, rf"{field}=.*sliding-window attention \(window {window}\).*pass max_seq_len "
          rf"<= {window} \(now 128\): within the window, attention is full attention")
  assert jaxfuse.load_hf(tmp_path, max_seq_len=window).config.max_seq_len == window
  assert jaxfuse.load_hf(tmp_path, max_seq_len=window // 2).config.max_seq_len == window // 2
  refused(tmp_path, "sliding-window", max_seq_len=window + 1)


def test_sliding_window_off_or_longer_than_the_model(tmp_path):
  write_checkpoint(tmp_path / "a", QWEN2, use_sliding_window=False, sliding_window=8)
  write_checkpoint(tmp_path / "b", MISTRAL, sliding_window=128)
  write_checkpoint(tmp_path / "c", QWEN3, use_sliding_window=True, sliding_window=None)
  for name in "abc":
    assert jaxfuse.load_hf(tmp_path / name).config.max_seq_len == 128


def drop(name):
  return lambda tensors: {k: v for k, v in tensors.items() if k != name}


def replace(name, value):
  return lambda tensors: {**tensors, name: value(tensors[name]) if callable(value) else value}


TENSOR_ERRORS = {  # id: (arch, tied, edit of the tensors, message)
    "missing-matrix": (LLAMA, False, drop("model.layers.1.mlp.up_proj.weight"),
                       r"the checkpoint lacks model.layers.1.mlp.up_proj.weight \(1 tensors that "
                       "a LlamaForCausalLM"),
    "missing-qwen2-bias": (QWEN2, False, drop("model.layers.0.self_attn.v_proj.bias"),
                           r"lacks model.layers.0.self_attn.v_proj.bias"),
    "missing-qwen3-norm": (QWEN3, False, drop("model.layers.1.self_attn.k_norm.weight"),
                           r"lacks model.layers.1.self_attn.k_norm.weight"),
    "missing-untied-head": (LLAMA, False, drop("lm_head.weight"), r"lacks lm_head.weight"),
    "transposed-matrix": (
        LLAMA, False, replace("model.layers.0.self_attn.k_proj.weight", lambda w: w.T.copy()),
        r"tensor model.layers.0.self_attn.k_proj.weight has shape \(64, 32\), expected \(32, 64\)"),
    "wrong-head_dim-norm": (
        QWEN3, False, replace("model.layers.1.self_attn.q_norm.weight", np.ones(16, np.float32)),
        r"model.layers.1.self_attn.q_norm.weight has shape \(16,\), expected \(32,\)"),
    "o_proj-bias": (LLAMA, False, replace("model.layers.0.self_attn.o_proj.bias",
                                          np.zeros(64, np.float32)),
                    r"holds model.layers.0.self_attn.o_proj.bias, which a LlamaForCausalLM with "
                    "this config.json does not have"),
    "mlp-bias": (QWEN2, True, replace("model.layers.1.mlp.gate_proj.bias",
                                      np.zeros(96, np.float32)),
                 r"holds model.layers.1.mlp.gate_proj.bias"),
    "qk-norm-in-llama": (LLAMA, False, replace("model.layers.0.self_attn.q_norm.weight",
                                               np.ones(16, np.float32)),
                         r"holds model.layers.0.self_attn.q_norm.weight"),
    "integer-tensor": (MISTRAL, False, replace("model.norm.weight", np.ones(64, np.int32)),
                       r"model.norm.weight has dtype I32, expected a floating point dtype"),
}


@pytest.mark.parametrize("arch, tied, edit, message", TENSOR_ERRORS.values(), ids=TENSOR_ERRORS)
def test_tensor_errors(tmp_path, arch, tied, edit, message):
  tensors = write_checkpoint(tmp_path, arch, tied=tied)
  save_tensors(tmp_path, edit(tensors))
  refused(tmp_path, message)


def test_vocab_size_must_match_the_embedding(tmp_path):
  write_checkpoint(tmp_path, QWEN2, tied=True)
  edit_config(tmp_path, vocab_size=100)
  refused(tmp_path, r"model.embed_tokens.weight has shape \(97, 64\), expected \(100, 64\) "
          r"\(from config.json\)")


def test_missing_config_field(tmp_path):
  write_checkpoint(tmp_path, LLAMA)
  edit_config(tmp_path, intermediate_size=None)
  refused(tmp_path, "config.json lacks intermediate_size")


def test_missing_files(tmp_path):
  refused(tmp_path / "nowhere", "is not a folder", FileNotFoundError)
  refused(tmp_path, r"config.json is missing", FileNotFoundError)
  write_checkpoint(tmp_path, LLAMA)
  os.remove(tmp_path / "model.safetensors")
  refused(tmp_path, r"neither model.safetensors nor model.safetensors.index.json$",
          FileNotFoundError)
  (tmp_path / "pytorch_model.bin").write_bytes(b"")
  refused(tmp_path, r"only pytorch_model.bin: save the model with safetensors", FileNotFoundError)


def test_sharded_index_errors(tmp_path):
  write_checkpoint(tmp_path, MISTRAL, sharded=True)
  index_path = tmp_path / "model.safetensors.index.json"
  index = json.loads(index_path.read_text())
  shard_1, shard_2 = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"
  name = next(n for n, shard in index["weight_map"].items() if shard == shard_1)
  write_json(index_path, {**index, "weight_map": {**index["weight_map"], name: shard_2}})
  refused(tmp_path, rf"index.json puts {name} in {shard_2}, which does not hold it")
  write_json(index_path, index)
  os.remove(tmp_path / shard_2)
  refused(tmp_path, rf"shard {shard_2}, listed in model.safetensors.index.json, is missing",
          FileNotFoundError)


@pytest.mark.parametrize("dtype", ["int8", "float64", np.int32, "not-a-dtype"])
def test_bad_dtype_argument(tmp_path, dtype):
  write_checkpoint(tmp_path, LLAMA)
  refused(tmp_path, r"dtype .* is not a supported model dtype \(float32, bfloat16 or float16\)",
          dtype=dtype)


def test_float64_checkpoint_needs_a_dtype(tmp_path):
  tensors = write_checkpoint(tmp_path, LLAMA)
  save_tensors(tmp_path, {k: v.astype(np.float64) for k, v in tensors.items()})
  refused(tmp_path, r"the checkpoint's dtype 'float64' is not a supported model dtype \(float32, "
          r"bfloat16 or float16\); pass dtype= to convert")
  assert jaxfuse.load_hf(tmp_path, dtype="float32").dtype == jnp.float32


# ---- quantized (jaxfuse.quantize, load_hf(quantize=)) against unquantized ----------------------

def teacher_forced_logits(model, tokens):
  """fp32 logits [B, T, V] after each prefix of ``tokens`` [B, T], one decode_step per token."""
  B, T = tokens.shape

  @jax.jit
  def run(model, tokens):
    def step(cache, t):
      logits, cache = jaxfuse.decode_step(model, tokens[:, t], jnp.full((B,), t, jnp.int32), cache)
      return cache, logits
    return jax.lax.scan(step, jaxfuse.init_cache(model, B, T), jnp.arange(T))[1].swapaxes(0, 1)

  return np.asarray(run(model, jnp.asarray(tokens, jnp.int32)))


# Logit error relative to the largest |logit|, and top-1 agreement with the unquantized model, on
# the tiny random checkpoints of tests/hf_checkpoints.py (2 layers, D 64). A weight's error is at
# most 1/254 of its column's largest (int8) or 1/16 of itself (fp8: rms about 2^-4 / sqrt(3) =
# 3.6%); over a few matrices in sequence the logits move by a few times that, int8 well under.
# Top-1 agreement is lower than on a trained model: random logits have many near-ties.
LIMITS = {"int8": (0.03, 0.9), "fp8": (0.12, 0.75)}


@pytest.mark.parametrize("quantization", ["int8", "fp8"])
@pytest.mark.parametrize("arch,dtype", [(LLAMA, "float32"), (QWEN2, "float32"),
                                        (QWEN3, "bfloat16")])
def test_hf_model_logits_close_to_unquantized(tmp_path, arch, dtype, quantization):
  write_checkpoint(tmp_path, arch, dtype=dtype, seed=4)
  model = jaxfuse.load_hf(tmp_path)
  quantized = jaxfuse.load_hf(tmp_path, quantize=quantization)
  assert_bitwise_equal(quantized, jaxfuse.quantize(model, quantization),
                       "load_hf(quantize=) against jaxfuse.quantize")
  assert quantized.head_quantized
  if quantization == "fp8":  # (the option, once: it only forwards head=)
    kept = jaxfuse.load_hf(tmp_path, quantize=quantization, quantize_head=False)
    assert not kept.head_quantized and kept.lm_head.dtype == model.lm_head.dtype
  tokens = np.random.default_rng(2).integers(0, model.vocab_size, (4, 24))
  want, got = teacher_forced_logits(model, tokens), teacher_forced_logits(quantized, tokens)
  err = np.abs(got - want).max() / np.abs(want).max()
  agree = np.mean(got.argmax(-1) == want.argmax(-1))
  max_err, min_agree = LIMITS[quantization]
  assert err < max_err and agree >= min_agree, (err, agree)
