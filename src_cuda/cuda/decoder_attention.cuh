// The CUDA decoder's attention stage (included by cuda/decoder.cu only), flash-decoding style
// over the cache with the new token's q, k and v (decoder_new_token.cuh):
// a work item is (batch row, kv head, chunk of <= 4 query heads of its group, split of 0..p);
// warps stride over positions, lanes split head_dim; online softmax per warp, merged across warps
// in shared memory, one partial (m, l, o) per split; the last split to finish (counter) merges
// all splits in a fixed order. The current token's k/v are used from shared memory (rounded to
// the cache dtype, exactly what the cache will hold), and written to the cache by one item per
// (b, kv head); no block reads [l, b, p] from memory.
#pragma once

#include "decoder_new_token.cuh"

namespace jaxfuse::cuda_decoder {

// One warp's online softmax state per head of the chunk; lanes hold elements lane + 32 * e.
struct WarpSoftmax {
  float m[kHeadChunk], l[kHeadChunk], o[kHeadChunk][kLaneElems];
};

// Attention with RoPE and the cache append, flash-decoding style (see the file comment).
template <DType kT>
struct AttentionStage {
  const DecoderParams& p;
  Smem& sm;
  int layer;

  __device__ void run() const {
    const KernelDims& d = p.dims;
    const int items = d.batch * d.kv_heads * d.head_chunks * p.plan.attn_splits;
    for (int i = blockIdx.x; i < items; i += gridDim.x) {
      const AttnItem it = item(i);
      if (!it.valid) {
        zero_output(it);
        continue;
      }
      const NewToken<kT> token{p, sm, layer};
      token.load_query_and_new_kv(it);
      if (it.split == 0 && it.chunk == 0) token.append_new_kv(it);
      WarpSoftmax state;
      attend(it, state);
      write_split_partial(it, state);
      int* counter = p.ws.attn_counter(layer, it.b, it.kv_head, it.chunk);
      if (arrive_last(counter, p.plan.attn_splits, &sm.flag)) merge_splits(it);
    }
  }

  // Work item i: split fastest, then head chunk, kv head, batch row.
  __device__ AttnItem item(int i) const {
    const KernelDims& d = p.dims;
    const int splits = p.plan.attn_splits;
    AttnItem it;
    it.split = i % splits;
    i /= splits;
    it.chunk = i % d.head_chunks;
    i /= d.head_chunks;
    it.kv_head = i % d.kv_heads;
    it.b = i / d.kv_heads;
    it.first_head = it.kv_head * d.group + it.chunk * kHeadChunk;
    it.heads = min(kHeadChunk, d.group - it.chunk * kHeadChunk);
    it.position = p.io.positions[it.b];
    it.valid = position_valid(it.position, d.max_seq_len);
    if (it.valid) {
      const int len = it.position + 1;
      const int per_split = (len + splits - 1) / splits;
      it.t0 = min(len, it.split * per_split);
      it.t1 = min(len, it.t0 + per_split);
      it.cache_head = (int64_t(layer) * d.batch + it.b) * d.max_seq_len * d.kv_dim +
                      int64_t(it.kv_head) * d.head_dim;
    } else {
      it.t0 = it.t1 = 0;
      it.cache_head = 0;
    }
    return it;
  }

  // Out-of-range position: attention output 0 (the row's output becomes NaN).
  __device__ void zero_output(const AttnItem& it) const {
    if (it.split != 0) return;
    float* out = p.ws.attn_out.head(it.b, it.first_head);
    for (int i = thread_index(); i < it.heads * p.dims.head_dim; i += kThreads) {
      ws_store(out + i, 0.0f);
    }
  }

  // This warp's online softmax over its positions of the split (every kWarps-th).
  __device__ void attend(const AttnItem& it, WarpSoftmax& s) const {
#pragma unroll
    for (int g = 0; g < kHeadChunk; ++g) {
      s.m[g] = neg_inf_f32();
      s.l[g] = 0.0f;
#pragma unroll
      for (int e = 0; e < kLaneElems; ++e) s.o[g][e] = 0.0f;
    }
    const int lane = thread_index() % 32;
    for (int t = it.t0 + thread_index() / 32; t < it.t1; t += kWarps) {
      float k[kLaneElems], v[kLaneElems];
      load_kv(it, t, lane, k, v);
      fold_position(it, lane, k, v, s);
    }
  }

  // This lane's elements of position t's k and v; the new token's from shared memory.
  __device__ void load_kv(const AttnItem& it, int t, int lane, float (&k)[kLaneElems],
                          float (&v)[kLaneElems]) const {
    const int64_t at = it.cache_index(t, p.dims.kv_dim);
#pragma unroll
    for (int e = 0; e < kLaneElems; ++e) {
      const int j = lane + 32 * e;
      if (j < p.dims.head_dim) {
        k[e] = t == it.position ? sm.attn_k_new()[j] : load_as_float(p.io.k_cache, kT, at + j);
        v[e] = t == it.position ? sm.attn_v_new()[j] : load_as_float(p.io.v_cache, kT, at + j);
      } else {
        k[e] = 0.0f;
        v[e] = 0.0f;
      }
    }
  }

  // Folds one position (this lane's k and v elements) into each head's softmax state.
  __device__ void fold_position(const AttnItem& it, int lane, const float (&k)[kLaneElems],
                                const float (&v)[kLaneElems], WarpSoftmax& s) const {
    const int hd = p.dims.head_dim;
#pragma unroll
    for (int g = 0; g < kHeadChunk; ++g) {
      if (g < it.heads) {
        const float* q = sm.attn_q(g, hd);
        float dot = 0.0f;
#pragma unroll
        for (int e = 0; e < kLaneElems; ++e) {
          const int j = lane + 32 * e;
          if (j < hd) dot = fmaf(q[j], k[e], dot);
        }
        dot = warp_sum(dot);
        float pw;
        const float alpha = online_softmax_step(s.m[g], s.l[g], dot * p.dims.attn_scale, &pw);
#pragma unroll
        for (int e = 0; e < kLaneElems; ++e) s.o[g][e] = s.o[g][e] * alpha + pw * v[e];
      }
    }
  }

  // Merges the warps' states (fixed order) into this split's partial (m, l, o) per head.
  __device__ void write_split_partial(const AttnItem& it, const WarpSoftmax& s) const {
    const int t = thread_index(), warp = t / 32, lane = t % 32, hd = p.dims.head_dim;
    __syncthreads();
#pragma unroll
    for (int g = 0; g < kHeadChunk; ++g) {
      if (lane == 0) {
        sm.attn_warp_ml(warp, g)[0] = s.m[g];
        sm.attn_warp_ml(warp, g)[1] = s.l[g];
      }
#pragma unroll
      for (int e = 0; e < kLaneElems; ++e) {
        const int j = lane + 32 * e;
        if (j < hd) sm.attn_warp_o(warp, g)[j] = s.o[g][e];
      }
    }
    __syncthreads();
    for (int i = thread_index(); i < it.heads * hd; i += kThreads) {
      const int g = i / hd, j = i % hd;
      float m = neg_inf_f32(), l = 0.0f, o = 0.0f;
      for (int w = 0; w < kWarps; ++w) {
        const float* ml = sm.attn_warp_ml(w, g);
        float a, b;
        online_softmax_merge(m, l, ml[0], ml[1], &a, &b);
        o = o * a + sm.attn_warp_o(w, g)[j] * b;
      }
      const AttnPartial partial = p.ws.attn_partial(it.b, it.first_head + g, it.split);
      if (j == 0) {
        ws_store(partial.m(), m);
        ws_store(partial.l(), l);
      }
      ws_store(partial.o(j), o);
    }
  }

  // The last split to finish: merges all splits' partials (fixed order) into attn_out.
  __device__ void merge_splits(const AttnItem& it) const {
    const int hd = p.dims.head_dim;
    for (int i = thread_index(); i < it.heads * hd; i += kThreads) {
      const int g = i / hd, j = i % hd;
      float m = neg_inf_f32(), l = 0.0f, o = 0.0f;
      for (int s = 0; s < p.plan.attn_splits; ++s) {
        const AttnPartial partial = p.ws.attn_partial(it.b, it.first_head + g, s);
        float a, b;
        online_softmax_merge(m, l, ws_load(partial.m()), ws_load(partial.l()), &a, &b);
        o = o * a + ws_load(partial.o(j)) * b;
      }
      ws_store(p.ws.attn_out.head(it.b, it.first_head + g) + j, o / l);
    }
  }
};

}  // namespace jaxfuse::cuda_decoder
