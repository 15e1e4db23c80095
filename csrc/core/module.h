// A native module of jaxfuse: one platform's handlers (_jaxfuse_cpu, _jaxfuse_cuda), each a
// nanobind module whose init (module_init.cc, compiled with JAXFUSE_MODULE_NAME set) calls
// define_module(). It exports what the ops registered (JAXFUSE_REGISTER_OP): registrations(),
// the handler capsules by target name; contract(), the numbers and layouts that Python reads
// instead of repeating them; call_cost(), what a call launches and moves (op.h's CallCost, for
// jaxfuse.report); and, in a module built with the CUDA sources (JAXFUSE_CUDA_MODULE),
// cuda_info(), the runtime's and the driver's versions.
#pragma once

#include <nanobind/nanobind.h>

namespace jaxfuse {

void define_module(nanobind::module_& m);

}  // namespace jaxfuse
