// One op for every element-wise optimizer: OptimizerOp<Family> is the FFI signature, operand
// layout, decoding and validation of the fused in-place step of any family, and
// optimizer_group() the per-group program both drivers run (the CPU's tiles, optim/cpu/optimizer.h;
// the GPU's registers, optim/cuda/optimizer.cuh). A family (optim/families/adam.h, sgd.h, ...) is
// a struct:
//
//   kName                  the XLA target, e.g. "jaxfuse_adam"
//   Hyper                  its hyperparameter vector layout (JF_DEFINE_VECTOR_LAYOUT)
//   kFlagNames             the bits of the call's `flags` attribute, in bit order
//   kTensorFlagNames       the bits of each tensor's entry of `tensor_flags` (e.g. "decay")
//   kComplex               whether complex tensors are allowed
//   kQuantizedStates       (optional, default true but for trust-ratio families) whether its
//                          state lists may be 8-bit codes
//   kMaxStates             the most state lists it keeps per tensor (at most 3)
//   allows_states(k)       constexpr: whether some configuration keeps k state lists
//   num_states(flags)      how many this configuration keeps; state_name(flags, k) their names
//   Step<Real>             the per-step scalars; make_step(hyper, count, flags, complex)
//   update(step, n, tensor_flags, g, p, s0, s1, s2, u)
//                          the element loop over n scalars: the state lists s0.. (as many as the
//                          configuration keeps) updated in place, u = the update added to p
//
// A family whose update scales each tensor by a trust ratio (LAMB, LARS: You et al., 2017 and
// 2019) also has
//   kTrustRatio = true     and a `trust_ratio` member of its Step, which update() reads
//   kTrustSumsName         the XLA target of its first pass (trust_sums.h)
//   kDirectionStates       how many of its state lists (the first ones) the direction reads
//   direction(step, n, tensor_flags, g, p, s0, s1, s2, d)
//                          the update before the ratio, states read only (the first pass sums
//                          its squares and the params' per tensor)
//   trust_ratio(step, tensor_flags, param_sumsq, direction_sumsq)
//                          the tensor's ratio from those sums
// and its op takes one more trailing operand: trust_sums u32[R, n, kTrustSumWords], the
// per-tensor sums of R devices (R = 1 unsharded), added in row order.
//
// Operands: count s32[], hyper f32/f64[Hyper::kSize], grad_ctrl f32/f64[GradCtrl::kSize], then
//   n buffers per list: grads, params, the state lists in order, then master params (attribute
//   `master`) or param remainders (int16, attribute `remainders`, bf16 params: rounding.h),
//   then with attribute `quantized_states` (8-bit moments, moment_codes.h: every state list holds
//   int8 or uint8 codes) a float32 block-scale list per state list, in state order,
//   then the trailing operands: trust_sums (trust-ratio families), rounding_keys
//   u32[n, RoundingKey::kSize] (attribute `stochastic_rounding`: the params are stored rounded
//   stochastically, rounding.h). Results: the new count s32[], then every list but the grads,
//   updated in place: each result buffer must be aliased to its operand (the handler checks).
// The math runs in double when any buffer of the call is float64, else in float; the tensors of
// one call are all real or all complex.
#pragma once

#include <cmath>
#include <iterator>
#include <string>
#include <type_traits>

#include "optim/moment_codes.h"
#include "optim/multi_tensor_plan.h"
#include "optim/norm_math.h"
#include "core/op.h"
#include "optim/optimizer_signatures.h"
#include "optim/rounding.h"
#include "optim/tensor_lists.h"

namespace jaxfuse {

inline constexpr int kMaxOptimizerStates = 3;
// Leaves per optimizer call (Python splits a larger tree into calls of this many). XLA's fusion
// pass takes time quadratic in one custom call's input/output aliases, two to four per leaf, so
// calls of 256 keep compilation near-linear; on the GPU such a call is one launch, and the
// trust-ratio families' finishing kernel takes every leaf's chunk starts as a kernel parameter.
inline constexpr int kMaxTensorsPerCall = 256;

// The kernel lists of one call: grads, params, the states, then the master params or the param
// remainders (rounding.h) when present, then with quantized states (8-bit codes) their block
// scales (moment_codes.h), one list per state.
struct OptimizerLists {
  static constexpr int kGrads = 0;
  static constexpr int kParams = 1;
  int num_states = 0;
  int master = -1;      // list index, -1: absent
  int remainders = -1;  // list index, -1: absent
  bool quantized = false;

  static constexpr OptimizerLists of(int num_states, bool master, bool remainders = false,
                                     bool quantized = false) {
    OptimizerLists l;
    l.num_states = num_states;
    l.master = master ? 2 + num_states : -1;
    l.remainders = remainders ? 2 + num_states : -1;
    l.quantized = quantized;
    return l;
  }
  static constexpr int state(int k) { return 2 + k; }
  constexpr int unscaled_count() const {
    return 2 + num_states + (master >= 0 || remainders >= 0 ? 1 : 0);
  }
  constexpr int count() const { return unscaled_count() + (quantized ? num_states : 0); }
  // The block-scale list of state list k (quantized states only).
  constexpr int scales(int k) const { return unscaled_count() + k; }
  // The list the math reads the params from: the master copy when present (with remainders,
  // the params, joined to their remainders).
  constexpr int param_source() const { return master >= 0 ? master : kParams; }
};

// optax.safe_increment on an int32 count: saturates at INT32_MAX.
JF_HD int32_t safe_increment(int32_t count) { return count < INT32_MAX ? count + 1 : count; }

// The count written back: advanced unless the step is skipped.
JF_HD int32_t next_count(int32_t count, bool skip) { return skip ? count : safe_increment(count); }

// Whether a family scales each tensor's update by a trust ratio (see the header comment).
template <typename Family, typename = void>
struct HasTrustRatio : std::false_type {};
template <typename Family>
struct HasTrustRatio<Family, std::void_t<decltype(Family::kTrustRatio)>>
    : std::bool_constant<Family::kTrustRatio> {};
template <typename Family>
inline constexpr bool kHasTrustRatio = HasTrustRatio<Family>::value;

// Whether a family keeps 8-bit states (moment_codes.h): every family but the trust-ratio ones
// (their first pass reads the states as floats) and those that say kQuantizedStates = false
// (schedule-free: its state z is the params' other copy, which 8 bits cannot hold).
template <typename Family, typename = void>
struct TakesQuantizedStates : std::bool_constant<!kHasTrustRatio<Family>> {};
template <typename Family>
struct TakesQuantizedStates<Family, std::void_t<decltype(Family::kQuantizedStates)>>
    : std::bool_constant<Family::kQuantizedStates> {};
template <typename Family>
inline constexpr bool kTakesQuantizedStates = TakesQuantizedStates<Family>::value;

// One tensor's sums for its trust ratio: of the squares of its params and of its direction, in
// double, exchanged as kTrustSumWords uint32 words (the doubles' bits, so that JAX can gather
// devices' rows without float64).
inline constexpr int kTrustSumWords = kNormSumWords;

struct TrustSum {
  double param_sumsq = 0.0;
  double direction_sumsq = 0.0;

  JF_HD void add(const TrustSum& o) {
    param_sumsq += o.param_sumsq;
    direction_sumsq += o.direction_sumsq;
  }
  JF_HD void store(uint32_t* words) const {
    store_double_pair(words, param_sumsq, direction_sumsq);
  }
  JF_HD static TrustSum load(const uint32_t* words) {
    TrustSum s;
    load_double_pair(words, s.param_sumsq, s.direction_sumsq);
    return s;
  }
};

// optax.scale_by_trust_ratio's ratio (min_norm 0) from the sums of squares: the norms are the
// sums' square roots rounded once to the compute type (optax sums in it), and a tensor whose
// params or update have norm 0 keeps ratio 1.
template <typename Real>
JF_HD Real optax_trust_ratio(Real trust_coefficient, Real eps, double param_sumsq,
                             double direction_sumsq) {
  const Real param_norm = Real(sqrt(param_sumsq));
  const Real update_norm = Real(sqrt(direction_sumsq));
  const Real ratio = trust_coefficient * param_norm / (update_norm + eps);
  return (param_norm == Real(0) || update_norm == Real(0)) ? Real(1) : ratio;
}

// The trust_sums operand: rows of per-tensor sums, one per device that holds part of the
// tensors (a device's row is zero for the tensors it does not own), added in row order so that
// every device gets the same total.
struct TrustSums {
  const uint32_t* words = nullptr;  // [rows][num_tensors][kTrustSumWords]
  int64_t rows = 0;
  int64_t num_tensors = 0;

  JF_HD TrustSum total(int64_t t) const {
    TrustSum s;
    for (int64_t r = 0; r < rows; ++r) {
      s.add(TrustSum::load(words + (r * num_tensors + t) * kTrustSumWords));
    }
    return s;
  }
};

// What one step of a family needs per element: its scalars, how it sees the gradients and how
// it rounds the params it stores.
template <typename Family, typename Real>
struct OptimizerStep {
  typename Family::template Step<Real> math;
  GradScaling<Real> grad;
  ParamRounding rounding;
  uint32_t stream = 0;  // the tensor's random stream when the rounding is stochastic
};

// The step of tensor t: with its random stream when the rounding is stochastic, and with its
// ratio for a trust-ratio family.
template <typename Family, typename Real>
JF_HD OptimizerStep<Family, Real> tensor_step(const OptimizerStep<Family, Real>& step,
                                              const TrustSums& sums, int64_t t,
                                              uint8_t tensor_flags) {
  OptimizerStep<Family, Real> s = step;
  if (step.rounding.stochastic()) s.stream = step.rounding.stream(t);
  if constexpr (kHasTrustRatio<Family>) {
    const TrustSum total = sums.total(t);
    s.math.trust_ratio =
        Family::trust_ratio(step.math, tensor_flags, total.param_sumsq, total.direction_sumsq);
  }
  return s;
}

template <typename Family, typename Real>
JF_HD OptimizerStep<Family, Real> make_optimizer_step(ScalarVector hyper, ScalarVector grad_ctrl,
                                                      int32_t count, uint32_t flags, bool complex,
                                                      const uint32_t* rounding_keys = nullptr) {
  return {Family::template make_step<Real>(hyper, count, flags, complex),
          make_grad_scaling<Real>(grad_ctrl), ParamRounding{rounding_keys, count}};
}

// State list k of a group, from its floats or from its 8-bit codes and their block scales.
template <typename Lists, typename Group, typename Values>
JF_HD void load_state(const Lists& lists, const Group& group, int k, Values& x) {
  if (lists.quantized) {
    group.load_codes(OptimizerLists::state(k), lists.scales(k), x);
  } else {
    group.load(OptimizerLists::state(k), x);
  }
}

template <typename Lists, typename Group, typename Values>
JF_HD void store_state(const Lists& lists, const Group& group, int k, const Values& x) {
  if (lists.quantized) {
    group.store_codes(OptimizerLists::state(k), lists.scales(k), x);
  } else {
    group.store(OptimizerLists::state(k), x);
  }
}

// One group of elements through a step. `Group` is the platform's group (the GPU: 4 scalars of
// one thread, in registers; the CPU: a tile of a chunk, in scratch): Values (an array of Real),
// size(), load(list, x), store(list, x) (converting from and to the list's float dtype),
// load_words(list, x), store_words(list, x) (an int16 list, as integer values),
// load_codes(list, scale_list, x), store_codes(list, scale_list, x) (8-bit codes and their
// block scales, moment_codes.h; a group holds whole blocks, or whole warps of a block),
// round_stochastically(stream, p) (stochastic_round_run() over the group's params, their
// indices in the tensor) and update(math, g, p, s0, s1, s2, u), the family's element loop.
// `Lists` is an OptimizerLists or a type with its members as compile-time constants. A skipped
// (non-finite) step leaves everything as it is. With master weights the math reads and writes
// the master copy, and the params are its rounding; with remainders it reads the params joined
// to their remainders and writes both halves back.
template <typename Family, typename Real, typename Lists, typename Group>
JF_HD void optimizer_group(const OptimizerStep<Family, Real>& step, const Lists& lists,
                           const Group& group) {
  if (step.grad.skip) return;
  typename Group::Values g, p, s0, s1, s2, u;
  const auto n = group.size();
  // Every load first, then the math: on the GPU a group's loads go out together, none waiting
  // on the division of the gradient scaling.
  group.load(OptimizerLists::kGrads, g);
  group.load(lists.param_source(), p);
  if (lists.remainders >= 0) group.load_words(lists.remainders, u);
  if (lists.num_states > 0) load_state(lists, group, 0, s0);
  if (lists.num_states > 1) load_state(lists, group, 1, s1);
  if (lists.num_states > 2) load_state(lists, group, 2, s2);
  scale_group(step.grad, n, g);
  if (lists.remainders >= 0) {
    for (decltype(+n) i = 0; i < n; ++i) p[i] = join_remainder(p[i], u[i]);
  }
  group.update(step.math, g, p, s0, s1, s2, u);
  // The params first: their values die before the states' stores (8-bit codes reduce a block's
  // maximum across the warp, with only the states left live).
  for (decltype(+n) i = 0; i < n; ++i) p[i] = p[i] + u[i];
  if (lists.master >= 0) group.store(lists.master, p);
  if (lists.remainders >= 0) {
    for (decltype(+n) i = 0; i < n; ++i) split_remainder(p[i], p[i], u[i]);
    group.store_words(lists.remainders, u);
  } else if (lists.master < 0 && step.rounding.stochastic()) {  // (the op refuses both)
    group.round_stochastically(step.stream, p);
  }
  group.store(OptimizerLists::kParams, p);
  if (lists.num_states > 0) store_state(lists, group, 0, s0);
  if (lists.num_states > 1) store_state(lists, group, 1, s1);
  if (lists.num_states > 2) store_state(lists, group, 2, s2);
}

namespace optimizer_detail {

template <size_t N>
uint32_t bit_limit(const char* const (&)[N]) {
  return uint32_t(1) << N;
}

inline ffi::Error check_tensor_flags(ffi::Span<const uint8_t> flags, int64_t n, uint32_t limit) {
  if (static_cast<int64_t>(flags.size()) != n) {
    return invalid_argument("tensor_flags has ", flags.size(), " entries, expected num_tensors=",
                            n);
  }
  for (size_t t = 0; t < flags.size(); ++t) {
    if (flags[t] >= limit) {
      return invalid_argument("tensor_flags entry ", t, " is ", int(flags[t]), ", expected < ",
                              limit);
    }
  }
  return ffi::Error::Success();
}

// One call computes in one type and treats all its tensors alike: all real or all complex.
inline ffi::Error check_uniform_complex(const TensorLists& tensors, bool allowed) {
  for (int64_t t = 0; t < tensors.num_tensors(); ++t) {
    if (tensors.complex[t] && !allowed) {
      return invalid_argument("tensor ", t, " is complex; this optimizer takes real tensors");
    }
    if (tensors.complex[t] != tensors.complex[0]) {
      return invalid_argument("tensor ", t, " is ", tensors.complex[t] ? "complex" : "real",
                              ", tensor 0 is not (one call takes real or complex tensors)");
    }
  }
  return ffi::Error::Success();
}

// Result buffer t of a list must be its operand buffer t (in-place update).
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

// What every pass of a family reads besides its lists: the hyperparameter vector, the gradient
// control and the call's flags (checked against the family's flag names).
struct StepOperands {
  ScalarVector hyper;
  ScalarVector grad_ctrl;
  uint32_t flags = 0;
};

// How the params are kept: a master copy, remainders or neither; stochastic rounding only for
// params without either (they are what it stands in for).
inline ffi::Error check_params_mode(bool master, bool remainders, bool stochastic_rounding,
                                    bool trust_ratio) {
  if (master && remainders) return invalid_argument("master and remainders are exclusive");
  if (stochastic_rounding && (master || remainders)) {
    return invalid_argument("stochastic_rounding is for params without a master copy or "
                            "remainders");
  }
  if (remainders && trust_ratio) {
    return invalid_argument("remainders are not supported by trust-ratio families");
  }
  return ffi::Error::Success();
}

// 8-bit states: every tensor real, computed in float, whole blocks of elements; the codes' dtype
// is checked by collect_lists. Trust-ratio families' first pass reads the states as floats.
inline ffi::Error check_quantized_states(const TensorLists& tensors, bool f64, bool takes) {
  if (!takes) return invalid_argument("quantized states are not supported by this optimizer");
  if (f64) return invalid_argument("quantized states need a call computed in float32");
  for (int64_t t = 0; t < tensors.num_tensors(); ++t) {
    if (tensors.complex[t]) return invalid_argument("tensor ", t, " is complex; quantized states "
                                                    "take real tensors");
    if (tensors.size[t] % kMomentBlock != 0) {
      return invalid_argument("tensor ", t, " has ", tensors.size[t], " elements; quantized "
                              "states take whole blocks of ", kMomentBlock);
    }
  }
  return ffi::Error::Success();
}

// Remainders complete bfloat16 params to float32: every params buffer bfloat16, the call
// computed in float (the remainder list's int16 dtype is checked by collect_lists).
inline ffi::Error check_remainder_params(const TensorLists& tensors, bool f64) {
  if (f64) return invalid_argument("remainders need a call computed in float32, not float64");
  for (int64_t t = 0; t < tensors.num_tensors(); ++t) {
    if (tensors.dtype[t][OptimizerLists::kParams] != DType::kBF16) {
      return invalid_argument("params of tensor ", t, " are ",
                              dtype_name(tensors.dtype[t][OptimizerLists::kParams]),
                              "; remainders complete bfloat16 params");
    }
  }
  return ffi::Error::Success();
}

template <typename Family>
ffi::Error decode_step_operands(ffi::AnyBuffer hyper, ffi::AnyBuffer grad_ctrl, int64_t flags,
                                StepOperands* out) {
  const auto hyper_vector = scalar_vector("hyper", hyper, Family::Hyper::kSize);
  if (hyper_vector.has_error()) return hyper_vector.error();
  const auto grad_ctrl_vector = scalar_vector("grad_ctrl", grad_ctrl, GradCtrl::kSize);
  if (grad_ctrl_vector.has_error()) return grad_ctrl_vector.error();
  if (flags < 0 || flags >= bit_limit(Family::kFlagNames)) {
    return invalid_argument("flags ", flags, " has bits beyond the ",
                            std::size(Family::kFlagNames), " flags of the op");
  }
  *out = {*hyper_vector, *grad_ctrl_vector, static_cast<uint32_t>(flags)};
  return ffi::Error::Success();
}

}  // namespace optimizer_detail

template <typename Family>
struct OptimizerOp {
  static constexpr const char* kName = Family::kName;
  using Hyper = typename Family::Hyper;

  struct Call {
    TensorLists tensors;  // OptimizerLists order; mask: the tensor flags
    OptimizerLists lists;
    const int32_t* count = nullptr;
    int32_t* new_count = nullptr;
    ScalarVector hyper;
    ScalarVector grad_ctrl;
    TrustSums trust_sums;                    // trust-ratio families only
    const uint32_t* rounding_keys = nullptr;  // stochastic rounding only
    uint32_t flags = 0;
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
        .template Attr<int64_t>("flags")
        .template Attr<bool>("master")
        .template Attr<bool>("remainders")
        .template Attr<bool>("stochastic_rounding")
        .template Attr<bool>("quantized_states")
        .template Attr<ffi::Span<const uint8_t>>("tensor_flags")
        .template Attr<int64_t>("packed_lists")
        .template Attr<ffi::Span<const int64_t>>("packed_offsets")
        .template Attr<ffi::Span<const int64_t>>("tensor_sizes");
  }

  static OptimizerLists lists_of(uint32_t flags, bool master, bool remainders, bool quantized) {
    return OptimizerLists::of(Family::num_states(flags), master, remainders, quantized);
  }

  // The name of kernel list `list`.
  static std::string list_name(uint32_t flags, const OptimizerLists& lists, int list) {
    if (list == OptimizerLists::kGrads) return "grads";
    if (list == OptimizerLists::kParams) return "params";
    if (list == lists.master) return "master_params";
    if (list == lists.remainders) return "param_remainders";
    if (list >= lists.unscaled_count()) {
      return std::string(Family::state_name(flags, list - lists.unscaled_count())) + "_scales";
    }
    return Family::state_name(flags, list - OptimizerLists::state(0));
  }

  static ffi::Error decode(CountBuffer count, ffi::AnyBuffer hyper, ffi::AnyBuffer grad_ctrl,
                           ffi::RemainingArgs args, ffi::Result<CountBuffer> new_count,
                           ffi::RemainingRets rets, int64_t n, int64_t flags, bool master,
                           bool remainders, bool stochastic_rounding, bool quantized_states,
                           ffi::Span<const uint8_t> tensor_flags, int64_t packed_lists,
                           ffi::Span<const int64_t> packed_offsets,
                           ffi::Span<const int64_t> tensor_sizes, Call* call);

  template <typename Platform>
  static ffi::Error run(typename Platform::Arg ctx, const Call& call);

  // Python builds the hyper vector, the flags and the lists by these names.
  static Contract contract() {
    Contract c;
    c.names["hyper"] = name_list(Hyper::kNames);
    c.names["grad_ctrl"] = name_list(GradCtrl::kNames);
    c.names["flags"] = name_list(Family::kFlagNames);
    c.names["tensor_flags"] = name_list(Family::kTensorFlagNames);
    c.names["fixed_operands"] = {"count", "hyper", "grad_ctrl"};  // binding() order
    c.names["fixed_results"] = {"count"};
    c.names["rounding_key"] = name_list(RoundingKey::kNames);
    c.numbers["moment_block"] = kMomentBlock;
    c.numbers["max_tensors_per_call"] = kMaxTensorsPerCall;
    if constexpr (kHasTrustRatio<Family>) c.names["trust_sums_op"] = {Family::kTrustSumsName};
    // The lists, and the operands after them, of a call with these attributes.
    c.functions["lists"] = [](const std::map<std::string, int64_t>& args) {
      const uint32_t flags = static_cast<uint32_t>(contract_arg(args, "flags"));
      const OptimizerLists lists = lists_of(flags, contract_arg(args, "master") != 0,
                                            contract_arg(args, "remainders") != 0,
                                            contract_arg(args, "quantized_states") != 0);
      ContractValues v;
      for (int k = 0; k < lists.count(); ++k) {
        v.names["operands"].push_back(list_name(flags, lists, k));
        if (k != OptimizerLists::kGrads) v.names["results"].push_back(list_name(flags, lists, k));
      }
      v.names["trailing_operands"] = {};
      if (kHasTrustRatio<Family>) v.names["trailing_operands"].push_back("trust_sums");
      if (contract_arg(args, "stochastic_rounding") != 0) {
        v.names["trailing_operands"].push_back("rounding_keys");
      }
      return v;
    };
    return c;
  }

  static int64_t num_trailing(bool stochastic_rounding) {
    return (kHasTrustRatio<Family> ? 1 : 0) + (stochastic_rounding ? 1 : 0);
  }
  static std::string trailing_names(bool stochastic_rounding) {
    std::string names = kHasTrustRatio<Family> ? ", then trust_sums" : "";
    if (stochastic_rounding) names += names.empty() ? ", then rounding_keys" : ", rounding_keys";
    return names;
  }

  // Multi-tensor kernels over the call's lists, one per signature of its tensors
  // (optimizer_signatures.h), every tensor's elements read or written once (of a packed list,
  // the call's tensors' elements, not the whole buffer).
  static CallCost cost(const CallShape& shape) {
    const int64_t n = contract_arg(shape.attrs, "num_tensors");
    const int64_t fixed = 3;  // count, hyper, grad_ctrl; the grads are the first list
    const OptimizerLists lists = lists_of(static_cast<uint32_t>(contract_arg(shape.attrs, "flags")),
                                          contract_arg(shape.attrs, "master") != 0,
                                          contract_arg(shape.attrs, "remainders") != 0,
                                          contract_arg(shape.attrs, "quantized_states") != 0);
    const std::vector<int64_t> offsets = shape.array("packed_offsets");
    const std::vector<int64_t> sizes = shape.array("tensor_sizes");
    const PackedLists packed{static_cast<uint32_t>(contract_arg(shape.attrs, "packed_lists")),
                             offsets, sizes};
    auto buffer = [&](int k, int64_t t) -> const CallShape::Buffer& {
      return shape.operands.at(fixed + packed.first_buffer(0, k, n) + (packed.has(k) ? 0 : t));
    };
    std::vector<std::array<DType, kMaxLists>> rows(n);
    std::vector<int64_t> scalars(n);
    for (int64_t t = 0; t < n; ++t) {
      for (int k = 0; k < lists.count(); ++k) {
        rows[t][k] = hlo_float_dtype(buffer(k, t).element_type);
      }
      scalars[t] = packed.has(0) ? sizes.at(t) * (buffer(0, t).complex ? 2 : 1)
                                 : buffer(0, t).scalars();
    }
    CallCost c = streaming_cost(shape, signature_launches(lists, rows, scalars));
    for (int k = 0; k < lists.count(); ++k) {
      if (!packed.has(k)) continue;
      const CallShape::Buffer& b = buffer(k, 0);
      const ListKind kind =
          k >= lists.unscaled_count() ? ListKind::kBlockValues : ListKind::kFloats;
      int64_t touched = 0;
      for (int64_t t = 0; t < n; ++t) touched += list_elements(kind, scalars[t], b.complex);
      const int64_t unread = b.bytes() - touched * b.element_bytes;
      c.bytes_read -= unread;
      if (k != OptimizerLists::kGrads) c.bytes_written -= unread;
    }
    return c;
  }
};

template <typename Family>
ffi::Error OptimizerOp<Family>::decode(CountBuffer count, ffi::AnyBuffer hyper,
                                       ffi::AnyBuffer grad_ctrl, ffi::RemainingArgs args,
                                       ffi::Result<CountBuffer> new_count,
                                       ffi::RemainingRets rets, int64_t n, int64_t flags,
                                       bool master, bool remainders, bool stochastic_rounding,
                                       bool quantized_states,
                                       ffi::Span<const uint8_t> tensor_flags,
                                       int64_t packed_lists,
                                       ffi::Span<const int64_t> packed_offsets,
                                       ffi::Span<const int64_t> tensor_sizes, Call* call) {
  using namespace optimizer_detail;
  StepOperands step;
  JF_RETURN_IF_ERROR(decode_step_operands<Family>(hyper, grad_ctrl, flags, &step));
  const uint32_t op_flags = step.flags;
  JF_RETURN_IF_ERROR(check_params_mode(master, remainders, stochastic_rounding,
                                       kHasTrustRatio<Family>));
  const OptimizerLists lists = lists_of(op_flags, master, remainders, quantized_states);
  // n is bounded by the tensor flags' count before any product is formed (no overflow).
  JF_RETURN_IF_ERROR(
      check_tensor_flags(tensor_flags, n, bit_limit(Family::kTensorFlagNames)));
  if (packed_lists < 0 || packed_lists >= (int64_t(1) << lists.count())) {
    return invalid_argument("packed_lists ", packed_lists, " names lists beyond the call's ",
                            lists.count());
  }
  const PackedLists packed{static_cast<uint32_t>(packed_lists), packed_offsets, tensor_sizes};
  const int64_t trailing = num_trailing(stochastic_rounding);
  const int64_t num_args = static_cast<int64_t>(args.size()) - trailing;
  const int64_t list_buffers = packed.first_buffer(0, lists.count(), n);
  if (num_args != list_buffers ||
      static_cast<int64_t>(rets.size()) != list_buffers - packed.buffers(0, n)) {
    return invalid_argument(args.size(), " tensor operands and ", rets.size(),
                            " tensor results do not fit num_tensors=", n, " (expected ",
                            lists.count(), " and ", lists.count() - 1, " per tensor",
                            packed_lists != 0 ? ", one per packed list" : "",
                            trailing_names(stochastic_rounding), ")");
  }
  int64_t next = num_args;
  if constexpr (kHasTrustRatio<Family>) {
    auto sums = args.get<ffi::Buffer<ffi::U32, 3>>(next++);
    if (sums.has_error()) return invalid_argument("trust_sums: ", sums.error().message());
    const auto dims = sums->dimensions();
    if (dims[1] != n || dims[2] != kTrustSumWords) {
      return invalid_argument("trust_sums is u32[", dims[0], ", ", dims[1], ", ", dims[2],
                              "], expected u32[rows, ", n, ", ", kTrustSumWords, "]");
    }
    call->trust_sums = {sums->typed_data(), dims[0], n};
  }
  if (stochastic_rounding) {
    auto keys = args.get<ffi::Buffer<ffi::U32, 2>>(next++);
    if (keys.has_error()) return invalid_argument("rounding_keys: ", keys.error().message());
    const auto dims = keys->dimensions();
    if (dims[0] != n || dims[1] != RoundingKey::kSize) {
      return invalid_argument("rounding_keys is u32[", dims[0], ", ", dims[1], "], expected u32[",
                              n, ", ", int(RoundingKey::kSize), "]");
    }
    call->rounding_keys = keys->typed_data();
  }
  std::string names[kMaxLists];
  ListSource sources[kMaxLists];
  for (int k = 0; k < lists.count(); ++k) {
    names[k] = list_name(op_flags, lists, k);
    const bool state = k >= OptimizerLists::state(0) && k < OptimizerLists::state(lists.num_states);
    sources[k] = {names[k].c_str(), false, packed.first_buffer(0, k, n),
                  k == lists.remainders                      ? ListKind::kWords
                  : k >= lists.unscaled_count()              ? ListKind::kBlockValues
                  : (state && lists.quantized)               ? ListKind::kCodes
                                                             : ListKind::kFloats};
    if (k == OptimizerLists::kGrads) continue;
    JF_RETURN_IF_ERROR(check_aliased(args, rets, packed.first_buffer(0, k, n),
                                     packed.first_buffer(1, k, n), packed.buffers(k, n),
                                     names[k].c_str()));
  }
  JF_RETURN_IF_ERROR(collect_lists(args, &rets, sources, lists.count(), n, tensor_flags,
                                   &call->tensors, packed));
  JF_RETURN_IF_ERROR(check_uniform_complex(call->tensors, Family::kComplex));
  call->f64 = call->tensors.computes_in_double();
  if (master) {
    const DType compute = call->f64 ? DType::kF64 : DType::kF32;
    for (int64_t t = 0; t < n; ++t) {
      if (call->tensors.dtype[t][lists.master] != compute) {
        return invalid_argument("master params of tensor ", t, " must be ", dtype_name(compute),
                                " (the compute type)");
      }
    }
  }
  if (remainders) JF_RETURN_IF_ERROR(check_remainder_params(call->tensors, call->f64));
  if (quantized_states) {
    JF_RETURN_IF_ERROR(
        check_quantized_states(call->tensors, call->f64, kTakesQuantizedStates<Family>));
  }
  call->lists = lists;
  call->count = count.typed_data();
  call->new_count = new_count->typed_data();
  call->hyper = step.hyper;
  call->grad_ctrl = step.grad_ctrl;
  call->flags = op_flags;
  call->complex = n > 0 && call->tensors.complex[0];
  return ffi::Error::Success();
}

}  // namespace jaxfuse
