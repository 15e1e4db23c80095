// 8-bit optimizer moments, quantized block-wise (Dettmers et al., 2022, "8-bit Optimizers via
// Block-wise Quantization", https://arxiv.org/abs/2110.02861), one definition for the host (CPU
// handlers) and the device (CUDA kernels), so that both store the same bits;
// jaxfuse/_optim/moments.py is its XLA twin.
//
// Each block of kBlockElements consecutive elements of a moment keeps a float32 scale, the
// block's largest magnitude over the format's largest value, and one byte per element: an 8-bit
// float of that element over the scale, rounded to nearest (ties to even). The formats have 4
// exponent bits (binades 2^-14 .. 2^0, then subnormals), like fp8 but without NaN or Inf codes:
//  * signed moments (Adam's mu): sign, 4 exponent bits, 3 mantissa bits (E4M3), int8 buffers;
//  * non-negative moments (Adam's nu): 4 exponent bits, 4 mantissa bits (E4M4), uint8 buffers.
//    A positive value never becomes 0: the smallest code stands in for anything below it, so
//    that the update m / (sqrt(v) + eps) of an element with a tiny second moment is made smaller,
//    never divided by eps alone (the failure of zero codes in v: Li et al., 2023,
//    https://arxiv.org/abs/2309.01507).
// Floats keep the relative error below 2^-4 (signed) and 2^-5 (non-negative) over 14 binades
// below the block's largest value, where a linear map loses the small values of a block.
#pragma once

#include <cmath>
#include <cstdint>

#include "core/dtype.h"
#include "optim/tensor_lists.h"

namespace jaxfuse {

inline constexpr int kMomentBlock = kBlockElements;

// The code formats by their buffers' dtype: int8 signed (E4M3), uint8 non-negative (E4M4).
JF_HD int moment_mantissa_bits(bool is_signed) { return is_signed ? 3 : 4; }
// The largest magnitude of a format, 2 - 2^-mantissa_bits: what a block's scale maps its largest
// magnitude to.
JF_HD float moment_top(bool is_signed) { return is_signed ? 1.875f : 1.9375f; }

// A magnitude in [0, top] as its code (RNE): below 2^-14 a multiple of 2^-(14 + m) (an exact
// power-of-two scaling, then rint), above it the float's pattern rounded to m mantissa bits,
// its exponent rebased so that 2^-14 is code 1 << m. Both are computed and one is picked, through
// int32 (below 2^20), so that the CPU's loops vectorize.
JF_HD uint32_t encode_magnitude(float a, int m) {
  const float units = rintf(a * float(1 << (14 + m)));
  const uint32_t subnormal = static_cast<uint32_t>(static_cast<int32_t>(units));
  const int shift = 23 - m;
  uint32_t b = float_bits(a);
  b += ((1u << (shift - 1)) - 1u) + ((b >> shift) & 1u);
  const uint32_t normal = (b >> shift) - (112u << m);
  return a < 0x1p-14f ? subnormal : normal;
}

JF_HD float decode_magnitude(uint32_t code, int m) {
  const float subnormal = float(static_cast<int32_t>(code)) * (1.0f / float(1 << (14 + m)));
  const float normal = bits_float((code + (112u << m)) << (23 - m));
  return code < (1u << m) ? subnormal : normal;
}

// A block's largest magnitude is the largest of its elements' magnitude_bits(): non-negative
// floats order as their bit patterns, and NaNs above Inf, so that an integer maximum (which
// vectorizes, and is exact in any order) finds it, and a NaN when the block holds one.
JF_HD uint32_t magnitude_bits(float x) { return float_bits(x) & 0x7fffffffu; }

// The scale of a block from the largest magnitude_bits() of its elements: that magnitude times
// 1 / top rounded to float (XLA turns a division by a constant into this product, so the twin
// computes it so too); the canonical NaN for a block with a NaN, which then decodes to NaN.
JF_HD float moment_scale(uint32_t max_magnitude_bits, bool is_signed) {
  if (max_magnitude_bits > 0x7f800000u) return bits_float(0x7fc00000u);
  return bits_float(max_magnitude_bits) * (1.0f / moment_top(is_signed));
}

// The code of x (in the low byte; 32 bits wide, so that the CPU's loop over floats vectorizes)
// in a block whose scale has the inverse `inverse` (1.0f / scale: XLA divides by a broadcast
// value so, and a product rounds alike everywhere). |x| * inverse is at most top up to rounding
// (clamped); 0 * Inf and the NaNs of non-finite blocks give code 0.
JF_HD uint32_t encode_moment(float x, float inverse, bool is_signed) {
  const float top = moment_top(is_signed);
  float a = fabsf(x) * inverse;
  a = a <= top ? a : (a != a ? 0.0f : top);
  const uint32_t c = encode_magnitude(a, moment_mantissa_bits(is_signed));
  if (is_signed) return c | ((float_bits(x) >> 24) & 0x80u);  // x's sign bit
  return c | uint32_t(c == 0u && x > 0.0f);
}

JF_HD float decode_moment(uint8_t code, float scale, bool is_signed) {
  // One path for both formats (the GPU reads the format at run time): the sign bit, if any,
  // masked off and applied after the scaling (exact, whichever the rounding).
  const uint32_t sign = is_signed ? code & 0x80u : 0u;
  const float v = decode_magnitude(code & ~sign, moment_mantissa_bits(is_signed)) * scale;
  return sign ? -v : v;
}

}  // namespace jaxfuse
