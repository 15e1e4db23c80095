"""Weight-only quantization of the decoder's matrices: int8 or float8 e4m3fn, a scale per output
column.

Batch-1 decoding reads every weight once per token, so its time is the weight bytes over the
memory bandwidth; 8-bit matrices halve the bytes of a bf16 model. For each matrix ``W`` [K, N] of
each layer (wq, wk, wv, wo, w_gate, w_up, w_down) and each output column ``n``::

    scale[n] = max_k |W[k, n]| / qmax          (1 for an all-zero column)
    Q[k, n]  = round(W[k, n] / scale[n])       int8: to nearest, in [-127, 127] (qmax 127)
                                               fp8:  to nearest even e4m3fn, |Q| <= 448 (qmax 448)

and the decoder computes ``y[n] = scale[n] * sum_k a[k] * Q[k, n]`` in fp32 (the kernels widen Q
in registers). The error of each weight is at most half a step of its column's grid: int8
``scale / 2``; fp8 ``|W| * 2^-4`` (3 mantissa bits), or ``scale * 2^-10`` below e4m3's normal
range. Norms, biases and the embedding keep the model's dtype.

The LM head [V, D] is quantized the same way by default (:func:`quantize`'s ``head``), with a
scale per vocabulary row (the head's output column): ``logits[v] = scale[v] * sum_d a[d] Q[v, d]``.
It is the largest single matrix of a small model (Llama-3.2-1B: 263M of its 1.24B weights, read
once per decode step like the rest). A tied model gets the quantized head as its own matrix
beside the embedding, which the token gather still reads in the model's dtype: 1 more byte per
head weight in memory, 1 byte instead of 2 per decode step.

Per-channel absmax weight-only quantization as in gpt-fast's int8 mode and LLM.int8()'s
vector-wise scales (Dettmers et al. 2022, arXiv:2208.07339); fp8 e4m3 with a per-channel scale as
FP8 formats for deep learning (Micikevicius et al. 2022, arXiv:2209.05433) store weights.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxfuse._decode.config import DecoderConfig, DecoderWeights, QUANTIZED_DTYPES
from jaxfuse._decode.contract import _WEIGHT_KINDS, _weight_shapes
from jaxfuse._decode.model import DecoderModel

__all__ = ["quantize", "quantize_weights"]

# The seven matrices (the contract's weights of kind "matrix"); each's scales are <name>_scale.
MATRICES = tuple(name for name, kind in _WEIGHT_KINDS.items() if kind == "matrix")
# The largest magnitude of each format's grid that scale[n] maps max |W[:, n]| to.
_QMAX = {"int8": 127.0, "fp8": 448.0}


@functools.partial(jax.jit, static_argnums=(1, 2))  # fused: no fp32 copy of the matrix kept
def quantize_matrix(w, quantization: str, axis: int = -2):
  """``(Q, scale)`` of a stacked matrix ``w`` [L, K, N] (any float dtype): Q [L, K, N] int8 or
  float8_e4m3fn, scale float32 [L, N], per the module docstring; ``axis`` is the one the scales
  reduce over (-1 for the LM head [V, D]: a scale per row)."""
  qmax = _QMAX[quantization]
  w32 = w.astype(jnp.float32)
  amax = jnp.max(jnp.abs(w32), axis=axis, keepdims=True)
  scale = jnp.where(amax > 0, amax / qmax, 1.0).astype(jnp.float32)
  q = w32 / scale
  if quantization == "int8":
    q = jnp.round(q)
  # |q| can exceed qmax by a rounding of the division: clip, as e4m3fn has no infinity.
  return (jnp.clip(q, -qmax, qmax).astype(QUANTIZED_DTYPES[quantization]),
          jnp.squeeze(scale, axis))


def quantize_weights(w: DecoderWeights, cfg: DecoderConfig,
                     quantization: str) -> tuple[DecoderWeights, DecoderConfig]:
  """The layer stack ``w`` with its seven matrices quantized.

  Args:
    w: the stacked layer weights of ``cfg`` (not yet quantized), in any float dtype.
    cfg: their configuration, with ``quantization=None``.
    quantization: "int8" or "fp8" (float8 e4m3fn), each with a float32 scale per output column.

  Returns:
    ``(weights, config)``: the matrices int8 or float8_e4m3fn, the ``*_scale`` fields set, the
    other weights unchanged; the config with ``quantization`` set.

  Raises:
    ValueError: an unknown format, ``cfg`` or ``w`` already quantized, or a matrix with
      non-finite values (when its values are known: a concrete array, not a tracer).
  """
  if quantization not in _QMAX:
    raise ValueError(f"quantize: quantization must be 'int8' or 'fp8', got {quantization!r}")
  if not isinstance(w, DecoderWeights) or not isinstance(cfg, DecoderConfig):
    raise TypeError("quantize_weights: w must be a jaxfuse.DecoderWeights and cfg a "
                    "jaxfuse.DecoderConfig")
  if cfg.quantized:
    raise ValueError(f"quantize: the weights are already quantized (cfg.quantization="
                     f"{cfg.quantization!r})")
  shapes = _weight_shapes(cfg)
  fields = {}
  for name in MATRICES:
    a = getattr(w, name)
    if tuple(a.shape) != shapes[name]:
      raise ValueError(f"quantize: w.{name} has shape {tuple(a.shape)}, expected {shapes[name]}")
    if not jnp.issubdtype(a.dtype, jnp.floating) or jnp.dtype(a.dtype).itemsize == 1:
      raise ValueError(f"quantize: w.{name} has dtype {a.dtype}, expected a 16- or 32-bit float")
    _check_finite(f"w.{name}", a)
    fields[name], fields[name + "_scale"] = quantize_matrix(a, quantization)
  return w._replace(**fields), dataclasses.replace(cfg, quantization=quantization)


def quantize(model: DecoderModel, quantization: str, *, head: bool = True) -> DecoderModel:
  """``model`` with its layer stack's matrices (and its LM head) quantized to int8 or fp8
  (weight-only).

  The persistent decoder then reads 1 byte per matrix weight instead of 2 (bf16) or 4 (float32):
  see the module docstring for the scheme and its error bound. The embedding and the final norm
  keep the model's dtype, as do the per-layer norms and biases and the KV cache; the activations
  stay fp32 in the kernels.

  Args:
    model: a :class:`~jaxfuse.DecoderModel` (e.g. from :func:`jaxfuse.load_hf`), not yet
      quantized.
    quantization: "int8" or "fp8" (float8 e4m3fn), each with a float32 scale per output column.
    head: also quantize the LM head (a scale per vocabulary row; a tied model's becomes its own
      matrix: ``lm_head``, ``lm_head_scale``). False keeps it in the model's dtype, as GPTQ and
      LLM.int8() leave theirs.

  Returns:
    The quantized model (``model.config.quantization`` set).
  """
  if not isinstance(model, DecoderModel):
    raise TypeError(f"quantize: expected a jaxfuse.DecoderModel, got {type(model).__name__}")
  if model.head_quantized:
    raise ValueError("quantize: the model's LM head is already quantized")
  layers, config = quantize_weights(model.layers, model.config, quantization)
  model = dataclasses.replace(model, config=config, layers=layers)
  if not head:
    return model
  rows = model.embed if model.tied else model.lm_head
  _check_finite("model.embed (the tied LM head)" if model.tied else "model.lm_head", rows)
  q, scale = quantize_matrix(rows, quantization, -1)
  return dataclasses.replace(model, lm_head=q, lm_head_scale=scale)


def _check_finite(name: str, a) -> None:
  """Refuses a matrix with a non-finite value (its column's scale would be NaN) when its values
  are known; one device scalar per layer of a stack [L, K, N] comes back (the message names the
  first bad layer), not the matrix."""
  if isinstance(a, jax.core.Tracer):
    return
  finite = np.asarray(jnp.all(jnp.isfinite(a), axis=(-2, -1)))
  if not finite.all():
    where = f" (layer {int(np.argmin(finite))})" if finite.ndim else ""
    raise ValueError(f"quantize: {name} has non-finite values{where}")

