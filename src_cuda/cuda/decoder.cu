// jaxfuse_decoder, CUDA: one decode step of an L-layer Llama-style decoder in ONE persistent,
// cooperative kernel launch.
//
// Launch: cooperative (launch_kernel), kThreads threads per block, grid = co-resident blocks
// (occupancy x SMs, at most kMaxBlocksPerSm per SM; cached per device). The kernel is a sequence
// of stages, one struct each, separated by cooperative-groups grid syncs (acquire/release at grid
// scope):
//
//   EmbedStage:      h = float(x), per-tile sums of squares of h                          | sync
//   per layer l:
//   QkvStage:        [q|k|v] = rmsnorm(h) * attn_norm @ [wq|wk|wv]                         | sync
//   AttentionStage:  RoPE on q, k; append k, v at [l, b, p]; flash-decoding over 0..p      | sync
//   OProjStage:      h += attn_out @ wo; sums of squares of h                              | sync
//   GateUpStage:     mlp_act = silu(m @ w_gate) * (m @ w_up), m = rmsnorm(h) * mlp_norm    | sync
//   DownStage:       h += mlp_act @ w_down; sums of squares (last layer: out = h, NaN rows
//                    for bad p)                                                            | sync
//
// GEMV stages (weights [K, N], N contiguous; run_gemv): a column tile is 32 lanes x one 16-byte
// vector (256 columns of a 16-bit dtype, 128 of fp32), so every warp load is 512 contiguous
// bytes. A work item is (tile, split of K); the 8 warps of a block take interleaved groups of
// kUnroll rows (8 independent 16-byte loads in flight per lane), accumulate fp32 for up to
// kBatchPass batch rows (more rows: another pass over the same, now L1/L2-resident, weight
// slice), reduce across warps in shared memory and write one partial per (item, batch row) to
// the workspace. The last block to finish a tile (an atomic counter, release/acquire by
// __threadfence) sums the partials of all splits in a fixed order, so results are
// deterministic, and runs the stage's finish() (residual add, SwiGLU, sums of squares for the
// next RMSNorm). No extra grid sync is needed for the split-K reduction.
//
// Attention (flash-decoding): a work item is (batch row, kv head, chunk of <= 4 query heads of
// its group, split of 0..p); warps stride over positions, lanes split head_dim; online softmax
// per warp, merged across warps in shared memory, one partial (m, l, o) per split; the last
// split to finish (counter) merges all splits in a fixed order. The current token's k/v are used
// from shared memory (rounded to the cache dtype, exactly what the cache will hold), and written
// to the cache by one item per (b, kv head); no block reads [l, b, p] from memory.
//
// Workspace: the workspace result (decoder.h: DecoderWorkspace) holds every fp32 activation, the
// partial sums and the counters. The counters are reset with cudaMemsetAsync on the stream each
// call, so the handler does no allocation and no synchronization, and is command-buffer (CUDA
// graph) compatible. Workspace data written by other blocks is read with ld.global.cg (L2), so
// stale L1 lines are never observed; weights are read through the read-only path.
#include <cooperative_groups.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <initializer_list>

#include "jaxfuse/decoder.h"
#include "cuda_common.cuh"

namespace jaxfuse {
namespace {

namespace cg = cooperative_groups;

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kBatchPass = 4;     // batch rows accumulated per pass over a weight slice
constexpr int kUnroll = 8;        // rows (16-byte loads) in flight per lane
constexpr int kKChunk = 256;      // GEMV input rows staged in shared memory at a time
constexpr int kMaxHeadDim = 256;  // lanes hold head_dim / 32 <= 8 elements
constexpr int kLaneElems = kMaxHeadDim / 32;  // head elements of a lane: lane + 32 * e
constexpr int kHeadChunk = int(kDecHeadChunk);
// Blocks per SM, which caps registers at 65536 / (kThreads * blocks): at 2 (128 registers) the
// kernel spills 56-224 B (ncu on an H100: 1.45M local-memory requests per bf16 step).
// JAXFUSE_DECODER_BLOCKS_PER_SM is a tuning switch for tools/gpu_check.sh's variants stage.
#ifndef JAXFUSE_DECODER_BLOCKS_PER_SM
#define JAXFUSE_DECODER_BLOCKS_PER_SM 2
#endif
constexpr int kMaxBlocksPerSm = JAXFUSE_DECODER_BLOCKS_PER_SM;
constexpr int kMaxTile = 256;  // columns per tile for 16-bit dtypes
constexpr int kStaged = 2048;  // floats of the shared staging area

static_assert(kHeadChunk == 4, "attention accumulators are sized for 4 heads");
static_assert(kHeadChunk + 1 <= kWarps, "per-head q/k RMSNorm takes one warp per staged head");

// ---- kernel parameters -----------------------------------------------------------------------

// The sizes as ints (run<Cuda> checks the kernel limits) and the counts derived from them.
struct KernelDims {
  int layers, batch, hidden, kv_heads, head_dim, intermediate, max_seq_len;
  int q_dim, kv_dim;  // heads * head_dim, kv_heads * head_dim
  int group;          // query heads per kv head
  int head_chunks;    // chunks of <= kHeadChunk query heads per kv head
  int hidden_tiles, q_tiles, kv_tiles, mlp_tiles;  // GEMV column tiles of each output width
  float rms_eps;
  float attn_scale;  // 1 / sqrt(head_dim)
  bool qkv_bias;     // q/k/v projections add a bias
  bool qk_norm;      // per-head RMSNorm of q and k before RoPE
};

// How this launch splits the work over its grid (launch_plan()).
struct LaunchPlan {
  int qkv_splits, o_proj_splits, gate_up_splits, down_splits;  // K splits per GEMV stage
  int attn_splits;  // flash-decoding splits of the positions 0..p
};

struct DecoderParams {
  KernelDims dims;
  DecoderBuffers io;  // operands and results
  DecoderWorkspace ws;
  LaunchPlan plan;
};

// ---- device helpers ----------------------------------------------------------------------------

// The GEMV column tile of storage dtype kT: one 16-byte vector per lane of a warp.
template <DType kT>
struct GemvTile {
  static constexpr int kBytes = kT == DType::kF32 ? 4 : 2;
  static constexpr int kVec = 16 / kBytes;  // elements per 16-byte vector
  static constexpr int kColumns = 32 * kVec;
};

// The kVec elements of one 16-byte vector of dtype kT, as fp32.
template <DType kT>
__device__ __forceinline__ void unpack16(const uint4& r, float* o) {
  const uint32_t w[4] = {r.x, r.y, r.z, r.w};
  if constexpr (kT == DType::kF32) {
#pragma unroll
    for (int i = 0; i < 4; ++i) o[i] = __uint_as_float(w[i]);
  } else {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      o[2 * i] = Storage<kT>::template load<float>(uint16_t(w[i] & 0xffffu));
      o[2 * i + 1] = Storage<kT>::template load<float>(uint16_t(w[i] >> 16));
    }
  }
}

// Workspace values written by other blocks in this launch: read from L2, never a stale L1 line.
__device__ __forceinline__ float ws_load(const float* p) { return __ldcg(p); }
__device__ __forceinline__ void ws_store(float* p, float v) { __stcg(p, v); }

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

// ---- shared memory -----------------------------------------------------------------------------

// A block's shared memory; the stages reuse the arrays (a grid sync separates them).
struct Smem {
  float warp_sums[kWarps * kBatchPass * kMaxTile];  // per-warp GEMV column sums / attention o
  float staged[kStaged];                             // GEMV inputs / attention q, k_new, v_new
  float warp_ml[2 * kWarps * kHeadChunk];            // per-warp attention (m, l)
  float inv_rms[kBatchPass];
  float scratch[kWarps];  // block_sum
  int flag;               // arrive_last

  // GEMV: warp w's column sums for batch row bb of the pass, in tiles of `columns`.
  __device__ float* gemv_warp_sums(int w, int bb, int columns) {
    return warp_sums + (w * kBatchPass + bb) * columns;
  }
  // Attention: q of head g of the chunk [head_dim], the new k and v [head_dim].
  __device__ float* attn_q(int g, int head_dim) { return staged + g * head_dim; }
  __device__ float* attn_k_new() { return staged + kHeadChunk * kMaxHeadDim; }
  __device__ float* attn_v_new() { return attn_k_new() + kMaxHeadDim; }
  // Attention: warp w's o [head_dim] and (m, l) for head g of the chunk.
  __device__ float* attn_warp_o(int w, int g) {
    return warp_sums + (w * kHeadChunk + g) * kMaxHeadDim;
  }
  __device__ float* attn_warp_ml(int w, int g) { return warp_ml + (w * kHeadChunk + g) * 2; }
};
static_assert(kBatchPass * kKChunk <= kStaged, "staging area too small");
static_assert(kHeadChunk * kMaxHeadDim + 2 * kMaxHeadDim <= kStaged, "attention staging too small");
static_assert(kWarps * kHeadChunk * kMaxHeadDim <= kWarps * kBatchPass * kMaxTile,
              "attention merge area too small");

// The block's sum of `sq` (fixed order) as row b's sum of squares of h over column tile `tile`.
__device__ __forceinline__ void store_tile_sumsq(const DecoderParams& p, Smem& sm, int b, int tile,
                                                 float sq) {
  const float total = block_sum<kThreads>(sq, sm.scratch);
  if (threadIdx.x == 0) ws_store(p.ws.row_sumsq.at(b, tile), total);
}

// ---- the GEMV engine ---------------------------------------------------------------------------

// One matrix of a GEMV stage: this layer's [k_rows, columns] slice of a stacked weight.
struct GemvMatrix {
  const void* weights;
  int columns;
  int tiles;  // column tiles
};

// A GEMV stage's work: the fp32 input rows [B, k_rows] times up to three matrices side by side
// ([wq|wk|wv], [w_gate|w_up]); work item = (column tile, split of k_rows).
struct GemvJob {
  GemvMatrix matrix[3];
  int matrices;
  int k_rows;
  int splits;   // K splits per tile
  bool paired;  // matrices 0 and 1 (gate, up): tile t of both is finished by one block

  __device__ int total_tiles() const {
    return matrix[0].tiles + (matrices > 1 ? matrix[1].tiles : 0) +
           (matrices > 2 ? matrix[2].tiles : 0);
  }
  // The tile group that one counter (and one finishing block) covers.
  __device__ int group(int tile) const { return paired ? tile % matrix[0].tiles : tile; }
  __device__ int arrivals() const { return paired ? 2 * splits : splits; }
};

// Stage tile `tile` as (matrix, tile of that matrix).
struct MatrixTile {
  int matrix, tile;
};
__device__ __forceinline__ MatrixTile locate_tile(const GemvJob& job, int tile) {
  int m = 0;
  while (tile >= job.matrix[m].tiles) tile -= job.matrix[m++].tiles;
  return {m, tile};
}

// GEMV input rows rmsnorm(h) * norm (QKV, gate/up).
template <DType kT>
struct NormedHidden {
  static constexpr bool kNormalized = true;
  const DecoderParams& p;
  const void* norm;  // this layer's norm weights [hidden]

  __device__ float inv_rms(int b) const {
    float s = 0.0f;
    for (int j = 0; j < p.dims.hidden_tiles; ++j) s += ws_load(p.ws.row_sumsq.at(b, j));
    return rms_inv(s, p.dims.hidden, p.dims.rms_eps);
  }
  __device__ float value(int b, int k, float inv_rms) const {
    return rms_apply(ws_load(p.ws.hidden.at(b, k)), inv_rms, load_as_float(norm, kT, k));
  }
};

// GEMV input rows as they are in the workspace (attention output, MLP activations).
struct WorkspaceInput {
  static constexpr bool kNormalized = false;
  WorkspaceRows rows;

  __device__ float value(int b, int k, float) const { return ws_load(rows.at(b, k)); }
};

// Stages input rows [r0, r0 + rows) of batch rows b0 .. b0 + nb - 1 in shared memory as
// staged[bb][r] (zero past `rows`).
template <typename Input>
__device__ __forceinline__ void stage_inputs(Smem& sm, const Input& in, int b0, int nb, int r0,
                                             int rows) {
  __syncthreads();  // previous readers of the staging area are done
  if constexpr (Input::kNormalized) {
    if (threadIdx.x < nb) sm.inv_rms[threadIdx.x] = in.inv_rms(b0 + threadIdx.x);
  }
  __syncthreads();
  for (int i = threadIdx.x; i < nb * kKChunk; i += kThreads) {
    const int bb = i / kKChunk, r = i % kKChunk;
    sm.staged[i] = r < rows ? in.value(b0 + bb, r0 + r, sm.inv_rms[bb]) : 0.0f;
  }
  __syncthreads();
}

// The weight vectors a lane multiplies: columns [column, column + kVec) of a [K, columns] matrix.
struct LaneColumns {
  const char* matrix;
  int columns;
  int column;
  bool valid;  // column < columns (columns % kVec == 0, checked on the host)
};

template <DType kT>
using GemvAcc = float[kBatchPass][GemvTile<kT>::kVec];

// acc[bb][v] += staged[bb][r] * W[r0 + r][column + v] over this warp's staged rows: groups of
// kUnroll rows, interleaved over the warps, all loads of a group issued first.
template <DType kT>
__device__ __forceinline__ void accumulate_rows(const Smem& sm, const LaneColumns& lc, int r0,
                                                int rows, int nb, GemvAcc<kT>& acc) {
  constexpr int kVec = GemvTile<kT>::kVec;
  for (int rb = threadIdx.x / 32 * kUnroll; rb < rows; rb += kWarps * kUnroll) {
    uint4 raw[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int r = rb + u;
      const int64_t at = int64_t(r0 + r) * lc.columns + lc.column;
      raw[u] = lc.valid && r < rows
                   ? __ldg(reinterpret_cast<const uint4*>(lc.matrix + at * GemvTile<kT>::kBytes))
                   : make_uint4(0u, 0u, 0u, 0u);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      float wf[kVec];
      unpack16<kT>(raw[u], wf);
      const int r = min(rb + u, kKChunk - 1);  // rows past `rows` have zero weights
#pragma unroll
      for (int bb = 0; bb < kBatchPass; ++bb) {
        if (bb < nb) {
          const float a = sm.staged[bb * kKChunk + r];
#pragma unroll
          for (int v = 0; v < kVec; ++v) acc[bb][v] = fmaf(a, wf[v], acc[bb][v]);
        }
      }
    }
  }
}

// Sums acc over the warps (fixed order) and writes one partial per (work item, batch row).
template <DType kT>
__device__ __forceinline__ void write_partials(const DecoderParams& p, Smem& sm,
                                               const GemvAcc<kT>& acc, int item, int b0, int nb) {
  constexpr int kVec = GemvTile<kT>::kVec;
  constexpr int kColumns = GemvTile<kT>::kColumns;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  __syncthreads();
#pragma unroll
  for (int bb = 0; bb < kBatchPass; ++bb) {
    float* sums = sm.gemv_warp_sums(warp, bb, kColumns) + lane * kVec;
#pragma unroll
    for (int v = 0; v < kVec; ++v) sums[v] = acc[bb][v];
  }
  __syncthreads();
  for (int i = threadIdx.x; i < nb * kColumns; i += kThreads) {
    const int bb = i / kColumns, c = i % kColumns;
    float sum = 0.0f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) sum += sm.gemv_warp_sums(w, bb, kColumns)[c];
    ws_store(p.ws.gemv_partial(item, b0 + bb, c), sum);
  }
}

// Work item `item` of a GEMV job: one column tile's partial sums over one split of K, for every
// batch row (kBatchPass rows per pass over the weight slice).
template <DType kT, typename Input>
__device__ __forceinline__ void gemv_item(const DecoderParams& p, Smem& sm, const GemvJob& job,
                                          const Input& in, int item) {
  constexpr int kVec = GemvTile<kT>::kVec;
  const int split = item % job.splits;
  const MatrixTile mt = locate_tile(job, item / job.splits);
  const GemvMatrix& m = job.matrix[mt.matrix];
  const int column = mt.tile * GemvTile<kT>::kColumns + threadIdx.x % 32 * kVec;
  const LaneColumns lc{static_cast<const char*>(m.weights), m.columns, column, column < m.columns};
  const int k0 = int(int64_t(job.k_rows) * split / job.splits);
  const int k1 = int(int64_t(job.k_rows) * (split + 1) / job.splits);
  for (int b0 = 0; b0 < p.dims.batch; b0 += kBatchPass) {
    const int nb = min(kBatchPass, p.dims.batch - b0);
    GemvAcc<kT> acc;
#pragma unroll
    for (int bb = 0; bb < kBatchPass; ++bb)
#pragma unroll
      for (int v = 0; v < kVec; ++v) acc[bb][v] = 0.0f;
    for (int r0 = k0; r0 < k1; r0 += kKChunk) {
      const int rows = min(kKChunk, k1 - r0);
      stage_inputs(sm, in, b0, nb, r0, rows);
      accumulate_rows<kT>(sm, lc, r0, rows, nb, acc);
    }
    write_partials<kT>(p, sm, acc, item, b0, nb);
  }
}

// Runs a GEMV stage: its work items over the grid; the last block to finish a tile group (all
// its splits) calls stage.finish(job, group), which reads the partials with split_sum().
template <DType kT, typename Stage>
__device__ __forceinline__ void run_gemv(const Stage& stage) {
  const GemvJob job = stage.job();
  const auto input = stage.input();
  const int items = job.total_tiles() * job.splits;
  for (int item = blockIdx.x; item < items; item += gridDim.x) {
    gemv_item<kT>(stage.p, stage.sm, job, input, item);
    const int group = job.group(item / job.splits);
    if (arrive_last(stage.counter(group), job.arrivals(), &stage.sm.flag)) {
      stage.finish(job, group);
    }
  }
}

// Sum over the splits (fixed order: deterministic) of stage tile `tile`'s partials at (b, c).
__device__ __forceinline__ float split_sum(const DecoderParams& p, int tile, int splits, int b,
                                           int c) {
  float y = 0.0f;
  for (int s = 0; s < splits; ++s) y += ws_load(p.ws.gemv_partial(tile * splits + s, b, c));
  return y;
}

// Finishes a residual GEMV tile (O and down projections): h += y, the tile's sums of squares
// for the next RMSNorm, and after the last layer the output rows.
template <DType kT>
__device__ void add_residual(const DecoderParams& p, Smem& sm, int tile, int splits,
                             bool last_layer) {
  constexpr int kColumns = GemvTile<kT>::kColumns;
  const int c = threadIdx.x;
  const int col = tile * kColumns + c;
  for (int b = 0; b < p.dims.batch; ++b) {
    float sq = 0.0f;
    if (c < kColumns && col < p.dims.hidden) {
      float* h = p.ws.hidden.at(b, col);
      const float hn = ws_load(h) + split_sum(p, tile, splits, b, c);
      ws_store(h, hn);
      sq = hn * hn;
      if (last_layer) {
        const bool valid = position_valid(p.io.positions[b], p.dims.max_seq_len);
        store_from_float(p.io.out, kT, int64_t(b) * p.dims.hidden + col,
                         valid ? hn : quiet_nan_f32());
      }
    }
    store_tile_sumsq(p, sm, b, tile, sq);
  }
}

// ---- the stages ---------------------------------------------------------------------------------

// h = float(x) and its sums of squares per column tile (the first RMSNorm's input).
template <DType kT>
struct EmbedStage {
  const DecoderParams& p;
  Smem& sm;

  __device__ void run() const {
    constexpr int kColumns = GemvTile<kT>::kColumns;
    const int tiles = p.dims.hidden_tiles;
    for (int item = blockIdx.x; item < p.dims.batch * tiles; item += gridDim.x) {
      const int b = item / tiles, tile = item % tiles;
      const int col = tile * kColumns + threadIdx.x;
      float sq = 0.0f;
      if (threadIdx.x < kColumns && col < p.dims.hidden) {
        const float v = load_as_float(p.io.x, kT, int64_t(b) * p.dims.hidden + col);
        ws_store(p.ws.hidden.at(b, col), v);
        sq = v * v;
      }
      store_tile_sumsq(p, sm, b, tile, sq);
    }
  }
};

// [q|k|v] = rmsnorm(h) * attn_norm @ [wq|wk|wv]
template <DType kT>
struct QkvStage {
  const DecoderParams& p;
  Smem& sm;
  int layer;

  __device__ GemvJob job() const {
    const KernelDims& d = p.dims;
    const DecoderWeights& w = p.io.weights;
    const int64_t q_size = int64_t(d.hidden) * d.q_dim, kv_size = int64_t(d.hidden) * d.kv_dim;
    GemvJob job{};
    job.matrix[0] = {layer_slice(w.wq, kT, layer, q_size), d.q_dim, d.q_tiles};
    job.matrix[1] = {layer_slice(w.wk, kT, layer, kv_size), d.kv_dim, d.kv_tiles};
    job.matrix[2] = {layer_slice(w.wv, kT, layer, kv_size), d.kv_dim, d.kv_tiles};
    job.matrices = 3;
    job.k_rows = d.hidden;
    job.splits = p.plan.qkv_splits;
    return job;
  }
  __device__ NormedHidden<kT> input() const {
    return {p, layer_slice(p.io.weights.attn_norm, kT, layer, p.dims.hidden)};
  }
  __device__ int* counter(int tile) const { return p.ws.qkv_counter(layer, tile); }
  __device__ void finish(const GemvJob& job, int tile) const {
    constexpr int kColumns = GemvTile<kT>::kColumns;
    const MatrixTile mt = locate_tile(job, tile);
    const int columns = job.matrix[mt.matrix].columns;
    const int c = threadIdx.x, col = mt.tile * kColumns + c;
    if (c < kColumns && col < columns) {
      const float bias = p.dims.qkv_bias ? load_as_float(bias_of(mt.matrix, columns), kT, col)
                                         : 0.0f;
      for (int b = 0; b < p.dims.batch; ++b) {
        const float y = split_sum(p, tile, job.splits, b, c);
        ws_store(p.ws.qkv.column(b, mt.matrix, col), p.dims.qkv_bias ? y + bias : y);
      }
    }
  }
  // This layer's bias of matrix m (0: q, 1: k, 2: v), `columns` wide (only with qkv_bias).
  __device__ const void* bias_of(int m, int columns) const {
    const DecoderWeights& w = p.io.weights;
    return layer_slice(m == 0 ? w.q_bias : (m == 1 ? w.k_bias : w.v_bias), kT, layer, columns);
  }
  __device__ void run() const { run_gemv<kT>(*this); }
};

// One attention work item: batch row b, kv head, a chunk of its query heads, a split of 0..p.
struct AttnItem {
  int b, kv_head, chunk, split;
  int first_head, heads;  // the chunk's query heads: first_head .. first_head + heads - 1
  int32_t position;       // p, the new token's cache slot
  bool valid;             // position_valid(p): else no cache access, output 0 (row becomes NaN)
  int t0, t1;             // this split's positions [t0, t1) (valid items)
  int64_t cache_head;     // element index of [layer, b, 0, kv_head] in the caches (valid items)
};

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
      load_query_and_new_kv(it);
      if (it.split == 0 && it.chunk == 0) append_new_kv(it);
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

  // Element index of the item's kv head at position t in the caches [L, B, S, KV, hd].
  __device__ int64_t cache_index(const AttnItem& it, int t) const {
    return it.cache_head + int64_t(t) * p.dims.kv_dim;
  }

  // Out-of-range position: attention output 0 (the row's output becomes NaN).
  __device__ void zero_output(const AttnItem& it) const {
    if (it.split != 0) return;
    float* out = p.ws.attn_out.head(it.b, it.first_head);
    for (int i = threadIdx.x; i < it.heads * p.dims.head_dim; i += kThreads) {
      ws_store(out + i, 0.0f);
    }
  }

  // Shared memory: q of the chunk's heads and the kv head's new k (per-head RMSNorm with
  // qk_norm, then RoPE), and the new v; k and v rounded to the cache dtype (exactly what the
  // cache will hold). Staged head g < it.heads is query head first_head + g; g == it.heads is k.
  __device__ void load_query_and_new_kv(const AttnItem& it) const {
    const int hd = p.dims.head_dim, half = hd / 2;
    __syncthreads();  // the staging area may still be read by the previous item
    for (int i = threadIdx.x; i < (it.heads + 1) * hd; i += kThreads) {
      const int g = i / hd, j = i % hd;
      const float* x = g < it.heads ? p.ws.qkv.q(it.b, it.first_head + g)
                                    : p.ws.qkv.k(it.b, it.kv_head);
      staged_head(it, g)[j] = ws_load(x + j);
    }
    const float* v = p.ws.qkv.v(it.b, it.kv_head);
    for (int j = threadIdx.x; j < hd; j += kThreads) {
      sm.attn_v_new()[j] = round_to(kT, ws_load(v + j));
    }
    __syncthreads();
    if (p.dims.qk_norm) normalize_heads(it);
    // RoPE in place: one thread owns each pair (j, j + half).
    for (int i = threadIdx.x; i < (it.heads + 1) * half; i += kThreads) {
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
    return g < it.heads ? sm.attn_q(g, p.dims.head_dim) : sm.attn_k_new();
  }

  // Per-head RMSNorm of the staged heads in place (Qwen3's q_norm, k_norm): warp g takes head g.
  __device__ void normalize_heads(const AttnItem& it) const {
    const int hd = p.dims.head_dim, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
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
    const int64_t at = cache_index(it, it.position);
    for (int j = threadIdx.x; j < p.dims.head_dim; j += kThreads) {
      store_from_float(p.io.k_cache, kT, at + j, sm.attn_k_new()[j]);
      store_from_float(p.io.v_cache, kT, at + j, sm.attn_v_new()[j]);
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
    for (int t = it.t0 + threadIdx.x / 32; t < it.t1; t += kWarps) {
      float k[kLaneElems], v[kLaneElems];
      load_kv(it, t, k, v);
      fold_position(it, k, v, s);
    }
  }

  // This lane's elements of position t's k and v; the new token's from shared memory.
  __device__ void load_kv(const AttnItem& it, int t, float (&k)[kLaneElems],
                          float (&v)[kLaneElems]) const {
    const int64_t at = cache_index(it, t);
#pragma unroll
    for (int e = 0; e < kLaneElems; ++e) {
      const int j = threadIdx.x % 32 + 32 * e;
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
  __device__ void fold_position(const AttnItem& it, const float (&k)[kLaneElems],
                                const float (&v)[kLaneElems], WarpSoftmax& s) const {
    const int hd = p.dims.head_dim;
#pragma unroll
    for (int g = 0; g < kHeadChunk; ++g) {
      if (g < it.heads) {
        const float* q = sm.attn_q(g, hd);
        float dot = 0.0f;
#pragma unroll
        for (int e = 0; e < kLaneElems; ++e) {
          const int j = threadIdx.x % 32 + 32 * e;
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
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, hd = p.dims.head_dim;
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
    for (int i = threadIdx.x; i < it.heads * hd; i += kThreads) {
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
    for (int i = threadIdx.x; i < it.heads * hd; i += kThreads) {
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

// The residual GEMV stages: h += attn_out @ wo (the O projection, kDown false) and
// h += mlp_act @ w_down (kDown true; after the last layer it also writes out = h).
template <DType kT, bool kDown>
struct ResidualStage {
  const DecoderParams& p;
  Smem& sm;
  int layer;

  __device__ GemvJob job() const {
    const KernelDims& d = p.dims;
    const int k_rows = kDown ? d.intermediate : d.q_dim;
    const void* w = kDown ? p.io.weights.w_down : p.io.weights.wo;
    GemvJob job{};
    job.matrix[0] = {layer_slice(w, kT, layer, int64_t(k_rows) * d.hidden), d.hidden,
                     d.hidden_tiles};
    job.matrices = 1;
    job.k_rows = k_rows;
    job.splits = kDown ? p.plan.down_splits : p.plan.o_proj_splits;
    return job;
  }
  __device__ WorkspaceInput input() const {
    if constexpr (kDown) return {p.ws.mlp_act};
    else return {p.ws.attn_out};
  }
  __device__ int* counter(int tile) const {
    return kDown ? p.ws.down_counter(layer, tile) : p.ws.o_proj_counter(layer, tile);
  }
  __device__ void finish(const GemvJob& job, int tile) const {
    add_residual<kT>(p, sm, tile, job.splits, kDown && layer == p.dims.layers - 1);
  }
  __device__ void run() const { run_gemv<kT>(*this); }
};
template <DType kT>
using OProjStage = ResidualStage<kT, false>;
template <DType kT>
using DownStage = ResidualStage<kT, true>;

// mlp_act = silu(m @ w_gate) * (m @ w_up), m = rmsnorm(h) * mlp_norm
template <DType kT>
struct GateUpStage {
  const DecoderParams& p;
  Smem& sm;
  int layer;

  __device__ GemvJob job() const {
    const KernelDims& d = p.dims;
    const DecoderWeights& w = p.io.weights;
    const int64_t size = int64_t(d.hidden) * d.intermediate;
    GemvJob job{};
    job.matrix[0] = {layer_slice(w.w_gate, kT, layer, size), d.intermediate, d.mlp_tiles};
    job.matrix[1] = {layer_slice(w.w_up, kT, layer, size), d.intermediate, d.mlp_tiles};
    job.matrices = 2;
    job.k_rows = d.hidden;
    job.splits = p.plan.gate_up_splits;
    job.paired = true;
    return job;
  }
  __device__ NormedHidden<kT> input() const {
    return {p, layer_slice(p.io.weights.mlp_norm, kT, layer, p.dims.hidden)};
  }
  __device__ int* counter(int tile) const { return p.ws.gate_up_counter(layer, tile); }
  // Gate tile `tile` and its up tile (mlp_tiles further).
  __device__ void finish(const GemvJob& job, int tile) const {
    const int c = threadIdx.x, col = tile * GemvTile<kT>::kColumns + c;
    if (c < GemvTile<kT>::kColumns && col < p.dims.intermediate) {
      for (int b = 0; b < p.dims.batch; ++b) {
        const float gate = split_sum(p, tile, job.splits, b, c);
        const float up = split_sum(p, p.dims.mlp_tiles + tile, job.splits, b, c);
        ws_store(p.ws.mlp_act.at(b, col), swiglu(gate, up));
      }
    }
  }
  __device__ void run() const { run_gemv<kT>(*this); }
};

// ---- the kernel ---------------------------------------------------------------------------------

// Min blocks per SM pinned: without it ptxas may use up to 168 registers (one block per SM).
template <DType kT>
__global__ void __launch_bounds__(kThreads, kMaxBlocksPerSm)
    decoder_kernel(const __grid_constant__ DecoderParams p) {
  __shared__ Smem sm;
  cg::grid_group grid = cg::this_grid();
  EmbedStage<kT>{p, sm}.run();
  grid.sync();
  for (int layer = 0; layer < p.dims.layers; ++layer) {
    QkvStage<kT>{p, sm, layer}.run();
    grid.sync();
    AttentionStage<kT>{p, sm, layer}.run();
    grid.sync();
    OProjStage<kT>{p, sm, layer}.run();
    grid.sync();
    GateUpStage<kT>{p, sm, layer}.run();
    grid.sync();
    DownStage<kT>{p, sm, layer}.run();
    if (layer + 1 < p.dims.layers) grid.sync();
  }
}

// ---- host side ----------------------------------------------------------------------------------

// Kernel limits: 16-byte weight vectors, lane-split heads, 32-bit indices within a matrix.
ffi::Error check_kernel_limits(const DecoderDims& d) {
  const int64_t vec = d.vec();
  if (d.D % vec || d.I % vec || d.q_dim() % vec || d.kv_dim() % vec) {
    return invalid_argument("the CUDA kernel needs hidden_size, intermediate_size, "
                            "num_heads*head_dim and num_kv_heads*head_dim to be multiples of ",
                            vec, " for ", dtype_name(d.dtype));
  }
  if (d.hd > kMaxHeadDim) {
    return invalid_argument("the CUDA kernel needs head_dim <= ", kMaxHeadDim);
  }
  const int64_t big = std::max({d.L * d.D * std::max({d.q_dim(), d.I}), d.L * d.I * d.D,
                                d.L * d.B * d.S * d.kv_dim()});
  // Headroom below INT32_MAX: attention chunk bounds add up to one chunk to a position.
  if (big >= (int64_t(1) << 62) / 4 || d.B * std::max(d.D, d.I) >= INT32_MAX ||
      d.S >= INT32_MAX / 2) {
    return invalid_argument("sizes too large for the CUDA kernel");
  }
  return ffi::Error::Success();
}

// 16-byte vector loads of the weights need 16-byte aligned buffers (XLA's are; a view may
// not be). A misaligned load would be a sticky device fault, not an error we can return.
ffi::Error check_alignment(const DecoderBuffers& b) {
  const DecoderWeights& w = b.weights;
  for (const void* p : {b.x, w.wq, w.wk, w.wv, w.wo, w.w_gate, w.w_up, w.w_down,
                        static_cast<const void*>(b.k_cache), static_cast<const void*>(b.v_cache)}) {
    if (reinterpret_cast<uintptr_t>(p) % 16 != 0) {
      return invalid_argument("the CUDA kernel needs 16-byte aligned operand buffers");
    }
  }
  return ffi::Error::Success();
}

KernelDims kernel_dims(const DecoderDims& d) {
  KernelDims k;
  k.layers = int(d.L);
  k.batch = int(d.B);
  k.hidden = int(d.D);
  k.kv_heads = int(d.KV);
  k.head_dim = int(d.hd);
  k.intermediate = int(d.I);
  k.max_seq_len = int(d.S);
  k.q_dim = int(d.q_dim());
  k.kv_dim = int(d.kv_dim());
  k.group = int(d.group());
  k.head_chunks = int(d.head_chunks());
  k.hidden_tiles = int(d.tiles(d.D));
  k.q_tiles = int(d.tiles(d.q_dim()));
  k.kv_tiles = int(d.tiles(d.kv_dim()));
  k.mlp_tiles = int(d.tiles(d.I));
  k.rms_eps = d.eps;
  k.attn_scale = 1.0f / std::sqrt(float(d.hd));
  k.qkv_bias = d.qkv_bias;
  k.qk_norm = d.qk_norm;
  return k;
}

// K splits for a GEMV stage: enough items to cover the grid, at most kDecMaxGemvItems partial
// slots, at least 16 rows per split.
int gemv_splits(int blocks, int tiles, int k_rows) {
  const int budget = int(std::min<int64_t>(blocks, kDecMaxGemvItems));
  int s = std::max(1, budget / tiles);
  s = std::min(s, std::max(1, k_rows / 16));
  return s;
}

LaunchPlan launch_plan(int blocks, const KernelDims& d) {
  LaunchPlan plan;
  plan.qkv_splits = gemv_splits(blocks, d.q_tiles + 2 * d.kv_tiles, d.hidden);
  plan.o_proj_splits = gemv_splits(blocks, d.hidden_tiles, d.q_dim);
  plan.gate_up_splits = gemv_splits(blocks, 2 * d.mlp_tiles, d.hidden);
  plan.down_splits = gemv_splits(blocks, d.hidden_tiles, d.intermediate);
  // Attention: enough splits to cover the grid, at most kDecMaxAttnSplits, >= 16 positions each.
  const int64_t items = int64_t(d.batch) * d.kv_heads * d.head_chunks;
  plan.attn_splits =
      int(std::clamp<int64_t>(blocks / std::max<int64_t>(1, items), 1, kDecMaxAttnSplits));
  plan.attn_splits = std::min<int>(plan.attn_splits, std::max(1, d.max_seq_len / 16));
  return plan;
}

template <DType kT>
ffi::Error launch_decoder(cudaStream_t stream, const DecoderOp::Call& call) {
  int device = 0;
  JF_CUDA_RETURN_IF_ERROR(cudaGetDevice(&device));
  int cooperative = 0;
  JF_CUDA_RETURN_IF_ERROR(
      cudaDeviceGetAttribute(&cooperative, cudaDevAttrCooperativeLaunch, device));
  if (!cooperative) {
    return internal_error("device ", device, " does not support cooperative launch");
  }
  int blocks = 0;
  JF_CUDA_RETURN_IF_ERROR(resident_blocks<decoder_kernel<kT>>(kThreads, kMaxBlocksPerSm, &blocks));
  const KernelDims dims = kernel_dims(call.dims);
  const LaunchPlan plan = launch_plan(blocks, dims);
  const DecoderParams params{dims, call.buffers,
                             DecoderWorkspace(call.dims, call.buffers.workspace, plan.attn_splits),
                             plan};
  const StageCounters& counters = params.ws.counters;
  JF_CUDA_RETURN_IF_ERROR(
      cudaMemsetAsync(counters.data, 0, size_t(counters.size) * sizeof(int), stream));
  return launch_kernel("the decoder kernel", decoder_kernel<kT>, dim3(blocks), dim3(kThreads),
                       stream, /*cooperative=*/true, params);
}

}  // namespace

template <>
ffi::Error DecoderOp::run<Cuda>(cudaStream_t stream, const Call& call) {
  if (call.dims.B == 0) return ffi::Error::Success();
  JF_RETURN_IF_ERROR(check_kernel_limits(call.dims));
  JF_RETURN_IF_ERROR(check_alignment(call.buffers));
  // visit_narrow_dtype is host+device: a constexpr lambda (--expt-relaxed-constexpr) may be called there.
  const auto launch = visit_narrow_dtype(call.dims.dtype, [](auto tag) constexpr {
    return &launch_decoder<decltype(tag)::value>;
  });
  return launch(stream, call);
}

// Command-buffer compatible: a memset and one kernel on the given stream, no allocation, no
// host synchronization; temporaries live in the workspace result.
JAXFUSE_REGISTER_OP(DecoderOp, Cuda);

}  // namespace jaxfuse
