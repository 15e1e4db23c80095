// Storage dtypes and their conversions to and from the compute types (float, double), one
// definition compiled for the host (CPU handlers) and the device (CUDA kernels). 16-bit values
// are converted with round-to-nearest-even, NaN preserved, so both sides store the same bits.
// Multi-tensor ops compute in float for 16- and 32-bit storage and in double when a tensor of
// the call is stored in float64 (complex types are pairs of their real type).
//
// Rounding note for all jaxfuse math headers: nvcc contracts a*b+c into FMA (faster and more
// accurate); the CPU build does not (-ffp-contract=off), so that it rounds like XLA's CPU code.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#define JF_HD __host__ __device__ __forceinline__
#elif defined(__GNUC__)
// Always inlined on the host too: the CPU's hot loops are compiled once per ISA level
// (JF_CPU_MULTIVERSION), and math left out of line would run at the baseline ISA.
#define JF_HD inline __attribute__((always_inline))
#else
#define JF_HD inline
#endif

namespace jaxfuse {

// Storage types the kernels read and write: floats; int16 words (param remainders, rounding.h),
// int8 / uint8 codes (8-bit moments, moment_codes.h) and int8 / fp8 e4m3 quantized decoder
// weights, which only buffers declared as such hold and which visit_dtype() does not take.
enum class DType : uint8_t {
  kF32 = 0, kBF16 = 1, kF16 = 2, kF64 = 3, kI16 = 4, kI8 = 5, kU8 = 6, kF8E4M3 = 7
};

JF_HD constexpr int dtype_bytes(DType t) {
  return t == DType::kF64 ? 8
         : t == DType::kF32 ? 4
         : (t == DType::kI8 || t == DType::kU8 || t == DType::kF8E4M3) ? 1
                                                                         : 2;
}

// The compute-type rule of the multi-tensor ops: a tensor (or call) computes in double when any
// of its `n` buffers is stored as float64, else in float.
JF_HD bool computes_in_double(const DType* dtypes, int n) {
  for (int k = 0; k < n; ++k) {
    if (dtypes[k] == DType::kF64) return true;
  }
  return false;
}

// Overloads, so that templated math calls the precision of its arguments (a bare sqrt on a float
// may promote to double on the host, which also keeps the CPU loops from vectorizing).
JF_HD float jf_sqrt(float x) { return sqrtf(x); }
JF_HD double jf_sqrt(double x) { return sqrt(x); }

// ---- scalar conversions -------------------------------------------------------------------

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

// float8 e4m3fn (1 sign bit, 4 exponent bits of bias 7, 3 mantissa bits, no infinities) ->
// float, exact for every finite code: a normal code's fields move to float's positions with the
// exponent rebiased by 120; a subnormal one is its mantissa times 2^-9. No float subnormal is
// formed, so flush-to-zero modes do not matter. The two NaN codes (S.1111.111) read as +-480:
// jaxfuse.quantize never writes them. The CPU GEMV's vector form (cpu/decoder_gemv.cc) is this,
// lane-wise.
JF_HD float f8e4m3_to_float(uint8_t code) {
  const uint32_t c = code;
  const float magnitude = (c & 0x78u) != 0 ? bits_float(((c & 0x7fu) << 20) + (120u << 23))
                                           : float(c & 7u) * 0x1p-9f;
  return (c & 0x80u) != 0 ? -magnitude : magnitude;
}

// double -> float rounded to odd (truncated, then the last bit set if anything was dropped): a
// later round-to-nearest-even to a narrower format (bf16: 8 bits, f16: 11) is then correctly
// rounded, as if done from the double directly, without double rounding.
JF_HD float float_round_to_odd(double d) {
  const float f = float(d);
  if (double(f) == d || f != f) return f;  // exact, or NaN
  uint32_t u = float_bits(f);
  if (fabs(double(f)) > fabs(d)) u -= 1;  // rounded away from zero: step back toward it
  return bits_float(u | 1u);
}

// ---- typed storage and dispatch --------------------------------------------------------------

// Storage<kT>: the bits type of dtype kT, load<Real>(bits) and store(Real value), for code
// specialized per dtype. Stores round to nearest even (once, also from double).
template <DType kT>
struct Storage;

template <>
struct Storage<DType::kF32> {
  using Bits = float;
  template <typename Real>
  static JF_HD Real load(float x) { return Real(x); }
  static JF_HD float store(float x) { return x; }
  static JF_HD float store(double x) { return float(x); }
};

template <>
struct Storage<DType::kF64> {
  using Bits = double;
  template <typename Real>
  static JF_HD Real load(double x) { return Real(x); }
  static JF_HD double store(double x) { return x; }
  static JF_HD double store(float x) { return double(x); }
};

template <>
struct Storage<DType::kBF16> {
  using Bits = uint16_t;
  template <typename Real>
  static JF_HD Real load(uint16_t x) { return Real(bf16_to_float(x)); }
  static JF_HD uint16_t store(float x) { return float_to_bf16(x); }
  static JF_HD uint16_t store(double x) { return float_to_bf16(float_round_to_odd(x)); }
};

template <>
struct Storage<DType::kF16> {
  using Bits = uint16_t;
  template <typename Real>
  static JF_HD Real load(uint16_t x) { return Real(f16_to_float(x)); }
  static JF_HD uint16_t store(float x) { return float_to_f16(x); }
  static JF_HD uint16_t store(double x) { return float_to_f16(float_round_to_odd(x)); }
};

// Quantized decoder weights are only read.
template <>
struct Storage<DType::kI8> {
  using Bits = int8_t;
  template <typename Real>
  static JF_HD Real load(int8_t x) { return Real(x); }
};

template <>
struct Storage<DType::kF8E4M3> {
  using Bits = uint8_t;
  template <typename Real>
  static JF_HD Real load(uint8_t x) { return Real(f8e4m3_to_float(x)); }
};

template <DType kT>
struct DTypeTag {
  static constexpr DType value = kT;
  using S = Storage<kT>;
};

// Calls fn(DTypeTag<t>{}) for the 16- and 32-bit storage dtypes (all the decoder takes).
template <typename Fn>
JF_HD decltype(auto) visit_narrow_dtype(DType t, Fn&& fn) {
  switch (t) {
    case DType::kF32: return fn(DTypeTag<DType::kF32>{});
    case DType::kBF16: return fn(DTypeTag<DType::kBF16>{});
    default: return fn(DTypeTag<DType::kF16>{});
  }
}

// Calls fn(DTypeTag<t>{}): the one switch over all storage dtypes; everything that needs
// per-dtype code (vectorizable CPU loops, kernel instantiations) goes through it.
template <typename Fn>
JF_HD decltype(auto) visit_dtype(DType t, Fn&& fn) {
  if (t == DType::kF64) return fn(DTypeTag<DType::kF64>{});
  return visit_narrow_dtype(t, static_cast<Fn&&>(fn));
}

template <typename Real>
JF_HD Real load_value(const void* base, DType t, int64_t i) {
  return visit_dtype(t, [&](auto tag) -> Real {
    using S = typename decltype(tag)::S;
    return S::template load<Real>(static_cast<const typename S::Bits*>(base)[i]);
  });
}

template <typename Real>
JF_HD void store_value(void* base, DType t, int64_t i, Real v) {
  visit_dtype(t, [&](auto tag) {
    using S = typename decltype(tag)::S;
    static_cast<typename S::Bits*>(base)[i] = S::store(v);
  });
}

JF_HD float load_as_float(const void* base, DType t, int64_t i) {
  return load_value<float>(base, t, i);
}
JF_HD void store_from_float(void* base, DType t, int64_t i, float v) {
  store_value<float>(base, t, i, v);
}

// Round-trips a value through storage dtype `t` (what a buffer of that dtype will hold).
template <typename Real>
JF_HD Real round_to(DType t, Real v) {
  return visit_dtype(t, [&](auto tag) -> Real {
    using S = typename decltype(tag)::S;
    return S::template load<Real>(S::store(v));
  });
}

// The address of element i of a buffer of dtype t.
JF_HD const void* element_ptr(const void* base, DType t, int64_t i) {
  return static_cast<const char*>(base) + i * dtype_bytes(t);
}
JF_HD void* element_ptr(void* base, DType t, int64_t i) {
  return static_cast<char*>(base) + i * dtype_bytes(t);
}

// ---- small scalar vectors ---------------------------------------------------------------------
//
// Hyperparameters and gradient-control values reach the kernels as small device vectors, in
// float32, or in float64 under jax_enable_x64 (so float64 math sees exact values). Kernels read
// them as double and round to their compute type once, as optax rounds a Python float to the
// leaf's dtype.
struct ScalarVector {
  const void* data = nullptr;
  bool f64 = false;

  JF_HD double operator[](int i) const {
    return f64 ? static_cast<const double*>(data)[i] : double(static_cast<const float*>(data)[i]);
  }
};

// A vector (or scalar) the kernels write, float32 or float64.
struct ScalarVectorOut {
  void* data = nullptr;
  bool f64 = false;

  // `v` as this vector's dtype holds it.
  JF_HD double round(double v) const { return f64 ? v : double(float(v)); }
  JF_HD void set(int i, double v) const {
    if (f64) {
      static_cast<double*>(data)[i] = v;
    } else {
      static_cast<float*>(data)[i] = float(v);
    }
  }
};

}  // namespace jaxfuse
