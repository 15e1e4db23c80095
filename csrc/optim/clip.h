// The jaxfuse_global_norm op: its FFI signature, decoding and validation, shared by the CPU and
// CUDA handlers (op.h). The math is norm_math.h; the run steps are
// src_cuda/{cpu/clip.cc,cuda/clip.cu}.
//
// jaxfuse_global_norm
//   operands: norm_params f32/f64[NormParams::kSize], peer_sums u32[R, kNormSumWords] (the
//             totals of other devices' shards, NormSum rows; R = 0 unsharded), then n gradient
//             buffers (any element type of element_type(): a complex element counts as two)
//   results:  norm f32/f64[] (the leaves' result dtype), grad_ctrl f32/f64[GradCtrl::kSize],
//             workspace u8[kNormWorkspaceBytes] (the partials), own_sum u32[kNormSumWords] (the
//             total of this call's gradients, a NormSum row)
//   attrs:    clip, skip_nonfinite, clip_apply_loss_scale (see finish_norm)
//   The norm is that of the peers' rows, added in row order, plus this call's own total. A
//   sharded norm (jaxfuse/clip.py) makes two calls per device: one over its shards (own_sum),
//   then, after an all-reduce of the rows, one over no gradients with every device's row.
#pragma once

#include "optim/multi_tensor_plan.h"
#include "optim/norm_math.h"
#include "core/op.h"
#include "optim/tensor_lists.h"

namespace jaxfuse {

// Partial sums (sum of squares, non-finite marker, in double) per GPU block or CPU chunk group.
// A fixed number of slots, so the workspace is a plain result buffer of fixed size.
inline constexpr int kNormSlots = 1024;
inline constexpr int64_t kNormWorkspaceBytes = 2 * kNormSlots * sizeof(double);
using NormRows = ffi::Buffer<ffi::U32, 2>;  // NormSum rows (norm_math.h)
using NormRow = ffi::Buffer<ffi::U32, 1>;

struct GlobalNormOp {
  static constexpr const char* kName = "jaxfuse_global_norm";

  struct Call {
    TensorLists grads;
    ScalarVector norm_params;
    const uint32_t* peer_sums;  // [num_peers][kNormSumWords]
    int64_t num_peers;
    ScalarVectorOut norm;
    ScalarVectorOut grad_ctrl;
    double* partials;  // [kNormSlots][2], in the workspace
    uint32_t* own_sum;  // [kNormSumWords]
    bool clip, skip_nonfinite, clip_apply_loss_scale;
  };

  template <typename Context>
  static auto binding() {
    return ffi::Ffi::Bind()
        .Ctx<Context>()
        .template Arg<ffi::AnyBuffer>()  // norm_params
        .template Arg<NormRows>()        // peer_sums
        .RemainingArgs()
        .template Ret<ffi::AnyBuffer>()  // norm
        .template Ret<ffi::AnyBuffer>()  // grad_ctrl
        .template Ret<BytesBuffer>()     // workspace
        .template Ret<NormRow>()         // own_sum
        .template Attr<bool>("clip")
        .template Attr<bool>("skip_nonfinite")
        .template Attr<bool>("clip_apply_loss_scale");
  }

  static ffi::Error decode(ffi::AnyBuffer norm_params, NormRows peer_sums,
                           ffi::RemainingArgs args, ffi::Result<ffi::AnyBuffer> norm,
                           ffi::Result<ffi::AnyBuffer> grad_ctrl,
                           ffi::Result<BytesBuffer> workspace, ffi::Result<NormRow> own_sum,
                           bool clip, bool skip_nonfinite, bool clip_apply_loss_scale,
                           Call* call) {
    const auto params = scalar_vector("norm_params", norm_params, NormParams::kSize);
    if (params.has_error()) return params.error();
    const auto norm_out = scalar_vector_out("norm", *norm, 0);
    if (norm_out.has_error()) return norm_out.error();
    const auto grad_ctrl_out = scalar_vector_out("grad_ctrl result", *grad_ctrl, GradCtrl::kSize);
    if (grad_ctrl_out.has_error()) return grad_ctrl_out.error();
    if (static_cast<int64_t>(workspace->element_count()) != kNormWorkspaceBytes) {
      return invalid_argument("workspace has ", workspace->element_count(), " bytes, expected ",
                              kNormWorkspaceBytes);
    }
    if (peer_sums.dimensions()[1] != kNormSumWords) {
      return invalid_argument("peer_sums rows have ", peer_sums.dimensions()[1],
                              " words, expected ", kNormSumWords);
    }
    if (own_sum->dimensions()[0] != kNormSumWords) {
      return invalid_argument("own_sum has ", own_sum->dimensions()[0], " words, expected ",
                              kNormSumWords);
    }
    const ListSource src{"grads", false, 0};
    JF_RETURN_IF_ERROR(collect_lists(args, nullptr, &src, 1, static_cast<int64_t>(args.size()),
                                     {}, &call->grads));
    call->norm_params = *params;
    call->peer_sums = peer_sums.typed_data();
    call->num_peers = peer_sums.dimensions()[0];
    call->own_sum = own_sum->typed_data();
    call->norm = *norm_out;
    call->grad_ctrl = *grad_ctrl_out;
    call->partials = reinterpret_cast<double*>(workspace->typed_data());
    call->clip = clip;
    call->skip_nonfinite = skip_nonfinite;
    call->clip_apply_loss_scale = clip_apply_loss_scale;
    return ffi::Error::Success();
  }

  template <typename Platform>
  static ffi::Error run(typename Platform::Arg ctx, const Call& call);

  static Contract contract() {
    Contract c;
    c.numbers["norm_slots"] = kNormSlots;
    c.numbers["workspace_bytes"] = kNormWorkspaceBytes;
    c.numbers["norm_sum_words"] = kNormSumWords;
    c.names["norm_params"] = name_list(NormParams::kNames);
    c.names["grad_ctrl"] = name_list(GradCtrl::kNames);
    return c;
  }

  // The partial sums' multi-tensor kernel (none over no gradients), then the finishing kernel
  // (cuda/clip.cu). Operands: norm_params, peer_sums, the gradients. Results: norm, grad_ctrl,
  // workspace, own_sum; of the workspace, the partials are written and read back: one per block,
  // so at most one per chunk and one per slot.
  static CallCost cost(const CallShape& shape) {
    const int64_t grads = static_cast<int64_t>(shape.operands.size()) - 2;
    const std::vector<int64_t> sizes = shape.scalars(2, grads);
    const int64_t launches = grads > 0 ? multi_tensor_launches(1, sizes) : 0;
    int64_t chunks = 0;
    for (int64_t n : sizes) chunks += (n + kMultiTensorChunk - 1) / kMultiTensorChunk;
    const int64_t partial_bytes = std::min<int64_t>(chunks, kNormSlots) * 2 * sizeof(double);
    CallCost c = streaming_cost(shape, launches + 1);
    c.bytes_read += partial_bytes;
    c.bytes_written += partial_bytes - shape.results.at(2).bytes();
    return c;
  }
};

}  // namespace jaxfuse
