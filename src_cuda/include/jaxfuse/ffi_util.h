// Helpers shared by every XLA FFI handler: dtype mapping and error construction. Errors carry
// no op name: the op's handler (op.h) prefixes it once.
#pragma once

#include <cstdint>
#include <optional>
#include <sstream>
#include <string>
#include <utility>

#include "jaxfuse/dtype.h"
#include "xla/ffi/api/ffi.h"

namespace jaxfuse {

namespace ffi = xla::ffi;

inline std::optional<DType> to_dtype(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::F32: return DType::kF32;
    case ffi::DataType::BF16: return DType::kBF16;
    case ffi::DataType::F16: return DType::kF16;
    default: return std::nullopt;
  }
}

inline const char* dtype_name(DType t) {
  constexpr const char* kNames[] = {"float32", "bfloat16", "float16"};
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

}  // namespace jaxfuse
