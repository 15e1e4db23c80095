// The CUDA decoder's GEMV stages (included by cuda/decoder.cu only): the embedding, [q|k|v],
// the O and down projections (residual adds) and gate/up (SwiGLU), each one struct whose job(),
// input(), counter() and finish() the GEMV engine runs.
#pragma once

#include "decoder_gemv.cuh"

namespace jaxfuse::cuda_decoder {

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

}  // namespace jaxfuse::cuda_decoder
