// The CUDA driver of the optimizer op (optimizer.h), one for every family: every leaf in one
// multi-tensor launch (a few for very many leaves). Each thread runs optimizer_group() (the
// CPU's program too) on groups of 4 scalars held in registers, in float (double for float64
// calls), with 16-byte (32-/64-bit) or 8-byte (16-bit) accesses when aligned. Each list layout
// (number of states, master copy or not) is its own kernel, with no branches on it.
//
// A family's CUDA file is one line, JAXFUSE_CUDA_OPTIMIZER(Family).
#pragma once

#include <type_traits>

#include "jaxfuse/optimizer.h"
#include "multi_tensor.cuh"

namespace jaxfuse {
namespace cuda_optimizer {

// How a call keeps its params, one kernel each.
enum class ParamsMode { kPlain, kMaster, kRemainders };

// OptimizerLists as compile-time constants. Device code reads only the scalars: the layout
// object itself lives in host memory (--expt-relaxed-constexpr lets device code call its
// constexpr members, but a call that is not folded at compile time reads the host object, which
// nvcc compiles to a trap). tools/kernel_report.py fails on any such trap.
template <int kStates, ParamsMode kMode, bool kQuantized>
struct StaticLists {
 private:
  static constexpr OptimizerLists kLayout = OptimizerLists::of(
      kStates, kMode == ParamsMode::kMaster, kMode == ParamsMode::kRemainders, kQuantized);

 public:
  static constexpr int num_states = kStates;
  static constexpr int master = kLayout.master;
  static constexpr int remainders = kLayout.remainders;
  static constexpr bool quantized = kQuantized;
  static constexpr int kCount = kLayout.count();
  static constexpr int kUnscaledCount = kLayout.unscaled_count();
  static constexpr int kParamSource = kLayout.param_source();
  static constexpr int param_source() { return kParamSource; }
  static constexpr int scales(int k) { return kUnscaledCount + k; }
};

// A warp's 32 groups of 4 are one block of an 8-bit state: chunks and slices hold whole blocks,
// and quantized tensors too, so every lane of a warp that starts a block is active.
static_assert(kMomentBlock == 32 * 4, "one warp per block of an 8-bit state");
static_assert(kMultiTensorChunk % kMomentBlock == 0, "chunks hold whole blocks");

// optimizer_group()'s view of 4 consecutive scalars of one chunk.
template <typename Family, typename Real, int kLists>
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
  __device__ void load_words(int list, Real* x) const {
    load_word_group(chunk.ptr[list], i, n, vec, x);
  }
  __device__ void store_words(int list, const Real* x) const {
    store_word_group(chunk.ptr[list], i, n, vec, x);
  }
  // 8-bit states (moment_codes.h): each thread its 4 codes, the warp's lanes one block.
  __device__ void load_codes(int list, int scale_list, Real* x) const {
    const bool is_signed = chunk.dtype[list] == DType::kI8;
    const float scale = static_cast<const float*>(chunk.ptr[scale_list])[i / kMomentBlock];
    const uint32_t word =
        *reinterpret_cast<const uint32_t*>(static_cast<const uint8_t*>(chunk.ptr[list]) + i);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      x[j] = Real(decode_moment(uint8_t(word >> (8 * j)), scale, is_signed));
    }
  }
  __device__ void store_codes(int list, int scale_list, const Real* x) const {
    const bool is_signed = chunk.dtype[list] == DType::kI8;
    uint32_t largest = 0;
#pragma unroll
    for (int j = 0; j < 4; ++j) largest = max(largest, magnitude_bits(float(x[j])));
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      largest = max(largest, __shfl_xor_sync(0xffffffffu, largest, o));
    }
    const float scale = moment_scale(largest, is_signed);
    if (i % kMomentBlock == 0) static_cast<float*>(chunk.ptr[scale_list])[i / kMomentBlock] = scale;
    const float inverse = 1.0f / scale;
    uint32_t word = 0;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      word |= uint32_t(encode_moment(float(x[j]), inverse, is_signed)) << (8 * j);
    }
    *reinterpret_cast<uint32_t*>(static_cast<uint8_t*>(chunk.ptr[list]) + i) = word;
  }
  __device__ void round_stochastically(uint32_t stream, Real* x) const {
    stochastic_round_run(chunk.dtype[OptimizerLists::kParams], stream, chunk.offset + i, 4, x);
  }
  __device__ void update(const typename Family::template Step<Real>& s, const Real* g,
                         const Real* p, Real* s0, Real* s1, Real* s2, Real* u) const {
    Family::update(s, 4, chunk.mask, g, p, s0, s1, s2, u);
  }
  __device__ void direction(const typename Family::template Step<Real>& s, const Real* g,
                            const Real* p, const Real* s0, const Real* s1, const Real* s2,
                            Real* d) const {
    Family::direction(s, 4, chunk.mask, g, p, s0, s1, s2, d);
  }
};

template <typename Family, typename Real, typename Lists>
struct ChunkOp : MultiTensorOpBase {
  static constexpr int kLists = Lists::kCount;

  const int32_t* count;
  int32_t* new_count;
  ScalarVector hyper;
  ScalarVector grad_ctrl;
  TrustSums trust_sums;
  const uint32_t* rounding_keys;
  uint32_t flags;
  bool complex;
  OptimizerStep<Family, Real> step;

  __device__ void prepare() {
    const int32_t c = *count;
    step = make_optimizer_step<Family, Real>(hyper, grad_ctrl, c, flags, complex, rounding_keys);
    if (blockIdx.x == 0 && threadIdx.x == 0) *new_count = next_count(c, step.grad.skip);
  }

  __device__ void operator()(const ChunkRef<kLists>& chunk) const {
    const auto tensor = tensor_step(step, trust_sums, chunk.tensor, chunk.mask);
    for_each_group(chunk, [&](int64_t i, int n, bool vec) {
      // A short group (n < 4; even for complex tensors) computes all 4 lanes and stores n.
      const RegisterGroup<Family, Real, kLists> group{chunk, i, n, vec};
      optimizer_group(tensor, Lists{}, group);
    });
  }
};

// A step streams every byte once: its kernels must keep enough loads in flight (DESIGN.md).
JF_KERNEL_BUDGET("\\bChunkOp<", 64, 50, 0);
JF_KERNEL_GAP("\\bChunkOp<\\w+, float", 120, 25, 0,
              "issue 39: dtypes dispatched at run time in the loop, loads behind the clip scale");
JF_KERNEL_GAP("\\bChunkOp<\\w+, double", 168, 12, 0,
              "issue 39: float64 math in registers, dtypes dispatched at run time");
JF_KERNEL_GAP("\\bChunkOp<(Rmsprop, float, 1 states, master|Rmsprop, float, 2 states, plain|"
              "Lion, float, 1 states, remainders, 8-bit|Sgd, float, 1 states, master, 8-bit)>",
              64, 50, 32, "issue 39: registers spilled (4-16 B) in these instances");

template <typename Family, typename Real, int kStates, ParamsMode kMode, bool kQuantized>
ffi::Error launch(cudaStream_t stream, const typename OptimizerOp<Family>::Call& call) {
  using Op = ChunkOp<Family, Real, StaticLists<kStates, kMode, kQuantized>>;
  Op op;
  op.count = call.count;
  op.new_count = call.new_count;
  op.hyper = call.hyper;
  op.grad_ctrl = call.grad_ctrl;
  op.trust_sums = call.trust_sums;
  op.rounding_keys = call.rounding_keys;
  op.flags = call.flags;
  op.complex = call.complex;
  return multi_tensor_apply<Op::kLists>(stream, call.tensors, op);
}

// fn(std::integral_constant<int, num_states>): kernels only for the state counts the family
// allows.
template <typename Family, int kStates = 0, typename Fn>
ffi::Error with_state_count(int num_states, const Fn& fn) {
  if constexpr (kStates > kMaxOptimizerStates) {
    return internal_error("no kernel for ", num_states, " state lists");
  } else {
    if constexpr (Family::allows_states(kStates)) {
      if (num_states == kStates) return fn(std::integral_constant<int, kStates>{});
    }
    return with_state_count<Family, kStates + 1>(num_states, fn);
  }
}

// The kernel for the call's params mode, with its states as floats or as 8-bit codes. Codes
// and remainders are computed in float (the op checks), and trust-ratio families take neither:
// no kernels for those layouts.
template <typename Family, typename Real, int kStates, bool kQuantized>
ffi::Error launch_for_params(cudaStream_t stream, const typename OptimizerOp<Family>::Call& call) {
  if (call.lists.master >= 0) {
    return launch<Family, Real, kStates, ParamsMode::kMaster, kQuantized>(stream, call);
  }
  if (call.lists.remainders >= 0) {
    if constexpr (std::is_same_v<Real, float> && !kHasTrustRatio<Family>) {
      return launch<Family, Real, kStates, ParamsMode::kRemainders, kQuantized>(stream, call);
    }
    return internal_error("no kernel for remainders in this call");
  }
  return launch<Family, Real, kStates, ParamsMode::kPlain, kQuantized>(stream, call);
}

template <typename Family, typename Real>
ffi::Error launch_for_layout(cudaStream_t stream, const typename OptimizerOp<Family>::Call& call) {
  return with_state_count<Family>(call.lists.num_states, [&](auto states) {
    constexpr int kStates = decltype(states)::value;
    if (call.lists.quantized) {
      if constexpr (std::is_same_v<Real, float> && !kHasTrustRatio<Family> && kStates > 0) {
        return launch_for_params<Family, Real, kStates, true>(stream, call);
      }
      return internal_error("no kernel for quantized states in this call");
    }
    return launch_for_params<Family, Real, kStates, false>(stream, call);
  });
}

}  // namespace cuda_optimizer

// Registers Family's CUDA handler.
#define JAXFUSE_CUDA_OPTIMIZER(Family)                                                         \
  template <>                                                                                  \
  template <>                                                                                  \
  ffi::Error OptimizerOp<Family>::run<Cuda>(cudaStream_t stream, const Call& call) {           \
    return call.f64 ? cuda_optimizer::launch_for_layout<Family, double>(stream, call)          \
                    : cuda_optimizer::launch_for_layout<Family, float>(stream, call);          \
  }                                                                                            \
  JAXFUSE_REGISTER_OP(OptimizerOp<Family>, Cuda)

}  // namespace jaxfuse
