"""The in-place mode of jaxfuse's transforms, the mechanism behind :func:`jaxfuse.fused_step`.

``fused_step(tx, grads, opt_state, params)`` calls ``tx.update(grads, opt_state, params)``, the
public optax protocol, with an in-place step active (a thread-local `InPlaceStep`). While it is
active jaxfuse's transforms behave differently:

* a jaxfuse optimizer (``adam``, ``sgd``, ``lion``, ...; jaxfuse/_optim/optimizer.py) writes the new
  params, its state and master params in place, records the new params here, and returns
  placeholder updates (zeros that nothing reads: XLA removes them) with its new state;
* ``jaxfuse.clip_by_global_norm`` computes nothing: it records its ``max_norm`` and the leaves it
  passes on, and the optimizer that receives exactly those leaves folds the clip into its
  kernels;
* ``jaxfuse.multi_steps`` accumulates the gradients and runs its inner step in place every k-th
  call.

Whatever wraps them (``optax.chain``, ``optax.named_chain``, ``optax.inject_hyperparams``, nested
chains) runs as usual, so its own state advances as optax defines it and hyperparameters come
from where the wrapper puts them. What the wrapper returns tells whether the in-place step is the
step ``tx`` describes: the updates must be the optimizer's placeholders, untouched (nothing after
it changed them), and every recorded clip must have been folded. Anything else raises an error
that says what to use instead. No optax internals are read.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from typing import Any, Iterator, Optional

import jax

_local = threading.local()


@dataclasses.dataclass
class InPlaceStep:
  """What one in-place step has done so far (see the module docstring)."""

  grad_scale: Any = None
  need_norm: bool = False
  new_params: Any = None
  grad_norm: Any = None
  placeholders: Optional[list] = None  # the update leaves the optimizer returned
  pending_clip: Any = None  # (ClipSpec, the leaves the clip passed on) until an optimizer folds it
  owner: str = ""  # the transform that produced new_params, for error messages

  def take_clip(self, grads: Any):
    """The ClipSpec recorded for exactly these gradient leaves (and forget it), else None."""
    if self.pending_clip is None:
      return None
    spec, leaves = self.pending_clip
    mine = jax.tree.leaves(grads)
    if len(mine) != len(leaves) or any(a is not b for a, b in zip(mine, leaves)):
      return None
    self.pending_clip = None
    return spec

  def record_clip(self, spec: Any, updates: Any) -> None:
    if self.pending_clip is not None:
      raise ValueError("jaxfuse.fused_step: two jaxfuse.clip_by_global_norm transforms before "
                       "one optimizer; keep one")
    self.pending_clip = (spec, jax.tree.leaves(updates))

  def record_step(self, owner: str, new_params: Any, grad_norm: Any, placeholders: Any) -> None:
    if self.new_params is not None:
      raise ValueError(
          f"jaxfuse.fused_step: {owner} ran after {self.owner} had already updated the params in "
          "this step. fused_step takes one jaxfuse optimizer per step; wrappers that call their inner "
          "transform more than once, such as optax.MultiSteps (use jaxfuse.multi_steps, which "
          "keeps optax's state layout), are not supported")
    self.owner, self.new_params, self.grad_norm = owner, new_params, grad_norm
    self.placeholders = jax.tree.leaves(placeholders)

  def check_result(self, updates: Any) -> None:
    """Raises unless `updates`, what tx.update returned, shows the in-place step is tx's step."""
    if self.new_params is None:
      raise TypeError(
          "jaxfuse.fused_step: no jaxfuse optimizer ran in this transform. fused_step takes a "
          "jaxfuse optimizer (jaxfuse.adamw, sgd, lion, ...), alone or inside "
          "optax.chain/named_chain, "
          "optax.inject_hyperparams or jaxfuse.multi_steps (with jaxfuse.clip_by_global_norm or "
          "any other transform before it); for other optimizers use tx.update and "
          "optax.apply_updates")
    if self.pending_clip is not None:
      raise ValueError(
          "jaxfuse.fused_step: jaxfuse.clip_by_global_norm must come directly before the jaxfuse "
          "optimizer (fused_step folds it into the optimizer's kernels); something between them, "
          "or the clip after the optimizer, changes the gradients it would scale. Use "
          "optax.clip_by_global_norm there, or move the clip next to the optimizer")
    leaves = jax.tree.leaves(updates)
    if len(leaves) != len(self.placeholders) or any(
        a is not b for a, b in zip(leaves, self.placeholders)):
      raise ValueError(
          f"jaxfuse.fused_step: a transform after {self.owner} changes its updates, which the "
          "in-place step has already applied. Transforms after the optimizer are not supported: "
          "optax.apply_if_finite -> skip_nonfinite=True on the jaxfuse optimizer; optax.MultiSteps "
          "-> jaxfuse.multi_steps; optax.masked or optax.partition around it -> its "
          "own weight-decay mask, or tx.update + optax.apply_updates")


def current() -> Optional[InPlaceStep]:
  """The in-place step being traced on this thread, or None (the optax protocol)."""
  return getattr(_local, "step", None)


@contextlib.contextmanager
def active(step: Optional[InPlaceStep]) -> Iterator[Optional[InPlaceStep]]:
  """Within the block, jaxfuse's transforms run in place into `step` (None: the optax
  protocol)."""
  previous = current()
  _local.step = step
  try:
    yield step
  finally:
    _local.step = previous
