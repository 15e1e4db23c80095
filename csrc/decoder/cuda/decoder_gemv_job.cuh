// The CUDA decoder's GEMV jobs and their inputs (included by the GEMV engines,
// decoder_gemv.cuh and decoder_gemv_mma.cuh): a stage's matrices, its work items, and the input
// rows (normalized hidden rows or workspace rows) the engines stage in shared memory.
#pragma once

#include "decoder/cuda/decoder_common.cuh"

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
  int region;   // its partial sums' region (decoder.h's GemvPartials): consecutive stages alternate
  bool paired;  // matrices 0 and 1 (gate, up): tile t of both is one group (one counter)

  // The tile group that one counter covers (and one block finishes per batch row).
  __device__ int group(int tile) const { return paired ? tile % matrix[0].tiles : tile; }
  // The first row of K split s (s == splits: k_rows). 32-bit: splits <= kDecMaxGemvItems, and
  // check_kernel_limits keeps k_rows * kDecMaxGemvItems below 2^31.
  __device__ int split_row(int s) const { return k_rows * s / splits; }
  // Where work item `item` writes its partial sums for batch row b.
  __device__ float* partial(const DecoderParams& p, int item, int b) const {
    return p.ws.gemv_partial(region, item, b, 0);
  }
};

// Stage tile `tile` as (matrix, its index in the job, tile of that matrix). Constant indices
// only: a dynamic job.matrix[m] would put the whole job on the stack (local memory).
struct MatrixTile {
  GemvMatrix matrix;
  int index, tile;
};
__device__ __forceinline__ MatrixTile locate_tile(const GemvJob& job, int tile) {
  if (tile < job.matrix[0].tiles) return {job.matrix[0], 0, tile};
  tile -= job.matrix[0].tiles;
  if (job.matrices == 2 || tile < job.matrix[1].tiles) return {job.matrix[1], 1, tile};
  return {job.matrix[2], 2, tile - job.matrix[1].tiles};
}

// GEMV input rows rmsnorm(h) * norm (QKV, gate/up).
template <DType kT>
struct NormedHidden {
  static constexpr bool kNormalized = true;
  const DecoderParams& p;
  const void* norm;  // this layer's norm weights [hidden]

  // 8 tile sums a round (Llama-3.2-1B's 2048 columns in one): the tensor-core staging keeps its
  // inputs' loads in flight meanwhile, and 12 spilled the bf16 x int8 instance on sm_90.
  __device__ float inv_rms(int b) const {
    const float s = ordered_sum<8>(p.dims.hidden_tiles,
                                   [&](int j) { return ws_load(p.ws.row_sumsq.at(b, j)); });
    return rms_inv(s, p.dims.hidden, p.dims.rms_eps);
  }
  __device__ float value(int b, int k, float inv_rms) const {
    return value_of(fetch(b, k), inv_rms);
  }
  // The value in two steps, so its loads may be issued before 1 / rms is known.
  struct Fetched {
    float h = 0.0f, weight = 0.0f;
  };
  __device__ Fetched fetch(int b, int k) const {
    return {ws_load(p.ws.hidden.at(b, k)), load_as_float(norm, kT, k)};
  }
  __device__ static float value_of(const Fetched& f, float inv_rms) {
    return rms_apply(f.h, inv_rms, f.weight);
  }
};

// GEMV input rows as they are in the workspace (attention output, MLP activations).
struct WorkspaceInput {
  static constexpr bool kNormalized = false;
  WorkspaceRows rows;

  __device__ float value(int b, int k, float) const { return value_of(fetch(b, k), 0.0f); }
  struct Fetched {
    float x = 0.0f;
  };
  __device__ Fetched fetch(int b, int k) const { return {ws_load(rows.at(b, k))}; }
  __device__ static float value_of(const Fetched& f, float) { return f.x; }
};

// Asks L2 for the first kPrefetchRows rows k0 .. of a work item's column tile (each warp's first
// two row groups of 16-bit weights: 64 KB per block, 17 MB over an H100's 264 blocks, a third
// of its L2), before the item waits for its inputs.
constexpr int kPrefetchRows = 128;
static_assert(kPrefetchRows <= kThreads, "one row per thread");

template <DType kT, DType kW>
__device__ __forceinline__ void prefetch_rows(const MatrixTile& mt, int k0, int k1) {
  constexpr int kBytes = WeightVector<kT, kW>::kElementBytes;
  const int row = k0 + thread_index();
  const int column = mt.tile * GemvTile<kT>::kColumns;
  if (row < min(k1, k0 + kPrefetchRows)) {
    const int width = min(GemvTile<kT>::kColumns, mt.matrix.columns - column);
    const int64_t at = int64_t(row) * mt.matrix.columns + column;
    prefetch_l2(static_cast<const char*>(mt.matrix.weights) + at * kBytes, width * kBytes);
  }
}

// 1 / rms of batch rows b0 .. b0 + nb - 1 into shared memory (normalized inputs only), once per
// pass over a work item's rows.
template <typename Input>
__device__ __forceinline__ void stage_inv_rms(Smem& sm, const Input& in, int b0, int nb) {
  if constexpr (Input::kNormalized) {
    __syncthreads();  // previous readers of inv_rms are done
    const int t = thread_index();
    if (t < nb) sm.inv_rms[t] = in.inv_rms(b0 + t);
  }
}

}  // namespace jaxfuse::cuda_decoder
