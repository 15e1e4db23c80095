"""Fused multi-tensor Adagrad, optax-compatible.

``adagrad`` takes the arguments of ``optax.adagrad`` and computes the same update, in optax's
operation order (``scale_by_rss`` then ``scale_by_learning_rate``); the state is optax's, so
checkpoints move both ways. The element math is optim/families/adagrad.h's; the generic optimizer
(``jaxfuse/_optim/optimizer.py``) does the rest.
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
class AdagradSpec(_spec.Spec):
  """A jaxfuse Adagrad: the Adagrad family of the generic optimizer (optim/families/adagrad.h)."""

  op = "jaxfuse_adagrad"
  name = "jaxfuse.adagrad"
  initial_accumulator_value: Any
  eps: Any

  def optax_twin(self) -> optax.GradientTransformation:
    return optax.adagrad(self.learning_rate, self.initial_accumulator_value, self.eps)

  def states(self, state: Any) -> list[Any]:
    return [state[0].sum_of_squares]

  def state_signs(self) -> list[bool]:
    return [False]

  def with_states(self, state: Any, trees: list[Any]) -> Any:
    return (state[0]._replace(sum_of_squares=trees[0]), *state[1:])

  def hyper(self, count: jax.Array) -> dict[str, Any]:
    return {"learning_rate": _spec.scalar(self.learning_rate, count), "eps": self.eps}

  def leaf_math(self, k, g, p, states, flags):
    s = _spec.abs_sq(g) + states[0]  # complex leaves: a complex sum whose imaginary part stays 0
    scale = jnp.where(s > 0, 1 / jnp.sqrt(s + k["eps"]), 0)  # the kernels' IEEE reciprocal
    return -k["learning_rate"] * (scale * g), [s]


@_families.family(AdagradSpec, variants={"plain": dict(learning_rate=3e-2, eps=1e-6)})
def adagrad(learning_rate: ScalarOrSchedule, initial_accumulator_value: float = 0.1,
            eps: float = 1e-7, *, moment_bits: Optional[int] = None,
            master_weights: Union[bool, str] = False,
            skip_nonfinite: bool = False, stochastic_rounding: bool = False,
            seed: Optional[int] = None,
            packed: Packing = False) -> optax.GradientTransformationExtraArgs:
  """Adagrad as one fused kernel; same arguments, state and math as ``optax.adagrad``.

  Per element, with lr the learning rate::

    s = g**2 + s                                # s starts at initial_accumulator_value
    u = -lr * (s > 0 ? 1 / sqrt(s + eps) : 0) * g

  (Duchi et al, `Adaptive Subgradient Methods for Online Learning and Stochastic Optimization
  <https://jmlr.org/papers/v12/duchi11a.html>`_, 2011.) The state is optax's: a
  ``ScaleByRssState`` then the learning rate's (a count with a schedule). Complex leaves as
  optax's: ``g**2`` is ``|g|**2``, summed into a complex state whose imaginary part stays 0.

  Args:
    learning_rate: a float, or an optax schedule evaluated on the step count.
    initial_accumulator_value: the starting value of the sum of squares (>= 0).
    eps: added to the sum of squares inside the square root.

  Returns:
    An optax ``GradientTransformationExtraArgs``.
  """
