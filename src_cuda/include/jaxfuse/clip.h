// The jaxfuse_global_norm and jaxfuse_apply_grad_ctrl ops: FFI signatures, decoding and
// validation, shared by the CPU and CUDA handlers (op.h). The math is norm_math.h; the run
// steps are src_cuda/{cpu/clip.cc,cuda/clip.cu}.
//
// jaxfuse_global_norm
//   operands: norm_params f32[NormParams::kSize], then n gradient buffers
//   results:  norm f32[], grad_ctrl f32[GradCtrl::kSize], partials f32[2 * kNormSlots]
//             (workspace)
//   attrs:    clip, skip_nonfinite, clip_apply_loss_scale (see finish_norm)
// jaxfuse_apply_grad_ctrl
//   operands: grad_ctrl f32[GradCtrl::kSize], then n gradient buffers; results: n buffers
#pragma once

#include "jaxfuse/norm_math.h"
#include "jaxfuse/op.h"
#include "jaxfuse/tensor_lists.h"

namespace jaxfuse {

using ScalarF32Buffer = ffi::Buffer<ffi::F32, 0>;

// Partial sums (sum of squares, non-finite marker) per GPU block or CPU chunk group. A fixed
// number of slots, so the workspace is a plain result buffer of fixed size.
inline constexpr int kNormSlots = 1024;

struct GlobalNormOp {
  static constexpr const char* kName = "jaxfuse_global_norm";

  struct Call {
    TensorLists grads;
    const float* norm_params;
    float* norm;
    float* grad_ctrl;
    float* partials;  // [kNormSlots][2]
    bool clip, skip_nonfinite, clip_apply_loss_scale;
  };

  template <typename Context>
  static auto binding() {
    return ffi::Ffi::Bind()
        .Ctx<Context>()
        .template Arg<F32Vector>()  // norm_params
        .RemainingArgs()
        .template Ret<ScalarF32Buffer>()  // norm
        .template Ret<F32Vector>()        // grad_ctrl
        .template Ret<F32Vector>()        // partials workspace
        .template Attr<bool>("clip")
        .template Attr<bool>("skip_nonfinite")
        .template Attr<bool>("clip_apply_loss_scale");
  }

  static ffi::Error decode(F32Vector norm_params, ffi::RemainingArgs args,
                           ffi::Result<ScalarF32Buffer> norm, ffi::Result<F32Vector> grad_ctrl,
                           ffi::Result<F32Vector> partials, bool clip, bool skip_nonfinite,
                           bool clip_apply_loss_scale, Call* call) {
    JF_RETURN_IF_ERROR(
        check_f32_vector("norm_params", norm_params.element_count(), NormParams::kSize));
    JF_RETURN_IF_ERROR(
        check_f32_vector("grad_ctrl result", grad_ctrl->element_count(), GradCtrl::kSize));
    JF_RETURN_IF_ERROR(
        check_f32_vector("partials workspace", partials->element_count(), 2 * kNormSlots));
    const ListSource src{"grads", false, 0};
    JF_RETURN_IF_ERROR(collect_lists(args, nullptr, &src, 1, static_cast<int64_t>(args.size()),
                                     {}, &call->grads));
    call->norm_params = norm_params.typed_data();
    call->norm = norm->typed_data();
    call->grad_ctrl = grad_ctrl->typed_data();
    call->partials = partials->typed_data();
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
    c.names["norm_params"] = name_list(NormParams::kNames);
    c.names["grad_ctrl"] = name_list(GradCtrl::kNames);
    return c;
  }
};

struct ApplyGradCtrlOp {
  static constexpr const char* kName = "jaxfuse_apply_grad_ctrl";

  struct Call {
    TensorLists grads;  // lists: grads, scaled grads
    const float* grad_ctrl;
  };

  template <typename Context>
  static auto binding() {
    return ffi::Ffi::Bind().Ctx<Context>().template Arg<F32Vector>().RemainingArgs().RemainingRets();
  }

  static ffi::Error decode(F32Vector grad_ctrl, ffi::RemainingArgs args, ffi::RemainingRets rets,
                           Call* call) {
    JF_RETURN_IF_ERROR(check_f32_vector("grad_ctrl", grad_ctrl.element_count(), GradCtrl::kSize));
    const int64_t n = static_cast<int64_t>(args.size());
    if (static_cast<int64_t>(rets.size()) != n) {
      return invalid_argument(n, " operands but ", rets.size(), " results");
    }
    const ListSource sources[2] = {{"grads", false, 0}, {"scaled_grads", true, 0}};
    call->grad_ctrl = grad_ctrl.typed_data();
    return collect_lists(args, &rets, sources, 2, n, {}, &call->grads);
  }

  template <typename Platform>
  static ffi::Error run(typename Platform::Arg ctx, const Call& call);

  static Contract contract() {
    Contract c;
    c.names["grad_ctrl"] = name_list(GradCtrl::kNames);
    return c;
  }
};

}  // namespace jaxfuse
