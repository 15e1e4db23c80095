// The first pass of a trust-ratio family (LAMB, LARS; optimizer.h): per tensor, the sums of the
// squares of its params and of its direction (the update before the ratio), accumulated in
// double in a fixed order, so that they are the same on every run. The optimizer op then reads
// them (its trust_sums operand) and scales each tensor's update by its ratio. The direction is
// computed again there rather than stored: one more read of the lists instead of writing and
// reading a direction buffer, and nothing to allocate (apex's FusedLAMB stores it).
//
// <Family::kTrustSumsName>
//   operands: count s32[], hyper, grad_ctrl (the optimizer op's), then n buffers per list:
//             grads, params (the master copy when the step keeps one), the first
//             Family::kDirectionStates state lists (those the direction reads)
//   results:  sums u32[n, kTrustSumWords] (a TrustSum per tensor), workspace
//             u8[kTrustPartialBytes * chunks] (the GPU's per-chunk partials; chunks: the sum over
//             tensors of ceil(scalars / kMultiTensorChunk))
//   attrs:    num_tensors, flags, tensor_flags (the optimizer op's)
#pragma once

#include <string>

#include "optim/optimizer.h"

namespace jaxfuse {

inline constexpr int64_t kTrustPartialBytes = sizeof(TrustSum);

// One group through the first pass: the params the ratio's param norm is of, and the direction.
// `Group` is the optimizer's (optimizer_group()) with direction(step, g, p, s0, s1, s2, d), the
// family's direction() over the group; the states are read, never written.
template <typename Family, typename Real, typename Lists, typename Group>
JF_HD void trust_group(const OptimizerStep<Family, Real>& step, const Lists& lists,
                       const Group& group, Real* p, Real* d) {
  typename Group::Values g, s0, s1, s2;
  group.load(OptimizerLists::kGrads, g);  // every load first, as optimizer_group()
  group.load(OptimizerLists::kParams, p);
  if (lists.num_states > 0) group.load(OptimizerLists::state(0), s0);
  if (lists.num_states > 1) group.load(OptimizerLists::state(1), s1);
  if (lists.num_states > 2) group.load(OptimizerLists::state(2), s2);
  scale_group(step.grad, group.size(), g);
  group.direction(step.math, g, p, s0, s1, s2, d);
}

template <typename Family>
struct TrustSumsOp {
  static constexpr const char* kName = Family::kTrustSumsName;
  using Hyper = typename Family::Hyper;

  struct Call {
    TensorLists tensors;  // OptimizerLists order, no master list; mask: the tensor flags
    OptimizerLists lists;
    const int32_t* count = nullptr;
    ScalarVector hyper;
    ScalarVector grad_ctrl;
    uint32_t flags = 0;
    bool f64 = false;
    bool complex = false;          // every tensor is complex
    uint32_t* sums = nullptr;      // [n][kTrustSumWords]
    TrustSum* partials = nullptr;  // [chunks], the GPU's
  };

  template <typename Context>
  static auto binding() {
    return ffi::Ffi::Bind()
        .Ctx<Context>()
        .template Arg<CountBuffer>()     // count
        .template Arg<ffi::AnyBuffer>()  // hyper
        .template Arg<ffi::AnyBuffer>()  // grad_ctrl
        .RemainingArgs()
        .template Ret<ffi::Buffer<ffi::U32, 2>>()  // sums
        .template Ret<BytesBuffer>()               // workspace
        .template Attr<int64_t>("num_tensors")
        .template Attr<int64_t>("flags")
        .template Attr<ffi::Span<const uint8_t>>("tensor_flags")
        .template Attr<int64_t>("packed_lists")
        .template Attr<ffi::Span<const int64_t>>("packed_offsets")
        .template Attr<ffi::Span<const int64_t>>("tensor_sizes");
  }

  static ffi::Error decode(CountBuffer count, ffi::AnyBuffer hyper, ffi::AnyBuffer grad_ctrl,
                           ffi::RemainingArgs args, ffi::Result<ffi::Buffer<ffi::U32, 2>> sums,
                           ffi::Result<BytesBuffer> workspace, int64_t n, int64_t flags,
                           ffi::Span<const uint8_t> tensor_flags, int64_t packed_lists,
                           ffi::Span<const int64_t> packed_offsets,
                           ffi::Span<const int64_t> tensor_sizes, Call* call) {
    optimizer_detail::StepOperands step;
    JF_RETURN_IF_ERROR(
        optimizer_detail::decode_step_operands<Family>(hyper, grad_ctrl, flags, &step));
    const uint32_t op_flags = step.flags;
    const OptimizerLists lists = OptimizerLists::of(Family::kDirectionStates, false);
    const int64_t num_args = static_cast<int64_t>(args.size());
    if (n < 0 || n > kMaxTensorsPerCall) {
      return invalid_argument("num_tensors=", n, ", expected at most ", kMaxTensorsPerCall);
    }
    if (packed_lists < 0 || packed_lists >= (int64_t(1) << lists.count())) {
      return invalid_argument("packed_lists ", packed_lists, " names lists beyond the call's ",
                              lists.count());
    }
    const PackedLists packed{static_cast<uint32_t>(packed_lists), packed_offsets, tensor_sizes};
    if (num_args != packed.first_buffer(0, lists.count(), n)) {
      return invalid_argument(num_args, " tensor operands do not fit num_tensors=", n,
                              " (expected ", lists.count(), " per tensor",
                              packed_lists != 0 ? ", one per packed list)" : ")");
    }
    JF_RETURN_IF_ERROR(optimizer_detail::check_tensor_flags(
        tensor_flags, n, optimizer_detail::bit_limit(Family::kTensorFlagNames)));
    std::string names[kMaxLists];
    ListSource sources[kMaxLists];
    for (int k = 0; k < lists.count(); ++k) {
      names[k] = OptimizerOp<Family>::list_name(op_flags, lists, k);
      sources[k] = {names[k].c_str(), false, packed.first_buffer(0, k, n)};
    }
    JF_RETURN_IF_ERROR(collect_lists(args, nullptr, sources, lists.count(), n, tensor_flags,
                                     &call->tensors, packed));
    JF_RETURN_IF_ERROR(optimizer_detail::check_uniform_complex(call->tensors, Family::kComplex));
    if (sums->dimensions()[0] != n || sums->dimensions()[1] != kTrustSumWords) {
      return invalid_argument("sums is u32[", sums->dimensions()[0], ", ", sums->dimensions()[1],
                              "], expected u32[", n, ", ", kTrustSumWords, "]");
    }
    int64_t chunks = 0;
    for (int64_t t = 0; t < n; ++t) {
      chunks += (call->tensors.size[t] + kMultiTensorChunk - 1) / kMultiTensorChunk;
    }
    if (static_cast<int64_t>(workspace->element_count()) != chunks * kTrustPartialBytes) {
      return invalid_argument("workspace has ", workspace->element_count(), " bytes, expected ",
                              chunks * kTrustPartialBytes);
    }
    call->lists = lists;
    call->count = count.typed_data();
    call->hyper = step.hyper;
    call->grad_ctrl = step.grad_ctrl;
    call->flags = op_flags;
    call->f64 = call->tensors.computes_in_double();
    call->complex = n > 0 && call->tensors.complex[0];
    call->sums = sums->typed_data();
    call->partials = reinterpret_cast<TrustSum*>(workspace->typed_data());
    return ffi::Error::Success();
  }

  template <typename Platform>
  static ffi::Error run(typename Platform::Arg ctx, const Call& call);

  static Contract contract() {
    Contract c;
    c.names["hyper"] = name_list(Hyper::kNames);
    c.names["flags"] = name_list(Family::kFlagNames);
    c.names["tensor_flags"] = name_list(Family::kTensorFlagNames);
    c.numbers["sum_words"] = kTrustSumWords;
    c.numbers["direction_states"] = Family::kDirectionStates;
    c.numbers["chunk_scalars"] = kMultiTensorChunk;
    c.numbers["partial_bytes"] = kTrustPartialBytes;
    return c;
  }

  // One multi-tensor kernel reading every list once (of a packed list, the call's tensors'
  // elements) and writing a partial per chunk, then one finishing kernel reading the partials
  // back and writing the sums.
  static CallCost cost(const CallShape& shape) {
    const int64_t n = contract_arg(shape.attrs, "num_tensors");
    const int64_t fixed = 3;
    const std::vector<int64_t> offsets = shape.array("packed_offsets");
    const std::vector<int64_t> sizes = shape.array("tensor_sizes");
    const PackedLists packed{static_cast<uint32_t>(contract_arg(shape.attrs, "packed_lists")),
                             offsets, sizes};
    const int lists = OptimizerLists::of(Family::kDirectionStates, false).count();
    std::vector<int64_t> scalars(n);
    for (int64_t t = 0; t < n; ++t) {
      const CallShape::Buffer& g = shape.operands.at(fixed + (packed.has(0) ? 0 : t));
      scalars[t] = packed.has(0) ? sizes.at(t) * (g.complex ? 2 : 1) : g.scalars();
    }
    CallCost c = streaming_cost(shape, multi_tensor_launches(lists, scalars) + 1);
    for (int k = 0; k < lists; ++k) {
      if (!packed.has(k)) continue;
      const CallShape::Buffer& b = shape.operands.at(fixed + packed.first_buffer(0, k, n));
      int64_t touched = 0;
      for (int64_t t = 0; t < n; ++t) {
        touched += list_elements(ListKind::kFloats, scalars[t], b.complex);
      }
      c.bytes_read -= b.bytes() - touched * b.element_bytes;
    }
    c.bytes_read += shape.results.at(1).bytes();  // the partials, read back
    return c;
  }
};

}  // namespace jaxfuse
