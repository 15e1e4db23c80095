// jaxfuse_global_norm and jaxfuse_apply_grad_ctrl, CUDA.
// Global norm: stage 1 is a multi-tensor launch whose blocks each write one partial (sum of
// squares, non-finite marker) to a fixed slot; stage 2 is one block that sums the slots in a
// fixed order and writes the norm and the gradient-control vector. No atomics: the result is
// bitwise the same on every run on a given device. Nothing leaves the device.
#include "jaxfuse/clip.h"
#include "multi_tensor.cuh"

namespace jaxfuse {
namespace {

constexpr int kFinishThreads = 1024;
static_assert(kNormSlots <= kFinishThreads, "one finishing thread per partial slot");

struct NormChunkOp : MultiTensorOpBase {
  float* partials;
  float sumsq = 0.0f;
  float nonfinite = 0.0f;

  __device__ void operator()(const ChunkRef<1>& r) {
    for_each_group(r, [&](int64_t i, int n, bool vec) {
      float x[4] = {0.f, 0.f, 0.f, 0.f};
      load_group(r.ptr[0], r.dtype[0], i, n, vec, x);
#pragma unroll
      for (int j = 0; j < 4; ++j) norm_accumulate(x[j], sumsq, nonfinite);
    });
  }

  __device__ void finish(int block) {
    __shared__ float scratch[kMultiTensorThreads / 32];
    const float s = block_sum<kMultiTensorThreads>(sumsq, scratch);
    const float b = block_sum<kMultiTensorThreads>(nonfinite, scratch);
    if (threadIdx.x == 0) {
      partials[2 * block] = s;
      partials[2 * block + 1] = b;
    }
  }
};

__global__ void __launch_bounds__(kFinishThreads)
    norm_finish_kernel(const float* partials, int num_partials, const float* norm_params,
                       bool clip, bool skip_nonfinite, bool clip_apply_loss_scale, float* norm,
                       float* grad_ctrl) {
  __shared__ float scratch[kFinishThreads / 32];
  const int i = threadIdx.x;
  const float s = block_sum<kFinishThreads>(i < num_partials ? partials[2 * i] : 0.0f, scratch);
  const float b =
      block_sum<kFinishThreads>(i < num_partials ? partials[2 * i + 1] : 0.0f, scratch);
  if (i == 0) {
    finish_norm(s, b, norm_params, clip, skip_nonfinite, clip_apply_loss_scale, norm, grad_ctrl);
  }
}

struct ScaleChunkOp : MultiTensorOpBase {
  const float* grad_ctrl;
  GradScaling scaling;

  __device__ void prepare() { scaling = make_grad_scaling(grad_ctrl); }

  __device__ void operator()(const ChunkRef<2>& r) const {
    for_each_group(r, [&](int64_t i, int n, bool vec) {
      float x[4] = {0.f, 0.f, 0.f, 0.f};
      load_group(r.ptr[0], r.dtype[0], i, n, vec, x);
      scale_group(scaling, 4, x);
      store_group(r.ptr[1], r.dtype[1], i, n, vec, x);
    });
  }
};

}  // namespace

template <>
ffi::Error GlobalNormOp::run<Cuda>(cudaStream_t stream, const Call& call) {
  NormChunkOp op;
  op.partials = call.partials;
  // Slots are shared out among the launches (one unless the tree has very many leaves).
  const int64_t launches = multi_tensor_launches<1>(call.grads);
  if (launches > kNormSlots) {
    return invalid_argument("too many leaves (", call.grads.num_tensors(), ")");
  }
  int blocks = 0;
  JF_RETURN_IF_ERROR(multi_tensor_apply<1>(stream, call.grads, op,
                                           static_cast<int>(kNormSlots / launches), &blocks));
  return launch_kernel("the norm finishing kernel", norm_finish_kernel, dim3(1),
                       dim3(kFinishThreads), stream, /*cooperative=*/false, call.partials, blocks,
                       call.norm_params, call.clip, call.skip_nonfinite,
                       call.clip_apply_loss_scale, call.norm, call.grad_ctrl);
}

template <>
ffi::Error ApplyGradCtrlOp::run<Cuda>(cudaStream_t stream, const Call& call) {
  ScaleChunkOp op;
  op.grad_ctrl = call.grad_ctrl;
  return multi_tensor_apply<2>(stream, call.grads, op);
}

JAXFUSE_REGISTER_OP(GlobalNormOp, Cuda);
JAXFUSE_REGISTER_OP(ApplyGradCtrlOp, Cuda);

}  // namespace jaxfuse
