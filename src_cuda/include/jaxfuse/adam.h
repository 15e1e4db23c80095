// The jaxfuse_adam op: its FFI signature, operand layout, decoding and validation, shared by the
// CPU and CUDA handlers (op.h). The math is adam_math.h; the platforms' run steps are
// src_cuda/{cpu/adam.cc,cuda/adam.cu}.
//
// Operands: count s32[], hyper f32/f64[AdamHyper::kSize], grad_ctrl f32/f64[GradCtrl::kSize],
//   then the tensor lists of adam_layout() (n buffers each) in its operand order.
// Results:  new count s32[], then the lists of adam_layout() in its result order.
// A list that is both an operand and a result is updated in place: its result buffers must be
// aliased to its operands (the handler checks). The math runs in double when any buffer of the
// call is float64, else in float; the tensors of one call are all real or all complex.
#pragma once

#include "jaxfuse/adam_math.h"
#include "jaxfuse/multi_tensor_plan.h"
#include "jaxfuse/op.h"
#include "jaxfuse/tensor_lists.h"

namespace jaxfuse {

// Names of the kernel lists (AdamList, then the optional lists as AdamLists places them).
inline const char* adam_list_name(int list, const AdamLists& lists) {
  constexpr const char* kFixed[kAdamFixedLists] = {"grads", "mu", "nu"};
  if (list < kAdamFixedLists) return kFixed[list];
  if (list == lists.params) return "params";
  return list == lists.updates ? "updates" : "master_params";
}

// Which kernel list each operand group and each result group of a call is, in call order.
struct AdamLayout {
  AdamLists lists;
  int operands[5];  // kernel lists, in operand order
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

// The optax protocol (write_updates) reads params (when given: optax's adam accepts none) and
// writes the updates; the fused step updates params in place. The master copy (master) is read
// and written in place in both. Operand order: grads, params, mu, nu, master (what is present).
inline AdamLayout adam_layout(bool write_updates, bool master, bool params) {
  AdamLayout a;
  a.lists = AdamLists::of(write_updates, master, params);
  a.operands[a.num_operands++] = kGrads;
  if (params) a.operands[a.num_operands++] = a.lists.params;
  a.operands[a.num_operands++] = kMu;
  a.operands[a.num_operands++] = kNu;
  if (master) a.operands[a.num_operands++] = a.lists.master;
  if (write_updates) a.results[a.num_results++] = a.lists.updates;
  a.results[a.num_results++] = kMu;
  a.results[a.num_results++] = kNu;
  if (!write_updates) a.results[a.num_results++] = a.lists.params;
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
    ScalarVector hyper;
    ScalarVector grad_ctrl;
    bool nesterov = false;
    bool f64 = false;      // compute in double (a buffer is float64)
    bool complex = false;  // every tensor is complex
  };

  template <typename Context>
  static auto binding() {
    return ffi::Ffi::Bind()
        .Ctx<Context>()
        .template Arg<CountBuffer>()     // count
        .template Arg<ffi::AnyBuffer>()  // hyper
        .template Arg<ffi::AnyBuffer>()  // grad_ctrl
        .RemainingArgs()
        .template Ret<CountBuffer>()  // new count
        .RemainingRets()
        .template Attr<int64_t>("num_tensors")
        .template Attr<bool>("nesterov")
        .template Attr<bool>("write_updates")
        .template Attr<bool>("master")
        .template Attr<bool>("params")
        .template Attr<ffi::Span<const uint8_t>>("decay_mask");
  }

  static ffi::Error decode(CountBuffer count, ffi::AnyBuffer hyper, ffi::AnyBuffer grad_ctrl,
                           ffi::RemainingArgs args, ffi::Result<CountBuffer> new_count,
                           ffi::RemainingRets rets, int64_t num_tensors, bool nesterov,
                           bool write_updates, bool master, bool params,
                           ffi::Span<const uint8_t> decay_mask, Call* call);

  template <typename Platform>
  static ffi::Error run(typename Platform::Arg ctx, const Call& call);

  static Contract contract();

  // One multi-tensor kernel over the call's lists (cuda/adam.cu), every buffer read or written
  // once.
  static CallCost cost(const CallShape& shape) {
    const AdamLists lists = AdamLists::of(contract_arg(shape.attrs, "write_updates") != 0,
                                          contract_arg(shape.attrs, "master") != 0,
                                          contract_arg(shape.attrs, "params") != 0);
    const int64_t n = contract_arg(shape.attrs, "num_tensors");
    const int64_t grads_first = 3;  // after count, hyper, grad_ctrl; grads are the first group
    const std::vector<int64_t> sizes = shape.scalars(grads_first, n);
    return streaming_cost(shape, multi_tensor_launches(lists.count(), sizes));
  }
};

namespace adam_detail {

inline ffi::Error check_mask(ffi::Span<const uint8_t> mask, int64_t n, bool params) {
  if (static_cast<int64_t>(mask.size()) != n) {
    return invalid_argument("decay_mask has ", mask.size(), " entries, expected num_tensors=", n);
  }
  for (size_t t = 0; t < mask.size(); ++t) {
    if (mask[t] > 1 || (mask[t] == 1 && !params)) {
      return invalid_argument("decay_mask entry ", t, " is ", int(mask[t]), ", expected 0",
                              params ? " or 1" : " (weight decay needs params)");
    }
  }
  return ffi::Error::Success();
}

// The layouts the kernels implement: the fused step and master weights need params.
inline ffi::Error check_layout(bool write_updates, bool master, bool params) {
  if (params || (write_updates && !master)) return ffi::Error::Success();
  return invalid_argument(master ? "master weights need params" : "the in-place step needs params");
}

// One call computes in one type and treats all its tensors alike: all real or all complex.
inline ffi::Error check_uniform_complex(const TensorLists& tensors) {
  for (int64_t t = 1; t < tensors.num_tensors(); ++t) {
    if (tensors.complex[t] != tensors.complex[0]) {
      return invalid_argument("tensor ", t, " is ", tensors.complex[t] ? "complex" : "real",
                              ", tensor 0 is not (one call takes real or complex tensors)");
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

inline ffi::Error AdamOp::decode(CountBuffer count, ffi::AnyBuffer hyper,
                                 ffi::AnyBuffer grad_ctrl, ffi::RemainingArgs args,
                                 ffi::Result<CountBuffer> new_count, ffi::RemainingRets rets,
                                 int64_t n, bool nesterov, bool write_updates, bool master,
                                 bool params, ffi::Span<const uint8_t> decay_mask, Call* call) {
  using namespace adam_detail;
  const auto hyper_vector = scalar_vector("hyper", hyper, AdamHyper::kSize);
  if (hyper_vector.has_error()) return hyper_vector.error();
  const auto grad_ctrl_vector = scalar_vector("grad_ctrl", grad_ctrl, GradCtrl::kSize);
  if (grad_ctrl_vector.has_error()) return grad_ctrl_vector.error();
  JF_RETURN_IF_ERROR(check_layout(write_updates, master, params));
  const AdamLayout layout = adam_layout(write_updates, master, params);
  // n is bounded by the operand count before any product is formed (no overflow).
  if (n < 0 || n > static_cast<int64_t>(args.size()) ||
      static_cast<int64_t>(args.size()) != layout.num_operands * n ||
      static_cast<int64_t>(rets.size()) != layout.num_results * n) {
    return invalid_argument(args.size(), " tensor operands and ", rets.size(),
                            " tensor results do not fit num_tensors=", n, " (expected ",
                            layout.num_operands, " and ", layout.num_results, " per tensor)");
  }
  JF_RETURN_IF_ERROR(check_mask(decay_mask, n, params));
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
  JF_RETURN_IF_ERROR(check_uniform_complex(call->tensors));
  call->f64 = call->tensors.computes_in_double();
  if (master) {
    const DType compute = call->f64 ? DType::kF64 : DType::kF32;
    for (int64_t t = 0; t < n; ++t) {
      if (call->tensors.dtype[t][layout.lists.master] != compute) {
        return invalid_argument("master params of tensor ", t, " must be ", dtype_name(compute),
                                " (the compute type)");
      }
    }
  }
  call->lists = layout.lists;
  call->count = count.typed_data();
  call->new_count = new_count->typed_data();
  call->hyper = *hyper_vector;
  call->grad_ctrl = *grad_ctrl_vector;
  call->nesterov = nesterov;
  call->complex = n > 0 && call->tensors.complex[0];
  return ffi::Error::Success();
}

// Python builds the hyper vector by these names and lays out operands, results and aliases by
// layout(write_updates, master, params).
inline Contract AdamOp::contract() {
  Contract c;
  c.names["hyper"] = name_list(AdamHyper::kNames);
  c.names["grad_ctrl"] = name_list(GradCtrl::kNames);
  c.names["fixed_operands"] = {"count", "hyper", "grad_ctrl"};  // binding() order
  c.names["fixed_results"] = {"count"};
  c.functions["layout"] = [](const std::map<std::string, int64_t>& args) {
    const AdamLayout a = adam_layout(contract_arg(args, "write_updates") != 0,
                                     contract_arg(args, "master") != 0,
                                     contract_arg(args, "params") != 0);
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
