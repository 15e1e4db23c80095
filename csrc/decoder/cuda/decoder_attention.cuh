// The CUDA decoder's attention stage (included by cuda/decoder.cu only), flash-decoding style
// over the cache with the new token's q, k and v (decoder_new_token.cuh):
// a work item is (batch row, kv head, chunk of <= 4 query heads of its group, split of 0..p).
// A position's k (and v) row is read as 16-byte vectors by a group of AttnLanes::lanes lanes, so
// a warp takes 32 / lanes positions at once (4 for head_dim 64 in bf16), kPositionsInFlight of
// them per lane group with every load issued before any is used; each lane group keeps its own
// online softmax, merged within the warp by shuffles and across warps in shared memory, one
// partial (m, l, o) per split; the last split to finish (counter) merges all splits in a fixed
// order and counts the chunk done for the O projection. An item asks L2 for its positions' k and
// v rows (written by earlier calls) before it waits for its q, k and v tiles of the [q|k|v]
// stage. The current token's k/v are used from shared memory (rounded to
// the cache dtype, exactly what the cache will hold), and written to the cache by one item per
// (b, kv head); no block reads [l, b, p] from memory.
#pragma once

#include "decoder/cuda/decoder_new_token.cuh"

namespace jaxfuse::cuda_decoder {

constexpr int kPositionsInFlight = 2;  // positions per lane group whose k, v loads go out together

// Where a lane works: head_dim as 16-byte vectors of kVec elements, one per lane of a group of
// `lanes` (the next power of two; lanes past head_dim / kVec hold zeros), 32 / lanes groups (slots)
// per warp, each taking its own positions.
template <DType kT>
struct AttnLanes {
  static constexpr int kVec = GemvTile<kT>::kVec;
  int lanes, slots, slot, vec;
  bool valid;  // vec < head_dim / kVec

  __device__ explicit AttnLanes(int head_dim) {
    const int vectors = head_dim / kVec;  // head_dim % kVec == 0: checked on the host
    lanes = 1;
    while (lanes < vectors) lanes *= 2;
    slots = 32 / lanes;
    const int lane = thread_index() % 32;
    slot = lane / lanes;
    vec = lane % lanes;
    valid = vec < vectors;
  }
};

// One lane group's online softmax state per head of the chunk, the lane holding elements
// vec * kVec .. + kVec of o.
template <DType kT>
struct WarpSoftmax {
  float m[kHeadChunk], l[kHeadChunk], o[kHeadChunk][AttnLanes<kT>::kVec];
};

// Attention with RoPE and the cache append, flash-decoding style (see the file comment).
template <DType kT>
struct AttentionStage {
  const DecoderParams& p;
  Smem& sm;
  int layer;

  __device__ void run() const {
    for (int i = blockIdx.x; i < p.plan.attn_items; i += gridDim.x) {
      const AttnItem it = item(i);
      if (it.valid) prefetch_cache(it);
      // An invalid row's item waits too: it writes the row's output, which the previous layer's
      // O projection may still read.
      await_qkv(it);
      if (it.valid) {
        const NewToken<kT> token{p, sm, layer};
        token.load_query_and_new_kv(it);
        if (it.split == 0 && it.chunk == 0) token.append_new_kv(it);
        const AttnLanes<kT> lanes(head_dim_of(p.dims));
        WarpSoftmax<kT> state;
        attend(it, lanes, state);
        merge_slots(lanes, state);
        write_split_partial(it, lanes, state);
      }
      int* counter = p.ws.attn_counter(layer, it.b, it.kv_head, it.chunk);
      if (arrive_last(counter, p.plan.attn_splits, &sm.flag)) {
        if (it.valid) merge_splits(it);
        else zero_output(it);
        mark_finished(counter);
      }
    }
  }

  // Asks L2 for the k and v rows of the item's first kThreads positions, one of each per thread
  // (64 KB a block for head_dim 64 in bf16, as a GEMV item's prefetch; all of a long split's
  // rows, from every block at once, would overflow L2).
  __device__ void prefetch_cache(const AttnItem& it) const {
    const int t = it.t0 + thread_index();
    if (t < it.t1) {
      const int64_t at = it.cache_index(t, p.dims.kv_dim) * GemvTile<kT>::kBytes;
      const int bytes = head_dim_of(p.dims) * GemvTile<kT>::kBytes;
      prefetch_l2(static_cast<const char*>(p.io.k_cache) + at, bytes);
      prefetch_l2(static_cast<const char*>(p.io.v_cache) + at, bytes);
    }
  }

  // Waits for the [q|k|v] tiles that hold the chunk's query heads and its kv head's k and v
  // (stage tiles: q's, then k's, then v's).
  __device__ void await_qkv(const AttnItem& it) const {
    constexpr int kColumns = GemvTile<kT>::kColumns;
    const KernelDims& d = p.dims;
    const int q0 = it.first_head * head_dim_of(d) / kColumns;
    const int qn = ((it.first_head + it.heads) * head_dim_of(d) - 1) / kColumns - q0 + 1;
    const int k0 = it.kv_head * head_dim_of(d) / kColumns;
    const int kn = ((it.kv_head + 1) * head_dim_of(d) - 1) / kColumns - k0 + 1;
    await_finished(p.run.chained, sm.clock, qn + 2 * kn, [&](int i) {
      const int tile = i < qn        ? q0 + i
                       : i < qn + kn ? d.q_tiles + k0 + (i - qn)
                                     : d.q_tiles + d.kv_tiles + k0 + (i - qn - kn);
      return p.ws.qkv_counter(layer, tile);
    });
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
    it.position = p.io.row_position(it.b, d.vocab);
    it.valid = position_valid(it.position, d.max_seq_len);
    if (it.valid) {
      const int len = it.position + 1;
      const int per_split = (len + splits - 1) / splits;
      it.t0 = min(len, it.split * per_split);
      it.t1 = min(len, it.t0 + per_split);
      it.cache_head = (int64_t(layer) * d.batch + it.b) * d.max_seq_len * d.kv_dim +
                      int64_t(it.kv_head) * head_dim_of(d);
    } else {
      it.t0 = it.t1 = 0;
      it.cache_head = 0;
    }
    return it;
  }

  // Out-of-range position (the last split item to arrive): attention output 0 (the row's output
  // becomes NaN).
  __device__ void zero_output(const AttnItem& it) const {
    float* out = p.ws.attn_out.head(it.b, it.first_head);
    for (int i = thread_index(); i < it.heads * head_dim_of(p.dims); i += kThreads) {
      ws_store(out + i, 0.0f);
    }
  }

  // Each lane group's online softmax over its positions of the split: a warp takes slots x
  // kPositionsInFlight consecutive positions at a time, kWarps x that apart.
  __device__ void attend(const AttnItem& it, const AttnLanes<kT>& ln,
                         WarpSoftmax<kT>& s) const {
    constexpr int kVec = AttnLanes<kT>::kVec;
#pragma unroll
    for (int g = 0; g < kHeadChunk; ++g) {
      s.m[g] = neg_inf_f32();
      s.l[g] = 0.0f;
#pragma unroll
      for (int e = 0; e < kVec; ++e) s.o[g][e] = 0.0f;
    }
    const int per_warp = ln.slots * kPositionsInFlight;
    for (int t0 = it.t0 + thread_index() / 32 * per_warp; t0 < it.t1; t0 += kWarps * per_warp) {
      uint4 k[kPositionsInFlight], v[kPositionsInFlight];
#pragma unroll
      for (int u = 0; u < kPositionsInFlight; ++u) {
        load_kv(it, ln, t0 + u * ln.slots + ln.slot, k[u], v[u]);
      }
#pragma unroll
      for (int u = 0; u < kPositionsInFlight; ++u) {
        fold_position(it, ln, t0 + u * ln.slots + ln.slot, k[u], v[u], s);
      }
    }
  }

  // This lane's vectors of position t's k and v as stored (zero past the split or head_dim;
  // the new token's come from shared memory in fold_position).
  __device__ void load_kv(const AttnItem& it, const AttnLanes<kT>& ln, int t, uint4& k,
                          uint4& v) const {
    k = v = uint4{0, 0, 0, 0};
    if (ln.valid && t < it.t1 && t != it.position) {
      const int64_t at =
          (it.cache_index(t, p.dims.kv_dim) + ln.vec * ln.kVec) * GemvTile<kT>::kBytes;
      k = *reinterpret_cast<const uint4*>(static_cast<const char*>(p.io.k_cache) + at);
      v = *reinterpret_cast<const uint4*>(static_cast<const char*>(p.io.v_cache) + at);
    }
  }
  // Folds position t into the lane group's state for each head. Every lane runs the group's
  // shuffles, whether or not t is one of its positions.
  __device__ void fold_position(const AttnItem& it, const AttnLanes<kT>& ln, int t,
                                const uint4& k_raw, const uint4& v_raw,
                                WarpSoftmax<kT>& s) const {
    constexpr int kVec = AttnLanes<kT>::kVec;
    const int hd = head_dim_of(p.dims), j0 = ln.vec * kVec;
    const bool mine = t < it.t1;
    float k[kVec], v[kVec];
    if (t == it.position && ln.valid) {
#pragma unroll
      for (int e = 0; e < kVec; ++e) {
        k[e] = sm.attn_k_new()[j0 + e];
        v[e] = sm.attn_v_new()[j0 + e];
      }
    } else {
      WeightVector<kT, kT>{k_raw}.unpack(k);
      WeightVector<kT, kT>{v_raw}.unpack(v);
    }
#pragma unroll
    for (int g = 0; g < kHeadChunk; ++g) {
      if (g < it.heads) {
        float dot = 0.0f;
        if (ln.valid) {
          const float* q = sm.attn_q(g, hd) + j0;
#pragma unroll
          for (int e = 0; e < kVec; ++e) dot = fmaf(q[e], k[e], dot);
        }
        for (int offset = ln.lanes / 2; offset > 0; offset /= 2) {
          dot += __shfl_xor_sync(0xffffffffu, dot, offset);
        }
        if (mine) {
          float pw;
          const float alpha = online_softmax_step(s.m[g], s.l[g], dot * p.dims.attn_scale, &pw);
#pragma unroll
          for (int e = 0; e < kVec; ++e) s.o[g][e] = s.o[g][e] * alpha + pw * v[e];
        }
      }
    }
  }

  // Merges the warp's lane groups into one state (every lane ends with the merged state of its
  // vector): a butterfly over the slot bits, the lower slot's state always merged first, so both
  // partners compute the same bits.
  __device__ static void merge_slots(const AttnLanes<kT>& ln, WarpSoftmax<kT>& s) {
    constexpr int kVec = AttnLanes<kT>::kVec;
    for (int offset = ln.lanes; offset < 32; offset *= 2) {
      const bool lower = (thread_index() & offset) == 0;
#pragma unroll
      for (int g = 0; g < kHeadChunk; ++g) {
        float m2 = __shfl_xor_sync(0xffffffffu, s.m[g], offset);
        float l2 = __shfl_xor_sync(0xffffffffu, s.l[g], offset);
        float o2[kVec];
#pragma unroll
        for (int e = 0; e < kVec; ++e) o2[e] = __shfl_xor_sync(0xffffffffu, s.o[g][e], offset);
        float m = lower ? s.m[g] : m2, l = lower ? s.l[g] : l2, a, b;
        online_softmax_merge(m, l, lower ? m2 : s.m[g], lower ? l2 : s.l[g], &a, &b);
#pragma unroll
        for (int e = 0; e < kVec; ++e) {
          s.o[g][e] = lower ? s.o[g][e] * a + o2[e] * b : o2[e] * a + s.o[g][e] * b;
        }
        s.m[g] = m;
        s.l[g] = l;
      }
    }
  }

  // Merges the warps' states (fixed order) into this split's partial (m, l, o) per head.
  __device__ void write_split_partial(const AttnItem& it, const AttnLanes<kT>& ln,
                                     const WarpSoftmax<kT>& s) const {
    constexpr int kVec = AttnLanes<kT>::kVec;
    const int t = thread_index(), warp = t / 32, lane = t % 32, hd = head_dim_of(p.dims);
    __syncthreads();
#pragma unroll
    for (int g = 0; g < kHeadChunk; ++g) {
      if (lane == 0) {
        sm.attn_warp_ml(warp, g)[0] = s.m[g];
        sm.attn_warp_ml(warp, g)[1] = s.l[g];
      }
      if (ln.slot == 0 && ln.valid) {
#pragma unroll
        for (int e = 0; e < kVec; ++e) sm.attn_warp_o(warp, g)[ln.vec * kVec + e] = s.o[g][e];
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
    const int hd = head_dim_of(p.dims);
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
