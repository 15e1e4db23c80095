"""Persistent decoder: one fused decode step of a Llama/Qwen-style decoder stack.

``persistent_decoder(x, positions, w, cache, cfg)`` runs every layer of the stack for one new token
per batch row in a single XLA custom call (``jaxfuse_decoder``): on CUDA one persistent cooperative
kernel launch per step, on CPU a thread-pooled handler. Per layer and batch row ``b`` at
``p = positions[b]``::

    a = rmsnorm(h) * attn_norm[l]              rmsnorm(h) = h * rsqrt(mean(h^2) + eps), fp32
    q, k, v = a @ wq[l], a @ wk[l], a @ wv[l]  (+ q_bias[l], k_bias[l], v_bias[l] if qkv_bias)
                                               split into heads of head_dim
    q, k = rmsnorm(q) * q_norm[l], rmsnorm(k) * k_norm[l]   per head, only if qk_norm
    q, k = rope(q, p), rope(k, p)              Llama "rotate half": pairs (i, i + hd/2),
                                               angle = p * inv_freq[i] (cfg.rope_inv_freq():
                                               rope_theta^(-2i/hd), scaled by rope_scaling)
    cache.k[l, b, p], cache.v[l, b, p] = k, v  (rounded to the cache dtype)
    attn = softmax(q . K[0..p] / sqrt(hd)) V   query head j uses kv head j // (H / KV)
    h = h + attn @ wo[l]
    m = rmsnorm(h) * mlp_norm[l]
    h = h + (silu(m @ w_gate[l]) * (m @ w_up[l])) @ w_down[l]

and the output is ``h`` after the last layer (no final norm, no LM head). ``x``, the weights and the
cache share one dtype (float32, bfloat16 or float16); all arithmetic and accumulation is fp32.
With ``cfg.quantization`` ("int8" or "fp8", see :func:`jaxfuse.quantize`) the seven matrices are
int8 or float8_e4m3fn with a float32 scale per output column (``w.wq_scale`` ...), and each
``a @ w`` above is ``(a @ float(w)) * scale``: the weights are widened in registers, never
materialized in another dtype.

Out-of-range positions (negative or ``>= max_seq_len``): when the positions are concrete (NumPy
or a jax.Array, also as a constant under a trace), :func:`persistent_decoder` raises ValueError
naming the first bad row. Traced positions (under jit, vmap, scan...) cannot be checked before the
kernel runs: such a row never touches the cache (its cache stays bitwise unchanged) and its output
row is NaN; the other rows are unaffected. With ``check_positions=True`` a traced call also emits
a :func:`jax.experimental.checkify.check` naming the first bad row, to be run under
:func:`~jax.experimental.checkify.checkify` (the default adds nothing to the program)::

  step = functools.partial(persistent_decoder, cfg=cfg, check_positions=True)
  err, (h, cache) = checkify.checkify(jax.jit(step))(x, positions, w, cache)
  err.throw()  # JaxRuntimeError: persistent_decoder: positions[3] = 4096 is outside [0, 4096) ...

The cache is updated in place when it is donated (``jax.jit(..., donate_argnums=...)``); the
k/v operands are aliased to the k/v results of the custom call.

Implementation notes. The op is built from public APIs only: :func:`jax.ffi.ffi_call` (the custom
call, with ``input_output_aliases`` for the cache), wrapped in
:class:`jax.custom_batching.custom_vmap` (vmap folds the mapped axis into the kernel's batch
dimension; the weights must be unmapped) and in :class:`jax.custom_jvp` (whose rule raises: the
kernel is not differentiable). The call's C++/Python contract, defined once on the C++ side
(``DecoderOp::contract()`` in csrc/decoder/decoder.h), is read at import: operand and
result names in call order (a name in both is aliased), the attribute names (the
:class:`DecoderConfig` fields) and their types, and the workspace size.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import checkify

from jaxfuse._core import ffi as _ffi
from jaxfuse._core import partition as _partition

__all__ = ["DecoderConfig", "DecoderWeights", "KVCache", "RopeScaling", "persistent_decoder",
           "decoder_reference"]

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
    return _weight_shapes(self)

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


# ---- the C++ contract (DecoderOp::contract() in csrc/decoder/decoder.h) -------------

_CONTRACT = _ffi.contract("jaxfuse_decoder")
_OPERANDS_BEFORE = ("x", "positions", "rope_inv_freq")  # then the weights, then _CACHES
_CACHES = ("k_cache", "v_cache")
# The whole-model step's operands (empty in a layers-only call), after the caches.
_MODEL_OPERANDS = ("tokens", "embed", "final_norm", "lm_head", "lm_head_scale", "sample_key")
_RESULTS = ("out", "k_cache", "v_cache", "logits", "next_tokens", "workspace")
_STEP_ATTRIBUTES = ("model_step", "sample", "temperature", "top_k", "top_p")
# Config fields that are not attributes: they define the rope_inv_freq operand, and the
# matrices' dtype (the attribute is the property ``quantized``).
_NOT_ATTRIBUTES = ("rope_theta", "rope_scaling", "quantization")
_DERIVED_ATTRIBUTES = ("quantized",)
_WEIGHT_KIND_NAMES = ("model", "matrix", "scale")


def _check_contract(contract: _ffi.Contract) -> None:
  """Checks that the C++ contract of ``jaxfuse_decoder`` names what this module passes.

  Operands and results are passed by name, in the contract's order, so what must agree is the
  names: the operands are x, positions, rope_inv_freq, the :class:`DecoderWeights` fields (in
  field order), the two caches and the whole-model step's (_MODEL_OPERANDS); the results are out,
  the two caches (aliased in place), the logits, the next tokens and the workspace; the
  attributes are the :class:`DecoderConfig` fields but the RoPE ones (which define the
  rope_inv_freq operand) and ``quantization`` (whose attribute is ``quantized``), and the step's
  (_STEP_ATTRIBUTES).

  Args:
    contract: the contract, from ``jaxfuse._core.ffi.contract("jaxfuse_decoder")``.

  Raises:
    ImportError: the contract and this module disagree (a C++ change not made here, or a stale
      build).
  """
  names = contract.names
  operands, results, weights = names["operands"], names["results"], names["weights"]
  attrs = names["size_attrs"] + names["f32_attrs"] + names["bool_attrs"]
  fields = tuple(f.name for f in dataclasses.fields(DecoderConfig)
                 if f.name not in _NOT_ATTRIBUTES) + _DERIVED_ATTRIBUTES
  problems = []
  if (weights != DecoderWeights._fields
      or operands != _OPERANDS_BEFORE + weights + _CACHES + _MODEL_OPERANDS
      or tuple(names["model_operands"]) != _MODEL_OPERANDS):
    problems.append(f"operands {operands} are not x, positions, rope_inv_freq, the DecoderWeights "
                    f"fields {DecoderWeights._fields} in that order, k_cache, v_cache and "
                    f"{_MODEL_OPERANDS}")
  if not set(names["weight_flags"]) <= {"always", *names["bool_attrs"]}:
    problems.append(f"weight flags {names['weight_flags']} are not 'always' or bool attributes")
  if not set(names["weight_kinds"]) <= set(_WEIGHT_KIND_NAMES):
    problems.append(f"weight kinds {names['weight_kinds']} are not in {_WEIGHT_KIND_NAMES}")
  if sorted(results) != sorted(_RESULTS):
    problems.append(f"results {results} are not {_RESULTS} in some order")
  if sorted(attrs) != sorted(fields):
    problems.append(f"attributes {attrs} are not the DecoderConfig fields {fields}")
  step_attrs = names["step_bool_attrs"] + names["step_i64_attrs"] + names["step_f32_attrs"]
  if sorted(step_attrs) != sorted(_STEP_ATTRIBUTES):
    problems.append(f"step attributes {step_attrs} are not {_STEP_ATTRIBUTES}")
  if problems:
    raise ImportError("jaxfuse.decoder: the C++ contract of jaxfuse_decoder disagrees with "
                      f"jaxfuse/_decode/decoder.py: {'; '.join(problems)} (rebuild jaxfuse, or "
                      "update decoder.py to match csrc/decoder/decoder.h)")


_check_contract(_CONTRACT)
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
  shapes = _CONTRACT.call("weight_shapes", qkv_bias=cfg.qkv_bias, qk_norm=cfg.qk_norm,
                          quantized=cfg.quantized, **sizes).shapes
  return {name: shapes[name] for name, flag in _WEIGHT_FLAGS.items()
          if flag == "always" or getattr(cfg, flag)}


def _workspace_bytes(cfg: DecoderConfig, batch: int, dtype, sample_filter: bool = False) -> int:
  """The size of the kernel's scratch buffer, from the C++ layout (``decoder_layout()``).

  Args:
    cfg: the decoder configuration.
    batch: the number of rows of one call.
    dtype: the dtype of ``x``, the weights and the cache.
    sample_filter: whether the call's draw is filtered (top-k or top-p): the CUDA kernel's
      search for each row's threshold then lives in the workspace.

  Returns:
    The workspace size in bytes.
  """
  sizes = {name: getattr(cfg, name) for name in _CONTRACT.names["size_attrs"]}
  layout = _CONTRACT.call("workspace", batch=batch, dtype_bytes=jnp.dtype(dtype).itemsize,
                          sample_filter=int(sample_filter), **sizes)
  return layout.numbers["bytes"]


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


def _attributes(cfg: DecoderConfig, head: _Head | None = None) -> dict[str, np.generic]:
  """The custom call's attributes: the config fields the contract names, in the contract's types,
  and the whole-model step's."""
  names = _CONTRACT.names
  sample = head is not None and head.sample
  step = {"model_step": head is not None, "sample": sample,
          "temperature": head.temperature if sample else 0.0,
          "top_k": (head.top_k or 0) if sample else 0,
          "top_p": 1.0 if not sample or head.top_p is None else head.top_p}
  return {**{name: np.int64(getattr(cfg, name)) for name in names["size_attrs"]},
          **{name: np.float32(getattr(cfg, name)) for name in names["f32_attrs"]},
          **{name: np.bool_(getattr(cfg, name)) for name in names["bool_attrs"]},
          **{name: np.bool_(step[name]) for name in names["step_bool_attrs"]},
          **{name: np.int64(step[name]) for name in names["step_i64_attrs"]},
          **{name: np.float32(step[name]) for name in names["step_f32_attrs"]}}


# ---- trace-time validation ---------------------------------------------------------------------

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


# ---- the custom call, its vmap rule and its (absent) derivative ---------------------------------

def _kernel_weights(w: DecoderWeights, cfg: DecoderConfig, dtype) -> DecoderWeights:
  """Every field an array: the optional weights ``cfg`` does not use become empty [L, 0] arrays
  of their kind's dtype (the kernel's contract: the flag attributes say which are read)."""
  return DecoderWeights(**{
      name: jnp.zeros((cfg.num_layers, 0), _weight_dtype(name, cfg, dtype)) if a is None else a
      for name, a in w._asdict().items()})


def _returned(head: _Head | None) -> tuple[str, ...]:
  """The results a call returns, in order: the layers' output, or a whole-model step's logits
  (and next tokens), then the caches."""
  if head is None:
    return ("out", "k_cache", "v_cache")
  return ("logits",) + (("next_tokens",) if head.sample else ()) + ("k_cache", "v_cache")


def _call_kernel(cfg: DecoderConfig, head: _Head | None, first, positions, inv_freq,
                 w: DecoderWeights, k_cache, v_cache, model=()):
  """One ``jaxfuse_decoder`` custom call on validated operands; returns the :func:`_returned`
  results of ``head``.

  ``first`` is x [B, D] (``head`` None: the layers alone), or the tokens [B] of a whole-model
  step, whose ``model`` holds the operands ``head.operands()`` names: embed and final_norm, then
  lm_head unless the head is tied, its row scales when it is quantized, and the sample key's data
  u32[2] when it samples. ``w`` holds None for the optional weights ``cfg`` does not use;
  ``inv_freq`` is cfg.rope_inv_freq(). Operands and results are matched to the
  call's slots by name, in the contract's order; the cache operands alias the cache results, and
  the workspace result is dropped. Sharded operands split over the batch (the rows, the caches'
  batch axis; weights replicated): each device decodes its own rows into its own part of the
  cache (_partition.partitioned_call). The empty stand-ins of the unused operands are made inside
  the body, on each device: a zero-size operand of a shard_map segfaults jaxlib 0.11.2's
  compiler.
  """
  names = _CONTRACT.names
  used = jax.tree.structure(w)  # None (no leaf) where a weight is unused
  n_weights = used.num_leaves

  def body(shards, first, positions, inv_freq, *rest):
    del shards  # rows are independent
    k_cache, v_cache = rest[n_weights:n_weights + 2]
    dtype, B, D = k_cache.dtype, positions.shape[0], cfg.hidden_size
    weights = _kernel_weights(used.unflatten(rest[:n_weights]), cfg, dtype)
    operands = {"x": first, "positions": positions, "rope_inv_freq": inv_freq,
                **weights._asdict(), "k_cache": k_cache, "v_cache": v_cache,
                "tokens": jnp.zeros((0,), jnp.int32), "embed": jnp.zeros((0, D), dtype),
                "final_norm": jnp.zeros((0,), dtype), "lm_head": jnp.zeros((0, D), dtype),
                "lm_head_scale": jnp.zeros((0,), jnp.float32),
                "sample_key": jnp.zeros((0,), jnp.uint32)}
    if head is not None:
      operands.update(x=jnp.zeros((B, 0), dtype), tokens=first,
                      **dict(zip(head.operands(), rest[n_weights + 2:], strict=True)))
    vocab = operands["embed"].shape[0]
    sampled = B if head is not None and head.sample else 0
    workspace = (_workspace_bytes(cfg, B, dtype, head is not None and head.sample_filter),)
    results = {"out": jax.ShapeDtypeStruct((B, D), dtype),
               "k_cache": jax.ShapeDtypeStruct(k_cache.shape, k_cache.dtype),
               "v_cache": jax.ShapeDtypeStruct(v_cache.shape, v_cache.dtype),
               "logits": jax.ShapeDtypeStruct((B, vocab), jnp.float32),
               "next_tokens": jax.ShapeDtypeStruct((sampled,), jnp.int32),
               "workspace": jax.ShapeDtypeStruct(workspace, jnp.uint8)}
    call = jax.ffi.ffi_call(_ffi.target("jaxfuse_decoder"),
                            [results[n] for n in names["results"]], input_output_aliases=_ALIASES)
    outs = dict(zip(names["results"], call(*[operands[n] for n in names["operands"]],
                                           **_attributes(cfg, head))))
    return tuple(outs[n] for n in _returned(head))

  operands = [first, positions, inv_freq, *jax.tree.leaves(w), k_cache, v_cache, *model]
  return tuple(_partition.partitioned_call("persistent_decoder", body,
                                           _partition_layout(cfg, head), operands))


# Batch-sharded decode: the batch axis ("b") may be split over devices; everything else (the
# weights, the model and cache-length axes) must be whole on each device.
_CACHE_DIMS = (None, "b", None, None, None)  # [L, B, S, KV, hd]
_MODEL_DIMS = {"embed": (None, None), "final_norm": (None,), "lm_head": (None, None),
               "lm_head_scale": (None,), "sample_key": (None,)}


def _partition_layout(cfg: DecoderConfig, head: _Head | None) -> _partition.Layout:
  """x (or a whole-model step's tokens), positions, rope_inv_freq, the weights ``cfg`` uses (in
  field order), the two caches, and a whole-model step's embedding, final norm, untied head and
  sample key (:meth:`_Head.operands`); the :func:`_returned` results."""
  shapes = cfg.weight_shapes()
  used = tuple(name for name in DecoderWeights._fields if name in shapes)
  first = ("x", ("b", None)) if head is None else ("tokens", ("b",))
  model = tuple((name, _MODEL_DIMS[name]) for name in _model_names(head))
  operands = ((first, ("positions", ("b",)), ("rope_inv_freq", (None,)))
              + tuple((n, (None,) * len(shapes[n])) for n in used)
              + (("cache.k", _CACHE_DIMS), ("cache.v", _CACHE_DIMS)) + model)
  result_dims = {"out": ("b", None), "logits": ("b", None), "next_tokens": ("b",),
                 "k_cache": _CACHE_DIMS, "v_cache": _CACHE_DIMS}
  return _partition.Layout(operands=tuple(dims for _, dims in operands),
                           results=tuple(result_dims[n] for n in _returned(head)),
                           names=tuple(name for name, _ in operands))


def _fold(size: int, a, batched: bool, axis: int):
  """[size, ...] (broadcast from [...] when unmapped) -> the size axis merged into ``axis``."""
  if not batched:
    a = jnp.broadcast_to(a, (size,) + a.shape)
  a = jnp.moveaxis(a, 0, axis)
  return a.reshape(a.shape[:axis] + (a.shape[axis] * a.shape[axis + 1],) + a.shape[axis + 2:])


def _unfold(size: int, batch: int, a, axis: int):
  """The inverse of :func:`_fold`: ``axis`` split into (size, batch), size moved first."""
  return jnp.moveaxis(a.reshape(a.shape[:axis] + (size, batch) + a.shape[axis + 1:]), axis, 0)


def _vmap_rule(cfg: DecoderConfig, head: _Head | None, step, axis_size: int, in_batched, first,
               positions, inv_freq, weights: DecoderWeights, k_cache, v_cache, model):
  """The ``custom_vmap`` rule: vmap folds the mapped axis into the kernel's batch dimension.

  Mapped operands arrive with the mapped axis first; an unmapped x (or tokens), positions or
  cache is broadcast. The mapped axis becomes the major part of the batch axis (axis 0 of x,
  tokens and positions, axis 1 of the caches [L, B, S, KV, hd]), so one call runs
  ``axis_size * B`` rows, and the results are split back with the mapped axis first. A nested
  vmap folds one more axis the same way. (A sampling step's draws are then those of the folded
  rows: row b of mapped element i draws as row i * B + b.)

  Raises:
    NotImplementedError: a weight (or the embedding, head or sample key) is mapped.
  """
  first_b, positions_b, inv_freq_b, weights_b, k_b, v_b, model_b = in_batched
  unmapped = (("rope_inv_freq", inv_freq_b), *zip(DecoderWeights._fields, weights_b),
              *zip(_model_names(head), model_b))
  for name, batched in unmapped:
    if batched:
      raise NotImplementedError(
          f"persistent_decoder: vmap over the weights ({name}) is not supported; map only x (or "
          "tokens), positions and the cache (their mapped axis is folded into the batch)")
  batch = positions.shape[-1]
  fold = functools.partial(_fold, axis_size)
  outs = step(fold(first, first_b, 0), fold(positions, positions_b, 0), inv_freq, weights,
              fold(k_cache, k_b, 1), fold(v_cache, v_b, 1), model)
  unfold = functools.partial(_unfold, axis_size, batch)
  batch_axis = {"out": 0, "logits": 0, "next_tokens": 0, "k_cache": 1, "v_cache": 1}
  names = _returned(head)
  return tuple(unfold(o, batch_axis[n]) for o, n in zip(outs, names)), (True,) * len(names)


def _model_names(head: _Head | None) -> tuple[str, ...]:
  """The names of a whole-model step's ``model`` operands (none for the layers alone)."""
  return () if head is None else head.operands()


def _not_differentiable(primals, tangents):
  """The ``custom_jvp`` rule: the kernel has no derivative (its math is in decoder_reference)."""
  del primals, tangents
  raise NotImplementedError(_NOT_DIFFERENTIABLE)


@functools.cache
def _decoder_step(cfg: DecoderConfig, head: _Head | None = None):
  """The decode step for ``cfg``: ``(first, positions, inv_freq, weights, k_cache, v_cache,
  model) -> the _returned(head) results``, ``weights`` with None for the weights ``cfg`` does not
  use; ``first`` and ``model`` as :func:`_call_kernel` takes them (x and () for the layers alone).

  The custom call with a vmap rule (:class:`jax.custom_batching.custom_vmap`) inside a
  :class:`jax.custom_jvp` whose rule raises, so that jax.grad, jax.jvp, jax.vjp and friends fail
  with a clear message, also under vmap, instead of "Differentiation rule for 'ffi_call' not
  implemented". The custom_jvp is outermost, as ``custom_vmap`` has no reverse mode of its own.
  The whole is jitted so that an eager call is one cached dispatch (not a retrace of both custom
  wrappers per call); inside an outer jit the inner one is inlined, aliasing included.
  """
  step = jax.custom_batching.custom_vmap(functools.partial(_call_kernel, cfg, head))
  step.def_vmap(functools.partial(_vmap_rule, cfg, head, step))
  differentiable = jax.custom_jvp(step)
  differentiable.defjvp(_not_differentiable)
  return jax.jit(differentiable)


# ---- public API --------------------------------------------------------------------------------

def persistent_decoder(x, positions, w: DecoderWeights, cache: KVCache, cfg: DecoderConfig, *,
                       check_positions: bool = False):
  """One decode step of every layer of the stack, in one custom call.

  See the module docstring for the math and the handling of out-of-range positions. Works under
  jit (donate the cache for in-place updates), vmap (mapped over x, positions and the cache; the
  mapped axis is folded into the batch), lax.scan, lax.while_loop and eagerly.

  Args:
    x: [B, D] hidden state of the new token per row (float32, bfloat16 or float16).
    positions: int32 [B], the cache slot each row writes and attends up to (inclusive).
    w: the stacked layer weights, in the dtype of ``x`` (with ``cfg.quantization``, the matrices
      int8 or float8_e4m3fn and their scales float32).
    cache: the KV cache, [L, B, max_seq_len, KV, hd] each, in the dtype of ``x``.
    cfg: the static configuration of the stack.
    check_positions: with traced positions, emit a :func:`jax.experimental.checkify.check` that
      every position is in [0, max_seq_len) (run the caller under ``checkify.checkify``). Concrete
      positions are always checked.

  Returns:
    ``(h_out, new_cache)``: the [B, D] hidden state after the last layer and the updated cache; a
    row whose traced position is out of range gets NaN and its cache is left unchanged.

  Raises:
    TypeError: an argument has the wrong type or dtype.
    ValueError: an argument has the wrong shape, or a concrete position is outside
      [0, max_seq_len).
    NotImplementedError: when differentiated (use :func:`decoder_reference`), or vmapped over
      the weights.
  """
  _check_structure(w, cache, cfg)
  given = positions  # checked as given: no device round trip, no int64 -> int32 wrap-around
  x, positions = jnp.asarray(x), jnp.asarray(positions)
  w = DecoderWeights(*(None if a is None else jnp.asarray(a) for a in w))
  cache = KVCache(jnp.asarray(cache.k), jnp.asarray(cache.v))
  _check_operands(x, positions, w, cache, cfg)
  _check_rows("persistent_decoder", "positions", given, 0, cfg.max_seq_len,
              f"[0, {cfg.max_seq_len}) (max_seq_len)", check_positions)
  inv_freq = jnp.asarray(cfg.rope_inv_freq())
  out, k_cache, v_cache = _decoder_step(cfg)(x, positions, inv_freq, w, cache.k, cache.v, ())
  return out, KVCache(k_cache, v_cache)


def decoder_reference(x, positions, w: DecoderWeights, cache: KVCache, cfg: DecoderConfig, *,
                      activation_dtype=None):
  """Pure-JAX reference with the semantics of :func:`persistent_decoder`.

  Also accepts a multi-token prefill: ``x`` [B, T, D] with ``positions`` [B, T] (distinct per
  row); every token is written to the cache first, then each attends to cache positions up to its
  own (so a prefill from position 0 is causal attention). Returns outputs of the same rank as x.

  By default every GEMV input is fp32 (as in the kernels); ``activation_dtype`` (e.g. bfloat16)
  instead rounds GEMV and attention inputs to that dtype with fp32 accumulation, the usual way a
  plain JAX decoder is written (used as the speed baseline in the benchmark).

  Args:
    x: [B, D] (one step) or [B, T, D] (prefill) hidden states.
    positions: [B] or [B, T] cache slots.
    w: the stacked layer weights.
    cache: the KV cache.
    cfg: the static configuration of the stack.
    activation_dtype: ``None`` (fp32 GEMV inputs) or the dtype GEMV and attention inputs are
      rounded to.

  Returns:
    ``(h_out, new_cache)``, ``h_out`` of the rank of ``x``.
  """
  _check_structure(w, cache, cfg)
  _check_present("decoder_reference", w, cfg)
  x = jnp.asarray(x)
  positions = jnp.asarray(positions, jnp.int32)
  single = x.ndim == 2
  if single:
    x, positions = x[:, None, :], positions[:, None]
  B = x.shape[0]
  dt = x.dtype
  S = cfg.max_seq_len
  mm = functools.partial(_ref_matmul, activation_dtype=activation_dtype)
  rmsnorm = functools.partial(_ref_rmsnorm, eps=cfg.rms_norm_eps)
  rope = _ref_rope(positions, cfg)
  valid = (positions >= 0) & (positions < S)  # [B, T]
  slot = jnp.where(valid, positions, S)  # out of bounds -> dropped by the scatter
  rows = jnp.arange(B)[:, None]
  h = x.astype(jnp.float32)
  kc, vc = cache.k, cache.v
  for l in range(cfg.num_layers):
    wl = jax.tree.map(lambda a: a[l], w)  # noqa: B023 (called at once)
    linear = functools.partial(_ref_linear, mm, wl)
    q, k, v = _ref_qkv(linear, rmsnorm, wl, h, cfg)
    q, k = rope(q), rope(k)
    kl = kc[l].at[rows, slot].set(k.astype(dt), mode="drop")  # [B, S, KV, hd]
    vl = vc[l].at[rows, slot].set(v.astype(dt), mode="drop")
    kc, vc = kc.at[l].set(kl), vc.at[l].set(vl)
    o = _ref_attention(q, kl, vl, positions, valid, cfg, activation_dtype)
    h = _ref_mlp(linear, rmsnorm, wl, h + linear(o, "wo"))
  out = jnp.where(valid[..., None], h, jnp.nan).astype(dt)
  if single:
    out = out[:, 0]
  return out, KVCache(kc, vc)


def _ref_matmul(a, wl, activation_dtype):
  """[B, T, K] @ [K, N] -> fp32 (fp32 inputs, or inputs rounded to ``activation_dtype``)."""
  if activation_dtype is None:
    return jnp.einsum("btk,kn->btn", a, wl.astype(jnp.float32), precision=lax.Precision.HIGHEST)
  return jnp.einsum("btk,kn->btn", a.astype(activation_dtype), wl.astype(activation_dtype),
                    preferred_element_type=jnp.float32)


def _ref_linear(matmul, wl: DecoderWeights, a, name: str):
  """``a @ wl.<name>`` of one layer's weights by ``matmul``, times the matrix's per-column scales
  when it is quantized (after the sum over k, as the kernels apply them)."""
  y = matmul(a, getattr(wl, name))
  scale = getattr(wl, name + "_scale")
  return y if scale is None else y * scale


def _ref_qkv(linear, rmsnorm, wl: DecoderWeights, h, cfg: DecoderConfig):
  """One layer's q [B, T, H, hd], k and v [B, T, KV, hd] of the residual stream ``h`` [B, T, D]
  before RoPE, fp32: the attention RMSNorm, the projections by ``linear`` (of
  :func:`_ref_linear`'s signature, bound to the layer), the biases and the per-head q/k norms."""
  B, T, _ = h.shape
  a = rmsnorm(h, wl.attn_norm)
  q, k, v = linear(a, "wq"), linear(a, "wk"), linear(a, "wv")
  if cfg.qkv_bias:
    q, k, v = (t + b.astype(jnp.float32) for t, b in ((q, wl.q_bias), (k, wl.k_bias),
                                                     (v, wl.v_bias)))
  H, KV, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
  q, k, v = q.reshape(B, T, H, hd), k.reshape(B, T, KV, hd), v.reshape(B, T, KV, hd)
  if cfg.qk_norm:
    q, k = rmsnorm(q, wl.q_norm), rmsnorm(k, wl.k_norm)
  return q, k, v


def _ref_mlp(linear, rmsnorm, wl: DecoderWeights, h):
  """``h + (silu(m @ w_gate) * (m @ w_up)) @ w_down``, m = rmsnorm(h) * mlp_norm, fp32."""
  m = rmsnorm(h, wl.mlp_norm)
  g, u = linear(m, "w_gate"), linear(m, "w_up")
  return h + linear((g / (1.0 + jnp.exp(-g))) * u, "w_down")


def _ref_rmsnorm(h, wn, eps: float):
  """RMSNorm in fp32 of ``h`` [..., D] with the weight ``wn`` [D]."""
  f32 = jnp.float32
  return (h * lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True) + f32(eps))) * wn.astype(f32)


def _ref_rope(positions, cfg: DecoderConfig):
  """The RoPE of ``positions`` [B, T]: a function of [B, T, heads, hd] ("rotate half")."""
  half = cfg.head_dim // 2
  inv_freq = cfg.rope_inv_freq()
  angle = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)  # [B, T, hd/2]
  cos, sin = jnp.cos(angle)[:, :, None, :], jnp.sin(angle)[:, :, None, :]

  def rope(t):  # [B, T, heads, hd]
    x1, x2 = t[..., :half], t[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)

  return rope


def _ref_attention(q, kl, vl, positions, valid, cfg: DecoderConfig, activation_dtype):
  """Grouped-query attention of ``q`` [B, T, H, hd] over one layer's cache [B, S, KV, hd], each
  token up to its own position; returns [B, T, H * hd] in fp32 (zero for invalid tokens)."""
  f32, hi = jnp.float32, lax.Precision.HIGHEST
  B, T, H, hd = q.shape
  KV, S = cfg.num_kv_heads, cfg.max_seq_len
  mask = jnp.arange(S)[None, None, :] <= positions[:, :, None]  # [B, T, S]
  # Slots after every token's position are never read (whatever they hold, even NaN).
  seen = jnp.arange(S)[None, :] <= positions.max(axis=1)[:, None]
  seen = seen[:, :, None, None]  # [B, S, 1, 1]
  scale = f32(1.0 / np.sqrt(hd))
  qg = q.reshape(B, T, KV, H // KV, hd)
  if activation_dtype is None:
    s = jnp.einsum("btkgd,bskd->btkgs", qg, kl.astype(f32), precision=hi)
  else:
    s = jnp.einsum("btkgd,bskd->btkgs", qg.astype(activation_dtype), kl.astype(activation_dtype),
                   preferred_element_type=f32)
  s = jnp.where(mask[:, :, None, None, :], s * scale, -jnp.inf)
  s = jnp.where(valid[:, :, None, None, None], s, 0.0)  # keep invalid rows finite
  p = jax.nn.softmax(s, axis=-1)
  if activation_dtype is None:
    o = jnp.einsum("btkgs,bskd->btkgd", p, jnp.where(seen, vl.astype(f32), 0.0), precision=hi)
  else:
    o = jnp.einsum("btkgs,bskd->btkgd", p.astype(activation_dtype),
                   jnp.where(seen, vl, 0).astype(activation_dtype), preferred_element_type=f32)
  return jnp.where(valid[:, :, None, None, None], o, 0.0).reshape(B, T, H * hd)
