// The jaxfuse_adam FFI call, shared by its CPU and CUDA handlers: operand layout, decoding and
// validation. The element math is adam_element() in math.h; the drivers are in multi_tensor.*.
//
// Operands: count s32[], hyper f32[kAdamHyperSize], ctrl f32[kGradCtrlSize], then n buffers each of
//   grads, params, mu, nu, and (master) the fp32 master params.
// Results:  new_count s32[], then n buffers each of
//   (write_updates) the updates, mu, nu, (!write_updates) params, (master) master params.
// mu, nu, and the params (fused step) or master params are aliased input -> output, so each
// tensor is updated in place; the handlers check that the aliasing holds.
#pragma once

#include "jaxfuse/multi_tensor.h"

namespace jaxfuse {

// Lists in the order the kernels see them. kUpdates and kMaster are present only in those modes
// and then take the next free slots (see AdamCall::updates_list / master_list).
// Fixed operand types (aliases keep commas out of the handler-definition macros).
using CountBuffer = ffi::Buffer<ffi::S32, 0>;
using HyperBuffer = ffi::Buffer<ffi::F32, 1>;

enum AdamList : int { kGrads = 0, kParams = 1, kMu = 2, kNu = 3 };

struct AdamCall {
  TensorLists lists;
  const int32_t* count = nullptr;
  int32_t* new_count = nullptr;
  const float* hyper = nullptr;
  const float* ctrl = nullptr;
  bool nesterov = false;
  bool write_updates = false;  // optax protocol: write updates, params read-only
  bool master = false;         // fp32 master params in the state
  int updates_list() const { return write_updates ? 4 : -1; }
  int master_list() const { return master ? 4 + (write_updates ? 1 : 0) : -1; }
};

inline ffi::Error check_aliased(const ffi::RemainingArgs& args, const ffi::RemainingRets& rets,
                                int64_t arg_offset, int64_t ret_offset, int64_t n,
                                const char* name) {
  for (int64_t t = 0; t < n; ++t) {
    auto a = args.get<ffi::AnyBuffer>(arg_offset + t);
    if (a.has_error()) return a.error();
    auto r = rets.get<ffi::AnyBuffer>(ret_offset + t);
    if (r.has_error()) return r.error();
    if (a->untyped_data() != (*r)->untyped_data()) {
      return internal_error("jaxfuse_adam: output '", name, "' of tensor ", t,
                            " is not aliased to its input (input_output_aliases missing)");
    }
  }
  return ffi::Error::Success();
}

inline ffi::Error decode_adam_call(CountBuffer count, HyperBuffer hyper,
                                   HyperBuffer ctrl, const ffi::RemainingArgs& args,
                                   ffi::Result<CountBuffer> new_count,
                                   const ffi::RemainingRets& rets, int64_t n, bool nesterov,
                                   bool write_updates, bool master,
                                   ffi::Span<const uint8_t> decay_mask, AdamCall* call) {
  if (hyper.element_count() != kAdamHyperSize) {
    return invalid_argument("jaxfuse_adam: hyper has ", hyper.element_count(), " elements, expected ",
                            int(kAdamHyperSize));
  }
  if (ctrl.element_count() != kGradCtrlSize) {
    return invalid_argument("jaxfuse_adam: ctrl has ", ctrl.element_count(), " elements, expected ",
                            int(kGradCtrlSize));
  }
  const int64_t in_lists = 4 + (master ? 1 : 0);
  // updates (or params), mu, nu, [master]
  const int64_t out_lists = 3 + (master ? 1 : 0);
  // n is bounded by the operand count before any product is formed (no overflow).
  if (n < 0 || n > static_cast<int64_t>(args.size()) ||
      static_cast<int64_t>(args.size()) != in_lists * n ||
      static_cast<int64_t>(rets.size()) != out_lists * n) {
    return invalid_argument("jaxfuse_adam: ", args.size(), " tensor operands and ", rets.size(),
                            " tensor results do not fit num_tensors=", n, " (expected ",
                            in_lists, " and ", out_lists, " per tensor)");
  }
  if (static_cast<int64_t>(decay_mask.size()) != n) {
    return invalid_argument("jaxfuse_adam: decay_mask has ", decay_mask.size(),
                            " entries, expected num_tensors=", n);
  }
  for (size_t t = 0; t < decay_mask.size(); ++t) {
    if (decay_mask[t] > 1) {
      return invalid_argument("jaxfuse_adam: decay_mask entry ", t, " is ", int(decay_mask[t]),
                              ", expected 0 or 1");
    }
  }
  call->count = count.typed_data();
  call->new_count = new_count->typed_data();
  call->hyper = hyper.typed_data();
  call->ctrl = ctrl.typed_data();
  call->nesterov = nesterov;
  call->write_updates = write_updates;
  call->master = master;

  // Result offsets: [updates], mu, nu, [params], [master].
  const int64_t r_mu = write_updates ? n : 0;
  const int64_t r_nu = r_mu + n;
  const int64_t r_next = r_nu + n;  // updates mode: master; fused mode: params, then master
  ListSource sources[6] = {{"grads", false, 0}, {"params", false, n}, {"mu", false, 2 * n},
                           {"nu", false, 3 * n}};
  int num_lists = 4;
  if (write_updates) sources[num_lists++] = {"updates", true, 0};
  if (master) sources[num_lists++] = {"master_params", false, 4 * n};
  JF_RETURN_IF_ERROR(
      collect_lists("jaxfuse_adam", args, &rets, sources, num_lists, n, decay_mask, &call->lists));

  JF_RETURN_IF_ERROR(check_aliased(args, rets, 2 * n, r_mu, n, "mu"));
  JF_RETURN_IF_ERROR(check_aliased(args, rets, 3 * n, r_nu, n, "nu"));
  if (!write_updates) JF_RETURN_IF_ERROR(check_aliased(args, rets, n, r_next, n, "params"));
  if (master) {
    const int64_t r_master = write_updates ? r_next : r_next + n;
    JF_RETURN_IF_ERROR(check_aliased(args, rets, 4 * n, r_master, n, "master_params"));
    for (int64_t t = 0; t < n; ++t) {
      if (call->lists.dtype[t][call->master_list()] != DType::kF32) {
        return invalid_argument("jaxfuse_adam: master params of tensor ", t, " must be float32");
      }
    }
  }
  return ffi::Error::Success();
}

// The handler signature, shared by the CPU and CUDA handlers; `Ctx` is the platform context
// (ffi::ThreadPool or ffi::PlatformStream<cudaStream_t>).
template <typename Ctx>
auto adam_binding() {
  return ffi::Ffi::Bind()
      .Ctx<Ctx>()
      .template Arg<CountBuffer>()  // count
      .template Arg<HyperBuffer>()  // hyper
      .template Arg<HyperBuffer>()  // ctrl
      .RemainingArgs()
      .template Ret<CountBuffer>()  // new count
      .RemainingRets()
      .template Attr<int64_t>("num_tensors")
      .template Attr<bool>("nesterov")
      .template Attr<bool>("write_updates")
      .template Attr<bool>("master")
      .template Attr<ffi::Span<const uint8_t>>("decay_mask");
}

}  // namespace jaxfuse
