// jaxfuse_global_norm, CUDA.
// Global norm: stage 1 is a multi-tensor launch whose blocks each write one partial (sum of
// squares, non-finite marker) to a fixed slot; stage 2 is one block that sums the slots in a
// fixed order and writes the norm and the gradient-control vector. No atomics: the result is
// bitwise the same on every run on a given device. Nothing leaves the device.
#include "optim/clip.h"
#include "optim/cuda/multi_tensor.cuh"

namespace jaxfuse {
namespace {

constexpr int kFinishThreads = 1024;
static_assert(kNormSlots <= kFinishThreads, "one finishing thread per partial slot");

// Accumulates in double (norm_math.h): the squares of 16- and 32-bit values are exact.
struct NormChunkOp : MultiTensorOpBase {
  double* partials;
  double sumsq = 0.0;
  double nonfinite = 0.0;

  __device__ void operator()(const ChunkRef<1>& r) {
    for_each_group(r, [&](int64_t i, int n, bool vec) {
      double x[4] = {0.0, 0.0, 0.0, 0.0};
      load_group(r.ptr[0], r.dtype[0], i, n, vec, x);
#pragma unroll
      for (int j = 0; j < 4; ++j) norm_accumulate(x[j], sumsq, nonfinite);
    });
  }

  __device__ void finish(int block) {
    __shared__ double scratch[kMultiTensorThreads / 32];
    const double s = block_sum<kMultiTensorThreads>(sumsq, scratch);
    const double b = block_sum<kMultiTensorThreads>(nonfinite, scratch);
    if (threadIdx.x == 0) {
      partials[2 * block] = s;
      partials[2 * block + 1] = b;
    }
  }
};

// Sums the block partials into this call's own total (written as a row), then adds the peers'
// rows in row order to it and finishes. Each thread folds a fixed set of slots or rows and the
// block sums them in a fixed tree: the same result on every run.
__global__ void __launch_bounds__(kFinishThreads)
    norm_finish_kernel(const double* partials, int num_partials, const uint32_t* peer_sums,
                       int64_t num_peers, uint32_t* own_sum, ScalarVector norm_params, bool clip,
                       bool skip_nonfinite, bool clip_apply_loss_scale, ScalarVectorOut norm,
                       ScalarVectorOut grad_ctrl) {
  __shared__ double scratch[kFinishThreads / 32];
  const int i = threadIdx.x;
  NormSum own;
  own.sumsq = block_sum<kFinishThreads>(i < num_partials ? partials[2 * i] : 0.0, scratch);
  own.nonfinite = block_sum<kFinishThreads>(i < num_partials ? partials[2 * i + 1] : 0.0, scratch);
  NormSum peers;
  for (int64_t r = i; r < num_peers; r += kFinishThreads) {
    peers.add(NormSum::load_row(peer_sums + r * kNormSumWords));
  }
  NormSum total;
  total.sumsq = block_sum<kFinishThreads>(peers.sumsq, scratch);
  total.nonfinite = block_sum<kFinishThreads>(peers.nonfinite, scratch);
  if (i == 0) {
    own.store_row(own_sum);
    total.add(own);
    finish_norm(total.sumsq, total.nonfinite, norm_params, clip, skip_nonfinite,
                clip_apply_loss_scale, norm, grad_ctrl);
  }
}

}  // namespace

// The norm's pass reads every gradient once and keeps the whole SM busy; its finish is one block.
JF_KERNEL_BUDGET("NormChunkOp", 32, 100, 0);
JF_KERNEL_BUDGET("^norm_finish_kernel$", 64, 50, 0);

template <>
ffi::Error GlobalNormOp::run<Cuda>(cudaStream_t stream, const Call& call) {
  NormChunkOp op;
  op.partials = call.partials;
  // Slots are shared out among the launches (one unless the tree has very many leaves).
  const int64_t launches = multi_tensor_launches(1, call.grads.size);
  if (launches > kNormSlots) {
    return invalid_argument("too many leaves (", call.grads.num_tensors(), ")");
  }
  int blocks = 0;  // none for a call over no gradients (a sharded norm's second call)
  if (call.grads.num_tensors() > 0) {
    JF_RETURN_IF_ERROR(multi_tensor_apply<1>(stream, call.grads, op,
                                             static_cast<int>(kNormSlots / launches), &blocks));
  }
  return launch_kernel("the norm finishing kernel", norm_finish_kernel, dim3(1),
                       dim3(kFinishThreads), stream, LaunchOptions{}, call.partials, blocks,
                       call.peer_sums, call.num_peers, call.own_sum, call.norm_params, call.clip,
                       call.skip_nonfinite,
                       call.clip_apply_loss_scale, call.norm, call.grad_ctrl);
}

JAXFUSE_REGISTER_OP(GlobalNormOp, Cuda);

}  // namespace jaxfuse
