"""Gradient accumulation that keeps the fused step in place: ``jaxfuse.multi_steps``."""

from __future__ import annotations

from typing import Any, Callable, Union

import jax
import jax.numpy as jnp
import optax

from jaxfuse._core import trees as _trees
from jaxfuse._optim import inplace as _inplace
from jaxfuse._optim.clip import global_norm
from jaxfuse._optim.fused import fused_step


def multi_steps(tx: optax.GradientTransformation,
                every_k_schedule: Union[int, Callable[[jax.Array], jax.Array]],
                use_grad_mean: bool = True) -> optax.GradientTransformationExtraArgs:
  """``optax.MultiSteps(tx, every_k_schedule, use_grad_mean)`` that also runs in place.

  Gradients of k consecutive calls are accumulated (averaged with ``use_grad_mean``, as
  optax does: ``acc += (g - acc) / (n + 1)``), and every k-th call ``tx`` is applied to the
  accumulation, which then restarts from zero. The state is an ``optax.MultiStepsState`` with
  optax's layout (checkpoints move between the two). Through the optax protocol this is
  ``optax.MultiSteps`` itself: zero updates on the other calls.

  Under :func:`jaxfuse.fused_step` (``tx`` ending in a jaxfuse optimizer) the accumulation is one
  XLA pass over the gradients (read ``g`` and ``acc``, write ``acc`` in place) and the k-th call
  runs the fused in-place step on it inside a ``lax.cond``: a device-side branch, no host sync,
  no recompiles; moments and accumulator stay in place, and XLA's conditional copies the params
  once per call (20 bytes per fp32 param a call, plus the fused step's 28 every k-th; optax's
  MultiSteps runs its inner update on every call). ``return_grad_norm`` returns the norm of the
  gradients of this call (one more read of them). optax.MultiSteps's ``should_skip_update_fn``
  has no counterpart: use ``skip_nonfinite=True`` on the optimizer.

  Args:
    tx: the transform to apply every k calls.
    every_k_schedule: k, or a function of the gradient step (``MultiStepsState.gradient_step``)
      returning it.
    use_grad_mean: average the accumulated gradients (else sum them).
  """
  reference = optax.MultiSteps(tx, every_k_schedule, use_grad_mean=use_grad_mean)
  every_k = every_k_schedule if callable(every_k_schedule) else (lambda _: every_k_schedule)

  def update_fn(updates, state, params=None, **extra_args):
    in_place = _inplace.current()
    if in_place is None:
      return reference.update(updates, state, params, **extra_args)
    if params is None:
      raise ValueError("jaxfuse.fused_step: params are required")
    return _accumulate_in_place(tx, every_k(state.gradient_step), use_grad_mean, in_place,
                                _trees.as_arrays(updates), state, params)

  return optax.GradientTransformationExtraArgs(reference.init, update_fn)


def _accumulate_in_place(tx, k, use_grad_mean: bool, in_place: _inplace.InPlaceStep, grads: Any,
                         state: optax.MultiStepsState, params: Any):
  """One call of multi_steps inside a fused_step (see multi_steps)."""
  _trees.check_same_structure(state.acc_grads, grads, "the accumulated gradients", "grads")
  if in_place.grad_scale is not None:  # accumulate true gradients; the loss scale may change
    grads = jax.tree.map(lambda g: g / jnp.asarray(in_place.grad_scale, g.dtype), grads)
  n = state.mini_step
  if use_grad_mean:
    acc = jax.tree.map(lambda g, a: (a + (g - a) / (n + 1)).astype(a.dtype), grads,
                       state.acc_grads)
  else:
    acc = jax.tree.map(lambda g, a: (g + a).astype(a.dtype), grads, state.acc_grads)
  emit = n == k - 1

  def apply(acc, inner_state, params):
    new_params, new_inner = fused_step(tx, optax.tree.cast_like(acc, grads), inner_state, params)
    return new_params, new_inner, jax.tree.map(jnp.zeros_like, acc)

  def keep(acc, inner_state, params):
    return params, inner_state, acc

  new_params, new_inner, new_acc = jax.lax.cond(emit, apply, keep, acc, state.inner_opt_state,
                                                params)
  norm = None
  if in_place.need_norm:
    norm = global_norm(grads)
  placeholders = jax.tree.map(jnp.zeros_like, grads)
  in_place.record_step("jaxfuse.multi_steps", new_params, norm, placeholders)
  new_state = optax.MultiStepsState(
      mini_step=optax.safe_increment(n) % k,
      gradient_step=jnp.where(emit, optax.safe_increment(state.gradient_step),
                              state.gradient_step),
      inner_opt_state=new_inner, acc_grads=new_acc, skip_state=state.skip_state)
  return placeholders, new_state
