// The CUDA driver of a trust-ratio family's first pass (trust_sums.h): one multi-tensor launch in
// which each block sums its chunk's squares (params and direction, from trust_group(), the CPU's
// program too) in double and writes them to the chunk's slot, then one block per tensor that adds
// the tensor's slots in a fixed tree. No atomics: the same sums on every run.
//
// A family's CUDA file adds one line, JAXFUSE_CUDA_TRUST_SUMS(Family).
#pragma once

#include "optim/trust_sums.h"
#include "optim/cuda/optimizer.cuh"

namespace jaxfuse {
namespace cuda_trust_sums {

template <typename Family, typename Real, typename Lists, typename DTypes>
struct ChunkSumOp : MultiTensorOpBase {
  static constexpr int kLists = Lists::kCount;
  static constexpr int kMinBlocksPerSM = cuda_optimizer::kOptimizerMinBlocks<Real, Lists, DTypes>;

  const int32_t* count;
  ScalarVector hyper;
  ScalarVector grad_ctrl;
  uint32_t flags;
  bool complex;
  TrustSum* partials;
  OptimizerStep<Family, Real> step;

  __device__ void prepare() {
    step = make_optimizer_step<Family, Real>(hyper, grad_ctrl, *count, flags, complex);
  }

  __device__ void operator()(const ChunkRef<kLists>& chunk) const {
    double param_sumsq = 0.0, direction_sumsq = 0.0;
    cuda_optimizer::for_each_register_group<Family, Real, Lists, DTypes>(
        chunk, [&](const auto& group) {
          typename std::decay_t<decltype(group)>::Values p, d;
          trust_group(step, Lists{}, group, p, d);
          const int n = group.valid();  // the lanes past n were computed from nothing: dropped
          for (int j = 0; j < group.size(); ++j) {
            if (j < n) {
              param_sumsq += double(p[j]) * double(p[j]);
              direction_sumsq += double(d[j]) * double(d[j]);
            }
          }
        });
    __shared__ double scratch[kMultiTensorThreads / 32];
    const double p = block_sum<kMultiTensorThreads>(param_sumsq, scratch);
    const double d = block_sum<kMultiTensorThreads>(direction_sumsq, scratch);
    if (threadIdx.x == 0) partials[chunk.index] = TrustSum{p, d};
  }
};

// Tensor t's chunks are slots [first[t], first[t + 1]) (multi_tensor_apply numbers them in order).
struct ChunkStarts {
  int32_t first[kMaxTensorsPerCall + 1];
};

// One block per tensor adds its slots in a fixed tree and writes its TrustSum (trust_sums.cu).
ffi::Error launch_finish(cudaStream_t stream, const TrustSum* partials, const ChunkStarts& starts,
                         int64_t num_tensors, uint32_t* sums);

// The first pass streams the params and states like a step (the optimizer's budgets).
JF_KERNEL_BUDGET("\\bChunkSumOp<\\w+, float, [012] states, \\w+, \\w+ params", 64, 50, 0);
JF_KERNEL_BUDGET("\\bChunkSumOp<\\w+, float, [^>]*table dtypes", 128, 25, 0);
JF_KERNEL_BUDGET("\\bChunkSumOp<\\w+, double", 168, 12, 0);
JF_KERNEL_LOADS("\\bChunkSumOp<\\w+, float, 0 states, \\w+, \\w+ params", 2);
JF_KERNEL_LOADS("\\bChunkSumOp<\\w+, float, 2 states, \\w+, \\w+ params", 4);

template <typename Family, typename Real, int kStates, typename DTypes>
ffi::Error launch_sums(cudaStream_t stream, const typename TrustSumsOp<Family>::Call& call) {
  using Lists = cuda_optimizer::StaticLists<kStates, ParamsMode::kPlain, false>;
  using Op = ChunkSumOp<Family, Real, Lists, DTypes>;
  Op op;
  op.count = call.count;
  op.hyper = call.hyper;
  op.grad_ctrl = call.grad_ctrl;
  op.flags = call.flags;
  op.complex = call.complex;
  op.partials = call.partials;
  return multi_tensor_apply<Op::kLists>(stream, call.tensors, op);
}

// The signature kernel that takes every tensor of a float32 call, or -1. One launch numbers
// the partials' slots in tensor order, which the finish reads.
inline int uniform_signature(const TensorLists& tensors, int num_states) {
  const std::vector<int> signatures =
      tensor_signatures(tensors.dtype, OptimizerLists::of(num_states, /*master=*/false));
  for (int s : signatures) {
    if (s < 0 || s != signatures[0]) return -1;
  }
  return signatures.empty() ? -1 : signatures[0];
}

template <typename Family, typename Real, int kStates, int kSignature = 0>
ffi::Error launch_uniform(cudaStream_t stream, const typename TrustSumsOp<Family>::Call& call,
                          int signature) {
  if constexpr (std::is_same_v<Real, float> && kSignature < kNumKernelSignatures) {
    if constexpr (has_signature_kernel(kSignature, ParamsMode::kPlain, kStates > 0)) {
      if (signature == kSignature) {
        return launch_sums<Family, Real, kStates, cuda_optimizer::SignatureDTypes<kSignature>>(
            stream, call);
      }
    }
    return launch_uniform<Family, Real, kStates, kSignature + 1>(stream, call, signature);
  }
  return launch_sums<Family, Real, kStates, cuda_optimizer::TableDTypes>(stream, call);
}

template <typename Family, typename Real, int kStates>
ffi::Error launch(cudaStream_t stream, const typename TrustSumsOp<Family>::Call& call) {
  const int64_t n = call.tensors.num_tensors();
  if (n == 0) return ffi::Error::Success();
  const int signature = std::is_same_v<Real, float> ? uniform_signature(call.tensors, kStates) : -1;
  JF_RETURN_IF_ERROR((launch_uniform<Family, Real, kStates>(stream, call, signature)));
  ChunkStarts starts;
  starts.first[0] = 0;
  for (int64_t t = 0; t < n; ++t) {
    starts.first[t + 1] = starts.first[t] + static_cast<int32_t>(
        (call.tensors.size[t] + kMultiTensorChunk - 1) / kMultiTensorChunk);
  }
  return launch_finish(stream, call.partials, starts, n, call.sums);
}

}  // namespace cuda_trust_sums

// Registers the CUDA handler of Family's first pass.
#define JAXFUSE_CUDA_TRUST_SUMS(Family)                                                         \
  template <>                                                                                   \
  template <>                                                                                   \
  ffi::Error TrustSumsOp<Family>::run<Cuda>(cudaStream_t stream, const Call& call) {            \
    constexpr int kStates = Family::kDirectionStates;                                           \
    return call.f64 ? cuda_trust_sums::launch<Family, double, kStates>(stream, call)            \
                    : cuda_trust_sums::launch<Family, float, kStates>(stream, call);            \
  }                                                                                             \
  JAXFUSE_REGISTER_OP(TrustSumsOp<Family>, Cuda)

}  // namespace jaxfuse
