// Multi-tensor apply, host side: the tensor lists an FFI call hands over, and the CPU driver
// that spreads their chunks over XLA's intra-op thread pool. The CUDA driver
// (src_cuda/cuda/multi_tensor.cuh) packs the same lists into kernel-parameter tables.
//
// A "list" is one role in an element-wise op (grads, params, mu, ...); list k of tensor t is
// the k-th operand of leaf t. Each buffer has its own storage dtype (so one call covers a tree of
// mixed dtypes); all lists of a tensor have the same element count. An op is a functor applied to (tensor, first element, element count).
#pragma once

#include <algorithm>
#include <array>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

#include "jaxfuse/ffi_util.h"

// CPU hot loops are compiled for several x86 ISA levels and picked at load time (ifunc), so one
// wheel runs everywhere and still uses AVX2 / AVX-512 where the machine has them, as XLA's own
// code does.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && !defined(__CUDACC__)
#define JF_CPU_MULTIVERSION __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define JF_CPU_MULTIVERSION
#endif

namespace jaxfuse {

inline constexpr int kMaxLists = 8;

struct TensorLists {
  int num_lists = 0;
  std::vector<std::array<void*, kMaxLists>> ptr;  // [tensor][list]
  std::vector<std::array<DType, kMaxLists>> dtype;  // [tensor][list]
  std::vector<int64_t> size;                      // elements per tensor
  std::vector<uint8_t> flag;                      // per-tensor op flag (e.g. weight-decay mask)

  int64_t num_tensors() const { return static_cast<int64_t>(size.size()); }
};

// Where list `k` comes from: `num_tensors` consecutive buffers of the call's remaining
// arguments (`from_rets == false`) or remaining results, starting at `offset`.
struct ListSource {
  const char* name;
  bool from_rets;
  int64_t offset;
};

// The buffer behind a decoded result (results decode as Result<AnyBuffer>).
inline ffi::ErrorOr<ffi::AnyBuffer> buffer_of(ffi::ErrorOr<ffi::Result<ffi::AnyBuffer>> r) {
  if (r.has_error()) return ffi::Unexpected<ffi::Error>(r.error());
  return **r;
}

// Decodes the buffers of each list for op `op` (named in every error), checking dtypes (float32,
// bfloat16, float16) and that every list of a tensor has the same element count. `flags` may be
// empty (all zero); `rets` may be null when no list comes from the results.
inline ffi::Error collect_lists(const char* op, const ffi::RemainingArgs& args,
                                const ffi::RemainingRets* rets,
                                const ListSource* sources, int num_lists, int64_t num_tensors,
                                ffi::Span<const uint8_t> flags, TensorLists* out) {
  if (num_lists > kMaxLists) return internal_error(op, ": too many tensor lists");
  if (flags.size() != 0 && static_cast<int64_t>(flags.size()) != num_tensors) {
    return invalid_argument(op, ": per-tensor flag array has ", flags.size(), " entries for ",
                            num_tensors, " tensors");
  }
  out->num_lists = num_lists;
  out->ptr.assign(num_tensors, {});
  out->dtype.assign(num_tensors, {});
  out->size.assign(num_tensors, 0);
  out->flag.assign(num_tensors, 0);
  for (int k = 0; k < num_lists; ++k) {
    const ListSource& src = sources[k];
    if (src.from_rets && rets == nullptr) {
      return internal_error(op, ": list '", src.name, "': no results");
    }
    const int64_t available = src.from_rets ? static_cast<int64_t>(rets->size())
                                            : static_cast<int64_t>(args.size());
    if (src.offset + num_tensors > available) {
      return invalid_argument(op, ": list '", src.name, "' needs ", num_tensors, " buffers from ",
                              src.from_rets ? "results" : "operands", " at ", src.offset,
                              ", the call has ", available);
    }
    for (int64_t t = 0; t < num_tensors; ++t) {
      // No placeholder AnyBuffer: its constructor asserts a non-null buffer (Debug builds).
      ffi::ErrorOr<ffi::AnyBuffer> decoded =
          src.from_rets ? buffer_of(rets->get<ffi::AnyBuffer>(src.offset + t))
                        : args.get<ffi::AnyBuffer>(src.offset + t);
      if (decoded.has_error()) {
        return invalid_argument(op, ": list '", src.name, "' tensor ", t, ": ",
                                decoded.error().message());
      }
      const ffi::AnyBuffer buf = *decoded;
      auto dt = to_dtype(buf.element_type());
      if (!dt) {
        return invalid_argument(op, ": list '", src.name, "' tensor ", t,
                                ": unsupported dtype (float32, bfloat16, float16 only)");
      }
      out->dtype[t][k] = *dt;
      const int64_t n = static_cast<int64_t>(buf.element_count());
      if (k == 0) {
        out->size[t] = n;
      } else if (n != out->size[t]) {
        return invalid_argument(op, ": tensor ", t, ": list '", src.name, "' has ", n,
                                " elements, list '", sources[0].name, "' has ", out->size[t]);
      }
      out->ptr[t][k] = buf.untyped_data();
    }
  }
  for (int64_t t = 0; t < num_tensors && flags.size() != 0; ++t) out->flag[t] = flags[t];
  return ffi::Error::Success();
}

// ---- CPU driver -------------------------------------------------------------------------

// Runs fn(item) for item in [0, num_items) on the calling thread and up to
// pool.num_threads() pool workers. Items are claimed from a shared counter, and the caller only
// waits for workers that actually started, so it cannot deadlock when the pool is busy or when
// the caller is itself a pool thread. Workers that start after all items are claimed exit
// without touching `fn`.
template <typename Fn>
void parallel_for(ffi::ThreadPool* pool, int64_t num_items, const Fn& fn) {
  const int64_t helpers =
      pool == nullptr ? 0 : std::min<int64_t>(pool->num_threads(), num_items - 1);
  if (helpers <= 0) {
    for (int64_t i = 0; i < num_items; ++i) fn(i);
    return;
  }
  struct Shared {
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> active{0};
    std::mutex mu;
    std::condition_variable done;
  };
  auto shared = std::make_shared<Shared>();
  const Fn* fn_ptr = &fn;
  for (int64_t w = 0; w < helpers; ++w) {
    pool->Schedule([shared, fn_ptr, num_items]() {
      shared->active.fetch_add(1);
      for (int64_t i = shared->next.fetch_add(1); i < num_items; i = shared->next.fetch_add(1)) {
        (*fn_ptr)(i);
      }
      if (shared->active.fetch_sub(1) == 1) {
        std::lock_guard<std::mutex> lock(shared->mu);
        shared->done.notify_all();
      }
    });
  }
  for (int64_t i = shared->next.fetch_add(1); i < num_items; i = shared->next.fetch_add(1)) fn(i);
  std::unique_lock<std::mutex> lock(shared->mu);
  shared->done.wait(lock, [&] { return shared->active.load() == 0; });
}

// Splits every tensor into chunks of at most `chunk` elements and runs
// fn(tensor, first_element, count) over all chunks of all tensors in parallel.
template <typename Fn>
void for_each_chunk(ffi::ThreadPool* pool, const TensorLists& lists, int64_t chunk, const Fn& fn) {
  const int64_t nt = lists.num_tensors();
  std::vector<int64_t> first_chunk(nt + 1, 0);
  for (int64_t t = 0; t < nt; ++t) {
    first_chunk[t + 1] = first_chunk[t] + (lists.size[t] + chunk - 1) / chunk;
  }
  parallel_for(pool, first_chunk[nt], [&](int64_t c) {
    const int64_t t =
        std::upper_bound(first_chunk.begin(), first_chunk.end(), c) - first_chunk.begin() - 1;
    const int64_t start = (c - first_chunk[t]) * chunk;
    fn(t, start, std::min(chunk, lists.size[t] - start));
  });
}

// Converting tile copies for the CPU ops: load a run of any storage dtype into fp32 scratch and
// store it back. Plain loops over typed pointers, so the compiler vectorizes each dtype's case.
inline void load_tile(const void* base, DType t, int64_t start, int64_t n, float* out) {
  switch (t) {
    case DType::kF32: {
      const float* p = static_cast<const float*>(base) + start;
      for (int64_t i = 0; i < n; ++i) out[i] = p[i];
      break;
    }
    case DType::kBF16: {
      const uint16_t* p = static_cast<const uint16_t*>(base) + start;
      for (int64_t i = 0; i < n; ++i) out[i] = bf16_to_float(p[i]);
      break;
    }
    default: {
      const uint16_t* p = static_cast<const uint16_t*>(base) + start;
      for (int64_t i = 0; i < n; ++i) out[i] = f16_to_float(p[i]);
      break;
    }
  }
}

inline void store_tile(void* base, DType t, int64_t start, int64_t n, const float* in) {
  switch (t) {
    case DType::kF32: {
      float* p = static_cast<float*>(base) + start;
      for (int64_t i = 0; i < n; ++i) p[i] = in[i];
      break;
    }
    case DType::kBF16: {
      uint16_t* p = static_cast<uint16_t*>(base) + start;
      for (int64_t i = 0; i < n; ++i) p[i] = float_to_bf16(in[i]);
      break;
    }
    default: {
      uint16_t* p = static_cast<uint16_t*>(base) + start;
      for (int64_t i = 0; i < n; ++i) p[i] = float_to_f16(in[i]);
      break;
    }
  }
}

}  // namespace jaxfuse
