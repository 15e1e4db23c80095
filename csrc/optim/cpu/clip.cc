// jaxfuse_global_norm, CPU. Partial sums are per chunk, in double,
// combined in chunk order: the result does not depend on how the thread pool ran the chunks.
#include "optim/clip.h"

#include <cstring>
#include <vector>

#include "optim/cpu/chunks.h"

namespace jaxfuse {
namespace {

constexpr int64_t kChunk = 1 << 16;
constexpr int64_t kTile = 512;
constexpr int kLanes = 16;  // independent accumulators: fixed association, vectorizes
static_assert(kLanes == 16, "four 4-wide double accumulators");

// Four doubles from x[0..3] (float or double). (An out-parameter: a vector return value would
// have a different ABI in each multiversioned clone.)
__attribute__((always_inline)) inline void load4(const float* x, F64x4* out) {
  F32x4 v;
  std::memcpy(&v, x, 16);
  *out = __builtin_convertvector(v, F64x4);
}
__attribute__((always_inline)) inline void load4(const double* x, F64x4* out) {
  std::memcpy(out, x, 32);
}

// norm_accumulate() over a tile into kLanes independent lanes (element i into lane i % kLanes).
template <typename T>
__attribute__((always_inline)) inline void accumulate_lanes(int64_t len, const T* __restrict__ x,
                                                            double* __restrict__ sumsq,
                                                            double* __restrict__ nonfinite) {
  F64x4 a[4], b[4];
  std::memcpy(a, sumsq, sizeof(a));
  std::memcpy(b, nonfinite, sizeof(b));
  int64_t i = 0;
  for (; i + kLanes <= len; i += kLanes) {
    for (int k = 0; k < 4; ++k) {
      F64x4 v;
      load4(x + i + 4 * k, &v);
      a[k] += v * v;
      b[k] += v - v;
    }
  }
  std::memcpy(sumsq, a, sizeof(a));
  std::memcpy(nonfinite, b, sizeof(b));
  for (int j = 0; i < len; ++i, ++j) norm_accumulate(double(x[i]), sumsq[j], nonfinite[j]);
}

JF_CPU_MULTIVERSION
void accumulate_tile(int64_t len, const float* x, double* sumsq, double* nonfinite) {
  accumulate_lanes(len, x, sumsq, nonfinite);
}

JF_CPU_MULTIVERSION
void accumulate_tile(int64_t len, const double* x, double* sumsq, double* nonfinite) {
  accumulate_lanes(len, x, sumsq, nonfinite);
}

NormSum chunk_partial(const TensorLists& grads, int64_t t, int64_t start, int64_t n) {
  alignas(64) float x[kTile];
  double sumsq[kLanes] = {}, nonfinite[kLanes] = {};
  const DType dtype = grads.dtype[t][0];
  const void* base = grads.ptr[t][0];
  for (int64_t off = start; off < start + n; off += kTile) {
    const int64_t len = std::min(kTile, start + n - off);
    if (dtype == DType::kF64) {  // 32- and 64-bit storage is read in place
      accumulate_tile(len, static_cast<const double*>(base) + off, sumsq, nonfinite);
    } else if (dtype == DType::kF32) {
      accumulate_tile(len, static_cast<const float*>(base) + off, sumsq, nonfinite);
    } else {
      load_tile(base, dtype, off, len, x);
      accumulate_tile(len, x, sumsq, nonfinite);
    }
  }
  NormSum p;
  for (int j = 0; j < kLanes; ++j) p.add({sumsq[j], nonfinite[j]});
  return p;
}

}  // namespace

template <>
ffi::Error GlobalNormOp::run<Cpu>(ffi::ThreadPool pool, const Call& call) {
  const ChunkIndex chunks(call.grads, kChunk);
  std::vector<NormSum> partials(chunks.total());
  for_each_chunk(&pool, call.grads, chunks, [&](int64_t t, int64_t start, int64_t n, int64_t c) {
    partials[c] = chunk_partial(call.grads, t, start, n);
  });
  NormSum own;
  for (const NormSum& p : partials) own.add(p);
  own.store_row(call.own_sum);
  NormSum total;
  for (int64_t r = 0; r < call.num_peers; ++r) {
    total.add(NormSum::load_row(call.peer_sums + r * kNormSumWords));
  }
  total.add(own);
  finish_norm(total.sumsq, total.nonfinite, call.norm_params, call.clip, call.skip_nonfinite,
              call.clip_apply_loss_scale, call.norm, call.grad_ctrl);
  return ffi::Error::Success();
}

JAXFUSE_REGISTER_OP(GlobalNormOp, Cpu);

}  // namespace jaxfuse
