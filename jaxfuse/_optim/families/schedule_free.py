"""Fused multi-tensor schedule-free AdamW and SGD, optax-compatible.

``schedule_free_adamw`` and ``schedule_free_sgd`` take the arguments of
``optax.contrib.schedule_free_adamw`` / ``schedule_free_sgd`` and compute the same update
(Defazio et al., 2024, "The Road Less Scheduled", https://arxiv.org/abs/2405.15682). The params
are ``y``, where the gradient is taken; the state keeps ``z``, the base optimizer's iterate, and
the base optimizer's state; ``x``, the average to evaluate at, is recomputed from both. Per
element, with ``t`` the base optimizer's count after incrementing::

    nu = (1 - b2) * g**2 + b2 * nu                      # AdamW's base only
    d  = g / (sqrt(nu / (1 - b2**t)) + eps)             # SGD's base: d = g
    d  = -lr * (d + weight_decay * y)
    x  = (y - (1 - b1) * z) / b1
    z  = z + d
    x  = (1 - ck) * x + ck * z
    y  = b1 * x + (1 - b1) * z

The averaging weight ``ck = max_lr**weight_lr_power / weight_sum`` comes from scalars of the
state (the largest learning rate so far and the sum of the weights), advanced in JAX each step
as optax advances them; everything per element is one kernel pass. The state is optax's
``ScheduleFreeState`` (with the opt-ins' ``jaxfuse.ExtraState`` after it), so checkpoints move
between optax and jaxfuse both ways; :func:`schedule_free_eval_params` gives ``x`` for any of
jaxfuse's layouts (packed, split, with a master copy). Leaves are real: float32, bfloat16,
float16 (computed in float32, rounded once) or float64. The optax protocol and
:func:`jaxfuse.fused_step` work as for ``jaxfuse.adamw``, with the same opt-ins.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, Optional, Union

import jax
import jax.numpy as jnp
import numpy as np
import optax
from optax import contrib as _contrib

from jaxfuse._core import packing as _packing
from jaxfuse._core import trees as _trees
from jaxfuse._optim import families as _families
from jaxfuse._optim import spec as _spec
from jaxfuse._optim import state as _state
from jaxfuse._optim.spec import Packing, ScalarOrSchedule


def _schedule_free_state(state: Any) -> _contrib.ScheduleFreeState:
  """The ScheduleFreeState of an optimizer's state, alone or before its ExtraState."""
  return state if isinstance(state, _contrib.ScheduleFreeState) else state[0]


def _replaced(state: Any, **fields: Any) -> Any:
  """`state` (the optax part alone, or as a 1-tuple before an ExtraState) with fields of its
  ScheduleFreeState replaced."""
  if isinstance(state, _contrib.ScheduleFreeState):
    return state._replace(**fields)
  return (state[0]._replace(**fields), *state[1:])


@jax.jit
def _one_minus_power(decay: Any, count: jax.Array) -> jax.Array:
  """``1 - decay**count`` compiled as optax.tree.bias_correction compiles it (its own jit, decay
  an argument): XLA's pow then rounds alike (1 - decay**t cancels, magnifying an ulp of it)."""
  return 1 - decay**count


@dataclasses.dataclass(frozen=True, eq=False, kw_only=True)
class ScheduleFreeSpec(_spec.Spec):
  """A jaxfuse schedule-free optimizer (optim/families/schedule_free.h): what its two families,
  on an AdamW and on an SGD base, share."""

  base: ClassVar[str]  # "adamw" or "sgd"
  params_role = "y, the params the average x is recovered from"
  warmup_steps: Optional[int]
  b1: Any
  b2: Any = 0.0  # AdamW's base only
  eps: Any = 0.0
  weight_decay: Any
  weight_lr_power: Any
  state_dtype: Any

  def __post_init__(self):
    steps = self.warmup_steps
    integer = isinstance(steps, (int, np.integer)) or (
        hasattr(steps, "dtype") and jnp.issubdtype(steps.dtype, jnp.integer))
    if steps is not None and (isinstance(steps, (bool, np.bool_)) or not integer):
      raise TypeError(f"{self.name}: warmup_steps={steps!r}; expected None or an int (static: "
                      "under optax.inject_hyperparams, static_args=('warmup_steps',))")
    if isinstance(self.b1, (int, float)) and not self.b1 > 0:
      raise ValueError(f"{self.name}: b1={self.b1!r}; expected b1 > 0 (x is recovered from y "
                       "and z by dividing by it)")
    if steps is not None and callable(self.learning_rate):
      raise TypeError(f"{self.name}: a learning_rate schedule with warmup_steps={steps!r}; "
                      "warmup_steps builds the schedule from a number (as optax's), so give one "
                      "or the other")
    dtype = self.state_dtype
    if dtype is not None and (jnp.dtype(dtype) not in _trees.KERNEL_DTYPES
                              or _trees.is_complex(dtype)):
      raise ValueError(f"{self.name}: state_dtype {jnp.dtype(dtype).name} is not supported; "
                       "use None or a real float dtype")

  @property
  def name(self) -> str:
    return f"jaxfuse.schedule_free_{self.base}"

  @property
  def adam(self) -> bool:
    return self.base == "adamw"

  @property
  def needs_params(self) -> bool:
    return True  # y is the params

  def learning_rate_schedule(self) -> Any:
    """The learning rate as optax's schedule_free_* build it: with warmup_steps a warmup from 0
    to it, held there (a schedule of the count), else the value itself."""
    if self.warmup_steps is None:
      return self.learning_rate
    return optax.warmup_constant_schedule(0, self.learning_rate, self.warmup_steps)

  def optax_twin(self) -> optax.GradientTransformation:
    if self.adam:
      return _contrib.schedule_free_adamw(self.learning_rate, self.warmup_steps, self.b1,
                                          self.b2, self.eps, self.weight_decay,
                                          self.weight_lr_power, self.state_dtype)
    return _contrib.schedule_free_sgd(self.learning_rate, self.warmup_steps, self.b1,
                                      self.weight_decay, self.weight_lr_power, self.state_dtype)

  def flags(self) -> dict[str, bool]:
    return {"decay": _spec.decays(self.weight_decay)}

  def check_params(self, params: Any) -> None:
    _spec.check_real(self.name, params)
    dtype = self.state_dtype
    if dtype is not None and jnp.finfo(dtype).bits < 32:
      for name, p in zip(_trees.leaf_names(params), jax.tree.leaves(params)):
        if self.master_weights or p.dtype != jnp.dtype(dtype):
          wide = "its float32 master" if self.master_weights else p.dtype.name
          raise ValueError(
              f"{self.name}: state_dtype {jnp.dtype(dtype).name} is narrower than params leaf "
              f"{name} ({wide}): not supported, as the kernels build y from z before z is "
              "rounded to its storage dtype, and x would drift from optax's; use "
              "state_dtype=None (z in the params' dtype) or float32")
    if self.master_weights:
      return  # the state is the float32 master's
    names = {}
    for name, p in zip(_trees.leaf_names(params), jax.tree.leaves(params)):
      if p.dtype in (jnp.bfloat16, jnp.float16):
        names.setdefault(jnp.dtype(p.dtype).name, name)
    if len(names) == 2:
      raise TypeError(
          f"{self.name}: params leaf {names['bfloat16']} is bfloat16 and leaf "
          f"{names['float16']} float16: the state's scalars take the params' lowest dtype (as "
          "optax's), and these two have none; use one 16-bit dtype, or master_weights=True "
          "(the state of the float32 master)")

  def states(self, state: Any) -> list[Any]:
    sf = _schedule_free_state(state)
    return [sf.z, sf.base_optimizer_state[0].nu] if self.adam else [sf.z]

  def state_signs(self) -> list[bool]:
    return [True, False] if self.adam else [True]

  def with_states(self, state: Any, trees: list[Any]) -> Any:
    if not self.adam:
      return _replaced(state, z=trees[0])
    base = _schedule_free_state(state).base_optimizer_state
    return _replaced(state, z=trees[0],
                     base_optimizer_state=(base[0]._replace(nu=trees[1]), *base[1:]))

  def hyper(self, count: jax.Array) -> dict[str, Any]:
    wd = self.weight_decay if _spec.decays(self.weight_decay) else 0.0
    values = dict(learning_rate=self.learning_rate_schedule(), b1=self.b1,
                  one_minus_b1=_spec.one_minus(self.b1), b2=self.b2,
                  one_minus_b2=_spec.one_minus(self.b2), eps=self.eps, weight_decay=wd)
    return {k: _spec.scalar(v, count) for k, v in values.items()}

  def xla_hyper(self, count: jax.Array) -> dict[str, Any]:
    h = self.hyper(count)
    # optax's bias correction, in JAX's default float type (1: dividing by it is exact).
    h["bc"] = _one_minus_power(h["b2"], optax.safe_increment(count)) if self.adam else 1.0
    return h

  def _averaging(self, sf: _contrib.ScheduleFreeState) -> tuple[Any, Any, Any]:
    """(ck, max_lr, weight_sum) of this step from the state's scalars, in optax's operations,
    computed in float32 or wider (optax computes them in the state's dtype, 16-bit for a tree
    with a 16-bit leaf): like every other value of the step, they are rounded once, where they
    are stored."""
    wide = jnp.promote_types(sf.max_lr.dtype, jnp.float32)
    lr = self.learning_rate_schedule()
    if callable(lr):
      lr = jnp.asarray(lr(sf.step_count), dtype=wide)
    max_lr = jnp.maximum(sf.max_lr.astype(wide), lr)
    weight = max_lr ** self.weight_lr_power
    total = sf.weight_sum.astype(wide) + weight
    ck = jnp.where(jnp.isnan(weight) | jnp.isnan(total), jnp.full(weight.shape, jnp.nan),
                   jnp.nan_to_num(weight / total, nan=0.0, posinf=jnp.inf))
    return ck, max_lr, total

  def step_count(self, state: Any) -> jax.Array:
    # The steps taken, from the state's own counter (it starts at 1): the base optimizer's
    # count where it keeps one (they advance together), and SGD's base keeps none.
    return _schedule_free_state(state).step_count - 1

  def state_hyper(self, state: Any) -> dict[str, Any]:
    ck, _, _ = self._averaging(_schedule_free_state(state))
    return {"ck": ck, "one_minus_ck": 1.0 - ck}

  def advance(self, core: Any, skip: jax.Array) -> Any:
    sf = _schedule_free_state(core)
    _, max_lr, total = self._averaging(sf)
    keep = lambda old, new: jnp.where(skip, old, jnp.asarray(new).astype(old.dtype))
    return _replaced(core, weight_sum=keep(sf.weight_sum, total),
                     max_lr=keep(sf.max_lr, max_lr),
                     step_count=keep(sf.step_count, optax.safe_increment(sf.step_count)))

  def leaf_math(self, k, g, p, states, flags):
    z = states[0]
    d, new_states = g, []
    if self.adam:
      nu = k["one_minus_b2"] * _spec.abs_sq(g) + k["b2"] * states[1]
      d = (1 / (jnp.sqrt(nu / k["bc"]) + k["eps"])) * g
      new_states = [nu]
    if _spec.decays(self.weight_decay):
      d = d + k["weight_decay"] * p
    new_z = z + d * -k["learning_rate"]
    x = (p - k["one_minus_b1"] * z) / k["b1"]
    x = k["one_minus_ck"] * x + k["ck"] * new_z
    return (k["b1"] * x + k["one_minus_b1"] * new_z) - p, [new_z, *new_states]


@dataclasses.dataclass(frozen=True, eq=False, kw_only=True)
class ScheduleFreeAdamwSpec(ScheduleFreeSpec):
  op = "jaxfuse_schedule_free_adamw"
  base = "adamw"


@dataclasses.dataclass(frozen=True, eq=False, kw_only=True)
class ScheduleFreeSgdSpec(ScheduleFreeSpec):
  op = "jaxfuse_schedule_free_sgd"
  base = "sgd"


def schedule_free_eval_params(state: Any, params: Any) -> Any:
  """The params to evaluate at, ``x = (y - (1 - b1) z) / b1`` (optax.contrib's
  ``schedule_free_eval_params``), for the state of a jaxfuse schedule-free optimizer, alone or
  inside a chain, in any of its layouts: packed or split ``z``, and with master weights the
  master copy as ``y``. Returned in the params' dtypes (and packed where they are)."""
  found = [x for x in jax.tree.leaves(state, is_leaf=lambda x: isinstance(
      x, _contrib.ScheduleFreeState)) if isinstance(x, _contrib.ScheduleFreeState)]
  if len(found) != 1:
    raise ValueError(f"jaxfuse.schedule_free_eval_params: the state holds {len(found)} "
                     "schedule-free states; expected one (of jaxfuse.schedule_free_adamw or "
                     "schedule_free_sgd, or optax's)")
  sf = found[0]
  packed_params = _packing.is_packed(params)
  y = _state.master_params(params, state)
  z = _packing.unpack(sf.z)
  plain = _packing.unpack(params)
  x = jax.tree.map(lambda yi, zi, p: ((yi - (1.0 - sf.b1) * zi) / sf.b1).astype(p.dtype),
                   y, z, plain)
  return _packing.pack(x) if packed_params else x


@_families.family(ScheduleFreeAdamwSpec, variants={
    "decay": dict(learning_rate=1e-2, weight_decay=0.05),
})
def schedule_free_adamw(learning_rate: ScalarOrSchedule = 0.0025,
                        warmup_steps: Optional[int] = None, b1: float = 0.9, b2: float = 0.999,
                        eps: float = 1e-8, weight_decay: ScalarOrSchedule = 0.0,
                        weight_lr_power: float = 2.0,
                        state_dtype: Optional[Any] = None, *,
                        master_weights: Union[bool, str] = False, skip_nonfinite: bool = False,
                        stochastic_rounding: bool = False, seed: Optional[int] = None,
                        packed: Packing = False) -> optax.GradientTransformationExtraArgs:
  r"""Schedule-free AdamW (Defazio et al., 2024) as one fused kernel; same arguments, state and
  math as ``optax.contrib.schedule_free_adamw``.

  With :math:`\gamma_t` the learning rate (after warmup), :math:`\lambda` the weight decay and
  :math:`c_t` the averaging weight, at step :math:`t`, the params being :math:`y_t`:

  .. math::

    \nu_t &\leftarrow \beta_2 \nu_{t-1} + (1 - \beta_2) g_t^2 \\
    z_{t+1} &\leftarrow z_t - \gamma_t \left(g_t / (\sqrt{\nu_t / (1 - \beta_2^t)} + \epsilon)
      + \lambda y_t\right) \\
    x_{t+1} &\leftarrow (1 - c_{t+1}) x_t + c_{t+1} z_{t+1}, \quad
    c_{t+1} = \frac{\max_{s \le t} \gamma_s^{p}}{\sum_{s \le t} \max_{r \le s} \gamma_r^{p}} \\
    y_{t+1} &\leftarrow \beta_1 x_{t+1} + (1 - \beta_1) z_{t+1}

  Evaluate at :math:`x` (:func:`jaxfuse.schedule_free_eval_params`).

  Args:
    learning_rate: the learning rate, a float (with warmup_steps, the peak of the warmup) or,
      without warmup_steps, an optax schedule of the step count.
    warmup_steps: steps of linear warmup from 0 (None: none).
    b1: interpolation between the average x and the iterate z, where the gradient is taken
      (b1 > 0).
    b2: decay rate of the second moment.
    eps: added to the second moment's square root.
    weight_decay: decoupled weight decay (a float or a schedule), applied at y, scaled by the
      learning rate.
    weight_lr_power: the averaging weight of a step is its largest learning rate so far to this
      power.
    state_dtype: storage dtype of z (None: the params').

  Returns:
    An optax ``GradientTransformationExtraArgs``.

  References:
    Defazio et al, `The Road Less Scheduled <https://arxiv.org/abs/2405.15682>`_, 2024
  """


@_families.family(ScheduleFreeSgdSpec, variants={
    "decay": dict(learning_rate=0.1, weight_decay=0.01),
})
def schedule_free_sgd(learning_rate: ScalarOrSchedule = 1.0, warmup_steps: Optional[int] = None,
                      b1: float = 0.9, weight_decay: Optional[ScalarOrSchedule] = None,
                      weight_lr_power: float = 2.0, state_dtype: Optional[Any] = None, *,
                      master_weights: Union[bool, str] = False, skip_nonfinite: bool = False,
                      stochastic_rounding: bool = False, seed: Optional[int] = None,
                      packed: Packing = False) -> optax.GradientTransformationExtraArgs:
  r"""Schedule-free SGD (Defazio et al., 2024) as one fused kernel; same arguments, state and
  math as ``optax.contrib.schedule_free_sgd``: :func:`schedule_free_adamw` with the base step
  :math:`z_{t+1} \leftarrow z_t - \gamma_t (g_t + \lambda y_t)`.

  Args:
    learning_rate: the learning rate, a float (with warmup_steps, the peak of the warmup) or,
      without warmup_steps, an optax schedule of the step count.
    warmup_steps: steps of linear warmup from 0 (None: none).
    b1: interpolation between the average x and the iterate z, where the gradient is taken
      (b1 > 0).
    weight_decay: weight decay (a float or a schedule) added to the gradient at y (None: none).
    weight_lr_power: the averaging weight of a step is its largest learning rate so far to this
      power.
    state_dtype: storage dtype of z (None: the params').

  Returns:
    An optax ``GradientTransformationExtraArgs``.

  References:
    Defazio et al, `The Road Less Scheduled <https://arxiv.org/abs/2405.15682>`_, 2024
  """
