"""The decoder's configuration and operand types: DecoderConfig (with its RoPE scaling),
DecoderWeights and KVCache, and the dtypes they take."""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np


_SUPPORTED = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
# DecoderConfig.quantization -> the matrices' dtype.
QUANTIZED_DTYPES = {"int8": jnp.dtype(jnp.int8), "fp8": jnp.dtype(jnp.float8_e4m3fn)}


@dataclasses.dataclass(frozen=True)
class RopeScaling:
  """A RoPE frequency-scaling rule (Hugging Face's ``rope_scaling`` / ``rope_parameters``).

  ``rope_type="linear"`` divides every frequency by ``factor`` (position interpolation, Chen et
  al. 2023, arXiv:2306.15595). ``rope_type="llama3"`` is Llama 3.1's rule: wavelengths shorter
  than ``original_max_position_embeddings / high_freq_factor`` keep their frequency, those longer
  than ``original_max_position_embeddings / low_freq_factor`` are divided by ``factor``, and the
  band between interpolates linearly in ``original_max_position_embeddings / wavelength``.
  """

  rope_type: str
  factor: float
  low_freq_factor: float = 1.0
  high_freq_factor: float = 4.0
  original_max_position_embeddings: int = 8192

  def __post_init__(self):
    if self.rope_type not in ("linear", "llama3"):
      raise ValueError(f"RopeScaling: rope_type {self.rope_type!r} is not supported (supported: "
                       "'linear', 'llama3')")
    for name in ("factor", "low_freq_factor", "high_freq_factor"):
      v = getattr(self, name)
      if isinstance(v, bool) or not isinstance(v, (int, float, np.floating, np.integer)):
        raise ValueError(f"RopeScaling: {name} must be a number, got {v!r}")
      if not np.isfinite(v) or v <= 0:
        raise ValueError(f"RopeScaling: {name} must be finite and > 0, got {v!r}")
      object.__setattr__(self, name, float(v))
    v = self.original_max_position_embeddings
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
      raise ValueError("RopeScaling: original_max_position_embeddings must be a positive integer, "
                       f"got {v!r}")
    object.__setattr__(self, "original_max_position_embeddings", int(v))
    if self.rope_type == "llama3" and not self.high_freq_factor > self.low_freq_factor:
      raise ValueError(f"RopeScaling: high_freq_factor={self.high_freq_factor} must exceed "
                       f"low_freq_factor={self.low_freq_factor}")

  def apply(self, inv_freq: np.ndarray) -> np.ndarray:
    """The scaled frequencies (float64 in, float64 out)."""
    if self.rope_type == "linear":
      return inv_freq / self.factor
    context = float(self.original_max_position_embeddings)
    wavelength = 2.0 * np.pi / inv_freq
    ratio = context / wavelength  # periods of this frequency within the original context
    t = (ratio - self.low_freq_factor) / (self.high_freq_factor - self.low_freq_factor)
    blended = (1.0 - t) * inv_freq / self.factor + t * inv_freq
    return np.where(wavelength < context / self.high_freq_factor, inv_freq,
                    np.where(wavelength > context / self.low_freq_factor, inv_freq / self.factor,
                             blended))


@dataclasses.dataclass(frozen=True)
class DecoderConfig:
  """Static shape and hyperparameters of the decoder stack (hashable: a static jit argument).

  ``qkv_bias``: the q/k/v projections add a bias (Qwen2); ``qk_norm``: each q and k head is
  RMSNorm-ed (weights ``q_norm``/``k_norm`` [head_dim], eps ``rms_norm_eps``) before RoPE (Qwen3);
  ``rope_scaling``: a :class:`RopeScaling` rule applied to the frequencies ``rope_theta^(-2i/hd)``
  (Llama 3.1+); ``quantization``: None, or "int8" / "fp8" for weight-only quantized matrices
  (:func:`jaxfuse.quantize`). ``max_seq_len`` is the KV cache length.
  """

  num_layers: int
  hidden_size: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  intermediate_size: int
  max_seq_len: int
  rms_norm_eps: float = 1e-5
  rope_theta: float = 10000.0
  qkv_bias: bool = False
  qk_norm: bool = False
  rope_scaling: RopeScaling | None = None
  quantization: str | None = None

  def __post_init__(self):
    for name in ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim",
                 "intermediate_size", "max_seq_len"):
      v = getattr(self, name)
      if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
        raise ValueError(f"DecoderConfig: {name} must be a positive integer, got {v!r}")
      object.__setattr__(self, name, int(v))
    for name in ("rms_norm_eps", "rope_theta"):
      v = getattr(self, name)
      if isinstance(v, bool) or not isinstance(v, (int, float, np.floating, np.integer)):
        raise ValueError(f"DecoderConfig: {name} must be a number, got {v!r}")
      object.__setattr__(self, name, float(v))
    for name in ("qkv_bias", "qk_norm"):
      if not isinstance(getattr(self, name), (bool, np.bool_)):
        raise ValueError(f"DecoderConfig: {name} must be a bool, got {getattr(self, name)!r}")
      object.__setattr__(self, name, bool(getattr(self, name)))
    if self.rope_scaling is not None and not isinstance(self.rope_scaling, RopeScaling):
      raise ValueError("DecoderConfig: rope_scaling must be None or a jaxfuse.RopeScaling, got "
                       f"{self.rope_scaling!r}")
    if self.num_heads % self.num_kv_heads:
      raise ValueError(f"DecoderConfig: num_heads={self.num_heads} must be a multiple of "
                       f"num_kv_heads={self.num_kv_heads}")
    if self.head_dim % 2:
      raise ValueError(f"DecoderConfig: head_dim={self.head_dim} must be even "
                       "(RoPE rotates halves)")
    if not self.rms_norm_eps >= 0.0 or not np.isfinite(self.rms_norm_eps):
      raise ValueError("DecoderConfig: rms_norm_eps must be finite and >= 0, got "
                       f"{self.rms_norm_eps}")
    if not self.rope_theta > 0.0 or not np.isfinite(self.rope_theta):
      raise ValueError(f"DecoderConfig: rope_theta must be finite and > 0, got {self.rope_theta}")
    if self.max_seq_len >= 2**31 - 1:
      raise ValueError("DecoderConfig: max_seq_len must fit int32 positions")
    if self.quantization is not None and self.quantization not in QUANTIZED_DTYPES:
      raise ValueError(f"DecoderConfig: quantization must be None, 'int8' or 'fp8', got "
                       f"{self.quantization!r}")

  @property
  def quantized(self) -> bool:
    """The matrices are int8 or fp8 with per-column scales (the kernel's ``quantized``)."""
    return self.quantization is not None

  def matrix_dtype(self, dtype) -> np.dtype:
    """The dtype of the seven matrices in a model of ``dtype``: it, or the quantized one."""
    return jnp.dtype(QUANTIZED_DTYPES[self.quantization] if self.quantized else dtype)

  @property
  def q_dim(self) -> int:
    return self.num_heads * self.head_dim

  @property
  def kv_dim(self) -> int:
    return self.num_kv_heads * self.head_dim

  def weight_shapes(self) -> dict[str, tuple[int, ...]]:
    """The shapes of the :class:`DecoderWeights` fields this config uses (the others are None),
    in field order: the kernel's own shapes (``decoder_weight_shapes()`` in decoder.h)."""
    from jaxfuse._decode import contract  # noqa: PLC0415 (the config needs no native module)

    return contract._weight_shapes(self)

  def cache_shape(self, batch: int) -> tuple[int, ...]:
    return (self.num_layers, batch, self.max_seq_len, self.num_kv_heads, self.head_dim)

  def rope_inv_freq(self) -> np.ndarray:
    """float32 [head_dim / 2]: the RoPE frequency of each rotated pair (i, i + head_dim/2),
    ``rope_theta^(-2i/head_dim)`` scaled by ``rope_scaling``, computed in float64 and rounded once.
    The kernels and :func:`decoder_reference` read this one table."""
    half = self.head_dim // 2
    inv_freq = np.float64(self.rope_theta) ** (-2.0 * np.arange(half, dtype=np.float64)
                                               / self.head_dim)
    if self.rope_scaling is not None:
      inv_freq = self.rope_scaling.apply(inv_freq)
    return inv_freq.astype(np.float32)


class DecoderWeights(NamedTuple):
  """Stacked per-layer weights; matrices are [in, out] (``y = a @ w``).

  The last twelve are optional: the q/k/v biases when ``cfg.qkv_bias``, the per-head q/k RMSNorm
  weights when ``cfg.qk_norm``, the matrices' float32 per-output-column scales when
  ``cfg.quantization`` is set (the matrices then int8 or float8_e4m3fn); None otherwise (a weight
  the config does not use is an error, never silently ignored).
  """

  attn_norm: jax.Array  # [L, D]
  wq: jax.Array  # [L, D, H*hd]
  wk: jax.Array  # [L, D, KV*hd]
  wv: jax.Array  # [L, D, KV*hd]
  wo: jax.Array  # [L, H*hd, D]
  mlp_norm: jax.Array  # [L, D]
  w_gate: jax.Array  # [L, D, I]
  w_up: jax.Array  # [L, D, I]
  w_down: jax.Array  # [L, I, D]
  q_bias: jax.Array | None = None  # [L, H*hd]
  k_bias: jax.Array | None = None  # [L, KV*hd]
  v_bias: jax.Array | None = None  # [L, KV*hd]
  q_norm: jax.Array | None = None  # [L, hd]
  k_norm: jax.Array | None = None  # [L, hd]
  wq_scale: jax.Array | None = None  # [L, H*hd]
  wk_scale: jax.Array | None = None  # [L, KV*hd]
  wv_scale: jax.Array | None = None  # [L, KV*hd]
  wo_scale: jax.Array | None = None  # [L, D]
  w_gate_scale: jax.Array | None = None  # [L, I]
  w_up_scale: jax.Array | None = None  # [L, I]
  w_down_scale: jax.Array | None = None  # [L, D]


class KVCache(NamedTuple):
  """The per-layer key and value cache, in the dtype of ``x`` and the weights."""

  k: jax.Array  # [L, B, max_seq_len, KV, hd]
  v: jax.Array  # [L, B, max_seq_len, KV, hd]
