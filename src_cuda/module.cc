// The nanobind module of one platform's handlers, compiled once per module (_jaxfuse_cpu,
// _jaxfuse_cuda, the developer build _jaxfuse_cuda_on_cpu) with JAXFUSE_MODULE_NAME set. It
// exports what the ops registered (JAXFUSE_REGISTER_OP): registrations(), the handler capsules
// by target name, and contract(), the numbers and layouts that Python reads instead of
// repeating them.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include <stdexcept>

#include "jaxfuse/op.h"

#ifdef JAXFUSE_CUDA_MODULE
#include "jaxfuse/cuda_info.h"
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
  nb::dict numbers, names, out;
  for (const auto& [k, v] : values.numbers) numbers[k.c_str()] = v;
  for (const auto& [k, v] : values.names) {
    nb::list l;
    for (const std::string& s : v) l.append(s);
    names[k.c_str()] = nb::tuple(l);
  }
  out["numbers"] = numbers;
  out["names"] = names;
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

}  // namespace
}  // namespace jaxfuse

NB_MODULE(JAXFUSE_MODULE_NAME, m) {
  m.def("registrations", []() {
    nb::dict d;
    for (const jaxfuse::RegisteredOp& op : jaxfuse::registered_ops()) {
      d[op.name] = nb::capsule(reinterpret_cast<void*>(op.handler));
    }
    return d;
  });
  m.def("contract", []() {
    nb::dict d;
    for (const jaxfuse::RegisteredOp& op : jaxfuse::registered_ops()) {
      d[op.name] = jaxfuse::to_dict(op.contract());
    }
    return d;
  });
#ifdef JAXFUSE_CUDA_MODULE
  m.def("cuda_info", []() {
    const jaxfuse::CudaInfo info = jaxfuse::cuda_info();
    nb::dict d;
    d["runtime_version"] = info.runtime_version;
    d["driver_version"] = info.driver_version;
    d["driver_problem"] = info.driver_problem;
    return d;
  });
#endif
}
