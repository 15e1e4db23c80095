// The CUDA decoder's tensor-core LM head, for bf16 activations (included by cuda/decoder.cu
// only; fp32 and fp16 activations take HeadStage's FMA path, decoder_head.cuh): every head
// weight is read once for up to kMmaBatch batch rows, so the head's time hardly grows with the
// batch, where the FMA head re-reads the head per kHeadMaxRows rows.
//
// logits[b, n] = x[b] . head[n], x = rmsnorm(h[b]) * final_norm rounded to bf16 (as the
// reference's head takes it: jaxfuse/_decode/model.py's logits()), as mma.sync m16n8k16 with a
// 16-row tile of the vocabulary as operand A and the staged inputs as B (batch rows as its 8
// columns, one or two batch tiles). The head is [V, hidden] with k contiguous: A's natural
// layout, so a lane's loads are its fragments as they are. A sum over k does not care which k a
// fragment slot holds: lane (g, q) = (lane / 4, lane % 4) takes k = 32c + 8q .. 32c + 8q + 7 of
// each 32-k chunk c of vocabulary rows g and g + 8 (one 16-byte load of bf16 weights, 8 bytes of
// 8-bit ones, widened to bf16: exact), as two mma steps of 4 k each, and reads the same k of
// batch row 8t + g, its B fragments of both steps, with one 16-byte shared-memory load.
//
// Warps take vocabulary tiles round-robin over the grid and stream them in groups of
// kGroupChunks chunks (64 bytes a lane), the next group's loads issued before the current
// group's mmas, across tiles, and the first group's before the stage waits for the last layer:
// two groups, kInFlight bytes a lane, in flight (two groups of 128 bytes spilled at 128
// registers). The inputs are staged in the weight ring's shared
// memory (free after the last layer), bf16 rows of kHeadSpanK-rounded width whose 16-byte chunk
// j sits at j ^ (4 (b & 1)): a load phase's two rows then fall in distinct banks.
#pragma once

#include "decoder/cuda/decoder_head.cuh"

namespace jaxfuse::cuda_decoder {

// The staged inputs' row width rounds hidden up to this many elements: whole groups, and whole
// 128-byte spans for the chunk swizzle.
constexpr int kHeadSpanK = 256;

// Bytes of one staged input row of the tensor-core head (launch_plan() fits its rows per pass
// into the ring).
__host__ __device__ constexpr int64_t mma_head_row_bytes(int64_t hidden) {
  return (hidden + kHeadSpanK - 1) / kHeadSpanK * kHeadSpanK * 2;
}

template <DType kH>
struct MmaHeadStage {
  using Vector = WeightVector<DType::kBF16, kH>;  // 8 consecutive k of a vocabulary row
  static constexpr int kChunkK = 32;
  // Two groups in flight hold kInFlight bytes a lane.
  static constexpr int kGroupChunks = kInFlight / (4 * Vector::kBytes);  // 2 (bf16), 4 (8-bit)
  static constexpr int kGroupK = kGroupChunks * kChunkK;
  static_assert(kHeadSpanK % kGroupK == 0, "the staged width is whole groups");

  // A lane's weights of one group: chunk c's vectors of vocabulary rows g and g + 8.
  struct Group {
    Vector v[kGroupChunks][2];
  };
  template <int kTiles>
  using Acc = float[kTiles][4];  // [batch tile][c0..c3]

  const DecoderParams& p;
  Smem& sm;

  __device__ int lane() const { return thread_index() % 32; }
  __device__ int staged_chunks() const { return int(mma_head_row_bytes(p.dims.hidden) / 16); }
  // Staged batch row b's 16-byte chunk j (8 inputs, k = 8j ..).
  __device__ uint4* staged(int b, int j) const {
    return reinterpret_cast<uint4*>(dynamic_shared_memory()) + b * staged_chunks() +
           (j ^ (b & 1) << 2);
  }

  __device__ void run() const {
    const int warp = block_index() * kWarps + thread_index() / 32, warps = gridDim.x * kWarps;
    const int tiles = (p.dims.vocab + 15) / 16;
    const int groups = (p.dims.hidden + kGroupK - 1) / kGroupK;
    const int steps = warp < tiles ? ((tiles - 1 - warp) / warps + 1) * groups : 0;
    // The weights never wait for the activations.
    Group first = steps > 0 ? load(warp, 0) : Group{};
    await_hidden(p, sm, blockIdx.x, p.dims.layers - 1, false);
    const int rows = p.plan.head_rows;
    for (int b0 = 0; b0 < p.dims.batch; b0 += rows) {
      const int nb = min(rows, p.dims.batch - b0);
      if (b0 > 0 && steps > 0) first = load(warp, 0);
      stage_inputs(b0, nb);
      const uint32_t valid = valid_rows(p, b0, nb);
      if (nb > 8) pass<2>(first, b0, nb, valid, warp, warps, groups, steps);
      else pass<1>(first, b0, nb, valid, warp, warps, groups, steps);
    }
  }

  // The pass's inputs as bf16 rows, zero past hidden and in the batch tile's rows past nb.
  __device__ void stage_inputs(int b0, int nb) const {
    const int D = p.dims.hidden, chunks = staged_chunks();
    stage_inv_rms(sm, NormedHidden<DType::kBF16>{p, p.io.final_norm}, b0, nb);
    __syncthreads();  // inv_rms written; the previous pass's readers of the staged rows are done
    const int rows = (nb + 7) / 8 * 8;
    for (int i = thread_index(); i < rows * chunks; i += kThreads) {
      const int b = i / chunks, k = i % chunks * 8;
      uint32_t pairs[4] = {};
      if (b < nb && k < D) {
        float x[8];
#pragma unroll
        for (int e = 0; e < 8; ++e) x[e] = ws_load(p.ws.hidden.at(b0 + b, k + e));
#pragma unroll
        for (int e = 0; e < 8; ++e) {
          const float v = rms_apply(x[e], sm.inv_rms[b],
                                    load_as_float(p.io.final_norm, DType::kBF16, k + e));
          pairs[e / 2] |= uint32_t(float_to_bf16(v)) << 16 * (e % 2);
        }
      }
      *staged(b, i % chunks) = uint4{pairs[0], pairs[1], pairs[2], pairs[3]};
    }
    __syncthreads();
  }

  // Group `group` of vocabulary tile `tile`: zero past the vocabulary and past hidden (a
  // vector is wholly within or past it: hidden % 8 == 0, checked on the host).
  __device__ Group load(int tile, int group) const {
    const int g = lane() / 4, q = lane() % 4;
    const char* head = static_cast<const char*>(p.io.head);
    Group w;
#pragma unroll
    for (int c = 0; c < kGroupChunks; ++c) {
      const int k = group * kGroupK + c * kChunkK + 8 * q;
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int n = tile * 16 + g + 8 * r;
        w.v[c][r] = n < p.dims.vocab && k < p.dims.hidden
                        ? Vector::load(head, int64_t(n) * p.dims.hidden + k)
                        : Vector::zero();
      }
    }
    return w;
  }

  // Every tile of this warp for batch rows b0 .. b0 + nb - 1 (kTiles batch tiles of 8): a flat
  // stream of (tile, group) steps, `next` the first one's weights.
  template <int kTiles>
  __device__ void pass(Group next, int b0, int nb, uint32_t valid, int warp, int warps,
                       int groups, int steps) const {
    Acc<kTiles> acc = {};
    int tile = warp, group = 0;
    for (int i = 0; i < steps; ++i) {
      const Group cur = next;
      const bool tile_ends = group == groups - 1;
      if (i + 1 < steps) next = load(tile_ends ? tile + warps : tile, tile_ends ? 0 : group + 1);
      multiply<kTiles>(cur, group, acc);
      if (tile_ends) {
        store<kTiles>(acc, tile, b0, nb, valid);
#pragma unroll
        for (int t = 0; t < kTiles; ++t)
#pragma unroll
          for (int e = 0; e < 4; ++e) acc[t][e] = 0.0f;
        tile += warps;
        group = 0;
      } else {
        ++group;
      }
    }
  }

  // acc += the group's rows . the staged inputs: per chunk, one B load per batch tile and two
  // mma steps (file comment).
  template <int kTiles>
  __device__ void multiply(const Group& w, int group, Acc<kTiles>& acc) const {
    const int g = lane() / 4, q = lane() % 4;
#pragma unroll
    for (int c = 0; c < kGroupChunks; ++c) {
      const int j = (group * kGroupK + c * kChunkK) / 8 + q;
      uint4 x[kTiles];
#pragma unroll
      for (int t = 0; t < kTiles; ++t) x[t] = *staged(8 * t + g, j);
#pragma unroll
      for (int s = 0; s < 2; ++s) {
        uint32_t a[4];
        pairs(w.v[c][0], s, a[0], a[2]);
        pairs(w.v[c][1], s, a[1], a[3]);
#pragma unroll
        for (int t = 0; t < kTiles; ++t) {
          mma_bf16(acc[t], a, {word(x[t], 2 * s), word(x[t], 2 * s + 1)});
        }
      }
    }
  }

  // Elements 4s .. 4s + 3 of a vector as the bf16 pairs (4s, 4s + 1) and (4s + 2, 4s + 3), the
  // lower k in the low half: word 2s and 2s + 1 of bf16 weights; 8-bit ones widened from word s.
  __device__ static void pairs(const Vector& v, int s, uint32_t& first, uint32_t& second) {
    if constexpr (kH == DType::kBF16) {
      first = word(v.raw, 2 * s);
      second = word(v.raw, 2 * s + 1);
    } else {
      widen_word<kH>(word(v.raw, s), first, second);
    }
  }

  // The tile's logits: c0, c1 are vocabulary row g's of batch rows 2q, 2q + 1 of a batch tile,
  // c2, c3 row g + 8's; times the row's scale when the head is quantized, NaN in invalid rows.
  template <int kTiles>
  __device__ void store(const Acc<kTiles>& acc, int tile, int b0, int nb, uint32_t valid) const {
    const int g = lane() / 4, q = lane() % 4;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int n = tile * 16 + g + 8 * r;
      if (n >= p.dims.vocab) continue;
      const float scale = kH == DType::kBF16 ? 1.0f : __ldg(p.io.head_scale + n);
#pragma unroll
      for (int t = 0; t < kTiles; ++t) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int bb = 8 * t + 2 * q + h;
          if (bb >= nb) continue;
          const bool ok = (valid >> bb) & 1u;
          ws_store(p.io.logits + int64_t(b0 + bb) * p.dims.vocab + n,
                   ok ? acc[t][2 * r + h] * scale : quiet_nan_f32());
        }
      }
    }
  }
};

}  // namespace jaxfuse::cuda_decoder
