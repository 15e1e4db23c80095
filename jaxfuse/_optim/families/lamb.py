"""Fused multi-tensor LAMB, optax-compatible.

``lamb`` takes the arguments of ``optax.lamb`` and computes the same update (You et al., 2019,
"Large Batch Optimization for Deep Learning: Training BERT in 76 minutes",
https://arxiv.org/abs/1904.00962). Per leaf, with ``t`` the step count after incrementing::

    mu = (1 - b1) * g + b1 * mu
    nu = (1 - b2) * g**2 + b2 * nu
    d  = (mu / (1 - b1**t)) / (sqrt(nu / (1 - b2**t) + eps_root) + eps) + weight_decay * p
    r  = ||p|| / ||d||                 # 1 where either norm is 0
    u  = -lr * (r * d)

The state is optax's, so checkpoints move between ``optax.lamb`` and ``jaxfuse.lamb`` both ways.
Leaves are float32, bfloat16, float16 (computed in float32, rounded once), float64, complex64 or
complex128 (Adam's complex moments; the norms are of ``|x|``).

Under :func:`jaxfuse.fused_step` a step is two passes over the leaves: the trust-sums op sums each
leaf's squares of params and of ``d`` (in float64, deterministic; over the devices that split a
leaf, one small all-reduce), then the optimizer op recomputes ``d`` and applies each leaf's
ratio in place: 16 + 28 bytes per fp32 param. Through the optax protocol the math is XLA
operations, the norms summed in the leaf's compute type as optax sums them.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional, Union

import optax

from jaxfuse._optim import families as _families
from jaxfuse._optim import spec as _spec
from jaxfuse._optim.families import adam as _adam
from jaxfuse._optim.spec import Packing, ScalarOrSchedule


@dataclasses.dataclass(frozen=True, eq=False, kw_only=True)
class LambSpec(_adam.AdamSpec):
  """A jaxfuse LAMB: the LAMB family of the generic optimizer (optim/families/lamb.h), Adam's
  state and hyperparameters."""

  op = "jaxfuse_lamb"

  @property
  def name(self) -> str:
    return "jaxfuse.lamb"

  @property
  def needs_params(self) -> bool:
    return True  # the trust ratio is ||p|| / ||d||

  def optax_twin(self) -> optax.GradientTransformation:
    return optax.lamb(self.learning_rate, self.b1, self.b2, self.eps, self.eps_root,
                      self.weight_decay, self.mask)

  def flags(self) -> dict[str, bool]:
    return {}

  def leaf_math(self, k, g, p, states, flags):
    d, new_states = _adam.scaled_moment(k, g, p, states, flags["decay"], nesterov=False)
    return (d * _spec.trust_ratio(p, d)) * -k["learning_rate"], new_states


@_families.family(LambSpec, mu_dtype=None, nesterov=False, variants={
    "masked decay": dict(learning_rate=3e-3, weight_decay=0.1, mask=_families.some_leaves),
})
def lamb(learning_rate: ScalarOrSchedule, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-6,
         eps_root: float = 0.0, weight_decay: ScalarOrSchedule = 0.0, mask: Any = None, *,
         nu_dtype: Any = None, master_weights: Union[bool, str] = False,
         skip_nonfinite: bool = False, stochastic_rounding: bool = False,
         seed: Optional[int] = None,
         packed: Packing = False) -> optax.GradientTransformationExtraArgs:
  r"""LAMB (You et al., 2019) fused; same arguments and math as ``optax.lamb``.

  With :math:`\hat m_t, \hat v_t` Adam's bias-corrected moments, :math:`\lambda` the weight
  decay and :math:`\theta_t` the params of one leaf:

  .. math::

    d_t &\leftarrow \hat m_t / (\sqrt{\hat v_t + \epsilon_{root}} + \epsilon) + \lambda \theta_t \\
    u_t &\leftarrow -\alpha_t \frac{\lVert\theta_t\rVert}{\lVert d_t\rVert} d_t

  Args:
    learning_rate: a float, or an optax schedule evaluated on the step count.
    b1, b2: decay rates of the first and second moment estimates.
    eps, eps_root: added to the denominator outside / inside the square root.
    weight_decay: weight decay rate (a float or a schedule), added to the direction before the
      trust ratio.
    mask: pytree of bools (a prefix of params) or a callable returning one: True where weight
      decay applies. Must be static.
    nu_dtype: storage dtype of the second moment (None: the params' dtype, as optax); the math
      stays in float32 and the stored value is rounded once.

  Returns:
    An optax ``GradientTransformationExtraArgs``.

  References:
    You et al, `Large Batch Optimization for Deep Learning: Training BERT in 76 minutes
    <https://arxiv.org/abs/1904.00962>`_, 2019
  """
