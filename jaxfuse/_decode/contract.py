"""The C++ contract of the decoder op (``DecoderOp::contract()`` in csrc/decoder/decoder.h), read
at import (kernel.py checks it against the operands it passes): operand, result and attribute
names, the weights' shapes, flags and kinds, and the workspace size; and the custom call's
attributes built from it."""

from __future__ import annotations

import dataclasses
import functools
from typing import TYPE_CHECKING

import jax.numpy as jnp
import numpy as np

from jaxfuse._core import ffi as _ffi

if TYPE_CHECKING:  # annotations only: the config needs this module, not the reverse
  from jaxfuse._decode.config import DecoderConfig


_CONTRACT = _ffi.contract("jaxfuse_decoder")
# The k/v cache operands alias the k/v cache results (the names in both lists).
_ALIASES = _ffi.aliases(_CONTRACT.names["operands"], _CONTRACT.names["results"])
# The config flag each optional weight needs ("always" for the others).
_WEIGHT_FLAGS = dict(zip(_CONTRACT.names["weights"], _CONTRACT.names["weight_flags"]))
# What each weight's dtype is: the model's, the matrices' or float32 (scales).
_WEIGHT_KINDS = dict(zip(_CONTRACT.names["weights"], _CONTRACT.names["weight_kinds"]))


def _weight_dtype(name: str, cfg: DecoderConfig, dtype) -> np.dtype:
  """The dtype weight ``name`` has in a model of ``dtype`` (its kind in the contract)."""
  kind = _WEIGHT_KINDS[name]
  if kind == "scale":
    return jnp.dtype(jnp.float32)
  return cfg.matrix_dtype(dtype) if kind == "matrix" else jnp.dtype(dtype)


@functools.cache
def _weight_shapes(cfg: DecoderConfig) -> dict[str, tuple[int, ...]]:
  """:meth:`DecoderConfig.weight_shapes`: the contract's shapes of the weights ``cfg`` uses."""
  sizes = {name: getattr(cfg, name) for name in _CONTRACT.names["size_attrs"]}
  flags = {name: getattr(cfg, name) for name in _CONTRACT.names["bool_attrs"]}
  shapes = _CONTRACT.call("weight_shapes", **flags, **sizes).shapes
  return {name: shapes[name] for name, flag in _WEIGHT_FLAGS.items()
          if flag == "always" or getattr(cfg, flag)}


def _workspace_layout(cfg: DecoderConfig, batch: int, dtype, sample_filter: bool = False,
                      timeline: bool = False) -> dict[str, int]:
  """The kernel's scratch buffer, from the C++ layout (``decoder_layout()``): its size
  ("bytes") and the place and shape of its timeline ("timeline", the byte offset;
  "timeline_blocks", "timeline_slots", "timeline_header_bytes", "timeline_record_bytes").

  Args:
    cfg: the decoder configuration.
    batch: the number of rows of one call.
    dtype: the dtype of ``x``, the weights and the cache.
    sample_filter: whether the call's draw is filtered (top-k or top-p): the CUDA kernel's
      search for each row's threshold then lives in the workspace.
    timeline: whether the call records each block's times in each stage (the timeline then
      lives in the workspace).
  """
  sizes = {name: getattr(cfg, name) for name in _CONTRACT.names["size_attrs"]}
  layout = _CONTRACT.call("workspace", batch=batch, dtype_bytes=jnp.dtype(dtype).itemsize,
                          sample_filter=int(sample_filter), timeline=int(timeline), **sizes)
  return dict(layout.numbers)


def _workspace_bytes(cfg: DecoderConfig, batch: int, dtype, sample_filter: bool = False,
                     timeline: bool = False) -> int:
  """The size of the kernel's scratch buffer (:func:`_workspace_layout`'s "bytes")."""
  return _workspace_layout(cfg, batch, dtype, sample_filter, timeline)["bytes"]


@dataclasses.dataclass(frozen=True)
class _Head:
  """What a whole-model step computes after the layers (static): the final norm and the LM head
  (``tied``: the embedding's rows; ``quantized``: int8 or fp8 rows, the layers' format, with a
  scale each), and with a ``temperature`` the next tokens (0: greedy; None: logits only), drawn
  from the scores ``top_k`` and ``top_p`` keep (None: every score)."""

  tied: bool
  temperature: float | None = None
  quantized: bool = False
  top_k: int | None = None
  top_p: float | None = None

  @property
  def sample(self) -> bool:
    return self.temperature is not None

  @property
  def sample_filter(self) -> bool:
    return self.top_k is not None or self.top_p is not None

  def operands(self) -> tuple[str, ...]:
    """The names of the step's ``model`` operands, in call order (see :func:`_call_kernel`)."""
    return (("embed", "final_norm") + (() if self.tied else ("lm_head",))
            + (("lm_head_scale",) if self.quantized else ())
            + (("sample_key",) if self.sample else ()))


# The CUDA kernel's schedules (:func:`jaxfuse.persistent_decoder`'s ``schedule``): one persistent
# launch, or one launch per stage chained by programmatic dependent launch. The CPU handler has
# one: it takes either.
SCHEDULES = ("persistent", "stage_kernels")


def _check_schedule(fn: str, schedule) -> None:
  """``schedule`` is one of SCHEDULES."""
  if not isinstance(schedule, str) or schedule not in SCHEDULES:
    raise ValueError(f"{fn}: schedule must be one of {SCHEDULES}, got {schedule!r}")


def _attributes(cfg: DecoderConfig, head: _Head | None = None, timeline: bool = False,
                schedule: str = "persistent") -> dict[str, np.generic]:
  """The custom call's attributes: the config fields the contract names, in the contract's types,
  and the call's (``timeline``: record each block's times in each stage; ``schedule``: one of
  SCHEDULES)."""
  names = _CONTRACT.names
  sample = head is not None and head.sample
  step = {"model_step": head is not None, "sample": sample, "timeline": timeline,
          "stage_kernels": schedule == "stage_kernels",
          "temperature": head.temperature if sample else 0.0,
          "top_k": (head.top_k or 0) if sample else 0,
          "top_p": 1.0 if not sample or head.top_p is None else head.top_p}
  return {**{name: np.int64(getattr(cfg, name)) for name in names["size_attrs"]},
          **{name: np.float32(getattr(cfg, name)) for name in names["f32_attrs"]},
          **{name: np.bool_(getattr(cfg, name)) for name in names["bool_attrs"]},
          **{name: np.bool_(step[name]) for name in names["step_bool_attrs"]},
          **{name: np.int64(step[name]) for name in names["step_i64_attrs"]},
          **{name: np.float32(step[name]) for name in names["step_f32_attrs"]}}
