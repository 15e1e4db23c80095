// CUDA on the CPU: the asynchronous-copy primitives of CUDA's <cuda_pipeline_primitives.h>
// (cp.async on sm_80+), run by the emulator (emu.cc, cuemu::async_copy) per thread.
#pragma once

#include <cuda_runtime.h>

inline void __pipeline_memcpy_async(void* dst, const void* src, size_t size_and_align,
                                    size_t zfill = 0) {
  cuemu::async_copy(dst, src, size_and_align, zfill);
}
inline void __pipeline_commit() { cuemu::async_commit(); }
inline void __pipeline_wait_prior(size_t prior) { cuemu::async_wait_prior(prior); }
