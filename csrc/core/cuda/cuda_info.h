// What backends() reports about the CUDA module (defined in csrc/core/cuda/cuda_info.cu).
#pragma once

#include <string>

namespace jaxfuse {

// Versions as CUDA encodes them (13000 = 13.0; driver 0 = no driver) and why the driver cannot
// run the kernels ("" when it can).
struct CudaInfo {
  int runtime_version;
  int driver_version;
  std::string driver_problem;
};
CudaInfo cuda_info();

}  // namespace jaxfuse
