// jaxfuse_adam, CUDA: every leaf's Adam/AdamW update in one multi-tensor launch (a few for very
// many leaves). The element math is adam_element() in math.h, shared with the CPU handler.
#include "jaxfuse/adam_ffi.h"
#include "multi_tensor.cuh"

namespace jaxfuse {
namespace {

template <bool kWriteUpdates, bool kMaster>
struct AdamOp : MultiTensorOpBase {
  static constexpr int kLists = 4 + int(kWriteUpdates) + int(kMaster);
  static constexpr int kUpdates = kWriteUpdates ? 4 : -1;
  static constexpr int kMasterList = kMaster ? 4 + int(kWriteUpdates) : -1;
  // Where the math reads the param value from: the fp32 master copy when present.
  static constexpr int kParamSource = kMaster ? kMasterList : int(kParams);

  const int32_t* count;
  int32_t* new_count;
  const float* hyper;
  const float* ctrl;
  bool nesterov;
  AdamStep step;

  __device__ void prepare() {
    const int32_t c = *count;
    step = make_adam_step(hyper, ctrl, c, nesterov);
    if (blockIdx.x == 0 && threadIdx.x == 0) *new_count = adam_next_count(c, step.grad.skip);
  }

  __device__ void operator()(const ChunkRef<kLists>& r) const {
    const DType* dt = r.dtype;
    for_each_group(r, [&](int64_t i, int n, bool vec) {
      float u[4] = {0.f, 0.f, 0.f, 0.f};
      if (step.grad.skip) {
        // Non-finite step: state untouched; the optax path reports a zero update.
        if constexpr (kWriteUpdates) store_group(r.ptr[kUpdates], dt[kUpdates], i, n, vec, u);
        return;
      }
      float g[4], p[4], m[4], v[4];
      load_group(r.ptr[kGrads], dt[kGrads], i, n, vec, g);
      load_group(r.ptr[kParamSource], dt[kParamSource], i, n, vec, p);
      load_group(r.ptr[kMu], dt[kMu], i, n, vec, m);
      load_group(r.ptr[kNu], dt[kNu], i, n, vec, v);
#pragma unroll
      for (int j = 0; j < 4; ++j) u[j] = adam_element(step, step.grad.apply(g[j]), p[j], r.flag, m[j], v[j]);
      store_group(r.ptr[kMu], dt[kMu], i, n, vec, m);
      store_group(r.ptr[kNu], dt[kNu], i, n, vec, v);
#pragma unroll
      for (int j = 0; j < 4; ++j) p[j] = p[j] + u[j];  // new (master) params
      if constexpr (kWriteUpdates) {
        if constexpr (kMaster) {
          // Update that moves the low-precision params onto the new master value.
          float p_low[4];
          load_group(r.ptr[kParams], dt[kParams], i, n, vec, p_low);
#pragma unroll
          for (int j = 0; j < 4; ++j) u[j] = p[j] - p_low[j];
          store_group(r.ptr[kMasterList], DType::kF32, i, n, vec, p);
        }
        store_group(r.ptr[kUpdates], dt[kUpdates], i, n, vec, u);
      } else {
        if constexpr (kMaster) store_group(r.ptr[kMasterList], DType::kF32, i, n, vec, p);
        store_group(r.ptr[kParams], dt[kParams], i, n, vec, p);
      }
    });
  }
};

template <bool kWriteUpdates, bool kMaster>
ffi::Error launch_adam(cudaStream_t stream, const AdamCall& call) {
  using Op = AdamOp<kWriteUpdates, kMaster>;
  Op op;
  op.count = call.count;
  op.new_count = call.new_count;
  op.hyper = call.hyper;
  op.ctrl = call.ctrl;
  op.nesterov = call.nesterov;
  return multi_tensor_apply<Op::kLists>(stream, call.lists, op, "jaxfuse_adam");
}

ffi::Error AdamCuda(cudaStream_t stream, CountBuffer count,
                    HyperBuffer hyper, HyperBuffer ctrl,
                    ffi::RemainingArgs args, ffi::Result<CountBuffer> new_count,
                    ffi::RemainingRets rets, int64_t num_tensors, bool nesterov,
                    bool write_updates, bool master, ffi::Span<const uint8_t> decay_mask) {
  AdamCall call;
  JF_RETURN_IF_ERROR(decode_adam_call(count, hyper, ctrl, args, new_count, rets, num_tensors,
                                      nesterov, write_updates, master, decay_mask, &call));
  if (write_updates) {
    return master ? launch_adam<true, true>(stream, call) : launch_adam<true, false>(stream, call);
  }
  return master ? launch_adam<false, true>(stream, call) : launch_adam<false, false>(stream, call);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxfuseAdamCuda, AdamCuda, adam_binding<ffi::PlatformStream<cudaStream_t>>(),
                              {ffi::Traits::kCmdBufferCompatible});

}  // namespace jaxfuse
