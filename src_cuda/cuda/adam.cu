// jaxfuse_adam, CUDA: every leaf's Adam/AdamW update in one multi-tensor launch (a few for very
// many leaves). Each thread runs adam_group() (adam_math.h, the CPU's program too) on groups of
// 4 scalars held in registers, in float (double for float64 calls), with 16-byte (32-/64-bit)
// or 8-byte (16-bit) accesses when aligned.
#include "jaxfuse/adam.h"
#include "multi_tensor.cuh"

namespace jaxfuse {
namespace {

// AdamLists::of() as compile-time constants: each layout is its own kernel, with no branches on
// it.
template <bool kWriteUpdates, bool kMaster, bool kParams>
struct StaticAdamLists {
  static constexpr AdamLists kLists = AdamLists::of(kWriteUpdates, kMaster, kParams);
  static constexpr int params = kLists.params;
  static constexpr int updates = kLists.updates;
  static constexpr int master = kLists.master;
  static constexpr int kCount = kLists.count();
  static constexpr int param_source() { return kLists.param_source(); }
};

// adam_group()'s view of 4 consecutive scalars of one chunk.
template <typename Real, int kLists>
struct RegisterGroup {
  using Values = Real[4];
  const ChunkRef<kLists>& chunk;
  int64_t i;  // first scalar
  int n;      // valid scalars (the others are computed and dropped)
  bool vec;   // vector access allowed

  static constexpr int size() { return 4; }
  __device__ void load(int list, Real* x) const {
    load_group(chunk.ptr[list], chunk.dtype[list], i, n, vec, x);
  }
  __device__ void store(int list, const Real* x) const {
    store_group(chunk.ptr[list], chunk.dtype[list], i, n, vec, x);
  }
  __device__ void round(int list, Real* x) const {
#pragma unroll
    for (int j = 0; j < 4; ++j) x[j] = round_to(chunk.dtype[list], x[j]);
  }
  __device__ void update(const AdamStep<Real>& s, const Real* g, const Real* p, Real* m, Real* v,
                         Real* u) const {
    adam_elements(s, 4, chunk.mask, g, p, m, v, u);
  }
};

template <typename Real, typename Lists>
struct AdamChunkOp : MultiTensorOpBase {
  static constexpr int kLists = Lists::kCount;

  const int32_t* count;
  int32_t* new_count;
  ScalarVector hyper;
  ScalarVector grad_ctrl;
  bool nesterov;
  bool complex;
  AdamStep<Real> step;

  __device__ void prepare() {
    const int32_t c = *count;
    step = make_adam_step<Real>(hyper, grad_ctrl, c, nesterov, complex);
    if (blockIdx.x == 0 && threadIdx.x == 0) *new_count = adam_next_count(c, step.grad.skip);
  }

  __device__ void operator()(const ChunkRef<kLists>& chunk) const {
    for_each_group(chunk, [&](int64_t i, int n, bool vec) {
      // A short group (n < 4; even for complex tensors) computes all 4 lanes and stores n.
      const RegisterGroup<Real, kLists> group{chunk, i, n, vec};
      adam_group(step, Lists{}, group);
    });
  }
};

template <typename Real, typename Lists>
ffi::Error launch_adam(cudaStream_t stream, const AdamOp::Call& call) {
  using Op = AdamChunkOp<Real, Lists>;
  Op op;
  op.count = call.count;
  op.new_count = call.new_count;
  op.hyper = call.hyper;
  op.grad_ctrl = call.grad_ctrl;
  op.nesterov = call.nesterov;
  op.complex = call.complex;
  return multi_tensor_apply<Op::kLists>(stream, call.tensors, op);
}

// The layouts adam_layout() allows (decode checked), each one kernel per compute type.
template <typename Real>
ffi::Error launch_for_layout(cudaStream_t stream, const AdamOp::Call& call) {
  const bool master = call.lists.master >= 0;
  if (call.lists.updates < 0) {  // the fused step: params present
    return master ? launch_adam<Real, StaticAdamLists<false, true, true>>(stream, call)
                  : launch_adam<Real, StaticAdamLists<false, false, true>>(stream, call);
  }
  if (master) return launch_adam<Real, StaticAdamLists<true, true, true>>(stream, call);
  return call.lists.params >= 0
             ? launch_adam<Real, StaticAdamLists<true, false, true>>(stream, call)
             : launch_adam<Real, StaticAdamLists<true, false, false>>(stream, call);
}

}  // namespace

template <>
ffi::Error AdamOp::run<Cuda>(cudaStream_t stream, const Call& call) {
  return call.f64 ? launch_for_layout<double>(stream, call) : launch_for_layout<float>(stream, call);
}

JAXFUSE_REGISTER_OP(AdamOp, Cuda);

}  // namespace jaxfuse
