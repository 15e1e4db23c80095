// Element math of jaxfuse_decoder (the persistent Llama-style decode step), one definition
// compiled for the host (CPU handler) and the device (CUDA kernel), so the CPU tests in CI check
// the arithmetic the GPU runs. The reference in jaxfuse/_decode/reference.py follows the same
// formulas and operation order (all in fp32).
#pragma once

#include <cmath>
#include <cstdint>

#include "core/dtype.h"

namespace jaxfuse {

// ---- RMSNorm --------------------------------------------------------------------------------
// rmsnorm(h) * w = (h * rsqrt(mean(h^2) + eps)) * w. `sum_sq` is sum(h^2) over the row.
JF_HD float rms_inv(float sum_sq, int64_t n, float eps) {
  const float mean = sum_sq / float(n);
#if defined(__CUDA_ARCH__)
  return 1.0f / sqrtf(mean + eps);  // IEEE sqrt and division, not the approximate rsqrtf
#else
  return 1.0f / std::sqrt(mean + eps);
#endif
}

JF_HD float rms_apply(float h, float inv_rms, float weight) { return (h * inv_rms) * weight; }

// ---- RoPE (Llama "rotate half") ---------------------------------------------------------------
// inv_freq[i] for i < hd/2 is the operand rope_inv_freq: theta^(-2i/hd) with the config's scaling
// rule, computed once in float64 by Python (DecoderConfig.rope_inv_freq) and rounded to fp32, so
// the kernels and the reference read bit-identical frequencies. The angle is the fp32 product
// p * inv_freq[i], as in Llama's reference code.
JF_HD float rope_angle(int32_t position, float inv_freq) { return float(position) * inv_freq; }

// Rotates the pair (x[i], x[i + hd/2]) by the angle: (x1 c - x2 s, x2 c + x1 s).
JF_HD void rope_rotate(float& x1, float& x2, float cos_a, float sin_a) {
  const float a = x1 * cos_a - x2 * sin_a;
  const float b = x2 * cos_a + x1 * sin_a;
  x1 = a;
  x2 = b;
}

JF_HD void rope_cos_sin(float angle, float* cos_a, float* sin_a) {
#if defined(__CUDA_ARCH__)
  sincosf(angle, sin_a, cos_a);  // full-range accurate version (no --use_fast_math)
#else
  *cos_a = std::cos(angle);
  *sin_a = std::sin(angle);
#endif
}

// ---- SwiGLU -----------------------------------------------------------------------------------
JF_HD float exp_f32(float x) {
#if defined(__CUDA_ARCH__)
  return expf(x);
#else
  return std::exp(x);
#endif
}

// silu(g) * u with silu(g) = g * sigmoid(g) = g / (1 + exp(-g)).
JF_HD float swiglu(float g, float u) { return (g / (1.0f + exp_f32(-g))) * u; }

// ---- softmax (online, flash-decoding style) ---------------------------------------------------
// Running state over scores seen so far: m = max score, l = sum exp(score - m); the output
// accumulator o = sum exp(score - m) * v is kept by the caller and rescaled by `alpha`.
JF_HD float neg_inf_f32() { return -INFINITY; }

// Folds one score in: returns alpha (rescale of the old accumulator) and *p (weight of the new
// value); updates m and l.
JF_HD float online_softmax_step(float& m, float& l, float score, float* p) {
  const float m_new = fmaxf(m, score);
  const float alpha = m == neg_inf_f32() ? 0.0f : exp_f32(m - m_new);
  *p = exp_f32(score - m_new);
  l = l * alpha + *p;
  m = m_new;
  return alpha;
}

// Merges state (m2, l2) into (m, l): the caller rescales its accumulators by *a (old) and *b
// (incoming) and adds. Empty states have m = -inf, l = 0.
JF_HD void online_softmax_merge(float& m, float& l, float m2, float l2, float* a, float* b) {
  const float m_new = fmaxf(m, m2);
  if (m_new == neg_inf_f32()) {  // both empty
    *a = 1.0f;
    *b = 0.0f;
    return;
  }
  *a = m == neg_inf_f32() ? 0.0f : exp_f32(m - m_new);
  *b = m2 == neg_inf_f32() ? 0.0f : exp_f32(m2 - m_new);
  l = l * *a + l2 * *b;
  m = m_new;
}

JF_HD float quiet_nan_f32() { return bits_float(0x7fc00000u); }

// Whether a decode position may be used (else: cache untouched, output row NaN).
JF_HD bool position_valid(int32_t p, int64_t max_seq_len) {
  return p >= 0 && int64_t(p) < max_seq_len;
}

}  // namespace jaxfuse
