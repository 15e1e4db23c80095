// jaxfuse_decoder, CUDA: one decode step of an L-layer Llama-style decoder in ONE persistent,
// cooperative kernel launch.
//
// Launch: cooperative (launch_kernel), kThreads threads per block, grid = co-resident blocks
// (occupancy x SMs, at most kMaxBlocksPerSm per SM; cached per device). The kernel is a sequence
// of stages, one struct each, whose work items wait for the items that write their inputs
// (what each waits for, after the bar):
//
//   EmbedStage:      h = float(x), per-tile sums of squares of h
//   per layer l:
//   QkvStage:        [q|k|v] = rmsnorm(h) * attn_norm @ [wq|wk|wv]        | all of h (l-1's down)
//   AttentionStage:  RoPE on q, k; append k, v at [l, b, p];            | its q, k, v tiles
//                    flash-decoding over 0..p
//   OProjStage:      h += attn_out @ wo; sums of squares of h            | l's attention groups
//   GateUpStage:     mlp_act = silu(m @ w_gate) * (m @ w_up),            | all of h (l's O)
//                    m = rmsnorm(h) * mlp_norm
//   DownStage:       h += mlp_act @ w_down; sums of squares (last        | its K split's gate/up
//                    layer: out = h, NaN rows for bad p)                   tiles
// and in a whole-model step (decoder_head.cuh, decoder_sample.cuh), after the last layer:
//   HeadStage:       logits = (rmsnorm(h) * final_norm, as kT) @ head^T | all of h (last down)
//                    (times the rows' scales when quantized)
//   SampleStage:     next_tokens = argmax of the sampling scores kept by | a grid sync (all logits)
//                    top-k / top-p (their thresholds: radix passes over    then its own passes'
//                    the logits)                                           counters
// with EmbedStage then gathering h = embed[tokens[b]] (layer 0 waits for the embedding's h).
//
// With the `timeline` flag each block records its times in each stage (decoder.h's StageTime:
// when it entered and left, when its first wait ended, how long it waited) in the workspace, read
// by jaxfuse/_decode/timeline.py; every call keeps the clock, and only such a call writes it.
//
// A wait is on a counter per tile group (decoder.h's StageCounters): its split items' arrivals
// and a flag set once the last to arrive has finished the group (release / acquire, gpu scope). A
// block goes from its last item of one stage straight to its first of the next: the item asks L2
// for its first weight rows (attention: its cache rows) before it waits, so HBM streams while
// the previous stage's last groups finish. Every block takes its items in stage order and waits
// only for earlier stages, on a co-resident (cooperative) grid, so every wait ends. No stage's
// writes can overtake a reader of the previous layer: every group of a stage needs all of K,
// which needs every item of the stage before; the GEMV stages' partial sums alternate between
// two regions, so a stage's items may write theirs while the last groups of the stage before
// still read their own.
//
// Weight-only quantized models (int8 or fp8 e4m3 matrices with per-column scales, decoder.h) run
// the same stages in their own kernel instance: the GEMV engine widens the 8-bit weights, each
// finish() applies the scales to the summed columns.
//
// Files, one per part: decoder_common.cuh (constants, parameters, shared memory), the GEMV jobs
// and inputs (decoder_gemv_job.cuh), the GEMV engines (decoder_gemv.cuh: fp32 FMA for fp32 and
// fp16 activations; decoder_gemv_mma.cuh: tensor cores for bf16, 8-bit weights widened by
// decoder_widen.cuh), the GEMV stages (decoder_stages.cuh), the new token's RoPE and cache append
// (decoder_new_token.cuh), attention: split partials and their merge (decoder_attention.cuh),
// the LM head (decoder_head.cuh) and the draw (decoder_sample.cuh); here the kernel and its
// launch.
//
// Workspace: the workspace result (decoder.h: DecoderWorkspace) holds every fp32 activation, the
// partial sums and the counters. The counters are reset with cudaMemsetAsync on the stream each
// call, so the handler does no allocation and no synchronization, and is command-buffer (CUDA
// graph) compatible. Workspace data written by other blocks is read with ld.global.cg (L2), so
// stale L1 lines are never observed; weights are read through the read-only path.
#include <cooperative_groups.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <initializer_list>

#include "decoder/cuda/decoder_attention.cuh"
#include "decoder/cuda/decoder_head.cuh"
#include "decoder/cuda/decoder_head_mma.cuh"
#include "decoder/cuda/decoder_sample.cuh"
#include "decoder/cuda/decoder_stages.cuh"

namespace jaxfuse {
namespace cuda_decoder {

// ---- the kernel ---------------------------------------------------------------------------------

// The block's clock starts a stage (thread 0's; the waits add to it).
__device__ __forceinline__ void start_clock(Smem& sm) {
  if (thread_index() == 0) sm.clock = StageClock{timer_ns(), 0, 0, 0};
}

// The block's times in the stage that started the clock, as timeline slot `slot` of a call
// that records a timeline (thread 0; its own program order orders the clock's writes).
__device__ __forceinline__ void stop_clock(const DecoderParams& p, Smem& sm, int slot) {
  if (thread_index() != 0) return;
  StageTime* record = p.ws.stage_time(block_index(), slot);
  if (record == nullptr) return;
  const StageClock& c = sm.clock;
  *record = StageTime{c.begin, c.ready, timer_ns(), c.waited_ns, c.waits};
  if (slot == 0 && block_index() == 0) p.ws.timeline->blocks = gridDim.x;
}

// The LM head with weights of kH: on tensor cores where mma_head().
template <DType kT, DType kH>
__device__ __forceinline__ void run_head_stage(const DecoderParams& p, Smem& sm) {
  if constexpr (mma_head(kT)) {
    MmaHeadStage<kH>{p, sm}.run();
  } else {
    HeadStage<kT, kH>{p, sm}.prefetch();
    HeadStage<kT, kH>{p, sm}.run();
  }
}

// The whole-model step's stages after the last layer: the head in kW when it comes quantized
// (with a quantized layer stack, whose format it shares), else in kT. (A call instead of inlining
// them changes the layer loop's register allocation: it spilled the f16 instances.)
template <DType kT, DType kW>
__device__ __forceinline__ void run_head(const DecoderParams& p, Smem& sm) {
  const int head = int(head_slot(p.dims.layers));
  start_clock(sm);
  if (kW != kT && p.io.head_scale != nullptr) {
    run_head_stage<kT, kW>(p, sm);
  } else {
    run_head_stage<kT, kT>(p, sm);
  }
  stop_clock(p, sm, head);
  if (p.dims.sample) {
    start_clock(sm);
    const unsigned long long since = wait_begins();
    cg::this_grid().sync();
    sm.clock.waited(since);
    SampleStage{p, sm}.run();
    stop_clock(p, sm, head + 1);
  }
}

// kT: the dtype of x, the caches, norms and biases; kW: the matrices' (kT, or int8 / fp8 e4m3
// when quantized). Min blocks per SM pinned: without it ptxas may use up to 168 registers (one
// block per SM). The O projection's first rows are asked of L2 before attention, whose items are
// short. Each GEMV stage gets the layer as an opaque() value: the offsets derived from it are
// then formed in the stage, not at the layer loop's head and kept (spilled) across the others.
template <DType kT, DType kW>
__global__ void __launch_bounds__(kThreads, kMaxBlocksPerSm)
    decoder_kernel(const __grid_constant__ DecoderParams p) {
  __shared__ Smem sm;
  start_clock(sm);
  EmbedStage<kT>{p, sm}.run();
  stop_clock(p, sm, 0);
  for (int layer = 0; layer < p.dims.layers; ++layer) {
    const auto timed = [&](LayerStage stage, const auto& run) {
      start_clock(sm);
      run();
      stop_clock(p, sm, int(stage_slot(opaque(layer), stage)));
    };
    timed(LayerStage::kQkv, [&] { QkvStage<kT, kW>{p, sm, opaque(layer)}.run(); });
    timed(LayerStage::kAttention, [&] {
      OProjStage<kT, kW>{p, sm, opaque(layer)}.prefetch();
      AttentionStage<kT>{p, sm, layer}.run();
    });
    timed(LayerStage::kOProj, [&] { OProjStage<kT, kW>{p, sm, opaque(layer)}.run(); });
    timed(LayerStage::kGateUp, [&] { GateUpStage<kT, kW>{p, sm, opaque(layer)}.run(); });
    timed(LayerStage::kDown, [&] { DownStage<kT, kW>{p, sm, opaque(layer)}.run(); });
  }
  if (p.dims.model_step) run_head<kT, kW>(p, sm);
}

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
  const KernelDims dims = kernel_dims(call.dims);
  const LaunchPlan plan = launch_plan(blocks, call.dims, slots);
  const DecoderParams params{dims, call.buffers,
                             DecoderWorkspace(call.dims, call.buffers.workspace, plan.attn_splits),
                             plan};
  const StageCounters& counters = params.ws.counters;
  JF_CUDA_RETURN_IF_ERROR(
      cudaMemsetAsync(counters.data, 0, size_t(counters.size) * sizeof(int), stream));
  return launch_kernel("the decoder kernel", kernel, dim3(blocks), dim3(kThreads), stream,
                       LaunchOptions{/*cooperative=*/true, ring_bytes}, params);
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

// Command-buffer compatible: a memset and one kernel on the given stream, no allocation, no
// host synchronization; temporaries live in the workspace result.
JAXFUSE_REGISTER_OP(DecoderOp, Cuda);

}  // namespace jaxfuse
