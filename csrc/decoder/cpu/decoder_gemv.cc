// The CPU decoder's GEMV micro-kernel (decoder_gemv.h says what it computes and why so).
#include "decoder/cpu/decoder_gemv.h"

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

// k rows per register-tile round trip: the accumulator loads and stores are 1/kStepRows of the
// multiply-adds; the step's weights (8 rows x the item's columns, <= 8 KB at 16 batch rows) stay
// in L1 while every row group of the batch uses them. 8 rows stream faster than 16 or 4: as many
// runs at once as the prefetchers follow well.
constexpr int64_t kStepRows = 8;
// Work items span a multiple of the widest strip (4 x 16 lanes), so only the last item of a
// matrix can end in a partial strip.
constexpr int64_t kItemAlign = 64;

// Strips: kCols consecutive columns of a W row, held as kVectors vectors V. load(w, v) widens the
// kCols weights at w; to_columns(v, out) writes sums of those lanes as columns in order. A strip's
// vectors may hold its weights times a power of two, kUnit^-1 (sums are scaled by it exactly).

template <typename V, int kVectorCount>
struct StripShape {
  using Vec = V;
  static constexpr int kLanes = Lanes<V>::kCount;
  static constexpr int kVectors = kVectorCount;
  static constexpr int64_t kCols = kVectors * kLanes;
  static constexpr float kUnit = 1.0f;
};

// Strips of lanes that each hold kVectors consecutive columns: vector j lane i is column
// kVectors * i + j, which to_columns() interleaves.
template <typename V, int kVectorCount>
struct InterleavedStrip : StripShape<V, kVectorCount> {
  using StripShape<V, kVectorCount>::kLanes;
  using StripShape<V, kVectorCount>::kVectors;
  static void to_columns(const V* v, float* out) {
    for (int i = 0; i < kLanes; ++i) {
      for (int j = 0; j < kVectors; ++j) out[kVectors * i + j] = v[j][i];
    }
  }
};

// bf16 -> fp32 is a 16-bit left shift. A strip of bf16, read as 32-bit lanes, holds column 2i
// in the low half of lane i and column 2i+1 in its high half: one shift (even columns) and one
// mask (odd columns) widen it all, where zero-extension would take four shuffles.
template <typename V>
struct Bf16Strip : InterleavedStrip<V, 2> {
  using Storage = jaxfuse::Storage<DType::kBF16>;
  static void load(const uint16_t* w, V* v) {
    typename Lanes<V>::Bits u;
    std::memcpy(&u, w, sizeof(u));
    v[0] = reinterpret_cast<V>(u << 16);
    v[1] = reinterpret_cast<V>(u & 0xffff0000u);
  }
};

// Columns in order, kVectors vectors of kLanes.
template <typename V, int kVectorCount = 2>
struct ContiguousStrip : StripShape<V, kVectorCount> {
  static void to_columns(const V* v, float* out) { std::memcpy(out, v, kVectorCount * sizeof(V)); }
};

// fp32 weights are read in place.
template <typename V>
struct F32Strip : ContiguousStrip<V> {
  using Storage = jaxfuse::Storage<DType::kF32>;
  static void load(const float* w, V* v) { std::memcpy(v, w, 2 * sizeof(V)); }
};

// 8-bit weights (weight-only quantization) are read as 32-bit lanes of four columns each and
// never extended across lanes (GCC splits a 16- to 32-bit extension into halves and scalarizes
// an 8- to 32-bit one): shifts move column j's byte to the top of the lane, masks clear the rest.

// int8: byte j at the top of a 32-bit integer is 2^24 times its value, converted exactly; kUnit
// scales the sums back.
template <typename V>
struct I8Strip : InterleavedStrip<V, 4> {
  using Storage = jaxfuse::Storage<DType::kI8>;
  using Ints = typename Lanes<V>::Ints;
  static constexpr float kUnit = 0x1p-24f;
  [[gnu::always_inline]] static void load(const int8_t* w, V* v) {
    typename Lanes<V>::Bits x;
    std::memcpy(&x, w, sizeof(x));
    constexpr uint32_t kTop = 0xff000000u;
    v[0] = __builtin_convertvector(reinterpret_cast<Ints>(x << 24), V);
    v[1] = __builtin_convertvector(reinterpret_cast<Ints>((x << 16) & kTop), V);
    v[2] = __builtin_convertvector(reinterpret_cast<Ints>((x << 8) & kTop), V);
    v[3] = __builtin_convertvector(reinterpret_cast<Ints>(x & kTop), V);
  }
};

// float8 e4m3fn: each code's exponent and mantissa fields, moved to float's places, read as
// 2^-120 times the magnitude (subnormal codes as float subnormals), so one multiply rescales
// every code, and its sign bit moved to float's: 6 vector operations per vector of codes where
// f8e4m3_to_float's two cases (dtype.h), computed and selected, take 12. It needs float
// subnormal inputs read as such: gemv_pass_as runs it under SubnormalInputs.
template <typename V>
struct F8Strip : InterleavedStrip<V, 4> {
  using Storage = jaxfuse::Storage<DType::kF8E4M3>;
  using Bits = typename Lanes<V>::Bits;
  // Code j of each lane (bits 8j .. 8j + 7 of x) as a float.
  template <int j>
  [[gnu::always_inline]] static void widen(Bits x, V& out) {
    Bits fields, sign;  // exponent and mantissa at bits 20..26, sign at bit 31
    if constexpr (j < 3) {
      fields = (x << (20 - 8 * j)) & (0x7fu << 20);
      sign = (x << (24 - 8 * j)) & 0x80000000u;
    } else {
      fields = (x >> 4) & (0x7fu << 20);
      sign = x & 0x80000000u;
    }
    const V magnitude = reinterpret_cast<V>(fields) * 0x1p120f;
    out = reinterpret_cast<V>(reinterpret_cast<Bits>(magnitude) | sign);
  }
  [[gnu::always_inline]] static void load(const uint8_t* w, V* v) {
    Bits x;
    std::memcpy(&x, w, sizeof(x));
    widen<0>(x, v[0]);
    widen<1>(x, v[1]);
    widen<2>(x, v[2]);
    widen<3>(x, v[3]);
  }
};

// The first `cols` columns widened one at a time, the rest zero, in kVectors vectors: float16
// (rare as decoder weights; its widening has no cheap vector form below F16C) and the last,
// partial strip of every dtype when N is not a multiple of the strip (so no load reads past a
// weight row).
template <typename V, typename S, int kVectorCount = 2>
struct ScalarStrip : ContiguousStrip<V, kVectorCount> {
  using Storage = S;
  int64_t cols = ContiguousStrip<V, kVectorCount>::kCols;
  void load(const typename S::Bits* w, V* v) const {
    alignas(64) float f[ContiguousStrip<V, kVectorCount>::kCols] = {};
    for (int64_t i = 0; i < cols; ++i) f[i] = S::template load<float>(w[i]);
    std::memcpy(v, f, sizeof(f));
  }
};

template <typename Strip>
using WeightBits = typename Strip::Storage::Bits;

// The accumulators of one work item: [rows][strips][kVectors] vectors, in the strips' lane order.
template <typename V, int kVectors>
struct AccTile {
  V* v;
  int64_t row_vectors;  // kVectors * strips

  V* at(int64_t row, int64_t strip) const { return v + row * row_vectors + kVectors * strip; }
  AccTile from(int64_t row, int64_t strip) const { return {at(row, strip), row_vectors}; }
};
template <typename Strip>
using StripAcc = AccTile<typename Strip::Vec, Strip::kVectors>;

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
// hardware prefetchers would not fetch in time (8 rows, each a short run). Inlined into each
// ISA version of gemv_pass (a call would run the default-ISA copy).
template <int MR, int NS, typename Strip, typename V = typename Strip::Vec>
[[gnu::always_inline]] inline void gemv_tile(const Strip& strip,
                                             const StepOperands<WeightBits<Strip>>& op,
                                             const StripAcc<Strip>& acc) {
  constexpr int kV = Strip::kVectors;
  V sum[MR][NS][kV];
  for (int r = 0; r < MR; ++r) {
    for (int s = 0; s < NS; ++s) {
      for (int j = 0; j < kV; ++j) sum[r][s][j] = acc.at(r, s)[j];
    }
  }
  const WeightBits<Strip>* w = op.w;
  for (int64_t k = 0; k < op.steps; ++k, w += op.ldw) {
    for (int s = 0; s < NS; ++s) {
      prefetch_strip<Strip>(w + op.ahead + s * Strip::kCols);
      V wv[kV];
      strip.load(w + s * Strip::kCols, wv);
      for (int r = 0; r < MR; ++r) {
        const float ar = op.a[r * op.lda + k];
        for (int j = 0; j < kV; ++j) sum[r][s][j] += ar * wv[j];
      }
    }
  }
  for (int r = 0; r < MR; ++r) {
    for (int s = 0; s < NS; ++s) {
      for (int j = 0; j < kV; ++j) acc.at(r, s)[j] = sum[r][s][j];
    }
  }
}

// One step of MR rows across `cols` columns: NS strips per register tile, then single strips,
// then the partial strip.
template <int MR, int NS, typename Strip, typename V = typename Strip::Vec>
[[gnu::always_inline]] inline void gemv_step(const Strip& strip,
                                             const StepOperands<WeightBits<Strip>>& op,
                                             int64_t cols, const StripAcc<Strip>& acc) {
  constexpr int64_t kCols = Strip::kCols;
  const int64_t full = cols / kCols;
  int64_t s = 0;
  for (; s + NS <= full; s += NS) gemv_tile<MR, NS>(strip, op.from(0, s * kCols), acc.from(0, s));
  for (; s < full; ++s) gemv_tile<MR, 1>(strip, op.from(0, s * kCols), acc.from(0, s));
  if (cols % kCols != 0) {
    const ScalarStrip<V, typename Strip::Storage, Strip::kVectors> partial{{}, cols % kCols};
    gemv_tile<MR, 1>(partial, op.from(0, s * kCols), acc.from(0, s));
  }
}

// Register tiles: about 8 accumulators (hiding the 3-4 cycle add latency) with 16 vector
// registers, 16 with the 32 of AVX-512; batch rows per tile (at most 4, fewer where one strip's
// vectors for 4 rows would not fit), and strips of kVectors per tile for MR rows.
template <typename V>
constexpr int kAccumulators = Lanes<V>::kCount == 16 ? 16 : 8;
template <typename V, int kVectors>
constexpr int kTileRows = std::min(4, kAccumulators<V> / kVectors);
template <typename V, int kVectors>
constexpr int tile_strips(int rows) {
  return std::max(1, kAccumulators<V> / (rows == 3 ? 4 : rows) / kVectors);
}

// One step of rows r < rows across `cols` columns, in row groups of kTileRows.
template <typename Strip, typename V = typename Strip::Vec>
[[gnu::always_inline]] inline void gemv_step_rows(const Strip& strip, int64_t rows,
                                                  const StepOperands<WeightBits<Strip>>& op,
                                                  int64_t cols, const StripAcc<Strip>& acc) {
  constexpr int kV = Strip::kVectors;
  constexpr int kRows = kTileRows<V, kV>;
  for (int64_t r0 = 0; r0 < rows; r0 += kRows) {
    const StepOperands<WeightBits<Strip>> op_r = op.from(r0, 0);
    const StripAcc<Strip> acc_r = acc.from(r0, 0);
    const int64_t mr = std::min<int64_t>(kRows, rows - r0);
    if (mr == 1) {
      gemv_step<1, tile_strips<V, kV>(1)>(strip, op_r, cols, acc_r);
    } else if constexpr (kRows == 2) {
      gemv_step<2, tile_strips<V, kV>(2)>(strip, op_r, cols, acc_r);
    } else if (mr == 2) {
      gemv_step<2, tile_strips<V, kV>(2)>(strip, op_r, cols, acc_r);
    } else if (mr == 3) {
      gemv_step<3, tile_strips<V, kV>(3)>(strip, op_r, cols, acc_r);
    } else {
      gemv_step<4, tile_strips<V, kV>(4)>(strip, op_r, cols, acc_r);
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
                                                  float* y, int64_t ldy) {
  constexpr int64_t kCols = Strip::kCols;
  const int64_t strips = (len + kCols - 1) / kCols;
  alignas(64) V sums[kTileFloats / Lanes<V>::kCount];
  const StripAcc<Strip> acc{sums, Strip::kVectors * strips};
  std::fill_n(sums, rows * acc.row_vectors, V{});
  const WeightBits<Strip>* w = static_cast<const WeightBits<Strip>*>(W) + n0;
  for (int64_t k0 = 0; k0 < K; k0 += kStepRows) {
    const int64_t steps = std::min(kStepRows, K - k0);
    const int64_t ahead = k0 + 2 * kStepRows <= K ? kStepRows * N : 0;
    gemv_step_rows(strip, rows, {a + k0, lda, w + k0 * N, N, steps, ahead}, len, acc);
  }
  const int64_t full = len / kCols;
  for (int64_t r = 0; r < rows; ++r) {
    float* yr = y + r * ldy;
    for (int64_t s = 0; s < full; ++s) {
      strip.to_columns(acc.at(r, s), yr + s * kCols);
      if constexpr (Strip::kUnit != 1.0f) {
        for (int64_t i = 0; i < kCols; ++i) yr[s * kCols + i] *= Strip::kUnit;
      }
    }
    if (full < strips) {  // the partial strip, summed in ScalarStrip's column order and unit
      alignas(64) float columns[kCols];
      ContiguousStrip<V, Strip::kVectors>::to_columns(acc.at(r, full), columns);
      std::copy_n(columns, len - full * kCols, yr + full * kCols);
    }
  }
}

// gemv_pass_with the strip of W's storage `dtype`, in vectors V.
template <typename V>
[[gnu::always_inline]] inline void gemv_pass_as(int64_t rows, const float* a, int64_t lda,
                                                const void* W, DType dtype, int64_t K, int64_t N,
                                                int64_t n0, int64_t len, float* y,
                                                int64_t ldy) {
  switch (dtype) {
    case DType::kBF16:
      return gemv_pass_with(Bf16Strip<V>{}, rows, a, lda, W, K, N, n0, len, y, ldy);
    case DType::kF32:
      return gemv_pass_with(F32Strip<V>{}, rows, a, lda, W, K, N, n0, len, y, ldy);
    case DType::kI8:
      return gemv_pass_with(I8Strip<V>{}, rows, a, lda, W, K, N, n0, len, y, ldy);
    case DType::kF8E4M3: {
#if defined(__x86_64__)
      const SubnormalInputs subnormals;
      return gemv_pass_with(F8Strip<V>{}, rows, a, lda, W, K, N, n0, len, y, ldy);
#else  // (no flush-to-zero control here: the exact scalar widening)
      return gemv_pass_with(ScalarStrip<V, Storage<DType::kF8E4M3>, 4>{}, rows, a, lda, W, K, N,
                            n0, len, y, ldy);
#endif
    }    default:
      return gemv_pass_with(ScalarStrip<V, Storage<DType::kF16>>{}, rows, a, lda, W, K, N, n0,
                            len, y, ldy);
  }
}

// y[r, 0:len] (row stride ldy) = sum_k a[r, k] * W[k, n0 + 0:len] for r < rows, where
// rows * round_up(len, kItemAlign) <= kTileFloats; a fp32 with row stride lda, W [K, N] in
// storage `dtype`. One version per ISA level, picked at load time: 512-bit vectors where
// AVX-512 has them (half the instructions per multiply-add, and 32 registers for the
// accumulators), 256-bit ones otherwise.
#if JF_CPU_ISA_VERSIONS
__attribute__((target("default"))) void gemv_pass_for_isa(
    int64_t rows, const float* a, int64_t lda, const void* W, DType dtype, int64_t K, int64_t N,
    int64_t n0, int64_t len, float* y, int64_t ldy) {
  gemv_pass_as<F32x8>(rows, a, lda, W, dtype, K, N, n0, len, y, ldy);
}
__attribute__((target("avx2"))) void gemv_pass_for_isa(
    int64_t rows, const float* a, int64_t lda, const void* W, DType dtype, int64_t K, int64_t N,
    int64_t n0, int64_t len, float* y, int64_t ldy) {
  gemv_pass_as<F32x8>(rows, a, lda, W, dtype, K, N, n0, len, y, ldy);
}
__attribute__((target("avx512f"))) void gemv_pass_for_isa(
    int64_t rows, const float* a, int64_t lda, const void* W, DType dtype, int64_t K, int64_t N,
    int64_t n0, int64_t len, float* y, int64_t ldy) {
  gemv_pass_as<F32x16>(rows, a, lda, W, dtype, K, N, n0, len, y, ldy);
}
#else  // one version, for the ISA this compile targets
void gemv_pass_for_isa(int64_t rows, const float* a, int64_t lda, const void* W, DType dtype,
                       int64_t K, int64_t N, int64_t n0, int64_t len, float* y, int64_t ldy) {
#ifdef __AVX512F__
  gemv_pass_as<F32x16>(rows, a, lda, W, dtype, K, N, n0, len, y, ldy);
#else
  gemv_pass_as<F32x8>(rows, a, lda, W, dtype, K, N, n0, len, y, ldy);
#endif
}
#endif

}  // namespace

void gemv_pass(int64_t rows, const float* a, int64_t lda, const void* W, DType dtype, int64_t K,
               int64_t N, int64_t n0, int64_t len, float* y, int64_t ldy) {
  gemv_pass_for_isa(rows, a, lda, W, dtype, K, N, n0, len, y, ldy);
}

GemvColumns gemv_columns(int64_t B, int64_t N, int64_t splits, int64_t threads) {
  const int64_t units = (N + kItemAlign - 1) / kItemAlign;
  const int64_t tile_units = kTileFloats / std::min(B, kPassRows) / kItemAlign;
  const int64_t count = std::max((units + tile_units - 1) / tile_units,
                                 std::min(units, (threads + splits - 1) / splits));
  const int64_t width = (units + count - 1) / count * kItemAlign;
  return {width, (N + width - 1) / width};
}

}  // namespace jaxfuse::cpu_decoder
