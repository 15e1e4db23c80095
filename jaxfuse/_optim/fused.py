"""The fused in-place optimizer step."""

from __future__ import annotations

from typing import Any, Optional

import jax
import optax

from jaxfuse._optim import donation as _donation
from jaxfuse._optim import inplace as _inplace


def fused_step(tx: optax.GradientTransformation, grads: Any, opt_state: Any, params: Any, *,
               grad_scale: Optional[jax.Array] = None, return_grad_norm: bool = False):
  """One optimizer step with params and optimizer state updated in place.

  The result equals ``updates, s = tx.update(grads, opt_state, params)`` then
  ``optax.apply_updates(params, updates), s``, computed by one optimizer kernel (plus the two
  global-norm kernels when clipping, skipping non-finite steps or returning the norm) that reads
  params, grads and the optimizer's state once and writes params and state in place: 28 bytes
  per fp32 parameter with two state lists (Adam; 32 with clipping), 20 with one (SGD with
  momentum, Lion, Adagrad); trust-ratio families (LAMB, LARS) add a first pass that reads grads
  and params (and the states their direction needs) for their ratios. Under ``jax.jit(step, donate_argnums=...)`` with params and
  opt_state donated (in the order they are returned), no new parameter or state buffers are
  allocated; without donation XLA copies them first.

  ``tx`` is any transform whose last step is a jaxfuse optimizer (any family: ``adamw``,
  ``sgd``, ``lion``, ...): alone; in ``optax.chain``/``optax.named_chain`` (nested or not) after any transforms,
  ``jaxfuse.clip_by_global_norm`` directly before it folding into its kernels;
  ``optax.inject_hyperparams(jaxfuse.adamw)(...)`` (hyperparameters read from the state);
  ``jaxfuse.multi_steps(tx, k)`` (gradient accumulation). fused_step runs ``tx.update`` with
  jaxfuse's transforms switched to in place (``jaxfuse/_optim/inplace.py``): every wrapper's own
  state advances as optax defines it, and a transform after the optimizer, which would change
  updates that are already applied, raises an error naming the alternative
  (``skip_nonfinite=True`` for ``optax.apply_if_finite``, ``jaxfuse.multi_steps`` for
  ``optax.MultiSteps``).

  Args:
    tx: the transform that ``opt_state`` belongs to.
    grads, opt_state, params: as for ``tx.update``.
    grad_scale: optional loss scale (device scalar); gradients are divided by it as the jaxfuse
      kernels read them (transforms before the optimizer see them scaled).
    return_grad_norm: also return the global norm of the gradients that reach the optimizer
      (before a folded clip and unscaled), a device scalar: free when clipping or skipping non-finite
      steps, one extra read of the gradients otherwise.

  Returns:
    ``(new_params, new_opt_state)``, or ``(new_params, new_opt_state, grad_norm)``.
  """
  params, opt_state = _donation.check(params, opt_state)
  step = _inplace.InPlaceStep(grad_scale=grad_scale, need_norm=return_grad_norm)
  with _inplace.active(step):
    updates, new_state = tx.update(grads, opt_state, params)
  step.check_result(updates)
  if return_grad_norm:
    return step.new_params, new_state, step.grad_norm
  return step.new_params, new_state
