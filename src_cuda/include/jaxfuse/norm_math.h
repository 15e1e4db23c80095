// Global norm and gradient control: the math shared by the global-norm, apply-grad-ctrl and Adam
// kernels, one definition for the host (CPU handlers) and the device (CUDA kernels).
#pragma once

#include <cmath>

#include "jaxfuse/dtype.h"
#include "jaxfuse/vector_layout.h"

namespace jaxfuse {

// The gradient-control vector, f32[GradCtrl::kSize] on device, written by the global-norm kernel
// (or built in JAX): the gradients an op uses are ((g / loss_scale) / clip_div) * clip_mul, and
// the whole step is skipped (state untouched, count not advanced) when skip != 0.
#define JAXFUSE_GRAD_CTRL_FIELDS(X) X(loss_scale) X(clip_div) X(clip_mul) X(skip)
JF_DEFINE_VECTOR_LAYOUT(GradCtrl, JAXFUSE_GRAD_CTRL_FIELDS);

// The operands of the norm op, f32[NormParams::kSize]: the loss scale the gradients carry and
// the clipping threshold.
#define JAXFUSE_NORM_PARAMS_FIELDS(X) X(loss_scale) X(max_norm)
JF_DEFINE_VECTOR_LAYOUT(NormParams, JAXFUSE_NORM_PARAMS_FIELDS);

// How an op sees the gradients, decoded from a gradient-control vector: unscaled by the loss
// scale, then clipped the way optax's clip_by_global_norm does it, (g / norm) * max_norm.
struct GradScaling {
  float loss_scale, clip_div, clip_mul;
  bool scale;  // loss_scale != 1
  bool clip;   // clipping active
  bool skip;   // skip the whole step

  JF_HD float apply(float g) const {
    if (scale) g = g / loss_scale;
    if (clip) g = (g / clip_div) * clip_mul;
    return g;
  }
};

JF_HD GradScaling make_grad_scaling(const float* grad_ctrl) {
  GradScaling s;
  s.loss_scale = grad_ctrl[GradCtrl::loss_scale];
  s.clip_div = grad_ctrl[GradCtrl::clip_div];
  s.clip_mul = grad_ctrl[GradCtrl::clip_mul];
  s.scale = s.loss_scale != 1.0f;
  s.clip = s.clip_div != 1.0f || s.clip_mul != 1.0f;
  s.skip = grad_ctrl[GradCtrl::skip] != 0.0f;
  return s;
}

// g[i] = s.apply(g[i]) for a group of n elements, one pass per active factor so that each
// loop is a plain vectorizable division (the CPU calls it on tiles, the GPU on 4 registers).
template <typename Count>
JF_HD void scale_group(const GradScaling& s, Count n, float* g) {
  if (s.scale) {
    for (Count i = 0; i < n; ++i) g[i] = g[i] / s.loss_scale;
  }
  if (s.clip) {
    for (Count i = 0; i < n; ++i) g[i] = (g[i] / s.clip_div) * s.clip_mul;
  }
}

// ---- global norm ------------------------------------------------------------------------------
//
// Stage 1 (multi-tensor) writes one partial per GPU block / CPU chunk: the fp32 sum of squares
// and a non-finite marker (the sum of x - x, which is 0 for finite x and NaN otherwise, so it
// needs no branch and vectorizes). Stage 2 sums the partials in a fixed order and calls this.

// Folds one element into a partial.
JF_HD void norm_accumulate(float x, float& sumsq, float& nonfinite) {
  sumsq += x * x;
  nonfinite += x - x;
}

// From the total sum of squares of the raw (loss-scaled) gradients: the global norm of the
// unscaled gradients, and the gradient-control vector for the consumers. Clipping follows
// optax: unchanged when norm < max_norm (a NaN norm clips, spreading the NaN, as optax does);
// `clip_enabled` false turns it off. `clip_apply_loss_scale` false leaves the loss scale in the
// gradients (for a transform whose consumer unscales them later).
JF_HD void finish_norm(float sumsq, float nonfinite_marker, const float* norm_params,
                       bool clip_enabled, bool skip_nonfinite, bool clip_apply_loss_scale,
                       float* norm_out, float* grad_ctrl) {
  const float loss_scale = norm_params[NormParams::loss_scale];
  const float max_norm = norm_params[NormParams::max_norm];
  const float norm = sqrtf(sumsq) / loss_scale;
  *norm_out = norm;
  const bool nonfinite = nonfinite_marker != 0.0f;  // NaN compares unequal to 0: true
  const bool clip = clip_enabled && !(norm < max_norm);
  grad_ctrl[GradCtrl::loss_scale] = clip_apply_loss_scale ? loss_scale : 1.0f;
  grad_ctrl[GradCtrl::clip_div] = clip ? norm : 1.0f;
  grad_ctrl[GradCtrl::clip_mul] = clip ? max_norm : 1.0f;
  grad_ctrl[GradCtrl::skip] = (skip_nonfinite && nonfinite) ? 1.0f : 0.0f;
}

}  // namespace jaxfuse
