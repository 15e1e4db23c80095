"""jaxfuse.load_hf on tiny Hugging Face checkpoints: the logits of the loaded model against an
independent NumPy forward pass of the HF tensors (hf_checkpoints.hf_forward), and every way a
checkpoint is refused."""

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxfuse
from hf_checkpoints import (ROPES, hf_forward, hf_rope_inv_freq, read_config, save_tensors,
                            write_checkpoint, write_json)
from helpers import assert_bitwise_equal, reference_logits, rel_err

# Tolerance on max|logits - hf_forward| / max|hf_forward| (float64). fp32: the loader copies
# weights exactly and the decoder computes in fp32, so only summation order and fp32 RoPE tables
# differ (~4e-7 measured). bf16: weights are exact (stored bf16), but the decoder rounds its
# output and the cached k/v to bf16 and the head multiplies bf16 activations (2^-8 = 4e-3 per
# rounding, a few compounding over 2 layers; ~3e-3 measured).
TOL = {"float32": 1e-4, "bfloat16": 2e-2}

TOKENS = np.array([[1, 5, 17, 42, 96, 3], [2, 0, 64, 8, 8, 31]], np.int32)  # B=2, T=6


# ---- loading and logits ------------------------------------------------------------------------

CASES = [  # (arch, rope, dtype, tied, sharded, config_style): each axis covered both ways
    pytest.param("LlamaForCausalLM", "llama3", "float32", False, False, "new", id="llama3.1-fp32"),
    pytest.param("LlamaForCausalLM", "llama3", "bfloat16", True, True, "old",
                 id="llama3.2-bf16-tied-sharded"),
    pytest.param("LlamaForCausalLM", "default", "bfloat16", False, True, "old",
                 id="llama2-bf16-sharded"),
    pytest.param("LlamaForCausalLM", "linear", "float32", True, False, "old",
                 id="llama-linear-fp32-tied"),
    pytest.param("MistralForCausalLM", "default", "float32", False, True, "new",
                 id="mistral-fp32-sharded"),
    pytest.param("Qwen2ForCausalLM", "default", "float32", True, False, "old",
                 id="qwen2-fp32-tied"),
    pytest.param("Qwen2ForCausalLM", "default", "bfloat16", False, True, "new",
                 id="qwen2-bf16-sharded"),
    pytest.param("Qwen3ForCausalLM", "default", "float32", False, True, "old",
                 id="qwen3-fp32-sharded"),
    pytest.param("Qwen3ForCausalLM", "default", "bfloat16", True, False, "new",
                 id="qwen3-bf16-tied"),
]


@pytest.mark.parametrize("arch, rope, dtype, tied, sharded, config_style", CASES)
def test_logits_match_hf(tmp_path, arch, rope, dtype, tied, sharded, config_style):
  tensors = write_checkpoint(tmp_path, arch, dtype=dtype, tied=tied, sharded=sharded, rope=rope,
                             config_style=config_style)
  hf_config = read_config(tmp_path)
  model = jaxfuse.load_hf(tmp_path)

  config = model.config
  qwen2, qwen3 = arch == "Qwen2ForCausalLM", arch == "Qwen3ForCausalLM"
  assert (config.num_layers, config.hidden_size, config.num_heads, config.num_kv_heads,
          config.head_dim, config.intermediate_size, config.max_seq_len) == (
              2, 64, 4, 2, 32 if qwen3 else 16, 96, 128)
  assert (config.rms_norm_eps, config.rope_theta) == (1e-6, ROPES[rope][0])
  assert (config.qkv_bias, config.qk_norm) == (qwen2, qwen3)
  scaling = ROPES[rope][1]
  assert (config.rope_scaling is None) == (scaling is None)
  if scaling is not None:
    assert dataclasses.asdict(config.rope_scaling).items() >= scaling.items()
  assert model.dtype == jnp.dtype(dtype) and model.tied == tied and model.stop_tokens == (2,)
  assert model.embed.shape == (97, 64) and model.final_norm.shape == (64,)
  assert model.lm_head is None if tied else model.lm_head.shape == (97, 64)
  shapes = config.weight_shapes()
  for field, value in model.layers._asdict().items():
    if field in shapes:
      assert value.shape == shapes[field] and value.dtype == jnp.dtype(dtype), field
    else:
      assert value is None, field
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
  tensors = write_checkpoint(tmp_path, "Qwen2ForCausalLM", dtype="bfloat16")
  model = jaxfuse.load_hf(tmp_path, dtype=jnp.float32)
  assert all(a.dtype == jnp.float32 for a in jax.tree.leaves(model))
  np.testing.assert_array_equal(np.asarray(model.layers.q_bias[0]),  # bf16 -> fp32 is exact
                                tensors["model.layers.0.self_attn.q_proj.bias"].astype(np.float32))
  for name in ("bfloat16", "float16"):
    converted = jaxfuse.load_hf(tmp_path, dtype=name)
    assert all(a.dtype == jnp.dtype(name) for a in jax.tree.leaves(converted))


def test_mixed_dtypes_follow_config_torch_dtype(tmp_path):
  tensors = write_checkpoint(tmp_path, "LlamaForCausalLM", dtype="bfloat16")
  tensors["model.norm.weight"] = tensors["model.norm.weight"].astype(np.float32)
  save_tensors(tmp_path, tensors)
  assert jaxfuse.load_hf(tmp_path).dtype == jnp.bfloat16  # config.json torch_dtype
  edit_config(tmp_path, torch_dtype=None)
  with pytest.raises(ValueError, match=r"several dtypes \(BF16, F32\).*pass dtype="):
    jaxfuse.load_hf(tmp_path)
  assert jaxfuse.load_hf(tmp_path, dtype="float32").final_norm.dtype == jnp.float32


def test_max_seq_len_caps_max_position_embeddings(tmp_path):
  write_checkpoint(tmp_path, "LlamaForCausalLM")
  assert jaxfuse.load_hf(tmp_path, max_seq_len=40).config.max_seq_len == 40
  assert jaxfuse.load_hf(tmp_path, max_seq_len=1000).config.max_seq_len == 128
  with pytest.raises(ValueError, match="max_seq_len must be a positive integer"):
    jaxfuse.load_hf(tmp_path, max_seq_len=0)


def test_ignored_tensors(tmp_path):
  """Old Llama checkpoints' rotary inv_freq buffers, and a tied checkpoint's own lm_head (tied
  means the embedding, as in transformers), are not errors, and their dtype does not count."""
  tensors = write_checkpoint(tmp_path, "LlamaForCausalLM", dtype="bfloat16", tied=True)
  tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = np.ones(8, np.float32)
  tensors["lm_head.weight"] = np.zeros((97, 64), np.float32)
  save_tensors(tmp_path, tensors)
  edit_config(tmp_path, torch_dtype=None)
  model = jaxfuse.load_hf(tmp_path)
  assert model.lm_head is None and model.dtype == jnp.bfloat16


# ---- stop tokens -------------------------------------------------------------------------------

# An int eos_token_id in config.json (the checkpoints' 2): test_logits_match_hf checks it.
@pytest.mark.parametrize("config_eos, generation, want", [
    ([7, 9], None, (7, 9)),
    (None, None, ()),
    (2, {"eos_token_id": [2, 5]}, (2, 5)),
    (2, {"eos_token_id": 6}, (6,)),
    (2, {"bos_token_id": 1}, (2,)),  # no eos there: config.json's
], ids=["config-list", "config-null", "generation-list", "generation-int",
        "generation-without-eos"])
def test_stop_tokens(tmp_path, config_eos, generation, want):
  write_checkpoint(tmp_path, "Qwen3ForCausalLM", eos_token_id=config_eos)
  if generation is not None:
    write_json(tmp_path / "generation_config.json", generation)
  assert jaxfuse.load_hf(tmp_path).stop_tokens == want


def test_bad_stop_token(tmp_path):
  write_checkpoint(tmp_path, "LlamaForCausalLM", eos_token_id="</s>")
  with pytest.raises(ValueError, match="config.json eos_token_id='</s>' must be a token id"):
    jaxfuse.load_hf(tmp_path)


# ---- refused checkpoints -----------------------------------------------------------------------

def edit_config(directory, **changes):
  """Sets (or, with None, removes) config.json fields."""
  config = read_config(directory)
  config.update(changes)
  write_json(os.path.join(directory, "config.json"),
             {k: v for k, v in config.items() if v is not None or k not in changes})


def unsupported(arch, overrides, message, test_id):
  return pytest.param(arch, overrides, message, id=test_id)


UNSUPPORTED = [  # (arch, config.json overrides, message)
    unsupported("LlamaForCausalLM", dict(rope_scaling=dict(
        rope_type="yarn", factor=4.0, original_max_position_embeddings=32)),
        r"rope_scaling.rope_type='yarn' is not supported.*default, linear, llama3", "yarn"),
    unsupported("LlamaForCausalLM", dict(rope_scaling=dict(type="dynamic", factor=2.0)),
                r"rope_scaling.rope_type='dynamic' is not supported", "dynamic-old-type-key"),
    unsupported("Qwen2ForCausalLM", dict(rope_parameters=dict(rope_type="longrope",
                                                              rope_theta=1e4)),
                r"rope_parameters.rope_type='longrope' is not supported", "longrope-new-keys"),
    unsupported("LlamaForCausalLM", dict(rope_scaling=dict(rope_type="linear", factor=2.0,
                                                           beta_fast=32)),
                r"rope_scaling has keys \['beta_fast'\] that RoPE type 'linear' does not read",
                "unknown-rope-key"),
    unsupported("LlamaForCausalLM", dict(rope_scaling=dict(rope_type="llama3", factor=8.0)),
                r"rope_scaling \(RoPE type 'llama3'\) lacks \['low_freq_factor'", "llama3-keys"),
    unsupported("LlamaForCausalLM", dict(rope_scaling=dict(rope_type="linear", type="dynamic",
                                                           factor=2.0)),
                r"rope_type='linear' but type='dynamic'", "rope_type-vs-type"),
    unsupported("LlamaForCausalLM", dict(rope_parameters=dict(rope_type="default", rope_theta=1e4),
                                         rope_scaling=dict(rope_type="linear", factor=2.0)),
                r"rope_parameters and rope_scaling disagree on 'rope_type'", "two-rope-dicts"),
    unsupported("MistralForCausalLM", dict(partial_rotary_factor=0.5),
                r"partial_rotary_factor=0.5 is not supported", "partial-rotary"),
    unsupported("Qwen3ForCausalLM", dict(rope_parameters=dict(
        rope_type="default", rope_theta=1e4, partial_rotary_factor=0.25)),
        r"partial_rotary_factor=0.25 is not supported", "partial-rotary-in-rope_parameters"),
    unsupported("MistralForCausalLM", dict(hidden_act="gelu"),
                r"hidden_act='gelu' is not supported", "gelu"),
    unsupported("LlamaForCausalLM", dict(attention_bias=True),
                r"attention_bias=True is not supported: .*o_proj bias", "llama-attention_bias"),
    unsupported("MistralForCausalLM", dict(attention_bias=True), r"attention_bias=True",
                "mistral-attention_bias"),
    unsupported("Qwen3ForCausalLM", dict(attention_bias=True), r"attention_bias=True",
                "qwen3-attention_bias"),
    unsupported("LlamaForCausalLM", dict(mlp_bias=True), r"mlp_bias=True is not supported",
                "mlp_bias"),
    unsupported("Qwen2ForCausalLM", dict(quantization_config=dict(quant_method="awq", bits=4)),
                r"quantization_config=.* is not supported", "quantized"),
    unsupported("Qwen3ForCausalLM", dict(layer_types=["full_attention", "linear_attention"]),
                r"layer_types=.*'linear_attention' layers", "linear_attention-layers"),
    unsupported("Qwen3ForCausalLM", dict(layer_types=["full_attention", "sliding_attention"]),
                r"layer_types=.*need a sliding_window", "sliding-layers-without-window"),
]


@pytest.mark.parametrize("arch, overrides, message", UNSUPPORTED)
def test_unsupported_config(tmp_path, arch, overrides, message):
  write_checkpoint(tmp_path, arch, **overrides)
  with pytest.raises(ValueError, match=message):
    jaxfuse.load_hf(tmp_path)


@pytest.mark.parametrize("architectures, message", [
    (["GPT2LMHeadModel"], r"architecture 'GPT2LMHeadModel' is not supported; supported: "
     r"LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM"),
    ([], r'config.json names no architecture \("architectures"\); supported: LlamaForCausalLM'),
    (None, r"names no architecture"),
], ids=["gpt2", "empty-list", "absent"])
def test_unknown_architecture(tmp_path, architectures, message):
  write_checkpoint(tmp_path, "LlamaForCausalLM")
  edit_config(tmp_path, architectures=architectures)
  with pytest.raises(ValueError, match=message):
    jaxfuse.load_hf(tmp_path)


def test_attention_bias_is_ignored_by_qwen2(tmp_path):
  """Qwen2's q/k/v biases are unconditional and its o_proj has none, whatever attention_bias
  says (transformers' Qwen2Attention does not read it)."""
  write_checkpoint(tmp_path, "Qwen2ForCausalLM", attention_bias=True)
  assert jaxfuse.load_hf(tmp_path).config.qkv_bias


SLIDING = [  # (arch, config overrides, window, the field named)
    ("MistralForCausalLM", dict(sliding_window=32), 32, "sliding_window"),
    ("Qwen2ForCausalLM", dict(use_sliding_window=True, sliding_window=64), 64,
     "use_sliding_window"),
    ("Qwen3ForCausalLM", dict(layer_types=["full_attention", "sliding_attention"],
                              sliding_window=48), 48, "layer_types"),
]


@pytest.mark.parametrize("arch, overrides, window, field", SLIDING,
                         ids=[arch for arch, *_ in SLIDING])
def test_sliding_window(tmp_path, arch, overrides, window, field):
  write_checkpoint(tmp_path, arch, **overrides)
  with pytest.raises(ValueError, match=rf"{field}=.*sliding-window attention \(window {window}\).*"
                     rf"pass max_seq_len <= {window} \(now 128\): within the window, attention is "
                     "full attention"):
    jaxfuse.load_hf(tmp_path)
  assert jaxfuse.load_hf(tmp_path, max_seq_len=window).config.max_seq_len == window
  assert jaxfuse.load_hf(tmp_path, max_seq_len=window // 2).config.max_seq_len == window // 2
  with pytest.raises(ValueError, match="sliding-window"):
    jaxfuse.load_hf(tmp_path, max_seq_len=window + 1)


def test_sliding_window_off_or_longer_than_the_model(tmp_path):
  write_checkpoint(tmp_path / "a", "Qwen2ForCausalLM", use_sliding_window=False, sliding_window=8)
  write_checkpoint(tmp_path / "b", "MistralForCausalLM", sliding_window=128)
  write_checkpoint(tmp_path / "c", "Qwen3ForCausalLM", use_sliding_window=True, sliding_window=None)
  for name in "abc":
    assert jaxfuse.load_hf(tmp_path / name).config.max_seq_len == 128


def drop(tensors, name):
  return {k: v for k, v in tensors.items() if k != name}


def replace(name, value):
  return lambda tensors: {**tensors, name: value(tensors[name]) if callable(value) else value}


TENSOR_ERRORS = [  # (arch, tied, edit of the tensors, message)
    pytest.param("LlamaForCausalLM", False,
                 lambda t: drop(t, "model.layers.1.mlp.up_proj.weight"),
                 r"the checkpoint lacks model.layers.1.mlp.up_proj.weight \(1 tensors that a "
                 "LlamaForCausalLM", id="missing-matrix"),
    pytest.param("Qwen2ForCausalLM", False,
                 lambda t: drop(t, "model.layers.0.self_attn.v_proj.bias"),
                 r"lacks model.layers.0.self_attn.v_proj.bias", id="missing-qwen2-bias"),
    pytest.param("Qwen3ForCausalLM", False,
                 lambda t: drop(t, "model.layers.1.self_attn.k_norm.weight"),
                 r"lacks model.layers.1.self_attn.k_norm.weight", id="missing-qwen3-norm"),
    pytest.param("LlamaForCausalLM", False, lambda t: drop(t, "lm_head.weight"),
                 r"lacks lm_head.weight", id="missing-untied-head"),
    pytest.param("LlamaForCausalLM", False,
                 replace("model.layers.0.self_attn.k_proj.weight", lambda w: w.T.copy()),
                 r"tensor model.layers.0.self_attn.k_proj.weight has shape \(64, 32\), expected "
                 r"\(32, 64\)", id="transposed-matrix"),
    pytest.param("Qwen3ForCausalLM", False,
                 replace("model.layers.1.self_attn.q_norm.weight", np.ones(16, np.float32)),
                 r"model.layers.1.self_attn.q_norm.weight has shape \(16,\), expected \(32,\)",
                 id="wrong-head_dim-norm"),
    pytest.param("LlamaForCausalLM", False,
                 replace("model.layers.0.self_attn.o_proj.bias", np.zeros(64, np.float32)),
                 r"holds model.layers.0.self_attn.o_proj.bias, which a LlamaForCausalLM with this "
                 "config.json does not have", id="o_proj-bias"),
    pytest.param("Qwen2ForCausalLM", True,
                 replace("model.layers.1.mlp.gate_proj.bias", np.zeros(96, np.float32)),
                 r"holds model.layers.1.mlp.gate_proj.bias", id="mlp-bias"),
    pytest.param("LlamaForCausalLM", False,
                 replace("model.layers.0.self_attn.q_norm.weight", np.ones(16, np.float32)),
                 r"holds model.layers.0.self_attn.q_norm.weight", id="qk-norm-in-llama"),
    pytest.param("MistralForCausalLM", False,
                 replace("model.norm.weight", np.ones(64, np.int32)),
                 r"model.norm.weight has dtype I32, expected a floating point dtype",
                 id="integer-tensor"),
]


@pytest.mark.parametrize("arch, tied, edit, message", TENSOR_ERRORS)
def test_tensor_errors(tmp_path, arch, tied, edit, message):
  tensors = write_checkpoint(tmp_path, arch, tied=tied)
  save_tensors(tmp_path, edit(tensors))
  with pytest.raises(ValueError, match=message):
    jaxfuse.load_hf(tmp_path)


def test_vocab_size_must_match_the_embedding(tmp_path):
  write_checkpoint(tmp_path, "Qwen2ForCausalLM", tied=True)
  edit_config(tmp_path, vocab_size=100)
  with pytest.raises(ValueError, match=r"model.embed_tokens.weight has shape \(97, 64\), expected "
                     r"\(100, 64\) \(from config.json\)"):
    jaxfuse.load_hf(tmp_path)


def test_missing_config_field(tmp_path):
  write_checkpoint(tmp_path, "LlamaForCausalLM")
  edit_config(tmp_path, intermediate_size=None)
  with pytest.raises(ValueError, match="config.json lacks intermediate_size"):
    jaxfuse.load_hf(tmp_path)


def test_missing_files(tmp_path):
  with pytest.raises(FileNotFoundError, match="is not a folder"):
    jaxfuse.load_hf(tmp_path / "nowhere")
  with pytest.raises(FileNotFoundError, match=r"config.json is missing"):
    jaxfuse.load_hf(tmp_path)
  write_checkpoint(tmp_path, "LlamaForCausalLM")
  os.remove(tmp_path / "model.safetensors")
  with pytest.raises(FileNotFoundError, match=r"neither model.safetensors nor "
                     r"model.safetensors.index.json$"):
    jaxfuse.load_hf(tmp_path)
  (tmp_path / "pytorch_model.bin").write_bytes(b"")
  with pytest.raises(FileNotFoundError, match=r"only pytorch_model.bin: save the model with "
                     "safetensors"):
    jaxfuse.load_hf(tmp_path)


def test_sharded_index_errors(tmp_path):
  write_checkpoint(tmp_path, "MistralForCausalLM", sharded=True)
  index_path = tmp_path / "model.safetensors.index.json"
  index = json.loads(index_path.read_text())
  shard_1, shard_2 = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"
  name = next(n for n, shard in index["weight_map"].items() if shard == shard_1)
  moved = {**index, "weight_map": {**index["weight_map"], name: shard_2}}
  write_json(index_path, moved)
  with pytest.raises(ValueError, match=rf"index.json puts {name} in {shard_2}, which does not "
                     "hold it"):
    jaxfuse.load_hf(tmp_path)
  write_json(index_path, index)
  os.remove(tmp_path / shard_2)
  with pytest.raises(FileNotFoundError, match=rf"shard {shard_2}, listed in "
                     "model.safetensors.index.json, is missing"):
    jaxfuse.load_hf(tmp_path)


@pytest.mark.parametrize("dtype", ["int8", "float64", np.int32, "not-a-dtype"])
def test_bad_dtype_argument(tmp_path, dtype):
  write_checkpoint(tmp_path, "LlamaForCausalLM")
  with pytest.raises(ValueError, match=r"dtype .* is not a supported model dtype \(float32, "
                     r"bfloat16 or float16\)"):
    jaxfuse.load_hf(tmp_path, dtype=dtype)


def test_float64_checkpoint_needs_a_dtype(tmp_path):
  tensors = write_checkpoint(tmp_path, "LlamaForCausalLM")
  save_tensors(tmp_path, {k: v.astype(np.float64) for k, v in tensors.items()})
  with pytest.raises(ValueError, match=r"the checkpoint's dtype 'float64' is not a supported "
                     r"model dtype \(float32, bfloat16 or float16\); pass dtype= to convert"):
    jaxfuse.load_hf(tmp_path)
  assert jaxfuse.load_hf(tmp_path, dtype="float32").dtype == jnp.float32


# ---- quantized (jaxfuse.quantize, load_hf(quantize=)) against unquantized ----------------------

def teacher_forced_logits(model, tokens):
  """fp32 logits [B, T, V] after each prefix of ``tokens`` [B, T], one decode_step per token."""
  B, T = tokens.shape

  @jax.jit
  def run(model, tokens):
    def step(cache, t):
      logits, cache = jaxfuse.decode_step(model, tokens[:, t], jnp.full((B,), t, jnp.int32),
                                          cache)
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
@pytest.mark.parametrize("arch,dtype", [("LlamaForCausalLM", "float32"),
                                        ("Qwen2ForCausalLM", "float32"),
                                        ("Qwen3ForCausalLM", "bfloat16")])
def test_hf_model_logits_close_to_unquantized(tmp_path, arch, dtype, quantization):
  write_checkpoint(tmp_path, arch, dtype=dtype, seed=4)
  model = jaxfuse.load_hf(tmp_path)
  quantized = jaxfuse.load_hf(tmp_path, quantize=quantization)
  direct = jaxfuse.quantize(model, quantization)
  assert_bitwise_equal(quantized, direct, "load_hf(quantize=) against jaxfuse.quantize")
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
