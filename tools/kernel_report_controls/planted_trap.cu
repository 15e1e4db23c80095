// expect: unguarded trap
// A planted bug for `tools/kernel_report.py --controls`: device code that reads a host constexpr
// object at a run-time index, the defect that made every 8-bit optimizer kernel a trap. nvcc
// compiles the read into a trap; the report must fail on it.
#include <cuda_runtime.h>

#include "optim/optimizer.h"
#include "core/cuda/kernel_budget.cuh"

namespace {

// The 8-bit kernels' StaticLists before the fix: a static constexpr member function that reads
// the host object, called from device code.
template <int kStates>
struct HostLayout {
  static constexpr jaxfuse::OptimizerLists kLists =
      jaxfuse::OptimizerLists::of(kStates, /*master=*/false, /*remainders=*/false, /*quantized=*/true);
  static constexpr int scales(int k) { return kLists.scales(k); }
};

}  // namespace

JF_KERNEL_BUDGET("^planted_trap_kernel$", 255, 0, 1024);

__global__ void __launch_bounds__(256) planted_trap_kernel(const float* in, float* out) {
  const int k = threadIdx.x % 2;
  out[threadIdx.x] = in[HostLayout<2>::scales(k)];
}
