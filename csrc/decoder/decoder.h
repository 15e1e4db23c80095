// The jaxfuse_decoder op (op.h): its FFI binding, the decoding and validation of a call
// (decoder_operands.h's checks), its contract (the names, shapes and workspace layout Python
// reads) and its cost. The run steps are cpu/decoder*.{h,cc} (the CPU twin) and
// cuda/decoder*.{cu,cuh} (the CUDA kernel and its two schedules); the element math is
// decoder_math.h and sampling_math.h.
#pragma once

#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "core/op.h"
#include "decoder/decoder_operands.h"
#include "decoder/decoder_plan.h"
#include "decoder/decoder_workspace.h"

namespace jaxfuse {

struct DecoderOp {
  static constexpr const char* kName = "jaxfuse_decoder";

  struct Call {
    DecoderDims dims;
    DecoderBuffers buffers;
  };

  template <typename Context>
  static auto binding() {
#define JF_DECODER_WEIGHT_ARG(name, ...) .template Arg<ffi::AnyBuffer>()
    return ffi::Ffi::Bind()
        .Ctx<Context>()
        .template Arg<ffi::AnyBuffer>()   // x
        .template Arg<PositionsBuffer>()  // positions
        .template Arg<RopeTableBuffer>()  // rope_inv_freq
        JAXFUSE_DECODER_WEIGHTS(JF_DECODER_WEIGHT_ARG)
        .template Arg<ffi::AnyBuffer>()   // k_cache
        .template Arg<ffi::AnyBuffer>()   // v_cache
        .template Arg<TokensBuffer>()     // tokens
        .template Arg<ffi::AnyBuffer>()   // embed
        .template Arg<ffi::AnyBuffer>()   // final_norm
        .template Arg<ffi::AnyBuffer>()   // lm_head
        .template Arg<ffi::AnyBuffer>()   // lm_head_scale
        .template Arg<SampleKeyBuffer>()  // sample_key
        .template Ret<ffi::AnyBuffer>()   // out
        .template Ret<ffi::AnyBuffer>()   // k_cache (aliased)
        .template Ret<ffi::AnyBuffer>()   // v_cache (aliased)
        .template Ret<ffi::AnyBuffer>()   // logits
        .template Ret<ffi::AnyBuffer>()   // next_tokens
        .template Ret<WorkspaceBuffer>()  // workspace
        .template Attrs<DecoderAttrs>();
#undef JF_DECODER_WEIGHT_ARG
  }

#define JF_DECODER_WEIGHT_PARAM(name, ...) ffi::AnyBuffer name,
  static ffi::Error decode(ffi::AnyBuffer x, PositionsBuffer positions,
                           RopeTableBuffer rope_inv_freq,
                           JAXFUSE_DECODER_WEIGHTS(JF_DECODER_WEIGHT_PARAM)
                           ffi::AnyBuffer k_cache, ffi::AnyBuffer v_cache, TokensBuffer tokens,
                           ffi::AnyBuffer embed, ffi::AnyBuffer final_norm,
                           ffi::AnyBuffer lm_head, ffi::AnyBuffer lm_head_scale,
                           SampleKeyBuffer sample_key,
                           ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> k_out,
                           ffi::Result<ffi::AnyBuffer> v_out, ffi::Result<ffi::AnyBuffer> logits,
                           ffi::Result<ffi::AnyBuffer> next_tokens,
                           ffi::Result<WorkspaceBuffer> workspace, DecoderAttrs attrs,
                           Call* call) {
#undef JF_DECODER_WEIGHT_PARAM
    using namespace decoder_detail;
    JF_RETURN_IF_ERROR(check_attrs(attrs));
    const auto dtype = to_dtype(x.element_type());
    if (!dtype) return invalid_argument("x must be float32, bfloat16 or float16");
    const auto x_dims = x.dimensions();
    const int64_t x_width = attrs.model_step ? 0 : attrs.hidden_size;  // tokens replace x
    if (x_dims.size() != 2 || x_dims[1] != x_width) {
      return invalid_argument("x must have shape [B, ", x_width, "]");
    }
    DecoderDims d = dims_of(attrs, x_dims[0], *dtype);
    JF_RETURN_IF_ERROR(matrix_dtype(d, wq, &d.wdtype));
    if (positions.dimensions().size() != 1 || positions.dimensions()[0] != d.B) {
      return invalid_argument("positions must have shape [", d.B, "]");
    }
    if (rope_inv_freq.dimensions().size() != 1 || rope_inv_freq.dimensions()[0] != d.hd / 2) {
      return invalid_argument("rope_inv_freq must have shape [", d.hd / 2, "] (head_dim / 2)");
    }
#define JF_DECODER_WEIGHT_ADDRESS(name, ...) &name,
    const ffi::AnyBuffer* const weights[] = {JAXFUSE_DECODER_WEIGHTS(JF_DECODER_WEIGHT_ADDRESS)};
#undef JF_DECODER_WEIGHT_ADDRESS
    JF_RETURN_IF_ERROR(check_weights(d, weights));
    JF_RETURN_IF_ERROR(check_caches(d, k_cache, v_cache, *k_out, *v_out));
    JF_RETURN_IF_ERROR(check_buffer("out", *out, d.dtype, {d.B, d.D}));
    bool head_quantized = false;
    JF_RETURN_IF_ERROR(check_model_step(&d, tokens, embed, final_norm, lm_head, lm_head_scale,
                                        sample_key, *logits, *next_tokens, &head_quantized));
    // Exactly the layout's size (Python sizes it from the same decoder_layout()).
    const int64_t need = decoder_layout(d).total;
    if (workspace->dimensions().size() != 1 || workspace->dimensions()[0] != need) {
      return invalid_argument("workspace has ", workspace->element_count(), " bytes, expected ",
                              need);
    }
    call->dims = d;
    DecoderBuffers& b = call->buffers;
    b = DecoderBuffers{};
    b.x = x.untyped_data();
    b.positions = positions.typed_data();
    b.rope_inv_freq = rope_inv_freq.typed_data();
#define JF_DECODER_WEIGHT_DATA(name, ...) name.untyped_data(),
    b.weights = {JAXFUSE_DECODER_WEIGHTS(JF_DECODER_WEIGHT_DATA)};
#undef JF_DECODER_WEIGHT_DATA
    if (d.model_step) {
      b.tokens = tokens.typed_data();
      b.embed = embed.untyped_data();
      b.final_norm = final_norm.untyped_data();
      b.head = lm_head.element_count() ? lm_head.untyped_data() : embed.untyped_data();
      if (head_quantized) b.head_scale = static_cast<const float*>(lm_head_scale.untyped_data());
      b.logits = static_cast<float*>(logits->untyped_data());
    }
    if (d.sample) {
      b.sample_key = sample_key.typed_data();
      b.next_tokens = static_cast<int32_t*>(next_tokens->untyped_data());
    }
    b.k_cache = k_out->untyped_data();
    b.v_cache = v_out->untyped_data();
    b.out = out->untyped_data();
    b.workspace = reinterpret_cast<char*>(workspace->typed_data());
    return ffi::Error::Success();
  }

  template <typename Platform>
  static ffi::Error run(typename Platform::Arg ctx, const Call& call);

  static Contract contract() {
    Contract c;
    c.names["operands"] = name_list(kDecoderOperands);
    c.names["results"] = name_list(kDecoderResults);
    c.names["weights"] = std::vector<std::string>(
        kDecoderOperands + kDecoderFirstWeight, kDecoderOperands + kDecoderFirstWeight +
        kDecoderWeights);
    c.names["weight_flags"] = name_list(kDecoderWeightFlags);  // "always" or a bool attribute
    c.names["weight_kinds"] = name_list(kDecoderWeightKinds);  // "model", "matrix", "scale"
    c.names["size_attrs"] = name_list(kDecoderSizeAttrs);
    c.names["f32_attrs"] = {"rms_norm_eps"};
    c.names["bool_attrs"] = name_list(kDecoderFlags);
    // The whole-model step's operands (after the caches) and attributes (not config fields).
    c.names["model_operands"] = {"tokens",  "embed",         "final_norm",
                                 "lm_head", "lm_head_scale", "sample_key"};
    c.names["step_bool_attrs"] = name_list(kDecoderStepFlags);
    c.names["layer_stages"] = name_list(kLayerStageNames);  // the stages' order (the timeline's)
    c.names["step_i64_attrs"] = {"top_k"};
    c.names["step_f32_attrs"] = {"temperature", "top_p"};
    // workspace(batch=, dtype_bytes=, sample_filter=, timeline=, <size attrs>=) ->
    // numbers["bytes"], and the timeline's place and shape
    c.functions["workspace"] = [](const std::map<std::string, int64_t>& args) {
      // The layout depends on the dtype only through its width (f16 and bf16 lay out alike),
      // and on the draw only through whether it is filtered.
      const DType dtype = contract_arg(args, "dtype_bytes") == 4 ? DType::kF32 : DType::kBF16;
      DecoderDims d = decoder_detail::dims_of(contract_attrs(args),
                                              contract_arg(args, "batch"), dtype);
      d.top_k = contract_arg(args, "sample_filter") != 0 ? 1 : 0;  // any filter lays out alike
      d.timeline = contract_arg(args, "timeline") != 0;
      const DecoderLayout layout = decoder_layout(d);
      ContractValues v;
      v.numbers["bytes"] = layout.total;
      // With `timeline`: where it starts, its rows and slots, and its records' fields (the
      // StageTime words, then the header's).
      v.numbers["timeline"] = layout.timeline;
      v.numbers["timeline_blocks"] = kDecTimelineBlocks;
      v.numbers["timeline_slots"] = stage_slots(d.L);
      v.numbers["timeline_header_bytes"] = sizeof(TimelineHeader);
      v.numbers["timeline_record_bytes"] = sizeof(StageTime);
      return v;
    };
    // weight_shapes(<size attrs>=, <bool attrs>=) -> shapes[weight name]
    c.functions["weight_shapes"] = [](const std::map<std::string, int64_t>& args) {
      DecoderAttrs a = contract_attrs(args);
#define JF_DECODER_READ_FLAG(name) a.name = contract_arg(args, #name) != 0;
      JAXFUSE_DECODER_FLAGS(JF_DECODER_READ_FLAG)
#undef JF_DECODER_READ_FLAG
      ContractValues v;
      for (const DecoderWeightShape& s :
           decoder_weight_shapes(decoder_detail::dims_of(a, 0, DType::kF32))) {
        v.shapes[s.name] = s.dims;
      }
      return v;
    };
    return c;
  }

  // The position of operand `name` in kDecoderOperands.
  static size_t operand_index(std::string_view name) {
    for (size_t i = 0; i < std::size(kDecoderOperands); ++i) {
      if (name == kDecoderOperands[i]) return i;
    }
    throw std::invalid_argument(str_cat("jaxfuse_decoder has no operand ", name));
  }

  // The size attributes among a contract function's arguments (the others zero).
  static DecoderAttrs contract_attrs(const std::map<std::string, int64_t>& args) {
    DecoderAttrs a{};
    a.top_p = 1.0f;
#define JF_DECODER_READ_ARG(name) a.name = contract_arg(args, #name);
    JAXFUSE_DECODER_SIZE_ATTRS(JF_DECODER_READ_ARG)
#undef JF_DECODER_READ_ARG
    return a;
  }

  // A memset of the stage counters and one cooperative kernel (cuda/decoder.cu), or with
  // stage_kernels one launch per stage the call runs (slots_run()); nothing for an empty batch.
  // Reads x, positions, every weight and the caches, counted as if attention read every cache
  // position (at most: it reads positions 0..p of each row), and in a
  // whole-model step the head (lm_head and its scales, or the tied embedding) and B rows of the
  // embedding; writes out, one K and V row per layer and batch row, the logits and next tokens,
  // and the workspace (at most, its full size).
  static CallCost cost(const CallShape& shape) {
    CallCost c;
    const int64_t batch = shape.operands.at(1).elements();  // positions
    if (batch == 0) return c;
    const auto flag = [&](const char* name) { return contract_arg(shape.attrs, name) != 0; };
    c.cuda_kernels = flag("stage_kernels")
                         ? slots_run(contract_arg(shape.attrs, "num_layers"),
                                     flag("model_step"), flag("sample"))
                         : 1;
    c.cuda_memsets = 1;
    c.bytes_upper_bound = true;
    c.bytes_read = CallShape::total_bytes(shape.operands);
    const CallShape::Buffer& embed = shape.operands.at(operand_index("embed"));
    if (shape.operands.at(operand_index("lm_head")).elements() > 0 && embed.dims.size() == 2) {
      const int64_t gathered = std::min(embed.dims[0], batch) * embed.dims[1];
      c.bytes_read -= (embed.elements() - gathered) * embed.element_bytes;
    }
    const int64_t new_kv = 2 * contract_arg(shape.attrs, "num_layers") * batch *
                           contract_arg(shape.attrs, "num_kv_heads") *
                           contract_arg(shape.attrs, "head_dim") *
                           shape.operands.at(0).element_bytes;
    c.bytes_written = new_kv;
    for (size_t r : {0, 3, 4, 5}) c.bytes_written += shape.results.at(r).bytes();
    return c;
  }
};

}  // namespace jaxfuse
