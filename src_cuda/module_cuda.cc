// nanobind module exporting jaxfuse's CUDA FFI handlers (built only when nvcc is available).
#include <nanobind/nanobind.h>

#include "jaxfuse/handlers.h"

namespace nb = nanobind;

namespace {
template <typename Fn>
nb::capsule encapsulate(Fn* fn) {
  return nb::capsule(reinterpret_cast<void*>(fn));
}
}  // namespace

NB_MODULE(_jaxfuse_cuda, m) {
  m.def("registrations", []() {
    nb::dict d;
    d["jaxfuse_adam"] = encapsulate(jaxfuse::JaxfuseAdamCuda);
    d["jaxfuse_global_norm"] = encapsulate(jaxfuse::JaxfuseGlobalNormCuda);
    d["jaxfuse_apply_grad_ctrl"] = encapsulate(jaxfuse::JaxfuseApplyGradCtrlCuda);
    d["jaxfuse_decoder"] = encapsulate(jaxfuse::JaxfuseDecoderCuda);
    return d;
  });
}
