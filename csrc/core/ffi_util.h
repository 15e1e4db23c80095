// Helpers shared by every XLA FFI handler: dtype mapping and error construction. Errors carry
// no op name: the op's handler (op.h) prefixes it once.
#pragma once

#include <cstdint>
#include <optional>
#include <sstream>
#include <string>
#include <utility>

#include "core/dtype.h"
#include "xla/ffi/api/ffi.h"

namespace jaxfuse {

namespace ffi = xla::ffi;

// The 16- and 32-bit float dtypes (the decoder's).
inline std::optional<DType> to_dtype(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::F32: return DType::kF32;
    case ffi::DataType::BF16: return DType::kBF16;
    case ffi::DataType::F16: return DType::kF16;
    default: return std::nullopt;
  }
}

// How the multi-tensor ops see a buffer's elements: a real storage dtype, and whether they are
// complex, i.e. (real, imaginary) pairs of it (complex64: float32 pairs, complex128: float64).
struct ElementType {
  DType dtype;
  bool complex;
};

inline std::optional<ElementType> element_type(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::F64: return ElementType{DType::kF64, false};
    case ffi::DataType::C64: return ElementType{DType::kF32, true};
    case ffi::DataType::C128: return ElementType{DType::kF64, true};
    default: break;
  }
  if (const auto d = to_dtype(t)) return ElementType{*d, false};
  return std::nullopt;
}

inline const char* dtype_name(DType t) {
  constexpr const char* kNames[] = {"float32", "bfloat16", "float16", "float64", "int16",
                                     "int8",    "uint8",    "float8_e4m3fn"};
  return kNames[static_cast<int>(t)];
}

template <typename... Parts>
std::string str_cat(Parts&&... parts) {
  std::ostringstream os;
  (os << ... << std::forward<Parts>(parts));
  return os.str();
}

template <typename... Parts>
ffi::Error invalid_argument(Parts&&... parts) {
  return ffi::Error::InvalidArgument(str_cat(std::forward<Parts>(parts)...));
}

template <typename... Parts>
ffi::Error internal_error(Parts&&... parts) {
  return ffi::Error::Internal(str_cat(std::forward<Parts>(parts)...));
}

#define JF_RETURN_IF_ERROR(expr)                 \
  do {                                           \
    ::xla::ffi::Error jf_err_ = (expr);          \
    if (jf_err_.failure()) return jf_err_;       \
  } while (0)

// The same in a function returning ffi::ErrorOr<T>.
#define JF_RETURN_UNEXPECTED_IF_ERROR(expr)                                                 \
  do {                                                                                      \
    ::xla::ffi::Error jf_err_ = (expr);                                                     \
    if (jf_err_.failure()) return ::xla::ffi::Unexpected<::xla::ffi::Error>(std::move(jf_err_)); \
  } while (0)

}  // namespace jaxfuse
