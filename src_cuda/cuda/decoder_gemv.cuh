// The CUDA decoder's GEMV engine (included by cuda/decoder.cu only). Weights [K, N], N
// contiguous, of dtype kW: the activations' kT, or int8 / fp8 e4m3 with per-column scales
// (weight-only quantization: y[n] = scale[n] * sum_k a[k] * W[k, n]). A column tile is 32 lanes
// x kVec columns (GemvTile<kT>: 256 columns of a 16-bit kT, 128 of fp32), so every warp load is
// contiguous: 512 bytes, or 256 / 128 of 8-bit weights. A work item is (tile, split of K); the
// 8 warps of a block take interleaved groups of kRowsInFlight rows (128 bytes of loads in flight
// per lane: 8 rows of 16-byte vectors, 16 or 32 of 8-bit ones), accumulate fp32 for up to
// kBatchPass batch rows (more rows: another pass over the same, now L1/L2-resident, weight
// slice), reduce across warps in shared memory and write one partial per (item, batch row) to
// the workspace. The last block to finish a tile (an atomic counter, release/acquire by
// __threadfence) sums the partials of all splits in a fixed order, so results are
// deterministic, and runs the stage's finish() (scales, residual add, SwiGLU, sums of squares
// for the next RMSNorm). No extra grid sync is needed for the split-K reduction.
#pragma once

#include "decoder_common.cuh"

namespace jaxfuse::cuda_decoder {

// One matrix of a GEMV stage: this layer's [k_rows, columns] slice of a stacked weight.
struct GemvMatrix {
  const void* weights;
  const float* scale;  // per-column scales [columns] of quantized weights, else null
  int columns;
  int tiles;  // column tiles
};

// Layer `layer` of a stacked matrix [L, k_rows, columns] of dtype kW and of its scales
// [L, columns]: only quantized matrices (kW != kT) have them (decoder.h's layer_scales()).
template <DType kT, DType kW>
__device__ __forceinline__ GemvMatrix layer_matrix(const void* stacked, const void* scales,
                                                   int layer, int k_rows, int columns,
                                                   int tiles) {
  const float* scale = nullptr;
  if constexpr (kW != kT) scale = static_cast<const float*>(scales) + int64_t(layer) * columns;
  return {layer_slice(stacked, kW, layer, int64_t(k_rows) * columns), scale, columns, tiles};
}

// Matrix m's output y at column `col` times the column's scale: quantized matrices only (known
// at compile time, so the unquantized kernels never read the null scale pointers).
template <DType kT, DType kW>
__device__ __forceinline__ float apply_scale(const GemvMatrix& m, int col, float y) {
  if constexpr (kW == kT) return y;
  else return y * __ldg(m.scale + col);
}

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
// kRowsInFlight rows, interleaved over the warps, all loads of a group issued first.
template <DType kT, DType kW>
__device__ __forceinline__ void accumulate_rows(const Smem& sm, const LaneColumns& lc, int r0,
                                                int rows, int nb, GemvAcc<kT>& acc) {
  using Weights = WeightVector<kT, kW>;
  constexpr int kVec = Weights::kVec;
  constexpr int kUnroll = Weights::kRowsInFlight;
  for (int rb = threadIdx.x / 32 * kUnroll; rb < rows; rb += kWarps * kUnroll) {
    Weights loaded[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int r = rb + u;
      const int64_t at = int64_t(r0 + r) * lc.columns + lc.column;
      loaded[u] = lc.valid && r < rows ? Weights::load(lc.matrix, at) : Weights::zero();
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      float wf[kVec];
      loaded[u].unpack(wf);
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
template <DType kT, DType kW, typename Input>
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
      accumulate_rows<kT, kW>(sm, lc, r0, rows, nb, acc);
    }
    write_partials<kT>(p, sm, acc, item, b0, nb);
  }
}

// Runs a GEMV stage: its work items over the grid; the last block to finish a tile group (all
// its splits) calls stage.finish(job, group), which reads the partials with split_sum().
template <DType kT, DType kW, typename Stage>
__device__ __forceinline__ void run_gemv(const Stage& stage) {
  const GemvJob job = stage.job();
  const auto input = stage.input();
  const int items = job.total_tiles() * job.splits;
  for (int item = blockIdx.x; item < items; item += gridDim.x) {
    gemv_item<kT, kW>(stage.p, stage.sm, job, input, item);
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

// Finishes a residual GEMV tile of matrix m (O and down projections): h += y, the tile's sums
// of squares for the next RMSNorm, and after the last layer the output rows.
template <DType kT, DType kW>
__device__ void add_residual(const DecoderParams& p, Smem& sm, const GemvMatrix& m, int tile,
                             int splits, bool last_layer) {
  constexpr int kColumns = GemvTile<kT>::kColumns;
  const int c = threadIdx.x;
  const int col = tile * kColumns + c;
  for (int b = 0; b < p.dims.batch; ++b) {
    float sq = 0.0f;
    if (c < kColumns && col < p.dims.hidden) {
      float* h = p.ws.hidden.at(b, col);
      const float hn = ws_load(h) + apply_scale<kT, kW>(m, col, split_sum(p, tile, splits, b, c));
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

}  // namespace jaxfuse::cuda_decoder
