"""Tiny random Hugging Face checkpoints for tests (``write_checkpoint``), and ``hf_forward``: the
logits they define, from the transformers modeling code's semantics on the raw HF tensors in
float64 without jaxfuse, so agreeing with it checks the loader's tensor mapping, transposes and
config reading, and the decoder's math, together."""

import json
import os

import ml_dtypes
import numpy as np
from safetensors.numpy import save_file

ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}

# Per architecture, the config.json fields a real checkpoint of it carries beyond the common ones.
_ARCH_CONFIG = {
    "LlamaForCausalLM": dict(model_type="llama", attention_bias=False, mlp_bias=False,
                             pretraining_tp=1),
    "MistralForCausalLM": dict(model_type="mistral", head_dim=16, sliding_window=None),
    "Qwen2ForCausalLM": dict(model_type="qwen2", use_sliding_window=False, sliding_window=4096,
                             max_window_layers=2),
    # heads * head_dim = 128 != hidden_size = 64, as in the real Qwen3 models.
    "Qwen3ForCausalLM": dict(model_type="qwen3", head_dim=32, attention_bias=False,
                             use_sliding_window=False, sliding_window=None, max_window_layers=2),
}

# RoPE: (rope_theta, the rope dict without theta, or None). llama3's original context (64) puts
# head_dim 16's frequencies (wavelengths 6.3, 20, 63, 199, ...) in all three bands of the rule:
# kept (< 64/4), interpolated (16..64) and divided by the factor (> 64).
ROPES = {
    "default": (10000.0, None),
    "llama3": (10000.0, dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                             high_freq_factor=4.0, original_max_position_embeddings=64)),
    "linear": (10000.0, dict(rope_type="linear", factor=4.0)),
}


def make_config(arch, *, dtype="float32", tied=False, rope="default", config_style="old",
                **config_overrides):
  """The config.json dict of a tiny checkpoint (see :func:`write_checkpoint` for the arguments)."""
  assert arch in ARCHITECTURES and config_style in ("old", "new"), (arch, config_style)
  theta, scaling = ROPES[rope]
  config = dict(architectures=[arch], vocab_size=97, hidden_size=64, intermediate_size=96,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                max_position_embeddings=128, rms_norm_eps=1e-6, hidden_act="silu",
                tie_word_embeddings=tied, bos_token_id=1, eos_token_id=2, **_ARCH_CONFIG[arch])
  if config_style == "old":  # transformers 4: rope_theta and rope_scaling (old "type" key)
    if scaling is not None and scaling["rope_type"] == "linear":
      scaling = dict(type="linear", factor=scaling["factor"])
    config.update(rope_theta=theta, rope_scaling=scaling, torch_dtype=dtype)
  else:  # "new", transformers 5: rope_parameters holds theta too
    config.update(rope_parameters={"rope_type": "default", "rope_theta": theta, **(scaling or {})},
                  dtype=dtype)
  config.update(config_overrides)
  return config


def make_tensors(config, *, dtype="float32", seed=0):
  """Random HF tensors for ``config``: norm weights near 1, matrices ~ 1/sqrt(fan_in) ([out, in]),
  biases O(0.5), an N(0, 0.5^2) embedding (tied logits of a few units); an lm_head unless tied.
  Returns {HF name: array}."""
  rng = np.random.default_rng(seed)
  D, I, V = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
  H = config["num_attention_heads"]
  KV = config.get("num_key_value_heads") or H
  hd = config.get("head_dim") or D // H
  arch = config["architectures"][0]

  matrix = lambda out_dim, in_dim: rng.standard_normal((out_dim, in_dim)) / np.sqrt(in_dim)
  norm = lambda dim: 1.0 + 0.1 * rng.standard_normal(dim)
  tensors = {"model.embed_tokens.weight": 0.5 * rng.standard_normal((V, D)),
             "model.norm.weight": norm(D)}
  if not config.get("tie_word_embeddings", False):
    tensors["lm_head.weight"] = matrix(V, D)
  for i in range(config["num_hidden_layers"]):
    p = f"model.layers.{i}."
    tensors.update({
        p + "input_layernorm.weight": norm(D),
        p + "self_attn.q_proj.weight": matrix(H * hd, D),
        p + "self_attn.k_proj.weight": matrix(KV * hd, D),
        p + "self_attn.v_proj.weight": matrix(KV * hd, D),
        p + "self_attn.o_proj.weight": matrix(D, H * hd),
        p + "post_attention_layernorm.weight": norm(D),
        p + "mlp.gate_proj.weight": matrix(I, D),
        p + "mlp.up_proj.weight": matrix(I, D),
        p + "mlp.down_proj.weight": matrix(D, I),
    })
    if arch == "Qwen2ForCausalLM":
      tensors.update({p + f"self_attn.{n}_proj.bias": 0.5 * rng.standard_normal(dim)
                      for n, dim in (("q", H * hd), ("k", KV * hd), ("v", KV * hd))})
    if arch == "Qwen3ForCausalLM":
      tensors.update({p + "self_attn.q_norm.weight": norm(hd),
                      p + "self_attn.k_norm.weight": norm(hd)})
  return {name: t.astype(DTYPES[dtype]) for name, t in tensors.items()}


def save_tensors(directory, tensors, *, sharded=False):
  """Writes ``tensors`` as model.safetensors, or (``sharded``) as two shards with an index, in
  place of any weights written before."""
  for name in os.listdir(directory):
    if name.endswith(".safetensors") or name == "model.safetensors.index.json":
      os.remove(os.path.join(directory, name))
  if not sharded:
    save_file(tensors, os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})
    return
  names = sorted(tensors)
  shards = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
            "model-00002-of-00002.safetensors": names[len(names) // 2:]}
  for shard, shard_names in shards.items():
    save_file({n: tensors[n] for n in shard_names}, os.path.join(directory, shard),
              metadata={"format": "pt"})
  index = {"metadata": {"total_size": int(sum(t.nbytes for t in tensors.values()))},
           "weight_map": {n: shard for shard, shard_names in shards.items() for n in shard_names}}
  write_json(os.path.join(directory, "model.safetensors.index.json"), index)


def write_json(path, content):
  with open(path, "w", encoding="utf-8") as f:
    json.dump(content, f, indent=2)


def read_config(directory):
  """The config.json dict of a checkpoint folder."""
  with open(os.path.join(directory, "config.json"), encoding="utf-8") as f:
    return json.load(f)


def write_checkpoint(directory, arch, *, dtype="float32", tied=False, sharded=False,
                     rope="default", config_style="old", seed=0, **config_overrides):
  """Writes a tiny random checkpoint of ``arch`` (one of ARCHITECTURES) into ``directory``
  (created if needed); returns its tensors, {HF name: NumPy array in ``dtype``}, ``[out, in]``.

  2 layers, hidden 64, 4 heads, 2 kv heads (head_dim 16; Qwen3: 32, so heads * head_dim !=
  hidden), intermediate 96, vocab 97, max_position_embeddings 128, rms_norm_eps 1e-6; Qwen2 has
  q/k/v biases, Qwen3 per-head q/k norms. ``dtype``: the stored tensors' and config.json's;
  ``tied``: no lm_head.weight; ``sharded``: two shards and an index; ``rope``: a key of ROPES;
  ``config_style``: "old" (transformers 4: rope_theta, rope_scaling with the old "type" key for
  linear, torch_dtype) or "new" (transformers 5: rope_parameters with theta, dtype);
  ``config_overrides``: config.json fields set last (shapes follow them).
  """
  os.makedirs(directory, exist_ok=True)
  config = make_config(arch, dtype=dtype, tied=tied, rope=rope, config_style=config_style,
                       **config_overrides)
  tensors = make_tensors(config, dtype=dtype, seed=seed)
  write_json(os.path.join(directory, "config.json"), config)
  save_tensors(directory, tensors, sharded=sharded)
  return tensors


# ---- the forward pass, from the transformers modeling code (LlamaForCausalLM and friends) --------

def hf_rope_inv_freq(config, head_dim):
  """float64 [head_dim / 2]: transformers' RoPE inverse frequencies (default, linear, llama3;
  rope_parameters or the older rope_theta/rope_scaling)."""
  rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
  theta = rope.get("rope_theta", config.get("rope_theta", 10000.0))
  inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
  rope_type = rope.get("rope_type", rope.get("type", "default"))
  if rope_type == "default":
    return inv_freq
  if rope_type == "linear":
    return inv_freq / rope["factor"]
  if rope_type == "llama3":  # _compute_llama3_parameters, step by step
    factor, old_context = rope["factor"], rope["original_max_position_embeddings"]
    low_freq_wavelen = old_context / rope["low_freq_factor"]
    high_freq_wavelen = old_context / rope["high_freq_factor"]
    wavelen = 2 * np.pi / inv_freq
    inv_freq_llama = np.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth_factor = ((old_context / wavelen - rope["low_freq_factor"])
                     / (rope["high_freq_factor"] - rope["low_freq_factor"]))
    smoothed = (1 - smooth_factor) * inv_freq_llama / factor + smooth_factor * inv_freq_llama
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return np.where(is_medium, smoothed, inv_freq_llama)
  raise ValueError(f"hf_rope_inv_freq: rope type {rope_type!r} is not implemented here")


def _rms_norm(x, weight, eps):
  return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * weight


def _rotate_half(x):
  half = x.shape[-1] // 2
  return np.concatenate([-x[..., half:], x[..., :half]], axis=-1)


def hf_forward(tensors, config, tokens):
  """float64 logits [B, T, vocab] of a checkpoint's ``tensors`` (as write_checkpoint returns)
  and ``config`` (config.json's dict) over int ``tokens`` [B, T], causal from position 0 as
  transformers computes it: ``x @ W.T (+ b)``, RMSNorm, Qwen3's per-head q/k RMSNorm before
  RoPE, rotate-half RoPE, grouped-query attention (query head j reads kv head j // (H / KV)),
  SwiGLU MLP, final norm, the lm_head (or the tied embedding). No sliding window: the same for
  prompts no longer than the window."""
  w = lambda name: np.asarray(tensors[name], np.float64)
  linear = lambda x, p: x @ w(p + ".weight").T + (w(p + ".bias") if p + ".bias" in tensors else 0)
  B, T = np.shape(tokens)
  D, H = config["hidden_size"], config["num_attention_heads"]
  KV = config.get("num_key_value_heads") or H
  hd = config.get("head_dim") or D // H
  eps = config["rms_norm_eps"]
  qk_norm = config["architectures"][0] == "Qwen3ForCausalLM"

  angles = np.arange(T, dtype=np.float64)[:, None] * hf_rope_inv_freq(config, hd)[None, :]
  emb = np.concatenate([angles, angles], axis=-1)  # [T, hd]
  cos, sin = np.cos(emb), np.sin(emb)
  causal = np.tril(np.ones((T, T), bool))

  x = w("model.embed_tokens.weight")[tokens]  # [B, T, D]
  for i in range(config["num_hidden_layers"]):
    p = f"model.layers.{i}."
    h = _rms_norm(x, w(p + "input_layernorm.weight"), eps)
    q = linear(h, p + "self_attn.q_proj").reshape(B, T, H, hd)
    k = linear(h, p + "self_attn.k_proj").reshape(B, T, KV, hd)
    v = linear(h, p + "self_attn.v_proj").reshape(B, T, KV, hd)
    if qk_norm:
      q = _rms_norm(q, w(p + "self_attn.q_norm.weight"), eps)
      k = _rms_norm(k, w(p + "self_attn.k_norm.weight"), eps)
    q, k, v = (t.transpose(0, 2, 1, 3) for t in (q, k, v))  # [B, heads, T, hd]
    q, k = (t * cos + _rotate_half(t) * sin for t in (q, k))
    k, v = np.repeat(k, H // KV, axis=1), np.repeat(v, H // KV, axis=1)  # repeat_kv
    scores = np.where(causal, q @ k.transpose(0, 1, 3, 2) / np.sqrt(hd), -np.inf)
    probs = np.exp(scores - scores.max(axis=-1, keepdims=True))
    probs /= probs.sum(axis=-1, keepdims=True)
    attn = (probs @ v).transpose(0, 2, 1, 3).reshape(B, T, H * hd)
    x = x + linear(attn, p + "self_attn.o_proj")
    h = _rms_norm(x, w(p + "post_attention_layernorm.weight"), eps)
    gate = linear(h, p + "mlp.gate_proj")
    swiglu = gate / (1.0 + np.exp(-gate)) * linear(h, p + "mlp.up_proj")
    x = x + linear(swiglu, p + "mlp.down_proj")
  x = _rms_norm(x, w("model.norm.weight"), eps)
  tied = config.get("tie_word_embeddings", False)
  return x @ w("model.embed_tokens.weight" if tied else "lm_head.weight").T
