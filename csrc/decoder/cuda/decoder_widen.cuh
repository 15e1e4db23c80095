// The CUDA decoder's 8-bit weights widened without the conversion unit (included by
// decoder_common.cuh): as bf16 pairs for the tensor cores (the GEMV under bf16 and fp16
// activations, the LM head under bf16), and as fp32 for the FMA GEMV (fp32 activations) and the FMA
// head (fp32 and fp16). bf16 holds every int8 and fp8 e4m3 value exactly; a pair of codes is
// widened by a shift, two logic ops and one bf16x2 fma. Widening each code through an I2F on the
// quarter-rate conversion unit (and fp8's select between a normal and a subnormal form) made the
// 8-bit GEMVs issue-bound: at batch 1 their instructions, not their bytes, set the stages' time.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "core/dtype.h"

namespace jaxfuse::cuda_decoder {

// d = a * b + c on two bf16 lanes, rounded once to nearest even; subnormal operands are kept
// (no .ftz form exists for bf16). The emulator computes each lane in double from the bits (exact
// for the operands below, and immune to the flush-to-zero modes XLA's CPU threads run in).
__device__ __forceinline__ uint32_t fma_bf16x2(uint32_t a, uint32_t b, uint32_t c) {
#if defined(__CUDA_ARCH__)
  uint32_t d;
  asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
  return d;
#else
  const auto value = [](uint32_t bits) {
    const int e = int(bits >> 7 & 0xffu), m = int(bits & 0x7fu);
    double v = e == 0 ? std::ldexp(double(m), -133) : std::ldexp(double(128 + m), e - 134);
    if (e == 0xff) v = m ? NAN : INFINITY;
    return bits & 0x8000u ? -v : v;
  };
  const auto round = [](double v) -> uint32_t {
    const uint32_t sign = std::signbit(v) ? 0x8000u : 0u;
    v = std::fabs(v);
    if (std::isnan(v)) return 0x7fc0u;
    if (v == 0.0) return sign;
    int e;
    std::frexp(v, &e);  // v = f 2^e, f in [0.5, 1): 8 significant bits are units of 2^(e - 8)
    const int unit = std::max(e - 8, -133);  // below 2^-126 the units of a subnormal, 2^-133
    const double q = std::nearbyint(std::ldexp(v, -unit));  // round to nearest even
    if (unit == -133 && q < 128) return sign | uint32_t(q);
    // q in [128, 256] units of 2^unit: a normal (256: the next binade's 128).
    const int biased = unit + 134 + (q == 256 ? 1 : 0);
    if (biased >= 0xff) return sign | 0x7f80u;
    return sign | uint32_t(biased) << 7 | (uint32_t(q == 256 ? 128 : q) - 128);
  };
  uint32_t d = 0;
  for (int h = 0; h < 2; ++h) {
    const auto lane = [&](uint32_t x) { return x >> 16 * h & 0xffffu; };
    d |= round(value(lane(a)) * value(lane(b)) + value(lane(c))) << 16 * h;
  }
  return d;
#endif
}

// (a & b) | c as one instruction: nvcc splits a pair of constants b, c into an AND and an OR.
__device__ __forceinline__ uint32_t and_or(uint32_t a, uint32_t b, uint32_t c) {
#if defined(__CUDA_ARCH__)
  uint32_t d;
  asm("lop3.b32 %0, %1, %2, %3, 0xea;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
  return d;
#else
  return (a & b) | c;
#endif
}

// The 8-bit codes in bytes 1 and 3 of t (the high byte of each half; bytes 0 and 2 are ignored)
// as a bf16 pair, byte 1's in the low half.
//   int8:  c = (c & 127) - 128 s (s its sign bit). 0x4300 | (c & 127) is the bf16 of
//          128 + (c & 127), and 0xc300 | s << 7 that of -(128 + 128 s): their sum is c.
//   fp8:   code s.eeee.mmm. Its bits placed as a bf16's sign and low exponent and mantissa bits
//          are +-2^(e - 127) 1.m (e > 0), or the subnormal +-m 2^-129 (e = 0): times 2^120 that
//          is the code's value. The two NaN codes (S.1111.111) read as +-480, as
//          f8e4m3_to_float reads them.
// Every product and sum is exact, so the one rounding changes nothing.
template <DType kW>
__device__ __forceinline__ uint32_t widen_pair(uint32_t t) {
  static_assert(kW == DType::kI8 || kW == DType::kF8E4M3, "8-bit weights only");
  if constexpr (kW == DType::kI8) {
    const uint32_t low = and_or(t >> 8, 0x007f007fu, 0x43004300u);
    const uint32_t high = and_or(t >> 8, 0x00800080u, 0xc300c300u);
    return fma_bf16x2(low, 0x3f803f80u, high);  // low * 1 + high
  } else {
    const uint32_t bits = (t >> 4 & 0x07f007f0u) | (t & 0x80008000u);
    return fma_bf16x2(bits, 0x7b807b80u, 0x80008000u);  // * 2^120 + -0 (keeps a zero's sign)
  }
}

// The codes [c0, c2, c1, c3] (bytes 0-3 of u, as one byte permute gathers them) as the bf16 pairs
// (c0, c1) and (c2, c3): the first pair is in bytes 1 and 3 of u shifted by a byte.
template <DType kW>
__device__ __forceinline__ void widen_pairs(uint32_t u, uint32_t& first, uint32_t& second) {
  first = widen_pair<kW>(u << 8);
  second = widen_pair<kW>(u);
}

// The GEMV's A fragments: codes `byte` (0 or 2) and byte + 1 of the words wa, wb of two rows as
// the pairs (wa's, wb's) of each.
template <DType kW>
__device__ __forceinline__ void widen_rows(uint32_t wa, uint32_t wb, int byte, uint32_t& first,
                                           uint32_t& second) {
  widen_pairs<kW>(__byte_perm(wa, wb, byte == 0 ? 0x5410u : 0x7632u), first, second);
}

// The LM head's A fragments: a word's four k-consecutive codes as the pairs (0, 1) and (2, 3).
template <DType kW>
__device__ __forceinline__ void widen_word(uint32_t w, uint32_t& first, uint32_t& second) {
  widen_pairs<kW>(__byte_perm(w, w, 0x3120u), first, second);
}

// The four codes of w (byte i in o[i]) as fp32, exactly.
//   int8:  byte i of w ^ 0x80808080 is c + 128; as the low byte of the float 2^23 (0x4b000000) it
//          makes 2^23 + 128 + c, from which one subtraction leaves c.
//   fp8:   widen_word's bf16 pairs; a bf16 is a float's high half.
template <DType kW>
__device__ __forceinline__ void widen_floats(uint32_t w, float* o) {
  if constexpr (kW == DType::kI8) {
    const uint32_t biased = w ^ 0x80808080u;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      o[i] = __uint_as_float(__byte_perm(biased, 0x4b000000u, 0x7650u + i)) - 8388736.0f;
    }
  } else {
    uint32_t first, second;
    widen_word<kW>(w, first, second);
    o[0] = __uint_as_float(first << 16);
    o[1] = __uint_as_float(first & 0xffff0000u);
    o[2] = __uint_as_float(second << 16);
    o[3] = __uint_as_float(second & 0xffff0000u);
  }
}

}  // namespace jaxfuse::cuda_decoder
