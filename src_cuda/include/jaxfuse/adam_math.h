// Adam / AdamW element math and the per-group program of the Adam kernel, one definition
// compiled for the host (CPU handler) and the device (CUDA kernel), as PyTorch shares its
// adam_math between its drivers.
#pragma once

#include <cmath>
#include <cstdint>

#include "jaxfuse/norm_math.h"

namespace jaxfuse {

// The hyperparameter vector, f32[AdamHyper::kSize] on device, built in JAX (so schedules,
// inject_hyperparams and traced values all work without recompiling). The (1 - b) terms are
// computed by the caller the way optax computes them, so that rounding matches optax.
#define JAXFUSE_ADAM_HYPER_FIELDS(X) \
  X(learning_rate) X(b1) X(one_minus_b1) X(b2) X(one_minus_b2) X(eps) X(eps_root) X(weight_decay)
JF_DEFINE_VECTOR_LAYOUT(AdamHyper, JAXFUSE_ADAM_HYPER_FIELDS);

// Per-step scalars, resolved once per thread block (GPU) or per call (CPU).
struct AdamStep {
  float lr, b1, one_minus_b1, b2, one_minus_b2, eps, eps_root, weight_decay;
  float bc1;       // 1 - b1^t
  float bc1_next;  // 1 - b1^(t+1), for nesterov
  float bc2;       // 1 - b2^t
  GradScaling grad;
  bool nesterov;
};

// optax.safe_increment on an int32 count: saturates at INT32_MAX.
JF_HD int32_t safe_increment(int32_t count) { return count < INT32_MAX ? count + 1 : count; }

// Resolve the per-step scalars. `count` is the state count *before* this step (optax increments
// first, then bias-corrects with the new count).
JF_HD AdamStep make_adam_step(const float* hyper, const float* grad_ctrl, int32_t count,
                              bool nesterov) {
  AdamStep s;
  s.lr = hyper[AdamHyper::learning_rate];
  s.b1 = hyper[AdamHyper::b1];
  s.one_minus_b1 = hyper[AdamHyper::one_minus_b1];
  s.b2 = hyper[AdamHyper::b2];
  s.one_minus_b2 = hyper[AdamHyper::one_minus_b2];
  s.eps = hyper[AdamHyper::eps];
  s.eps_root = hyper[AdamHyper::eps_root];
  s.weight_decay = hyper[AdamHyper::weight_decay];
  const int32_t t = safe_increment(count);
  // optax: bias_correction = 1 - decay ** count, computed in fp32.
  s.bc1 = 1.0f - powf(s.b1, float(t));
  s.bc1_next = 1.0f - powf(s.b1, float(safe_increment(t)));
  s.bc2 = 1.0f - powf(s.b2, float(t));
  s.grad = make_grad_scaling(grad_ctrl);
  s.nesterov = nesterov;
  return s;
}

// The count written back: advanced unless the step is skipped.
JF_HD int32_t adam_next_count(int32_t count, bool skip) {
  return skip ? count : safe_increment(count);
}

// One element of optax.adamw: scale_by_adam -> add_decayed_weights -> scale_by_learning_rate,
// with optax's operation order. Updates m and v in place (fp32) and returns the update
// u = -lr * (m_hat / (sqrt(v_hat + eps_root) + eps) + wd * p).
JF_HD float adam_element(const AdamStep& s, float g, float p, bool decay, float& m, float& v) {
  m = s.one_minus_b1 * g + s.b1 * m;
  v = s.one_minus_b2 * (g * g) + s.b2 * v;
  float m_hat;
  if (s.nesterov) {
    m_hat = s.b1 * (m / s.bc1_next) + s.one_minus_b1 * (g / s.bc1);
  } else {
    m_hat = m / s.bc1;
  }
  const float v_hat = v / s.bc2;
  float u = m_hat / (sqrtf(v_hat + s.eps_root) + s.eps);
  if (decay) u = u + s.weight_decay * p;
  return u * -s.lr;
}

// ---- the per-group program ------------------------------------------------------------------

// The tensor lists of an Adam call in kernel order. The optional lists (updates in the optax
// protocol, master params with master_weights) take the next free slots when present.
enum AdamList : int { kGrads = 0, kParams = 1, kMu = 2, kNu = 3, kAdamFixedLists = 4 };

// Where the optional lists are in one call (-1: absent).
struct AdamLists {
  int updates = -1;
  int master = -1;

  static JF_HD AdamLists of(bool write_updates, bool master) {
    AdamLists l;
    l.updates = write_updates ? kAdamFixedLists : -1;
    l.master = master ? kAdamFixedLists + int(write_updates) : -1;
    return l;
  }
  JF_HD int count() const { return kAdamFixedLists + int(updates >= 0) + int(master >= 0); }
  // The param value the math reads: the fp32 master copy when present.
  JF_HD int param_source() const { return master >= 0 ? master : int(kParams); }
};

// One group of elements through an Adam step. `Group` is the platform's group (the GPU: 4
// elements of one thread, in registers; the CPU: a tile of a chunk, in fp32 scratch); it
// provides `Values` (an fp32 array type), size(), load(list, x), store(list, x) and
// update(step, g, p, m, v, u), the element loop of adam_element(). `Lists` is an AdamLists or a
// type with the same members as compile-time constants. The skipped (non-finite) step leaves the
// state as it is and reports a zero update.
template <typename Group, typename Lists>
JF_HD void adam_group(const AdamStep& step, const Lists& lists, const Group& group) {
  typename Group::Values g, p, m, v, u;
  const auto n = group.size();
  if (step.grad.skip) {
    if (lists.updates >= 0) {
      for (decltype(+n) i = 0; i < n; ++i) u[i] = 0.0f;
      group.store(lists.updates, u);
    }
    return;
  }
  group.load(kGrads, g);
  scale_group(step.grad, n, g);
  group.load(lists.param_source(), p);
  group.load(kMu, m);
  group.load(kNu, v);
  group.update(step, g, p, m, v, u);
  group.store(kMu, m);
  group.store(kNu, v);
  for (decltype(+n) i = 0; i < n; ++i) p[i] = p[i] + u[i];  // the new (master) params
  if (lists.master >= 0) group.store(lists.master, p);
  if (lists.updates < 0) {
    group.store(kParams, p);
    return;
  }
  if (lists.master >= 0) {
    // The update that moves the low-precision params onto the new master value.
    group.load(kParams, g);
    for (decltype(+n) i = 0; i < n; ++i) u[i] = p[i] - g[i];
  }
  group.store(lists.updates, u);
}

}  // namespace jaxfuse
