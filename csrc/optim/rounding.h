// How the optimizer op stores 16-bit params without a 4-byte master copy, one definition for the
// host (CPU handlers) and the device (CUDA kernels), so that both store the same bits:
//
// * stochastic rounding: a value is rounded to one of its two 16-bit neighbours with probability
//   proportional to its nearness, so that updates smaller than half an ulp survive on average
//   (Gupta et al., 2015, https://arxiv.org/abs/1502.02551). The random bits come from a
//   counter-based hash of (seed, leaf, shard, step count, element index): no generator state,
//   the same bits on every platform and at every launch configuration.
// * param remainders (TransformerEngine's FusedAdam `store_param_remainders`): bf16 params and
//   the int16 low halves of the fp32 master together are the fp32 master, bit for bit. The
//   param is the master's high half rounded to nearest (ties away from zero), the remainder the
//   signed difference, so that bits(master) = bits(param) * 2^16 + remainder.
#pragma once

#include <cstdint>

#include "core/dtype.h"
#include "core/vector_layout.h"

namespace jaxfuse {

// Murmur3's 32-bit finalizer: a bijection of 32-bit words in which every input bit flips each
// output bit with probability about 1/2.
JF_HD uint32_t mix32(uint32_t h) {
  h ^= h >> 16;
  h *= 0x85ebca6bu;
  h ^= h >> 13;
  h *= 0xc2b2ae35u;
  h ^= h >> 16;
  return h;
}

// One tensor's rounding key, a row of the rounding_keys operand u32[n, RoundingKey::kSize] that
// Python builds by these names: the user's seed, the leaf's place in the params tree and the
// shard's place among the shards of a leaf split over devices (0 when whole).
#define JAXFUSE_ROUNDING_KEY_FIELDS(X) X(seed) X(leaf) X(shard)
JF_DEFINE_VECTOR_LAYOUT(RoundingKey, JAXFUSE_ROUNDING_KEY_FIELDS);

// The stream of one tensor at one step: every word of the key and the step count (the count
// before the step) mixed in turn.
JF_HD uint32_t rounding_stream(const uint32_t* key, int32_t count) {
  uint32_t h = mix32(key[RoundingKey::seed] ^ 0x9e3779b9u);
  h = mix32(h ^ key[RoundingKey::leaf]);
  h = mix32(h ^ key[RoundingKey::shard]);
  return mix32(h ^ static_cast<uint32_t>(count));
}

// The random bits of an element come from its stream and its index in the tensor: the index's
// low word through one multiply and the finalizer (distinct elements of one stream get distinct
// words), its high word, zero below 2^32 elements, folded into the stream (index_word).
JF_HD uint32_t index_word(uint32_t stream, int64_t index) {
  const uint32_t high = static_cast<uint32_t>(static_cast<uint64_t>(index) >> 32);
  return stream ^ (high ? mix32(high) : 0u);
}

JF_HD uint32_t element_bits(uint32_t word, uint32_t low) { return mix32(low * 0x9e3779b1u + word); }

// `x` rounded stochastically to bfloat16, as a float: the 16 bits dropped from the float's
// pattern decide, against 16 random bits, whether its magnitude rounds up. NaN stays NaN.
JF_HD float bf16_stochastic(float x, uint32_t bits) {
  const float rounded = bits_float((float_bits(x) + (bits >> 16)) & 0xffff0000u);
  return x != x ? x : rounded;
}

// `x` rounded stochastically to float16, as a float. Normal halves drop 13 bits of the float's
// pattern, decided as for bfloat16; below the smallest normal half the values are multiples of
// 2^-24, and the fraction of one decides. NaN, Inf and values that round to Inf round to nearest.
JF_HD float f16_stochastic(float x, uint32_t bits) {
  const uint32_t u = float_bits(x);
  const uint32_t sign = u & 0x80000000u;
  const uint32_t a = u & 0x7fffffffu;
  if (a >= 0x477ff000u) return f16_to_float(float_to_f16(x));
  if (a >= 0x38800000u) return bits_float(sign | ((a + (bits >> 19)) & ~0x1fffu));
  const float scaled = bits_float(a) * 16777216.0f;  // in units of 2^-24: exact
  const float whole = floorf(scaled);
  const bool up = float(bits >> 8) * 5.9604644775390625e-8f < scaled - whole;
  return bits_float(sign | float_bits((whole + (up ? 1.0f : 0.0f)) * 5.9604644775390625e-8f));
}

// A compute-type value as the float the 16-bit roundings take: from double, rounded to odd.
JF_HD float as_float_to_round(float x) { return x; }
JF_HD float as_float_to_round(double x) { return float_round_to_odd(x); }

// Values x[0, n) of elements first, first + 1, ... of a tensor's stream rounded stochastically to
// storage dtype `t` (16-bit dtypes; others stay as they are), as values of the compute type that
// the store then keeps exactly (from double via as_float_to_round(), which keeps whether
// anything below the float's last bit was dropped). A run does not cross a multiple of 2^32
// elements (the drivers' groups are aligned to their power-of-two size).
template <typename Real, typename Count>
JF_HD void stochastic_round_run(DType t, uint32_t stream, int64_t first, Count n, Real* x) {
  const uint32_t word = index_word(stream, first);
  const uint32_t low = static_cast<uint32_t>(first);
  if (t == DType::kBF16) {
    for (Count i = 0; i < n; ++i) {
      x[i] = Real(bf16_stochastic(as_float_to_round(x[i]), element_bits(word, low + uint32_t(i))));
    }
  } else if (t == DType::kF16) {
    for (Count i = 0; i < n; ++i) {
      x[i] = Real(f16_stochastic(as_float_to_round(x[i]), element_bits(word, low + uint32_t(i))));
    }
  }
}

// The fp32 master from a bf16 param (as a value) and its remainder (an int16 as a value).
template <typename Real>
JF_HD Real join_remainder(Real param, Real remainder) {
  return Real(bits_float(float_bits(float(param)) + static_cast<uint32_t>(int32_t(remainder))));
}

// The bf16 param (as a value) and the remainder (an int16 as a value) of an fp32 master.
template <typename Real>
JF_HD void split_remainder(Real master, Real& param, Real& remainder) {
  const uint32_t bits = float_bits(float(master));
  const int16_t low = static_cast<int16_t>(bits & 0xffffu);
  param = Real(bits_float(bits - static_cast<uint32_t>(int32_t(low))));
  remainder = Real(low);
}

// The rounding of one step's params: whether it is stochastic, and the step's tensors' keys.
struct ParamRounding {
  const uint32_t* keys = nullptr;  // [num_tensors][RoundingKey::kSize], null: round to nearest
  int32_t count = 0;               // the step count before the step

  JF_HD bool stochastic() const { return keys != nullptr; }
  JF_HD uint32_t stream(int64_t t) const {
    return rounding_stream(keys + t * RoundingKey::kSize, count);
  }
};

}  // namespace jaxfuse
