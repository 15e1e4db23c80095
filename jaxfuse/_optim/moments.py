"""8-bit optimizer moments (``moment_bits=8``): the state they live in and the XLA twin of
csrc/optim/moment_codes.h, which says the formats (the same bits on every path).

A quantized leaf of a moment is a :class:`QuantizedMoment`: one byte per element and a float32
scale per block of ``block`` consecutive elements (Dettmers et al., 2022,
https://arxiv.org/abs/2110.02861). The blocks run along the fewest trailing dimensions whose
product is a multiple of the block size (the last one alone when it is), so that the scales keep
the leading dimensions, and a leaf split over devices along those keeps whole blocks on each.
Leaves below :data:`MIN_QUANTIZED_SIZE` elements, or of a size no multiple of the block, keep
their moments in floats, as bitsandbytes keeps small tensors' state in 32 bits.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np

from jaxfuse._core import notices as _notices
from jaxfuse._core import trees as _trees

# Leaves with fewer elements keep float moments: their state is a small part of the total, and
# biases and norms are where quantization error shows first (bitsandbytes' min_8bit_size).
MIN_QUANTIZED_SIZE = 4096

_MIN_NORMAL_EXPONENT = -14  # the formats' binades are 2^-14 .. 2^0


class QuantizedMoment(NamedTuple):
  """One leaf of an 8-bit moment.

  Attributes:
    codes: the leaf's shape; int8 for a signed moment (sign, 4 exponent, 3 mantissa bits),
      uint8 for a non-negative one (4 exponent, 4 mantissa bits), each an 8-bit float of the
      element over its block's scale.
    scales: float32, each block's largest magnitude over the format's largest value; shaped
      as the leaf's leading dimensions, then the blocks of the trailing ones (block_axis()).
  """

  codes: jax.Array
  scales: jax.Array


def is_quantized(x: Any) -> bool:
  return isinstance(x, QuantizedMoment)


def block_axis(shape: tuple[int, ...], block: int) -> Optional[int]:
  """The first of the trailing dimensions the blocks run along: the last k such that the
  dimensions from k on hold whole blocks; None when no k does."""
  for k in reversed(range(len(shape))):
    if math.prod(shape[k:]) % block == 0:
      return k
  return None


def quantizable(shape: tuple[int, ...], dtype: Any, block: int) -> bool:
  """Whether a params leaf of this shape and (compute) dtype gets 8-bit moments: real float32
  math, at least MIN_QUANTIZED_SIZE elements, whole blocks."""
  return (jnp.dtype(dtype) in (jnp.float32, jnp.bfloat16, jnp.float16)
          and math.prod(shape) >= MIN_QUANTIZED_SIZE and block_axis(shape, block) is not None)


def float_leaves(params: Any, block: int) -> list[tuple[str, Any]]:
  """(name, shape) of each params leaf whose states ``moment_bits=8`` keeps in floats."""
  return [(name, p.shape) for name, p in zip(_trees.leaf_names(params), jax.tree.leaves(params))
          if not quantizable(p.shape, p.dtype, block)]


def warn_float_leaves(owner: str, params: Any, block: int) -> None:
  """Warns, once per message, which leaves ``moment_bits=8`` leaves in floats: the small ones by
  count, the others (where a user expected to save) by name."""
  kept = float_leaves(params, block)
  if not kept:
    return
  small = [name for name, shape in kept if math.prod(shape) < MIN_QUANTIZED_SIZE]
  other = [f"{name} {tuple(shape)}" for name, shape in kept if math.prod(shape) >= MIN_QUANTIZED_SIZE]
  parts = []
  if other:
    parts.append(f"{len(other)} whose trailing dimensions hold no whole blocks of {block} "
                 f"elements, or whose math is not float32: {', '.join(other[:10])}"
                 + (", ..." if len(other) > 10 else ""))
  if small:
    parts.append(f"{len(small)} under {MIN_QUANTIZED_SIZE} elements (biases, norms: kept in "
                 f"floats by design): {', '.join(small[:5])}" + (", ..." if len(small) > 5 else ""))
  message = (f"{owner}: moment_bits=8 keeps the states of {len(kept)} of "
             f"{len(jax.tree.leaves(params))} params leaves in floats: {'; '.join(parts)}. "
             "jaxfuse.report(step, ...).float_state_leaves lists them.")
  _notices.warn_once(message)


def split_block_dims(x: Any, block: int) -> list[int]:
  """The dimensions of `x` its blocks run along that its type says are split over devices
  (explicit sharding; a leaf split so would cut blocks)."""
  spec = getattr(getattr(jax.typeof(x), "sharding", None), "spec", None) or ()
  axis = block_axis(jnp.shape(x), block)
  return [d for d in range(axis, jnp.ndim(x)) if d < len(spec) and spec[d] is not None]


def _mantissa_bits(signed: bool) -> int:
  return 3 if signed else 4


def _top(signed: bool) -> np.float32:
  return np.float32(2.0 - 2.0 ** -_mantissa_bits(signed))


def _encode_magnitude(a: jax.Array, m: int) -> jax.Array:
  """encode_magnitude() of moment_codes.h: a in [0, top] to its code, ties to even."""
  subnormal = jnp.rint(a * np.float32(2.0 ** (14 + m))).astype(jnp.uint32)
  shift = 23 - m
  b = jax.lax.bitcast_convert_type(a, jnp.uint32)
  b = b + np.uint32((1 << (shift - 1)) - 1) + ((b >> shift) & np.uint32(1))
  normal = (b >> shift) - np.uint32(112 << m)
  return jnp.where(a < np.float32(2.0 ** _MIN_NORMAL_EXPONENT), subnormal, normal)


def _decode_magnitude(code: jax.Array, m: int) -> jax.Array:
  code = code.astype(jnp.uint32)
  subnormal = code.astype(jnp.float32) * np.float32(2.0 ** -(14 + m))
  normal = jax.lax.bitcast_convert_type((code + np.uint32(112 << m)) << (23 - m), jnp.float32)
  return jnp.where(code < (1 << m), subnormal, normal)


def _as_blocks(x: jax.Array, axis: int, block: int) -> jax.Array:
  """`x` as [leading dimensions..., blocks, block], its dimensions from `axis` on merged first
  (reshapes that merge or split whole dimensions keep explicit shardings of the leading ones)."""
  return x.reshape(*x.shape[:axis], -1).reshape(*x.shape[:axis], -1, block)


def quantize(x: jax.Array, signed: bool, block: int) -> QuantizedMoment:
  """`x` (float32, whole blocks: quantizable()) as codes and block scales."""
  x = x.astype(jnp.float32)
  blocks = _as_blocks(x, block_axis(x.shape, block), block)
  top = _top(signed)
  # moment_scale(): the largest magnitude's bits (NaNs above Inf), the canonical NaN for a NaN
  largest = jnp.max(jax.lax.bitcast_convert_type(blocks, jnp.uint32) & np.uint32(0x7fffffff),
                    axis=-1)
  scales = jnp.where(largest > np.uint32(0x7f800000), np.float32(np.nan),
                     jax.lax.bitcast_convert_type(largest, jnp.float32) * (np.float32(1) / top))
  a = jnp.abs(blocks) * (np.float32(1) / scales)[..., None]
  a = jnp.where(a <= top, a, jnp.where(jnp.isnan(a), np.float32(0), top))
  code = _encode_magnitude(a, _mantissa_bits(signed))
  if signed:
    sign = jax.lax.bitcast_convert_type(blocks, jnp.uint32) >> 24 & np.uint32(0x80)
    code = code | sign  # x's sign bit
    codes = jax.lax.bitcast_convert_type(code.astype(jnp.uint8), jnp.int8)
  else:
    codes = jnp.where((code == 0) & (blocks > 0), np.uint32(1), code).astype(jnp.uint8)
  return QuantizedMoment(codes.reshape(*x.shape[:scales.ndim - 1], -1).reshape(x.shape), scales)


def dequantize(q: QuantizedMoment) -> jax.Array:
  """The float32 values of a quantized moment."""
  signed = q.codes.dtype == jnp.int8
  raw = jax.lax.bitcast_convert_type(q.codes, jnp.uint8).astype(jnp.uint32) if signed \
      else q.codes.astype(jnp.uint32)
  blocks = _as_blocks(raw, q.scales.ndim - 1, block_size(q))
  value = _decode_magnitude(blocks & np.uint32(0x7f) if signed else blocks,
                            _mantissa_bits(signed)) * q.scales[..., None]
  if signed:
    value = jnp.where(blocks >= 0x80, -value, value)
  return value.reshape(*q.scales.shape[:-1], -1).reshape(q.codes.shape)


def block_size(q: QuantizedMoment) -> int:
  return math.prod(q.codes.shape) // math.prod(q.scales.shape)


def like(x: jax.Array, target: QuantizedMoment) -> QuantizedMoment:
  """`x` quantized in `target`'s format and block size."""
  return quantize(x, target.codes.dtype == jnp.int8, block_size(target))


def dequantize_tree(tree: Any) -> Any:
  """`tree` with each QuantizedMoment replaced by its float32 values."""
  return jax.tree.map(lambda x: dequantize(x) if is_quantized(x) else x, tree,
                      is_leaf=is_quantized)
