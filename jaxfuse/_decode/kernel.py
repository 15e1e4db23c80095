"""Persistent decoder: one fused decode step of a Llama/Qwen-style decoder stack.

``persistent_decoder(x, positions, w, cache, cfg)`` runs every layer of the stack for one new token
per batch row in a single XLA custom call (``jaxfuse_decoder``): on CUDA one persistent cooperative
kernel launch per step, or the same kernel launched once per stage (``schedule="stage_kernels"``),
on CPU a thread-pooled handler. Per layer and batch row ``b`` at
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
(``DecoderOp::contract()`` in csrc/decoder/decoder.h), is read at import and checked against
what this module passes: operand and result names in call order (a name in both is aliased), the
attribute names (the :class:`DecoderConfig` fields) and their types, and the workspace size. A
disagreement raises at the decoder's first use, not at import.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from jaxfuse._core import ffi as _ffi
from jaxfuse._core import partition as _partition
from jaxfuse._decode.checks import (_NOT_DIFFERENTIABLE, _check_operands, _check_rows,
                                    _check_structure)
from jaxfuse._decode.config import DecoderConfig, DecoderWeights, KVCache
from jaxfuse._decode.contract import (_ALIASES, _CONTRACT, _attributes, _check_schedule,
                                      _Head, _weight_dtype, _workspace_bytes)


# ---- the C++ contract against what this module passes ---------------------------------------------

_OPERANDS_BEFORE = ("x", "positions", "rope_inv_freq")  # then the weights, then _CACHES
_CACHES = ("k_cache", "v_cache")
# The whole-model step's operands (empty in a layers-only call), after the caches.
_MODEL_OPERANDS = ("tokens", "embed", "final_norm", "lm_head", "lm_head_scale", "sample_key")
_RESULTS = ("out", "k_cache", "v_cache", "logits", "next_tokens", "workspace")
_STEP_ATTRIBUTES = ("model_step", "sample", "timeline", "stage_kernels", "temperature", "top_k",
                    "top_p")
# Config fields that are not attributes: they define the rope_inv_freq operand, and the
# matrices' dtype (the attribute is the property ``quantized``).
_NOT_ATTRIBUTES = ("rope_theta", "rope_scaling", "quantization")
_DERIVED_ATTRIBUTES = ("quantized",)
_WEIGHT_KIND_NAMES = ("model", "matrix", "scale")


def _contract_problems(contract: _ffi.Contract) -> list[str]:
  """What the C++ contract of ``jaxfuse_decoder`` names differently from what jaxfuse._decode
  passes (empty when they agree).

  Operands and results are passed by name, in the contract's order, so what must agree is the
  names: the operands are x, positions, rope_inv_freq, the :class:`DecoderWeights` fields (in
  field order), the two caches and the whole-model step's (_MODEL_OPERANDS); the results are out,
  the two caches (aliased in place), the logits, the next tokens and the workspace; the
  attributes are the :class:`DecoderConfig` fields but the RoPE ones (which define the
  rope_inv_freq operand) and ``quantization`` (whose attribute is ``quantized``), and the step's
  (_STEP_ATTRIBUTES).

  Args:
    contract: the contract, from ``jaxfuse._core.ffi.contract("jaxfuse_decoder")``.
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
  return problems


# Checked at import, raised at the decoder's first use: a stale build or a C++ change not made
# here (in the decoder wing) leaves `import jaxfuse` and its optimizers working.
_CONTRACT_PROBLEMS = _contract_problems(_CONTRACT)


def _check_contract() -> None:
  """Raises RuntimeError naming how the C++ contract and jaxfuse/_decode disagree, if they do."""
  if _CONTRACT_PROBLEMS:
    raise RuntimeError("jaxfuse's decoder: the C++ contract of jaxfuse_decoder disagrees with "
                       f"jaxfuse/_decode: {'; '.join(_CONTRACT_PROBLEMS)} (rebuild jaxfuse, or "
                       "update jaxfuse/_decode/config.py and contract.py to match "
                       "csrc/decoder/decoder.h)")


def _kernel_weights(w: DecoderWeights, cfg: DecoderConfig, dtype) -> DecoderWeights:
  """Every field an array: the optional weights ``cfg`` does not use become empty [L, 0] arrays
  of their kind's dtype (the kernel's contract: the flag attributes say which are read)."""
  return DecoderWeights(**{
      name: jnp.zeros((cfg.num_layers, 0), _weight_dtype(name, cfg, dtype)) if a is None else a
      for name, a in w._asdict().items()})


def _returned(head: _Head | None, timeline: bool = False) -> tuple[str, ...]:
  """The results a call returns, in order: the layers' output, or a whole-model step's logits
  (and next tokens), then the caches (then, recording a timeline, the workspace)."""
  if head is None:
    names = ("out", "k_cache", "v_cache")
  else:
    names = ("logits",) + (("next_tokens",) if head.sample else ()) + ("k_cache", "v_cache")
  return names + (("workspace",) if timeline else ())


def _call_kernel(cfg: DecoderConfig, head: _Head | None, timeline: bool, schedule: str, first,
                 positions, inv_freq, w: DecoderWeights, k_cache, v_cache, model=()):
  """One ``jaxfuse_decoder`` custom call on validated operands; returns the
  :func:`_returned` results of ``head`` and ``timeline``.

  ``first`` is x [B, D] (``head`` None: the layers alone), or the tokens [B] of a whole-model
  step, whose ``model`` holds the operands ``head.operands()`` names: embed and final_norm, then
  lm_head unless the head is tied, its row scales when it is quantized, and the sample key's data
  u32[2] when it samples. ``w`` holds None for the optional weights ``cfg`` does not use;
  ``inv_freq`` is cfg.rope_inv_freq(). Operands and results are matched to the
  call's slots by name, in the contract's order; the cache operands alias the cache results, and
  the workspace result is dropped unless the call records a timeline (``timeline``: one device's
  call, as the operands come). Sharded operands split over the batch (the rows, the caches'
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
    workspace = (_workspace_bytes(cfg, B, dtype, head is not None and head.sample_filter,
                                  timeline),)
    results = {"out": jax.ShapeDtypeStruct((B, D), dtype),
               "k_cache": jax.ShapeDtypeStruct(k_cache.shape, k_cache.dtype),
               "v_cache": jax.ShapeDtypeStruct(v_cache.shape, v_cache.dtype),
               "logits": jax.ShapeDtypeStruct((B, vocab), jnp.float32),
               "next_tokens": jax.ShapeDtypeStruct((sampled,), jnp.int32),
               "workspace": jax.ShapeDtypeStruct(workspace, jnp.uint8)}
    call = jax.ffi.ffi_call(_ffi.target("jaxfuse_decoder"),
                            [results[n] for n in names["results"]], input_output_aliases=_ALIASES)
    outs = dict(zip(names["results"], call(*[operands[n] for n in names["operands"]],
                                           **_attributes(cfg, head, timeline, schedule))))
    return tuple(outs[n] for n in _returned(head, timeline))

  operands = [first, positions, inv_freq, *jax.tree.leaves(w), k_cache, v_cache, *model]
  if timeline:
    return body(None, *operands)
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
def _decoder_step(cfg: DecoderConfig, head: _Head | None = None, timeline: bool = False,
                  schedule: str = "persistent"):
  """The decode step for ``cfg``: ``(first, positions, inv_freq, weights, k_cache, v_cache,
  model) -> the _returned(head, timeline) results``, ``weights`` with None for the weights
  ``cfg`` does not use; ``first`` and ``model`` as :func:`_call_kernel` takes them (x and () for
  the layers alone), on the CUDA kernel's ``schedule`` (SCHEDULES). A step that records a
  timeline is the custom call alone (jitted): no vmap, no sharding.

  The custom call with a vmap rule (:class:`jax.custom_batching.custom_vmap`) inside a
  :class:`jax.custom_jvp` whose rule raises, so that jax.grad, jax.jvp, jax.vjp and friends fail
  with a clear message, also under vmap, instead of "Differentiation rule for 'ffi_call' not
  implemented". The custom_jvp is outermost, as ``custom_vmap`` has no reverse mode of its own.
  The whole is jitted so that an eager call is one cached dispatch (not a retrace of both custom
  wrappers per call); inside an outer jit the inner one is inlined, aliasing included.
  """
  _check_contract()
  if timeline:
    return jax.jit(functools.partial(_call_kernel, cfg, head, True, schedule))
  step = jax.custom_batching.custom_vmap(functools.partial(_call_kernel, cfg, head, False,
                                                           schedule))
  step.def_vmap(functools.partial(_vmap_rule, cfg, head, step))
  differentiable = jax.custom_jvp(step)
  differentiable.defjvp(_not_differentiable)
  return jax.jit(differentiable)


# ---- public API ----------------------------------------------------------------------------------

def persistent_decoder(x, positions, w: DecoderWeights, cache: KVCache, cfg: DecoderConfig, *,
                       check_positions: bool = False, schedule: str = "persistent"):
  """One decode step of every layer of the stack, in one custom call.

  See the module docstring for the math and the handling of out-of-range positions. Works under
  jit (donate the cache for in-place updates), vmap (mapped over x, positions and the cache; the
  mapped axis is folded into the batch), lax.scan, lax.while_loop and eagerly.

  On CUDA the call runs one kernel's stages in one of two schedules (``schedule``), with the
  same work split over the same grid, so the two give the same bits:

  - ``"persistent"``: every stage in one cooperative launch; between stages its blocks poll the
    counters of the work groups whose results they need (a group's last split finishes it and
    releases it). One launch per step; each boundary costs that chain of finish, release and
    polls.
  - ``"stage_kernels"``: one launch per stage (the embedding, five a layer, the LM head and the
    draw), each a programmatic dependent launch of the one before (Hopper and newer; a plain
    launch before): its blocks start as the previous launch's leave, copy their first weights
    into shared memory and then wait for it. Each boundary costs the previous launch's tail less
    what those weights overlap of it; the step costs a launch per stage on the host, or none
    where XLA captures it into a command buffer (a CUDA graph).

  The CPU handler has one schedule and takes either.

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
    schedule: the CUDA kernel's schedule, ``"persistent"`` or ``"stage_kernels"`` (above).

  Returns:
    ``(h_out, new_cache)``: the [B, D] hidden state after the last layer and the updated cache; a
    row whose traced position is out of range gets NaN and its cache is left unchanged.

  Raises:
    TypeError: an argument has the wrong type or dtype.
    ValueError: an argument has the wrong shape, a concrete position is outside
      [0, max_seq_len), or ``schedule`` is not one of the two.
    NotImplementedError: when differentiated (use :func:`decoder_reference`), or vmapped over
      the weights.
  """
  _check_schedule("persistent_decoder", schedule)
  x, positions, w, cache = _checked_operands(x, positions, w, cache, cfg, check_positions)
  inv_freq = jnp.asarray(cfg.rope_inv_freq())
  step = _decoder_step(cfg, None, False, schedule)
  out, k_cache, v_cache = step(x, positions, inv_freq, w, cache.k, cache.v, ())
  return out, KVCache(k_cache, v_cache)


def _checked_operands(x, positions, w: DecoderWeights, cache: KVCache, cfg: DecoderConfig,
                      check_positions: bool = False):
  """:func:`persistent_decoder`'s operands as arrays, checked (its Raises)."""
  _check_structure(w, cache, cfg)
  given = positions  # checked as given: no device round trip, no int64 -> int32 wrap-around
  x, positions = jnp.asarray(x), jnp.asarray(positions)
  w = DecoderWeights(*(None if a is None else jnp.asarray(a) for a in w))
  cache = KVCache(jnp.asarray(cache.k), jnp.asarray(cache.v))
  _check_operands(x, positions, w, cache, cfg)
  _check_rows("persistent_decoder", "positions", given, 0, cfg.max_seq_len,
              f"[0, {cfg.max_seq_len}) (max_seq_len)", check_positions)
  return x, positions, w, cache
