// expect: local memory
// A planted bug for `tools/kernel_report.py --controls`: a kernel that needs more registers than
// its __launch_bounds__ leave it (8 blocks of 256 threads per SM: 32 registers), so ptxas spills
// to local memory. Its budget allows no local memory; the report must fail on it.
#include <cuda_runtime.h>

#include "core/cuda/kernel_budget.cuh"

JF_KERNEL_BUDGET("^planted_spill_kernel$", 255, 0, 0);

__global__ void __launch_bounds__(256, 8) planted_spill_kernel(const float* in, float* out, int n) {
  constexpr int kLive = 48;  // values each needed by every output below
  float v[kLive];
#pragma unroll
  for (int j = 0; j < kLive; ++j) v[j] = in[threadIdx.x + j * n];
#pragma unroll
  for (int i = 0; i < kLive; ++i) {
    float acc = 0.0f;
#pragma unroll
    for (int j = 0; j < kLive; ++j) acc += v[j] * v[(i + j) % kLive];
    out[threadIdx.x + i * n] = acc;
  }
}
