// jaxfuse_decoder, CUDA: one decode step of an L-layer Llama-style decoder, in one of two
// schedules of one kernel (decoder_kernel.cuh): every stage in one persistent cooperative launch
// (decoder_persistent.cuh), or one launch per stage chained by programmatic dependent launch
// (decoder_stage_kernels.cuh), as the call's stage_kernels flag says. Here: the checks of what
// the kernel can run, its parameters and grid, and the launch of either schedule.
//
// Launch: kThreads threads per block, grid = co-resident blocks (occupancy x SMs, at most
// kMaxBlocksPerSm per SM; cached per device), the same in both schedules, and so is the split of
// every stage's work over it (decoder_plan.h's StagePlan): the two give the same bits.
//
// Files, one per part: decoder_common.cuh (constants, parameters, waits, shared memory), the
// GEMV jobs and inputs (decoder_gemv_job.cuh), the GEMV engines (decoder_gemv.cuh: fp32 FMA for
// fp32 and fp16 activations; decoder_gemv_mma.cuh: tensor cores for bf16, 8-bit weights widened
// by decoder_widen.cuh), the GEMV stages (decoder_stages.cuh), the new token's RoPE and cache
// append (decoder_new_token.cuh), attention: split partials and their merge
// (decoder_attention.cuh), the LM head (decoder_head*.cuh) and the draw (decoder_sample.cuh);
// the kernel (decoder_kernel.cuh); what a launch is (decoder_launch.cuh) and the two schedules.
//
// Workspace: the workspace result (decoder_workspace.h: DecoderWorkspace) holds every fp32
// activation, the partial sums and the counters. The counters are reset with cudaMemsetAsync on
// the stream each call, so the handler does no allocation and no synchronization, and is
// command-buffer (CUDA graph) compatible.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <initializer_list>

#include "decoder/cuda/decoder_persistent.cuh"
#include "decoder/cuda/decoder_stage_kernels.cuh"

namespace jaxfuse {
namespace cuda_decoder {

// ---- host side ----------------------------------------------------------------------------------

// Kernel limits: kVec-column weight vectors per lane, 16-byte vectors of k and v rows, 32-bit
// indices within a matrix.
ffi::Error check_kernel_limits(const DecoderDims& d) {
  const int64_t vec = gemv_vec(d);
  if (d.D % vec || d.I % vec || d.hd % vec) {
    return invalid_argument("the CUDA kernel needs hidden_size, intermediate_size and head_dim "
                            "to be multiples of ", vec, " for ", dtype_name(d.dtype));
  }
  // The tensor-core GEMV's weight ring copies 16-byte chunks of the matrices' rows.
  if (mma_gemv(d.dtype, d.wdtype) && dtype_bytes(d.wdtype) == 1 &&
      (d.D % 16 || d.I % 16 || d.hd % 16)) {
    return invalid_argument("the CUDA kernel needs hidden_size, intermediate_size and head_dim "
                            "to be multiples of 16 for 8-bit weights with ", dtype_name(d.dtype),
                            " activations");
  }
  // A k or v row is at most one 16-byte vector per lane of a warp.
  const int64_t max_head_dim = std::min<int64_t>(kMaxHeadDim, 32 * vec);
  if (d.hd > max_head_dim) {
    return invalid_argument("the CUDA kernel needs head_dim <= ", max_head_dim, " for ",
                            dtype_name(d.dtype));
  }
  // The LM head stages at least one batch row's inputs (hidden_size elements) in shared memory:
  // the weight ring's smallest (ring_slots()) on tensor cores.
  const int64_t head_staging = mma_head(d.dtype) ? 2 * kRingSlabBytes : kHeadStagingBytes;
  const int64_t head_row =
      mma_head(d.dtype) ? mma_head_row_bytes(d.D) : d.D * dtype_bytes(d.dtype);
  if (d.model_step && head_row > head_staging) {
    return invalid_argument("the CUDA kernel's LM head needs hidden_size <= ",
                            head_staging / dtype_bytes(d.dtype), " for ", dtype_name(d.dtype));
  }
  const int64_t big = std::max({d.L * d.D * std::max({d.q_dim(), d.I}), d.L * d.I * d.D,
                                d.L * d.B * d.S * d.kv_dim(), d.V * d.D, d.B * d.V});
  // Headroom below INT32_MAX: attention chunk bounds add up to one chunk to a position.
  if (big >= (int64_t(1) << 62) / 4 || d.B * std::max(d.D, d.I) >= INT32_MAX ||
      std::max({d.D, d.I, d.q_dim()}) * kDecMaxGemvItems >= INT32_MAX || d.S >= INT32_MAX / 2) {
    return invalid_argument("sizes too large for the CUDA kernel");
  }
  return ffi::Error::Success();
}

// 16-byte vector loads of the weights (kVec bytes of 8-bit ones) need 16-byte aligned buffers
// (XLA's are; a view may not be). A misaligned load would be a sticky device fault, not an error
// we can return.
#define JF_IF_KIND_matrix(pointer) pointer,
#define JF_IF_KIND_model(pointer)
#define JF_IF_KIND_scale(pointer)
#define JF_MATRIX_POINTER(name, flag, kind, ...) JF_IF_KIND_##kind(w.name)
ffi::Error check_alignment(const DecoderBuffers& b) {
  const DecoderWeights& w = b.weights;
  for (const void* p : {JAXFUSE_DECODER_WEIGHTS(JF_MATRIX_POINTER) b.x, b.head,
                        static_cast<const void*>(b.k_cache), static_cast<const void*>(b.v_cache)}) {
    if (reinterpret_cast<uintptr_t>(p) % 16 != 0) {
      return invalid_argument("the CUDA kernel needs 16-byte aligned operand buffers");
    }
  }
  return ffi::Error::Success();
}
#undef JF_MATRIX_POINTER
#undef JF_IF_KIND_scale
#undef JF_IF_KIND_model
#undef JF_IF_KIND_matrix

KernelDims kernel_dims(const DecoderDims& d) {
  KernelDims k;
  k.layers = int(d.L);
  k.batch = int(d.B);
  k.hidden = int(d.D);
  k.kv_heads = int(d.KV);
  k.head_dim = int(d.hd);
  k.intermediate = int(d.I);
  k.max_seq_len = int(d.S);
  k.q_dim = int(d.q_dim());
  k.kv_dim = int(d.kv_dim());
  k.group = int(d.group());
  k.head_chunks = int(head_chunks(d));
  k.hidden_tiles = int(hidden_tiles(d));
  k.q_tiles = int(gemv_tiles(d, d.q_dim()));
  k.kv_tiles = int(gemv_tiles(d, d.kv_dim()));
  k.mlp_tiles = int(mlp_tiles(d));
  k.rms_eps = d.eps;
  k.attn_scale = 1.0f / std::sqrt(float(d.hd));
#define JF_KERNEL_FLAG_COPY(name) k.name = d.name;
  JAXFUSE_DECODER_FLAGS(JF_KERNEL_FLAG_COPY)
  JAXFUSE_DECODER_STEP_FLAGS(JF_KERNEL_FLAG_COPY)
#undef JF_KERNEL_FLAG_COPY
  k.temperature = d.temperature;
  k.vocab = int(d.V);
  k.top_k = int(d.top_k);
  k.top_p = d.top_p;
  return k;
}

LaunchPlan launch_plan(int blocks, const DecoderDims& d, int ring_slots) {
  LaunchPlan plan;
  static_cast<StagePlan&>(plan) = stage_plan(d, blocks);
  // LM head: as many batch rows per pass as its staging area holds (check_kernel_limits: >= 1),
  // the weight ring's memory on tensor cores.
  plan.head_rows =
      mma_head(d.dtype)
          ? int(std::clamp<int64_t>(ring_slots * kRingSlabBytes / mma_head_row_bytes(d.D), 1,
                                    kMmaBatch))
          : int(std::clamp<int64_t>(kHeadStagingBytes / (d.D * dtype_bytes(d.dtype)), 1,
                                    kHeadMaxRows));
  plan.ring_slabs = ring_slots;
  return plan;
}

// Two blocks per SM (kMaxBlocksPerSm) cap the registers at 128, without spills. The 32 bytes of
// local memory are sincosf's table for RoPE angles past 105615 (CUDA's full-range reduction).
JF_KERNEL_BUDGET("^decoder_kernel<", 128, 25, 32);
// Twice Little's law in flight per SM, in every stage of either schedule: the weight ring's
// slabs on tensor cores, the FMA GEMV's row groups elsewhere.
JF_KERNEL_IN_FLIGHT("^decoder_kernel<", 2);
// The tensor-core GEMV's weight ring (ring_slots()): 4 slots of 16 KB on an H100, 2 on an A100.
static_assert(kRingSlabBytes == 16384 && kMaxRingSlots == 4, "the ring declared below");
JF_KERNEL_RING("^decoder_kernel<(bf16, |f16, (i8|f8e4m3)>)", 4, 2, 16384, 16384);

// Slots of decoder_kernel<kT, kW>'s weight ring (its dynamic shared memory: the tensor-core GEMV,
// mma_gemv(); none for the others): 4 where kMaxBlocksPerSm blocks with 4 still fit an SM (an
// H100), else 2 (an A100). The kernel opts in to that much dynamic shared memory once per
// device.
template <DType kT, DType kW>
cudaError_t ring_slots(int* slots) {
  *slots = 0;
  if constexpr (!mma_gemv(kT, kW)) {
    return cudaSuccess;
  } else {
    static std::atomic<int> cached[64];
    return cached_per_device(cached, [](int device, int* out) {
      int per_sm = 0;
      cudaError_t err =
          cudaDeviceGetAttribute(&per_sm, cudaDevAttrMaxSharedMemoryPerMultiprocessor, device);
      if (err != cudaSuccess) return err;
      constexpr int kReservedPerBlock = 1024;  // the driver's, sm_80+
      const int per_block = per_sm / kMaxBlocksPerSm - kReservedPerBlock - int(sizeof(Smem));
      *out = per_block >= kMaxRingSlots * kRingSlabBytes ? kMaxRingSlots : 2;
      return cudaFuncSetAttribute(decoder_kernel<kT, kW>,
                                  cudaFuncAttributeMaxDynamicSharedMemorySize,
                                  *out * kRingSlabBytes);
    }, slots);
  }
}

template <DType kT, DType kW>
ffi::Error launch_decoder(cudaStream_t stream, const DecoderOp::Call& call) {
  int device = 0;
  JF_CUDA_RETURN_IF_ERROR(cudaGetDevice(&device));
  int cooperative = 0;
  JF_CUDA_RETURN_IF_ERROR(
      cudaDeviceGetAttribute(&cooperative, cudaDevAttrCooperativeLaunch, device));
  if (!cooperative) {
    return internal_error("device ", device, " does not support cooperative launch");
  }
  int slots = 0, blocks = 0;
  JF_CUDA_RETURN_IF_ERROR((ring_slots<kT, kW>(&slots)));
  const size_t ring_bytes = size_t(slots) * kRingSlabBytes;
  constexpr auto kernel = decoder_kernel<kT, kW>;
  JF_CUDA_RETURN_IF_ERROR(resident_blocks<kernel>(kThreads, kMaxBlocksPerSm, ring_bytes, &blocks));
  const LaunchPlan plan = launch_plan(blocks, call.dims, slots);
  const DecoderLaunch launch{
      kernel, blocks, ring_bytes, stream,
      DecoderParams{kernel_dims(call.dims), call.buffers,
                    DecoderWorkspace(call.dims, call.buffers.workspace, plan.attn_splits), plan,
                    LaunchSlots{}}};
  const StageCounters& counters = launch.params.ws.counters;
  JF_CUDA_RETURN_IF_ERROR(
      cudaMemsetAsync(counters.data, 0, size_t(counters.size) * sizeof(int), stream));
  return call.dims.stage_kernels ? launch_stage_kernels(launch) : launch_persistent(launch);
}

// JAXFUSE_DECODER_QUANTIZED_KERNELS=0 leaves out the int8 / fp8 instances, two thirds of this
// file's compile time: for tools/cuda_on_cpu.sh's builds that do not run them.
#ifndef JAXFUSE_DECODER_QUANTIZED_KERNELS
#define JAXFUSE_DECODER_QUANTIZED_KERNELS 1
#endif

// The launch for the matrices' dtype: x's (kT), or int8 / fp8 e4m3 when quantized.
template <DType kT>
ffi::Error launch_for_weights(cudaStream_t stream, const DecoderOp::Call& call) {
  if (call.dims.wdtype == kT) return launch_decoder<kT, kT>(stream, call);
#if JAXFUSE_DECODER_QUANTIZED_KERNELS
  if (call.dims.wdtype == DType::kI8) return launch_decoder<kT, DType::kI8>(stream, call);
  if (call.dims.wdtype == DType::kF8E4M3) return launch_decoder<kT, DType::kF8E4M3>(stream, call);
#endif
  return internal_error("no decoder kernel for ", dtype_name(call.dims.wdtype), " weights and ",
                        dtype_name(kT), " activations in this build");
}

}  // namespace cuda_decoder

template <>
ffi::Error DecoderOp::run<Cuda>(cudaStream_t stream, const Call& call) {
  using namespace cuda_decoder;
  if (call.dims.B == 0) return ffi::Error::Success();
  JF_RETURN_IF_ERROR(check_kernel_limits(call.dims));
  JF_RETURN_IF_ERROR(check_alignment(call.buffers));
  // visit_narrow_dtype is host+device: a constexpr lambda (--expt-relaxed-constexpr) may be
  // called there.
  const auto launch = visit_narrow_dtype(call.dims.dtype, [](auto tag) constexpr {
    return &launch_for_weights<decltype(tag)::value>;
  });
  return launch(stream, call);
}

// Command-buffer compatible: a memset and the schedule's kernels on the given stream, no
// allocation, no host synchronization; temporaries live in the workspace result.
JAXFUSE_REGISTER_OP(DecoderOp, Cuda);

}  // namespace jaxfuse
