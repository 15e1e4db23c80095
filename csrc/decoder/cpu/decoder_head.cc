// The CPU decoder's whole-model step around the layers (DecodeStep, decoder_step.h): the
// embedding gather, the final RMSNorm and LM head, and the next token's draw, as the CUDA
// kernel's EmbedStage, HeadStage and SampleStage (cuda/decoder_head.cuh).
#include <algorithm>
#include <optional>
#include <vector>

#include "decoder/cpu/decoder_step.h"

namespace jaxfuse::cpu_decoder {
namespace {

// Vocabulary rows per work item of the head and of the sampling pass.
constexpr int64_t kHeadRowsPerItem = 256;
// A head row's dot products with the batch rows, kDotRows at a time (their sums are independent
// chains: the FP adders stay busy); each product's partial sums in kDotLanes lanes: lane j adds
// the products of k = j mod kDotLanes in ascending k, then the lanes are added in order (fixed
// bits whatever the ISA; the lanes vectorize).
constexpr int64_t kDotLanes = 16;
constexpr int64_t kDotRows = 4;

// out[r] = a[r, :] . w for r < kRows (a with row stride lda; w and each row n long). One
// partial-sum array per row, not a [rows][lanes] one, which GCC vectorized across rows with
// scalar gathers.
template <int64_t kRows>
__attribute__((always_inline)) inline void dots(const float* a, int64_t lda, const float* w,
                                                int64_t n, float* out) {
  const float* a0 = a;
  const float* a1 = a + (kRows > 1 ? lda : 0);
  const float* a2 = a + (kRows > 2 ? 2 * lda : 0);
  const float* a3 = a + (kRows > 3 ? 3 * lda : 0);
  float s0[kDotLanes] = {}, s1[kDotLanes] = {}, s2[kDotLanes] = {}, s3[kDotLanes] = {};
  int64_t k = 0;
  for (; k + kDotLanes <= n; k += kDotLanes) {
    for (int64_t j = 0; j < kDotLanes; ++j) {
      const float wj = w[k + j];
      s0[j] += a0[k + j] * wj;
      if constexpr (kRows > 1) s1[j] += a1[k + j] * wj;
      if constexpr (kRows > 2) s2[j] += a2[k + j] * wj;
      if constexpr (kRows > 3) s3[j] += a3[k + j] * wj;
    }
  }
  for (int64_t j = 0; k < n; ++k, ++j) {
    s0[j] += a0[k] * w[k];
    if constexpr (kRows > 1) s1[j] += a1[k] * w[k];
    if constexpr (kRows > 2) s2[j] += a2[k] * w[k];
    if constexpr (kRows > 3) s3[j] += a3[k] * w[k];
  }
  const float* sums[4] = {s0, s1, s2, s3};
  for (int64_t r = 0; r < kRows; ++r) {
    float s = 0.0f;
    for (int64_t j = 0; j < kDotLanes; ++j) s += sums[r][j];
    out[r] = s;
  }
}

JF_CPU_MULTIVERSION void head_dots(const float* a, int64_t lda, int64_t rows, const float* w,
                                   int64_t n, float* out) {
  for (int64_t r0 = 0; r0 < rows; r0 += kDotRows) {
    const float* ar = a + r0 * lda;
    switch (std::min(kDotRows, rows - r0)) {
      case 1: dots<1>(ar, lda, w, n, out + r0); break;
      case 2: dots<2>(ar, lda, w, n, out + r0); break;
      case 3: dots<3>(ar, lda, w, n, out + r0); break;
      default: dots<4>(ar, lda, w, n, out + r0); break;
    }
  }
}

// n elements from `start` of the head [V, D] as fp32: load_tile's dtypes, or the int8 / fp8 codes
// of a quantized head widened exactly (visit_dtype does not take them).
template <DType kT>
[[gnu::always_inline]] inline void widen(const void* head, int64_t start, int64_t n, float* out) {
  using S = Storage<kT>;
  const typename S::Bits* p = static_cast<const typename S::Bits*>(head) + start;
  for (int64_t i = 0; i < n; ++i) out[i] = S::template load<float>(p[i]);
}

#if defined(__x86_64__)
// fp8 e4m3 codes widened as F8Strip does (decoder_gemv.cc), element by element: the exponent and
// mantissa fields at float's places read as 2^-120 times the magnitude (subnormal codes as float
// subnormals: the caller holds a SubnormalInputs), one multiply to rescale, the sign moved to
// float's. f8e4m3_to_float's values in 6 vector operations a vector, where its two cases,
// computed and selected, take 12.
[[gnu::always_inline]] inline void widen_f8(const void* head, int64_t start, int64_t n,
                                            float* out) {
  const uint8_t* p = static_cast<const uint8_t*>(head) + start;
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t c = p[i];
    out[i] = bits_float(((c & 0x7fu) << 20) | ((c & 0x80u) << 24)) * 0x1p120f;
  }
}
#else  // (no flush-to-zero control here: the exact scalar widening)
[[gnu::always_inline]] inline void widen_f8(const void* head, int64_t start, int64_t n,
                                            float* out) {
  widen<DType::kF8E4M3>(head, start, n, out);
}
#endif

JF_CPU_MULTIVERSION void head_row(const void* head, DType t, int64_t start, int64_t n,
                                  float* out) {
  if (t == DType::kI8) return widen<DType::kI8>(head, start, n, out);
  if (t == DType::kF8E4M3) return widen_f8(head, start, n, out);
  load_tile(head, t, start, n, out);
}

// Row b's sampling scores of its logits n0 .. n0 + n - 1 (SampleRule::score; the rule by value,
// so its fields are not reloaded per element and the loop vectorizes, logs included).
JF_CPU_MULTIVERSION void sample_scores(SampleRule rule, const float* logits, int64_t b,
                                       int64_t n0, int64_t n, int64_t vocab, float* out) {
  if (rule.greedy) {
    std::copy_n(logits, n, out);
    return;
  }
  for (int64_t j = 0; j < n; ++j) out[j] = rule.score(logits[j], b, n0 + j, vocab);
}

// Radix pass `pass` over the candidates: their count (and mass) by digit, bins [select_bins].
void count_digits(const std::vector<uint32_t>& keys, const std::vector<uint64_t>& masses,
                  int pass, uint32_t* counts, uint64_t* bin_masses) {
  std::fill_n(counts, kSelectBins, 0u);
  std::fill_n(bin_masses, kSelectBins, uint64_t(0));
  for (size_t i = 0; i < keys.size(); ++i) {
    const uint32_t digit = select_digit(keys[i], pass);
    ++counts[digit];
    if (!masses.empty()) bin_masses[digit] += masses[i];
  }
}

// Keeps the candidates whose digit of `pass` is `bin` (the next pass's bucket).
void keep_bin(std::vector<uint32_t>& keys, std::vector<uint64_t>& masses, int pass, int bin) {
  size_t kept = 0;
  for (size_t i = 0; i < keys.size(); ++i) {
    if (select_digit(keys[i], pass) != uint32_t(bin)) continue;
    keys[kept] = keys[i];
    if (!masses.empty()) masses[kept] = masses[i];
    ++kept;
  }
  keys.resize(kept);
  if (!masses.empty()) masses.resize(kept);
}

// The smallest order key of row `logits` [V] that top-k and top-p keep (0: every key): the CUDA
// kernel's radix passes and walks (sampling_math.h), each pass over the candidates of the bucket
// found so far only.
uint32_t sample_floor(const SampleRule& rule, const float* logits, int64_t V) {
  std::vector<uint32_t> all(V);
  for (int64_t n = 0; n < V; ++n) all[n] = order_key(rule.scaled(logits[n]));
  uint32_t counts[kSelectBins];
  uint64_t bin_masses[kSelectBins];
  uint32_t floor = 0;
  if (rule.top_k_filters(V)) {
    std::vector<uint32_t> keys = all;
    std::vector<uint64_t> none;
    uint32_t need = uint32_t(rule.top_k), prefix = 0;
    for (int pass = 0; pass < kSelectPasses; ++pass) {
      count_digits(keys, none, pass, counts, bin_masses);
      const int bin = walk_count(counts, select_bins(pass), need);
      if (bin < 0) break;  // (not reached: the bucket holds the need-th largest)
      prefix |= uint32_t(bin) << select_shift(pass);
      keep_bin(keys, none, pass, bin);
    }
    floor = prefix;
  }
  if (rule.top_p_filters()) {
    const float max_s = order_value(*std::max_element(all.begin(), all.end()));
    const int shift = mass_shift(V);
    std::vector<uint32_t> keys;
    std::vector<uint64_t> masses;
    for (int64_t n = 0; n < V; ++n) {
      if (all[n] < floor) continue;
      keys.push_back(all[n]);
      masses.push_back(fixed_mass(rule.scaled(logits[n]), max_s, shift));
    }
    uint64_t total = 0, above = 0;
    for (const uint64_t m : masses) total += m;
    const NucleusLimit limit{double(rule.top_p) * double(total)};
    uint32_t prefix = 0;
    for (int pass = 0; pass < kSelectPasses; ++pass) {
      count_digits(keys, masses, pass, counts, bin_masses);
      const int bin = walk_mass(counts, bin_masses, select_bins(pass), above, limit);
      if (bin < 0) break;  // (not reached: the bucket's largest candidate is kept)
      prefix |= uint32_t(bin) << select_shift(pass);
      keep_bin(keys, masses, pass, bin);
    }
    floor = prefix;
  }
  return floor;
}

}  // namespace

void DecodeStep::embed_tokens() {
  for (int64_t b = 0; b < d.B; ++b) {
    float* h = ws.hidden.row(b);
    if (io.token_valid(b, d.V)) {
      load_tile(io.embed, dtype, int64_t(io.tokens[b]) * d.D, d.D, h);
    } else {
      std::fill_n(h, d.D, 0.0f);  // an invalid row (position()): never read past the embedding
    }
  }
}

void DecodeStep::lm_head() {
  // The head's input: rmsnorm(h) * final_norm, rounded to the model's dtype as the head's
  // matrix product takes it.
  rmsnorm_rows(d, ws.hidden, io.final_norm, normed);
  for (int64_t i = 0; i < d.B * d.D; ++i) normed.data[i] = round_to(dtype, normed.data[i]);
  // A quantized head's rows are widened exactly and their scales applied to the sums.
  const DType head_dtype = io.head_scale != nullptr ? d.wdtype : dtype;
  const int64_t items = (d.V + kHeadRowsPerItem - 1) / kHeadRowsPerItem;
  parallel_for(pool_for(pool, d.B * d.V * d.D), items, [&](int64_t item) {
#if defined(__x86_64__)
    std::optional<SubnormalInputs> subnormals;  // (each thread's own MXCSR)
    if (head_dtype == DType::kF8E4M3) subnormals.emplace();
#endif
    std::vector<float> row(d.D), y(d.B);
    const int64_t n1 = std::min(d.V, (item + 1) * kHeadRowsPerItem);
    for (int64_t n = item * kHeadRowsPerItem; n < n1; ++n) {
      head_row(io.head, head_dtype, n * d.D, d.D, row.data());
      head_dots(normed.data, normed.width, d.B, row.data(), d.D, y.data());
      const float scale = io.head_scale != nullptr ? io.head_scale[n] : 1.0f;
      for (int64_t b = 0; b < d.B; ++b) {
        const bool valid = position_valid(position(b), d.S);
        io.logits[b * d.V + n] = valid ? y[b] * scale : quiet_nan_f32();
      }
    }
  }, helpers_beside_caller(pool));
}

void DecodeStep::sample_tokens() {
  const SampleRule rule = io.sample_rule(d.temperature, d.top_k, d.top_p);
  std::vector<uint32_t> floors(d.B, 0);
  if (rule.top_k_filters(d.V) || rule.top_p_filters()) {
    parallel_for(pool_for(pool, d.B * d.V * 16), d.B, [&](int64_t b) {
      floors[b] = sample_floor(rule, io.logits + b * d.V, d.V);
    }, helpers_beside_caller(pool));
  }
  const int64_t chunks = (d.V + kHeadRowsPerItem - 1) / kHeadRowsPerItem;
  std::vector<uint64_t> best(d.B * chunks);
  // A draw costs about as much as 16 multiply-adds (threefry and two logs, vectorized).
  const int64_t work = d.B * d.V * (rule.greedy ? 1 : 16);
  parallel_for(pool_for(pool, work), d.B * chunks, [&](int64_t item) {
    const int64_t b = item / chunks, chunk = item % chunks;
    const int64_t n0 = chunk * kHeadRowsPerItem, n = std::min(d.V - n0, kHeadRowsPerItem);
    const float* logits = io.logits + b * d.V + n0;
    float scores[kHeadRowsPerItem];
    sample_scores(rule, logits, b, n0, n, d.V, scores);
    uint64_t key = 0;
    for (int64_t j = 0; j < n; ++j) {
      if (sample_keeps(rule, logits[j], floors[b])) {
        key = std::max(key, argmax_key(scores[j], uint32_t(n0 + j)));
      }
    }
    best[item] = key;
  }, helpers_beside_caller(pool));
  for (int64_t b = 0; b < d.B; ++b) {
    const uint64_t* row = best.data() + b * chunks;
    io.next_tokens[b] = argmax_index(*std::max_element(row, row + chunks));
  }
}

}  // namespace jaxfuse::cpu_decoder
