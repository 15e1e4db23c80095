// Every XLA FFI handler jaxfuse exports. The nanobind modules hand them to JAX as capsules;
// each target name carries a CPU and (when built) a CUDA handler.
#pragma once

#include <string>

#include "xla/ffi/api/api.h"

namespace jaxfuse {

XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxfuseAdamCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxfuseAdamCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxfuseGlobalNormCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxfuseGlobalNormCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxfuseApplyGradCtrlCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxfuseApplyGradCtrlCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxfuseDecoderCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JaxfuseDecoderCuda);

// CUDA module only: versions as CUDA encodes them (13000 = 13.0; driver 0 = no driver) and why
// the driver cannot run the kernels ("" when it can).
struct CudaInfo {
  int runtime_version;
  int driver_version;
  std::string driver_problem;
};
CudaInfo cuda_info();

}  // namespace jaxfuse
