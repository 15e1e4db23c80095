"""Text generation with the persistent decoder: prefill, one decode step, and a whole generation
in one jitted call.

  cache = init_cache(model, batch, max_seq_len)
  logits, cache = prefill(model, prompt_tokens, prompt_lengths, cache)   # plain XLA
  logits, cache = decode_step(model, tokens, positions, cache)           # one kernel, whole model
  tokens, lengths = generate(model, prompt_tokens, prompt_lengths, max_new_tokens, ...)

:func:`generate` runs the prefill (all prompt tokens at once, causal, in plain XLA) and then
every decode step inside one ``lax.while_loop`` in one ``jax.jit``: per step, record each row's
token, stop the rows that emitted a stop token, and run one kernel call for the whole model: the
embedding gather, every layer (the KV cache updated in place: it is a loop carry), the final norm,
the LM head and the next token's draw (greedy when ``temperature == 0``, else from
softmax(logits / temperature) restricted by ``top_k`` and ``top_p``: the draw of
:func:`jax.random.categorical` with the step's key, after the filters of :func:`_sample`). A key
the kernel cannot draw with (not threefry2x32) has the kernel return the logits and XLA draw.
The loop ends when every row has stopped or ``max_new_tokens`` are out. Stopped rows decode at
position -1: the kernel neither reads nor writes their cache.

``decoder="reference"`` runs the same loop with :func:`jaxfuse.decoder_reference` (plain XLA) in
place of the kernel: the baseline the kernel is compared with.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxfuse._decode.checks import _check_layers, _check_rows, _concrete
from jaxfuse._decode.config import DecoderWeights, KVCache, _SUPPORTED
from jaxfuse._decode.contract import _check_schedule, _Head
from jaxfuse._decode.kernel import _decoder_step
from jaxfuse._decode.model import DecoderModel
from jaxfuse._decode.prefill import prefill_stack
from jaxfuse._decode.reference import decoder_reference

__all__ = ["init_cache", "prefill", "decode_step", "generate"]

_DECODERS = ("persistent", "reference")
_FILL = -1  # tokens past a row's length


# ---- validation ---------------------------------------------------------------------------------

def _check_model(fn: str, model) -> None:
  """The model's non-layer weights agree with its config (the layers are checked by the decoder)."""
  if not isinstance(model, DecoderModel):
    raise TypeError(f"{fn}: model must be a jaxfuse.DecoderModel (e.g. from jaxfuse.load_hf), got "
                    f"{type(model).__name__}")
  if not isinstance(model.layers, DecoderWeights):
    raise TypeError(f"{fn}: model.layers must be a jaxfuse.DecoderWeights")
  D, dtype = model.config.hidden_size, model.dtype
  heads = {"embed": model.embed, "lm_head": model.lm_head}
  for name, a in heads.items():
    if a is not None and (a.ndim != 2 or a.shape[1] != D):
      raise ValueError(f"{fn}: model.{name} has shape {tuple(a.shape)}, expected (vocab, {D})")
  if model.lm_head is not None and model.lm_head.shape != model.embed.shape:
    raise ValueError(f"{fn}: model.lm_head has shape {tuple(model.lm_head.shape)}, expected the "
                     f"embedding's {tuple(model.embed.shape)}")
  if model.final_norm.shape != (D,):
    raise ValueError(f"{fn}: model.final_norm has shape {tuple(model.final_norm.shape)}, "
                     f"expected ({D},)")
  if jnp.dtype(model.final_norm.dtype) != dtype:
    raise TypeError(f"{fn}: model.final_norm has dtype {model.final_norm.dtype}, expected the "
                    f"embedding's {dtype}")
  if model.head_quantized:
    _check_quantized_head(fn, model)
  elif model.lm_head is not None and jnp.dtype(model.lm_head.dtype) != dtype:
    raise TypeError(f"{fn}: model.lm_head has dtype {model.lm_head.dtype}, expected the "
                    f"embedding's {dtype}")


def _check_quantized_head(fn: str, model: DecoderModel) -> None:
  """A quantized head (lm_head_scale set): its own rows in the layer matrices' format, float32
  scales [vocab]."""
  cfg, scale = model.config, model.lm_head_scale
  if model.lm_head is None:
    raise ValueError(f"{fn}: model.lm_head_scale is given but model.lm_head is None (a quantized "
                     "head has its own rows: see jaxfuse.quantize)")
  if not cfg.quantized:
    raise ValueError(f"{fn}: model.lm_head_scale is given but the layers are not quantized (a "
                     "quantized head takes the layer matrices' format: see jaxfuse.quantize)")
  want = cfg.matrix_dtype(model.dtype)
  if jnp.dtype(model.lm_head.dtype) != want:
    raise TypeError(f"{fn}: model.lm_head has dtype {model.lm_head.dtype}, expected {want} "
                    f"(the quantized head takes the layers' format, "
                    f"cfg.quantization={cfg.quantization!r})")
  if not hasattr(scale, "dtype") or not hasattr(scale, "shape"):
    raise TypeError(f"{fn}: model.lm_head_scale must be a float32 array [{model.vocab_size}], got "
                    f"{type(scale).__name__}")
  if scale.shape != (model.vocab_size,) or jnp.dtype(scale.dtype) != jnp.float32:
    raise ValueError(f"{fn}: model.lm_head_scale is {scale.dtype}{list(scale.shape)}, expected "
                     f"float32[{model.vocab_size}] (a scale per vocabulary row)")


def _check_cache(fn: str, model: DecoderModel, cache, batch: int) -> None:
  if not isinstance(cache, KVCache):
    raise TypeError(f"{fn}: cache must be a jaxfuse.KVCache (see jaxfuse.init_cache), got "
                    f"{type(cache).__name__}")
  L, _, S_max, KV, hd = model.config.cache_shape(batch)
  S = cache.k.shape[2] if cache.k.ndim == 5 else None
  if S is None or S > S_max or cache.k.shape != (L, batch, S, KV, hd):
    raise ValueError(f"{fn}: cache.k has shape {tuple(cache.k.shape)}, expected ({L}, {batch}, S, "
                     f"{KV}, {hd}) with S <= {S_max} (layers, batch, cache length, kv_heads, "
                     "head_dim)")


def _check_prompts(fn: str, model: DecoderModel, tokens, lengths,
                   check_lengths: bool = False) -> None:
  """Shapes and dtypes; the values too when they are concrete (out-of-range ids or lengths
  would otherwise be clamped silently by the embedding gather). ``check_lengths``: a checkify
  check of traced lengths (:func:`jaxfuse._decode.checks._check_rows`)."""
  if tokens.ndim != 2 or not jnp.issubdtype(tokens.dtype, jnp.integer):
    raise ValueError(f"{fn}: prompt_tokens must be an integer array [batch, prompt_len], got "
                     f"{tokens.dtype}{list(tokens.shape)}")
  if lengths.shape != tokens.shape[:1] or not jnp.issubdtype(lengths.dtype, jnp.integer):
    raise ValueError(f"{fn}: prompt_lengths must be an integer array [{tokens.shape[0]}], got "
                     f"{lengths.dtype}{list(lengths.shape)}")
  T = tokens.shape[1]
  _check_rows(fn, "prompt_lengths", lengths, 1, T + 1, f"[1, {T}] (the prompt width)",
              check_lengths)
  t, n = _concrete(tokens), _concrete(lengths)
  if t is not None and n is not None:
    used = t[np.arange(T)[None, :] < n[:, None]]
    if used.size and (used.min() < 0 or used.max() >= model.vocab_size):
      raise ValueError(f"{fn}: prompt_tokens has ids outside [0, {model.vocab_size}) (the "
                       f"vocabulary): {used.min()} .. {used.max()}")


def _check_total_length(model: DecoderModel, width: int, lengths, max_new_tokens: int) -> None:
  """The cache of a generation (prompt width + max_new_tokens) fits the model's max_seq_len."""
  total, limit = width + max_new_tokens, model.config.max_seq_len
  if total <= limit:
    return
  n = _concrete(lengths)
  # The longest row tells the caller whether trimming the padding would do.
  longest = "" if n is None else f"; the longest prompt, row {n.argmax()}, has {n.max()} tokens"
  raise ValueError(f"generate: prompt width {width} + max_new_tokens {max_new_tokens} = {total} "
                   f"exceeds the model's max_seq_len {limit} (max_position_embeddings){longest}")


# ---- the pieces ---------------------------------------------------------------------------------

def init_cache(model: DecoderModel, batch: int, max_seq_len: int) -> KVCache:
  """An empty KV cache of ``max_seq_len`` positions for ``batch`` rows, in the model's dtype.

  Raises:
    ValueError: ``max_seq_len`` exceeds what the model supports (``model.config.max_seq_len``).
  """
  _check_model("init_cache", model)
  if not 1 <= max_seq_len <= model.config.max_seq_len:
    raise ValueError(f"init_cache: max_seq_len={max_seq_len} must be in [1, "
                     f"{model.config.max_seq_len}] (the model's max_position_embeddings)")
  shape = dataclasses.replace(model.config, max_seq_len=int(max_seq_len)).cache_shape(batch)
  return KVCache(jnp.zeros(shape, model.dtype), jnp.zeros(shape, model.dtype))


def _cache_config(model: DecoderModel, cache: KVCache):
  """The decoder config of this cache's length."""
  return dataclasses.replace(model.config, max_seq_len=int(cache.k.shape[2]))


def prefill(model: DecoderModel, prompt_tokens, prompt_lengths, cache: KVCache):
  """All prompt tokens through the stack at once (plain XLA, causal), written to the cache.

  Row ``b``'s tokens ``prompt_tokens[b, :prompt_lengths[b]]`` go to cache positions 0.. (the
  padding on the right is never cached). The math is :func:`jaxfuse.decoder_reference`'s, with
  matrix and attention inputs in the model's dtype and fp32 sums, one ``lax.scan`` over the
  layers (jaxfuse/_decode/prefill.py).

  Args:
    model: the model.
    prompt_tokens: int [B, T], right-padded.
    prompt_lengths: int [B], each in [1, T].
    cache: a KV cache for B rows of at least T positions (:func:`init_cache`).

  Returns:
    ``(logits, cache)``: fp32 [B, vocab] next-token logits after each row's last prompt token,
    and the cache.
  """
  _check_model("prefill", model)
  tokens, lengths = jnp.asarray(prompt_tokens), jnp.asarray(prompt_lengths)
  _check_prompts("prefill", model, tokens, lengths)
  B, T = tokens.shape
  _check_cache("prefill", model, cache, B)
  if T > cache.k.shape[2]:
    raise ValueError(f"prefill: the prompts ({T} tokens wide) do not fit the cache "
                     f"({cache.k.shape[2]} positions)")
  cfg = _cache_config(model, cache)
  _check_layers("prefill", model.layers, cache, cfg, B, model.dtype)
  h, cache = prefill_stack(model.embed_tokens(tokens), lengths, model.layers, cache, cfg)
  last = h[jnp.arange(B), lengths - 1]
  return model.logits(last), cache


def decode_step(model: DecoderModel, tokens, positions, cache: KVCache, *,
                decoder: str = "persistent", check_positions: bool = False,
                schedule: str = "persistent"):
  """One new token per row through the whole model, and the next-token logits: with the
  persistent decoder one kernel call gathers the embeddings, runs every layer, the final norm
  and the LM head.

  Args:
    model: the model.
    tokens: int [B], the new token of each row, in [0, vocab). Concrete tokens outside it are
      refused; with the persistent decoder a traced one is treated as a bad position.
    positions: int32 [B], the cache position each row writes and attends up to, in [0, cache
      length). Concrete positions outside it are refused; a traced one leaves the row's cache
      untouched and gives NaN logits (see ``check_positions``).
    cache: the KV cache (donate it under jit to update it in place).
    decoder: "persistent" (the kernel) or "reference" (:func:`jaxfuse.decoder_reference`).
    check_positions: with traced positions, emit a :func:`jax.experimental.checkify.check` that
      every position is in [0, cache length) (run the caller under ``checkify.checkify``).
    schedule: the persistent decoder's CUDA schedule, ``"persistent"`` or ``"stage_kernels"``
      (:func:`jaxfuse.persistent_decoder`).

  Returns:
    ``(logits, cache)``: fp32 [B, vocab] and the updated cache.

  Raises:
    TypeError, ValueError: bad arguments (named), or a concrete position outside
      [0, cache length).
  """
  _check_model("decode_step", model)
  _decoder_fn("decode_step", decoder, model)
  _check_schedule("decode_step", schedule)
  tokens, positions, cfg = _checked_step(model, tokens, positions, cache, check_positions)
  if decoder == "reference":
    h, cache = decoder_reference(model.embed_tokens(tokens), positions, model.layers, cache, cfg)
    return model.logits(h), cache
  logits, k, v = _model_step(model, cfg, tokens.astype(jnp.int32),
                             positions.astype(jnp.int32), cache, schedule=schedule)
  return logits, KVCache(k, v)


def _checked_step(model: DecoderModel, tokens, positions, cache: KVCache,
                  check_positions: bool = False):
  """:func:`decode_step`'s tokens and positions as arrays, checked (its Raises), and the
  decoder configuration of ``model`` (checked: _check_model) with ``cache``."""
  given, given_tokens = positions, tokens  # checked as given (see persistent_decoder)
  tokens, positions = jnp.asarray(tokens), jnp.asarray(positions)
  if tokens.ndim != 1 or not jnp.issubdtype(tokens.dtype, jnp.integer):
    raise ValueError(f"decode_step: tokens must be an integer array [batch], got "
                     f"{tokens.dtype}{list(tokens.shape)}")
  if positions.shape != tokens.shape or not jnp.issubdtype(positions.dtype, jnp.integer):
    raise ValueError(f"decode_step: positions must be an integer array [{tokens.shape[0]}], got "
                     f"{positions.dtype}{list(positions.shape)}")
  _check_cache("decode_step", model, cache, tokens.shape[0])
  S = cache.k.shape[2]
  _check_rows("decode_step", "positions", given, 0, S, f"[0, {S}) (the cache length)",
              check_positions)
  _check_rows("decode_step", "tokens", given_tokens, 0, model.vocab_size,
              f"[0, {model.vocab_size}) (the vocabulary)", False)
  cfg = _cache_config(model, cache)
  _check_layers("decode_step", model.layers, cache, cfg, tokens.shape[0], model.dtype)
  return tokens, positions, cfg


def _model_step(model: DecoderModel, cfg, tokens, positions, cache: KVCache,
                temperature: float | None = None, key_data=None, top_k: int | None = None,
                top_p: float | None = None, timeline: bool = False,
                schedule: str = "persistent"):
  """One whole-model step in one kernel call (validated operands): the embedding of ``tokens``,
  every layer, the final norm and the LM head; with a ``temperature``, the next tokens drawn in
  the same call with the key data ``key_data`` (0: greedy), from the scores ``top_k`` and
  ``top_p`` keep (None: all; as :func:`_sample`), on the CUDA kernel's ``schedule``. Returns
  (logits, [next_tokens,] k_cache, v_cache[, the workspace when recording a ``timeline``])."""
  top_k, top_p = _active_filters(model, top_k, top_p)
  head = _Head(tied=model.tied, temperature=temperature, quantized=model.head_quantized,
               top_k=top_k, top_p=top_p)
  given = {"embed": model.embed, "final_norm": model.final_norm, "lm_head": model.lm_head,
           "lm_head_scale": model.lm_head_scale, "sample_key": key_data}
  operands = tuple(given[name] for name in head.operands())
  step = _decoder_step(cfg, head, timeline, schedule)
  return step(tokens, positions, jnp.asarray(cfg.rope_inv_freq()), model.layers, cache.k,
              cache.v, operands)


def _decoder_fn(fn: str, decoder: str, model: DecoderModel) -> None:
  """``decoder`` is one of _DECODERS, and the kernel takes the model's dtype."""
  if decoder not in _DECODERS:
    raise ValueError(f"{fn}: decoder must be one of {sorted(_DECODERS)}, got {decoder!r}")
  if decoder == "persistent" and model.dtype not in _SUPPORTED:
    raise TypeError(f"{fn}: the persistent decoder takes float32, bfloat16 or float16 models, "
                    f"got {model.dtype} (decoder='reference' runs it in plain JAX)")


# ---- sampling -----------------------------------------------------------------------------------

def _sample(logits, key, temperature: float, top_k: int | None, top_p: float | None):
  """One token per row of fp32 ``logits`` [B, V]: the argmax when ``temperature == 0``, else a
  draw from softmax(logits / temperature) restricted to the ``top_k`` largest logits and then to
  the smallest set of those whose probability reaches ``top_p`` (nucleus sampling, Holtzman et
  al. 2020, arXiv:1904.09751)."""
  if temperature == 0.0:
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)
  logits = logits / jnp.float32(temperature)
  if top_k is not None and top_k < logits.shape[-1]:
    kth = lax.top_k(logits, top_k)[0][:, -1:]
    logits = jnp.where(logits < kth, -jnp.inf, logits)
  if top_p is not None and top_p < 1.0:
    ordered = jnp.sort(logits, axis=-1)[:, ::-1]
    probs = jax.nn.softmax(ordered, axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    # The smallest kept logit: the largest is always kept (its mass before is 0).
    cutoff = jnp.min(jnp.where(mass_before < top_p, ordered, jnp.inf), axis=-1, keepdims=True)
    logits = jnp.where(logits < cutoff, -jnp.inf, logits)
  return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


# ---- generate -----------------------------------------------------------------------------------

def _stop_table(stop_tokens, batch: int) -> np.ndarray:
  """Stop tokens as int32 [1 or batch, n] (-1 pads rows of different counts)."""
  if isinstance(stop_tokens, (int, np.integer)):
    stop_tokens = (stop_tokens,)
  try:
    table = np.asarray(stop_tokens if len(stop_tokens) else [[]], dtype=np.int64)
  except ValueError:  # ragged
    table = np.zeros((0, 0, 0))
  if table.ndim == 1:
    table = table[None, :]
  if table.ndim != 2 or table.shape[0] not in (1, batch):
    raise ValueError("generate: stop_tokens must be a sequence of token ids (every row) or one "
                     f"sequence per row ([{batch}, n], padded with -1), got shape {table.shape}")
  return table.astype(np.int32)


def _kernel_key_data(key) -> jax.Array | None:
  """The data u32[2] of a key with which the kernel draws exactly what jax.random draws (a
  threefry2x32 key, jax_threefry_partitionable on: sampling_math.h), else None."""
  if not jax.config.jax_threefry_partitionable:
    return None
  if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
    return jax.random.key_data(key) if str(jax.random.key_impl(key)) == "threefry2x32" else None
  ok = key.shape == (2,) and jax.config.jax_default_prng_impl == "threefry2x32"
  return key.astype(jnp.uint32) if ok else None  # a raw key, jax.random.PRNGKey's


def _active_filters(model: DecoderModel, top_k, top_p) -> tuple[int | None, float | None]:
  """``top_k`` and ``top_p``, None where they keep every score (as in :func:`_sample`)."""
  return (None if top_k is None or top_k >= model.vocab_size else int(top_k),
          None if top_p is None or top_p >= 1.0 else float(top_p))


@functools.partial(jax.jit, static_argnames=("max_new_tokens", "temperature", "top_k", "top_p",
                                             "decoder", "schedule"))
def _generate(model: DecoderModel, tokens, lengths, key, stop, *, max_new_tokens: int,
              temperature: float, top_k, top_p, decoder: str, schedule: str):
  B, T = tokens.shape
  N = max_new_tokens
  cache = init_cache(model, B, T + N)
  logits, cache = prefill(model, tokens, lengths, cache)
  cfg = _cache_config(model, cache)
  sample = functools.partial(_sample, temperature=temperature, top_k=top_k, top_p=top_p)
  # The kernel draws unless its key is one it cannot draw with: then XLA samples its logits.
  in_kernel = decoder == "persistent" and (temperature == 0.0
                                           or _kernel_key_data(key) is not None)

  # The loop carries what decides token i: its logits, or the token itself when the kernel drew
  # it (token i draws with fold_in(key, i) either way, so both give jax.random's tokens).
  def token_of(pending, i):
    return pending if in_kernel else sample(pending, jax.random.fold_in(key, i))

  def decode(token, positions, cache, i):
    """The pending state of token i + 1 after token i."""
    if decoder == "reference":
      h, cache = decoder_reference(model.embed_tokens(jnp.maximum(token, 0)), positions,
                                   model.layers, cache, cfg)
      return model.logits(h), cache
    if in_kernel:
      key_data = (jnp.zeros((2,), jnp.uint32) if temperature == 0.0  # greedy: unused
                  else _kernel_key_data(jax.random.fold_in(key, i + 1)))
      _, nxt, k, v = _model_step(model, cfg, token, positions, cache, temperature, key_data,
                                 top_k, top_p, schedule=schedule)
      return nxt, KVCache(k, v)
    logits, k, v = _model_step(model, cfg, token, positions, cache, schedule=schedule)
    return logits, KVCache(k, v)

  def record(state):
    """Token i of every running row into the output; rows that emit a stop token stop."""
    i, cache, pending, out, count, done = state
    token = jnp.where(done, _FILL, token_of(pending, i))
    out = lax.dynamic_update_slice(out, token[:, None], (0, i))
    count = count + (~done).astype(jnp.int32)
    done = done | jnp.any(token[:, None] == stop, axis=-1)
    return token, (i, cache, pending, out, count, done)

  def body(state):
    token, (i, cache, _, out, count, done) = record(state)
    positions = jnp.where(done, -1, lengths + i)  # stopped rows: no cache access
    pending, cache = decode(token, positions, cache, i)
    return i + 1, cache, pending, out, count, done

  def running(state):
    i, done = state[0], state[-1]
    return (i < N - 1) & ~jnp.all(done)

  out = jnp.full((B, N), _FILL, jnp.int32)
  first = sample(logits, jax.random.fold_in(key, 0)) if in_kernel else logits
  state = (jnp.int32(0), cache, first, out, jnp.zeros((B,), jnp.int32), jnp.zeros((B,), bool))
  state = lax.while_loop(running, body, state)
  _, (_, _, _, out, count, _) = record(state)  # the last token needs no decode step
  return out, count


def generate(model: DecoderModel, prompt_tokens, prompt_lengths, max_new_tokens: int, *,
             temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None,
             key: jax.Array | None = None, stop_tokens: Sequence[int] | Sequence[Sequence[int]] = (),
             decoder: str = "persistent", check_positions: bool = False,
             schedule: str = "persistent"):
  """Generates up to ``max_new_tokens`` tokens after each prompt, in one jitted call.

  Prefill in plain XLA, then one ``lax.while_loop`` of persistent-decoder steps (see the module
  docstring). Row b's i-th new token is at position ``prompt_lengths[b] + i``; the KV cache holds
  ``prompt_len + max_new_tokens`` positions, which must not exceed ``model.config.max_seq_len``.
  Prompt lengths in [1, prompt_len] keep every position inside the cache: concrete ones are
  checked at call time, traced ones only with ``check_positions``.

  Args:
    model: the model (e.g. :func:`jaxfuse.load_hf`).
    prompt_tokens: int [B, prompt_len], right-padded prompts.
    prompt_lengths: int [B], the length of each prompt, in [1, prompt_len].
    max_new_tokens: tokens to generate per row (>= 1).
    temperature: 0 for greedy (argmax) decoding; > 0 samples from softmax(logits / temperature).
    top_k: with sampling, keep only the ``top_k`` most likely tokens (and those tied with the
      ``top_k``-th).
    top_p: with sampling, keep the smallest set of most likely tokens whose probability reaches
      ``top_p`` (in (0, 1]).
    key: a PRNG key, required when sampling (token i of the generation draws with
      ``fold_in(key, i)``).
    stop_tokens: token ids that end a row's generation (the stop token is kept in the output), or
      one sequence of ids per row ([B, n], padded with -1).
    decoder: "persistent" (the kernel) or "reference" (plain JAX, the same loop).
    check_positions: with traced ``prompt_lengths``, emit a
      :func:`jax.experimental.checkify.check` that each is in [1, prompt_len] (run the caller
      under ``checkify.checkify``). Otherwise a bad traced length is not detected: its row's
      tokens are garbage.
    schedule: the persistent decoder's CUDA schedule, ``"persistent"`` or ``"stage_kernels"``
      (:func:`jaxfuse.persistent_decoder`): the same tokens either way.

  Returns:
    ``(tokens, lengths)``: int32 [B, max_new_tokens] generated tokens, -1 after each row's end;
    int32 [B] the number generated per row (including a stop token).

  Raises:
    TypeError, ValueError: bad arguments (named), checked before anything runs.
  """
  _check_model("generate", model)
  tokens, lengths = jnp.asarray(prompt_tokens), jnp.asarray(prompt_lengths)
  _check_prompts("generate", model, tokens, lengths, check_positions)
  _decoder_fn("generate", decoder, model)
  _check_schedule("generate", schedule)
  if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, (int, np.integer)) \
      or max_new_tokens < 1:
    raise ValueError(f"generate: max_new_tokens must be a positive integer, got {max_new_tokens!r}")
  _check_total_length(model, tokens.shape[1], lengths, int(max_new_tokens))
  temperature = float(temperature)
  if not temperature >= 0.0 or not np.isfinite(temperature):
    raise ValueError(f"generate: temperature must be finite and >= 0, got {temperature}")
  if temperature > 0.0 and key is None:
    raise ValueError("generate: sampling (temperature > 0) needs a PRNG key (key=)")
  if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, (int, np.integer))
                            or top_k < 1):
    raise ValueError(f"generate: top_k must be a positive integer or None, got {top_k!r}")
  if top_p is not None and not 0.0 < float(top_p) <= 1.0:
    raise ValueError(f"generate: top_p must be in (0, 1] or None, got {top_p!r}")
  if temperature == 0.0 and (top_k is not None or top_p is not None):
    raise ValueError("generate: top_k / top_p apply to sampling; set temperature > 0 (greedy "
                     "decoding takes the argmax)")
  stop = _stop_table(stop_tokens, tokens.shape[0])
  key = jax.random.key(0) if key is None else key  # unused when greedy
  return _generate(model, tokens.astype(jnp.int32), lengths.astype(jnp.int32), key,
                   jnp.asarray(stop), max_new_tokens=int(max_new_tokens), temperature=temperature,
                   top_k=None if top_k is None else int(top_k),
                   top_p=None if top_p is None else float(top_p), decoder=decoder,
                   schedule=schedule)
