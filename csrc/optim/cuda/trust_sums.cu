// The finishing kernel of the trust-ratio families' first pass (trust_sums.cuh), compiled once.
#include "optim/cuda/trust_sums.cuh"

namespace jaxfuse {
namespace cuda_trust_sums {
namespace {

__global__ void __launch_bounds__(kMultiTensorThreads)
    trust_finish_kernel(const TrustSum* partials, const __grid_constant__ ChunkStarts starts,
                        uint32_t* sums) {
  __shared__ double scratch[kMultiTensorThreads / 32];
  const int t = blockIdx.x;
  TrustSum own;
  for (int c = starts.first[t] + threadIdx.x; c < starts.first[t + 1]; c += blockDim.x) {
    own.add(partials[c]);
  }
  const double p = block_sum<kMultiTensorThreads>(own.param_sumsq, scratch);
  const double d = block_sum<kMultiTensorThreads>(own.direction_sumsq, scratch);
  if (threadIdx.x == 0) TrustSum{p, d}.store(sums + int64_t(t) * kTrustSumWords);
}

}  // namespace

// One block per tensor over a few slots: any budget that keeps a block launchable.
JF_KERNEL_BUDGET("^trust_finish_kernel$", 64, 50, 0);

ffi::Error launch_finish(cudaStream_t stream, const TrustSum* partials, const ChunkStarts& starts,
                         int64_t num_tensors, uint32_t* sums) {
  return launch_kernel("the trust-sums finishing kernel", trust_finish_kernel,
                       dim3(static_cast<unsigned>(num_tensors)), dim3(kMultiTensorThreads), stream,
                       LaunchOptions{}, partials, starts, sums);
}

}  // namespace cuda_trust_sums
}  // namespace jaxfuse
