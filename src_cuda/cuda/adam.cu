// jaxfuse_adam, CUDA: every leaf's Adam/AdamW update in one multi-tensor launch (a few for very
// many leaves). Each thread runs adam_group() (adam_math.h, the CPU's program too) on groups of
// 4 elements held in registers, with 16-byte (fp32) or 8-byte (16-bit) accesses when aligned.
#include "jaxfuse/adam.h"
#include "multi_tensor.cuh"

namespace jaxfuse {
namespace {

// AdamLists as compile-time constants: each mode is its own kernel, with no branches on it.
template <bool kWriteUpdates, bool kMaster>
struct StaticAdamLists {
  static constexpr int updates = kWriteUpdates ? kAdamFixedLists : -1;
  static constexpr int master = kMaster ? kAdamFixedLists + int(kWriteUpdates) : -1;
  static constexpr int kCount = kAdamFixedLists + int(kWriteUpdates) + int(kMaster);
  static constexpr int param_source() { return kMaster ? master : int(kParams); }
};

// adam_group()'s view of 4 consecutive elements of one chunk.
template <int kLists>
struct RegisterGroup {
  using Values = float[4];
  const ChunkRef<kLists>& chunk;
  int64_t i;  // first element
  int n;      // valid elements (the others are computed and dropped)
  bool vec;   // vector access allowed

  static constexpr int size() { return 4; }
  __device__ void load(int list, float* x) const {
    load_group(chunk.ptr[list], chunk.dtype[list], i, n, vec, x);
  }
  __device__ void store(int list, const float* x) const {
    store_group(chunk.ptr[list], chunk.dtype[list], i, n, vec, x);
  }
  __device__ void update(const AdamStep& s, const float* g, const float* p, float* m, float* v,
                         float* u) const {
#pragma unroll
    for (int j = 0; j < 4; ++j) u[j] = adam_element(s, g[j], p[j], chunk.mask, m[j], v[j]);
  }
};

template <bool kWriteUpdates, bool kMaster>
struct AdamChunkOp : MultiTensorOpBase {
  using Lists = StaticAdamLists<kWriteUpdates, kMaster>;
  static constexpr int kLists = Lists::kCount;

  const int32_t* count;
  int32_t* new_count;
  const float* hyper;
  const float* grad_ctrl;
  bool nesterov;
  AdamStep step;

  __device__ void prepare() {
    const int32_t c = *count;
    step = make_adam_step(hyper, grad_ctrl, c, nesterov);
    if (blockIdx.x == 0 && threadIdx.x == 0) *new_count = adam_next_count(c, step.grad.skip);
  }

  __device__ void operator()(const ChunkRef<kLists>& chunk) const {
    for_each_group(chunk, [&](int64_t i, int n, bool vec) {
      // A short group (n < 4) computes all 4 lanes and stores n.
      const RegisterGroup<kLists> group{chunk, i, n, vec};
      adam_group(step, Lists{}, group);
    });
  }
};

template <bool kWriteUpdates, bool kMaster>
ffi::Error launch_adam(cudaStream_t stream, const AdamOp::Call& call) {
  using Op = AdamChunkOp<kWriteUpdates, kMaster>;
  Op op;
  op.count = call.count;
  op.new_count = call.new_count;
  op.hyper = call.hyper;
  op.grad_ctrl = call.grad_ctrl;
  op.nesterov = call.nesterov;
  return multi_tensor_apply<Op::kLists>(stream, call.tensors, op);
}

}  // namespace

template <>
ffi::Error AdamOp::run<Cuda>(cudaStream_t stream, const Call& call) {
  const bool master = call.lists.master >= 0;
  if (call.lists.updates >= 0) {
    return master ? launch_adam<true, true>(stream, call) : launch_adam<true, false>(stream, call);
  }
  return master ? launch_adam<false, true>(stream, call) : launch_adam<false, false>(stream, call);
}

JAXFUSE_REGISTER_OP(AdamOp, Cuda);

}  // namespace jaxfuse
