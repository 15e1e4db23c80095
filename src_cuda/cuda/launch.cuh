// Kernel launches and CUDA error handling for every CUDA handler.
//
// Every launch goes through launch_kernel() (the type-safe cudaLaunchKernelEx), which returns
// this launch's own error code. Nothing reads the thread's last-error slot: it may hold an error
// of an unrelated earlier call. A failed runtime call is reported once and then cleared from the
// slot, so it cannot resurface in a later call (sticky errors, a device fault, stay sticky: the
// CUDA context is unusable after one). tools/cuda_on_cpu runs these same call sites against its
// CPU implementation of the runtime API.
#pragma once

#include <cuda_runtime.h>

#include <utility>

#include "jaxfuse/ffi_util.h"

namespace jaxfuse {

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

}  // namespace jaxfuse
