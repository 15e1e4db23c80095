"""16-bit params without a 4-byte master: stochastic rounding and param remainders.

The math of ``csrc/optim/rounding.h`` as XLA operations, for the optax protocol
(the kernels do the same in place under :func:`jaxfuse.fused_step`), with the same bits:

* **stochastic rounding** (Gupta et al., 2015, https://arxiv.org/abs/1502.02551): a value goes to
  one of its two neighbours in the params' 16-bit dtype with probability proportional to its
  nearness, so that an update below half an ulp survives on average. The random bits are a
  counter-based hash of (seed, leaf, shard, step count, element index): no generator state to
  keep, the same bits on the CPU and the CUDA handlers.
* **param remainders** (TransformerEngine's FusedAdam ``store_param_remainders``): bf16 params and
  int16 remainders together are the fp32 master bit for bit,
  ``bits(master) = bits(param) * 2**16 + remainder``, with the param the master rounded to
  nearest (ties away from zero): 2 bytes of state per param where a master copy takes 4.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

_U32 = jnp.uint32
ROUNDED_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def _u32(x: Any) -> jax.Array:
  """`x` as uint32: a Python int (up to 2**32 - 1) directly, an array by conversion."""
  return jnp.asarray(x, _U32) if isinstance(x, int) else jnp.asarray(x).astype(_U32)


def mix32(h: jax.Array) -> jax.Array:
  """mix32() (rounding.h): Murmur3's 32-bit finalizer."""
  h = h ^ (h >> 16)
  h = h * _U32(0x85EBCA6B)
  h = h ^ (h >> 13)
  h = h * _U32(0xC2B2AE35)
  return h ^ (h >> 16)


def stream(seed: Any, leaf: Any, shard: Any, count: jax.Array) -> jax.Array:
  """rounding_stream() (rounding.h): one leaf's stream at the step of `count` (before it)."""
  h = mix32(_u32(seed) ^ _U32(0x9E3779B9))
  h = mix32(h ^ _u32(leaf))
  h = mix32(h ^ _u32(shard))
  return mix32(h ^ jax.lax.bitcast_convert_type(jnp.asarray(count, jnp.int32), _U32))


def element_bits(stream_: jax.Array, shape: tuple[int, ...]) -> jax.Array:
  """element_bits() (rounding.h) for every element of a leaf of `shape` (fewer than 2**32
  elements: the high word of the index is 0, index_word() is the stream)."""
  index = jax.lax.iota(_U32, int(np.prod(shape, dtype=np.int64))).reshape(shape)
  return mix32(index * _U32(0x9E3779B1) + stream_)


def _bits_float(u: jax.Array) -> jax.Array:
  return jax.lax.bitcast_convert_type(u, jnp.float32)


def _float_bits(x: jax.Array) -> jax.Array:
  return jax.lax.bitcast_convert_type(x, _U32)


def _bf16_stochastic(x: jax.Array, bits: jax.Array) -> jax.Array:
  rounded = _bits_float((_float_bits(x) + (bits >> 16)) & _U32(0xFFFF0000))
  return jnp.where(jnp.isnan(x), x, rounded)


def _f16_stochastic(x: jax.Array, bits: jax.Array) -> jax.Array:
  u = _float_bits(x)
  sign = u & _U32(0x80000000)
  a = u & _U32(0x7FFFFFFF)
  nearest = x.astype(jnp.float16).astype(jnp.float32)
  normal = _bits_float(sign | ((a + (bits >> 19)) & ~_U32(0x1FFF)))
  scaled = _bits_float(a) * jnp.float32(16777216.0)
  whole = jnp.floor(scaled)
  up = (bits >> 8).astype(jnp.float32) * jnp.float32(2.0**-24) < scaled - whole
  small = _bits_float(sign | _float_bits((whole + up.astype(jnp.float32)) * jnp.float32(2.0**-24)))
  return jnp.where(a >= _U32(0x477FF000), nearest,
                   jnp.where(a >= _U32(0x38800000), normal, small))


def stochastic_round(x: jax.Array, dtype: Any, bits: jax.Array) -> jax.Array:
  """stochastic_round_run() (rounding.h) over a leaf: float32 `x` rounded stochastically to
  the 16-bit `dtype`, as that dtype."""
  rounded = _bf16_stochastic(x, bits) if jnp.dtype(dtype) == jnp.bfloat16 else \
      _f16_stochastic(x, bits)
  return rounded.astype(dtype)


def join_remainder(param: jax.Array, remainder: jax.Array) -> jax.Array:
  """The float32 master of bf16 `param` and its int16 `remainder`."""
  high = jax.lax.bitcast_convert_type(param, jnp.uint16).astype(_U32) << 16
  return _bits_float(high + remainder.astype(jnp.int32).astype(_U32))


def split_remainder(master: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(bf16 param, int16 remainder) of a float32 master."""
  bits = _float_bits(master)
  low = jax.lax.bitcast_convert_type((bits & _U32(0xFFFF)).astype(jnp.uint16), jnp.int16)
  param = _bits_float(bits - low.astype(jnp.int32).astype(_U32))
  return param.astype(jnp.bfloat16), low
