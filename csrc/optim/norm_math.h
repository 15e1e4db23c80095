// Global norm and gradient control: the math shared by the global-norm kernels and the optimizer
// kernels, one definition for the host (CPU handlers) and the device (CUDA kernels).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "core/dtype.h"
#include "core/vector_layout.h"

namespace jaxfuse {

// The gradient-control vector, GradCtrl::kSize scalars on device, written by the global-norm
// kernel (or built in JAX): the gradients an op uses are ((g / loss_scale) / clip_div) *
// clip_mul, and the whole step is skipped (state untouched, count not advanced) when skip != 0.
#define JAXFUSE_GRAD_CTRL_FIELDS(X) X(loss_scale) X(clip_div) X(clip_mul) X(skip)
JF_DEFINE_VECTOR_LAYOUT(GradCtrl, JAXFUSE_GRAD_CTRL_FIELDS);

// The operands of the norm op, NormParams::kSize scalars: the loss scale the gradients carry and
// the clipping threshold.
#define JAXFUSE_NORM_PARAMS_FIELDS(X) X(loss_scale) X(max_norm)
JF_DEFINE_VECTOR_LAYOUT(NormParams, JAXFUSE_NORM_PARAMS_FIELDS);

// How an op sees the gradients, decoded from a gradient-control vector in the op's compute type
// (as optax rounds the norm to each leaf's dtype): unscaled by the loss scale, then clipped the
// way optax's clip_by_global_norm does it, (g / norm) * max_norm.
template <typename Real>
struct GradScaling {
  Real loss_scale, clip_div, clip_mul;
  bool scale;  // loss_scale != 1
  bool clip;   // clipping active
  bool skip;   // skip the whole step

  JF_HD Real apply(Real g) const {
    if (scale) g = g / loss_scale;
    if (clip) g = (g / clip_div) * clip_mul;
    return g;
  }
};

template <typename Real>
JF_HD GradScaling<Real> make_grad_scaling(ScalarVector grad_ctrl) {
  GradScaling<Real> s;
  s.loss_scale = Real(grad_ctrl[GradCtrl::loss_scale]);
  s.clip_div = Real(grad_ctrl[GradCtrl::clip_div]);
  s.clip_mul = Real(grad_ctrl[GradCtrl::clip_mul]);
  s.scale = s.loss_scale != Real(1);
  s.clip = s.clip_div != Real(1) || s.clip_mul != Real(1);
  s.skip = grad_ctrl[GradCtrl::skip] != 0.0;
  return s;
}

// g[i] = s.apply(g[i]) for a group of n elements, one pass per active factor so that each
// loop is a plain vectorizable division (the CPU calls it on tiles, the GPU on 4 registers).
template <typename Real, typename Count>
JF_HD void scale_group(const GradScaling<Real>& s, Count n, Real* g) {
  if (s.scale) {
    for (Count i = 0; i < n; ++i) g[i] = g[i] / s.loss_scale;
  }
  if (s.clip) {
    for (Count i = 0; i < n; ++i) g[i] = (g[i] / s.clip_div) * s.clip_mul;
  }
}

// ---- global norm ------------------------------------------------------------------------------
//
// Stage 1 (multi-tensor) writes one partial per GPU block / CPU chunk: the sum of squares and a
// non-finite marker (the sum of x - x, which is 0 for finite x and NaN otherwise, so it needs no
// branch and vectorizes). Stage 2 sums the partials in a fixed order and calls finish_norm.
// Everything accumulates in double: the square of a float is exact in double, and a sum of n of
// them in double is off by at most n * 2^-53 relative, below a float ulp (2^-23) for any
// n < 2^30, so the norm of a 16- or 32-bit tree is its exact norm rounded once, whatever the
// size (a float64 tree's error grows with n as plain float64 summation does).

// Folds one element (a real scalar; a complex element is two) into a partial.
JF_HD void norm_accumulate(double x, double& sumsq, double& nonfinite) {
  sumsq += x * x;
  nonfinite += x - x;
}

// A sum of squares with its non-finite marker: a partial, one device's total, or a sum of them.
// A sharded norm (jaxfuse/clip.py) exchanges each device's total as a row of kNormSumWords
// uint32 words (the two doubles' bits, so that JAX can all-reduce rows without float64): each
// device fills only its own row and the others are zero, so the all-reduce's sum is exact and
// every device then adds the same rows in the same order.
inline constexpr int kNormSumWords = 4;

// Two doubles as four uint32 words (their bits), the rows devices exchange.
JF_HD void store_double_pair(uint32_t* words, double a, double b) {
  memcpy(words, &a, sizeof(double));
  memcpy(words + 2, &b, sizeof(double));
}
JF_HD void load_double_pair(const uint32_t* words, double& a, double& b) {
  memcpy(&a, words, sizeof(double));
  memcpy(&b, words + 2, sizeof(double));
}

struct NormSum {
  double sumsq = 0.0;
  double nonfinite = 0.0;  // sum of (x - x): 0 iff every x is finite

  JF_HD void add(const NormSum& other) {
    sumsq += other.sumsq;
    nonfinite += other.nonfinite;
  }
  JF_HD void store_row(uint32_t* row) const { store_double_pair(row, sumsq, nonfinite); }
  JF_HD static NormSum load_row(const uint32_t* row) {
    NormSum s;
    load_double_pair(row, s.sumsq, s.nonfinite);
    return s;
  }
};

// From the total sum of squares of the raw (loss-scaled) gradients: the global norm of the
// unscaled gradients, rounded to the dtype of `norm_out` (the leaves' result dtype, as in optax),
// and the gradient-control vector for the consumers. Clipping follows optax: unchanged when
// norm < max_norm (compared in the norm's dtype; a NaN norm clips, spreading the NaN, as optax
// does); `clip_enabled` false turns it off. `clip_apply_loss_scale` false leaves the loss scale
// in the gradients (for a transform whose consumer unscales them later).
JF_HD void finish_norm(double sumsq, double nonfinite_marker, ScalarVector norm_params,
                       bool clip_enabled, bool skip_nonfinite, bool clip_apply_loss_scale,
                       ScalarVectorOut norm_out, ScalarVectorOut grad_ctrl) {
  const double loss_scale = norm_params[NormParams::loss_scale];
  const double max_norm = norm_params[NormParams::max_norm];
  const double norm = norm_out.round(norm_out.round(sqrt(sumsq)) / norm_out.round(loss_scale));
  norm_out.set(0, norm);
  const bool nonfinite = nonfinite_marker != 0.0;  // NaN compares unequal to 0: true
  const bool clip = clip_enabled && !(norm < norm_out.round(max_norm));
  grad_ctrl.set(GradCtrl::loss_scale, clip_apply_loss_scale ? loss_scale : 1.0);
  grad_ctrl.set(GradCtrl::clip_div, clip ? norm : 1.0);
  grad_ctrl.set(GradCtrl::clip_mul, clip ? max_norm : 1.0);
  grad_ctrl.set(GradCtrl::skip, (skip_nonfinite && nonfinite) ? 1.0 : 0.0);
}

}  // namespace jaxfuse
