// The jaxfuse_global_norm and jaxfuse_apply_grad_ctrl FFI calls, shared by their CPU and CUDA
// handlers. The math is finish_norm() and GradScaling in math.h.
//
// jaxfuse_global_norm
//   operands: params f32[kNormParamsSize] (loss scale, max norm), then n gradient buffers
//   results:  norm f32[], ctrl f32[kGradCtrlSize], partials f32[2 * kNormSlots] (workspace)
//   attrs:    clip, skip_nonfinite, clip_apply_loss_scale (see finish_norm)
// jaxfuse_apply_grad_ctrl
//   operands: ctrl f32[kGradCtrlSize], then n gradient buffers; results: n gradient buffers
#pragma once

#include "jaxfuse/multi_tensor.h"

namespace jaxfuse {

using NormParamsBuffer = ffi::Buffer<ffi::F32, 1>;
using HyperCtrlBuffer = ffi::Buffer<ffi::F32, 1>;
using ScalarF32Buffer = ffi::Buffer<ffi::F32, 0>;

// Partial sums (sum of squares, non-finite marker) per GPU block or CPU chunk group. A fixed
// number of slots, so the workspace is a plain result buffer of fixed size.
inline constexpr int kNormSlots = 1024;

inline ffi::Error decode_norm_call(NormParamsBuffer params, const ffi::RemainingArgs& args,
                                   ffi::Result<HyperCtrlBuffer> ctrl,
                                   ffi::Result<HyperCtrlBuffer> partials,
                                   TensorLists* lists) {
  if (params.element_count() != kNormParamsSize) {
    return invalid_argument("jaxfuse_global_norm: params has ", params.element_count(),
                            " elements, expected ", int(kNormParamsSize));
  }
  if (ctrl->element_count() != kGradCtrlSize) {
    return invalid_argument("jaxfuse_global_norm: ctrl result has ", ctrl->element_count(),
                            " elements, expected ", int(kGradCtrlSize));
  }
  if (partials->element_count() != 2 * kNormSlots) {
    return invalid_argument("jaxfuse_global_norm: partials workspace has ",
                            partials->element_count(), " elements, expected ", 2 * kNormSlots);
  }
  const ListSource src{"grads", false, 0};
  return collect_lists("jaxfuse_global_norm", args, nullptr, &src, 1,
                       static_cast<int64_t>(args.size()), {}, lists);
}

inline ffi::Error decode_apply_grad_ctrl_call(HyperCtrlBuffer ctrl, const ffi::RemainingArgs& args,
                                              const ffi::RemainingRets& rets, TensorLists* lists) {
  if (ctrl.element_count() != kGradCtrlSize) {
    return invalid_argument("jaxfuse_apply_grad_ctrl: ctrl has ", ctrl.element_count(),
                            " elements, expected ", int(kGradCtrlSize));
  }
  const int64_t n = static_cast<int64_t>(args.size());
  if (static_cast<int64_t>(rets.size()) != n) {
    return invalid_argument("jaxfuse_apply_grad_ctrl: ", n, " operands but ", rets.size(), " results");
  }
  const ListSource sources[2] = {{"grads", false, 0}, {"scaled_grads", true, 0}};
  return collect_lists("jaxfuse_apply_grad_ctrl", args, &rets, sources, 2, n, {}, lists);
}

// Handler signatures, shared by the CPU and CUDA handlers (`Ctx`: the platform context).
template <typename Ctx>
auto global_norm_binding() {
  return ffi::Ffi::Bind()
      .Ctx<Ctx>()
      .template Arg<NormParamsBuffer>()
      .RemainingArgs()
      .template Ret<ScalarF32Buffer>()  // norm
      .template Ret<HyperCtrlBuffer>()  // ctrl
      .template Ret<HyperCtrlBuffer>()  // partials workspace
      .template Attr<bool>("clip")
      .template Attr<bool>("skip_nonfinite")
      .template Attr<bool>("clip_apply_loss_scale");
}

template <typename Ctx>
auto apply_grad_ctrl_binding() {
  return ffi::Ffi::Bind().Ctx<Ctx>().template Arg<HyperCtrlBuffer>().RemainingArgs().RemainingRets();
}

}  // namespace jaxfuse
