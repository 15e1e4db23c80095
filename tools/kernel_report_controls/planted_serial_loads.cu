// expect: arrays loaded in flight
// A planted bug for `tools/kernel_report.py --controls`: the optimizer kernels' defect before
// issue 39, each load waiting on the one before it. The second array's load sits behind a branch
// on the first's value (the gradient scaling's slow-path division, a dtype switch), so the two
// loads are one round trip after another. Its floor asks for both in flight; the report must fail.
#include <cuda_runtime.h>

#include "core/cuda/kernel_budget.cuh"

JF_KERNEL_BUDGET("^planted_serial_loads_kernel$", 255, 0, 1024);
JF_KERNEL_LOADS("^planted_serial_loads_kernel$", 2);

__global__ void __launch_bounds__(256) planted_serial_loads_kernel(const float4* a,
                                                                   const float4* b, float4* out) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  float4 x = a[i];
  if (x.x > 0.0f) x.y = 1.0f / x.x;  // a branch on the loaded value
  const float4 y = b[i];
  out[i] = make_float4(x.x + y.x, x.y + y.y, x.z + y.z, x.w + y.w);
}
