// Multi-tensor apply, host side: the tensor lists an FFI call hands over, decoded once and
// shared by the CPU driver (csrc/core/cpu/common.h) and the CUDA driver
// (csrc/optim/cuda/multi_tensor.cuh), which packs them into kernel-parameter tables.
//
// A "list" is one role in an element-wise op (grads, params, mu, ...); list k of tensor t is
// the k-th operand of leaf t. Each buffer has its own storage dtype (so one call covers a tree of
// mixed dtypes); all lists of a tensor have the same element count. A complex tensor (all of its
// lists complex) is seen as its real and imaginary parts interleaved: 2 scalars per element,
// counted and addressed as scalars of its real dtype. A list of block values (the scales of
// 8-bit moments) holds one float32 per kBlockElements elements of its tensor. A packed list
// (PackedLists) holds every tensor's elements in one buffer, each at its own offset.
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <optional>
#include <vector>

#include "core/ffi_util.h"

namespace jaxfuse {

inline constexpr int kMaxLists = 9;  // grads, params, 3 states, master, 3 block-scale lists
inline constexpr int kBlockElements = 128;  // elements per value of a block list

struct TensorLists {
  int num_lists = 0;
  std::vector<std::array<void*, kMaxLists>> ptr;    // [tensor][list]
  std::vector<std::array<DType, kMaxLists>> dtype;  // [tensor][list]
  std::vector<int64_t> size;                        // scalars per tensor
  std::vector<uint8_t> mask;                        // per-tensor choice of the op (Adam: decay)
  std::vector<uint8_t> complex;                     // per tensor: its lists are complex
  std::array<bool, kMaxLists> per_block{};          // per list: one value per kBlockElements

  int64_t num_tensors() const { return static_cast<int64_t>(size.size()); }

  // Whether a call over these tensors computes in double (computes_in_double of any tensor).
  bool computes_in_double() const {
    for (const auto& row : dtype) {
      if (jaxfuse::computes_in_double(row.data(), num_lists)) return true;
    }
    return false;
  }
};

// What a list holds: floats of any kernel dtype, int16 words (DType::kI16), 8-bit codes (int8:
// DType::kI8, uint8: DType::kU8) or float32 block values (one per kBlockElements elements).
enum class ListKind : uint8_t { kFloats, kWords, kCodes, kBlockValues };

// Where list `k` comes from: `num_tensors` consecutive buffers of the call's remaining
// arguments (`from_rets == false`) or remaining results, starting at `offset`.
struct ListSource {
  const char* name;
  bool from_rets;
  int64_t offset;
  ListKind kind = ListKind::kFloats;
};

// The dtype of a buffer of a list of this kind, or nullopt where the kind does not take it.
inline std::optional<ElementType> list_element_type(ListKind kind, ffi::DataType t) {
  switch (kind) {
    case ListKind::kWords:
      if (t == ffi::DataType::S16) return ElementType{DType::kI16, false};
      return std::nullopt;
    case ListKind::kCodes:
      if (t == ffi::DataType::S8) return ElementType{DType::kI8, false};
      if (t == ffi::DataType::U8) return ElementType{DType::kU8, false};
      return std::nullopt;
    case ListKind::kBlockValues:
      if (t == ffi::DataType::F32) return ElementType{DType::kF32, false};
      return std::nullopt;
    case ListKind::kFloats:
      break;
  }
  return element_type(t);
}

inline const char* list_kind_dtypes(ListKind kind) {
  switch (kind) {
    case ListKind::kWords: return "int16";
    case ListKind::kCodes: return "int8 or uint8";
    case ListKind::kBlockValues: return "float32";
    case ListKind::kFloats: break;
  }
  return "float32, bfloat16, float16, float64, complex64, complex128";
}

// Which lists of a call are packed: all their tensors in one buffer, tensor t's elements at its
// own offset (jaxfuse's packed optimizer state and packed params, jaxfuse/_core/packing.py: a
// handful of buffers whatever the tree). `lists`: bit k set when list k is packed. `offsets`:
// for each packed list in list order, one offset per tensor, in the buffer's elements (a
// block-value list's in block values). `sizes`: each tensor's element count (a complex element
// counted once), given whenever a list is packed.
struct PackedLists {
  uint32_t lists = 0;
  ffi::Span<const int64_t> offsets;
  ffi::Span<const int64_t> sizes;

  bool has(int k) const { return ((lists >> k) & 1) != 0; }
  // The call's buffers of list k: one when it is packed, else one per tensor.
  int64_t buffers(int k, int64_t num_tensors) const { return has(k) ? 1 : num_tensors; }
  // The operand (or result) index of list `k`'s first buffer, lists [first, k) before it.
  int64_t first_buffer(int first, int k, int64_t num_tensors) const {
    int64_t at = 0;
    for (int j = first; j < k; ++j) at += buffers(j, num_tensors);
    return at;
  }
};

// Checks the packed-list attributes against the call's lists and tensors.
inline ffi::Error check_packed(const PackedLists& packed, int num_lists, int64_t num_tensors) {
  if (packed.lists >> num_lists != 0) {
    return invalid_argument("packed_lists ", packed.lists, " names lists beyond the call's ",
                            num_lists);
  }
  int count = 0;
  for (int k = 0; k < num_lists; ++k) count += packed.has(k) ? 1 : 0;
  const size_t sizes = count == 0 ? 0 : static_cast<size_t>(num_tensors);
  if (packed.offsets.size() != static_cast<size_t>(count * num_tensors) ||
      packed.sizes.size() != sizes) {
    return invalid_argument("packed_offsets has ", packed.offsets.size(), " entries and "
                            "tensor_sizes ", packed.sizes.size(), ", expected ",
                            count * num_tensors, " (", count, " packed lists of ", num_tensors,
                            " tensors) and ", sizes);
  }
  for (size_t t = 0; t < packed.sizes.size(); ++t) {
    if (packed.sizes[t] < 0) return invalid_argument("tensor_sizes entry ", t, " is negative");
  }
  return ffi::Error::Success();
}

// The buffer behind a decoded result (results decode as Result<AnyBuffer>).
inline ffi::ErrorOr<ffi::AnyBuffer> buffer_of(ffi::ErrorOr<ffi::Result<ffi::AnyBuffer>> r) {
  if (r.has_error()) return ffi::Unexpected<ffi::Error>(r.error());
  return **r;
}

// Decodes buffer t of list `src`, checking its dtype against the list's kind.
inline ffi::ErrorOr<ffi::AnyBuffer> list_buffer(const ffi::RemainingArgs& args,
                                                const ffi::RemainingRets* rets,
                                                const ListSource& src, int64_t t) {
  // No placeholder AnyBuffer: its constructor asserts a non-null buffer (Debug builds).
  ffi::ErrorOr<ffi::AnyBuffer> decoded = src.from_rets
                                             ? buffer_of(rets->get<ffi::AnyBuffer>(src.offset + t))
                                             : args.get<ffi::AnyBuffer>(src.offset + t);
  if (decoded.has_error()) {
    return ffi::Unexpected<ffi::Error>(invalid_argument(
        "list '", src.name, "' tensor ", t, ": ", decoded.error().message()));
  }
  if (!list_element_type(src.kind, decoded->element_type())) {
    return ffi::Unexpected<ffi::Error>(invalid_argument("list '", src.name, "' tensor ", t,
                                                        ": unsupported dtype (",
                                                        list_kind_dtypes(src.kind), " only)"));
  }
  return decoded;
}

// The elements a tensor of `scalars` scalars has in a list of this kind (of a block-value list,
// its block values).
inline int64_t list_elements(ListKind kind, int64_t scalars, bool complex) {
  if (kind == ListKind::kBlockValues) return (scalars + kBlockElements - 1) / kBlockElements;
  return complex ? scalars / 2 : scalars;
}

// Each tensor's address in packed list `src` (list k), at its offset: checked to lie inside the
// buffer and to overlap no other tensor (two tensors writing one element would race, and
// corrupt each other).
inline ffi::Error place_packed(const ListSource& src, ffi::AnyBuffer buffer,
                               ffi::Span<const int64_t> offsets, int k, TensorLists* tensors) {
  const int64_t available = static_cast<int64_t>(buffer.element_count());
  const int64_t bytes = static_cast<int64_t>(ffi::ByteWidth(buffer.element_type()));
  std::vector<std::pair<int64_t, int64_t>> spans;  // (offset, elements)
  for (int64_t t = 0; t < tensors->num_tensors(); ++t) {
    const int64_t elements = list_elements(src.kind, tensors->size[t], tensors->complex[t] != 0);
    const int64_t offset = offsets[t];
    if (offset < 0 || elements > available || offset > available - elements) {
      return invalid_argument("packed list '", src.name, "' tensor ", t, ": elements [", offset,
                              ", ", offset + elements, ") outside its buffer of ", available);
    }
    if (elements > 0) spans.emplace_back(offset, elements);
  }
  std::sort(spans.begin(), spans.end());
  for (size_t i = 1; i < spans.size(); ++i) {
    if (spans[i - 1].first + spans[i - 1].second > spans[i].first) {
      return invalid_argument("packed list '", src.name, "': two tensors overlap at element ",
                              spans[i].first);
    }
  }
  char* base = static_cast<char*>(buffer.untyped_data());
  for (int64_t t = 0; t < tensors->num_tensors(); ++t) {
    tensors->ptr[t][k] = base + offsets[t] * bytes;
  }
  return ffi::Error::Success();
}

// Decodes the buffers of each list, checking dtypes and that every list of a tensor has the
// same element count and is complex or real alike. `mask` may be empty (all zero); `rets` may
// be null when no list comes from the results. A packed list (`packed`) takes one buffer, its
// source's `offset`, for all tensors.
inline ffi::Error collect_lists(const ffi::RemainingArgs& args, const ffi::RemainingRets* rets,
                                const ListSource* sources, int num_lists, int64_t num_tensors,
                                ffi::Span<const uint8_t> mask, TensorLists* out,
                                const PackedLists& packed = {}) {
  if (num_lists > kMaxLists) return internal_error("too many tensor lists");
  if (mask.size() != 0 && static_cast<int64_t>(mask.size()) != num_tensors) {
    return invalid_argument("per-tensor mask has ", mask.size(), " entries for ", num_tensors,
                            " tensors");
  }
  JF_RETURN_IF_ERROR(check_packed(packed, num_lists, num_tensors));
  out->num_lists = num_lists;
  out->ptr.assign(num_tensors, {});
  out->dtype.assign(num_tensors, {});
  out->size.assign(num_tensors, 0);
  out->mask.assign(num_tensors, 0);
  out->complex.assign(num_tensors, 0);
  int64_t packed_seen = 0;
  for (int k = 0; k < num_lists; ++k) {
    const ListSource& src = sources[k];
    out->per_block[k] = src.kind == ListKind::kBlockValues;
    if (src.from_rets && rets == nullptr) return internal_error("list '", src.name, "': no results");
    const int64_t available = src.from_rets ? static_cast<int64_t>(rets->size())
                                            : static_cast<int64_t>(args.size());
    const int64_t buffers = packed.buffers(k, num_tensors);
    if (src.offset + buffers > available) {
      return invalid_argument("list '", src.name, "' needs ", buffers, " buffers from ",
                              src.from_rets ? "results" : "operands", " at ", src.offset,
                              ", the call has ", available);
    }
    if (packed.has(k)) {
      ffi::ErrorOr<ffi::AnyBuffer> buf = list_buffer(args, rets, src, 0);
      if (buf.has_error()) return buf.error();
      const ElementType type = *list_element_type(src.kind, buf->element_type());
      for (int64_t t = 0; t < num_tensors; ++t) {
        const int64_t n = packed.sizes[t] * (type.complex ? 2 : 1);
        if (k == 0) {
          out->size[t] = n;
          out->complex[t] = type.complex;
        } else if (src.kind != ListKind::kBlockValues &&
                   (n != out->size[t] || type.complex != (out->complex[t] != 0))) {
          return invalid_argument("tensor ", t, ": packed list '", src.name, "' does not match "
                                  "list '", sources[0].name, "' (size or complex)");
        }
        out->dtype[t][k] = type.dtype;
      }
      const ffi::Span<const int64_t> offsets(packed.offsets.begin() + packed_seen * num_tensors,
                                             num_tensors);
      ++packed_seen;
      JF_RETURN_IF_ERROR(place_packed(src, *buf, offsets, k, out));
      continue;
    }
    for (int64_t t = 0; t < num_tensors; ++t) {
      ffi::ErrorOr<ffi::AnyBuffer> buf = list_buffer(args, rets, src, t);
      if (buf.has_error()) return buf.error();
      const ElementType type = *list_element_type(src.kind, buf->element_type());
      out->dtype[t][k] = type.dtype;
      const int64_t count = static_cast<int64_t>(buf->element_count());
      if (src.kind == ListKind::kBlockValues) {
        const int64_t blocks = (out->size[t] + kBlockElements - 1) / kBlockElements;
        if (k == 0 || count != blocks) {
          return invalid_argument("tensor ", t, ": list '", src.name, "' has ", count,
                                  " block values, expected ", blocks, " (one per ",
                                  kBlockElements, " elements)");
        }
        out->ptr[t][k] = buf->untyped_data();
        continue;
      }
      const int64_t n = count * (type.complex ? 2 : 1);
      if (k == 0) {
        out->size[t] = n;
        out->complex[t] = type.complex;
      } else if (type.complex != (out->complex[t] != 0)) {
        return invalid_argument("tensor ", t, ": list '", src.name, "' is ",
                                type.complex ? "complex" : "real", ", list '", sources[0].name,
                                "' is not");
      } else if (n != out->size[t]) {
        const int per_element = type.complex ? 2 : 1;
        return invalid_argument("tensor ", t, ": list '", src.name, "' has ", n / per_element,
                                " elements, list '", sources[0].name, "' has ",
                                out->size[t] / per_element);
      }
      if (k == 0 && packed.sizes.size() != 0 && n != packed.sizes[t] * (type.complex ? 2 : 1)) {
        return invalid_argument("tensor ", t, ": list '", src.name, "' has ", count,
                                " elements, tensor_sizes says ", packed.sizes[t]);
      }
      out->ptr[t][k] = buf->untyped_data();
    }
  }
  for (int64_t t = 0; t < num_tensors && mask.size() != 0; ++t) out->mask[t] = mask[t];
  return ffi::Error::Success();
}

}  // namespace jaxfuse
