// The CPU decoder's GEMV micro-kernel (decoder_gemv.h says what it computes and why so).
#include "decoder_gemv.h"

#include <cstring>

namespace jaxfuse::cpu_decoder {
namespace {

// Vector types of the micro-kernel: F32x8 (AVX2, and the default ISA as pairs of SSE vectors)
// or F32x16 (AVX-512), with the 32-bit integer and the 16-bit types of the same lanes.
template <typename V>
struct Lanes;
template <>
struct Lanes<F32x8> {
  using Bits = U32x8;
  using Ints = I32x8;
  using I16 = I16x8;
  using U16 = U16x8;
  static constexpr int kCount = 8;
};
template <>
struct Lanes<F32x16> {
  using Bits = U32x16;
  using Ints = I32x16;
  using I16 = I16x16;
  using U16 = U16x16;
  static constexpr int kCount = 16;
};

// Batch rows per register tile.
constexpr int kTileRows = 4;
// k rows per register-tile round trip: the accumulator loads and stores are 1/kStepRows of the
// multiply-adds; the step's weights (16 rows x the item's columns, <= 8 KB at 16 batch rows)
// stay in L1 while every row group of the batch uses them.
constexpr int64_t kStepRows = 16;
// Work items span a multiple of the widest strip (2 x 16 lanes), so only the last item of a
// matrix can end in a partial strip.
constexpr int64_t kItemAlign = 32;

// Strips: kCols consecutive columns of a W row, held as two vectors V. load(w, v0, v1) widens
// the kCols weights at w; to_columns(v0, v1, out) writes sums of those lanes as columns in order.

// Strips of 2-column lanes: lane i holds columns 2i and 2i+1, widened into an even-column and an
// odd-column vector, which to_columns() interleaves.
template <typename V>
struct PairedStrip {
  using Vec = V;
  static constexpr int kLanes = Lanes<V>::kCount;
  static constexpr int64_t kCols = 2 * kLanes;
  static void to_columns(V even, V odd, float* out) {
    for (int i = 0; i < kLanes; ++i) {
      out[2 * i] = even[i];
      out[2 * i + 1] = odd[i];
    }
  }
};

// bf16 -> fp32 is a 16-bit left shift. A strip of bf16, read as 32-bit lanes, holds column 2i
// in the low half of lane i and column 2i+1 in its high half: one shift (even columns) and one
// mask (odd columns) widen it all, where zero-extension would take four shuffles.
template <typename V>
struct Bf16Strip : PairedStrip<V> {
  using Storage = jaxfuse::Storage<DType::kBF16>;
  static void load(const uint16_t* w, V& even, V& odd) {
    typename Lanes<V>::Bits u;
    std::memcpy(&u, w, sizeof(u));
    even = reinterpret_cast<V>(u << 16);
    odd = reinterpret_cast<V>(u & 0xffff0000u);
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

// 8-bit weights (weight-only quantization) are read as 16-bit lanes, each two columns,
// extended to 32 bits in one instruction; shifts split the bytes. (A direct byte-to-lane
// conversion is scalarized by GCC.)

// int8: sign-extended pairs; both columns converted exactly.
template <typename V>
struct I8Strip : PairedStrip<V> {
  using Storage = jaxfuse::Storage<DType::kI8>;
  using Ints = typename Lanes<V>::Ints;
  [[gnu::always_inline]] static void load(const int8_t* w, V& even, V& odd) {
    typename Lanes<V>::I16 pairs;
    std::memcpy(&pairs, w, sizeof(pairs));
    const Ints x = __builtin_convertvector(pairs, Ints);
    even = __builtin_convertvector((x << 24) >> 24, V);
    odd = __builtin_convertvector(x >> 8, V);
  }
};

// float8 e4m3fn: its exponent and mantissa fields, moved to float's places, read as 2^-120 times
// the magnitude (subnormal codes as float subnormals), so one multiply rescales every code: 6
// vector operations per pair of vectors where f8e4m3_to_float's two cases (dtype.h), computed
// and selected, take 12 (1.5x the GEMV's speed on AVX-512). It needs float subnormal inputs
// read as such: gemv_pass_as runs it under SubnormalInputs.
template <typename V>
struct F8Strip : PairedStrip<V> {
  using Storage = jaxfuse::Storage<DType::kF8E4M3>;
  using Bits = typename Lanes<V>::Bits;
  [[gnu::always_inline]] static void widen(Bits c, V& out) {
    const V magnitude = reinterpret_cast<V>((c & 0x7fu) << 20) * 0x1p120f;
    out = reinterpret_cast<V>(reinterpret_cast<Bits>(magnitude) | ((c & 0x80u) << 24));
  }
  [[gnu::always_inline]] static void load(const uint8_t* w, V& even, V& odd) {
    typename Lanes<V>::U16 pairs;
    std::memcpy(&pairs, w, sizeof(pairs));
    const Bits x = __builtin_convertvector(pairs, Bits);
    widen(x & 0xffu, even);
    widen(x >> 8, odd);
  }
};

#if defined(__x86_64__)
// Float subnormal inputs read as such in this scope: XLA's CPU threads run with MXCSR's
// denormals-are-zero bit set, which would read F8Strip's subnormal codes as 0. Restored on exit.
class SubnormalInputs {
 public:
  static constexpr unsigned kDenormalsAreZero = 1u << 6;
  SubnormalInputs() : saved_(__builtin_ia32_stmxcsr()) {
    __builtin_ia32_ldmxcsr(saved_ & ~kDenormalsAreZero);
  }
  ~SubnormalInputs() { __builtin_ia32_ldmxcsr(saved_); }
  SubnormalInputs(const SubnormalInputs&) = delete;
  SubnormalInputs& operator=(const SubnormalInputs&) = delete;

 private:
  unsigned saved_;
};
#endif

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
    case DType::kI8: return gemv_pass_with(I8Strip<V>{}, rows, a, lda, W, K, N, n0, len, y);
    case DType::kF8E4M3: {
#if defined(__x86_64__)
      const SubnormalInputs subnormals;
      return gemv_pass_with(F8Strip<V>{}, rows, a, lda, W, K, N, n0, len, y);
#else  // (no flush-to-zero control here: the exact scalar widening)
      return gemv_pass_with(ScalarStrip<V, Storage<DType::kF8E4M3>>{}, rows, a, lda, W, K, N, n0,
                            len, y);
#endif
    }    default:
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
__attribute__((target("default"))) void gemv_pass_for_isa(
    int64_t rows, const float* a, int64_t lda, const void* W, DType dtype, int64_t K, int64_t N,
    int64_t n0, int64_t len, float* y) {
  gemv_pass_as<F32x8>(rows, a, lda, W, dtype, K, N, n0, len, y);
}
__attribute__((target("avx2"))) void gemv_pass_for_isa(
    int64_t rows, const float* a, int64_t lda, const void* W, DType dtype, int64_t K, int64_t N,
    int64_t n0, int64_t len, float* y) {
  gemv_pass_as<F32x8>(rows, a, lda, W, dtype, K, N, n0, len, y);
}
__attribute__((target("avx512f"))) void gemv_pass_for_isa(
    int64_t rows, const float* a, int64_t lda, const void* W, DType dtype, int64_t K, int64_t N,
    int64_t n0, int64_t len, float* y) {
  gemv_pass_as<F32x16>(rows, a, lda, W, dtype, K, N, n0, len, y);
}
#else
void gemv_pass_for_isa(int64_t rows, const float* a, int64_t lda, const void* W, DType dtype,
                       int64_t K, int64_t N, int64_t n0, int64_t len, float* y) {
  gemv_pass_as<F32x8>(rows, a, lda, W, dtype, K, N, n0, len, y);
}
#endif

}  // namespace

void gemv_pass(int64_t rows, const float* a, int64_t lda, const void* W, DType dtype, int64_t K,
               int64_t N, int64_t n0, int64_t len, float* y) {
  gemv_pass_for_isa(rows, a, lda, W, dtype, K, N, n0, len, y);
}

int64_t gemv_item_width(int64_t B, int64_t N, int64_t threads) {
  const int64_t tile_units = kTileFloats / std::min(B, kPassRows) / kItemAlign;
  const int64_t thread_units = (N + threads * kItemAlign - 1) / (threads * kItemAlign);
  return std::max<int64_t>(std::min(tile_units, thread_units), 1) * kItemAlign;
}

}  // namespace jaxfuse::cpu_decoder
