// One definition of jaxfuse's element math, compiled for the host (CPU handlers) and the device
// (CUDA kernels), so that the CPU tests in CI check the arithmetic the GPU runs. The one
// difference is rounding: nvcc contracts a*b+c into FMA (faster, and more accurate); the CPU
// build does not, so that it rounds like XLA's CPU code.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#define JF_HD __host__ __device__ __forceinline__
#else
#define JF_HD inline
#endif

namespace jaxfuse {

// Floating-point storage types the kernels read and write. Arithmetic is always fp32.
enum class DType : uint8_t { kF32 = 0, kBF16 = 1, kF16 = 2 };

JF_HD int dtype_bytes(DType t) { return t == DType::kF32 ? 4 : 2; }

// ---- scalar conversions (round to nearest even, NaN preserved) ----------------------------

JF_HD uint32_t float_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
#endif
}

JF_HD float bits_float(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, 4);
  return f;
#endif
}

JF_HD float bf16_to_float(uint16_t h) { return bits_float(uint32_t(h) << 16); }

JF_HD uint16_t float_to_bf16(float f) {
#if defined(__CUDA_ARCH__)
  __nv_bfloat16 b = __float2bfloat16_rn(f);
  return *reinterpret_cast<uint16_t*>(&b);
#else
  uint32_t u = float_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40u);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
#endif
}

JF_HD float f16_to_float(uint16_t h) {
#if defined(__CUDA_ARCH__)
  return __half2float(*reinterpret_cast<const __half*>(&h));
#else
  const uint32_t sign = uint32_t(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t man = h & 0x3ffu;
  if (exp == 0x1fu) return bits_float(sign | 0x7f800000u | (man << 13));  // inf / nan
  if (exp == 0) {
    if (man == 0) return bits_float(sign);
    // Subnormal half: value = man * 2^-24, exact in fp32.
    float v = float(man) * 5.9604644775390625e-8f;
    return sign ? -v : v;
  }
  return bits_float(sign | ((exp + 112u) << 23) | (man << 13));
#endif
}

JF_HD uint16_t float_to_f16(float f) {
#if defined(__CUDA_ARCH__)
  __half h = __float2half_rn(f);
  return *reinterpret_cast<uint16_t*>(&h);
#else
  const uint32_t u = float_bits(f);
  const uint16_t sign = uint16_t((u >> 16) & 0x8000u);
  const uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return uint16_t(sign | 0x7e00u | ((a >> 13) & 0x3ffu));  // NaN
  if (a >= 0x477ff000u) return uint16_t(sign | 0x7c00u);  // rounds to >= 65520: inf
  if (a < 0x38800000u) {
    // Result is subnormal (or zero) in fp16: round |f| * 2^24 to an integer, nearest even.
    // Adding 0.5 (2^-1) forces rounding at the right bit; the float add rounds to even.
    float v = bits_float(a) + 0.5f;
    return uint16_t(sign | uint16_t(float_bits(v) - 0x3f000000u));
  }
  // Normal: rebias exponent, round mantissa 23 -> 10 bits to nearest even.
  uint32_t r = a + 0xc8000fffu + ((a >> 13) & 1u);  // 0xc8000000 == (15 - 127) << 23
  return uint16_t(sign | uint16_t(r >> 13));
#endif
}

JF_HD float load_as_float(const void* base, DType t, int64_t i) {
  switch (t) {
    case DType::kF32: return static_cast<const float*>(base)[i];
    case DType::kBF16: return bf16_to_float(static_cast<const uint16_t*>(base)[i]);
    default: return f16_to_float(static_cast<const uint16_t*>(base)[i]);
  }
}

JF_HD void store_from_float(void* base, DType t, int64_t i, float v) {
  switch (t) {
    case DType::kF32: static_cast<float*>(base)[i] = v; break;
    case DType::kBF16: static_cast<uint16_t*>(base)[i] = float_to_bf16(v); break;
    default: static_cast<uint16_t*>(base)[i] = float_to_f16(v); break;
  }
}

// Round-trips an fp32 value through storage dtype `t` (what a buffer of that dtype will hold).
JF_HD float round_to(DType t, float v) {
  switch (t) {
    case DType::kF32: return v;
    case DType::kBF16: return bf16_to_float(float_to_bf16(v));
    default: return f16_to_float(float_to_f16(v));
  }
}

// ---- Adam / AdamW ------------------------------------------------------------------------
//
// The hyperparameter vector, a f32[kAdamHyperSize] device buffer built in JAX (so schedules,
// inject_hyperparams and traced values all work without recompiling). The (1 - b) terms are
// computed by the caller the way optax computes them, so that rounding matches optax.
enum AdamHyper : int {
  kLr = 0,
  kB1,
  kOneMinusB1,
  kB2,
  kOneMinusB2,
  kEps,
  kEpsRoot,
  kWeightDecay,
  kAdamHyperSize
};

// The gradient-control vector, a f32[kGradCtrlSize] device buffer, written by the global-norm
// kernel (or built in JAX): g_used = ((g / loss_scale) / clip_div) * clip_mul, and the whole
// step is skipped (state untouched, count not advanced) when skip != 0.
enum GradCtrl : int { kLossScale = 0, kClipDiv, kClipMul, kSkip, kGradCtrlSize };

// How an op sees the gradients, from the gradient-control vector: unscaled by the loss scale,
// then clipped the way optax's clip_by_global_norm does it, (g / norm) * max_norm.
struct GradScaling {
  float loss_scale, clip_div, clip_mul;
  bool scale;  // loss_scale != 1
  bool clip;   // clipping active
  bool skip;   // skip the whole step

  JF_HD float apply(float g) const {
    if (scale) g = g / loss_scale;
    if (clip) g = (g / clip_div) * clip_mul;
    return g;
  }
};

JF_HD GradScaling make_grad_scaling(const float* ctrl) {
  GradScaling s;
  s.loss_scale = ctrl[kLossScale];
  s.clip_div = ctrl[kClipDiv];
  s.clip_mul = ctrl[kClipMul];
  s.scale = s.loss_scale != 1.0f;
  s.clip = s.clip_div != 1.0f || s.clip_mul != 1.0f;
  s.skip = ctrl[kSkip] != 0.0f;
  return s;
}

// Per-step scalars, resolved once per thread block (GPU) or per call (CPU).
struct AdamStep {
  float lr, b1, one_minus_b1, b2, one_minus_b2, eps, eps_root, weight_decay;
  float bc1;       // 1 - b1^t
  float bc1_next;  // 1 - b1^(t+1), for nesterov
  float bc2;       // 1 - b2^t
  GradScaling grad;
  bool nesterov;
};

// optax.safe_increment on an int32 count: saturates at INT32_MAX.
JF_HD int32_t safe_increment(int32_t count) { return count < INT32_MAX ? count + 1 : count; }

// Resolve the per-step scalars. `count` is the state count *before* this step (optax increments
// first, then bias-corrects with the new count).
JF_HD AdamStep make_adam_step(const float* hyper, const float* ctrl, int32_t count, bool nesterov) {
  AdamStep s;
  s.lr = hyper[kLr];
  s.b1 = hyper[kB1];
  s.one_minus_b1 = hyper[kOneMinusB1];
  s.b2 = hyper[kB2];
  s.one_minus_b2 = hyper[kOneMinusB2];
  s.eps = hyper[kEps];
  s.eps_root = hyper[kEpsRoot];
  s.weight_decay = hyper[kWeightDecay];
  const int32_t t = safe_increment(count);
  // optax: bias_correction = 1 - decay ** count, computed in fp32.
  s.bc1 = 1.0f - powf(s.b1, float(t));
  s.bc1_next = 1.0f - powf(s.b1, float(safe_increment(t)));
  s.bc2 = 1.0f - powf(s.b2, float(t));
  s.grad = make_grad_scaling(ctrl);
  s.nesterov = nesterov;
  return s;
}

// The count written back: advanced unless the step is skipped.
JF_HD int32_t adam_next_count(int32_t count, bool skip) { return skip ? count : safe_increment(count); }

// One element of optax.adamw: scale_by_adam -> add_decayed_weights -> scale_by_learning_rate,
// with optax's operation order. Updates m and v in place (fp32) and returns the update
// u = -lr * (m_hat / (sqrt(v_hat + eps_root) + eps) + wd * p).
JF_HD float adam_element(const AdamStep& s, float g, float p, bool decay, float& m, float& v) {
  m = s.one_minus_b1 * g + s.b1 * m;
  v = s.one_minus_b2 * (g * g) + s.b2 * v;
  float m_hat;
  if (s.nesterov) {
    m_hat = s.b1 * (m / s.bc1_next) + s.one_minus_b1 * (g / s.bc1);
  } else {
    m_hat = m / s.bc1;
  }
  const float v_hat = v / s.bc2;
  float u = m_hat / (sqrtf(v_hat + s.eps_root) + s.eps);
  if (decay) u = u + s.weight_decay * p;
  return u * -s.lr;
}

// ---- global norm and clipping ---------------------------------------------------------------
//
// Stage 1 (multi-tensor) writes one partial per block / chunk: the fp32 sum of squares and a
// non-finite marker (the sum of x - x, which is 0 for finite x and NaN otherwise, so it needs
// no branch and vectorizes). Stage 2 sums the partials in a fixed order and calls this.

// Operands of the norm op: f32[kNormParamsSize].
enum NormParams : int { kNormLossScale = 0, kNormMaxNorm, kNormParamsSize };

// From the total sum of squares of the raw (loss-scaled) gradients: the global norm of the
// unscaled gradients, and the gradient-control vector for the consumers. Clipping follows
// optax: unchanged when norm < max_norm (a NaN norm clips, spreading the NaN, as optax does);
// `clip_enabled` false turns it off. `clip_apply_loss_scale` false leaves the loss scale in the
// gradients (for a transform whose consumer unscales them later).
JF_HD void finish_norm(float sumsq, float nonfinite_marker, const float* params, bool clip_enabled,
                       bool skip_nonfinite, bool clip_apply_loss_scale, float* norm_out,
                       float* ctrl) {
  const float loss_scale = params[kNormLossScale];
  const float max_norm = params[kNormMaxNorm];
  const float norm = sqrtf(sumsq) / loss_scale;
  *norm_out = norm;
  const bool nonfinite = nonfinite_marker != 0.0f;  // NaN compares unequal to 0: true
  const bool clip = clip_enabled && !(norm < max_norm);
  ctrl[kLossScale] = clip_apply_loss_scale ? loss_scale : 1.0f;
  ctrl[kClipDiv] = clip ? norm : 1.0f;
  ctrl[kClipMul] = clip ? max_norm : 1.0f;
  ctrl[kSkip] = (skip_nonfinite && nonfinite) ? 1.0f : 0.0f;
}

}  // namespace jaxfuse
