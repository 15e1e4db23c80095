// What backends() reports about the CUDA side: the runtime jaxfuse was built with, the driver,
// and why the driver cannot run the kernels (empty when it can).
#include "core/cuda/cuda_info.h"
#include "core/cuda/common.cuh"

namespace jaxfuse {

CudaInfo cuda_info() {
  const CudaVersions v = cuda_versions();
  return CudaInfo{v.runtime, v.driver, driver_problem(v)};
}

}  // namespace jaxfuse
