// jaxfuse_decoder, CPU: one decode step of an L-layer Llama-style decoder (RMSNorm, GQA attention
// with RoPE over a KV cache, SwiGLU MLP), in one FFI call. DecodeStep runs the stages of the CUDA
// kernel (decoder.cu) in the same order, without its split of the work: per layer rmsnorm + QKV,
// RoPE + KV append, attention, O projection, MLP. The GEMVs and the attention heads are spread
// over XLA's intra-op thread pool; all arithmetic is fp32 (decoder_math.h, shared with the CUDA
// kernel); temporaries live in the workspace result (DecoderWorkspace), so the handler allocates
// nothing per layer. Operand layout: decoder.h.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "jaxfuse/decoder.h"

#include "cpu_common.h"

namespace jaxfuse {
namespace {

// ---- GEMV: y[b, :] = a[b, :] @ W for the B rows of a decode step -----------------------------
//
// A decode GEMV streams every weight once per step for only B rows, so it is bound by how fast
// the weights arrive and how cheaply each is widened and used B times:
//  - memory order: W [K, N] is walked k-row by k-row, each row's span of a work item read front
//    to back (the hardware prefetchers follow that; walking a narrow column strip down K, one
//    cache line per 1-3 KB row, runs at a quarter of the bandwidth on this class of machine);
//  - registers: the micro-kernel (gemv_tile) keeps an MR-row x NS-strip accumulator tile in
//    registers over kStepRows k rows, widens each weight vector once for its MR rows and
//    broadcasts a[r, k] against it. Between steps the accumulators wait in an L1-resident tile.
// Every output is summed over k in ascending order, one fp32 multiply and one add per term
// (no FMA contraction: see CMakeLists.txt), whatever the blocking, the vector width, the dtype's
// load path and the thread count: results are deterministic and equal to the plain loop's.

// Vector types of the micro-kernel: F32x8 (AVX2, and the default ISA as pairs of SSE vectors)
// or F32x16 (AVX-512), with the unsigned type of the same lanes.
template <typename V>
struct Lanes;
template <>
struct Lanes<F32x8> {
  using Bits = U32x8;
  static constexpr int kCount = 8;
};
template <>
struct Lanes<F32x16> {
  using Bits = U32x16;
  static constexpr int kCount = 16;
};

// Batch rows per register tile.
constexpr int kTileRows = 4;
// k rows per register-tile round trip: the accumulator loads and stores are 1/kStepRows of the
// multiply-adds; the step's weights (16 rows x the item's columns, <= 8 KB at 16 batch rows)
// stay in L1 while every row group of the batch uses them.
constexpr int64_t kStepRows = 16;
// The accumulator tile of one work item: at most kPassRows batch rows x (kTileFloats / rows)
// columns of fp32, 16 KB, half of L1. Batches above kPassRows take further passes over W.
constexpr int64_t kTileFloats = 4096;
constexpr int64_t kPassRows = 16;
// Work items span a multiple of the widest strip (2 x 16 lanes), so only the last item of a
// matrix can end in a partial strip.
constexpr int64_t kItemAlign = 32;
// Below this many multiply-adds a stage runs on the calling thread: handing work to the pool
// costs more than it saves for small models.
constexpr int64_t kMinParallelWork = int64_t(1) << 17;

ffi::ThreadPool* pool_for(ffi::ThreadPool* pool, int64_t work) {
  return work >= kMinParallelWork ? pool : nullptr;
}

// Strips: kCols consecutive columns of a W row, held as two vectors V. load(w, v0, v1) widens
// the kCols weights at w; to_columns(v0, v1, out) writes sums of those lanes as columns in order.

// bf16 -> fp32 is a 16-bit left shift. A strip of bf16, read as 32-bit lanes, holds column 2i
// in the low half of lane i and column 2i+1 in its high half: one shift (even columns) and one
// mask (odd columns) widen it all, where zero-extension would take four shuffles. The
// accumulators hold even / odd columns until to_columns() interleaves them.
template <typename V>
struct Bf16Strip {
  using Storage = jaxfuse::Storage<DType::kBF16>;
  using Vec = V;
  static constexpr int kLanes = Lanes<V>::kCount;
  static constexpr int64_t kCols = 2 * kLanes;
  static void load(const uint16_t* w, V& even, V& odd) {
    typename Lanes<V>::Bits u;
    std::memcpy(&u, w, sizeof(u));
    even = reinterpret_cast<V>(u << 16);
    odd = reinterpret_cast<V>(u & 0xffff0000u);
  }
  static void to_columns(V even, V odd, float* out) {
    for (int i = 0; i < kLanes; ++i) {
      out[2 * i] = even[i];
      out[2 * i + 1] = odd[i];
    }
  }
};

// Columns in order, lanes 0..kLanes-1 then kLanes..kCols-1.
template <typename V>
struct ContiguousStrip {
  using Vec = V;
  static constexpr int kLanes = Lanes<V>::kCount;
  static constexpr int64_t kCols = 2 * kLanes;
  static void to_columns(V lo, V hi, float* out) {
    std::memcpy(out, &lo, sizeof(lo));
    std::memcpy(out + kLanes, &hi, sizeof(hi));
  }
};

// fp32 weights are read in place.
template <typename V>
struct F32Strip : ContiguousStrip<V> {
  using Storage = jaxfuse::Storage<DType::kF32>;
  static void load(const float* w, V& lo, V& hi) {
    std::memcpy(&lo, w, sizeof(lo));
    std::memcpy(&hi, w + Lanes<V>::kCount, sizeof(hi));
  }
};

// The first `cols` columns widened one at a time, the rest zero: float16 (rare as decoder
// weights; its widening has no cheap vector form below F16C) and the last, partial strip of
// every dtype when N is not a multiple of the strip (so no load reads past a weight row).
template <typename V, typename S>
struct ScalarStrip : ContiguousStrip<V> {
  using Storage = S;
  int64_t cols = ContiguousStrip<V>::kCols;
  void load(const typename S::Bits* w, V& lo, V& hi) const {
    alignas(64) float f[ContiguousStrip<V>::kCols] = {};
    for (int64_t i = 0; i < cols; ++i) f[i] = S::template load<float>(w[i]);
    std::memcpy(&lo, f, sizeof(lo));
    std::memcpy(&hi, f + Lanes<V>::kCount, sizeof(hi));
  }
};

template <typename Strip>
using WeightBits = typename Strip::Storage::Bits;

// The accumulators of one work item: [rows][strips][2] vectors, in the strips' lane order.
template <typename V>
struct AccTile {
  V* v;
  int64_t row_vectors;  // 2 * strips

  V* at(int64_t row, int64_t strip) const { return v + row * row_vectors + 2 * strip; }
  AccTile from(int64_t row, int64_t strip) const { return {at(row, strip), row_vectors}; }
};

// The operands of one step of a pass: `steps` k rows of the activations a (row stride lda) and
// of the weights w (row stride ldw). `ahead`: how far on the next step's weights are (0 if there
// is no full next step), for the prefetches.
template <typename Bits>
struct StepOperands {
  const float* a;
  int64_t lda;
  const Bits* w;
  int64_t ldw;
  int64_t steps;
  int64_t ahead;

  StepOperands from(int64_t row, int64_t column) const {
    return {a + row * lda, lda, w + column, ldw, steps, ahead};
  }
};

// Asks for the cache lines of the strip at w.
template <typename Strip>
[[gnu::always_inline]] inline void prefetch_strip(const WeightBits<Strip>* w) {
  for (int64_t byte = 0; byte < Strip::kCols * int64_t(sizeof(*w)); byte += 64) {
    __builtin_prefetch(reinterpret_cast<const char*>(w) + byte);
  }
}

// The micro-kernel: acc[r, strips 0..NS) += sum_k a[r, k] * w[k, strips 0..NS) for r < MR over
// the step's k rows, k ascending. It prefetches the same strips of the next step, which the
// hardware prefetchers would not fetch in time (16 rows, each a short run). Inlined into each
// ISA version of gemv_pass (a call would run the default-ISA copy).
template <int MR, int NS, typename Strip, typename V = typename Strip::Vec>
[[gnu::always_inline]] inline void gemv_tile(const Strip& strip,
                                             const StepOperands<WeightBits<Strip>>& op,
                                             const AccTile<V>& acc) {
  V sum[MR][NS][2];
  for (int r = 0; r < MR; ++r) {
    for (int s = 0; s < NS; ++s) {
      sum[r][s][0] = acc.at(r, s)[0];
      sum[r][s][1] = acc.at(r, s)[1];
    }
  }
  const WeightBits<Strip>* w = op.w;
  for (int64_t k = 0; k < op.steps; ++k, w += op.ldw) {
    for (int s = 0; s < NS; ++s) {
      prefetch_strip<Strip>(w + op.ahead + s * Strip::kCols);
      V w0, w1;
      strip.load(w + s * Strip::kCols, w0, w1);
      for (int r = 0; r < MR; ++r) {
        const float ar = op.a[r * op.lda + k];
        sum[r][s][0] += ar * w0;
        sum[r][s][1] += ar * w1;
      }
    }
  }
  for (int r = 0; r < MR; ++r) {
    for (int s = 0; s < NS; ++s) {
      acc.at(r, s)[0] = sum[r][s][0];
      acc.at(r, s)[1] = sum[r][s][1];
    }
  }
}

// One step of MR rows across `cols` columns: NS strips per register tile, then single strips,
// then the partial strip.
template <int MR, int NS, typename Strip, typename V = typename Strip::Vec>
[[gnu::always_inline]] inline void gemv_step(const Strip& strip,
                                             const StepOperands<WeightBits<Strip>>& op,
                                             int64_t cols, const AccTile<V>& acc) {
  constexpr int64_t kCols = Strip::kCols;
  const int64_t full = cols / kCols;
  int64_t s = 0;
  for (; s + NS <= full; s += NS) gemv_tile<MR, NS>(strip, op.from(0, s * kCols), acc.from(0, s));
  for (; s < full; ++s) gemv_tile<MR, 1>(strip, op.from(0, s * kCols), acc.from(0, s));
  if (cols % kCols != 0) {
    const ScalarStrip<V, typename Strip::Storage> partial{{}, cols % kCols};
    gemv_tile<MR, 1>(partial, op.from(0, s * kCols), acc.from(0, s));
  }
}

// Strips per register tile for MR rows: 8 accumulators (hiding the 3-4 cycle add latency) with
// 16 vector registers; 16 with the 32 of AVX-512.
template <typename V>
constexpr int tile_strips(int rows) {
  return Lanes<V>::kCount == 16 ? (rows <= 2 ? 4 : 2) : (rows == 1 ? 4 : rows == 2 ? 2 : 1);
}

// One step of rows r < rows across `cols` columns, in row groups of kTileRows.
template <typename Strip, typename V = typename Strip::Vec>
[[gnu::always_inline]] inline void gemv_step_rows(const Strip& strip, int64_t rows,
                                                  const StepOperands<WeightBits<Strip>>& op,
                                                  int64_t cols, const AccTile<V>& acc) {
  for (int64_t r0 = 0; r0 < rows; r0 += kTileRows) {
    const StepOperands<WeightBits<Strip>> op_r = op.from(r0, 0);
    const AccTile<V> acc_r = acc.from(r0, 0);
    switch (std::min<int64_t>(kTileRows, rows - r0)) {
      case 1: gemv_step<1, tile_strips<V>(1)>(strip, op_r, cols, acc_r); break;
      case 2: gemv_step<2, tile_strips<V>(2)>(strip, op_r, cols, acc_r); break;
      case 3: gemv_step<3, tile_strips<V>(3)>(strip, op_r, cols, acc_r); break;
      default: gemv_step<4, tile_strips<V>(4)>(strip, op_r, cols, acc_r); break;
    }
  }
}

// y[r, 0:len] = sum_k a[r, k] * W[k, n0 + 0:len] for r < rows: kStepRows k rows at a time,
// each step across all rows and columns of the item. Needs rows * round_up(len, kCols) <=
// kTileFloats.
template <typename Strip, typename V = typename Strip::Vec>
[[gnu::always_inline]] inline void gemv_pass_with(const Strip& strip, int64_t rows,
                                                  const float* a, int64_t lda, const void* W,
                                                  int64_t K, int64_t N, int64_t n0, int64_t len,
                                                  float* y) {
  constexpr int64_t kCols = Strip::kCols;
  const int64_t strips = (len + kCols - 1) / kCols;
  alignas(64) V sums[kTileFloats / Lanes<V>::kCount];
  const AccTile<V> acc{sums, 2 * strips};
  std::fill_n(sums, rows * acc.row_vectors, V{});
  const WeightBits<Strip>* w = static_cast<const WeightBits<Strip>*>(W) + n0;
  for (int64_t k0 = 0; k0 < K; k0 += kStepRows) {
    const int64_t steps = std::min(kStepRows, K - k0);
    const int64_t ahead = k0 + 2 * kStepRows <= K ? kStepRows * N : 0;
    gemv_step_rows(strip, rows, {a + k0, lda, w + k0 * N, N, steps, ahead}, len, acc);
  }
  const int64_t full = len / kCols;
  for (int64_t r = 0; r < rows; ++r) {
    float* yr = y + r * len;
    for (int64_t s = 0; s < full; ++s) {
      strip.to_columns(acc.at(r, s)[0], acc.at(r, s)[1], yr + s * kCols);
    }
    if (full < strips) {  // the partial strip, summed in ScalarStrip's column order
      alignas(64) float columns[kCols];
      ContiguousStrip<V>::to_columns(acc.at(r, full)[0], acc.at(r, full)[1], columns);
      std::copy_n(columns, len - full * kCols, yr + full * kCols);
    }
  }
}

// gemv_pass_with the strip of W's storage `dtype`, in vectors V.
template <typename V>
[[gnu::always_inline]] inline void gemv_pass_as(int64_t rows, const float* a, int64_t lda,
                                                const void* W, DType dtype, int64_t K, int64_t N,
                                                int64_t n0, int64_t len, float* y) {
  switch (dtype) {
    case DType::kBF16: return gemv_pass_with(Bf16Strip<V>{}, rows, a, lda, W, K, N, n0, len, y);
    case DType::kF32: return gemv_pass_with(F32Strip<V>{}, rows, a, lda, W, K, N, n0, len, y);
    default:
      return gemv_pass_with(ScalarStrip<V, Storage<DType::kF16>>{}, rows, a, lda, W, K, N, n0,
                            len, y);
  }
}

// y[r, 0:len] (row stride len) = sum_k a[r, k] * W[k, n0 + 0:len] for r < rows, where
// rows * round_up(len, kItemAlign) <= kTileFloats; a fp32 with row stride lda, W [K, N] in
// storage `dtype`. One version per ISA level, picked at load time: 512-bit vectors where
// AVX-512 has them (half the instructions per multiply-add, and 32 registers for the
// accumulators), 256-bit ones otherwise.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && !defined(__CUDACC__)
__attribute__((target("default"))) void gemv_pass(int64_t rows, const float* a, int64_t lda,
                                                  const void* W, DType dtype, int64_t K,
                                                  int64_t N, int64_t n0, int64_t len, float* y) {
  gemv_pass_as<F32x8>(rows, a, lda, W, dtype, K, N, n0, len, y);
}
__attribute__((target("avx2"))) void gemv_pass(int64_t rows, const float* a, int64_t lda,
                                               const void* W, DType dtype, int64_t K, int64_t N,
                                               int64_t n0, int64_t len, float* y) {
  gemv_pass_as<F32x8>(rows, a, lda, W, dtype, K, N, n0, len, y);
}
__attribute__((target("avx512f"))) void gemv_pass(int64_t rows, const float* a, int64_t lda,
                                                  const void* W, DType dtype, int64_t K,
                                                  int64_t N, int64_t n0, int64_t len, float* y) {
  gemv_pass_as<F32x16>(rows, a, lda, W, dtype, K, N, n0, len, y);
}
#else
void gemv_pass(int64_t rows, const float* a, int64_t lda, const void* W, DType dtype, int64_t K,
               int64_t N, int64_t n0, int64_t len, float* y) {
  gemv_pass_as<F32x8>(rows, a, lda, W, dtype, K, N, n0, len, y);
}
#endif

// Columns per GEMV work item: as many as the accumulator tile holds for min(B, kPassRows) rows,
// but no more than N / threads, so every thread gets one.
int64_t gemv_item_width(int64_t B, int64_t N, int64_t threads) {
  const int64_t tile_units = kTileFloats / std::min(B, kPassRows) / kItemAlign;
  const int64_t thread_units = (N + threads * kItemAlign - 1) / (threads * kItemAlign);
  return std::max<int64_t>(std::min(tile_units, thread_units), 1) * kItemAlign;
}

// y[b, n] = sum_k a[b, k] * W[k, n] for the B rows of `a` (fp32, row stride lda), W [K, N] in
// storage `dtype`. Work items are column ranges, as wide as the accumulator tile allows (long
// sequential runs of each weight row) but at least one per thread; each covers all rows and all
// of K, so its sums do not depend on who computes it. epilogue(b, n0, len, y) receives each
// finished range of a row (fp32).
template <typename Epilogue>
void gemv(ffi::ThreadPool* pool, int64_t B, const float* a, int64_t lda, const void* W,
          DType dtype, int64_t K, int64_t N, const Epilogue& epilogue) {
  pool = pool_for(pool, B * K * N);
  const int64_t helpers = helpers_beside_caller(pool);
  const int64_t width = gemv_item_width(B, N, helpers + 1);
  parallel_for(pool, (N + width - 1) / width, [&](int64_t item) {
    const int64_t n0 = item * width;
    const int64_t len = std::min(width, N - n0);
    alignas(64) float y[kTileFloats];
    for (int64_t b0 = 0; b0 < B; b0 += kPassRows) {
      const int64_t rows = std::min(kPassRows, B - b0);
      gemv_pass(rows, a + b0 * lda, lda, W, dtype, K, N, n0, len, y);
      for (int64_t r = 0; r < rows; ++r) epilogue(b0 + r, n0, len, y + r * len);
    }
  }, helpers);
}

// sum_i a[i] * b[i]: 8-element chunk c into F32x8 accumulator c % 4, then the accumulators and
// the 8 lanes added pairwise. Attention calls this once per head and cache position with
// n = head_dim; at 64, one accumulator and a lane-by-lane sum were a chain of 16 dependent adds,
// this order is 7. The lanes are F32x8's on every ISA level, so the result is the same
// everywhere.
JF_CPU_MULTIVERSION
float dot(const float* a, const float* b, int64_t n) {
  const auto add_chunk = [&](F32x8& acc, int64_t i) {  // acc += a[i:i+8] * b[i:i+8]
    F32x8 va, vb;
    std::memcpy(&va, a + i, sizeof(va));
    std::memcpy(&vb, b + i, sizeof(vb));
    acc += va * vb;
  };
  F32x8 acc0 = {}, acc1 = {}, acc2 = {}, acc3 = {};
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    add_chunk(acc0, i);
    add_chunk(acc1, i + 8);
    add_chunk(acc2, i + 16);
    add_chunk(acc3, i + 24);
  }
  if (i + 8 <= n) add_chunk(acc0, i), i += 8;
  if (i + 8 <= n) add_chunk(acc1, i), i += 8;
  if (i + 8 <= n) add_chunk(acc2, i), i += 8;
  const F32x8 s = (acc0 + acc1) + (acc2 + acc3);
  float sum = ((s[0] + s[4]) + (s[2] + s[6])) + ((s[1] + s[5]) + (s[3] + s[7]));
  for (; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

// Normalized rows: out[b, :] = rmsnorm(h[b, :]) * w (fp32).
void rmsnorm_rows(const DecoderDims& d, const WorkspaceRows& h, const void* w,
                  const WorkspaceRows& out) {
  std::vector<float> wf(d.D);
  load_tile(w, d.dtype, 0, d.D, wf.data());
  for (int64_t b = 0; b < d.B; ++b) {
    const float* hb = h.row(b);
    float ss = 0.0f;
    for (int64_t i = 0; i < d.D; ++i) ss += hb[i] * hb[i];
    const float r = rms_inv(ss, d.D, d.eps);
    for (int64_t i = 0; i < d.D; ++i) *out.at(b, i) = rms_apply(hb[i], r, wf[i]);
  }
}

// RoPE on one head vector in place, at position p, with the frequencies inv_freq[hd/2].
void rope_head(float* v, int64_t hd, int32_t p, const float* inv_freq) {
  const int64_t half = hd / 2;
  for (int64_t i = 0; i < half; ++i) {
    float c, s;
    rope_cos_sin(rope_angle(p, inv_freq[i]), &c, &s);
    rope_rotate(v[i], v[i + half], c, s);
  }
}

// RMSNorm of one head vector in place (Qwen3's q_norm / k_norm), weights w[hd] in `dtype`.
void rmsnorm_head(float* v, int64_t hd, const void* w, DType dtype, float eps) {
  float ss = 0.0f;
  for (int64_t i = 0; i < hd; ++i) ss += v[i] * v[i];
  const float r = rms_inv(ss, hd, eps);
  for (int64_t i = 0; i < hd; ++i) v[i] = rms_apply(v[i], r, load_as_float(w, dtype, i));
}

// One decode step: the stages below, layer by layer, each over all batch rows.
struct DecodeStep {
  ffi::ThreadPool* pool;
  const DecoderDims& d;
  const DecoderBuffers& io;
  const DecoderWeights& w;
  const DType dtype;
  DecoderWorkspace ws;
  const float attn_scale;
  WorkspaceRows normed;  // [B][D]: the current RMSNorm's output, the GEMV input
  WorkspaceRows gate;    // [B][I]: the gate projection
  std::vector<float> heap;  // normed and gate, when the workspace cannot hold them

  DecodeStep(ffi::ThreadPool* thread_pool, const DecoderDims& dims, const DecoderBuffers& buffers)
      : pool(thread_pool), d(dims), io(buffers), w(buffers.weights), dtype(dims.dtype),
        ws(dims, buffers.workspace), attn_scale(1.0f / std::sqrt(float(dims.hd))) {
    // `normed` and `gate` live in the GEMV partial-sum region (the CUDA kernel's; unused here),
    // which holds >= 1024 * B * 128 floats; heap only if it cannot.
    float* scratch = ws.gemv_partials.data;
    if ((d.D + d.I) * d.B > ws.gemv_partials.capacity) {
      heap.resize((d.D + d.I) * d.B);
      scratch = heap.data();
    }
    normed = {scratch, d.D};
    gate = {scratch + d.B * d.D, d.I};
  }

  void run() {
    load_tile(io.x, dtype, 0, d.B * d.D, ws.hidden.data);  // h = float(x)
    for (int64_t l = 0; l < d.L; ++l) {
      rmsnorm_qkv(l);
      rope_append_kv(l);
      attention(l);
      o_proj(l);
      mlp(l);
    }
    write_output();
  }

  // Layer l of stacked weight `stacked` ([L, layer_size]).
  const void* layer(const void* stacked, int64_t l, int64_t layer_size) const {
    return layer_slice(stacked, dtype, l, layer_size);
  }

  // Element index of kv head `kv_head` at `position` of the caches [L, B, S, KV, hd].
  int64_t cache_index(int64_t l, int64_t b, int64_t position, int64_t kv_head) const {
    return ((l * d.B + b) * d.S + position) * d.kv_dim() + kv_head * d.hd;
  }

  // The residual GEMV epilogue: h += y.
  auto add_to_hidden() const {
    return [this](int64_t b, int64_t n0, int64_t len, const float* y) {
      float* hb = ws.hidden.at(b, n0);
      for (int64_t i = 0; i < len; ++i) hb[i] += y[i];
    };
  }

  // [q | k | v] = (rmsnorm(h) * attn_norm) @ [wq | wk | wv] (+ [q_bias | k_bias | v_bias])
  void rmsnorm_qkv(int64_t l) {
    rmsnorm_rows(d, ws.hidden, layer(w.attn_norm, l, d.D), normed);
    const int64_t q_dim = d.q_dim(), kv_dim = d.kv_dim();
    const void* matrices[3] = {layer(w.wq, l, d.D * q_dim), layer(w.wk, l, d.D * kv_dim),
                               layer(w.wv, l, d.D * kv_dim)};
    // Only with qkv_bias: otherwise the bias operands are empty (possibly null) buffers.
    const void* biases[3] = {nullptr, nullptr, nullptr};
    if (d.qkv_bias) {
      biases[0] = layer(w.q_bias, l, q_dim);
      biases[1] = layer(w.k_bias, l, kv_dim);
      biases[2] = layer(w.v_bias, l, kv_dim);
    }
    const int64_t columns[3] = {q_dim, kv_dim, kv_dim};
    for (int m = 0; m < 3; ++m) {
      gemv(pool, d.B, normed.data, d.D, matrices[m], dtype, d.D, columns[m],
           [&](int64_t b, int64_t n0, int64_t len, const float* y) {
             float* out = ws.qkv.column(b, m, n0);
             for (int64_t i = 0; i < len; ++i) {
               out[i] = d.qkv_bias ? y[i] + load_as_float(biases[m], dtype, n0 + i) : y[i];
             }
           });
    }
  }

  // Per-head q/k RMSNorm (qk_norm) and RoPE on q and k, then k and v appended (rounded to the
  // cache dtype) at [l, b, p].
  void rope_append_kv(int64_t l) {
    const float* inv_freq = io.rope_inv_freq;
    for (int64_t b = 0; b < d.B; ++b) {
      const int32_t p = io.positions[b];
      if (!position_valid(p, d.S)) continue;
      for (int64_t head = 0; head < d.H; ++head) {
        float* q = ws.qkv.q(b, head);
        if (d.qk_norm) rmsnorm_head(q, d.hd, layer(w.q_norm, l, d.hd), dtype, d.eps);
        rope_head(q, d.hd, p, inv_freq);
      }
      for (int64_t kv_head = 0; kv_head < d.KV; ++kv_head) {
        float* k = ws.qkv.k(b, kv_head);
        if (d.qk_norm) rmsnorm_head(k, d.hd, layer(w.k_norm, l, d.hd), dtype, d.eps);
        rope_head(k, d.hd, p, inv_freq);
      }
      const int64_t at = cache_index(l, b, p, 0);
      const float* k = ws.qkv.k(b, 0);
      const float* v = ws.qkv.v(b, 0);
      for (int64_t i = 0; i < d.kv_dim(); ++i) {
        store_from_float(io.k_cache, dtype, at + i, k[i]);
        store_from_float(io.v_cache, dtype, at + i, v[i]);
      }
    }
  }

  // One work item per (batch row, query head).
  void attention(int64_t l) {
    int64_t work = 0;  // multiply-adds of this layer's attention
    for (int64_t b = 0; b < d.B; ++b) {
      work += 2 * d.H * d.hd * (int64_t(std::max(io.positions[b], 0)) + 1);
    }
    const int64_t chunks = d.head_chunks();  // of <= kDecHeadChunk query heads per kv head
    parallel_for(pool_for(pool, work), d.B * d.KV * chunks, [&](int64_t item) {
      const int64_t chunk = item % chunks, kv_head = item / chunks % d.KV, b = item / chunks / d.KV;
      const int64_t first = kv_head * d.group() + chunk * kDecHeadChunk;
      attend_heads(l, b, kv_head, first, std::min(kDecHeadChunk, (kv_head + 1) * d.group() - first));
    });
  }

  // Online softmax of query heads first .. first + heads - 1 (all on kv head `kv_head`) of row b
  // over the cache positions 0..p, as the CUDA kernel's work item: each K and V row is read (and
  // widened from a 16-bit cache) once for all the chunk's heads.
  void attend_heads(int64_t l, int64_t b, int64_t kv_head, int64_t first, int64_t heads) const {
    for (int64_t g = 0; g < heads; ++g) std::fill_n(ws.attn_out.head(b, first + g), d.hd, 0.0f);
    const int32_t p = io.positions[b];
    if (!position_valid(p, d.S)) return;
    std::vector<float> kv_row(2 * d.hd);
    float m[kDecHeadChunk], lsum[kDecHeadChunk];
    std::fill_n(m, heads, neg_inf_f32());
    std::fill_n(lsum, heads, 0.0f);
    for (int64_t s = 0; s <= p; ++s) {
      const int64_t at = cache_index(l, b, s, kv_head);
      // An fp32 cache is read in place; a 16-bit one is widened into kv_row first.
      const float* kf = kv_row.data();
      const float* vf = kf + d.hd;
      if (dtype == DType::kF32) {
        kf = static_cast<const float*>(io.k_cache) + at;
        vf = static_cast<const float*>(io.v_cache) + at;
      } else {
        load_tile(io.k_cache, dtype, at, d.hd, kv_row.data());
        load_tile(io.v_cache, dtype, at, d.hd, kv_row.data() + d.hd);
      }
      for (int64_t g = 0; g < heads; ++g) {
        float* o = ws.attn_out.head(b, first + g);
        float pw;
        const float score = dot(ws.qkv.q(b, first + g), kf, d.hd) * attn_scale;
        const float alpha = online_softmax_step(m[g], lsum[g], score, &pw);
        for (int64_t i = 0; i < d.hd; ++i) o[i] = o[i] * alpha + pw * vf[i];
      }
    }
    for (int64_t g = 0; g < heads; ++g) {
      float* o = ws.attn_out.head(b, first + g);
      const float inv = 1.0f / lsum[g];
      for (int64_t i = 0; i < d.hd; ++i) o[i] *= inv;
    }
  }

  // h += attn_out @ wo
  void o_proj(int64_t l) {
    const int64_t q_dim = d.q_dim();
    gemv(pool, d.B, ws.attn_out.data, q_dim, layer(w.wo, l, q_dim * d.D), dtype, q_dim, d.D,
         add_to_hidden());
  }

  // h += (silu(m @ w_gate) * (m @ w_up)) @ w_down, m = rmsnorm(h) * mlp_norm
  void mlp(int64_t l) {
    rmsnorm_rows(d, ws.hidden, layer(w.mlp_norm, l, d.D), normed);
    const int64_t size = d.D * d.I;
    gemv(pool, d.B, normed.data, d.D, layer(w.w_gate, l, size), dtype, d.D, d.I,
         [&](int64_t b, int64_t n0, int64_t len, const float* y) {
           std::copy_n(y, len, gate.at(b, n0));
         });
    gemv(pool, d.B, normed.data, d.D, layer(w.w_up, l, size), dtype, d.D, d.I,
         [&](int64_t b, int64_t n0, int64_t len, const float* y) {
           const float* g = gate.at(b, n0);
           float* a = ws.mlp_act.at(b, n0);
           for (int64_t i = 0; i < len; ++i) a[i] = swiglu(g[i], y[i]);
         });
    gemv(pool, d.B, ws.mlp_act.data, d.I, layer(w.w_down, l, size), dtype, d.I, d.D,
         add_to_hidden());
  }

  // out = h, or NaN for rows whose position is out of range.
  void write_output() {
    for (int64_t b = 0; b < d.B; ++b) {
      const int64_t first = b * d.D;  // of out's row b
      if (position_valid(io.positions[b], d.S)) {
        store_tile(io.out, dtype, first, d.D, ws.hidden.row(b));
      } else {
        for (int64_t i = 0; i < d.D; ++i) store_from_float(io.out, dtype, first + i, quiet_nan_f32());
      }
    }
  }
};

}  // namespace

template <>
ffi::Error DecoderOp::run<Cpu>(ffi::ThreadPool pool, const Call& call) {
  if (call.dims.B == 0) return ffi::Error::Success();
  DecodeStep(&pool, call.dims, call.buffers).run();
  return ffi::Error::Success();
}

JAXFUSE_REGISTER_OP(DecoderOp, Cpu);

}  // namespace jaxfuse
