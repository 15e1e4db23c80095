"""Load a Hugging Face checkpoint folder as a :class:`~jaxfuse.DecoderModel`.

:func:`load_hf` reads ``config.json``, the weights (``model.safetensors``, or the shards a
``model.safetensors.index.json`` lists) and, when present, ``generation_config.json``, for the
architectures the decoder kernels implement exactly:

  LlamaForCausalLM     Llama 2, 3, 3.1, 3.2 (rope_scaling null, "linear" or "llama3")
  MistralForCausalLM   Mistral (no sliding window, or one no shorter than max_seq_len)
  Qwen2ForCausalLM     Qwen2 / Qwen2.5: q/k/v projections with biases
  Qwen3ForCausalLM     Qwen3 (dense): per-head RMSNorm of q and k before RoPE

A config.json field the kernels cannot honour (another RoPE type, partial rotary, another
activation, an o_proj or MLP bias, quantization, a sliding window shorter than the sequence) is an
error naming the field: the loader never returns a silently different model. A config.json field
left out takes the default of the matching ``transformers`` config class.

Matrices are stored by Hugging Face as ``[out, in]`` per layer; they are transposed to the
kernels' ``[in, out]`` and stacked over layers in one preallocated host array per
:class:`~jaxfuse.DecoderWeights` field (converted to the model's dtype as they are copied in), then
put on the default device.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from safetensors import safe_open

from jaxfuse._decode.config import DecoderConfig, DecoderWeights, QUANTIZED_DTYPES, RopeScaling
from jaxfuse._decode.model import DecoderModel
from jaxfuse._decode.quantize import MATRICES  # stored [out, in] by Hugging Face, [in, out] here
from jaxfuse._decode.quantize import quantize as quantize_model

__all__ = ["load_hf"]


@dataclasses.dataclass(frozen=True)
class _Family:
  """How one supported architecture departs from plain Llama, as ``transformers`` defines it.

  Attributes:
    qkv_bias: the q/k/v projections always have a bias (Qwen2).
    qk_norm: q and k are RMSNorm-ed per head before RoPE (Qwen3).
    reads_attention_bias: config.json's ``attention_bias`` gives every attention projection,
      o_proj included, a bias (Llama, Qwen3; refused for Mistral too, whose code ignores it).
    window_switch: the config field that turns on sliding-window attention: "sliding_window"
      (Mistral: a window when not null), "use_sliding_window" (Qwen: a flag), or None (Llama).
    defaults: the config class's defaults that differ between architectures.
  """

  qkv_bias: bool
  qk_norm: bool
  reads_attention_bias: bool
  window_switch: str | None
  defaults: dict[str, Any]


_FAMILIES = {
    "LlamaForCausalLM": _Family(False, False, True, None, dict(max_position_embeddings=2048)),
    "MistralForCausalLM": _Family(False, False, True, "sliding_window",
                                  dict(max_position_embeddings=131072, sliding_window=4096)),
    "Qwen2ForCausalLM": _Family(True, False, False, "use_sliding_window",
                                dict(max_position_embeddings=32768, sliding_window=4096)),
    "Qwen3ForCausalLM": _Family(False, True, True, "use_sliding_window",
                                dict(max_position_embeddings=32768, sliding_window=4096,
                                     head_dim=128)),
}

# The defaults the four config classes share (for fields config.json may leave out).
_COMMON_DEFAULTS = dict(
    num_key_value_heads=None, head_dim=None, rms_norm_eps=1e-6, rope_theta=10000.0,
    rope_scaling=None, rope_parameters=None, partial_rotary_factor=None, hidden_act="silu",
    attention_bias=False, mlp_bias=False, tie_word_embeddings=False, use_sliding_window=False,
    sliding_window=None, layer_types=None, quantization_config=None, eos_token_id=None)

_REQUIRED_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                    "num_attention_heads")

# The keys each supported RoPE type reads (besides rope_type/type, rope_theta and
# partial_rotary_factor, which any rope dict may hold).
_ROPE_KEYS = {
    "default": (),
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
}
_ROPE_COMMON_KEYS = ("rope_type", "type", "rope_theta", "partial_rotary_factor")

# transformers' ACT2FN maps both names to torch.nn.SiLU.
_SILU_NAMES = ("silu", "swish")

# DecoderWeights field -> its tensor in layer i, after "model.layers.{i}.".
_LAYER_TENSORS = {
    "attn_norm": "input_layernorm.weight",
    "wq": "self_attn.q_proj.weight",
    "wk": "self_attn.k_proj.weight",
    "wv": "self_attn.v_proj.weight",
    "wo": "self_attn.o_proj.weight",
    "mlp_norm": "post_attention_layernorm.weight",
    "w_gate": "mlp.gate_proj.weight",
    "w_up": "mlp.up_proj.weight",
    "w_down": "mlp.down_proj.weight",
    "q_bias": "self_attn.q_proj.bias",
    "k_bias": "self_attn.k_proj.bias",
    "v_bias": "self_attn.v_proj.bias",
    "q_norm": "self_attn.q_norm.weight",
    "k_norm": "self_attn.k_norm.weight",
}

_EMBED = "model.embed_tokens.weight"
_FINAL_NORM = "model.norm.weight"
_LM_HEAD = "lm_head.weight"
# Buffers some old Llama checkpoints saved; recomputed from the config, never read.
_IGNORED = re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq")

# BF16 arrives as ml_dtypes' bfloat16 (jnp.bfloat16), which importing jax registers with NumPy.
_SAFETENSORS_FLOATS = {"F16": np.dtype(np.float16), "BF16": np.dtype(jnp.bfloat16),
                       "F32": np.dtype(np.float32), "F64": np.dtype(np.float64)}
_MODEL_DTYPES = (np.dtype(np.float32), np.dtype(jnp.bfloat16), np.dtype(np.float16))


@dataclasses.dataclass(frozen=True)
class _Tensor:
  """One stored tensor: its name, the open safetensors file holding it, its shape and its
  safetensors dtype name ("BF16", "F32", ...), read from the file's header."""

  name: str
  file: Any
  shape: tuple[int, ...]
  dtype: str

  @classmethod
  def of(cls, file, name: str) -> _Tensor:
    header = file.get_slice(name)
    return cls(name, file, tuple(header.get_shape()), header.get_dtype())

  def read(self) -> np.ndarray:
    return self.file.get_tensor(self.name)


def load_hf(path, dtype=None, *, max_seq_len: int | None = None,
            quantize: str | None = None, quantize_head: bool = True) -> DecoderModel:
  """Loads a Hugging Face Llama, Mistral, Qwen2 or Qwen3 checkpoint folder.

  Args:
    path: the folder holding ``config.json`` and ``model.safetensors`` (or the shards listed by
      ``model.safetensors.index.json``); ``generation_config.json`` is read when present.
    dtype: the model's dtype (float32, bfloat16 or float16, as a name or dtype), every weight
      norms included; None keeps the checkpoint's dtype (config.json's ``torch_dtype`` or
      ``dtype`` when the tensors are stored in several).
    max_seq_len: caps the model's ``config.max_seq_len`` (else ``max_position_embeddings``). A
      sliding-window checkpoint loads only when this is at most the window (within it, attention
      is full attention).
    quantize: None, or "int8" / "fp8": the layer stack's matrices quantized per output column
      and the LM head per vocabulary row (:func:`jaxfuse.quantize`; the embedding and the norms
      stay in ``dtype``).
    quantize_head: with ``quantize``, False keeps the LM head in ``dtype``.

  Returns:
    The :class:`~jaxfuse.DecoderModel`, weights on the default device; ``lm_head`` is None when
    config.json ties it to the embedding (unless the head is quantized); ``stop_tokens`` are the
    ``eos_token_id`` of generation_config.json, else of config.json.

  Raises:
    FileNotFoundError: the folder, config.json, the weights or a listed shard is missing.
    ValueError: an unsupported architecture or config.json field (named), a missing, unexpected
      or misshapen tensor (named), or an unusable ``dtype`` or ``max_seq_len``.
  """
  requested_dtype = None if dtype is None else _as_model_dtype(dtype, "dtype")
  if quantize is not None and quantize not in QUANTIZED_DTYPES:
    raise ValueError(f"load_hf: quantize must be None, 'int8' or 'fp8', got {quantize!r}")
  directory = os.fspath(path)
  if not os.path.isdir(directory):
    raise FileNotFoundError(f"load_hf: {directory!r} is not a folder")
  raw = _read_json(os.path.join(directory, "config.json"))
  family, architecture = _family(raw)
  settings = {**_COMMON_DEFAULTS, **family.defaults, **raw}
  config = _decoder_config(settings, family, architecture, max_seq_len)
  tied = bool(settings["tie_word_embeddings"])
  with contextlib.ExitStack() as open_files:
    stored = _open_tensors(directory, open_files)
    expected = _expected_shapes(config, settings["vocab_size"], tied)
    _check_tensors(stored, expected, tied, architecture)
    model_dtype = (_checkpoint_dtype({stored[name].dtype for name in expected}, settings)
                   if requested_dtype is None else requested_dtype)
    model = DecoderModel(
        config=config,
        layers=_load_layers(stored, config, model_dtype),
        embed=_load_tensor(stored[_EMBED], model_dtype),
        final_norm=_load_tensor(stored[_FINAL_NORM], model_dtype),
        lm_head=None if tied else _load_tensor(stored[_LM_HEAD], model_dtype),
        stop_tokens=_stop_tokens(directory, settings))
  return model if quantize is None else quantize_model(model, quantize, head=quantize_head)


# ---- config.json ---------------------------------------------------------------------------------

def _read_json(path: str) -> dict[str, Any]:
  """The JSON object in ``path``.

  Raises:
    FileNotFoundError: no such file.
    ValueError: not a JSON object.
  """
  if not os.path.isfile(path):
    raise FileNotFoundError(f"load_hf: {path} is missing")
  with open(path, encoding="utf-8") as f:
    try:
      content = json.load(f)
    except json.JSONDecodeError as e:
      raise ValueError(f"load_hf: {path} is not valid JSON: {e}") from None
  if not isinstance(content, dict):
    raise ValueError(f"load_hf: {path} does not hold a JSON object")
  return content


def _family(raw: dict[str, Any]) -> tuple[_Family, str]:
  """The supported family of config.json's ``architectures[0]``, and that name.

  Raises:
    ValueError: no architecture, or one not supported.
  """
  architectures = raw.get("architectures")
  if not isinstance(architectures, list) or not architectures:
    raise ValueError("load_hf: config.json names no architecture (\"architectures\"); supported: "
                     f"{', '.join(_FAMILIES)}")
  architecture = architectures[0]
  if architecture not in _FAMILIES:
    raise ValueError(f"load_hf: architecture {architecture!r} is not supported; supported: "
                     f"{', '.join(_FAMILIES)}")
  return _FAMILIES[architecture], architecture


def _unsupported(field: str, value, why: str) -> ValueError:
  return ValueError(f"load_hf: config.json {field}={value!r} is not supported: {why}")


def _decoder_config(settings: dict[str, Any], family: _Family, architecture: str,
                    max_seq_len: int | None) -> DecoderConfig:
  """The :class:`DecoderConfig` of config.json (with defaults filled in), checking that the
  kernels can run exactly that model.

  Raises:
    ValueError: a required field is missing, a field asks for something unsupported, or a value
      is out of range.
  """
  missing = [name for name in _REQUIRED_FIELDS if name not in settings]
  if missing:
    raise ValueError(f"load_hf: config.json lacks {', '.join(missing)}")
  _check_supported(settings, family, architecture)
  rope_theta, rope_scaling = _rope(settings)
  heads = settings["num_attention_heads"]
  kv_heads = settings["num_key_value_heads"]
  head_dim = settings["head_dim"]
  seq_len = _max_seq_len(settings["max_position_embeddings"], max_seq_len)
  _check_sliding_window(settings, family, seq_len)
  try:
    return DecoderConfig(
        num_layers=settings["num_hidden_layers"], hidden_size=settings["hidden_size"],
        num_heads=heads, num_kv_heads=heads if kv_heads is None else kv_heads,
        head_dim=settings["hidden_size"] // heads if head_dim is None else head_dim,
        intermediate_size=settings["intermediate_size"], max_seq_len=seq_len,
        rms_norm_eps=settings["rms_norm_eps"], rope_theta=rope_theta,
        qkv_bias=family.qkv_bias, qk_norm=family.qk_norm, rope_scaling=rope_scaling)
  except (ValueError, TypeError, ZeroDivisionError) as e:
    raise ValueError(f"load_hf: config.json gives an invalid model: {e}") from None


def _check_supported(settings: dict[str, Any], family: _Family, architecture: str) -> None:
  """Raises ValueError naming the first config.json field the kernels cannot honour (RoPE and
  sliding windows are checked by :func:`_rope` and :func:`_check_sliding_window`)."""
  if settings["hidden_act"] not in _SILU_NAMES:
    raise _unsupported("hidden_act", settings["hidden_act"], "the MLP is SwiGLU with silu")
  if family.reads_attention_bias and settings["attention_bias"]:
    raise _unsupported("attention_bias", settings["attention_bias"],
                       f"for {architecture} it adds an o_proj bias, which the kernels lack")
  if settings["mlp_bias"]:
    raise _unsupported("mlp_bias", settings["mlp_bias"], "the kernels' MLP has no biases")
  if settings["quantization_config"] is not None:
    raise _unsupported("quantization_config", settings["quantization_config"],
                       "quantized checkpoints cannot be loaded (use a float one)")
  for layer_type in settings["layer_types"] or ():
    if layer_type not in ("full_attention", "sliding_attention"):
      raise _unsupported("layer_types", settings["layer_types"],
                         f"{layer_type!r} layers (the kernels do full attention)")


def _rope(settings: dict[str, Any]) -> tuple[float, RopeScaling | None]:
  """``(rope_theta, rope_scaling)`` from ``rope_parameters`` (transformers 5) or the older
  ``rope_theta`` and ``rope_scaling``.

  Raises:
    ValueError: a RoPE type other than default/linear/llama3, missing or unknown keys in the rope
      dict, a partial rotary factor other than 1, or rope_parameters and rope_scaling disagreeing.
  """
  rope = _rope_dict(settings)
  field = "rope_parameters" if settings["rope_parameters"] is not None else "rope_scaling"
  if "rope_type" in rope and "type" in rope and rope["rope_type"] != rope["type"]:
    raise ValueError(f"load_hf: config.json {field} has rope_type={rope['rope_type']!r} but "
                     f"type={rope['type']!r}")
  rope_type = rope.get("rope_type", rope.get("type")) or "default"
  if rope_type not in _ROPE_KEYS:
    raise _unsupported(f"{field}.rope_type", rope_type,
                       f"the kernels implement the RoPE types {', '.join(_ROPE_KEYS)}")
  keys = _ROPE_KEYS[rope_type]
  unknown = sorted(set(rope) - set(keys) - set(_ROPE_COMMON_KEYS))
  if unknown:
    raise ValueError(f"load_hf: config.json {field} has keys {unknown} that RoPE type "
                     f"{rope_type!r} does not read (it reads {list(keys)})")
  absent = [key for key in keys if key not in rope]
  if absent:
    raise ValueError(f"load_hf: config.json {field} (RoPE type {rope_type!r}) lacks {absent}")
  partial = rope.get("partial_rotary_factor", settings["partial_rotary_factor"])
  if partial is not None and partial != 1:
    raise _unsupported("partial_rotary_factor", partial, "RoPE rotates the whole head")
  rope_theta = rope.get("rope_theta", settings["rope_theta"])
  if rope_type == "default":
    return rope_theta, None
  try:
    return rope_theta, RopeScaling(rope_type, **{key: rope[key] for key in keys})
  except ValueError as e:
    raise ValueError(f"load_hf: config.json {field}: {e}") from None


def _rope_dict(settings: dict[str, Any]) -> dict[str, Any]:
  """The rope dict in force: ``rope_parameters``, else ``rope_scaling``, else empty.

  Raises:
    ValueError: not a dict, or both given and disagreeing on a key.
  """
  parameters, scaling = settings["rope_parameters"], settings["rope_scaling"]
  for field, value in (("rope_parameters", parameters), ("rope_scaling", scaling)):
    if value is not None and not isinstance(value, dict):
      raise ValueError(f"load_hf: config.json {field} must be an object or null, got {value!r}")
  if parameters is None:
    return scaling or {}
  for key, value in (scaling or {}).items():
    key = "rope_type" if key == "type" else key
    if parameters.get(key) != value:
      raise ValueError(f"load_hf: config.json rope_parameters and rope_scaling disagree on {key!r} "
                       f"({parameters.get(key)!r} vs {value!r})")
  return parameters


def _max_seq_len(max_position_embeddings, cap: int | None) -> int:
  """``max_position_embeddings``, capped by the ``max_seq_len`` argument when given.

  Raises:
    ValueError: the cap is not a positive integer.
  """
  if cap is None:
    return max_position_embeddings
  if isinstance(cap, bool) or not isinstance(cap, (int, np.integer)) or cap < 1:
    raise ValueError(f"load_hf: max_seq_len must be a positive integer or None, got {cap!r}")
  return min(int(cap), max_position_embeddings)


def _check_sliding_window(settings: dict[str, Any], family: _Family, seq_len: int) -> None:
  """Accepts a sliding window only when no sequence can outgrow it (``seq_len <= window``:
  every token then sees every earlier one, as in full attention).

  Raises:
    ValueError: config.json asks for a sliding window shorter than ``seq_len``.
  """
  window = settings["sliding_window"]
  if "sliding_attention" in (settings["layer_types"] or ()):
    field = "layer_types"
    if window is None:
      raise _unsupported(field, settings[field], "sliding_attention layers need a sliding_window")
  elif family.window_switch == "use_sliding_window" and settings["use_sliding_window"]:
    field = "use_sliding_window"  # with sliding_window null, transformers uses full attention
  elif family.window_switch == "sliding_window":
    field = "sliding_window"
  else:
    return
  if window is not None and seq_len > window:
    raise ValueError(
        f"load_hf: config.json {field}={settings[field]!r} asks for sliding-window attention "
        f"(window {window}), which the kernels do not implement; pass max_seq_len <= {window} "
        f"(now {seq_len}): within the window, attention is full attention")


# ---- tensors -----------------------------------------------------------------------------------

def _open_tensors(directory: str, open_files: contextlib.ExitStack) -> dict[str, _Tensor]:
  """Every stored tensor by name: ``model.safetensors``, else the shards of
  ``model.safetensors.index.json`` (each opened once, closed with ``open_files``).

  Raises:
    FileNotFoundError: neither file, or a listed shard, is present.
    ValueError: the index is malformed, or a shard lacks a tensor the index puts in it.
  """
  single = os.path.join(directory, "model.safetensors")
  if os.path.isfile(single):
    file = open_files.enter_context(safe_open(single, framework="np"))
    return {name: _Tensor.of(file, name) for name in file.keys()}
  index_path = os.path.join(directory, "model.safetensors.index.json")
  if not os.path.isfile(index_path):
    others = sorted(f for f in os.listdir(directory) if f.endswith((".bin", ".pt", ".pth")))
    raise FileNotFoundError(
        f"load_hf: {directory} has neither model.safetensors nor model.safetensors.index.json"
        + (f" (only {', '.join(others)}: save the model with safetensors)" if others else ""))
  weight_map = _read_json(index_path).get("weight_map")
  if not isinstance(weight_map, dict):
    raise ValueError(f"load_hf: {index_path} has no weight_map object")
  files, names_in = {}, {}
  for shard in sorted(set(weight_map.values())):
    shard_path = os.path.join(directory, shard)
    if not os.path.isfile(shard_path):
      raise FileNotFoundError(f"load_hf: shard {shard}, listed in model.safetensors.index.json, "
                              f"is missing from {directory}")
    files[shard] = open_files.enter_context(safe_open(shard_path, framework="np"))
    names_in[shard] = set(files[shard].keys())
  tensors = {}
  for name, shard in weight_map.items():
    if name not in names_in[shard]:
      raise ValueError(f"load_hf: model.safetensors.index.json puts {name} in {shard}, which does "
                       "not hold it")
    tensors[name] = _Tensor.of(files[shard], name)
  return tensors


def _layer_tensor(layer: int, field: str) -> str:
  """The Hugging Face name of a :class:`DecoderWeights` field's tensor in one layer."""
  return f"model.layers.{layer}.{_LAYER_TENSORS[field]}"


def _expected_shapes(config: DecoderConfig, vocab_size: int, tied: bool) -> dict[str, tuple]:
  """Every tensor the checkpoint must hold, by Hugging Face name, with its stored shape."""
  expected = {_EMBED: (vocab_size, config.hidden_size), _FINAL_NORM: (config.hidden_size,)}
  if not tied:
    expected[_LM_HEAD] = (vocab_size, config.hidden_size)
  for field, stacked in config.weight_shapes().items():
    shape = stacked[:0:-1] if field in MATRICES else stacked[1:]  # [out, in] for matrices
    expected.update({_layer_tensor(i, field): shape for i in range(config.num_layers)})
  return expected


def _names(names: list[str], most: int = 6) -> str:
  shown = ", ".join(names[:most])
  return shown + (f" and {len(names) - most} more" if len(names) > most else "")


def _check_tensors(stored: dict[str, _Tensor], expected: dict[str, tuple], tied: bool,
                   architecture: str) -> None:
  """Checks that the checkpoint holds exactly the expected tensors, in their shapes, as floats
  (a tied checkpoint's own lm_head.weight and old rotary inv_freq buffers are ignored, as
  transformers does).

  Raises:
    ValueError: a tensor is missing, unexpected, misshapen or not floating point (named).
  """
  missing = [name for name in expected if name not in stored]
  if missing:
    raise ValueError(f"load_hf: the checkpoint lacks {_names(missing)} ({len(missing)} tensors "
                     f"that a {architecture} with this config.json has)")
  unexpected = [name for name in stored if name not in expected and not _IGNORED.fullmatch(name)
                and not (tied and name == _LM_HEAD)]
  if unexpected:
    raise ValueError(f"load_hf: the checkpoint holds {_names(unexpected)}, which a {architecture} "
                     "with this config.json does not have (the kernels cannot run it)")
  for name, shape in expected.items():
    tensor = stored[name]
    if tensor.shape != tuple(shape):
      raise ValueError(f"load_hf: tensor {name} has shape {tensor.shape}, expected {tuple(shape)} "
                       "(from config.json)")
    if tensor.dtype not in _SAFETENSORS_FLOATS:
      raise ValueError(f"load_hf: tensor {name} has dtype {tensor.dtype}, expected a floating "
                       "point dtype")


def _as_model_dtype(dtype, source: str, advice: str = "") -> np.dtype:
  """``dtype`` as float32, bfloat16 or float16; ``source`` and ``advice`` frame the error.

  Raises:
    ValueError: any other dtype, or not a dtype at all.
  """
  try:
    model_dtype = np.dtype(jnp.dtype(dtype))
  except TypeError:
    model_dtype = None
  if model_dtype not in _MODEL_DTYPES:
    raise ValueError(f"load_hf: {source} {dtype!r} is not a supported model dtype (float32, "
                     f"bfloat16 or float16){advice}")
  return model_dtype


def _checkpoint_dtype(stored: set[str], settings: dict[str, Any]) -> np.dtype:
  """The checkpoint's dtype: the one its tensors are stored in (``stored``: safetensors names),
  else config.json's ``torch_dtype`` (``dtype`` in transformers 5) when they are in several.

  Raises:
    ValueError: the dtype is not float32/bfloat16/float16, or cannot be decided.
  """
  if len(stored) == 1:
    return _as_model_dtype(_SAFETENSORS_FLOATS[next(iter(stored))].name, "the checkpoint's dtype",
                           "; pass dtype= to convert")
  declared = settings.get("dtype", settings.get("torch_dtype"))
  if declared is None:
    raise ValueError("load_hf: the tensors are stored in several dtypes "
                     f"({', '.join(sorted(stored))}) and config.json names none (torch_dtype); "
                     "pass dtype=")
  return _as_model_dtype(declared, "config.json torch_dtype", "; pass dtype= to choose")


def _load_layers(stored: dict[str, _Tensor], config: DecoderConfig,
                 dtype: np.dtype) -> DecoderWeights:
  """The stacked layer weights: per field one host array [L, ...] filled layer by layer
  (matrices transposed to [in, out], values converted to ``dtype`` as they are copied in), then
  put on the default device."""
  fields = {}
  for field, shape in config.weight_shapes().items():
    stacked = np.empty(shape, dtype)
    for layer in range(config.num_layers):
      tensor = stored[_layer_tensor(layer, field)].read()
      stacked[layer] = tensor.T if field in MATRICES else tensor
    fields[field] = jax.device_put(stacked)
  return DecoderWeights(**fields)


def _load_tensor(tensor: _Tensor, dtype: np.dtype) -> jax.Array:
  """One tensor, converted to ``dtype``, on the default device."""
  return jax.device_put(np.asarray(tensor.read(), dtype))


def _stop_tokens(directory: str, settings: dict[str, Any]) -> tuple[int, ...]:
  """The end-of-sequence ids: generation_config.json's ``eos_token_id`` when it gives one, else
  config.json's (an int, a list of ints, or null).

  Raises:
    ValueError: an id is not a non-negative integer.
  """
  eos, source = settings["eos_token_id"], "config.json"
  generation_path = os.path.join(directory, "generation_config.json")
  if os.path.isfile(generation_path):
    generation_eos = _read_json(generation_path).get("eos_token_id")
    if generation_eos is not None:
      eos, source = generation_eos, "generation_config.json"
  ids = [] if eos is None else eos if isinstance(eos, list) else [eos]
  for token in ids:
    if isinstance(token, bool) or not isinstance(token, int) or token < 0:
      raise ValueError(f"load_hf: {source} eos_token_id={eos!r} must be a token id or a list of "
                       "them")
  return tuple(dict.fromkeys(ids))
