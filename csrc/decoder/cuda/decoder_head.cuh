// The CUDA decoder's whole-model step after the last layer (included by cuda/decoder.cu only):
// the final RMSNorm and LM head (HeadStage). The next token's draw is SampleStage's
// (decoder_sample.cuh), the embedding gather EmbedStage's (decoder_stages.cuh).
#pragma once

#include "decoder/cuda/decoder_stages.cuh"

namespace jaxfuse::cuda_decoder {

// Batch rows per pass of the LM head, at most: their inputs (kT, hidden wide) are staged in the
// warp_sums area, which launch_plan() keeps them within.
constexpr int kHeadMaxRows = 8;
constexpr int kHeadStagingBytes = int(sizeof(Smem::warp_sums));

// Bit bb: batch row b0 + bb of a head pass has a valid position (its logits are NaN otherwise).
__device__ __forceinline__ uint32_t valid_rows(const DecoderParams& p, int b0, int nb) {
  uint32_t valid = 0;
  for (int bb = 0; bb < nb; ++bb) {
    if (position_valid(p.io.row_position(b0 + bb, p.dims.vocab), p.dims.max_seq_len)) {
      valid |= 1u << bb;
    }
  }
  return valid;
}

// logits[b, n] = (rmsnorm(h[b]) * final_norm, rounded to kT) . head[n] for every vocabulary row
// n, times the row's scale when the head is quantized (kH int8 or fp8 e4m3; else kH = kT). The
// head is [V, hidden] (Hugging Face's [out, in]; the embedding when tied), so one warp takes one
// row at a time, its lanes reading vectors of kVec weights across it, all of a group before any
// is used (kGroup vectors: kInFlight = 128 bytes a lane, 4 KB a warp; at most 16 vectors, so 64
// bytes of an 8-bit head under fp32), and sums it against every staged batch row of the pass.
// Rows go round-robin over every warp of the grid. The inputs are rounded to kT as the
// reference's head takes them (jaxfuse/_decode/model.py's logits()).
template <DType kT, DType kH>
struct HeadStage {
  using Vector = WeightVector<kT, kH>;  // kVec weights of kH
  using Inputs = WeightVector<kT, kT>;  // kVec staged inputs of kT, 16 bytes
  static constexpr int kVec = Vector::kVec;
  static constexpr int kGroup = kInFlight / Vector::kBytes < 16 ? kInFlight / Vector::kBytes : 16;
  static constexpr int kBytes = GemvTile<kT>::kBytes;

  const DecoderParams& p;
  Smem& sm;

  __device__ char* staged() const { return reinterpret_cast<char*>(sm.warp_sums); }

  // The first vocabulary rows this block's warps take, asked of L2 before the stage waits for
  // the last layer.
  __device__ void prefetch() const {
    const int64_t row_bytes = int64_t(p.dims.hidden) * Vector::kElementBytes;
    const int64_t first = int64_t(blockIdx.x) * kWarps;
    const int64_t rows = p.dims.vocab - first < kWarps ? p.dims.vocab - first : kWarps;
    if (rows > 0) prefetch_l2(static_cast<const char*>(p.io.head) + first * row_bytes,
                              int(rows * row_bytes));
  }

  __device__ void run() const {
    const int batch = p.dims.batch, rows = p.plan.head_rows;
    await_hidden(p, sm, blockIdx.x, p.dims.layers - 1, false);
    for (int b0 = 0; b0 < batch; b0 += rows) {
      const int nb = min(rows, batch - b0);
      stage_inputs(b0, nb);
      const uint32_t valid = valid_rows(p, b0, nb);
      const int warps = gridDim.x * kWarps;
      for (int n = blockIdx.x * kWarps + thread_index() / 32; n < p.dims.vocab; n += warps) {
        row(n, b0, nb, valid);
      }
    }
  }

  // The pass's inputs rmsnorm(h[b0 + bb]) * final_norm as kT, [nb][hidden], in shared memory.
  __device__ void stage_inputs(int b0, int nb) const {
    const int D = p.dims.hidden;
    stage_inv_rms(sm, NormedHidden<kT>{p, p.io.final_norm}, b0, nb);
    __syncthreads();  // inv_rms written; the previous pass's readers of staged() are done
    for (int i = thread_index(); i < nb * D; i += kThreads) {
      const int bb = i / D, k = i % D;
      store_from_float(staged(), kT, i,
                       rms_apply(ws_load(p.ws.hidden.at(b0 + bb, k)), sm.inv_rms[bb],
                                 load_as_float(p.io.final_norm, kT, k)));
    }
    __syncthreads();
  }

  // Vocabulary row n against the nb staged rows; lane 0 writes the logits (NaN for invalid rows).
  __device__ void row(int n, int b0, int nb, uint32_t valid) const {
    const int D = p.dims.hidden, lane = thread_index() % 32;
    const char* weights =
        static_cast<const char*>(p.io.head) + int64_t(n) * D * Vector::kElementBytes;
    float acc[kHeadMaxRows] = {};
    for (int k0 = 0; k0 < D; k0 += kGroup * 32 * kVec) {
      Vector v[kGroup];
#pragma unroll
      for (int g = 0; g < kGroup; ++g) {
        const int k = k0 + (g * 32 + lane) * kVec;
        v[g] = k < D ? Vector::load(weights, k) : Vector::zero();
      }
#pragma unroll
      for (int g = 0; g < kGroup; ++g) {
        const int k = k0 + (g * 32 + lane) * kVec;
        if (k < D) accumulate(v[g], k, nb, acc);
      }
    }
    const float scale = kH == kT ? 1.0f : __ldg(p.io.head_scale + n);
#pragma unroll
    for (int bb = 0; bb < kHeadMaxRows; ++bb) {
      if (bb < nb) {
        const float y = warp_sum(acc[bb]) * scale;
        if (lane == 0) {
          const bool ok = (valid >> bb) & 1u;
          ws_store(p.io.logits + int64_t(b0 + bb) * p.dims.vocab + n, ok ? y : quiet_nan_f32());
        }
      }
    }
  }

  // acc[bb] += w . input[bb][k .. k + kVec) for the staged rows bb < nb.
  __device__ void accumulate(const Vector& w, int k, int nb, float* acc) const {
    float wf[kVec];
    w.unpack(wf);
#pragma unroll
    for (int bb = 0; bb < kHeadMaxRows; ++bb) {
      if (bb < nb) {
        const Inputs in{*reinterpret_cast<const typename Inputs::Raw*>(
            staged() + (int64_t(bb) * p.dims.hidden + k) * kBytes)};
#pragma unroll
        for (int e = 0; e < kVec; ++e) acc[bb] += wf[e] * in.at(e);
      }
    }
  }
};

}  // namespace jaxfuse::cuda_decoder
