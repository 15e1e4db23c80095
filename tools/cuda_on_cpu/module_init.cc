// The init of _jaxfuse_cuda_on_cpu, the CUDA handlers compiled for the host: the production
// module's exports (csrc/core/module.h) plus enqueued_work(), the kernels and memsets the emulated
// runtime has enqueued so far (tests/test_cuda_on_cpu.py checks each op's CallCost with it).
// Each op's handler is wrapped so that the emulated runtime watches the call's results while it
// runs (cuda_runtime.h's watch_memory(): what the programmatic launches' checks look at).
#include <cuda_runtime.h>

#include <array>
#include <stdexcept>
#include <utility>

#include "core/module.h"
#include "core/op.h"

namespace nb = nanobind;

namespace {

constexpr size_t kMaxOps = 64;
std::array<XLA_FFI_Handler*, kMaxOps> wrapped_handlers{};

// The bytes of an FFI buffer.
size_t buffer_bytes(const XLA_FFI_Buffer& b) {
  size_t n = 1;
  for (int64_t i = 0; i < b.rank; ++i) n *= size_t(b.dims[i]);
  const size_t width = xla::ffi::ByteWidth(static_cast<xla::ffi::DataType>(b.dtype));
  return n * (width == 0 ? 1 : width);
}

// Handler i with the call's results watched for the length of an execution.
template <size_t I>
XLA_FFI_Error* watched_handler(XLA_FFI_CallFrame* frame) {
  const bool execute = frame->api != nullptr && frame->stage == XLA_FFI_ExecutionStage_EXECUTE;
  if (execute) {
    for (int64_t r = 0; r < frame->rets.size; ++r) {
      if (frame->rets.types[r] != XLA_FFI_RetType_BUFFER) continue;
      const auto* b = static_cast<const XLA_FFI_Buffer*>(frame->rets.rets[r]);
      cuemu::watch_memory(b->data, buffer_bytes(*b));
    }
  }
  XLA_FFI_Error* err = wrapped_handlers[I](frame);
  if (execute) cuemu::unwatch_memory();
  return err;
}

template <size_t... I>
constexpr std::array<XLA_FFI_Handler*, kMaxOps> make_watched(std::index_sequence<I...>) {
  return {&watched_handler<I>...};
}
constexpr std::array<XLA_FFI_Handler*, kMaxOps> kWatched =
    make_watched(std::make_index_sequence<kMaxOps>{});

void watch_every_op() {
  std::vector<jaxfuse::RegisteredOp>& ops = jaxfuse::registered_ops();
  if (ops.size() > kMaxOps) throw std::runtime_error("cuda_on_cpu: more ops than kMaxOps");
  for (size_t i = 0; i < ops.size(); ++i) {
    if (ops[i].handler == kWatched[i]) continue;  // already wrapped
    wrapped_handlers[i] = ops[i].handler;
    ops[i].handler = kWatched[i];
  }
}

}  // namespace

NB_MODULE(_jaxfuse_cuda_on_cpu, m) {
  watch_every_op();
  jaxfuse::define_module(m);
  m.def("enqueued_work", []() {
    const cuemu::EnqueuedWork work = cuemu::enqueued_work();
    nb::dict d;
    d["kernels"] = work.kernels;
    d["memsets"] = work.memsets;
    return d;
  });
}
