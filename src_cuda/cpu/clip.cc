// jaxfuse_global_norm and jaxfuse_apply_grad_ctrl, CPU. Partial sums are per chunk, combined in
// chunk order: the result does not depend on how the thread pool ran the chunks.
#include "jaxfuse/clip.h"

#include <cstring>
#include <vector>

#include "cpu_common.h"

namespace jaxfuse {
namespace {

constexpr int64_t kChunk = 1 << 16;
constexpr int64_t kTile = 512;
constexpr int kLanes = 16;  // independent accumulators: fixed association, vectorizes
static_assert(kLanes == 16, "two 8-wide accumulators");

struct Partial {
  float sumsq = 0.0f;
  float nonfinite = 0.0f;  // sum of (x - x): 0 iff every x is finite
};

// norm_accumulate() over a tile into kLanes independent lanes (element i into lane i % kLanes).
JF_CPU_MULTIVERSION
void accumulate_tile(int64_t len, const float* __restrict__ x, float* __restrict__ sumsq,
                     float* __restrict__ nonfinite) {
  F32x8 a0, a1, b0, b1;
  std::memcpy(&a0, sumsq, 32);
  std::memcpy(&a1, sumsq + 8, 32);
  std::memcpy(&b0, nonfinite, 32);
  std::memcpy(&b1, nonfinite + 8, 32);
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
  std::memcpy(sumsq, &a0, 32);
  std::memcpy(sumsq + 8, &a1, 32);
  std::memcpy(nonfinite, &b0, 32);
  std::memcpy(nonfinite + 8, &b1, 32);
  for (int j = 0; i < len; ++i, ++j) norm_accumulate(x[i], sumsq[j], nonfinite[j]);
}

Partial chunk_partial(const TensorLists& grads, int64_t t, int64_t start, int64_t n) {
  alignas(64) float x[kTile];
  float sumsq[kLanes] = {}, nonfinite[kLanes] = {};
  const DType dtype = grads.dtype[t][0];
  for (int64_t off = start; off < start + n; off += kTile) {
    const int64_t len = std::min(kTile, start + n - off);
    const float* xp = static_cast<const float*>(grads.ptr[t][0]) + off;
    if (dtype != DType::kF32) {  // fp32 is read in place
      load_tile(grads.ptr[t][0], dtype, off, len, x);
      xp = x;
    }
    accumulate_tile(len, xp, sumsq, nonfinite);
  }
  Partial p;
  for (int j = 0; j < kLanes; ++j) {
    p.sumsq += sumsq[j];
    p.nonfinite += nonfinite[j];
  }
  return p;
}

}  // namespace

template <>
ffi::Error GlobalNormOp::run<Cpu>(ffi::ThreadPool pool, const Call& call) {
  const ChunkIndex chunks(call.grads, kChunk);
  std::vector<Partial> partials(chunks.total());
  for_each_chunk(&pool, call.grads, chunks, [&](int64_t t, int64_t start, int64_t n, int64_t c) {
    partials[c] = chunk_partial(call.grads, t, start, n);
  });
  Partial total;
  for (const Partial& p : partials) {
    total.sumsq += p.sumsq;
    total.nonfinite += p.nonfinite;
  }
  finish_norm(total.sumsq, total.nonfinite, call.norm_params, call.clip, call.skip_nonfinite,
              call.clip_apply_loss_scale, call.norm, call.grad_ctrl);
  return ffi::Error::Success();
}

template <>
ffi::Error ApplyGradCtrlOp::run<Cpu>(ffi::ThreadPool pool, const Call& call) {
  const GradScaling scaling = make_grad_scaling(call.grad_ctrl);
  const TensorLists& lists = call.grads;
  const ChunkIndex chunks(lists, kChunk);
  for_each_chunk(&pool, lists, chunks, [&](int64_t t, int64_t start, int64_t len, int64_t) {
    alignas(64) float x[kTile];
    for (int64_t off = start; off < start + len; off += kTile) {
      const int64_t m = std::min(kTile, start + len - off);
      load_tile(lists.ptr[t][0], lists.dtype[t][0], off, m, x);
      scale_group(scaling, m, x);
      store_tile(lists.ptr[t][1], lists.dtype[t][1], off, m, x);
    }
  });
  return ffi::Error::Success();
}

JAXFUSE_REGISTER_OP(GlobalNormOp, Cpu);
JAXFUSE_REGISTER_OP(ApplyGradCtrlOp, Cpu);

}  // namespace jaxfuse
