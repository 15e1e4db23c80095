// jaxfuse_decoder, CUDA: one decode step of an L-layer Llama-style decoder in ONE persistent,
// cooperative kernel launch.
//
// Launch: cooperative (launch_kernel), kThreads threads per block, grid = co-resident blocks
// (occupancy x SMs, at most kMaxBlocksPerSm per SM; cached per device). Stages are separated by
// cooperative-groups grid syncs (acquire/release at grid scope):
//
//   pre:   h = float(x), per-tile sums of squares of h                              | sync
//   per layer l:
//   QKV:   [q|k|v] = rmsnorm(h) * attn_norm @ [wq|wk|wv]                             | sync
//   ATT:   RoPE on q, k; append k, v at [l, b, p]; flash-decoding over 0..p          | sync
//   O:     h += attn @ wo; sums of squares of h                                      | sync
//   GU:    act = silu(m @ w_gate) * (m @ w_up), m = rmsnorm(h) * mlp_norm             | sync
//   DOWN:  h += act @ w_down; sums of squares (last layer: out = h, NaN rows for bad p) | sync
//
// GEMV (weights [K, N], N contiguous): a column tile is 32 lanes x one 16-byte vector (256
// columns of a 16-bit dtype, 128 of fp32), so every warp load is 512 contiguous bytes. A work
// item is (tile, split of K); the 8 warps of a block take interleaved groups of kUnroll rows (8
// independent 16-byte loads in flight per lane), accumulate fp32 for up to kBatchPass batch rows
// (more rows: another pass over the same, now L1/L2-resident, weight slice), reduce across
// warps in shared memory and write one partial per (item, batch row) to the workspace. The last
// block to finish a tile (an atomic counter, release/acquire by __threadfence) sums the partials
// of all splits in a fixed order, so results are deterministic, and applies the epilogue
// (residual add, SwiGLU, sums of squares for the next RMSNorm). No extra grid sync is needed for
// the split-K reduction.
//
// Attention (flash-decoding): a work item is (batch row, kv head, chunk of <= 4 query heads of
// its group, split of 0..p); warps stride over positions, lanes split head_dim; online softmax
// per warp, merged across warps in shared memory, one partial (m, l, o) per split; the last
// split to finish (counter) merges all splits in a fixed order. The current token's k/v are used
// from registers/shared memory (rounded to the cache dtype, exactly what the cache will hold),
// and written to the cache by one item per (b, kv head); no block reads [l, b, p] from memory.
//
// Workspace: the workspace result (decoder_ffi.h layout) holds every fp32 activation, the
// partial sums and the counters. The counters are reset with cudaMemsetAsync on the stream each
// call, so the handler does no allocation and no synchronization, and is command-buffer (CUDA
// graph) compatible. Workspace data written by other blocks is read with ld.global.cg (L2), so
// stale L1 lines are never observed; weights are read through the read-only path.
#include <cooperative_groups.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <initializer_list>

#include "jaxfuse/decoder_ffi.h"
#include "launch.cuh"

namespace jaxfuse {
namespace {

namespace cg = cooperative_groups;

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kBatchPass = 4;     // batch rows accumulated per pass over a weight slice
constexpr int kUnroll = 8;        // rows (16-byte loads) in flight per lane
constexpr int kKChunk = 256;      // GEMV input rows staged in shared memory at a time
constexpr int kMaxHeadDim = 256;  // lanes hold head_dim / 32 <= 8 elements
constexpr int kEpl = kMaxHeadDim / 32;
constexpr int kHeadChunk = int(kDecHeadChunk);
constexpr int kMaxBlocksPerSm = 2;
constexpr int kMaxTile = 256;  // columns per tile for 16-bit dtypes

static_assert(kHeadChunk == 4, "attention accumulators are sized for 4 heads");

struct DecParams {
  const void* x;
  const int32_t* pos;
  const void* attn_norm;
  const void* wq;
  const void* wk;
  const void* wv;
  const void* wo;
  const void* mlp_norm;
  const void* w_gate;
  const void* w_up;
  const void* w_down;
  void* kc;
  void* vc;
  void* out;
  float* h;
  float* ss;
  float* qkv;
  float* attn;
  float* act;
  float* attn_part;
  float* part;
  int* counters;
  int L, B, D, H, KV, hd, I, S;
  int nt_d, nt_q, nt_kv, nt_i;
  int s_qkv, s_o, s_gu, s_down;  // K splits per GEMV stage
  int ns;                        // attention splits
  int hc;                        // head chunks per kv head
  int c_qkv, c_o, c_gu, c_down, c_attn;  // counter bases
  float eps;
  float scale;
  double theta;
};

// ---- storage types -------------------------------------------------------------------------

template <DType kT>
struct Storage {
  static constexpr int kBytes = kT == DType::kF32 ? 4 : 2;
  static constexpr int kVec = 16 / kBytes;  // elements per 16-byte vector
  static constexpr int kTile = 32 * kVec;   // GEMV tile columns
};

template <DType kT>
__device__ __forceinline__ void unpack16(const uint4& r, float* o) {
  const uint32_t w[4] = {r.x, r.y, r.z, r.w};
  if constexpr (kT == DType::kF32) {
#pragma unroll
    for (int i = 0; i < 4; ++i) o[i] = __uint_as_float(w[i]);
  } else {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const uint16_t lo = uint16_t(w[i] & 0xffffu), hi = uint16_t(w[i] >> 16);
      if constexpr (kT == DType::kBF16) {
        o[2 * i] = bf16_to_float(lo);
        o[2 * i + 1] = bf16_to_float(hi);
      } else {
        o[2 * i] = f16_to_float(lo);
        o[2 * i + 1] = f16_to_float(hi);
      }
    }
  }
}

template <DType kT>
__device__ __forceinline__ float ld_elem(const void* base, int64_t i) {
  return load_as_float(base, kT, i);
}

template <DType kT>
__device__ __forceinline__ void st_elem(void* base, int64_t i, float v) {
  store_from_float(base, kT, i, v);
}

template <DType kT>
__device__ __forceinline__ const void* elem_ptr(const void* base, int64_t i) {
  return static_cast<const char*>(base) + i * Storage<kT>::kBytes;
}

// Workspace values written by other blocks in this launch: read from L2, never a stale L1 line.
__device__ __forceinline__ float ld_ws(const float* p) { return __ldcg(p); }

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// Sum over the block; the result is valid in thread 0. `scratch` holds kWarps floats.
__device__ __forceinline__ float block_sum(float v, float* scratch) {
  v = warp_sum(v);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  __syncthreads();  // scratch may still be read from a previous call
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  float r = 0.0f;
  if (threadIdx.x == 0) {
    for (int w = 0; w < kWarps; ++w) r += scratch[w];
  }
  return r;
}

// Release this block's writes and count its arrival; true in every thread of the last block
// to arrive (which then sees every arrived block's writes).
__device__ __forceinline__ bool arrive_last(int* counter, int expected, int* flag) {
  __threadfence();  // release: this thread's partials are visible device-wide
  __syncthreads();  // ...for every thread of the block
  if (threadIdx.x == 0) *flag = atomicAdd(counter, 1) == expected - 1;
  __syncthreads();
  const bool last = *flag != 0;
  if (last) __threadfence();  // acquire
  return last;
}

// ---- shared memory ---------------------------------------------------------------------------

struct Smem {
  float red[kWarps * kBatchPass * kMaxTile];  // cross-warp GEMV reduction / attention warp states
  float stage[2048];                          // staged GEMV inputs / q, k_new, v_new
  float ml[2 * kWarps * kHeadChunk];          // attention warp (m, l)
  float inv_rms[kBatchPass];
  float scratch[kWarps];
  int flag;
};
static_assert(kBatchPass * kKChunk <= 2048, "staging area too small");
static_assert(kHeadChunk * kMaxHeadDim + 2 * kMaxHeadDim <= 2048, "attention staging too small");
static_assert(kWarps * kHeadChunk * kMaxHeadDim <= kWarps * kBatchPass * kMaxTile,
              "attention merge area too small");

// ---- GEMV stage --------------------------------------------------------------------------------

struct GemvStage {
  const void* w[3];  // this layer's [K, n[m]] matrices
  int n[3];          // columns of each matrix
  int tiles[3];      // column tiles of each matrix
  int nmat;
  int K;
  int splits;
  bool paired;  // matrices 0 and 1 (gate, up): tile c of both shares one reducer
  int* counters;
};

// Input functors: prepare(bc0, nb, inv) runs on threads < nb before staging; value(b, k).
struct NormInput {  // rmsnorm(h) * norm
  const float* h;
  const float* ss;
  const void* norm;
  int D, nt_d;
  float eps;
};

struct PlainInput {  // a fp32 workspace matrix [B, K]
  const float* a;
  int K;
};

template <DType kT>
__device__ __forceinline__ void prepare_input(const NormInput& in, int b, float* inv) {
  float s = 0.0f;
  for (int j = 0; j < in.nt_d; ++j) s += ld_ws(in.ss + int64_t(b) * in.nt_d + j);
  *inv = rms_inv(s, in.D, in.eps);
}
template <DType kT>
__device__ __forceinline__ void prepare_input(const PlainInput&, int, float*) {}

template <DType kT>
__device__ __forceinline__ float input_value(const NormInput& in, int b, int k, float inv) {
  return rms_apply(ld_ws(in.h + int64_t(b) * in.D + k), inv, ld_elem<kT>(in.norm, k));
}
template <DType kT>
__device__ __forceinline__ float input_value(const PlainInput& in, int b, int k, float) {
  return ld_ws(in.a + int64_t(b) * in.K + k);
}

// Runs a GEMV stage. `reduce(g, tile_of_group...)` is called by the whole last block of group g:
// reduce(group, sm) with the partials complete; it uses tile_sum() to read them.
template <DType kT, typename Input, typename Reduce>
__device__ void gemv_stage(const DecParams& P, Smem& sm, const GemvStage& st, const Input& in,
                           const Reduce& reduce) {
  constexpr int kVec = Storage<kT>::kVec;
  constexpr int kTile = Storage<kT>::kTile;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int ntiles = st.tiles[0] + (st.nmat > 1 ? st.tiles[1] : 0) + (st.nmat > 2 ? st.tiles[2] : 0);
  const int S = st.splits;
  const int items = ntiles * S;
  const int B = P.B;
  for (int item = blockIdx.x; item < items; item += gridDim.x) {
    const int t = item / S, s = item % S;
    int m = 0, lt = t;
    while (lt >= st.tiles[m]) lt -= st.tiles[m++];
    const int N = st.n[m];
    const int col = lt * kTile + lane * kVec;
    const bool cvalid = col < N;  // N % kVec == 0 (checked on the host)
    const char* W = static_cast<const char*>(st.w[m]);
    const int k0 = int(int64_t(st.K) * s / S), k1 = int(int64_t(st.K) * (s + 1) / S);
    for (int bc0 = 0; bc0 < B; bc0 += kBatchPass) {
      const int nb = min(kBatchPass, B - bc0);
      float acc[kBatchPass][kVec];
#pragma unroll
      for (int bb = 0; bb < kBatchPass; ++bb)
#pragma unroll
        for (int v = 0; v < kVec; ++v) acc[bb][v] = 0.0f;
      for (int r0 = k0; r0 < k1; r0 += kKChunk) {
        const int rl = min(kKChunk, k1 - r0);
        __syncthreads();  // previous readers of the staging area are done
        if (threadIdx.x < nb) prepare_input<kT>(in, bc0 + threadIdx.x, &sm.inv_rms[threadIdx.x]);
        __syncthreads();
        for (int i = threadIdx.x; i < nb * kKChunk; i += kThreads) {
          const int bb = i / kKChunk, r = i % kKChunk;
          sm.stage[i] = r < rl ? input_value<kT>(in, bc0 + bb, r0 + r, sm.inv_rms[bb]) : 0.0f;
        }
        __syncthreads();
        for (int rb = warp * kUnroll; rb < rl; rb += kWarps * kUnroll) {
          uint4 raw[kUnroll];
#pragma unroll
          for (int u = 0; u < kUnroll; ++u) {
            const int r = rb + u;
            if (cvalid && r < rl) {
              raw[u] = __ldg(reinterpret_cast<const uint4*>(
                  W + (int64_t(r0 + r) * N + col) * Storage<kT>::kBytes));
            } else {
              raw[u] = make_uint4(0u, 0u, 0u, 0u);
            }
          }
#pragma unroll
          for (int u = 0; u < kUnroll; ++u) {
            float wf[kVec];
            unpack16<kT>(raw[u], wf);
            const int r = min(rb + u, kKChunk - 1);  // rows past rl have zero weights
#pragma unroll
            for (int bb = 0; bb < kBatchPass; ++bb) {
              if (bb < nb) {
                const float a = sm.stage[bb * kKChunk + r];
#pragma unroll
                for (int v = 0; v < kVec; ++v) acc[bb][v] = fmaf(a, wf[v], acc[bb][v]);
              }
            }
          }
        }
      }
      // Cross-warp reduction, then one partial per (item, batch row).
      __syncthreads();
#pragma unroll
      for (int bb = 0; bb < kBatchPass; ++bb)
#pragma unroll
        for (int v = 0; v < kVec; ++v) sm.red[(warp * kBatchPass + bb) * kTile + lane * kVec + v] = acc[bb][v];
      __syncthreads();
      for (int i = threadIdx.x; i < nb * kTile; i += kThreads) {
        const int bb = i / kTile, c = i % kTile;
        float sum = 0.0f;
#pragma unroll
        for (int w = 0; w < kWarps; ++w) sum += sm.red[(w * kBatchPass + bb) * kTile + c];
        __stcg(P.part + (int64_t(item) * B + bc0 + bb) * kTile + c, sum);
      }
    }
    const int group = st.paired ? (t % st.tiles[0]) : t;
    const int expected = st.paired ? 2 * S : S;
    if (arrive_last(st.counters + group, expected, &sm.flag)) reduce(group, sm);
  }
}

// Sum over splits (fixed order) of the partials of tile t at (b, c).
template <DType kT>
__device__ __forceinline__ float tile_sum(const DecParams& P, int t, int S, int b, int c) {
  constexpr int kTile = Storage<kT>::kTile;
  float y = 0.0f;
  for (int s = 0; s < S; ++s) y += ld_ws(P.part + (int64_t(t * S + s) * P.B + b) * kTile + c);
  return y;
}

// Reducer for a residual GEMV (O and DOWN): h += y over the tile, sums of squares per tile, and
// after the last layer the output row.
template <DType kT>
__device__ void residual_reduce(const DecParams& P, Smem& sm, int t, int S, bool last_layer) {
  constexpr int kTile = Storage<kT>::kTile;
  const int c = threadIdx.x;
  const int col = t * kTile + c;
  for (int b = 0; b < P.B; ++b) {
    float sq = 0.0f;
    if (c < kTile && col < P.D) {
      const int64_t i = int64_t(b) * P.D + col;
      const float hn = ld_ws(P.h + i) + tile_sum<kT>(P, t, S, b, c);
      __stcg(P.h + i, hn);
      sq = hn * hn;
      if (last_layer) st_elem<kT>(P.out, i, position_valid(P.pos[b], P.S) ? hn : quiet_nan_f32());
    }
    const float total = block_sum(sq, sm.scratch);
    if (threadIdx.x == 0) __stcg(P.ss + int64_t(b) * P.nt_d + t, total);
  }
}

// ---- attention stage ---------------------------------------------------------------------------

template <DType kT>
__device__ void attention_stage(const DecParams& P, Smem& sm, int l) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int hd = P.hd, half = hd / 2, G = P.H / P.KV, NS = P.ns;
  const int QD = P.H * hd, KVD = P.KV * hd, QKV = QD + 2 * KVD;
  const int items = P.B * P.KV * P.hc * NS;
  float* q_s = sm.stage;                        // [kHeadChunk][hd]
  float* kn_s = sm.stage + kHeadChunk * kMaxHeadDim;  // [hd]
  float* vn_s = kn_s + kMaxHeadDim;             // [hd]
  for (int item = blockIdx.x; item < items; item += gridDim.x) {
    const int s = item % NS;
    int rest = item / NS;
    const int hc = rest % P.hc;
    rest /= P.hc;
    const int kvh = rest % P.KV;
    const int b = rest / P.KV;
    const int qh0 = kvh * G + hc * kHeadChunk;
    const int nh = min(kHeadChunk, G - hc * kHeadChunk);
    const int32_t p = P.pos[b];
    if (!position_valid(p, P.S)) {
      // Invalid position: no cache access; attention output 0 (the row's output becomes NaN).
      if (s == 0) {
        for (int i = threadIdx.x; i < nh * hd; i += kThreads) {
          __stcg(P.attn + int64_t(b) * QD + int64_t(qh0) * hd + i, 0.0f);
        }
      }
      continue;
    }
    const int len = p + 1;
    const int chunk = (len + NS - 1) / NS;
    const int t0 = min(len, s * chunk), t1 = min(len, t0 + chunk);
    const float* qkv = P.qkv + int64_t(b) * QKV;

    __syncthreads();  // the staging area may still be read by the previous item
    for (int i = threadIdx.x; i < (nh + 1) * half; i += kThreads) {
      const int g = i / half, j = i % half;
      float c, sn;
      rope_cos_sin(rope_angle(p, j, hd, P.theta), &c, &sn);
      if (g < nh) {
        const float* q = qkv + int64_t(qh0 + g) * hd;
        float x1 = ld_ws(q + j), x2 = ld_ws(q + j + half);
        rope_rotate(x1, x2, c, sn);
        q_s[g * hd + j] = x1;
        q_s[g * hd + j + half] = x2;
      } else {  // the kv head's new key, rounded to what the cache holds
        const float* k = qkv + QD + int64_t(kvh) * hd;
        float x1 = ld_ws(k + j), x2 = ld_ws(k + j + half);
        rope_rotate(x1, x2, c, sn);
        kn_s[j] = round_to(kT, x1);
        kn_s[j + half] = round_to(kT, x2);
      }
    }
    for (int j = threadIdx.x; j < hd; j += kThreads) {
      vn_s[j] = round_to(kT, ld_ws(qkv + QD + KVD + int64_t(kvh) * hd + j));
    }
    __syncthreads();
    const int64_t row0 = ((int64_t(l) * P.B + b) * P.S) * KVD + int64_t(kvh) * hd;  // position 0
    if (s == 0 && hc == 0) {
      for (int j = threadIdx.x; j < hd; j += kThreads) {
        st_elem<kT>(P.kc, row0 + int64_t(p) * KVD + j, kn_s[j]);
        st_elem<kT>(P.vc, row0 + int64_t(p) * KVD + j, vn_s[j]);
      }
    }

    float m[kHeadChunk], lsum[kHeadChunk], o[kHeadChunk][kEpl];
#pragma unroll
    for (int g = 0; g < kHeadChunk; ++g) {
      m[g] = neg_inf_f32();
      lsum[g] = 0.0f;
#pragma unroll
      for (int e = 0; e < kEpl; ++e) o[g][e] = 0.0f;
    }
    for (int t = t0 + warp; t < t1; t += kWarps) {
      float kf[kEpl], vf[kEpl];
      const int64_t at = row0 + int64_t(t) * KVD;
#pragma unroll
      for (int e = 0; e < kEpl; ++e) {
        const int j = lane + 32 * e;
        if (j < hd) {
          kf[e] = t == p ? kn_s[j] : ld_elem<kT>(P.kc, at + j);
          vf[e] = t == p ? vn_s[j] : ld_elem<kT>(P.vc, at + j);
        } else {
          kf[e] = 0.0f;
          vf[e] = 0.0f;
        }
      }
#pragma unroll
      for (int g = 0; g < kHeadChunk; ++g) {
        if (g < nh) {
          float dot = 0.0f;
#pragma unroll
          for (int e = 0; e < kEpl; ++e) {
            const int j = lane + 32 * e;
            if (j < hd) dot = fmaf(q_s[g * hd + j], kf[e], dot);
          }
          dot = warp_sum(dot);
          float pw;
          const float alpha = online_softmax_step(m[g], lsum[g], dot * P.scale, &pw);
#pragma unroll
          for (int e = 0; e < kEpl; ++e) o[g][e] = o[g][e] * alpha + pw * vf[e];
        }
      }
    }
    // Merge the warps' states (fixed order) and write this split's partial.
    __syncthreads();
#pragma unroll
    for (int g = 0; g < kHeadChunk; ++g) {
      if (lane == 0) {
        sm.ml[(warp * kHeadChunk + g) * 2] = m[g];
        sm.ml[(warp * kHeadChunk + g) * 2 + 1] = lsum[g];
      }
#pragma unroll
      for (int e = 0; e < kEpl; ++e) {
        const int j = lane + 32 * e;
        if (j < hd) sm.red[(warp * kHeadChunk + g) * kMaxHeadDim + j] = o[g][e];
      }
    }
    __syncthreads();
    for (int i = threadIdx.x; i < nh * hd; i += kThreads) {
      const int g = i / hd, j = i % hd;
      float M = neg_inf_f32(), Lw = 0.0f, O = 0.0f;
      for (int w = 0; w < kWarps; ++w) {
        float a, bw;
        online_softmax_merge(M, Lw, sm.ml[(w * kHeadChunk + g) * 2], sm.ml[(w * kHeadChunk + g) * 2 + 1],
                             &a, &bw);
        O = O * a + sm.red[(w * kHeadChunk + g) * kMaxHeadDim + j] * bw;
      }
      float* dst = P.attn_part + ((int64_t(b) * P.H + qh0 + g) * NS + s) * (hd + 2);
      if (j == 0) {
        __stcg(dst, M);
        __stcg(dst + 1, Lw);
      }
      __stcg(dst + 2 + j, O);
    }
    int* counter = P.counters + P.c_attn + ((int64_t(l) * P.B + b) * P.KV + kvh) * P.hc + hc;
    if (arrive_last(counter, NS, &sm.flag)) {
      for (int i = threadIdx.x; i < nh * hd; i += kThreads) {
        const int g = i / hd, j = i % hd;
        const float* src = P.attn_part + ((int64_t(b) * P.H + qh0 + g) * NS) * (hd + 2);
        float M = neg_inf_f32(), Lw = 0.0f, O = 0.0f;
        for (int k = 0; k < NS; ++k) {
          const float* sp = src + int64_t(k) * (hd + 2);
          float a, bw;
          online_softmax_merge(M, Lw, ld_ws(sp), ld_ws(sp + 1), &a, &bw);
          O = O * a + ld_ws(sp + 2 + j) * bw;
        }
        __stcg(P.attn + int64_t(b) * QD + int64_t(qh0 + g) * hd + j, O / Lw);
      }
    }
  }
}

// ---- the kernel ----------------------------------------------------------------------------------

template <DType kT>
// Min blocks per SM pinned: without it ptxas may use up to 168 registers (one block per SM).
__global__ void __launch_bounds__(kThreads, kMaxBlocksPerSm) decoder_kernel(const __grid_constant__ DecParams P) {
  constexpr int kTile = Storage<kT>::kTile;
  __shared__ Smem sm;
  cg::grid_group grid = cg::this_grid();
  const int QD = P.H * P.hd, KVD = P.KV * P.hd;

  // pre: h = float(x) and its per-tile sums of squares.
  for (int item = blockIdx.x; item < P.B * P.nt_d; item += gridDim.x) {
    const int b = item / P.nt_d, t = item % P.nt_d;
    const int col = t * kTile + threadIdx.x;
    float sq = 0.0f;
    if (threadIdx.x < kTile && col < P.D) {
      const int64_t i = int64_t(b) * P.D + col;
      const float v = ld_elem<kT>(P.x, i);
      __stcg(P.h + i, v);
      sq = v * v;
    }
    const float total = block_sum(sq, sm.scratch);
    if (threadIdx.x == 0) __stcg(P.ss + int64_t(b) * P.nt_d + t, total);
  }
  grid.sync();

  for (int l = 0; l < P.L; ++l) {
    const bool last_layer = l == P.L - 1;
    const NormInput attn_in{P.h, P.ss, elem_ptr<kT>(P.attn_norm, int64_t(l) * P.D), P.D, P.nt_d, P.eps};
    const NormInput mlp_in{P.h, P.ss, elem_ptr<kT>(P.mlp_norm, int64_t(l) * P.D), P.D, P.nt_d, P.eps};

    // QKV
    {
      GemvStage st{};
      st.w[0] = elem_ptr<kT>(P.wq, int64_t(l) * P.D * QD);
      st.w[1] = elem_ptr<kT>(P.wk, int64_t(l) * P.D * KVD);
      st.w[2] = elem_ptr<kT>(P.wv, int64_t(l) * P.D * KVD);
      st.n[0] = QD;
      st.n[1] = KVD;
      st.n[2] = KVD;
      st.tiles[0] = P.nt_q;
      st.tiles[1] = P.nt_kv;
      st.tiles[2] = P.nt_kv;
      st.nmat = 3;
      st.K = P.D;
      st.splits = P.s_qkv;
      st.paired = false;
      st.counters = P.counters + P.c_qkv + l * (P.nt_q + 2 * P.nt_kv);
      const int S = st.splits;
      gemv_stage<kT>(P, sm, st, attn_in, [&](int t, Smem&) {
        int m = 0, lt = t;
        while (lt >= st.tiles[m]) lt -= st.tiles[m++];
        const int off = m == 0 ? 0 : (m == 1 ? QD : QD + KVD);
        const int c = threadIdx.x, col = lt * kTile + c;
        if (c < kTile && col < st.n[m]) {
          for (int b = 0; b < P.B; ++b) {
            __stcg(P.qkv + int64_t(b) * (QD + 2 * KVD) + off + col, tile_sum<kT>(P, t, S, b, c));
          }
        }
      });
    }
    grid.sync();

    attention_stage<kT>(P, sm, l);
    grid.sync();

    // O projection + residual
    {
      GemvStage st{};
      st.w[0] = elem_ptr<kT>(P.wo, int64_t(l) * QD * P.D);
      st.n[0] = P.D;
      st.tiles[0] = P.nt_d;
      st.nmat = 1;
      st.K = QD;
      st.splits = P.s_o;
      st.counters = P.counters + P.c_o + l * P.nt_d;
      const PlainInput in{P.attn, QD};
      gemv_stage<kT>(P, sm, st, in, [&](int t, Smem& s) { residual_reduce<kT>(P, s, t, st.splits, false); });
    }
    grid.sync();

    // gate/up + SwiGLU
    {
      GemvStage st{};
      st.w[0] = elem_ptr<kT>(P.w_gate, int64_t(l) * P.D * P.I);
      st.w[1] = elem_ptr<kT>(P.w_up, int64_t(l) * P.D * P.I);
      st.n[0] = P.I;
      st.n[1] = P.I;
      st.tiles[0] = P.nt_i;
      st.tiles[1] = P.nt_i;
      st.nmat = 2;
      st.K = P.D;
      st.splits = P.s_gu;
      st.paired = true;
      st.counters = P.counters + P.c_gu + l * P.nt_i;
      const int S = st.splits;
      gemv_stage<kT>(P, sm, st, mlp_in, [&](int g, Smem&) {
        const int c = threadIdx.x, col = g * kTile + c;
        if (c < kTile && col < P.I) {
          for (int b = 0; b < P.B; ++b) {
            const float yg = tile_sum<kT>(P, g, S, b, c);
            const float yu = tile_sum<kT>(P, P.nt_i + g, S, b, c);
            __stcg(P.act + int64_t(b) * P.I + col, swiglu(yg, yu));
          }
        }
      });
    }
    grid.sync();

    // down projection + residual
    {
      GemvStage st{};
      st.w[0] = elem_ptr<kT>(P.w_down, int64_t(l) * P.I * P.D);
      st.n[0] = P.D;
      st.tiles[0] = P.nt_d;
      st.nmat = 1;
      st.K = P.I;
      st.splits = P.s_down;
      st.counters = P.counters + P.c_down + l * P.nt_d;
      const PlainInput in{P.act, P.I};
      gemv_stage<kT>(P, sm, st, in,
                     [&](int t, Smem& s) { residual_reduce<kT>(P, s, t, st.splits, last_layer); });
    }
    if (!last_layer) grid.sync();
  }
}

// ---- host side -----------------------------------------------------------------------------------

// Co-resident grid for the kernel of one dtype on the current device (cached per device).
template <DType kT>
cudaError_t decoder_grid(int device, int* blocks) {
  static std::atomic<int> cached[64];
  if (device >= 0 && device < 64) {
    const int c = cached[device].load(std::memory_order_relaxed);
    if (c > 0) {
      *blocks = c;
      return cudaSuccess;
    }
  }
  int coop = 0, sms = 0, per_sm = 0;
  cudaError_t err = cudaDeviceGetAttribute(&coop, cudaDevAttrCooperativeLaunch, device);
  if (err != cudaSuccess) return err;
  if (!coop) return cudaErrorNotSupported;
  err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  if (err != cudaSuccess) return err;
  err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, decoder_kernel<kT>, kThreads, 0);
  if (err != cudaSuccess) return err;
  if (per_sm < 1) return cudaErrorInvalidConfiguration;
  *blocks = sms * std::min(per_sm, kMaxBlocksPerSm);
  if (device >= 0 && device < 64) cached[device].store(*blocks, std::memory_order_relaxed);
  return cudaSuccess;
}

// K splits for a GEMV stage: enough items to cover the grid, at most kDecMaxGemvItems partial
// slots, at least 16 rows per split.
int gemv_splits(int grid, int ntiles, int K) {
  const int budget = int(std::min<int64_t>(grid, kDecMaxGemvItems));
  int s = std::max(1, budget / ntiles);
  s = std::min(s, std::max(1, K / 16));
  return s;
}

template <DType kT>
ffi::Error launch_decoder(cudaStream_t stream, const DecoderDims& d, DecParams P) {
  int device = 0;
  JF_CUDA_RETURN_IF_ERROR(cudaGetDevice(&device));
  int grid = 0;
  const cudaError_t gerr = decoder_grid<kT>(device, &grid);
  if (gerr == cudaErrorNotSupported) {
    return internal_error("jaxfuse_decoder: device ", device, " does not support cooperative launch");
  }
  JF_CUDA_RETURN_IF_ERROR(gerr);
  const DecoderLayout lay = decoder_layout(d);
  P.s_qkv = gemv_splits(grid, P.nt_q + 2 * P.nt_kv, P.D);
  P.s_o = gemv_splits(grid, P.nt_d, P.H * P.hd);
  P.s_gu = gemv_splits(grid, 2 * P.nt_i, P.D);
  P.s_down = gemv_splits(grid, P.nt_d, P.I);
  const int64_t attn_base = int64_t(P.B) * P.KV * P.hc;
  P.ns = int(std::clamp<int64_t>(grid / std::max<int64_t>(1, attn_base), 1, kDecMaxAttnSplits));
  P.ns = std::min<int>(P.ns, std::max(1, P.S / 16));
  JF_CUDA_RETURN_IF_ERROR(
      cudaMemsetAsync(P.counters, 0, size_t(lay.num_counters) * sizeof(int), stream));
  return launch_kernel("jaxfuse_decoder", decoder_kernel<kT>, dim3(grid), dim3(kThreads), stream,
                       /*cooperative=*/true, P);
}

ffi::Error DecoderCuda(cudaStream_t stream, ffi::AnyBuffer x, PositionsBuffer positions,
                       ffi::AnyBuffer attn_norm, ffi::AnyBuffer wq, ffi::AnyBuffer wk,
                       ffi::AnyBuffer wv, ffi::AnyBuffer wo, ffi::AnyBuffer mlp_norm,
                       ffi::AnyBuffer w_gate, ffi::AnyBuffer w_up, ffi::AnyBuffer w_down,
                       ffi::AnyBuffer k_cache, ffi::AnyBuffer v_cache,
                       ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> k_out,
                       ffi::Result<ffi::AnyBuffer> v_out, ffi::Result<WorkspaceBuffer> workspace,
                       DecoderAttrs attrs) {
  const ffi::AnyBuffer weights[9] = {attn_norm, wq, wk, wv, wo, mlp_norm, w_gate, w_up, w_down};
  DecoderDims d;
  JF_RETURN_IF_ERROR(decode_decoder_call(x, positions, weights, k_cache, v_cache, *out, *k_out,
                                         *v_out, *workspace, attrs, &d));
  if (d.B == 0) return ffi::Error::Success();
  // Kernel limits: 16-byte weight vectors, lane-split heads, 32-bit indices within a matrix.
  const int64_t vec = d.vec();
  if (d.D % vec || d.I % vec || d.q_dim() % vec || d.kv_dim() % vec) {
    return invalid_argument("jaxfuse_decoder (CUDA): hidden_size, intermediate_size, num_heads*head_dim "
                            "and num_kv_heads*head_dim must be multiples of ", vec, " for ",
                            dtype_name(d.dtype));
  }
  if (d.hd > kMaxHeadDim) {
    return invalid_argument("jaxfuse_decoder (CUDA): head_dim must be <= ", kMaxHeadDim);
  }
  const int64_t big = std::max({d.L * d.D * std::max({d.q_dim(), d.I}), d.L * d.I * d.D,
                                d.L * d.B * d.S * d.kv_dim()});
  // Headroom below INT32_MAX: attention chunk bounds add up to one chunk to a position.
  if (big >= (int64_t(1) << 62) / 4 || d.B * std::max(d.D, d.I) >= INT32_MAX ||
      d.S >= INT32_MAX / 2) {
    return invalid_argument("jaxfuse_decoder (CUDA): sizes too large");
  }
  // 16-byte vector loads of the weights need 16-byte aligned buffers (XLA's are; a view may
  // not be). A misaligned load would be a sticky device fault, not an error we can return.
  for (const ffi::AnyBuffer* b : {&x, &wq, &wk, &wv, &wo, &w_gate, &w_up, &w_down, &k_cache, &v_cache}) {
    if (reinterpret_cast<uintptr_t>(b->untyped_data()) % 16 != 0) {
      return invalid_argument("jaxfuse_decoder (CUDA): operand buffers must be 16-byte aligned");
    }
  }
  char* ws = reinterpret_cast<char*>(workspace->typed_data());
  const DecoderLayout lay = decoder_layout(d);
  DecParams P{};
  P.x = x.untyped_data();
  P.pos = positions.typed_data();
  P.attn_norm = attn_norm.untyped_data();
  P.wq = wq.untyped_data();
  P.wk = wk.untyped_data();
  P.wv = wv.untyped_data();
  P.wo = wo.untyped_data();
  P.mlp_norm = mlp_norm.untyped_data();
  P.w_gate = w_gate.untyped_data();
  P.w_up = w_up.untyped_data();
  P.w_down = w_down.untyped_data();
  P.kc = k_out->untyped_data();
  P.vc = v_out->untyped_data();
  P.out = out->untyped_data();
  P.h = reinterpret_cast<float*>(ws + lay.h);
  P.ss = reinterpret_cast<float*>(ws + lay.ss);
  P.qkv = reinterpret_cast<float*>(ws + lay.qkv);
  P.attn = reinterpret_cast<float*>(ws + lay.attn);
  P.act = reinterpret_cast<float*>(ws + lay.act);
  P.attn_part = reinterpret_cast<float*>(ws + lay.attn_part);
  P.part = reinterpret_cast<float*>(ws + lay.gemv_part);
  P.counters = reinterpret_cast<int*>(ws + lay.counters);
  P.L = int(d.L);
  P.B = int(d.B);
  P.D = int(d.D);
  P.H = int(d.H);
  P.KV = int(d.KV);
  P.hd = int(d.hd);
  P.I = int(d.I);
  P.S = int(d.S);
  P.nt_d = int(d.tiles(d.D));
  P.nt_q = int(d.tiles(d.q_dim()));
  P.nt_kv = int(d.tiles(d.kv_dim()));
  P.nt_i = int(d.tiles(d.I));
  P.hc = int(d.head_chunks());
  P.c_qkv = int(lay.c_qkv);
  P.c_o = int(lay.c_o);
  P.c_gu = int(lay.c_gu);
  P.c_down = int(lay.c_down);
  P.c_attn = int(lay.c_attn);
  P.eps = d.eps;
  P.scale = 1.0f / std::sqrt(float(d.hd));
  P.theta = d.theta;
  switch (d.dtype) {
    case DType::kF32: return launch_decoder<DType::kF32>(stream, d, P);
    case DType::kBF16: return launch_decoder<DType::kBF16>(stream, d, P);
    default: return launch_decoder<DType::kF16>(stream, d, P);
  }
}

}  // namespace

// Command-buffer compatible: a memset and one kernel on the given stream, no allocation, no
// host synchronization; temporaries live in the workspace result.
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxfuseDecoderCuda, DecoderCuda,
                              decoder_binding<ffi::PlatformStream<cudaStream_t>>(),
                              {ffi::Traits::kCmdBufferCompatible});

}  // namespace jaxfuse
