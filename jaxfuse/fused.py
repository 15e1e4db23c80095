"""The fused in-place optimizer step."""

from __future__ import annotations

from typing import Any, Optional

import jax
import optax

from jaxfuse.adam import AdamSpec, adam_in_place, grad_ctrl_for
from jaxfuse.clip import ClipSpec


def _component_specs(tx: optax.GradientTransformation) -> tuple[list[Any], bool]:
  """The jaxfuse specs of `tx`'s parts, and whether `tx` is an optax.chain of them."""
  spec = getattr(tx.update, "jaxfuse_spec", None)
  if spec is not None:
    return [spec], False
  # optax.chain keeps the update functions of its transforms (unwrapped for ExtraArgs
  # transforms, as all of jaxfuse's are) in a tuple in its closure.
  for cell in getattr(tx.update, "__closure__", None) or ():
    try:
      value = cell.cell_contents
    except ValueError:
      continue
    if isinstance(value, tuple) and value and all(callable(f) for f in value):
      return [getattr(f, "jaxfuse_spec", None) for f in value], True
  return [None], False


def fused_step(tx: optax.GradientTransformation, grads: Any, opt_state: Any, params: Any, *,
               grad_scale: Optional[jax.Array] = None, return_grad_norm: bool = False):
  """One optimizer step with params and optimizer state updated in place.

  ``tx`` is ``jaxfuse.adam(...)``/``jaxfuse.adamw(...)``, alone or as the last transform of
  ``optax.chain([jaxfuse.clip_by_global_norm(c),] jaxfuse.adam(...)/adamw(...))``. The result
  equals ``updates, s = tx.update(grads, opt_state, params); optax.apply_updates(params,
  updates), s``, computed by one Adam kernel (plus the two global-norm kernels when clipping,
  skipping non-finite steps or returning the norm) that reads each of params, grads, mu and nu
  once and writes params, mu and nu in place: 28 bytes per fp32 parameter (32 with clipping).
  Under ``jax.jit(step, donate_argnums=...)`` with params and opt_state donated (in the order
  they are returned), no new parameter or state buffers are allocated; without donation XLA
  copies them first.

  Args:
    tx: the transform that ``opt_state`` belongs to.
    grads, opt_state, params: as for ``tx.update``.
    grad_scale: optional loss scale (device scalar); gradients are divided by it as they are read.
    return_grad_norm: also return the global norm of the (unscaled, unclipped) gradients, a
      device scalar (free when clipping; one extra read of the gradients otherwise).

  Returns:
    ``(new_params, new_opt_state)``, or ``(new_params, new_opt_state, grad_norm)``.
  """
  specs, chained = _component_specs(tx)
  if len(specs) == 1 and isinstance(specs[0], AdamSpec):
    clip, spec = None, specs[0]
  elif len(specs) == 2 and isinstance(specs[0], ClipSpec) and isinstance(specs[1], AdamSpec):
    clip, spec = specs
  else:
    raise TypeError(
        "jaxfuse.fused_step supports jaxfuse.adam/adamw, alone or as "
        "optax.chain([jaxfuse.clip_by_global_norm(c),] jaxfuse.adam/adamw(...)); got a transform "
        f"made of {[type(s).__name__ if s is not None else 'non-jaxfuse transform' for s in specs]}")
  if chained and not (isinstance(opt_state, tuple) and len(opt_state) == len(specs)):
    raise ValueError(f"jaxfuse.fused_step: opt_state is not the state of a {len(specs)}-transform "
                     f"chain (got {type(opt_state).__name__})")
  norm, grad_ctrl = grad_ctrl_for(spec, grads, grad_scale,
                                  clip_max_norm=clip.max_norm if clip is not None else None,
                                  need_norm=return_grad_norm,
                                  axis_name=clip.axis_name if clip is not None else None)
  adam_state = opt_state[-1] if chained else opt_state
  new_params, new_adam_state = adam_in_place(spec, grads, adam_state, params, grad_ctrl)
  new_state = (*opt_state[:-1], new_adam_state) if chained else new_adam_state
  if return_grad_norm:
    return new_params, new_state, norm
  return new_params, new_state
