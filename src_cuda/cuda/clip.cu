// jaxfuse_global_norm and jaxfuse_apply_grad_ctrl, CUDA.
// Global norm: stage 1 is a multi-tensor launch whose blocks each write one partial (sum of
// squares, non-finite marker) to a fixed slot; stage 2 is one block that sums the slots in a
// fixed order and writes the norm and the gradient-control vector. No atomics: the result is
// bitwise the same on every run on a given device. Nothing leaves the device.
#include "jaxfuse/clip_ffi.h"
#include "multi_tensor.cuh"

namespace jaxfuse {
namespace {

constexpr int kFinishThreads = 1024;
static_assert(kNormSlots <= kFinishThreads, "one finishing thread per partial slot");

// Sum over the block in a fixed order: warp shuffles, then the first warp over warp results.
template <int kThreads>
__device__ float block_sum(float x, float* shared) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) x += __shfl_down_sync(0xffffffffu, x, offset);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  __syncthreads();  // `shared` may still be read by a previous call
  if (lane == 0) shared[warp] = x;
  __syncthreads();
  x = threadIdx.x < kThreads / 32 ? shared[threadIdx.x] : 0.0f;
  if (warp == 0) {
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) x += __shfl_down_sync(0xffffffffu, x, offset);
  }
  return x;  // valid in thread 0
}

struct NormOp : MultiTensorOpBase {
  float* partials;
  float sumsq = 0.0f;
  float nonfinite = 0.0f;

  __device__ void operator()(const ChunkRef<1>& r) {
    for_each_group(r, [&](int64_t i, int n, bool vec) {
      float x[4] = {0.f, 0.f, 0.f, 0.f};
      load_group(r.ptr[0], r.dtype[0], i, n, vec, x);
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        sumsq += x[j] * x[j];
        nonfinite += x[j] - x[j];
      }
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
    norm_finish_kernel(const float* partials, int num_partials, const float* params, bool clip,
                       bool skip_nonfinite, bool clip_apply_loss_scale, float* norm, float* ctrl) {
  __shared__ float scratch[kFinishThreads / 32];
  const int i = threadIdx.x;
  const float s = block_sum<kFinishThreads>(i < num_partials ? partials[2 * i] : 0.0f, scratch);
  const float b = block_sum<kFinishThreads>(i < num_partials ? partials[2 * i + 1] : 0.0f, scratch);
  if (i == 0) finish_norm(s, b, params, clip, skip_nonfinite, clip_apply_loss_scale, norm, ctrl);
}

ffi::Error GlobalNormCuda(cudaStream_t stream, NormParamsBuffer params, ffi::RemainingArgs args,
                          ffi::Result<ScalarF32Buffer> norm, ffi::Result<HyperCtrlBuffer> ctrl,
                          ffi::Result<HyperCtrlBuffer> partials, bool clip,
                          bool skip_nonfinite, bool clip_apply_loss_scale) {
  TensorLists lists;
  JF_RETURN_IF_ERROR(decode_norm_call(params, args, ctrl, partials, &lists));
  NormOp op;
  op.partials = partials->typed_data();
  // Slots are shared out among the launches (one unless the tree has very many leaves).
  const int64_t launches = multi_tensor_launches<1>(lists);
  if (launches > kNormSlots) {
    return invalid_argument("jaxfuse_global_norm: too many leaves (", lists.num_tensors(), ")");
  }
  int blocks = 0;
  JF_RETURN_IF_ERROR(multi_tensor_apply<1>(stream, lists, op, "jaxfuse_global_norm",
                                           static_cast<int>(kNormSlots / launches), &blocks));
  return launch_kernel("jaxfuse_global_norm finish", norm_finish_kernel, dim3(1),
                       dim3(kFinishThreads), stream, /*cooperative=*/false, op.partials, blocks,
                       params.typed_data(), clip, skip_nonfinite, clip_apply_loss_scale,
                       norm->typed_data(), ctrl->typed_data());
}

struct ApplyGradCtrlOp : MultiTensorOpBase {
  const float* ctrl;
  GradScaling scaling;

  __device__ void prepare() { scaling = make_grad_scaling(ctrl); }

  __device__ void operator()(const ChunkRef<2>& r) const {
    for_each_group(r, [&](int64_t i, int n, bool vec) {
      float x[4] = {0.f, 0.f, 0.f, 0.f};
      load_group(r.ptr[0], r.dtype[0], i, n, vec, x);
#pragma unroll
      for (int j = 0; j < 4; ++j) x[j] = scaling.apply(x[j]);
      store_group(r.ptr[1], r.dtype[1], i, n, vec, x);
    });
  }
};

ffi::Error ApplyGradCtrlCuda(cudaStream_t stream, HyperCtrlBuffer ctrl, ffi::RemainingArgs args,
                             ffi::RemainingRets rets) {
  TensorLists lists;
  JF_RETURN_IF_ERROR(decode_apply_grad_ctrl_call(ctrl, args, rets, &lists));
  ApplyGradCtrlOp op;
  op.ctrl = ctrl.typed_data();
  return multi_tensor_apply<2>(stream, lists, op, "jaxfuse_apply_grad_ctrl");
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxfuseGlobalNormCuda, GlobalNormCuda,
                              global_norm_binding<ffi::PlatformStream<cudaStream_t>>(),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxfuseApplyGradCtrlCuda, ApplyGradCtrlCuda,
                              apply_grad_ctrl_binding<ffi::PlatformStream<cudaStream_t>>(),
                              {ffi::Traits::kCmdBufferCompatible});

}  // namespace jaxfuse
