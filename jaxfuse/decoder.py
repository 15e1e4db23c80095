"""Persistent decoder: one fused decode step of a Llama/Qwen-style decoder stack.

``persistent_decoder(x, positions, w, cache, cfg)`` runs every layer of the stack for one new token
per batch row in a single XLA custom call (``jaxfuse_decoder``): on CUDA one persistent cooperative
kernel launch per step, on CPU a thread-pooled handler. Per layer and batch row ``b`` at
``p = positions[b]``::

    a = rmsnorm(h) * attn_norm[l]              rmsnorm(h) = h * rsqrt(mean(h^2) + eps), fp32
    q, k, v = a @ wq[l], a @ wk[l], a @ wv[l]  split into heads of head_dim
    q, k = rope(q, p), rope(k, p)              Llama "rotate half": pairs (i, i + hd/2),
                                               angle = p * rope_theta^(-2i/hd)
    cache.k[l, b, p], cache.v[l, b, p] = k, v  (rounded to the cache dtype)
    attn = softmax(q . K[0..p] / sqrt(hd)) V   query head j uses kv head j // (H / KV)
    h = h + attn @ wo[l]
    m = rmsnorm(h) * mlp_norm[l]
    h = h + (silu(m @ w_gate[l]) * (m @ w_up[l])) @ w_down[l]

and the output is ``h`` after the last layer (no final norm, no LM head). ``x``, the weights and the
cache share one dtype (float32, bfloat16 or float16); all arithmetic and accumulation is fp32.

Out-of-range positions: a row whose position is negative or ``>= max_seq_len`` never touches
the cache (that row's cache stays bitwise unchanged) and its output row is NaN; the other rows
are unaffected.

The cache is updated in place when it is donated (``jax.jit(..., donate_argnums=...)``); the
k/v operands are aliased to the k/v results of the custom call.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from jaxfuse import _ffi

__all__ = ["DecoderConfig", "DecoderWeights", "KVCache", "persistent_decoder", "decoder_reference"]

_SUPPORTED = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


@dataclasses.dataclass(frozen=True)
class DecoderConfig:
  """Static shape and hyperparameters of the decoder stack (hashable: it is a primitive param)."""

  num_layers: int
  hidden_size: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  intermediate_size: int
  max_seq_len: int
  rms_norm_eps: float = 1e-5
  rope_theta: float = 10000.0

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
    if self.num_heads % self.num_kv_heads:
      raise ValueError(f"DecoderConfig: num_heads={self.num_heads} must be a multiple of "
                       f"num_kv_heads={self.num_kv_heads}")
    if self.head_dim % 2:
      raise ValueError(f"DecoderConfig: head_dim={self.head_dim} must be even (RoPE rotates halves)")
    if not self.rms_norm_eps >= 0.0 or not np.isfinite(self.rms_norm_eps):
      raise ValueError(f"DecoderConfig: rms_norm_eps must be finite and >= 0, got {self.rms_norm_eps}")
    if not self.rope_theta > 0.0 or not np.isfinite(self.rope_theta):
      raise ValueError(f"DecoderConfig: rope_theta must be finite and > 0, got {self.rope_theta}")
    if self.max_seq_len >= 2**31 - 1:
      raise ValueError("DecoderConfig: max_seq_len must fit int32 positions")

  @property
  def q_dim(self) -> int:
    return self.num_heads * self.head_dim

  @property
  def kv_dim(self) -> int:
    return self.num_kv_heads * self.head_dim

  def weight_shapes(self) -> dict[str, tuple[int, ...]]:
    L, D, I = self.num_layers, self.hidden_size, self.intermediate_size
    return {
        "attn_norm": (L, D), "wq": (L, D, self.q_dim), "wk": (L, D, self.kv_dim),
        "wv": (L, D, self.kv_dim), "wo": (L, self.q_dim, D), "mlp_norm": (L, D),
        "w_gate": (L, D, I), "w_up": (L, D, I), "w_down": (L, I, D),
    }

  def cache_shape(self, batch: int) -> tuple[int, ...]:
    return (self.num_layers, batch, self.max_seq_len, self.num_kv_heads, self.head_dim)


class DecoderWeights(NamedTuple):
  """Stacked per-layer weights; matrices are [in, out] (``y = a @ w``)."""

  attn_norm: jax.Array  # [L, D]
  wq: jax.Array  # [L, D, H*hd]
  wk: jax.Array  # [L, D, KV*hd]
  wv: jax.Array  # [L, D, KV*hd]
  wo: jax.Array  # [L, H*hd, D]
  mlp_norm: jax.Array  # [L, D]
  w_gate: jax.Array  # [L, D, I]
  w_up: jax.Array  # [L, D, I]
  w_down: jax.Array  # [L, I, D]


class KVCache(NamedTuple):
  k: jax.Array  # [L, B, max_seq_len, KV, hd]
  v: jax.Array  # [L, B, max_seq_len, KV, hd]


_WEIGHT_NAMES = DecoderWeights._fields

# ---- workspace layout (mirror of decoder_layout() in src_cuda/include/jaxfuse/decoder_ffi.h) ----
_MAX_GEMV_ITEMS = 1024
_MAX_ATTN_SPLITS = 64
_HEAD_CHUNK = 4
_ALIGN = 256


def _workspace_bytes(cfg: DecoderConfig, batch: int, dtype) -> int:
  itemsize = jnp.dtype(dtype).itemsize
  tile = 32 * (16 // itemsize)
  tiles = lambda n: -(-n // tile)
  B, L, D, I = batch, cfg.num_layers, cfg.hidden_size, cfg.intermediate_size
  H, KV, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
  qd, kvd = cfg.q_dim, cfg.kv_dim
  nt_d, nt_qkv, nt_i = tiles(D), tiles(qd) + 2 * tiles(kvd), tiles(I)
  max_tiles = max(nt_qkv, nt_d, 2 * nt_i)
  head_chunks = -(-(H // KV) // _HEAD_CHUNK)
  num_counters = L * nt_qkv + L * nt_d + L * nt_i + L * nt_d + L * B * KV * head_chunks
  regions = [B * D * 4, B * nt_d * 4, B * (qd + 2 * kvd) * 4, B * qd * 4, B * I * 4,
             B * H * _MAX_ATTN_SPLITS * (hd + 2) * 4, max(_MAX_GEMV_ITEMS, max_tiles) * B * tile * 4,
             num_counters * 4]
  off = 0
  for r in regions:
    off = -(-(off + r) // _ALIGN) * _ALIGN
  return off


# ---- the primitive -----------------------------------------------------------------------------

decoder_p = Primitive("jaxfuse_decoder")
decoder_p.multiple_results = True


def _fmt(shape) -> str:
  return "(" + ", ".join(str(int(s)) for s in shape) + ("," if len(shape) == 1 else "") + ")"


def _abstract_eval(x, positions, *rest, cfg: DecoderConfig):
  weights, k, v = rest[:9], rest[9], rest[10]
  if x.ndim != 2 or x.shape[1] != cfg.hidden_size:
    raise ValueError(f"persistent_decoder: x has shape {_fmt(x.shape)}, expected (B, "
                     f"{cfg.hidden_size}) (batch, hidden_size)")
  dtype = jnp.dtype(x.dtype)
  if dtype not in _SUPPORTED:
    raise TypeError(f"persistent_decoder: x has dtype {dtype}, expected float32, bfloat16 or float16")
  B = x.shape[0]
  if positions.shape != (B,):
    raise ValueError(f"persistent_decoder: positions has shape {_fmt(positions.shape)}, "
                     f"expected {_fmt((B,))}")
  if jnp.dtype(positions.dtype) != jnp.int32:
    raise TypeError(f"persistent_decoder: positions has dtype {positions.dtype}, expected int32")
  shapes = cfg.weight_shapes()
  for name, a in zip(_WEIGHT_NAMES, weights):
    if a.shape != shapes[name]:
      raise ValueError(f"persistent_decoder: {name} has shape {_fmt(a.shape)}, expected "
                       f"{_fmt(shapes[name])}")
    if jnp.dtype(a.dtype) != dtype:
      raise TypeError(f"persistent_decoder: {name} has dtype {a.dtype}, expected {dtype} "
                      "(x, the weights and the cache share one dtype)")
  for name, a in (("cache.k", k), ("cache.v", v)):
    if a.shape != cfg.cache_shape(B):
      raise ValueError(f"persistent_decoder: {name} has shape {_fmt(a.shape)}, expected "
                       f"{_fmt(cfg.cache_shape(B))} (layers, batch, max_seq_len, kv_heads, head_dim)")
    if jnp.dtype(a.dtype) != dtype:
      raise TypeError(f"persistent_decoder: {name} has dtype {a.dtype}, expected {dtype} "
                      "(x, the weights and the cache share one dtype)")
  ws = jax.core.ShapedArray((_workspace_bytes(cfg, B, dtype),), jnp.uint8)
  return (jax.core.ShapedArray(x.shape, dtype), jax.core.ShapedArray(k.shape, dtype),
          jax.core.ShapedArray(v.shape, dtype), ws)


decoder_p.def_abstract_eval(_abstract_eval)


def _impl(*args, cfg):
  return _jit_bind(*args, cfg=cfg)


@functools.partial(jax.jit, static_argnames="cfg")
def _jit_bind(*args, cfg):
  return decoder_p.bind(*args, cfg=cfg)


decoder_p.def_impl(_impl)


def _lowering(ctx, *args, cfg: DecoderConfig):
  rule = jax.ffi.ffi_lowering(_ffi.target("jaxfuse_decoder"), operand_output_aliases={11: 1, 12: 2})
  return rule(ctx, *args,
              num_layers=np.int64(cfg.num_layers), hidden_size=np.int64(cfg.hidden_size),
              num_heads=np.int64(cfg.num_heads), num_kv_heads=np.int64(cfg.num_kv_heads),
              head_dim=np.int64(cfg.head_dim), intermediate_size=np.int64(cfg.intermediate_size),
              max_seq_len=np.int64(cfg.max_seq_len), rms_norm_eps=np.float32(cfg.rms_norm_eps),
              rope_theta=np.float64(cfg.rope_theta))


mlir.register_lowering(decoder_p, _lowering, platform="cpu")
mlir.register_lowering(decoder_p, _lowering, platform="cuda")


def _batching_rule(args, dims, *, cfg: DecoderConfig):
  """vmap folds the mapped axis into the kernel's batch dimension (weights must be unmapped)."""
  x, positions, *weights, k, v = args
  xd, pd, *wd, kd, vd = dims
  for name, d in zip(_WEIGHT_NAMES, wd):
    if d is not None:
      raise NotImplementedError(
          f"persistent_decoder: vmap over the weights ({name}) is not supported; map only x, "
          "positions and the cache (their mapped axis is folded into the batch)")
  size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)

  def put(a, d, axis):  # the mapped axis at `axis` (broadcast when unmapped)
    if d is None:
      a = jnp.expand_dims(a, axis)
      return jnp.broadcast_to(a, a.shape[:axis] + (size,) + a.shape[axis + 1:])
    return jnp.moveaxis(a, d, axis)

  x = put(x, xd, 0)
  B = x.shape[1]
  x = x.reshape(size * B, cfg.hidden_size)
  positions = put(positions, pd, 0).reshape(size * B)
  cache_shape = cfg.cache_shape(size * B)
  k = put(k, kd, 1).reshape(cache_shape)
  v = put(v, vd, 1).reshape(cache_shape)
  out, k2, v2, ws = decoder_p.bind(x, positions, *weights, k, v, cfg=cfg)
  unfold = (cfg.num_layers, size, B) + cache_shape[2:]
  return (out.reshape(size, B, cfg.hidden_size), k2.reshape(unfold), v2.reshape(unfold), ws), \
      (0, 1, 1, None)


batching.primitive_batchers[decoder_p] = _batching_rule


def _jvp_rule(primals, tangents, *, cfg):
  raise NotImplementedError(
      "persistent_decoder is an inference kernel and is not differentiable; use "
      "jaxfuse.decoder_reference (pure JAX) for gradients")


ad.primitive_jvps[decoder_p] = _jvp_rule


# ---- public API --------------------------------------------------------------------------------

def _check_structure(w, cache, cfg):
  if not isinstance(cfg, DecoderConfig):
    raise TypeError(f"persistent_decoder: cfg must be a jaxfuse.DecoderConfig, got {type(cfg).__name__}")
  if not isinstance(w, DecoderWeights):
    raise TypeError(f"persistent_decoder: w must be a jaxfuse.DecoderWeights, got {type(w).__name__}")
  if not isinstance(cache, KVCache):
    raise TypeError(f"persistent_decoder: cache must be a jaxfuse.KVCache, got {type(cache).__name__}")


def persistent_decoder(x, positions, w: DecoderWeights, cache: KVCache, cfg: DecoderConfig):
  """One decode step of every layer: returns ``(h_out [B, D], new_cache)``.

  ``x``: [B, D] hidden state of the new token per row; ``positions``: int32 [B], the cache slot
  each row writes and attends up to (inclusive). See the module docstring for the math and the
  handling of out-of-range positions. Works under jit (donate the cache for in-place updates),
  vmap (mapped over x, positions and the cache), lax.scan and lax.while_loop; not differentiable.
  """
  _check_structure(w, cache, cfg)
  x = jnp.asarray(x)
  positions = jnp.asarray(positions)
  out, k, v, _ = decoder_p.bind(x, positions, *w, cache.k, cache.v, cfg=cfg)
  return out, KVCache(k, v)


def decoder_reference(x, positions, w: DecoderWeights, cache: KVCache, cfg: DecoderConfig, *,
                      activation_dtype=None):
  """Pure-JAX reference with the semantics of :func:`persistent_decoder`.

  Also accepts a multi-token prefill: ``x`` [B, T, D] with ``positions`` [B, T] (distinct per
  row); every token is written to the cache first, then each attends to cache positions up to its
  own (so a prefill from position 0 is causal attention). Returns outputs of the same rank as x.

  By default every GEMV input is fp32 (as in the kernels); ``activation_dtype`` (e.g. bfloat16)
  instead rounds GEMV and attention inputs to that dtype with fp32 accumulation, the usual way a
  plain JAX decoder is written (used as the speed baseline in the benchmark).
  """
  _check_structure(w, cache, cfg)
  x = jnp.asarray(x)
  positions = jnp.asarray(positions, jnp.int32)
  single = x.ndim == 2
  if single:
    x, positions = x[:, None, :], positions[:, None]
  B, T, D = x.shape
  dt = x.dtype
  f32 = jnp.float32
  L, H, KV, hd, S = cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.max_seq_len
  G, half = H // KV, hd // 2
  hi = lax.Precision.HIGHEST

  def mm(a, wl):  # [B, T, K] @ [K, N] -> fp32
    if activation_dtype is None:
      return jnp.einsum("btk,kn->btn", a, wl.astype(f32), precision=hi)
    return jnp.einsum("btk,kn->btn", a.astype(activation_dtype), wl.astype(activation_dtype),
                      preferred_element_type=f32)

  def rmsnorm(h, wn):
    return (h * lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True) + f32(cfg.rms_norm_eps))) * \
        wn.astype(f32)

  inv_freq = (np.float64(cfg.rope_theta) ** (-2.0 * np.arange(half) / hd)).astype(np.float32)
  angle = positions.astype(f32)[..., None] * jnp.asarray(inv_freq)  # [B, T, hd/2]
  cos, sin = jnp.cos(angle)[:, :, None, :], jnp.sin(angle)[:, :, None, :]

  def rope(t):  # [B, T, heads, hd]
    x1, x2 = t[..., :half], t[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)

  valid = (positions >= 0) & (positions < S)  # [B, T]
  slot = jnp.where(valid, positions, S)  # out of bounds -> dropped by the scatter
  rows = jnp.arange(B)[:, None]
  mask = jnp.arange(S)[None, None, :] <= positions[:, :, None]  # [B, T, S]
  # Slots after every token's position are never read (whatever they hold, even NaN).
  seen = (jnp.arange(S)[None, :] <= positions.max(axis=1)[:, None])[:, :, None, None]  # [B, S, 1, 1]
  scale = f32(1.0 / np.sqrt(hd))
  h = x.astype(f32)
  kc, vc = cache.k, cache.v
  for l in range(L):
    a = rmsnorm(h, w.attn_norm[l])
    q = rope(mm(a, w.wq[l]).reshape(B, T, H, hd))
    k = rope(mm(a, w.wk[l]).reshape(B, T, KV, hd))
    v = mm(a, w.wv[l]).reshape(B, T, KV, hd)
    kl = kc[l].at[rows, slot].set(k.astype(dt), mode="drop")  # [B, S, KV, hd]
    vl = vc[l].at[rows, slot].set(v.astype(dt), mode="drop")
    kc, vc = kc.at[l].set(kl), vc.at[l].set(vl)
    qg = q.reshape(B, T, KV, G, hd)
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
                     jnp.where(seen, vl, 0).astype(activation_dtype),
                     preferred_element_type=f32)
    o = jnp.where(valid[:, :, None, None, None], o, 0.0).reshape(B, T, H * hd)
    h = h + mm(o, w.wo[l])
    m = rmsnorm(h, w.mlp_norm[l])
    g, u = mm(m, w.w_gate[l]), mm(m, w.w_up[l])
    h = h + mm((g / (1.0 + jnp.exp(-g))) * u, w.w_down[l])
  out = jnp.where(valid[..., None], h, jnp.nan).astype(dt)
  if single:
    out = out[:, 0]
  return out, KVCache(kc, vc)
