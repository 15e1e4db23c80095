// The jaxfuse_adam op: its FFI signature, operand layout, decoding and validation, shared by the
// CPU and CUDA handlers (op.h). The math is adam_math.h; the platforms' run steps are
// src_cuda/{cpu/adam.cc,cuda/adam.cu}.
//
// Operands: count s32[], hyper f32[AdamHyper::kSize], grad_ctrl f32[GradCtrl::kSize], then the
//   tensor lists of adam_layout() (n buffers each) in its operand order.
// Results:  new count s32[], then the lists of adam_layout() in its result order.
// A list that is both an operand and a result is updated in place: its result buffers must be
// aliased to its operands (the handler checks).
#pragma once

#include "jaxfuse/adam_math.h"
#include "jaxfuse/op.h"
#include "jaxfuse/tensor_lists.h"

namespace jaxfuse {

// Names of the kernel lists (AdamList, then updates and master params as AdamLists places them).
inline const char* adam_list_name(int list, const AdamLists& lists) {
  constexpr const char* kFixed[kAdamFixedLists] = {"grads", "params", "mu", "nu"};
  if (list < kAdamFixedLists) return kFixed[list];
  return list == lists.updates ? "updates" : "master_params";
}

// Which kernel list each operand group and each result group of a call is, in call order.
struct AdamLayout {
  AdamLists lists;
  int operands[5];
  int num_operands = 0;
  int results[4];
  int num_results = 0;

  bool in_place(int list) const {
    for (int i = 0; i < num_operands; ++i) {
      for (int j = 0; j < num_results; ++j) {
        if (operands[i] == list && results[j] == list) return true;
      }
    }
    return false;
  }
};

// The optax protocol (write_updates) reads params and writes the updates; the fused step
// updates params in place. The master copy (master) is read and written in place in both.
inline AdamLayout adam_layout(bool write_updates, bool master) {
  AdamLayout a;
  a.lists = AdamLists::of(write_updates, master);
  for (int list : {int(kGrads), int(kParams), int(kMu), int(kNu)}) a.operands[a.num_operands++] = list;
  if (master) a.operands[a.num_operands++] = a.lists.master;
  if (write_updates) a.results[a.num_results++] = a.lists.updates;
  a.results[a.num_results++] = kMu;
  a.results[a.num_results++] = kNu;
  if (!write_updates) a.results[a.num_results++] = kParams;
  if (master) a.results[a.num_results++] = a.lists.master;
  return a;
}


struct AdamOp {
  static constexpr const char* kName = "jaxfuse_adam";

  struct Call {
    TensorLists tensors;  // kernel lists, AdamLists order
    AdamLists lists;
    const int32_t* count = nullptr;
    int32_t* new_count = nullptr;
    const float* hyper = nullptr;
    const float* grad_ctrl = nullptr;
    bool nesterov = false;
  };

  template <typename Context>
  static auto binding() {
    return ffi::Ffi::Bind()
        .Ctx<Context>()
        .template Arg<CountBuffer>()  // count
        .template Arg<F32Vector>()    // hyper
        .template Arg<F32Vector>()    // grad_ctrl
        .RemainingArgs()
        .template Ret<CountBuffer>()  // new count
        .RemainingRets()
        .template Attr<int64_t>("num_tensors")
        .template Attr<bool>("nesterov")
        .template Attr<bool>("write_updates")
        .template Attr<bool>("master")
        .template Attr<ffi::Span<const uint8_t>>("decay_mask");
  }

  static ffi::Error decode(CountBuffer count, F32Vector hyper, F32Vector grad_ctrl,
                           ffi::RemainingArgs args, ffi::Result<CountBuffer> new_count,
                           ffi::RemainingRets rets, int64_t num_tensors, bool nesterov,
                           bool write_updates, bool master, ffi::Span<const uint8_t> decay_mask,
                           Call* call);

  template <typename Platform>
  static ffi::Error run(typename Platform::Arg ctx, const Call& call);

  static Contract contract();
};

namespace adam_detail {

inline ffi::Error check_mask(ffi::Span<const uint8_t> mask, int64_t n) {
  if (static_cast<int64_t>(mask.size()) != n) {
    return invalid_argument("decay_mask has ", mask.size(), " entries, expected num_tensors=", n);
  }
  for (size_t t = 0; t < mask.size(); ++t) {
    if (mask[t] > 1) {
      return invalid_argument("decay_mask entry ", t, " is ", int(mask[t]), ", expected 0 or 1");
    }
  }
  return ffi::Error::Success();
}

// Result buffer t of list `name` must be its operand buffer t (in-place update).
inline ffi::Error check_aliased(const ffi::RemainingArgs& args, const ffi::RemainingRets& rets,
                                int64_t arg_offset, int64_t ret_offset, int64_t n,
                                const char* name) {
  for (int64_t t = 0; t < n; ++t) {
    auto a = args.get<ffi::AnyBuffer>(arg_offset + t);
    if (a.has_error()) return a.error();
    auto r = rets.get<ffi::AnyBuffer>(ret_offset + t);
    if (r.has_error()) return r.error();
    if (a->untyped_data() != (*r)->untyped_data()) {
      return internal_error("output '", name, "' of tensor ", t,
                            " is not aliased to its input (input_output_aliases missing)");
    }
  }
  return ffi::Error::Success();
}

}  // namespace adam_detail

inline ffi::Error AdamOp::decode(CountBuffer count, F32Vector hyper, F32Vector grad_ctrl,
                                 ffi::RemainingArgs args, ffi::Result<CountBuffer> new_count,
                                 ffi::RemainingRets rets, int64_t n, bool nesterov,
                                 bool write_updates, bool master,
                                 ffi::Span<const uint8_t> decay_mask, Call* call) {
  using namespace adam_detail;
  JF_RETURN_IF_ERROR(check_f32_vector("hyper", hyper.element_count(), AdamHyper::kSize));
  JF_RETURN_IF_ERROR(check_f32_vector("grad_ctrl", grad_ctrl.element_count(), GradCtrl::kSize));
  const AdamLayout layout = adam_layout(write_updates, master);
  // n is bounded by the operand count before any product is formed (no overflow).
  if (n < 0 || n > static_cast<int64_t>(args.size()) ||
      static_cast<int64_t>(args.size()) != layout.num_operands * n ||
      static_cast<int64_t>(rets.size()) != layout.num_results * n) {
    return invalid_argument(args.size(), " tensor operands and ", rets.size(),
                            " tensor results do not fit num_tensors=", n, " (expected ",
                            layout.num_operands, " and ", layout.num_results, " per tensor)");
  }
  JF_RETURN_IF_ERROR(check_mask(decay_mask, n));
  // Each kernel list from its operand group; the updates from their result group.
  ListSource sources[kMaxLists];
  for (int i = 0; i < layout.num_operands; ++i) {
    const int list = layout.operands[i];
    sources[list] = {adam_list_name(list, layout.lists), false, i * n};
  }
  for (int j = 0; j < layout.num_results; ++j) {
    const int list = layout.results[j];
    if (list == layout.lists.updates) sources[list] = {"updates", true, j * n};
    if (!layout.in_place(list)) continue;
    int i = 0;
    while (layout.operands[i] != list) ++i;
    JF_RETURN_IF_ERROR(check_aliased(args, rets, i * n, j * n, n, adam_list_name(list, layout.lists)));
  }
  JF_RETURN_IF_ERROR(collect_lists(args, &rets, sources, layout.lists.count(), n, decay_mask,
                                   &call->tensors));
  if (master) {
    for (int64_t t = 0; t < n; ++t) {
      if (call->tensors.dtype[t][layout.lists.master] != DType::kF32) {
        return invalid_argument("master params of tensor ", t, " must be float32");
      }
    }
  }
  call->lists = layout.lists;
  call->count = count.typed_data();
  call->new_count = new_count->typed_data();
  call->hyper = hyper.typed_data();
  call->grad_ctrl = grad_ctrl.typed_data();
  call->nesterov = nesterov;
  return ffi::Error::Success();
}

// Python builds the hyper vector by these names and lays out operands, results and aliases by
// layout(write_updates, master).
inline Contract AdamOp::contract() {
  Contract c;
  c.names["hyper"] = name_list(AdamHyper::kNames);
  c.names["grad_ctrl"] = name_list(GradCtrl::kNames);
  c.names["fixed_operands"] = {"count", "hyper", "grad_ctrl"};  // binding() order
  c.names["fixed_results"] = {"count"};
  c.functions["layout"] = [](const std::map<std::string, int64_t>& args) {
    const AdamLayout a = adam_layout(contract_arg(args, "write_updates") != 0,
                                     contract_arg(args, "master") != 0);
    ContractValues v;
    for (int i = 0; i < a.num_operands; ++i) {
      v.names["operands"].push_back(adam_list_name(a.operands[i], a.lists));
    }
    for (int j = 0; j < a.num_results; ++j) {
      v.names["results"].push_back(adam_list_name(a.results[j], a.lists));
    }
    return v;
  };
  return c;
}

}  // namespace jaxfuse
