"""Fused multi-tensor RMSprop, optax-compatible.

``rmsprop`` takes the arguments of ``optax.rmsprop`` and computes the same update: optax's chain
``scale_by_rms`` (or ``scale_by_stddev`` when centered) -> ``scale_by_learning_rate`` ->
``trace`` (the momentum comes after the learning rate). Per element, with ``t`` the step count
after incrementing (Tieleman & Hinton, 2012; centered: Graves, 2013,
https://arxiv.org/abs/1308.0850)::

    nu = (1 - decay) * g**2 + decay * nu
    mu = (1 - decay) * g + decay * mu                # centered only
    nu_hat, mu_hat = nu / bc, mu / bc                # bc = 1 - decay**t with bias_correction
    var = nu_hat - mu_hat**2                         # centered; else nu_hat
    u = -lr * g / sqrt(var + eps)                    # eps_in_sqrt=False: / (sqrt(var) + eps)
    trace = u + momentum * trace                     # with momentum only
    u = u + momentum * trace if nesterov else trace

The state is optax's (``[mu,] nu``, a count with bias correction, the learning rate's and the
trace's states), so checkpoints move between ``optax.rmsprop`` and ``jaxfuse.rmsprop`` both ways.
Leaves are float32, bfloat16, float16 (computed in float32, rounded once), float64, complex64 or
complex128 (optax's complex RMSprop: ``g**2`` and ``mu_hat**2`` are squared magnitudes). The
reciprocal square root is computed as 1 / sqrt, correctly rounded, by the kernels and the optax
protocol alike. The optax protocol and :func:`jaxfuse.fused_step` work as for ``jaxfuse.adamw``
(see ``jaxfuse/_optim/families/adam.py``), with the same opt-in ``master_weights`` and
``skip_nonfinite``.
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
class RmspropSpec(_spec.Spec):
  """A jaxfuse RMSprop: the RMSprop family of the generic optimizer (optim/families/rmsprop.h)."""

  op = "jaxfuse_rmsprop"
  name = "jaxfuse.rmsprop"
  decay: Any
  eps: Any
  initial_scale: Any
  eps_in_sqrt: bool
  centered: bool
  momentum: Any  # None: no trace
  nesterov: bool
  bias_correction: bool

  def optax_twin(self) -> optax.GradientTransformation:
    return optax.rmsprop(self.learning_rate, self.decay, self.eps, self.initial_scale,
                         self.eps_in_sqrt, self.centered, self.momentum, self.nesterov,
                         self.bias_correction)

  def flags(self) -> dict[str, bool]:
    has_momentum = self.momentum is not None
    return {"centered": self.centered, "momentum": has_momentum,
            "nesterov": has_momentum and self.nesterov, "eps_in_sqrt": self.eps_in_sqrt,
            "bias_correction": self.bias_correction}

  def states(self, state: Any) -> list[Any]:
    trees = [state[0].mu] if self.centered else []
    trees.append(state[0].nu)
    if self.momentum is not None:
      trees.append(state[2].trace)
    return trees

  def state_signs(self) -> list[bool]:
    # mu (centered) takes both signs, nu none, the momentum trace both
    return [True] * self.centered + [False] + [True] * (self.momentum is not None)

  def with_states(self, state: Any, trees: list[Any]) -> Any:
    trees = list(trees)
    rms = state[0]._replace(mu=trees.pop(0)) if self.centered else state[0]
    rms = rms._replace(nu=trees.pop(0))
    trace = state[2]._replace(trace=trees.pop(0)) if self.momentum is not None else state[2]
    return (rms, state[1], trace, *state[3:])

  def hyper(self, count: jax.Array) -> dict[str, Any]:
    values = dict(learning_rate=self.learning_rate, decay=self.decay,
                  one_minus_decay=_spec.one_minus(self.decay), eps=self.eps,
                  momentum=0.0 if self.momentum is None else self.momentum)
    return {k: _spec.scalar(v, count) for k, v in values.items()}

  def xla_hyper(self, count: jax.Array) -> dict[str, Any]:
    h = self.hyper(count)
    # optax's bias correction, in JAX's default float type (1: dividing by it is exact).
    h["bc"] = 1 - h["decay"] ** optax.safe_increment(count) if self.bias_correction else 1.0
    return h

  def leaf_math(self, k, g, p, states, flags):
    states = list(states)
    mu = states.pop(0) if self.centered else None
    nu = states.pop(0)
    new_nu = k["one_minus_decay"] * _spec.abs_sq(g) + k["decay"] * nu
    var = new_nu / k["bc"]
    new_states = [new_nu]
    if self.centered:
      new_mu = k["one_minus_decay"] * g + k["decay"] * mu
      mu_hat = new_mu / k["bc"]
      var = var - _spec.abs_sq(mu_hat)
      new_states.insert(0, new_mu)
    if self.eps_in_sqrt:
      scaling = 1 / jnp.sqrt(var + k["eps"])
    else:
      scaling = 1 / (jnp.sqrt(var) + k["eps"])
    u = (scaling * g) * -k["learning_rate"]
    if self.momentum is not None:
      trace = u + k["momentum"] * states.pop(0)
      u = u + k["momentum"] * trace if self.nesterov else trace
      new_states.append(trace)
    return u, new_states


@_families.family(RmspropSpec, variants={
    "plain": dict(learning_rate=3e-3),
    "centered": dict(learning_rate=3e-3, centered=True),
    "nesterov, bias-corrected": dict(learning_rate=3e-3, momentum=0.9, nesterov=True,
                                      bias_correction=True),
    "centered momentum, eps outside the root": dict(learning_rate=3e-3, centered=True,
                                                     momentum=0.9, eps_in_sqrt=False),
})
def rmsprop(learning_rate: ScalarOrSchedule, decay: float = 0.9, eps: float = 1e-8,
            initial_scale: float = 0.0, eps_in_sqrt: bool = True, centered: bool = False,
            momentum: Optional[float] = None, nesterov: bool = False,
            bias_correction: bool = False, *, moment_bits: Optional[int] = None,
            master_weights: Union[bool, str] = False,
            skip_nonfinite: bool = False, stochastic_rounding: bool = False,
            seed: Optional[int] = None,
            packed: Packing = False) -> optax.GradientTransformationExtraArgs:
  r"""RMSprop as one fused kernel; same arguments and math as ``optax.rmsprop``.

  With :math:`\alpha_t` the learning rate, :math:`\rho` the decay, :math:`\epsilon` the eps and
  :math:`\beta` the momentum, at step :math:`t` (centered: the variance estimate subtracts the
  squared mean :math:`\mu_t`; bias correction divides :math:`\nu_t, \mu_t` by
  :math:`1 - \rho^t`):

  .. math::

    \nu_t &\leftarrow \rho \nu_{t-1} + (1 - \rho) g_t^2 \\
    \mu_t &\leftarrow \rho \mu_{t-1} + (1 - \rho) g_t \\
    u_t &\leftarrow -\alpha_t g_t / \sqrt{\nu_t - \mu_t^2 + \epsilon} \\
    m_t &\leftarrow u_t + \beta m_{t-1}, \quad
    u_t \leftarrow m_t \; (\text{nesterov: } u_t + \beta m_t)

  Args:
    learning_rate: a float, or an optax schedule evaluated on the step count.
    decay: decay rate of the moving averages of the squared gradient (and of the gradient).
    eps: added inside the square root (``eps_in_sqrt``) or to it.
    initial_scale: initial value of the squared-gradient average.
    eps_in_sqrt: whether eps goes inside the square root.
    centered: subtract the squared mean gradient (Graves, 2013).
    momentum: decay of the trace of the updates (after the learning rate); None: no trace.
    nesterov: Nesterov momentum (with ``momentum`` only).
    bias_correction: divide the averages by ``1 - decay**t``.

  Returns:
    An optax ``GradientTransformationExtraArgs``.

  References:
    Hinton, `Overview of mini-batch gradient descent
    <www.cs.toronto.edu/~tijmen/csc321/slides/lecture_slides_lec6.pdf>`_, 2012;
    Graves, `Generating Sequences With Recurrent Neural Networks
    <https://arxiv.org/abs/1308.0850>`_, 2013
  """
