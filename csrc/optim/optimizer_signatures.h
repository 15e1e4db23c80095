// The dtype signatures the CUDA optimizer driver (csrc/optim/cuda/optimizer.cuh) compiles a kernel
// for, with every storage dtype fixed at compile time: straight-line 16- and 8-byte loads that
// the compiler issues together, no dtype branches, fewer registers. A call is split by signature
// into one launch each; tensors whose dtypes match none (float64 calls, complex, float16 params
// without a master copy, grads of another dtype than their params, states of different dtypes)
// go to the kernel that reads each list's dtype from its table at run time.
//
// Host code too, so that the launch count of a call can be told without a GPU.
#pragma once

#include <string>
#include <vector>

#include "core/dtype.h"
#include "optim/multi_tensor_plan.h"
#include "optim/tensor_lists.h"

namespace jaxfuse {

// How a call keeps its params, one kernel each.
enum class ParamsMode { kPlain, kMaster, kRemainders };

// A signature: the dtype of the grads and params, and of every float state list (ignored for a
// layout without float states: none, or 8-bit codes). A master copy is float32.
struct KernelSignature {
  DType params;
  DType states;
};

// The signatures users train with: float32 everything; bfloat16 params and moments (optax's
// default for bfloat16 params); float32 params with bfloat16 moments (mu_dtype and nu_dtype);
// bfloat16 params with float32 moments (a master copy, remainders or stochastic rounding);
// float16 params with a float32 master (loss scaling).
inline constexpr int kNumKernelSignatures = 5;
JF_HD constexpr KernelSignature kernel_signature(int s) {
  return s == 0   ? KernelSignature{DType::kF32, DType::kF32}
         : s == 1 ? KernelSignature{DType::kBF16, DType::kBF16}
         : s == 2 ? KernelSignature{DType::kF32, DType::kBF16}
         : s == 3 ? KernelSignature{DType::kBF16, DType::kF32}
                  : KernelSignature{DType::kF16, DType::kF32};
}

// Whether a float32 layout has a kernel for signature s. A layout without float states has one
// per params dtype (the signatures whose states are float32).
JF_HD constexpr bool has_signature_kernel(int s, ParamsMode mode, bool float_states) {
  const KernelSignature sig = kernel_signature(s);
  if (!float_states && sig.states != DType::kF32) return false;
  switch (mode) {
    case ParamsMode::kPlain: return s <= 3;
    case ParamsMode::kMaster: return sig.params == DType::kBF16 || sig.params == DType::kF16;
    case ParamsMode::kRemainders: return sig.params == DType::kBF16;
  }
  return false;
}

// The signature kernel that takes tensor `dtypes` (its lists' dtypes) of a float32 call, or -1:
// grads and params of the signature's params dtype, float states of its states dtype, a master
// copy float32; other lists (remainders, codes, block scales) have one dtype each.
inline int find_kernel_signature(const std::array<DType, kMaxLists>& dtypes, ParamsMode mode,
                                 int num_states, bool float_states) {
  for (int s = 0; s < kNumKernelSignatures; ++s) {
    if (!has_signature_kernel(s, mode, float_states)) continue;
    const KernelSignature sig = kernel_signature(s);
    bool match = dtypes[0] == sig.params && dtypes[1] == sig.params;
    for (int k = 0; k < num_states && float_states; ++k) match &= dtypes[2 + k] == sig.states;
    if (mode == ParamsMode::kMaster) match &= dtypes[2 + num_states] == DType::kF32;
    if (match) return s;
  }
  return -1;
}

// The float dtype of a buffer by its HLO element type (complex as its parts), kF32 for the
// lists that hold no floats (their dtype takes no part in the choice of a kernel).
inline DType hlo_float_dtype(const std::string& t) {
  if (t == "f64" || t == "c128") return DType::kF64;
  if (t == "bf16") return DType::kBF16;
  if (t == "f16") return DType::kF16;
  return DType::kF32;
}

// Per tensor of a call laid out as `lists` (an OptimizerLists), whose lists have the dtypes
// `rows`: the signature kernel that takes it, or -1 (every tensor of a float64 call).
template <typename Lists>
std::vector<int> tensor_signatures(const std::vector<std::array<DType, kMaxLists>>& rows,
                                   const Lists& lists) {
  const ParamsMode mode = lists.master >= 0       ? ParamsMode::kMaster
                          : lists.remainders >= 0 ? ParamsMode::kRemainders
                                                  : ParamsMode::kPlain;
  bool f64 = false;
  for (const auto& row : rows) f64 |= computes_in_double(row.data(), lists.count());
  std::vector<int> out;
  for (const auto& row : rows) {
    out.push_back(f64 ? -1
                      : find_kernel_signature(row, mode, lists.num_states,
                                              lists.num_states > 0 && !lists.quantized));
  }
  return out;
}

// The CUDA launches of such a call over tensors of `sizes` scalars: the driver's split by
// signature, each group in as many launches as its tables take; the tensors no signature takes
// in one more group, which also runs an empty call.
template <typename Lists>
int64_t signature_launches(const Lists& lists, const std::vector<std::array<DType, kMaxLists>>& rows,
                           const std::vector<int64_t>& sizes) {
  const std::vector<int> signatures = tensor_signatures(rows, lists);
  std::vector<int64_t> groups[kNumKernelSignatures + 1];  // [0]: no signature
  for (size_t t = 0; t < rows.size(); ++t) groups[signatures[t] + 1].push_back(sizes[t]);
  int64_t launches = 0;
  for (int s = 1; s <= kNumKernelSignatures; ++s) {
    if (!groups[s].empty()) launches += multi_tensor_launches(lists.count(), groups[s]);
  }
  if (!groups[0].empty() || launches == 0) {
    launches += multi_tensor_launches(lists.count(), groups[0]);
  }
  return launches;
}

}  // namespace jaxfuse
