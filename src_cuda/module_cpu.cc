// nanobind module exporting jaxfuse's CPU FFI handlers.
#include <nanobind/nanobind.h>

#include "jaxfuse/handlers.h"

namespace nb = nanobind;

namespace {
template <typename Fn>
nb::capsule encapsulate(Fn* fn) {
  return nb::capsule(reinterpret_cast<void*>(fn));
}
}  // namespace

NB_MODULE(_jaxfuse_cpu, m) {
  m.def("registrations", []() {
    nb::dict d;
    d["jaxfuse_adam"] = encapsulate(jaxfuse::JaxfuseAdamCpu);
    d["jaxfuse_global_norm"] = encapsulate(jaxfuse::JaxfuseGlobalNormCpu);
    d["jaxfuse_apply_grad_ctrl"] = encapsulate(jaxfuse::JaxfuseApplyGradCtrlCpu);
    d["jaxfuse_decoder"] = encapsulate(jaxfuse::JaxfuseDecoderCpu);
    return d;
  });
}
