// What a native module of jaxfuse exports (module.h), compiled into each module with its ops.
#include <nanobind/nanobind.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <stdexcept>
#include <tuple>

#include "core/module.h"
#include "core/op.h"
#include "xla/ffi/api/c_api.h"
#ifdef JAXFUSE_CUDA_MODULE
#include "core/cuda/cuda_info.h"
#endif

namespace nb = nanobind;

namespace jaxfuse {

std::vector<RegisteredOp>& registered_ops() {
  static std::vector<RegisteredOp> ops;
  return ops;
}

int64_t contract_arg(const std::map<std::string, int64_t>& args, const char* name) {
  auto it = args.find(name);
  if (it == args.end()) throw std::invalid_argument(str_cat("contract argument '", name, "' missing"));
  return it->second;
}

namespace {

nb::dict to_dict(const ContractValues& values) {
  nb::dict numbers, names, shapes, out;
  for (const auto& [k, v] : values.numbers) numbers[k.c_str()] = v;
  for (const auto& [k, v] : values.shapes) {
    nb::list l;
    for (int64_t s : v) l.append(s);
    shapes[k.c_str()] = nb::tuple(l);
  }
  for (const auto& [k, v] : values.names) {
    nb::list l;
    for (const std::string& s : v) l.append(s);
    names[k.c_str()] = nb::tuple(l);
  }
  out["numbers"] = numbers;
  out["names"] = names;
  out["shapes"] = shapes;
  return out;
}

nb::dict to_dict(const Contract& contract) {
  nb::dict out = to_dict(static_cast<const ContractValues&>(contract));
  nb::dict functions;
  for (const auto& [name, fn] : contract.functions) {
    functions[name.c_str()] = nb::cpp_function([fn](nb::kwargs kwargs) {
      std::map<std::string, int64_t> args;
      for (auto [k, v] : kwargs) args[nb::cast<std::string>(k)] = nb::cast<int64_t>(v);
      return to_dict(fn(args));
    });
  }
  out["functions"] = functions;
  return out;
}

// One buffer per entry of `buffers`: (dims, bytes per element, complex, HLO element type).
std::vector<CallShape::Buffer> to_buffers(const nb::list& buffers) {
  std::vector<CallShape::Buffer> out;
  for (nb::handle b : buffers) {
    auto [dims, element_bytes, complex, element_type] =
        nb::cast<std::tuple<std::vector<int64_t>, int64_t, bool, std::string>>(b);
    out.push_back({dims, element_bytes, complex, element_type});
  }
  return out;
}

// CallCost of a call of op `target`; attrs: the call's integer and boolean attributes, and its
// integer arrays as lists.
nb::dict call_cost(const std::string& target, const nb::list& operands, const nb::list& results,
                   const nb::dict& attrs) {
  CallShape shape;
  shape.operands = to_buffers(operands);
  shape.results = to_buffers(results);
  for (auto [k, v] : attrs) {
    if (nb::isinstance<nb::list>(v)) {
      shape.arrays[nb::cast<std::string>(k)] = nb::cast<std::vector<int64_t>>(v);
    } else {
      shape.attrs[nb::cast<std::string>(k)] = nb::cast<int64_t>(v);
    }
  }
  for (const RegisteredOp& op : registered_ops()) {
    if (target != op.name) continue;
    const CallCost cost = op.cost(shape);
    nb::dict out;
    out["cuda_kernels"] = cost.cuda_kernels;
    out["cuda_memsets"] = cost.cuda_memsets;
    out["bytes_read"] = cost.bytes_read;
    out["bytes_written"] = cost.bytes_written;
    out["bytes_upper_bound"] = cost.bytes_upper_bound;
    return out;
  }
  throw std::invalid_argument(str_cat("no jaxfuse op named '", target, "'"));
}

}  // namespace

void define_module(nb::module_& m) {
  m.def("registrations", []() {
    nb::dict d;
    for (const RegisteredOp& op : registered_ops()) {
      d[op.name] = nb::capsule(reinterpret_cast<void*>(op.handler));
    }
    return d;
  });
  m.def("contract", []() {
    nb::dict d;
    for (const RegisteredOp& op : registered_ops()) d[op.name] = to_dict(op.contract());
    return d;
  });
  // What the module was built against: checked at import against the running jaxlib.
  m.def("build_info", []() {
    nb::dict d;
    d["ffi_api"] = nb::make_tuple(XLA_FFI_API_MAJOR, XLA_FFI_API_MINOR);
    d["jaxlib"] = JAXFUSE_JAXLIB_VERSION;
    return d;
  });
  m.def("call_cost", &call_cost, nb::arg("target"), nb::arg("operands"), nb::arg("results"),
        nb::arg("attrs"));
#ifdef JAXFUSE_CUDA_MODULE
  m.def("cuda_info", []() {
    const CudaInfo info = cuda_info();
    nb::dict d;
    d["runtime_version"] = info.runtime_version;
    d["driver_version"] = info.driver_version;
    d["driver_problem"] = info.driver_problem;
    return d;
  });
#endif
}

}  // namespace jaxfuse

