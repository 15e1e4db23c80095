// The new token of a CUDA decoder attention work item (included by cuda/decoder.cu only): its q
// heads and the kv head's new k and v staged in shared memory (per-head RMSNorm with qk_norm,
// RoPE, k and v rounded to the cache dtype), and the cache append.
#pragma once

#include "decoder/cuda/decoder_common.cuh"

namespace jaxfuse::cuda_decoder {

// One attention work item: batch row b, kv head, a chunk of its query heads, a split of 0..p.
struct AttnItem {
  int b, kv_head, chunk, split;
  int first_head, heads;  // the chunk's query heads: first_head .. first_head + heads - 1
  int32_t position;       // p, the new token's cache slot
  bool valid;             // position_valid(p): else no cache access, output 0 (row becomes NaN)
  int t0, t1;             // this split's positions [t0, t1) (valid items)
  int64_t cache_head;     // element index of [layer, b, 0, kv_head] in the caches (valid items)

  // Element index of the item's kv head at position t in the caches [L, B, S, KV, hd].
  __device__ int64_t cache_index(int t, int kv_dim) const {
    return cache_head + int64_t(t) * kv_dim;
  }
};

// The item's new token, for AttentionStage (decoder_attention.cuh).
template <DType kT>
struct NewToken {
  const DecoderParams& p;
  Smem& sm;
  int layer;

  // Shared memory: q of the chunk's heads and the kv head's new k (per-head RMSNorm with
  // qk_norm, then RoPE), and the new v; k and v rounded to the cache dtype (exactly what the
  // cache will hold). Staged head g < it.heads is query head first_head + g; g == it.heads is k.
  __device__ void load_query_and_new_kv(const AttnItem& it) const {
    const int hd = head_dim_of(p.dims), half = hd / 2;
    __syncthreads();  // the staging area may still be read by the previous item
    for (int i = thread_index(); i < (it.heads + 1) * hd; i += kThreads) {
      const int g = i / hd, j = i % hd;
      const float* x = g < it.heads ? p.ws.qkv.q(it.b, it.first_head + g)
                                    : p.ws.qkv.k(it.b, it.kv_head);
      staged_head(it, g)[j] = ws_load(x + j);
    }
    const float* v = p.ws.qkv.v(it.b, it.kv_head);
    for (int j = thread_index(); j < hd; j += kThreads) {
      sm.attn_v_new()[j] = round_to(kT, ws_load(v + j));
    }
    __syncthreads();
    if (p.dims.qk_norm) normalize_heads(it);
    // RoPE in place: one thread owns each pair (j, j + half).
    for (int i = thread_index(); i < (it.heads + 1) * half; i += kThreads) {
      const int g = i / half, j = i % half;
      float c, sn;
      rope_cos_sin(rope_angle(it.position, __ldg(p.io.rope_inv_freq + j)), &c, &sn);
      float* x = staged_head(it, g);
      float x1 = x[j], x2 = x[j + half];
      rope_rotate(x1, x2, c, sn);
      const bool key = g == it.heads;
      x[j] = key ? round_to(kT, x1) : x1;
      x[j + half] = key ? round_to(kT, x2) : x2;
    }
    __syncthreads();
  }

  // Staged head g of the item (see load_query_and_new_kv) in shared memory.
  __device__ float* staged_head(const AttnItem& it, int g) const {
    return g < it.heads ? sm.attn_q(g, head_dim_of(p.dims)) : sm.attn_k_new();
  }

  // Per-head RMSNorm of the staged heads in place (Qwen3's q_norm, k_norm): warp g takes head g.
  __device__ void normalize_heads(const AttnItem& it) const {
    const int t = thread_index(), hd = head_dim_of(p.dims), warp = t / 32, lane = t % 32;
    if (warp <= it.heads) {
      float* x = staged_head(it, warp);
      float sum_sq = 0.0f;
      for (int j = lane; j < hd; j += 32) sum_sq += x[j] * x[j];
      const float inv = rms_inv(warp_sum(sum_sq), hd, p.dims.rms_eps);
      const DecoderWeights& w = p.io.weights;
      const void* norm = layer_slice(warp < it.heads ? w.q_norm : w.k_norm, kT, layer, hd);
      for (int j = lane; j < hd; j += 32) x[j] = rms_apply(x[j], inv, load_as_float(norm, kT, j));
    }
    __syncthreads();
  }

  // The new k and v into the caches at [layer, b, p] (one item per (b, kv head) does it).
  __device__ void append_new_kv(const AttnItem& it) const {
    const int64_t at = it.cache_index(it.position, p.dims.kv_dim);
    for (int j = thread_index(); j < head_dim_of(p.dims); j += kThreads) {
      store_from_float(p.io.k_cache, kT, at + j, sm.attn_k_new()[j]);
      store_from_float(p.io.v_cache, kT, at + j, sm.attn_v_new()[j]);
    }
  }
};

}  // namespace jaxfuse::cuda_decoder
