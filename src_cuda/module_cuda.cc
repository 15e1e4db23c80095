// nanobind module exporting jaxfuse's CUDA FFI handlers (built only when nvcc is available).
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include "jaxfuse/handlers.h"

namespace nb = nanobind;

namespace {
template <typename Fn>
nb::capsule encapsulate(Fn* fn) {
  return nb::capsule(reinterpret_cast<void*>(fn));
}
}  // namespace

// The CUDA-on-CPU build of tools/cuda_on_cpu compiles this module under another name.
#ifndef JAXFUSE_CUDA_MODULE
#define JAXFUSE_CUDA_MODULE _jaxfuse_cuda
#endif

NB_MODULE(JAXFUSE_CUDA_MODULE, m) {
  m.def("registrations", []() {
    nb::dict d;
    d["jaxfuse_adam"] = encapsulate(jaxfuse::JaxfuseAdamCuda);
    d["jaxfuse_global_norm"] = encapsulate(jaxfuse::JaxfuseGlobalNormCuda);
    d["jaxfuse_apply_grad_ctrl"] = encapsulate(jaxfuse::JaxfuseApplyGradCtrlCuda);
    d["jaxfuse_decoder"] = encapsulate(jaxfuse::JaxfuseDecoderCuda);
    return d;
  });
  m.def("cuda_info", []() {
    const jaxfuse::CudaInfo info = jaxfuse::cuda_info();
    nb::dict d;
    d["runtime_version"] = info.runtime_version;
    d["driver_version"] = info.driver_version;
    d["driver_problem"] = info.driver_problem;
    return d;
  });
}
