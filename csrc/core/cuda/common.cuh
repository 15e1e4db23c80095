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

#include <cuda_pipeline_primitives.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <utility>

#include "core/op.h"
#include "core/cuda/kernel_budget.cuh"

namespace jaxfuse {

// The CUDA platform of op.h: handlers enqueue work on XLA's stream and never synchronize or
// allocate, so XLA may capture them into command buffers (CUDA graphs).
struct Cuda {
  using Context = ffi::PlatformStream<cudaStream_t>;
  using Arg = cudaStream_t;
  static constexpr bool kCommandBufferCompatible = true;
};

struct CudaVersions {
  int runtime = CUDART_VERSION;  // the toolkit jaxfuse was built with, e.g. 13000 for 13.0
  int driver = 0;                // the newest CUDA the installed driver supports; 0: no driver
};

// The oldest driver that runs these kernels: the CUDA version it must support (CUDA's
// minor-version compatibility: any driver of the runtime's major) and that driver's branch. CUDA
// 12 builds need 12.1's driver (R530): the multi-tensor tables are kernel parameters over 4 KB,
// which CUDA 12.1 introduced.
struct DriverNeed {
  int cuda_version;
  int branch;
};
inline DriverNeed driver_need(int runtime) {
  if (runtime / 1000 >= 13) return {runtime / 1000 * 1000, 580};
  return {12010, 530};
}

inline CudaVersions cuda_versions() {
  CudaVersions v;
  if (cudaDriverGetVersion(&v.driver) != cudaSuccess) v.driver = 0;
  return v;
}

// Why the driver cannot run these kernels, or "" when it can.
inline std::string driver_problem(const CudaVersions& v) {
  if (v.driver == 0) return "no NVIDIA driver found";
  const DriverNeed need = driver_need(v.runtime);
  if (v.driver < need.cuda_version) {
    return str_cat("the NVIDIA driver supports CUDA ", v.driver / 1000, ".", v.driver % 1000 / 10,
                   " but jaxfuse's CUDA kernels were built with CUDA ", v.runtime / 1000, ".",
                   v.runtime % 1000 / 10, ": install driver ", need.branch,
                   " or newer (or jaxfuse's package for an older CUDA)");
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

// How a kernel is launched beyond its grid and block: cooperatively (all blocks co-resident,
// grid sync allowed), with dynamic shared memory (over 48 KB: the kernel must have opted in,
// cudaFuncSetAttribute), and as a programmatic dependent launch (sm_90+: the kernel may start
// before the one before it on the stream has finished; it must wait for it, wait_for_prior_grids(),
// before it reads what that one writes: programmatic_launch_supported()).
struct LaunchOptions {
  bool cooperative = false;
  size_t dynamic_shared = 0;
  bool programmatic = false;
};

// Launches kernel<<<grid, block, options.dynamic_shared, stream>>>(args...). A launch error names
// the kernel `name`.
template <typename... Params, typename... Args>
ffi::Error launch_kernel(const char* name, void (*kernel)(Params...), dim3 grid, dim3 block,
                         cudaStream_t stream, LaunchOptions options, Args&&... args) {
  cudaLaunchAttribute attr[2] = {};
  unsigned attrs = 0;
  if (options.cooperative) {
    attr[attrs].id = cudaLaunchAttributeCooperative;
    attr[attrs++].val.cooperative = 1;
  }
  if (options.programmatic) {
    attr[attrs].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[attrs++].val.programmaticStreamSerializationAllowed = 1;
  }
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = options.dynamic_shared;
  config.stream = stream;
  config.attrs = attr;
  config.numAttrs = attrs;
  const cudaError_t err = cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...);
  if (err != cudaSuccess) return cuda_failure(str_cat("launch of ", name).c_str(), err);
  return ffi::Error::Success();
}

// A value per device, computed once per (cache, device) by compute(device, &value) (> 0).
template <typename Compute>
cudaError_t cached_per_device(std::atomic<int> (&cache)[64], const Compute& compute, int* value) {
  int device = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return err;
  const bool cacheable = device >= 0 && device < 64;
  if (cacheable && cache[device].load(std::memory_order_relaxed) > 0) {
    *value = cache[device].load(std::memory_order_relaxed);
    return cudaSuccess;
  }
  err = compute(device, value);
  if (err == cudaSuccess && cacheable) cache[device].store(*value, std::memory_order_relaxed);
  return err;
}

// Blocks of `kernel` (launched with `threads` threads and `dynamic_shared` bytes of dynamic
// shared memory, the same on every call) that fit on the current device at once, at most
// `max_per_sm` per SM (0: no limit); cached per kernel and device (the template parameter makes
// one cache per kernel).
template <auto kKernel>
cudaError_t resident_blocks(int threads, int max_per_sm, size_t dynamic_shared, int* blocks) {
  static std::atomic<int> cached[64];
  return cached_per_device(cached, [&](int device, int* out) {
    int sms = 0, per_sm = 0;
    cudaError_t err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
    if (err != cudaSuccess) return err;
    err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kKernel, threads, dynamic_shared);
    if (err != cudaSuccess) return err;
    if (per_sm < 1) return cudaErrorInvalidConfiguration;
    if (max_per_sm > 0) per_sm = std::min(per_sm, max_per_sm);
    *out = sms * per_sm;
    return cudaSuccess;
  }, blocks);
}

// Whether the current device runs programmatic dependent launches (compute capability 9.0+);
// cached per device.
inline cudaError_t programmatic_launch_supported(bool* supported) {
  static std::atomic<int> cached[64];  // 1: no, 2: yes
  int value = 0;
  const cudaError_t err = cached_per_device(cached, [](int device, int* out) {
    int major = 0;
    const cudaError_t e =
        cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
    *out = major >= 9 ? 2 : 1;
    return e;
  }, &value);
  *supported = value == 2;
  return err;
}

// ---- device helpers ---------------------------------------------------------------------------

// Programmatic dependent launch (sm_90+; elsewhere, and in a launch that is not programmatic,
// both are no-ops). A thread waits in wait_for_prior_grids() until the kernels before this one on
// the stream have completed and their writes are visible to it; a block's
// allow_dependent_launch() lets the next kernel's blocks be scheduled once every block of this
// one has called it (or exited), so that they may start what does not depend on this one.
__device__ __forceinline__ void wait_for_prior_grids() {
#if defined(CUDA_ON_CPU)
  cuemu::grid_dependency_wait(__FILE__, __LINE__);
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void allow_dependent_launch() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

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

// The block's dynamic shared memory (the launch's dynamicSmemBytes, 16-byte aligned).
__device__ __forceinline__ char* dynamic_shared_memory() {
#if defined(CUDA_ON_CPU)
  return cuemu::dynamic_shared_memory();
#else
  extern __shared__ __align__(16) char dynamic_shared[];
  return dynamic_shared;
#endif
}

// Asynchronous copies global -> shared (cp.async, sm_80+), in commit groups: a thread's copies
// land when it has waited for their group (then a __syncthreads() shows them to the block).
// copy_async_16 copies the 16 bytes at `src` to `dst`, or (copy false) writes 16 zeros there
// without reading `src`; L1 is bypassed (.cg: the bytes are used once, from shared memory). Both
// 16-byte aligned.
__device__ __forceinline__ void copy_async_16(void* dst, const void* src, bool copy) {
#if defined(__CUDA_ARCH__)
  const unsigned to = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  asm volatile(
      "{\n .reg .pred skip;\n setp.eq.u32 skip, %2, 0;\n"
      " cp.async.cg.shared.global [%0], [%1], 16, skip;\n}" ::"r"(to), "l"(src),
      "r"(unsigned(copy))
      : "memory");
#else
  __pipeline_memcpy_async(dst, src, 16, copy ? 0 : 16);
#endif
}

__device__ __forceinline__ void commit_async_copies() {
#if defined(__CUDA_ARCH__)
  asm volatile("cp.async.commit_group;" ::: "memory");
#else
  __pipeline_commit();
#endif
}

// Waits until at most kPending of this thread's latest commit groups are still in flight.
template <int kPending>
__device__ __forceinline__ void wait_async_copies() {
#if defined(__CUDA_ARCH__)
  asm volatile("cp.async.wait_group %0;" ::"n"(kPending) : "memory");
#else
  __pipeline_wait_prior(kPending);
#endif
}

}  // namespace jaxfuse
