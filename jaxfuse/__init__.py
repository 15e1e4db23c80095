"""jaxfuse: fused multi-tensor optimizer and decode kernels for JAX, as XLA FFI custom calls.

Optimizer side (optax-compatible):
  adam, adamw          Adam/AdamW for a whole pytree in one fused kernel
  nadam, nadamw        the same with Nesterov momentum (as optax.nadam/nadamw)
  sgd, lion, adagrad,  SGD (momentum, Nesterov), Lion, Adagrad and RMSprop (centered,
  rmsprop              momentum), as optax's, fused the same way
  lamb, lars           LAMB and LARS (per-leaf trust ratios), as optax's: two fused passes
  muon                 Muon, as optax.contrib.muon: matrices orthogonalized in batches by shape,
                       element passes fused, AdamW for the other leaves
  schedule_free_adamw, schedule-free AdamW and SGD, as optax.contrib's: one fused pass, and
  schedule_free_sgd    schedule_free_eval_params for the params to evaluate at
  clip_by_global_norm  clipping whose norm and scale never leave the device
  global_norm          the L2 norm of a pytree, one call, deterministic
  fused_step           params and optimizer state updated in place (28 B/param fp32)
  multi_steps          gradient accumulation (optax.MultiSteps) that fused_step runs in place
  master_params,       the full-precision params a state keeps (master copy, remainders), and
  convert_state        a state moved to another transform's dtypes and master layout
  QuantizedMoment      one leaf of an 8-bit moment (moment_bits=8): codes and block scales
  pack, unpack, Packed a tree's arrays as one flat buffer per dtype (packed params; the
                       optimizers' packed=True states), and back

Reporting:
  report               what a jitted step launches, moves and holds, beside a baseline

Decode side:
  persistent_decoder   one decode step of a Llama-style decoder stack, all layers in one launch
  decoder_reference    the same step (or a multi-token prefill) in plain JAX
  load_hf              a Llama / Mistral / Qwen2 / Qwen3 checkpoint (Hugging Face files)
  generate             prefill + a whole generation in one jitted while_loop of decoder launches
  decode_step          one token per row through the model (embedding, stack, head): logits
"""

import importlib as _importlib
from importlib import metadata as _metadata

from jaxfuse._core.ffi import backends, export_safety_checks
from jaxfuse._core.packing import Packed, pack, unpack
from jaxfuse._decode.config import DecoderConfig, DecoderWeights, KVCache, RopeScaling
from jaxfuse._decode.generation import decode_step, generate, init_cache, prefill
from jaxfuse._decode.hf import load_hf
from jaxfuse._decode.kernel import persistent_decoder
from jaxfuse._decode.model import DecoderModel
from jaxfuse._decode.quantize import quantize, quantize_weights
from jaxfuse._decode.reference import decoder_reference
from jaxfuse._optim.accumulate import multi_steps
from jaxfuse._optim.clip import clip_by_global_norm, global_norm
from jaxfuse._optim.families.adagrad import adagrad
from jaxfuse._optim.families.adam import AdamExtraState, adam, adamw, nadam, nadamw
from jaxfuse._optim.families.lamb import lamb
from jaxfuse._optim.families.lars import lars
from jaxfuse._optim.families.lion import lion
from jaxfuse._optim.families.muon import muon
from jaxfuse._optim.families.rmsprop import rmsprop
from jaxfuse._optim.families.schedule_free import (schedule_free_adamw, schedule_free_eval_params,
                                                   schedule_free_sgd)
from jaxfuse._optim.families.sgd import sgd
from jaxfuse._optim.fused import fused_step
from jaxfuse._optim.moments import QuantizedMoment
from jaxfuse._optim.spec import ExtraState
from jaxfuse._optim.state import convert_state, master_params
from jaxfuse._report.report import Report, report

try:  # as installed: the base version plus +cuXY or +cpu, what the build compiled
  __version__ = _metadata.version("jaxfuse")
except _metadata.PackageNotFoundError:  # source tree on sys.path without an install
  __version__ = "unknown"


def __getattr__(name: str):
  # jaxfuse.flax loads on first use (PEP 562): flax is an optional dependency that `import
  # jaxfuse` must not need (`jaxfuse.flax.TrainState` then works without an `import jaxfuse.flax`
  # of its own).
  if name == "flax":
    try:
      return _importlib.import_module("jaxfuse.flax")
    except ModuleNotFoundError as e:
      if e.name is None or e.name.split(".")[0] != "flax":
        raise
      # An AttributeError, so that hasattr(jaxfuse, "flax") and getattr(..., default) still work.
      raise AttributeError("jaxfuse.flax needs flax, an optional dependency: "
                           "pip install 'jaxfuse[flax]'") from e
  raise AttributeError(f"module 'jaxfuse' has no attribute {name!r}")


__all__ = [
    "AdamExtraState",
    "DecoderConfig",
    "DecoderModel",
    "DecoderWeights",
    "ExtraState",
    "KVCache",
    "Packed",
    "QuantizedMoment",
    "Report",
    "RopeScaling",
    "adagrad",
    "adam",
    "adamw",
    "backends",
    "clip_by_global_norm",
    "convert_state",
    "decode_step",
    "decoder_reference",
    "export_safety_checks",
    "fused_step",
    "generate",
    "global_norm",
    "init_cache",
    "lamb",
    "lars",
    "lion",
    "muon",
    "load_hf",
    "master_params",
    "nadam",
    "multi_steps",
    "nadamw",
    "pack",
    "persistent_decoder",
    "prefill",
    "quantize",
    "quantize_weights",
    "report",
    "rmsprop",
    "schedule_free_adamw",
    "schedule_free_eval_params",
    "schedule_free_sgd",
    "sgd",
    "unpack",
]
