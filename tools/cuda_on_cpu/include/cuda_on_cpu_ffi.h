// CUDA on the CPU: the XLA FFI platform stream. The emulated handlers are registered for XLA's
// CPU platform, which has no GPU stream to hand out; they get the default stream (nullptr), and
// every launch runs synchronously on it.
#pragma once

#include <cuda_runtime.h>

#include "xla/ffi/api/ffi.h"

template <>
struct xla::ffi::CtxDecoding<xla::ffi::PlatformStream<cudaStream_t>> {
  using Type = cudaStream_t;
  static std::optional<Type> Decode(const XLA_FFI_Api*, XLA_FFI_ExecutionContext*,
                                    DiagnosticEngine&) {
    return Type{nullptr};
  }
};
