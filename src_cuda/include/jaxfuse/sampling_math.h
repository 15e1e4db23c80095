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

#include "jaxfuse/dtype.h"

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

// The score row b's candidate n competes with: greedy takes the logit itself, sampling the
// logit over the temperature plus the Gumbel noise of element b * vocab + n.
struct SampleRule {
  bool greedy;
  float temperature;
  uint32_t k0, k1;  // the key's data (jax.random.key_data)

  JF_HD float score(float logit, int64_t b, int64_t n, int64_t vocab) const {
    if (greedy) return logit;
    const float g = gumbel_from_bits(threefry_bits(k0, k1, uint64_t(b * vocab + n)));
    return g + logit / temperature;
  }
};

// ---- argmax as a max of 64-bit keys ----------------------------------------------------------

// Candidate n with score v: larger keys win; equal scores go to the lower index; a NaN beats
// every number (the first NaN wins, as in jnp.argmax).
JF_HD uint64_t argmax_key(float v, uint32_t n) {
  uint32_t order;
  if (v != v) {
    order = 0xffffffffu;
  } else {
    const uint32_t bits = float_bits(v == 0.0f ? 0.0f : v);  // -0 ties +0
    order = (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
  }
  return (uint64_t(order) << 32) | uint64_t(0xffffffffu - n);
}

// The index a winning key names.
JF_HD int32_t argmax_index(uint64_t key) { return int32_t(0xffffffffu - uint32_t(key)); }

}  // namespace jaxfuse
