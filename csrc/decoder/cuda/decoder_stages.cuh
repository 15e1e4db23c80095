// The CUDA decoder's GEMV stages (included by cuda/decoder.cu only): the embedding, [q|k|v],
// the O and down projections (residual adds) and gate/up (SwiGLU), each one struct whose job(),
// input(), await_inputs(), counter() and finish() the GEMV engine runs. A work item waits for the
// counters of the groups that write its inputs: all of h for a normalized input (its RMSNorm
// needs every column), every attention group of the layer (O), the gate/up tiles of its K split
// (down).
#pragma once

#include "decoder/cuda/decoder_gemv.cuh"

namespace jaxfuse::cuda_decoder {

// Waits until h and its sums of squares are written over every hidden tile by the embedding
// (layer < 0) or by layer's down projection (for [q|k|v] and the LM head), or by layer's O
// projection (after_o_proj, for gate/up). h does not change within a stage, so a block waits on
// its first item of the stage only.
__device__ __forceinline__ void await_hidden(const DecoderParams& p, Smem& sm, int item,
                                             int layer, bool after_o_proj) {
  if (item != int(blockIdx.x)) return;
  await_finished(p.run.chained, sm.clock, p.dims.hidden_tiles, [&](int tile) {
    return after_o_proj ? p.ws.o_proj_counter(layer, tile)
                        : (layer < 0 ? p.ws.embed_counter(tile) : p.ws.down_counter(layer, tile));
  });
}

// h = float(x), or embed[tokens[b]] in a whole-model step (zero for a token outside the
// vocabulary: its row is invalid, decoder.h's row_position), and its sums of squares per column
// tile (the first RMSNorm's input).
template <DType kT>
struct EmbedStage {
  const DecoderParams& p;
  Smem& sm;

  __device__ void run() const {
    constexpr int kColumns = GemvTile<kT>::kColumns;
    const int tiles = p.dims.hidden_tiles;
    for (int item = blockIdx.x; item < p.dims.batch * tiles; item += gridDim.x) {
      const int b = item / tiles, tile = item % tiles;
      const int c = thread_index(), col = tile * kColumns + c;
      float sq = 0.0f;
      if (c < kColumns && col < p.dims.hidden) {
        const int64_t at = int64_t(b) * p.dims.hidden + col;
        const float v = p.dims.model_step ? embedding(b, col) : load_as_float(p.io.x, kT, at);
        ws_store(p.ws.hidden.at(b, col), v);
        sq = v * v;
      }
      store_tile_sumsq(p, sm, b, tile, sq);
      int* counter = p.ws.embed_counter(tile);  // the tile's batch rows
      if (arrive_last(counter, p.dims.batch, &sm.flag)) mark_finished(counter);
    }
  }
  __device__ float embedding(int b, int col) const {
    if (!p.io.token_valid(b, p.dims.vocab)) return 0.0f;
    return load_as_float(p.io.embed, kT, int64_t(p.io.tokens[b]) * p.dims.hidden + col);
  }
};

// [q|k|v] = rmsnorm(h) * attn_norm @ [wq|wk|wv] (+ the biases)
template <DType kT, DType kW>
struct QkvStage {
  const DecoderParams& p;
  Smem& sm;
  int layer;

  __device__ GemvJob job() const {
    const int layer = opaque(this->layer);  // formed per work item (run_gemv)
    const KernelDims& d = p.dims;
    const DecoderWeights& w = p.io.weights;
    GemvJob job{};
    job.matrix[0] = layer_matrix<kT, kW>(w.wq, w.wq_scale, layer, d.hidden, d.q_dim, d.q_tiles);
    job.matrix[1] =
        layer_matrix<kT, kW>(w.wk, w.wk_scale, layer, d.hidden, d.kv_dim, d.kv_tiles);
    job.matrix[2] =
        layer_matrix<kT, kW>(w.wv, w.wv_scale, layer, d.hidden, d.kv_dim, d.kv_tiles);
    job.matrices = 3;
    job.k_rows = d.hidden;
    job.splits = plan().splits;
    job.region = 0;
    return job;
  }
  __device__ NormedHidden<kT> input() const {
    return {p, layer_slice(p.io.weights.attn_norm, kT, layer, p.dims.hidden)};
  }
  __device__ void await_inputs(const GemvJob&, int item) const {
    await_hidden(p, sm, item, layer - 1, false);
  }
  __device__ const GemvPlan& plan() const { return p.plan.qkv; }
  __device__ int* counter(int tile) const { return p.ws.qkv_counter(opaque(layer), tile); }
  // Batch row b of tile `tile`.
  __device__ void finish(const GemvJob& job, int tile, int b) const {
    constexpr int kColumns = GemvTile<kT>::kColumns;
    const MatrixTile mt = locate_tile(job, tile);
    const GemvMatrix& m = mt.matrix;
    const int c = thread_index(), col = mt.tile * kColumns + c;
    if (c < kColumns && col < m.columns) {
      const float y = apply_scale<kT, kW>(m, col, split_sum<kT>(p, job, tile, b, c));
      const float bias = p.dims.qkv_bias ? load_as_float(bias_of(mt.index, m.columns), kT, col)
                                         : 0.0f;
      ws_store(p.ws.qkv.column(b, mt.index, col), p.dims.qkv_bias ? y + bias : y);
    }
  }
  // This layer's bias of matrix m (0: q, 1: k, 2: v), `columns` wide (only with qkv_bias).
  __device__ const void* bias_of(int m, int columns) const {
    const DecoderWeights& w = p.io.weights;
    return layer_slice(m == 0 ? w.q_bias : (m == 1 ? w.k_bias : w.v_bias), kT, layer, columns);
  }
  __device__ void run() const { run_gemv<kT, kW>(*this); }
  __device__ void prefetch() const { prefetch_gemv<kT, kW>(*this); }
};


// The residual GEMV stages: h += attn_out @ wo (the O projection, kDown false) and
// h += mlp_act @ w_down (kDown true; after the last layer it also writes out = h).
template <DType kT, DType kW, bool kDown>
struct ResidualStage {
  const DecoderParams& p;
  Smem& sm;
  int layer;

  __device__ GemvJob job() const {
    const int layer = opaque(this->layer);  // formed per work item (run_gemv)
    const KernelDims& d = p.dims;
    const int k_rows = kDown ? d.intermediate : d.q_dim;
    const DecoderWeights& w = p.io.weights;
    const void* matrix = kDown ? w.w_down : w.wo;
    const void* scales = kDown ? w.w_down_scale : w.wo_scale;
    GemvJob job{};
    job.matrix[0] =
        layer_matrix<kT, kW>(matrix, scales, layer, k_rows, d.hidden, d.hidden_tiles);
    job.matrices = 1;
    job.k_rows = k_rows;
    job.splits = plan().splits;
    job.region = 1;
    return job;
  }
  __device__ WorkspaceInput input() const {
    if constexpr (kDown) return {p.ws.mlp_act};
    else return {p.ws.attn_out};
  }
  // Down: the gate/up tiles that write the rows of the item's K split. O: every attention group
  // of the layer (its counters are contiguous), on the block's first item: a K split spans a
  // head or two of every batch row, whose groups finish at about the same time as the others.
  __device__ void await_inputs(const GemvJob& job, int item) const {
    if constexpr (kDown) {
      constexpr int kColumns = GemvTile<kT>::kColumns;
      const int split = item % job.splits;
      const int t0 = job.split_row(split) / kColumns;
      const int tiles = (job.split_row(split + 1) - 1) / kColumns - t0 + 1;
      await_finished(p.run.chained, sm.clock, tiles,
                     [&](int i) { return p.ws.gate_up_counter(layer, t0 + i); });
    } else {
      if (item != int(blockIdx.x)) return;
      await_finished(p.run.chained, sm.clock, p.plan.attn_groups,
                     [&](int i) { return p.ws.attn_counter(layer, 0, 0, i); });
    }
  }
  __device__ const GemvPlan& plan() const { return kDown ? p.plan.down : p.plan.o_proj; }
  __device__ int* counter(int tile) const {
    const int l = opaque(layer);
    return kDown ? p.ws.down_counter(l, tile) : p.ws.o_proj_counter(l, tile);
  }
  __device__ void finish(const GemvJob& job, int tile, int b) const {
    add_residual<kT, kW>(p, sm, job, tile, b, kDown && layer == p.dims.layers - 1);
  }
  __device__ void run() const { run_gemv<kT, kW>(*this); }
  __device__ void prefetch() const { prefetch_gemv<kT, kW>(*this); }
};
template <DType kT, DType kW>
using OProjStage = ResidualStage<kT, kW, false>;
template <DType kT, DType kW>
using DownStage = ResidualStage<kT, kW, true>;

// mlp_act = silu(m @ w_gate) * (m @ w_up), m = rmsnorm(h) * mlp_norm
template <DType kT, DType kW>
struct GateUpStage {
  const DecoderParams& p;
  Smem& sm;
  int layer;

  __device__ GemvJob job() const {
    const int layer = opaque(this->layer);  // formed per work item (run_gemv)
    const KernelDims& d = p.dims;
    const DecoderWeights& w = p.io.weights;
    GemvJob job{};
    job.matrix[0] = layer_matrix<kT, kW>(w.w_gate, w.w_gate_scale, layer, d.hidden,
                                         d.intermediate, d.mlp_tiles);
    job.matrix[1] = layer_matrix<kT, kW>(w.w_up, w.w_up_scale, layer, d.hidden, d.intermediate,
                                         d.mlp_tiles);
    job.matrices = 2;
    job.k_rows = d.hidden;
    job.splits = plan().splits;
    job.region = 0;
    job.paired = true;
    return job;
  }
  __device__ NormedHidden<kT> input() const {
    return {p, layer_slice(p.io.weights.mlp_norm, kT, layer, p.dims.hidden)};
  }
  __device__ void await_inputs(const GemvJob&, int item) const {
    await_hidden(p, sm, item, layer, true);
  }
  __device__ const GemvPlan& plan() const { return p.plan.gate_up; }
  __device__ int* counter(int tile) const { return p.ws.gate_up_counter(opaque(layer), tile); }
  // Batch row b of gate tile `tile` and its up tile (mlp_tiles further).
  __device__ void finish(const GemvJob& job, int tile, int b) const {
    const int c = thread_index(), col = tile * GemvTile<kT>::kColumns + c;
    if (c < GemvTile<kT>::kColumns && col < p.dims.intermediate) {
      const float gate = split_sum<kT>(p, job, tile, b, c);
      const float up = split_sum<kT>(p, job, p.dims.mlp_tiles + tile, b, c);
      ws_store(p.ws.mlp_act.at(b, col), swiglu(apply_scale<kT, kW>(job.matrix[0], col, gate),
                                               apply_scale<kT, kW>(job.matrix[1], col, up)));
    }
  }
  __device__ void run() const { run_gemv<kT, kW>(*this); }
  __device__ void prefetch() const { prefetch_gemv<kT, kW>(*this); }
};

}  // namespace jaxfuse::cuda_decoder
