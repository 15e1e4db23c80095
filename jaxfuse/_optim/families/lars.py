"""Fused multi-tensor LARS, optax-compatible.

``lars`` takes the arguments of ``optax.lars`` and computes the same update (You et al., 2017,
"Large Batch Training of Convolutional Networks", https://arxiv.org/abs/1708.03888). Per leaf::

    d     = g + weight_decay * p                        # where weight_decay_mask says
    r     = trust_coefficient * ||p|| / (||d|| + eps)   # where trust_ratio_mask says, else 1;
                                                        # 1 where either norm is 0
    x     = -lr * (r * d)
    trace = x + momentum * trace
    u     = x + momentum * trace if nesterov else trace

The state is optax's (its momentum ``TraceState`` last), so checkpoints move between
``optax.lars`` and ``jaxfuse.lars`` both ways. Leaves are float32, bfloat16, float16 (computed
in float32, rounded once), float64, complex64 or complex128 (the norms are of ``|x|``). Under
:func:`jaxfuse.fused_step` a step is two passes, as ``jaxfuse.lamb``'s (see
``jaxfuse/_optim/families/lamb.py``), the first reading only grads and params: 8 + 20 bytes per
fp32 param.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional, Union

import jax
import optax

from jaxfuse._core import trees as _trees
from jaxfuse._optim import families as _families
from jaxfuse._optim import spec as _spec
from jaxfuse._optim.spec import Packing, ScalarOrSchedule


@dataclasses.dataclass(frozen=True, eq=False, kw_only=True)
class LarsSpec(_spec.Spec):
  """A jaxfuse LARS: the LARS family of the generic optimizer (optim/families/lars.h)."""

  op = "jaxfuse_lars"
  name = "jaxfuse.lars"
  weight_decay: ScalarOrSchedule
  weight_decay_mask: Any
  trust_coefficient: Any
  eps: Any
  trust_ratio_mask: Any
  momentum: Any
  nesterov: bool

  @property
  def needs_params(self) -> bool:
    return True  # the trust ratio reads the params

  def optax_twin(self) -> optax.GradientTransformation:
    return optax.lars(self.learning_rate, self.weight_decay, self.weight_decay_mask,
                      self.trust_coefficient, self.eps, self.trust_ratio_mask, self.momentum,
                      self.nesterov)

  def flags(self) -> dict[str, bool]:
    return {"nesterov": self.nesterov}

  def tensor_flags(self, params: Any) -> list[dict[str, bool]]:
    decay = _spec.decay_flags(self.weight_decay, self.weight_decay_mask, params)
    trust = _trees.static_bool_mask(self.trust_ratio_mask, params)
    return [{"decay": d["decay"], "trust": t} for d, t in zip(decay, trust)]

  # optax.lars's state: add_decayed_weights', the masked trust ratio's, the learning rate's,
  # then trace's TraceState (and jaxfuse's ExtraState after it when one is on).
  def states(self, state: Any) -> list[Any]:
    return [state[3].trace]

  def with_states(self, state: Any, trees: list[Any]) -> Any:
    return (*state[:3], state[3]._replace(trace=trees[0]), *state[4:])

  def hyper(self, count: jax.Array) -> dict[str, Any]:
    wd = self.weight_decay if _spec.decays(self.weight_decay) else 0.0
    values = dict(learning_rate=self.learning_rate, weight_decay=wd,
                  trust_coefficient=self.trust_coefficient, eps=self.eps, momentum=self.momentum)
    return {k: _spec.scalar(v, count) for k, v in values.items()}

  def leaf_math(self, k, g, p, states, flags):
    (trace,) = states
    d = g + k["weight_decay"] * p if flags["decay"] else g
    if flags["trust"]:
      d = d * _spec.trust_ratio(p, d, k["trust_coefficient"], k["eps"])
    x = -k["learning_rate"] * d
    new_trace = x + k["momentum"] * trace
    return (x + k["momentum"] * new_trace if self.nesterov else new_trace), [new_trace]


@_families.family(LarsSpec, variants={
    "decay, ratio mask": dict(learning_rate=0.1, weight_decay=0.01,
                              trust_ratio_mask=_families.some_leaves),
    "nesterov": dict(learning_rate=0.1, weight_decay=0.01, nesterov=True),
})
def lars(learning_rate: ScalarOrSchedule, weight_decay: ScalarOrSchedule = 0.0,
         weight_decay_mask: Any = True, trust_coefficient: float = 0.001, eps: float = 0.0,
         trust_ratio_mask: Any = True, momentum: float = 0.9, nesterov: bool = False, *,
         master_weights: Union[bool, str] = False,
         skip_nonfinite: bool = False, stochastic_rounding: bool = False,
         seed: Optional[int] = None,
         packed: Packing = False) -> optax.GradientTransformationExtraArgs:
  r"""LARS (You et al., 2017) fused; same arguments and math as ``optax.lars``.

  With :math:`\lambda` the weight decay, :math:`\eta` the trust coefficient and :math:`\theta_t`
  the params of one leaf:

  .. math::

    d_t &\leftarrow g_t + \lambda \theta_t \\
    x_t &\leftarrow -\alpha_t \frac{\eta \lVert\theta_t\rVert}{\lVert d_t\rVert + \epsilon} d_t \\
    m_t &\leftarrow x_t + \mu m_{t-1}, \quad u_t \leftarrow m_t
      \; (\text{Nesterov: } x_t + \mu m_t)

  Args:
    learning_rate: a float, or an optax schedule evaluated on the step count.
    weight_decay: weight decay rate (a float or a schedule), added before the trust ratio.
    weight_decay_mask: bool, pytree of bools (a prefix of params) or a callable returning one:
      where weight decay applies. Must be static.
    trust_coefficient: the trust ratio's multiplier.
    eps: added to the update norm in the ratio's denominator.
    trust_ratio_mask: like ``weight_decay_mask``: where the trust ratio applies.
    momentum: decay rate of the momentum (``optax.trace``).
    nesterov: use Nesterov momentum.

  Returns:
    An optax ``GradientTransformationExtraArgs``.

  References:
    You et al, `Large Batch Training of Convolutional Networks
    <https://arxiv.org/abs/1708.03888>`_, 2017
  """
