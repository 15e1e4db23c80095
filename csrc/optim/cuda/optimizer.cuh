// The CUDA driver of the optimizer op (optimizer.h), one for every family: the leaves of a call
// in one multi-tensor launch per dtype signature (optimizer_signatures.h; a few launches for very
// many leaves). Each thread runs optimizer_group() (the CPU's program too) on groups of 4 scalars
// held in registers, in float (double for float64 calls), with 16-byte (32-/64-bit) or 8-byte
// (16-bit) accesses when aligned, every load of a group issued before its math. Each list layout
// (number of states, params mode, 8-bit states) and signature is its own kernel, with no branches
// on them; the tensors no signature takes run a kernel that reads each list's dtype per chunk.
//
// A family's CUDA file is one line, JAXFUSE_CUDA_OPTIMIZER(Family).
#pragma once

#include <type_traits>

#include "optim/optimizer.h"
#include "optim/optimizer_signatures.h"
#include "optim/cuda/multi_tensor.cuh"

namespace jaxfuse {
namespace cuda_optimizer {

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

// The storage dtypes of a kernel's float lists: fixed by a signature (optimizer_signatures.h),
// so that each access is one straight-line load or store, or read from the table per chunk
// (the fallback for the tensors no signature takes).
template <DType kParams, DType kStates>
struct FixedDTypes {
  static constexpr bool kFixed = true;
  template <typename Lists>
  static JF_HD constexpr DType of(int list) {
    return list <= OptimizerLists::kParams                      ? kParams
           : list < OptimizerLists::state(Lists::num_states)   ? kStates
                                                                : DType::kF32;  // the master
  }
};
template <int kSignature>
using SignatureDTypes =
    FixedDTypes<kernel_signature(kSignature).params, kernel_signature(kSignature).states>;

struct TableDTypes {
  static constexpr bool kFixed = false;
};

// A warp's 32 groups of 4 are one block of an 8-bit state: chunks and slices hold whole blocks,
// and quantized tensors too, so every lane of a warp that starts a block is active.
static_assert(kMomentBlock == 32 * 4, "one warp per block of an 8-bit state");
static_assert(kMultiTensorChunk % kMomentBlock == 0, "chunks hold whole blocks");

// A thread's groups of 4 consecutive scalars are this far apart: a block's groups tile a span.
inline constexpr int kGroupStride = kMultiTensorThreads * 4;

// optimizer_group()'s view of a thread's kGroups groups of 4 consecutive scalars of one chunk,
// kGroupStride apart, in registers. kVector: every group whole and aligned, so each access is
// one vector load or store (16 bytes for 32-bit lists, 8 for 16-bit); else one group whose `n`
// valid scalars take vector accesses when `vec`, scalar ones otherwise.
template <typename Family, typename Real, typename Lists, typename DTypes, int kGroups,
          bool kVector>
struct RegisterGroup {
  static_assert(kVector || kGroups == 1, "a short or unaligned group stands alone");
  using Values = Real[4 * kGroups];
  const ChunkRef<Lists::kCount>& chunk;
  int64_t i;  // first scalar
  int n;      // valid scalars (the others are computed and dropped)
  bool vec;   // vector access allowed

  static constexpr int size() { return 4 * kGroups; }
  __device__ int valid() const { return kVector ? 4 * kGroups : n; }
  __device__ DType dtype(int list) const {
    if constexpr (DTypes::kFixed) {
      return DTypes::template of<Lists>(list);
    } else {
      return chunk.dtype[list];
    }
  }
  __device__ void load(int list, Real* x) const {
    const void* base = chunk.ptr[list];
    if constexpr (kVector) {
      visit_dtype(dtype(list), [&](auto tag) {
#pragma unroll
        for (int g = 0; g < kGroups; ++g) {
          load4<decltype(tag)::value>(base, i + g * kGroupStride, x + 4 * g);
        }
      });
    } else {
      load_group(base, dtype(list), i, n, vec, x);
    }
  }
  __device__ void store(int list, const Real* x) const {
    void* base = chunk.ptr[list];
    if constexpr (kVector) {
      visit_dtype(dtype(list), [&](auto tag) {
#pragma unroll
        for (int g = 0; g < kGroups; ++g) {
          store4<decltype(tag)::value>(base, i + g * kGroupStride, x + 4 * g);
        }
      });
    } else {
      store_group(base, dtype(list), i, n, vec, x);
    }
  }
  __device__ void load_words(int list, Real* x) const {
#pragma unroll
    for (int g = 0; g < kGroups; ++g) {
      load_word_group(chunk.ptr[list], i + g * kGroupStride, n, kVector || vec, x + 4 * g);
    }
  }
  __device__ void store_words(int list, const Real* x) const {
#pragma unroll
    for (int g = 0; g < kGroups; ++g) {
      store_word_group(chunk.ptr[list], i + g * kGroupStride, n, kVector || vec, x + 4 * g);
    }
  }
  // 8-bit states (moment_codes.h): each thread its 4 codes per group, the warp's lanes one block.
  __device__ void load_codes(int list, int scale_list, Real* x) const {
    const bool is_signed = chunk.dtype[list] == DType::kI8;
    const float* scales = static_cast<const float*>(chunk.ptr[scale_list]);
    const uint8_t* codes = static_cast<const uint8_t*>(chunk.ptr[list]);
    uint32_t words[kGroups];
    float scale[kGroups];
#pragma unroll
    for (int g = 0; g < kGroups; ++g) {
      const int64_t first = i + g * kGroupStride;
      words[g] = *reinterpret_cast<const uint32_t*>(codes + first);
      scale[g] = scales[first / kMomentBlock];
    }
#pragma unroll
    for (int g = 0; g < kGroups; ++g) {
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        x[4 * g + j] = Real(decode_moment(uint8_t(words[g] >> (8 * j)), scale[g], is_signed));
      }
    }
  }
  __device__ void store_codes(int list, int scale_list, const Real* x) const {
    const bool is_signed = chunk.dtype[list] == DType::kI8;
#pragma unroll
    for (int g = 0; g < kGroups; ++g) {
      const int64_t first = i + g * kGroupStride;
      uint32_t largest = 0;
#pragma unroll
      for (int j = 0; j < 4; ++j) largest = max(largest, magnitude_bits(float(x[4 * g + j])));
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) {
        largest = max(largest, __shfl_xor_sync(0xffffffffu, largest, o));
      }
      const float scale = moment_scale(largest, is_signed);
      if (first % kMomentBlock == 0) {
        static_cast<float*>(chunk.ptr[scale_list])[first / kMomentBlock] = scale;
      }
      const float inverse = 1.0f / scale;
      uint32_t word = 0;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        word |= uint32_t(encode_moment(float(x[4 * g + j]), inverse, is_signed)) << (8 * j);
      }
      *reinterpret_cast<uint32_t*>(static_cast<uint8_t*>(chunk.ptr[list]) + first) = word;
    }
  }
  __device__ void round_stochastically(uint32_t stream, Real* x) const {
    const DType t = dtype(OptimizerLists::kParams);
#pragma unroll
    for (int g = 0; g < kGroups; ++g) {
      stochastic_round_run(t, stream, chunk.offset + i + g * kGroupStride, 4, x + 4 * g);
    }
  }
  __device__ void update(const typename Family::template Step<Real>& s, const Real* g,
                         const Real* p, Real* s0, Real* s1, Real* s2, Real* u) const {
    Family::update(s, size(), chunk.mask, g, p, s0, s1, s2, u);
  }
  __device__ void direction(const typename Family::template Step<Real>& s, const Real* g,
                            const Real* p, const Real* s0, const Real* s1, const Real* s2,
                            Real* d) const {
    Family::direction(s, size(), chunk.mask, g, p, s0, s1, s2, d);
  }
};

// Bytes a thread loads for one group of a kernel with fixed dtypes.
template <typename Lists, typename DTypes>
constexpr int group_load_bytes() {
  int bytes = 4 * dtype_bytes(DTypes::template of<Lists>(OptimizerLists::kGrads)) +
              4 * dtype_bytes(DTypes::template of<Lists>(Lists::param_source()));
  for (int k = 0; k < Lists::num_states; ++k) {
    bytes += Lists::quantized ? 4 + 4  // codes, block scale
                              : 4 * dtype_bytes(DTypes::template of<Lists>(OptimizerLists::state(k)));
  }
  return bytes + (Lists::remainders >= 0 ? 8 : 0);
}

// Groups a thread keeps in flight, all their loads issued before any math. Little's law asks
// ~17 KB in flight per H100 SM (3.35 TB/s x ~700 ns over 132 SMs); 1024 resident threads with
// 32 bytes each hold twice that, so a kernel whose group loads less takes two groups at a time.
// The table's dtypes branch each access and float64 math is register-bound: one group.
template <typename Real, typename Lists, typename DTypes>
constexpr int groups_in_flight() {
  if constexpr (DTypes::kFixed && std::is_same_v<Real, float>) {
    return group_load_bytes<Lists, DTypes>() < 32 ? 2 : 1;
  }
  return 1;
}

// Calls program(group) over the block's share of a chunk: groups_in_flight() vector groups per
// step while whole ones remain (aligned chunks), then one group per step. With 8-bit states,
// chunks and tensors hold whole blocks, so each step's condition is the same for a whole warp.
template <typename Family, typename Real, typename Lists, typename DTypes, typename Program>
__device__ __forceinline__ void for_each_register_group(const ChunkRef<Lists::kCount>& chunk,
                                                        Program&& program) {
  constexpr int kGroups = groups_in_flight<Real, Lists, DTypes>();
  int i = threadIdx.x * 4;
  if (chunk.aligned) {
    for (; i + (kGroups - 1) * kGroupStride + 4 <= chunk.n; i += kGroups * kGroupStride) {
      program(RegisterGroup<Family, Real, Lists, DTypes, kGroups, true>{chunk, chunk.start + i,
                                                                        4, true});
    }
  }
  for (; i < chunk.n; i += kGroupStride) {
    const int n = min(4, chunk.n - i);
    program(RegisterGroup<Family, Real, Lists, DTypes, 1, false>{chunk, chunk.start + i, n,
                                                                 chunk.aligned && n == 4});
  }
}

// Resident blocks per SM the step kernels are compiled for (their register cap): with fixed
// dtypes 4 (64 registers, half the SM's warps), one fewer for three float states and one fewer
// for 8-bit ones (their signedness read at run time, a block's maximum reduced across the warp
// with the other values live); 2 (128) where the table's dtypes branch each access; float64
// math holds twice the registers and takes what it needs. Each keeps over Little's law in flight.
template <typename Real, typename Lists, typename DTypes>
inline constexpr int kOptimizerMinBlocks =
    !std::is_same_v<Real, float> ? 1
    : !DTypes::kFixed            ? 2
                                 : 4 - int(Lists::quantized) - int(Lists::num_states > 2);

template <typename Family, typename Real, typename Lists, typename DTypes>
struct ChunkOp : MultiTensorOpBase {
  static constexpr int kLists = Lists::kCount;
  static constexpr int kMinBlocksPerSM = kOptimizerMinBlocks<Real, Lists, DTypes>;

  const int32_t* count;
  int32_t* new_count;
  ScalarVector hyper;
  ScalarVector grad_ctrl;
  TrustSums trust_sums;
  const uint32_t* rounding_keys;
  uint32_t flags;
  bool complex;
  OptimizerStep<Family, Real> step;

  // The step's scalars, the gradient control included, are read here, once per block: never
  // between a group's loads.
  __device__ void prepare() {
    const int32_t c = *count;
    step = make_optimizer_step<Family, Real>(hyper, grad_ctrl, c, flags, complex, rounding_keys);
    if (blockIdx.x == 0 && threadIdx.x == 0) *new_count = next_count(c, step.grad.skip);
  }

  __device__ void operator()(const ChunkRef<kLists>& chunk) const {
    const auto tensor = tensor_step(step, trust_sums, chunk.tensor, chunk.mask);
    // A short group (n < 4; even for complex tensors) computes all 4 lanes and stores n.
    for_each_register_group<Family, Real, Lists, DTypes>(
        chunk, [&](const auto& group) { optimizer_group(tensor, Lists{}, group); });
  }
};

// A step streams every byte once: its kernels must keep enough loads in flight (DESIGN.md) at
// the register caps above. Three float states or 8-bit ones hold more values than 64 registers:
// a few bytes of (L1-resident) spills at 80 registers cost less than a third fewer warps.
JF_KERNEL_BUDGET("\\bChunkOp<\\w+, float, [012] states, \\w+, \\w+ params", 64, 50, 0);
JF_KERNEL_BUDGET("\\bChunkOp<\\w+, float, (3 states, \\w+|[012] states, \\w+, 8-bit), \\w+ params", 80,
                 37, 128);
JF_KERNEL_BUDGET("\\bChunkOp<\\w+, float, 3 states, \\w+, 8-bit, \\w+ params", 128, 25, 0);
JF_KERNEL_BUDGET("\\bChunkOp<\\w+, float, [^>]*table dtypes", 128, 25, 0);
JF_KERNEL_BUDGET("\\bChunkOp<\\w+, double", 168, 12, 0);
// With fixed dtypes a group's loads go out together: one per list it reads (a state's 8-bit
// codes counted once, their scales apart), issued before any is read. Three 8-bit states are the
// exception (ptxas decodes each state's codes before the next state's loads there).
JF_KERNEL_LOADS("\\bChunkOp<\\w+, float, 0 states, \\w+, \\w+ params", 2);
JF_KERNEL_LOADS("\\bChunkOp<\\w+, float, 1 states, \\w+(, 8-bit)?, \\w+ params", 3);
JF_KERNEL_LOADS("\\bChunkOp<\\w+, float, 2 states, \\w+(, 8-bit)?, \\w+ params", 4);
JF_KERNEL_LOADS("\\bChunkOp<\\w+, float, 3 states, \\w+, \\w+ params", 5);

template <typename Family, typename Real, int kStates, ParamsMode kMode, bool kQuantized,
          typename DTypes>
ffi::Error launch(cudaStream_t stream, const typename OptimizerOp<Family>::Call& call,
                  const std::vector<int32_t>* subset) {
  using Op = ChunkOp<Family, Real, StaticLists<kStates, kMode, kQuantized>, DTypes>;
  Op op;
  op.count = call.count;
  op.new_count = call.new_count;
  op.hyper = call.hyper;
  op.grad_ctrl = call.grad_ctrl;
  op.trust_sums = call.trust_sums;
  op.rounding_keys = call.rounding_keys;
  op.flags = call.flags;
  op.complex = call.complex;
  return multi_tensor_apply<Op::kLists>(stream, call.tensors, op, 0, nullptr, subset);
}

// The tensors of a call grouped by the signature kernel that takes them (-1: none).
struct SignatureGroups {
  std::vector<int32_t> by_signature[kNumKernelSignatures];
  std::vector<int32_t> rest;
};

inline SignatureGroups group_by_signature(const TensorLists& tensors,
                                          const OptimizerLists& lists) {
  SignatureGroups groups;
  const std::vector<int> signatures = tensor_signatures(tensors.dtype, lists);
  for (size_t t = 0; t < signatures.size(); ++t) {
    const int s = signatures[t];
    (s >= 0 ? groups.by_signature[s] : groups.rest).push_back(static_cast<int32_t>(t));
  }
  return groups;
}

// Launches the signature kernels of a float32 layout, from signature kSignature on, each over
// its tensors.
template <typename Family, int kStates, ParamsMode kMode, bool kQuantized, int kSignature = 0>
ffi::Error launch_signatures(cudaStream_t stream, const typename OptimizerOp<Family>::Call& call,
                             const SignatureGroups& groups) {
  if constexpr (kSignature < kNumKernelSignatures) {
    constexpr bool kFloatStates = kStates > 0 && !kQuantized;
    if constexpr (has_signature_kernel(kSignature, kMode, kFloatStates)) {
      const std::vector<int32_t>& tensors = groups.by_signature[kSignature];
      if (!tensors.empty()) {
        JF_RETURN_IF_ERROR((launch<Family, float, kStates, kMode, kQuantized,
                                   SignatureDTypes<kSignature>>(stream, call, &tensors)));
      }
    }
    return launch_signatures<Family, kStates, kMode, kQuantized, kSignature + 1>(stream, call,
                                                                                  groups);
  }
  return ffi::Error::Success();
}

// The call split by signature: one launch per signature kernel with tensors, the tensors no
// signature takes (and float64 calls) in the fallback, which also runs an empty call (it writes
// the count).
template <typename Family, typename Real, int kStates, ParamsMode kMode, bool kQuantized>
ffi::Error launch_by_signature(cudaStream_t stream,
                               const typename OptimizerOp<Family>::Call& call) {
  if constexpr (std::is_same_v<Real, float>) {
    const SignatureGroups groups = group_by_signature(call.tensors, call.lists);
    if (groups.rest.size() < static_cast<size_t>(call.tensors.num_tensors())) {
      JF_RETURN_IF_ERROR(
          (launch_signatures<Family, kStates, kMode, kQuantized>(stream, call, groups)));
      if (groups.rest.empty()) return ffi::Error::Success();
      return launch<Family, Real, kStates, kMode, kQuantized, TableDTypes>(stream, call,
                                                                           &groups.rest);
    }
  }
  return launch<Family, Real, kStates, kMode, kQuantized, TableDTypes>(stream, call, nullptr);
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
// and remainders are computed in float (the op checks); trust-ratio families take neither, and
// a family whose states 8 bits cannot hold no codes: no kernels for those layouts.
template <typename Family, typename Real, int kStates, bool kQuantized>
ffi::Error launch_for_params(cudaStream_t stream, const typename OptimizerOp<Family>::Call& call) {
  if (call.lists.master >= 0) {
    return launch_by_signature<Family, Real, kStates, ParamsMode::kMaster, kQuantized>(stream, call);
  }
  if (call.lists.remainders >= 0) {
    if constexpr (std::is_same_v<Real, float> && !kHasTrustRatio<Family>) {
      return launch_by_signature<Family, Real, kStates, ParamsMode::kRemainders, kQuantized>(stream,
                                                                                     call);
    }
    return internal_error("no kernel for remainders in this call");
  }
  return launch_by_signature<Family, Real, kStates, ParamsMode::kPlain, kQuantized>(stream, call);
}

template <typename Family, typename Real>
ffi::Error launch_for_layout(cudaStream_t stream, const typename OptimizerOp<Family>::Call& call) {
  return with_state_count<Family>(call.lists.num_states, [&](auto states) {
    constexpr int kStates = decltype(states)::value;
    if (call.lists.quantized) {
      if constexpr (std::is_same_v<Real, float> && kTakesQuantizedStates<Family> && kStates > 0) {
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
