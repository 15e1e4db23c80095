// What an op is, and the one handler every op gets on every platform.
//
// An op is a struct (see optim/optimizer.h, optim/clip.h, decoder/decoder.h) with
//   kName                     the XLA target name, e.g. "jaxfuse_adam";
//   Call                      the decoded, validated call (pointers, sizes, flags);
//   binding<Context>()        its FFI signature after the platform context;
//   decode(operands..., Call*) validation shared by all platforms;
//   run<Platform>(ctx, call)  declared only; each platform file defines its own;
//   contract()                the numbers and layouts Python must agree with, exported by the
//                             nanobind module so that each is written once, here in C++;
//   cost(shape)               what a call of that shape costs (CallCost): the kernels and
//                             memsets run<Cuda> enqueues and the bytes it moves, for
//                             jaxfuse.report (tools/cuda_on_cpu checks the launch counts
//                             against the work the emulated runtime saw).
// A platform file defines run<Platform> and registers the op with JAXFUSE_REGISTER_OP; the
// module (csrc/core/module.cc) hands every registered op's handler and contract to Python.
#pragma once

#include <functional>
#include <map>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "core/ffi_util.h"

namespace jaxfuse {

// Numbers, ordered name lists (operand layouts, vector fields) and shapes shared with Python.
struct ContractValues {
  std::map<std::string, int64_t> numbers;
  std::map<std::string, std::vector<std::string>> names;
  std::map<std::string, std::vector<int64_t>> shapes;
};

// Layouts that depend on the call (e.g. the workspace size for a batch): named integer
// arguments in, values out.
using ContractFunction = std::function<ContractValues(const std::map<std::string, int64_t>&)>;

struct Contract : ContractValues {
  std::map<std::string, ContractFunction> functions;
};

// Reads integer argument `name` of a contract function (a missing one is a programming error on
// the Python side, reported as a C++ exception that nanobind turns into a Python one).
int64_t contract_arg(const std::map<std::string, int64_t>& args, const char* name);

template <size_t N>
std::vector<std::string> name_list(const char* const (&names)[N]) {
  return std::vector<std::string>(names, names + N);
}

// Operand types most ops share (aliases keep commas out of macros).
using CountBuffer = ffi::Buffer<ffi::S32, 0>;
using BytesBuffer = ffi::Buffer<ffi::U8, 1>;  // a workspace of raw bytes

namespace op_detail {

// `rank` 1 for a vector, 0 for a scalar (size 1).
inline ffi::Error check_scalar_vector(const char* name, const ffi::AnyBuffer& b, int64_t size,
                                      size_t rank) {
  const ffi::DataType t = b.element_type();
  if (t != ffi::DataType::F32 && t != ffi::DataType::F64) {
    return invalid_argument(name, " must be float32 or float64");
  }
  if (b.dimensions().size() != rank) {
    return invalid_argument(name, " must have rank ", rank, ", got ", b.dimensions().size());
  }
  if (static_cast<int64_t>(b.element_count()) != size) {
    return invalid_argument(name, " has ", b.element_count(), " elements, expected ", size);
  }
  return ffi::Error::Success();
}

}  // namespace op_detail

// A small float32 or float64 vector operand of `size` elements (dtype.h's ScalarVector).
inline ffi::ErrorOr<ScalarVector> scalar_vector(const char* name, const ffi::AnyBuffer& b,
                                                int64_t size) {
  JF_RETURN_UNEXPECTED_IF_ERROR(op_detail::check_scalar_vector(name, b, size, 1));
  return ScalarVector{b.untyped_data(), b.element_type() == ffi::DataType::F64};
}

// The same for a result the op writes; a 0-d result (`size` 0) is a scalar.
inline ffi::ErrorOr<ScalarVectorOut> scalar_vector_out(const char* name, ffi::AnyBuffer b,
                                                       int64_t size) {
  JF_RETURN_UNEXPECTED_IF_ERROR(
      op_detail::check_scalar_vector(name, b, size == 0 ? 1 : size, size == 0 ? 0 : 1));
  return ScalarVectorOut{b.untyped_data(), b.element_type() == ffi::DataType::F64};
}

// ---- launch and byte accounting ----------------------------------------------------------------

// A call as compiled HLO shows it: each operand's and result's dimensions, bytes per element and
// whether it is complex (two scalars per element), and the call's integer and boolean attributes.
struct CallShape {
  struct Buffer {
    std::vector<int64_t> dims;
    int64_t element_bytes = 0;
    bool complex = false;
    std::string element_type;  // HLO's name: "f32", "bf16", "c64", "s8", ...
    int64_t elements() const {
      int64_t n = 1;
      for (int64_t d : dims) n *= d;
      return n;
    }
    int64_t scalars() const { return complex ? 2 * elements() : elements(); }
    int64_t bytes() const { return element_bytes * elements(); }
  };
  std::vector<Buffer> operands;
  std::vector<Buffer> results;
  std::map<std::string, int64_t> attrs;
  std::map<std::string, std::vector<int64_t>> arrays;  // integer array attributes

  // The integer array attribute `name`, empty where the call has none.
  std::vector<int64_t> array(const std::string& name) const {
    const auto it = arrays.find(name);
    return it == arrays.end() ? std::vector<int64_t>{} : it->second;
  }

  // Scalars of operands [first, first + count), in order (the tensors of a multi-tensor list).
  // A shape the op cannot have is a programming error on the Python side (an exception).
  std::vector<int64_t> scalars(int64_t first, int64_t count) const {
    if (first < 0 || count < 0 || first + count > static_cast<int64_t>(operands.size())) {
      throw std::invalid_argument(str_cat("operands [", first, ", ", first + count,
                                          ") of a call with ", operands.size()));
    }
    std::vector<int64_t> out;
    for (int64_t i = first; i < first + count; ++i) out.push_back(operands[i].scalars());
    return out;
  }

  static int64_t total_bytes(const std::vector<Buffer>& buffers) {
    int64_t n = 0;
    for (const Buffer& b : buffers) n += b.bytes();
    return n;
  }
};

// What one call costs: the kernels and memsets it enqueues on a CUDA stream, and the bytes it
// reads and writes in device (or host) memory on either platform. `bytes_upper_bound`: the
// bytes depend on runtime values (e.g. the decoder's positions) and are counted at their most.
struct CallCost {
  int64_t cuda_kernels = 0;
  int64_t cuda_memsets = 0;
  int64_t bytes_read = 0;
  int64_t bytes_written = 0;
  bool bytes_upper_bound = false;
};

// The cost of an op that reads each operand once and writes each result once (element-wise
// multi-tensor ops), given its CUDA launches.
inline CallCost streaming_cost(const CallShape& shape, int64_t cuda_kernels) {
  CallCost c;
  c.cuda_kernels = cuda_kernels;
  c.bytes_read = CallShape::total_bytes(shape.operands);
  c.bytes_written = CallShape::total_bytes(shape.results);
  return c;
}

// ---- registration -----------------------------------------------------------------------------

struct RegisteredOp {
  const char* name;
  XLA_FFI_Handler* handler;
  Contract (*contract)();
  CallCost (*cost)(const CallShape&);
};

// The ops linked into this module (defined in csrc/core/module.cc).
std::vector<RegisteredOp>& registered_ops();

inline bool register_op(RegisteredOp op) {
  registered_ops().push_back(op);
  return true;
}

// The op's name, once, in front of every error its handler returns.
inline ffi::Error with_op_name(const char* op, ffi::Error err) {
  if (err.success()) return err;
  return ffi::Error(*err.errc(), str_cat(op, ": ", err.message()));
}

// The handler of `Op` on `Platform`: decode (shared), then the platform's run step. `Platform`
// names its FFI context (Context), what that context decodes to (Arg) and whether the handler
// may be captured into command buffers (kCommandBufferCompatible).
template <typename Op, typename Platform>
XLA_FFI_Error* ffi_handler(XLA_FFI_CallFrame* frame) {
  auto impl = [](typename Platform::Arg ctx, auto... operands) -> ffi::Error {
    typename Op::Call call;
    ffi::Error err = Op::decode(operands..., &call);
    if (err.success()) err = Op::template run<Platform>(ctx, call);
    return with_op_name(Op::kName, std::move(err));
  };
  static auto* handler = [&] {
    auto binding = Op::template binding<typename Platform::Context>();
    if constexpr (Platform::kCommandBufferCompatible) {
      return binding.To(impl, {ffi::Traits::kCmdBufferCompatible}).release();
    } else {
      return binding.To(impl).release();
    }
  }();
  return handler->Call(frame);
}

#define JF_CONCAT_INNER(a, b) a##b
#define JF_CONCAT(a, b) JF_CONCAT_INNER(a, b)

// Registers Op's handler for Platform in this module (one line in the op's platform file).
#define JAXFUSE_REGISTER_OP(Op, Platform)                                                      \
  static const bool JF_CONCAT(jf_registered_, __LINE__) = ::jaxfuse::register_op(             \
      {Op::kName, &::jaxfuse::ffi_handler<Op, Platform>, &Op::contract, &Op::cost})

}  // namespace jaxfuse
