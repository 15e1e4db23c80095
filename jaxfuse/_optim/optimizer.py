"""The generic fused optimizer: what every element-wise family (Adam, SGD, Lion, ...) shares.

A family is a :class:`~jaxfuse._optim.spec.Spec` subclass (spec.py) plus a C++ family struct
(csrc/optim/optimizer.h); :func:`transform` makes its optax transform, written once for all:

* ``init``: the optax twin's state (so checkpoints move both ways), with an ``ExtraState``
  appended for the opt-in master weights and non-finite skipping;
* ``update``: the optax protocol (xla_path.py), the family's element math as XLA operations,
  which XLA fuses with ``optax.apply_updates`` into one pass, as optax's own step is; or, under
  :func:`jaxfuse.fused_step`, the in-place step (kernel_path.py) in the family's kernels;
* both on arguments checked at trace time, naming the leaf at fault (step.py).
"""

from __future__ import annotations

import optax

from jaxfuse._optim import inplace as _inplace
from jaxfuse._optim import kernel_path as _kernel_path
from jaxfuse._optim import xla_path as _xla_path
from jaxfuse._optim.spec import Spec


def transform(spec: Spec) -> optax.GradientTransformationExtraArgs:
  """The optax transform of `spec`: the optax protocol, or the in-place step under
  :func:`jaxfuse.fused_step`."""
  spec.check_options()  # also fails early when the op is not built

  def init_fn(params):
    return spec.init(params)

  def update_fn(updates, state, params=None, *, grad_scale=None, **extra_args):
    del extra_args
    if params is None and spec.needs_params:
      why = "master weights" if spec.master_weights else "stochastic rounding" \
          if spec.stochastic_rounding else spec.params_role
      raise ValueError(f"{spec.name}: update() needs params (for {why}), as optax's does")
    step = _inplace.current()
    if step is not None:
      return _kernel_path.update_in_place(spec, step, updates, state, params)
    return _xla_path.xla_updates(spec, updates, state, params, grad_scale)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
