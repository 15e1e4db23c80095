"""The decoder step in plain JAX: :func:`decoder_reference` (one step or a multi-token prefill),
with the semantics of :func:`jaxfuse.persistent_decoder`, and its per-layer pieces that the
prefill, the model and generation share."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxfuse._decode.checks import _check_present, _check_structure
from jaxfuse._decode.config import DecoderConfig, DecoderWeights, KVCache


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
