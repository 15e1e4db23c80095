// What every CUDA handler shares: the platform (op.h), kernel launches and CUDA error
// handling, the occupancy-sized grid, and the block reduction.
//
// Every launch goes through launch_kernel() (the type-safe cudaLaunchKernelEx), which returns
// this launch's own error code. Nothing reads the thread's last-error slot: it may hold an error
// of an unrelated earlier call. A failed runtime call is reported once and then cleared from the
// slot, so it cannot resurface in a later call (sticky errors, a device fault, stay sticky: the
// CUDA context is unusable after one). tools/cuda_on_cpu runs these same call sites against its
// CPU implementation of the runtime API.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <utility>

#include "jaxfuse/op.h"
#include "kernel_budget.cuh"

namespace jaxfuse {

// The CUDA platform of op.h: handlers enqueue work on XLA's stream and never synchronize or
// allocate, so XLA may capture them into command buffers (CUDA graphs).
struct Cuda {
  using Context = ffi::PlatformStream<cudaStream_t>;
  using Arg = cudaStream_t;
  static constexpr bool kCommandBufferCompatible = true;
};

// Lowest NVIDIA driver branch for a CUDA major version (CUDA minor-version compatibility).
inline int min_driver_branch(int cuda_major) { return cuda_major >= 13 ? 580 : 525; }

struct CudaVersions {
  int runtime = CUDART_VERSION;  // the toolkit jaxfuse was built with, e.g. 13000 for 13.0
  int driver = 0;                // the newest CUDA the installed driver supports; 0: no driver
};

inline CudaVersions cuda_versions() {
  CudaVersions v;
  if (cudaDriverGetVersion(&v.driver) != cudaSuccess) v.driver = 0;
  return v;
}

// Why the driver cannot run these kernels, or "" when it can.
inline std::string driver_problem(const CudaVersions& v) {
  const int need = v.runtime / 1000;
  if (v.driver == 0) return "no NVIDIA driver found";
  if (v.driver / 1000 < need) {
    return str_cat("the NVIDIA driver supports CUDA ", v.driver / 1000, ".", v.driver % 1000 / 10,
                   " but jaxfuse's CUDA kernels were built with CUDA ", need, ".",
                   v.runtime % 1000 / 10, ": install driver ", min_driver_branch(need),
                   " or newer (or build jaxfuse with an older CUDA toolkit)");
  }
  return "";
}

// ffi::Error for a failed CUDA call `what`; driver problems are spelled out.
inline ffi::Error cuda_failure(const char* what, cudaError_t err) {
  (void)cudaGetLastError();  // reported here; keep it out of later, unrelated calls
  std::string detail;
  if (err == cudaErrorInsufficientDriver || err == cudaErrorNoDevice) {
    const std::string problem = driver_problem(cuda_versions());
    if (!problem.empty()) detail = " (" + problem + ")";
  }
  return internal_error(what, " failed: ", cudaGetErrorName(err), ": ", cudaGetErrorString(err),
                        detail);
}

#define JF_CUDA_RETURN_IF_ERROR(expr)                                                       \
  do {                                                                                      \
    const cudaError_t jf_cuda_err_ = (expr);                                                \
    if (jf_cuda_err_ != cudaSuccess) return ::jaxfuse::cuda_failure(#expr, jf_cuda_err_);   \
  } while (0)

// Launches kernel<<<grid, block, 0, stream>>>(args...), as a cooperative launch (all blocks
// co-resident, grid sync allowed) when `cooperative`. A launch error names the kernel `name`.
template <typename... Params, typename... Args>
ffi::Error launch_kernel(const char* name, void (*kernel)(Params...), dim3 grid, dim3 block,
                         cudaStream_t stream, bool cooperative, Args&&... args) {
  cudaLaunchAttribute attr[1] = {};
  attr[0].id = cudaLaunchAttributeCooperative;
  attr[0].val.cooperative = 1;
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = 0;
  config.stream = stream;
  config.attrs = attr;
  config.numAttrs = cooperative ? 1 : 0;
  const cudaError_t err = cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...);
  if (err != cudaSuccess) return cuda_failure(str_cat("launch of ", name).c_str(), err);
  return ffi::Error::Success();
}

// Blocks of `kernel` (launched with `threads` threads, no dynamic shared memory) that fit on the
// current device at once, at most `max_per_sm` per SM (0: no limit); cached per kernel and
// device (the template parameter makes one cache per kernel).
template <auto kKernel>
cudaError_t resident_blocks(int threads, int max_per_sm, int* blocks) {
  static std::atomic<int> cached[64];
  int device = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return err;
  const bool cacheable = device >= 0 && device < 64;
  if (cacheable && cached[device].load(std::memory_order_relaxed) > 0) {
    *blocks = cached[device].load(std::memory_order_relaxed);
    return cudaSuccess;
  }
  int sms = 0, per_sm = 0;
  err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  if (err != cudaSuccess) return err;
  err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kKernel, threads, 0);
  if (err != cudaSuccess) return err;
  if (per_sm < 1) return cudaErrorInvalidConfiguration;
  if (max_per_sm > 0) per_sm = std::min(per_sm, max_per_sm);
  *blocks = sms * per_sm;
  if (cacheable) cached[device].store(*blocks, std::memory_order_relaxed);
  return cudaSuccess;
}

// ---- device helpers ---------------------------------------------------------------------------

template <typename T>
__device__ __forceinline__ T warp_sum(T v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// Sum over a block of kThreads threads in a fixed order (warp butterflies, then the warp sums in
// order by thread 0): deterministic. The result is valid in thread 0; `scratch` holds
// kThreads / 32 values (back-to-back calls may share it: each call syncs first).
template <int kThreads, typename T>
__device__ __forceinline__ T block_sum(T v, T* scratch) {
  static_assert(kThreads % 32 == 0 && kThreads <= 1024, "whole warps");
  v = warp_sum(v);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  __syncthreads();  // scratch may still be read by a previous call
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  T r = T(0);
  if (threadIdx.x == 0) {
    for (int w = 0; w < kThreads / 32; ++w) r += scratch[w];
  }
  return r;
}

}  // namespace jaxfuse
