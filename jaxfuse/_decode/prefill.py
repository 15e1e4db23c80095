"""The prompt through the decoder stack at once (plain XLA): the first half of a generation.

Per layer, for all T prompt tokens of every row together (the math of
:func:`jaxfuse.decoder_reference`, the order of the kernel's stages)::

    a = rmsnorm(h) * attn_norm                     fp32
    q, k, v = a @ wq, a @ wk, a @ wv               inputs in the model's dtype, fp32 sums
    (+ biases, per-head q/k RMSNorm, RoPE at positions 0..T-1)
    attn = softmax(q . k / sqrt(hd)) v             causal, fp32 scores and softmax
    h = h + attn @ wo
    h = h + (silu(m @ w_gate) * (m @ w_up)) @ w_down,  m = rmsnorm(h) * mlp_norm

The residual stream ``h`` is fp32, as in the kernel; matrix inputs are rounded to the model's
dtype (int8 and fp8 matrices convert to it exactly; their column scales multiply the sums) and
summed in fp32 (the usual mixed precision of a bf16 model; a float32 model stays float32
throughout, at full precision on every backend). The layers are one ``lax.scan`` over the stacked
weights, so the program does not grow with depth. Attention runs among the prompt's own tokens
(a prompt starts at position 0), so it never reads the cache; each row's k and v, rounded to the
cache dtype, are then written at positions 0..length-1 (padding is never cached). Queries go in
blocks of ``_QUERY_BLOCK``, so the scores held at once are [B, heads, block, T], not T x T.

(``jax.nn.dot_product_attention`` would be the obvious call, but its XLA path materializes every
T x T score too, and under ``jit`` it cannot lower float16 on the CPU in jax 0.11.)
"""

from __future__ import annotations

import contextlib
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxfuse._decode.config import DecoderConfig, DecoderWeights, KVCache
from jaxfuse._decode.reference import _ref_linear, _ref_mlp, _ref_qkv, _ref_rmsnorm, _ref_rope


def prefill_stack(x, lengths, w: DecoderWeights, cache: KVCache, cfg: DecoderConfig):
  """The prompts ``x`` through every layer, their k and v written to ``cache``.

  Args:
    x: [B, T, D] embedded prompt tokens in the model's dtype, row b's first ``lengths[b]`` real
      (the rest padding), at positions 0..T-1.
    lengths: int [B], each in [1, T].
    w: the stacked layer weights (checked by the caller).
    cache: the KV cache, at least T positions long.
    cfg: the stack's configuration (``max_seq_len`` the cache's length).

  Returns:
    ``(h, cache)``: [B, T, D] outputs of the last layer in the model's dtype (rows' padding
    positions hold values of no meaning), and the cache with positions [0, lengths[b]) of row b
    written in every layer, the rest unchanged.
  """
  dtype = jnp.dtype(x.dtype)
  full_fp32 = dtype == jnp.float32  # else the TF32 default of GPUs would apply to float32 models
  precision = jax.default_matmul_precision("highest") if full_fp32 else contextlib.nullcontext()
  with precision:
    layer = functools.partial(_layer, cfg, dtype, _Prompt(lengths, x.shape[1], cfg))
    init = (x.astype(jnp.float32), cache.k, cache.v)
    (h, k_cache, v_cache), _ = lax.scan(layer, init, (jnp.arange(cfg.num_layers), w))
  return h.astype(dtype), KVCache(k_cache, v_cache)


class _Prompt:
  """What every layer needs of the prompts' positions: the valid tokens and the RoPE."""

  def __init__(self, lengths, T: int, cfg: DecoderConfig):
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (lengths.shape[0], T))
    self.valid = positions < lengths[:, None]  # [B, T]
    self.rope = _ref_rope(positions, cfg)  # of [B, T, heads, hd]


def _einsum(spec: str, x, y):
  """``jnp.einsum(spec, x, y)`` of 16-bit (or fp32) operands, summed in fp32."""
  return jnp.einsum(spec, x, y, preferred_element_type=jnp.float32)


def _matmul(dtype, a, w):
  """[B, T, K] fp32 @ [K, N]: inputs rounded to ``dtype`` (int8 and fp8 weights exactly), fp32
  sums."""
  return _einsum("btk,kn->btn", a.astype(dtype), w.astype(dtype))


def _layer(cfg: DecoderConfig, dtype, prompt: _Prompt, carry, xs):
  """One layer of the scan: (h, k_cache, v_cache), (layer index, its weights) -> the same."""
  h, k_cache, v_cache = carry
  l, wl = xs
  rmsnorm = functools.partial(_ref_rmsnorm, eps=cfg.rms_norm_eps)
  linear = functools.partial(_ref_linear, functools.partial(_matmul, dtype), wl)
  q, k, v = _ref_qkv(linear, rmsnorm, wl, h, cfg)
  q, k, v = prompt.rope(q).astype(dtype), prompt.rope(k).astype(dtype), v.astype(dtype)
  k_cache, v_cache = (_write_prompt(c, l, t, prompt.valid) for c, t in ((k_cache, k),
                                                                        (v_cache, v)))
  h = _ref_mlp(linear, rmsnorm, wl, h + linear(_causal_attention(q, k, v), "wo"))
  return (h, k_cache, v_cache), None


_QUERY_BLOCK = 512


def _causal_attention(q, k, v):
  """Grouped-query attention of q [B, T, H, hd] over k, v [B, T, KV, hd] (all in the model's
  dtype), each token up to its own position: [B, T, H * hd] fp32, as decoder_reference computes it
  with ``activation_dtype`` (fp32 scores and softmax, probabilities rounded to the dtype)."""
  B, T, H, hd = q.shape
  KV = k.shape[2]
  block = min(T, _QUERY_BLOCK)
  blocks = -(-T // block)
  scale = jnp.float32(1.0 / np.sqrt(hd))

  def attend(first, qb):  # qb [B, block, KV, H // KV, hd], queries first .. first + block - 1
    s = _einsum("btkgd,bskd->btkgs", qb, k)
    seen = jnp.arange(T)[None, :] <= first + jnp.arange(block)[:, None]  # [block, T]
    p = jax.nn.softmax(jnp.where(seen[None, :, None, None, :], s * scale, -jnp.inf), axis=-1)
    return _einsum("btkgs,bskd->btkgd", p.astype(v.dtype), v)

  qg = q.reshape(B, T, KV, H // KV, hd)
  if blocks == 1:
    return attend(0, qg).reshape(B, T, H * hd)
  qg = jnp.pad(qg, ((0, 0), (0, blocks * block - T), (0, 0), (0, 0), (0, 0)))
  qg = jnp.moveaxis(qg.reshape(B, blocks, block, KV, H // KV, hd), 1, 0)
  o = lax.map(lambda args: attend(*args), (jnp.arange(blocks) * block, qg))
  return jnp.moveaxis(o, 0, 1).reshape(B, blocks * block, H * hd)[:, :T]


def _write_prompt(cache, l, new, valid):
  """``cache`` [L, B, S, KV, hd] with [l, b, t] = new[b, t] where ``valid[b, t]``."""
  _, B, _, KV, hd = cache.shape
  T = new.shape[1]
  old = lax.dynamic_slice(cache, (l, 0, 0, 0, 0), (1, B, T, KV, hd))[0]
  rows = jnp.where(valid[:, :, None, None], new, old)
  return lax.dynamic_update_slice(cache, rows[None], (l, 0, 0, 0, 0))
