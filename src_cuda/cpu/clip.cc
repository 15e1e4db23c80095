// jaxfuse_global_norm and jaxfuse_apply_grad_ctrl, CPU. Partial sums are per chunk, combined in
// chunk order: the result does not depend on how the thread pool ran the chunks.
#include <cstring>
#include <vector>

#include "jaxfuse/clip_ffi.h"

namespace jaxfuse {
namespace {

constexpr int64_t kChunk = 1 << 16;
constexpr int64_t kTile = 512;
constexpr int kLanes = 16;  // independent accumulators: fixed association, vectorizes

struct Partial {
  float sumsq = 0.0f;
  float nonfinite = 0.0f;  // sum of (x - x): 0 iff every x is finite
};

// Accumulates x^2 and x - x of a tile into kLanes independent lanes (element i into lane
// i % kLanes). GCC vector types give the same lanes, so the same rounding, on every ISA, and
// compile to full-width SIMD where a lane array loop does not.
typedef float F32x8 __attribute__((vector_size(32)));
static_assert(kLanes == 16, "two 8-wide accumulators");

JF_CPU_MULTIVERSION
void accumulate_tile(int64_t len, const float* __restrict__ x, float* __restrict__ acc,
                     float* __restrict__ bad) {
  F32x8 a0, a1, b0, b1;
  std::memcpy(&a0, acc, 32);
  std::memcpy(&a1, acc + 8, 32);
  std::memcpy(&b0, bad, 32);
  std::memcpy(&b1, bad + 8, 32);
  int64_t i = 0;
  for (; i + kLanes <= len; i += kLanes) {
    F32x8 v0, v1;
    std::memcpy(&v0, x + i, 32);
    std::memcpy(&v1, x + i + 8, 32);
    a0 += v0 * v0;
    a1 += v1 * v1;
    b0 += v0 - v0;
    b1 += v1 - v1;
  }
  std::memcpy(acc, &a0, 32);
  std::memcpy(acc + 8, &a1, 32);
  std::memcpy(bad, &b0, 32);
  std::memcpy(bad + 8, &b1, 32);
  for (int j = 0; i < len; ++i, ++j) {
    acc[j] += x[i] * x[i];
    bad[j] += x[i] - x[i];
  }
}

Partial chunk_partial(const TensorLists& lists, int64_t t, int64_t start, int64_t n) {
  alignas(64) float x[kTile];
  float acc[kLanes] = {}, bad[kLanes] = {};
  const bool direct = lists.dtype[t][0] == DType::kF32;
  for (int64_t off = start; off < start + n; off += kTile) {
    const int64_t len = std::min(kTile, start + n - off);
    const float* xp = static_cast<const float*>(lists.ptr[t][0]) + off;
    if (!direct) {
      load_tile(lists.ptr[t][0], lists.dtype[t][0], off, len, x);
      xp = x;
    }
    accumulate_tile(len, xp, acc, bad);
  }
  Partial p;
  for (int j = 0; j < kLanes; ++j) {
    p.sumsq += acc[j];
    p.nonfinite += bad[j];
  }
  return p;
}

ffi::Error GlobalNormCpu(ffi::ThreadPool pool, NormParamsBuffer params, ffi::RemainingArgs args,
                         ffi::Result<ScalarF32Buffer> norm, ffi::Result<HyperCtrlBuffer> ctrl,
                         ffi::Result<HyperCtrlBuffer> partials, bool clip, bool skip_nonfinite,
                         bool clip_apply_loss_scale) {
  TensorLists lists;
  JF_RETURN_IF_ERROR(decode_norm_call(params, args, ctrl, partials, &lists));
  std::vector<int64_t> first_chunk(lists.num_tensors() + 1, 0);
  for (int64_t t = 0; t < lists.num_tensors(); ++t) {
    first_chunk[t + 1] = first_chunk[t] + (lists.size[t] + kChunk - 1) / kChunk;
  }
  std::vector<Partial> chunk_partials(first_chunk.back());
  for_each_chunk(&pool, lists, kChunk, [&](int64_t t, int64_t start, int64_t n) {
    chunk_partials[first_chunk[t] + start / kChunk] = chunk_partial(lists, t, start, n);
  });
  Partial total;
  for (const Partial& p : chunk_partials) {
    total.sumsq += p.sumsq;
    total.nonfinite += p.nonfinite;
  }
  finish_norm(total.sumsq, total.nonfinite, params.typed_data(), clip, skip_nonfinite,
              clip_apply_loss_scale, norm->typed_data(), ctrl->typed_data());
  return ffi::Error::Success();
}

ffi::Error ApplyGradCtrlCpu(ffi::ThreadPool pool, HyperCtrlBuffer ctrl, ffi::RemainingArgs args,
                            ffi::RemainingRets rets) {
  TensorLists lists;
  JF_RETURN_IF_ERROR(decode_apply_grad_ctrl_call(ctrl, args, rets, &lists));
  const GradScaling scaling = make_grad_scaling(ctrl.typed_data());
  for_each_chunk(&pool, lists, kChunk, [&](int64_t t, int64_t start, int64_t len) {
    alignas(64) float x[kTile];
    for (int64_t off = start; off < start + len; off += kTile) {
      const int64_t m = std::min(kTile, start + len - off);
      load_tile(lists.ptr[t][0], lists.dtype[t][0], off, m, x);
      for (int64_t i = 0; i < m; ++i) x[i] = scaling.apply(x[i]);
      store_tile(lists.ptr[t][1], lists.dtype[t][1], off, m, x);
    }
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxfuseGlobalNormCpu, GlobalNormCpu,
                              global_norm_binding<ffi::ThreadPool>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxfuseApplyGradCtrlCpu, ApplyGradCtrlCpu,
                              apply_grad_ctrl_binding<ffi::ThreadPool>());

}  // namespace jaxfuse
