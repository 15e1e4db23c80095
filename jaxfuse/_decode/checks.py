"""Trace-time validation of the decoder's operands (structure, shapes, dtypes, positions and
token ids), naming the argument at fault."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import checkify

from jaxfuse._decode.config import _SUPPORTED, DecoderConfig, DecoderWeights, KVCache
from jaxfuse._decode.contract import _WEIGHT_FLAGS, _WEIGHT_KINDS, _weight_dtype


_SHARED_DTYPE = " (x, the weights and the cache share one dtype)"
_DTYPE_NOTES = {"model": _SHARED_DTYPE, "scale": " (quantization scales are float32)"}
_CACHE_AXES = " (layers, batch, max_seq_len, kv_heads, head_dim)"
_NOT_DIFFERENTIABLE = ("persistent_decoder is an inference kernel and is not differentiable; use "
                       "jaxfuse.decoder_reference (pure JAX) for gradients")


def _fmt(shape) -> str:
  """A shape as Python prints a tuple: ``(2, 3)``, ``(2,)``."""
  return "(" + ", ".join(str(int(s)) for s in shape) + ("," if len(shape) == 1 else "") + ")"


def _check_structure(w, cache, cfg) -> None:
  """Checks the container types of the weights, the cache and the config."""
  for name, value, kind in (("cfg", cfg, DecoderConfig), ("w", w, DecoderWeights),
                            ("cache", cache, KVCache)):
    if not isinstance(value, kind):
      raise TypeError(f"persistent_decoder: {name} must be a jaxfuse.{kind.__name__}, got "
                      f"{type(value).__name__}")


def _check_present(fn: str, w: DecoderWeights, cfg: DecoderConfig) -> None:
  """The optional weights are given exactly when ``cfg`` uses them (never silently ignored)."""
  used = cfg.weight_shapes()
  for name, a in w._asdict().items():
    if name in used and a is None:
      raise ValueError(f"{fn}: w.{name} is None, but cfg.{_WEIGHT_FLAGS[name]} is set")
    if name not in used and a is not None:
      raise ValueError(f"{fn}: w.{name} is given, but cfg.{_WEIGHT_FLAGS[name]} is False (the "
                       "kernel would ignore it)")


def _expect(fn: str, name: str, a, shape, dtype, shape_note: str = "",
            dtype_note: str = "") -> None:
  """Raises ValueError unless ``a`` has ``shape``, then TypeError unless it has ``dtype``."""
  if a.shape != tuple(shape):
    raise ValueError(f"{fn}: {name} has shape {_fmt(a.shape)}, expected {_fmt(shape)}{shape_note}")
  if jnp.dtype(a.dtype) != dtype:
    raise TypeError(f"{fn}: {name} has dtype {a.dtype}, expected {dtype}{dtype_note}")


def _check_operands(x, positions, w: DecoderWeights, cache: KVCache, cfg: DecoderConfig) -> None:
  """Validates the shapes and dtypes of one (unbatched) step against ``cfg``, at trace time."""
  if x.ndim != 2 or x.shape[1] != cfg.hidden_size:
    raise ValueError(f"persistent_decoder: x has shape {_fmt(x.shape)}, expected (B, "
                     f"{cfg.hidden_size}) (batch, hidden_size)")
  dtype = jnp.dtype(x.dtype)
  if dtype not in _SUPPORTED:
    raise TypeError(f"persistent_decoder: x has dtype {dtype}, expected float32, bfloat16 or "
                    "float16")
  batch = x.shape[0]
  _expect("persistent_decoder", "positions", positions, (batch,), jnp.dtype(jnp.int32))
  _check_layers("persistent_decoder", w, cache, cfg, batch, dtype)


def _check_layers(fn: str, w: DecoderWeights, cache: KVCache, cfg: DecoderConfig, batch: int,
                  dtype) -> None:
  """The weights and the cache of ``batch`` rows have ``cfg``'s shapes and ``dtype``."""
  _check_present(fn, w, cfg)
  for name, shape in cfg.weight_shapes().items():
    note = _DTYPE_NOTES.get(_WEIGHT_KINDS[name])
    if note is None:  # a matrix
      note = (f" (cfg.quantization={cfg.quantization!r})" if cfg.quantized else _SHARED_DTYPE)
    _expect(fn, name, getattr(w, name), shape, _weight_dtype(name, cfg, dtype), dtype_note=note)
  for name, a in (("cache.k", cache.k), ("cache.v", cache.v)):
    _expect(fn, name, a, cfg.cache_shape(batch), dtype, _CACHE_AXES, _SHARED_DTYPE)


def _concrete(a) -> np.ndarray | None:
  """``a`` as NumPy when its value is known without tracing, else None.

  Reading a jax.Array waits for it to be computed; a tracer (jit, vmap, grad...) is never read,
  nor is an array with shards on other processes.
  """
  if isinstance(a, jax.core.Tracer) or (isinstance(a, jax.Array) and not a.is_fully_addressable):
    return None
  try:
    return np.asarray(a)
  except jax.errors.TracerArrayConversionError:  # a sequence holding tracers
    return None


def _check_rows(fn: str, name: str, values, lo: int, hi: int, bounds: str,
                traced_check: bool) -> None:
  """Refuses a row of the integer vector ``values`` outside [lo, hi).

  Concrete values are checked now (ValueError naming the first bad row). Traced values are checked
  by a :func:`checkify.check` with the same message only when ``traced_check``: the default adds
  nothing to the traced program. ``bounds`` is how the messages write the range.
  """
  message = f"{fn}: {name}[{{}}] = {{}} is outside {bounds}"
  known = _concrete(values)
  if known is not None:
    bad = np.flatnonzero((known < lo) | (known >= hi))
    if bad.size:
      raise ValueError(message.format(bad[0], known[bad[0]]))
  elif traced_check and jnp.size(values):  # (no rows: nothing to check, and no argmin)
    values = jnp.asarray(values)
    ok = (values >= lo) & (values < hi)
    row = jnp.argmin(ok)  # the first bad row (any row when all are good)
    checkify.check(jnp.all(ok), message, row, values[row])
