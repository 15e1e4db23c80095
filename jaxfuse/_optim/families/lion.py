"""Fused multi-tensor Lion, optax-compatible.

``lion`` takes the arguments of ``optax.lion`` and computes the same update. Per element
(Chen et al., 2023, "Symbolic Discovery of Optimization Algorithms",
https://arxiv.org/abs/2302.06675)::

    u  = sign((1 - b1) * g + b1 * mu)               # sign(+-0) = +-0, sign(NaN) = NaN
    mu = (1 - b2) * g + b2 * mu
    u  = -lr * (u + weight_decay * p)               # weight decay where the mask says

The state is optax's (``ScaleByLionState(count, mu)`` then the weight-decay and learning-rate
states), so checkpoints move between ``optax.lion`` and ``jaxfuse.lion`` both ways. Leaves are
real: float32, bfloat16, float16 (computed in float32, rounded once) or float64. The optax
protocol and :func:`jaxfuse.fused_step` work as for ``jaxfuse.adamw`` (see
``jaxfuse/_optim/families/adam.py``), with the same opt-in ``master_weights`` and
``skip_nonfinite``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional, Union

import jax
import jax.numpy as jnp
import optax

from jaxfuse._core import trees as _trees
from jaxfuse._optim import families as _families
from jaxfuse._optim import spec as _spec
from jaxfuse._optim.spec import Packing, ScalarOrSchedule


def check_moment_dtype(dtype: Any) -> None:
  """Raises unless `dtype` (a moment's storage dtype) is None or a real kernel dtype."""
  if dtype is None:
    return
  if jnp.dtype(dtype) not in _trees.KERNEL_DTYPES or _trees.is_complex(dtype):
    raise ValueError(f"jaxfuse: mu_dtype {jnp.dtype(dtype).name} is not supported; use None or a "
                     "real float dtype")


@dataclasses.dataclass(frozen=True, eq=False, kw_only=True)
class LionSpec(_spec.Spec):
  """A jaxfuse Lion: the Lion family of the generic optimizer (optim/families/lion.h)."""

  op = "jaxfuse_lion"
  name = "jaxfuse.lion"
  b1: Any
  b2: Any
  mu_dtype: Any
  weight_decay: ScalarOrSchedule
  mask: Any

  def __post_init__(self):
    check_moment_dtype(self.mu_dtype)

  @property
  def needs_params(self) -> bool:
    return True  # optax's add_decayed_weights asks for params even with no decay

  def optax_twin(self) -> optax.GradientTransformation:
    return optax.lion(self.learning_rate, self.b1, self.b2, self.mu_dtype, self.weight_decay,
                      self.mask)

  def tensor_flags(self, params: Any) -> list[dict[str, bool]]:
    return _spec.decay_flags(self.weight_decay, self.mask, params)

  def check_params(self, params: Any) -> None:
    _spec.check_real(self.name, params)

  def states(self, state: Any) -> list[Any]:
    return [state[0].mu]

  def state_signs(self) -> list[bool]:
    return [True]

  def with_states(self, state: Any, trees: list[Any]) -> Any:
    return (state[0]._replace(mu=trees[0]), *state[1:])

  def hyper(self, count: jax.Array) -> dict[str, Any]:
    wd = self.weight_decay if _spec.decays(self.weight_decay) else 0.0
    values = dict(learning_rate=self.learning_rate, b1=self.b1,
                  one_minus_b1=_spec.one_minus(self.b1), b2=self.b2,
                  one_minus_b2=_spec.one_minus(self.b2), weight_decay=wd)
    return {k: _spec.scalar(v, count) for k, v in values.items()}

  def leaf_math(self, k, g, p, states, flags):
    (m,) = states
    u = jnp.sign(k["one_minus_b1"] * g + k["b1"] * m)
    new_m = k["one_minus_b2"] * g + k["b2"] * m
    if flags["decay"]:
      u = u + k["weight_decay"] * p
    return u * -k["learning_rate"], [new_m]


@_families.family(LionSpec, variants={
    "masked decay": dict(learning_rate=3e-3, weight_decay=0.1, mask=_families.some_leaves),
})
def lion(learning_rate: ScalarOrSchedule, b1: float = 0.9, b2: float = 0.99,
         mu_dtype: Optional[Any] = None, weight_decay: ScalarOrSchedule = 1e-3,
         mask: Any = None, *, moment_bits: Optional[int] = None,
         master_weights: Union[bool, str] = False,
         skip_nonfinite: bool = False, stochastic_rounding: bool = False,
         seed: Optional[int] = None,
         packed: Packing = False) -> optax.GradientTransformationExtraArgs:
  r"""Lion (Chen et al., 2023) as one fused kernel; same arguments and math as ``optax.lion``.

  With :math:`\alpha_t` the learning rate, :math:`\lambda` the weight decay and
  :math:`\theta_t` the params, at step :math:`t`:

  .. math::

    c_t &\leftarrow \beta_1 m_{t-1} + (1 - \beta_1) g_t \\
    u_t &\leftarrow -\alpha_t (\mathrm{sign}(c_t) + \lambda \theta_t) \\
    m_t &\leftarrow \beta_2 m_{t-1} + (1 - \beta_2) g_t

  Args:
    learning_rate: a float, or an optax schedule evaluated on the step count.
    b1: rate combining the momentum and the current gradient into the update's sign.
    b2: decay rate of the momentum.
    mu_dtype: storage dtype of the momentum (None: the params' dtype, as optax).
    weight_decay: decoupled weight decay rate (a float or a schedule).
    mask: pytree of bools (a prefix of params) or a callable returning one: True where weight
      decay applies. Must be static.

  Returns:
    An optax ``GradientTransformationExtraArgs``.

  References:
    Chen et al, `Symbolic Discovery of Optimization Algorithms
    <https://arxiv.org/abs/2302.06675>`_, 2023
  """
