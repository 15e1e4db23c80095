// Token sampling of the decoder's whole-model step, one definition for the CPU handler and the
// CUDA kernel: the draw of jax.random.categorical, element for element.
//
// categorical(key, s) over a row of scores s = logits / temperature is argmax(s + g), g Gumbel
// noise (the Gumbel-max trick); greedy decoding is argmax(logits). For a [B, V] call, jax draws
// g[b, n] from the threefry2x32 hash of the key and the element's flat index b * V + n as a
// 64-bit counter (jax_threefry_partitionable, the default since jax 0.5), xors the two output
// words into 32 random bits, maps them to a uniform u in [tiny, 1) through the mantissa, and
// takes g = -log(-log(u)) (gumbel's default "low" mode). The same steps here give the same g,
// up to the last bit of log (XLA's, CUDA's and log_positive's may differ there), so the kernels
// draw the tokens jax draws but where two candidates tie within a rounding.
//
// argmax is jnp.argmax's: the first index of the largest value, a NaN counting as the largest.
// Each candidate becomes one 64-bit key whose unsigned order is that order (the value's order-
// preserving bits above the index's complement), so an argmax is a max of keys: an atomicMax on
// the GPU, any order of reduction, the same winner.
#pragma once

#include <cmath>
#include <cstdint>

#include "core/dtype.h"

namespace jaxfuse {

// ---- threefry2x32 (Salmon et al. 2011), 20 rounds, as jax.random ----------------------------

JF_HD uint32_t rotl32(uint32_t x, int r) { return (x << r) | (x >> (32 - r)); }

// Four rounds with rotations r0..r3, then the key injection (k_a, k_b + i).
JF_HD void threefry_rounds(uint32_t& x0, uint32_t& x1, int r0, int r1, int r2, int r3,
                           uint32_t k_a, uint32_t k_b, uint32_t i) {
  const int rot[4] = {r0, r1, r2, r3};
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
  for (int j = 0; j < 4; ++j) {
    x0 += x1;
    x1 = rotl32(x1, rot[j]) ^ x0;
  }
  x0 += k_a;
  x1 += k_b + i;
}

// The 32 random bits jax.random.bits(key, shape) holds at flat index `index`: threefry2x32 of
// the key (k0, k1) and the counter (index >> 32, index & 0xffffffff), its words xored.
JF_HD uint32_t threefry_bits(uint32_t k0, uint32_t k1, uint64_t index) {
  const uint32_t k2 = k0 ^ k1 ^ 0x1BD11BDAu;
  uint32_t x0 = uint32_t(index >> 32) + k0;
  uint32_t x1 = uint32_t(index) + k1;
  threefry_rounds(x0, x1, 13, 15, 26, 6, k1, k2, 1);
  threefry_rounds(x0, x1, 17, 29, 16, 24, k2, k0, 2);
  threefry_rounds(x0, x1, 13, 15, 26, 6, k0, k1, 3);
  threefry_rounds(x0, x1, 17, 29, 16, 24, k1, k2, 4);
  threefry_rounds(x0, x1, 13, 15, 26, 6, k2, k0, 5);
  return x0 ^ x1;
}

// log(x) of a positive normal float (the only arguments gumbel_from_bits has): CUDA's logf on
// the device; on the host the float nearest the double-precision value (x = m 2^e, m in
// [sqrt(1/2), sqrt(2)), log x = e ln 2 + 2 atanh((m - 1) / (m + 1)) to t^13, a relative error
// below 1e-12), straight-line arithmetic that vectorizes where a call to glibc's logf does not.
JF_HD float log_positive(float x) {
#if defined(__CUDA_ARCH__)
  return logf(x);
#else
  const uint32_t bits = float_bits(x);
  const bool high = (bits & 0x7fffffu) > 0x3504f3u;  // mantissa above sqrt(2): halve it
  const int e = int(bits >> 23) - 127 + (high ? 1 : 0);
  const double m = double(bits_float((bits & 0x7fffffu) | (high ? 0x3f000000u : 0x3f800000u)));
  const double t = (m - 1.0) / (m + 1.0), t2 = t * t;
  double series = 2.0 / 13;  // 2 atanh(t) / t = sum of 2 t^2k / (2k + 1), by Horner
  for (int k = 5; k >= 0; --k) series = 2.0 / (2 * k + 1) + t2 * series;
  return float(double(e) * 0.6931471805599453 + t * series);
#endif
}

// jax.random.gumbel's float32 noise from 32 random bits: u = max(tiny, f * (1 - tiny) + tiny),
// f in [0, 1) from the top 23 bits, then -log(-log(u)).
JF_HD float gumbel_from_bits(uint32_t bits) {
  const float tiny = 1.17549435e-38f;  // the smallest normal float32
  const float f = bits_float((bits >> 9) | 0x3f800000u) - 1.0f;
  const float sum = f * (1.0f - tiny) + tiny;
  const float u = sum > tiny ? sum : tiny;  // never NaN: lax.max's value (fmaxf does not vectorize)
  return -log_positive(-log_positive(u));
}

// How row b's next token is drawn: greedy takes the argmax of the logits; sampling the argmax
// of the scores s = logit / temperature plus the Gumbel noise of element b * vocab + n, over the
// scores top-k and top-p keep (top_k 0 or >= vocab, top_p 1: every score).
struct SampleRule {
  bool greedy;
  float temperature;
  uint32_t k0, k1;  // the key's data (jax.random.key_data)
  int64_t top_k;
  float top_p;

  JF_HD bool top_k_filters(int64_t vocab) const { return !greedy && top_k > 0 && top_k < vocab; }
  JF_HD bool top_p_filters() const { return !greedy && top_p < 1.0f; }
  JF_HD float scaled(float logit) const { return logit / temperature; }
  JF_HD float score(float logit, int64_t b, int64_t n, int64_t vocab) const {
    if (greedy) return logit;
    const float g = gumbel_from_bits(threefry_bits(k0, k1, uint64_t(b * vocab + n)));
    return g + scaled(logit);
  }
};

// ---- argmax as a max of 64-bit keys ----------------------------------------------------------

// A float's 32-bit key whose unsigned order is the float's: -0 ties +0, a NaN is above every
// number (the all-ones key).
JF_HD uint32_t order_key(float v) {
  if (v != v) return 0xffffffffu;
  const uint32_t bits = float_bits(v == 0.0f ? 0.0f : v);
  return (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
}

// The float a key stands for (a NaN for the NaN key).
JF_HD float order_value(uint32_t key) {
  return bits_float((key & 0x80000000u) ? (key & 0x7fffffffu) : ~key);
}

// Candidate n with score v: larger keys win; equal scores go to the lower index; a NaN beats
// every number (the first NaN wins, as in jnp.argmax).
JF_HD uint64_t argmax_key(float v, uint32_t n) {
  return (uint64_t(order_key(v)) << 32) | uint64_t(0xffffffffu - n);
}

// The index a winning key names.
JF_HD int32_t argmax_index(uint64_t key) { return int32_t(0xffffffffu - uint32_t(key)); }

// ---- top-k and top-p: the smallest key a row keeps ---------------------------------------------
//
// The reference (jaxfuse/_decode/generation.py's _sample) keeps, of a row's scores s = logits /
// temperature, those >= the k-th largest (top-k; ties at it kept), then of those the ones >= the
// nucleus cutoff: the smallest kept value v whose mass above, M(>v) = the sum of softmax(s) over
// the kept scores > v, is below top_p (the largest is always kept). Both are thresholds on
// order_key(s), and the draw is categorical's over the scores whose key is >= the row's `floor`.
//
// A threshold is found digit by digit from the keys' top bits (kSelectPasses passes of a radix
// select): each pass counts the candidates of the bucket found so far by their next digit (a
// histogram of kSelectBins bins at most), then walks the bins from the top (walk_count,
// walk_mass). The CUDA kernel builds each histogram over the whole grid and walks it in parallel
// ranges; the CPU handler row by row over one range; both take the same bins. Masses are fixed-
// point integers, exp(s - max s) * 2^mass_shift(V) (fixed_mass), so their sums are exact in any
// order and both keep the same scores, up to the last bit of exp. The reference sums float
// probabilities, so it may keep one score more or fewer where M(>v) is within a rounding of top_p.

inline constexpr int kSelectPasses = 3;
inline constexpr int kSelectBins = 2048;

// Pass `pass`'s digit: the key's bits [select_shift, select_shift + select_bits), 11, 11 and 10
// bits from the top.
JF_HD int select_shift(int pass) { return pass == 0 ? 21 : (pass == 1 ? 10 : 0); }
JF_HD int select_bits(int pass) { return pass == 2 ? 10 : 11; }
JF_HD int select_bins(int pass) { return 1 << select_bits(pass); }
JF_HD uint32_t select_digit(uint32_t key, int pass) {
  return (key >> select_shift(pass)) & uint32_t(select_bins(pass) - 1);
}
// Whether `key` has the digits of `prefix` found by the passes before `pass`.
JF_HD bool select_in_bucket(uint32_t key, uint32_t prefix, int pass) {
  if (pass == 0) return true;
  const int found = select_shift(pass) + select_bits(pass);
  return (key >> found) == (prefix >> found);
}

// The fixed-point scale of masses: a vocabulary of masses of at most 2^shift sums below 2^63.
JF_HD int mass_shift(int64_t vocab) {
  int bits = 0;
  while ((int64_t(1) << bits) <= vocab) ++bits;
  return 63 - bits;
}

// exp(s - max_s) * 2^shift, truncated (0 for a NaN: a row whose largest score is a NaN or an
// infinity has no masses, and keeps all its top-k scores).
JF_HD uint64_t fixed_mass(float s, float max_s, int shift) {
  const float e = expf(s - max_s);
  return e > 0.0f ? uint64_t(e * float(uint64_t(1) << shift)) : 0;
}

// Top-p's rule for the candidates of a value whose mass above is `above`: kept while above <
// top_p * (the mass of every candidate); the largest value (nothing above) always.
struct NucleusLimit {
  double limit;  // top_p * total mass

  JF_HD bool keeps(uint64_t above) const { return above == 0 || double(above) < limit; }
};

// Top-k: of bins n - 1 down to 0 (counts[j]: the candidates with digit j), the one that holds the
// need-th largest candidate; `need` becomes its rank in that bin. -1 if the bins hold fewer.
JF_HD int walk_count(const uint32_t* counts, int n, uint32_t& need) {
  for (int j = n - 1; j >= 0; --j) {
    if (need <= counts[j]) return j;
    need -= counts[j];
  }
  return -1;
}

// Top-p: of bins n - 1 down to 0 (counts and masses of the candidates by digit), the lowest
// nonempty one whose largest candidate is kept, `above` being the mass of the candidates above
// bin n - 1; `above` becomes the mass above the bin found. -1 (above unchanged) if none is.
JF_HD int walk_mass(const uint32_t* counts, const uint64_t* masses, int n, uint64_t& above,
                    NucleusLimit rule) {
  int found = -1;
  uint64_t at = above, m = above;
  for (int j = n - 1; j >= 0; --j) {
    if (counts[j] == 0) continue;
    if (!rule.keeps(m)) break;
    found = j;
    at = m;
    m += masses[j];
  }
  above = at;
  return found;
}

// Whether a row whose smallest kept key is `floor` (0: no filter) draws from `logit`.
JF_HD bool sample_keeps(const SampleRule& rule, float logit, uint32_t floor) {
  return floor == 0 || order_key(rule.scaled(logit)) >= floor;
}

}  // namespace jaxfuse
