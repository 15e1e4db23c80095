"""Fused multi-tensor SGD with optional (Nesterov) momentum, optax-compatible.

``sgd`` takes the arguments of ``optax.sgd`` and computes the same update, in optax's operation
order (``trace`` then ``scale_by_learning_rate``); the state is optax's, so checkpoints move both
ways. The element math is optim/families/sgd.h's; the generic optimizer
(``jaxfuse/_optim/optimizer.py``) does the rest: the optax protocol as fusable XLA operations,
the in-place kernels of :func:`jaxfuse.fused_step`, master weights and non-finite skipping.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional, Union

import jax
import jax.numpy as jnp
import optax

from jaxfuse._optim import families as _families
from jaxfuse._optim import spec as _spec
from jaxfuse._optim.spec import Packing, ScalarOrSchedule


@dataclasses.dataclass(frozen=True, eq=False, kw_only=True)
class SgdSpec(_spec.Spec):
  """A jaxfuse SGD: the SGD family of the generic optimizer (optim/families/sgd.h)."""

  op = "jaxfuse_sgd"
  name = "jaxfuse.sgd"
  momentum: Any  # None: no trace
  nesterov: bool
  accumulator_dtype: Any

  def optax_twin(self) -> optax.GradientTransformation:
    return optax.sgd(self.learning_rate, self.momentum, self.nesterov, self.accumulator_dtype)

  def flags(self) -> dict[str, bool]:
    return {"momentum": self.momentum is not None, "nesterov": self.nesterov}

  def check_params(self, params: Any) -> None:
    if self.momentum is not None:
      _spec.check_state_dtype("accumulator_dtype", self.accumulator_dtype, params)

  def states(self, state: Any) -> list[Any]:
    return [] if self.momentum is None else [state[0].trace]

  def state_signs(self) -> list[bool]:
    return [] if self.momentum is None else [True]

  def with_states(self, state: Any, trees: list[Any]) -> Any:
    if self.momentum is None:
      return state
    return (state[0]._replace(trace=trees[0]), *state[1:])

  def hyper(self, count: jax.Array) -> dict[str, Any]:
    momentum = 0.0 if self.momentum is None else self.momentum
    return {"learning_rate": _spec.scalar(self.learning_rate, count),
            "momentum": momentum}

  def leaf_math(self, k, g, p, states, flags):
    if self.momentum is None:
      return -k["learning_rate"] * g, []
    t = g + k["momentum"] * states[0]
    u = g + k["momentum"] * t if self.nesterov else t
    return -k["learning_rate"] * u, [t]


@_families.family(SgdSpec, variants={
    "momentum": dict(learning_rate=3e-2, momentum=0.9),
    "nesterov, bf16 accumulator": dict(learning_rate=3e-2, momentum=0.9, nesterov=True,
                                        accumulator_dtype=jnp.bfloat16),
    "no momentum": dict(learning_rate=3e-2),
})
def sgd(learning_rate: ScalarOrSchedule, momentum: Optional[float] = None,
        nesterov: bool = False, accumulator_dtype: Optional[Any] = None, *,
        moment_bits: Optional[int] = None,
        master_weights: Union[bool, str] = False,
        skip_nonfinite: bool = False, stochastic_rounding: bool = False,
        seed: Optional[int] = None,
        packed: Packing = False) -> optax.GradientTransformationExtraArgs:
  r"""Stochastic gradient descent, with optional (Nesterov) momentum, as one fused kernel; same
  arguments, state and math as ``optax.sgd``.

  Per element, with lr the learning rate and mu the momentum::

    without momentum:  u = -lr * g
    with momentum:     m = g + mu * m
                       u = -lr * m                  # nesterov: u = -lr * (g + mu * m)

  (Sutskever et al, `On the importance of initialization and momentum in deep learning
  <http://proceedings.mlr.press/v28/sutskever13.pdf>`_, 2013.) The state is optax's: a
  ``TraceState`` with momentum, else an empty state, then the learning rate's (a count with a
  schedule).

  Args:
    learning_rate: a float, or an optax schedule evaluated on the step count.
    momentum: decay rate of the trace of past gradients; None: no momentum (and no state).
    nesterov: use Nesterov momentum.
    accumulator_dtype: storage dtype of the trace (None: the params' dtype, as optax).

  Returns:
    An optax ``GradientTransformationExtraArgs``.
  """
