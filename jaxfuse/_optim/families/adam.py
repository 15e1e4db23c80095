"""Fused multi-tensor Adam / AdamW, optax-compatible.

``jaxfuse.adam`` and ``jaxfuse.adamw`` take the arguments of ``optax.adam`` / ``optax.adamw`` and
compute the same update. Per element, with ``t`` the step count after incrementing (Kingma & Ba,
2015, https://arxiv.org/abs/1412.6980; Loshchilov & Hutter, 2019,
https://arxiv.org/abs/1711.05101)::

    mu = (1 - b1) * g + b1 * mu
    nu = (1 - b2) * g**2 + b2 * nu
    mu_hat = mu / (1 - b1**t)                       # nesterov: b1 * mu / (1 - b1**(t+1))
                                                    #           + (1 - b1) * g / (1 - b1**t)
    nu_hat = nu / (1 - b2**t)
    u = -lr * (mu_hat / (sqrt(nu_hat + eps_root) + eps) + weight_decay * p)   # wd: AdamW only

The state has the structure, shapes and dtypes of optax's own state for the same arguments, so
checkpoints move between ``optax.adamw`` and ``jaxfuse.adamw``. The learning rate (a float or an
optax schedule evaluated on the count), every other hyperparameter and the count reach the
kernel as device scalars: no recompiles, no host round trips, and the transforms work under
``optax.inject_hyperparams``, ``optax.MultiSteps``, ``optax.apply_if_finite`` and ``lax.cond``.

Leaves may be float32, bfloat16, float16, float64 (math in float64) or complex64/complex128
(optax's complex Adam: ``nu`` from ``|g|**2``), as JAX arrays, NumPy arrays or Python scalars,
mixed freely in one tree. 16-bit leaves are computed in float32 and rounded once (optax
computes in the 16-bit type: jaxfuse's step is the more accurate one).

Opt-in extensions (they append a :class:`jaxfuse.ExtraState` to the state):

* ``master_weights=True``: low-precision (bf16/fp16) params keep an fp32 master copy in the
  state; moments are fp32 (or ``mu_dtype``). The math runs on the master copy; params are its
  rounding. Updates have the grads' dtype (optax's rule) and step the params exactly onto that
  rounding.
* ``moment_bits=8``: the moments of leaves of at least 4096 elements, a multiple of 128, are
  kept block-wise in 8 bits (:class:`jaxfuse.QuantizedMoment` leaves in the
  optax state's ``mu`` and ``nu``; csrc/optim/moment_codes.h says the formats),
  dequantized, updated in float32 and requantized in the same pass.
* ``skip_nonfinite=True``: a step whose gradients hold a NaN or Inf leaves params, moments and
  the count untouched and adds one to ``skipped_steps`` (like ``optax.apply_if_finite``, decided
  on device by the global-norm kernel).

Two ways to apply it:

* the optax protocol, ``updates, state = tx.update(grads, state, params)`` then
  ``optax.apply_updates``: the element math (the kernels', optim/families/adam.h, in the same
  operation order) as XLA operations, which XLA fuses with ``apply_updates``'s add into one pass that reads
  and writes each buffer once, as optax's own step does (a kernel there would have to write the
  updates out for XLA to read back);
* :func:`jaxfuse.fused_step` (and the framework helpers in ``jaxfuse.flax``): the generic
  optimizer's kernels (``jaxfuse/_optim/kernel_path.py``), which update params and moments in
  place, 28 bytes per fp32 parameter, the minimum, under ``jax.jit(..., donate_argnums=...)``.
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
from jaxfuse._optim.spec import ExtraState, Packing, ScalarOrSchedule

AdamExtraState = ExtraState  # the name this state had before the other families came


@dataclasses.dataclass(frozen=True, eq=False, kw_only=True)
class AdamSpec(_spec.Spec):
  """A jaxfuse Adam: the Adam family of the generic optimizer (optim/families/adam.h)."""

  op = "jaxfuse_adam"
  b1: Any
  b2: Any
  eps: Any
  eps_root: Any
  mu_dtype: Any
  nu_dtype: Any = None
  weight_decay: Optional[ScalarOrSchedule]  # None: Adam (no decoupled weight decay)
  mask: Any
  nesterov: bool

  def __post_init__(self):
    if self.mu_dtype is not None and jnp.dtype(self.mu_dtype) not in _trees.KERNEL_DTYPES:
      raise ValueError(f"jaxfuse: mu_dtype {jnp.dtype(self.mu_dtype).name} is not supported; "
                       f"use None or one of {', '.join(t.name for t in _trees.KERNEL_DTYPES)}")

  @property
  def name(self) -> str:
    return "jaxfuse.adam" if self.weight_decay is None else "jaxfuse.adamw"

  @property
  def needs_params(self) -> bool:
    return self.master_weights or self.weight_decay is not None

  def optax_twin(self) -> optax.GradientTransformation:
    if self.weight_decay is None:
      return optax.adam(self.learning_rate, self.b1, self.b2, self.eps, self.eps_root,
                        self.mu_dtype, nesterov=self.nesterov)
    return optax.adamw(self.learning_rate, self.b1, self.b2, self.eps, self.eps_root,
                       self.mu_dtype, self.weight_decay, self.mask, nesterov=self.nesterov)

  def flags(self) -> dict[str, bool]:
    return {"nesterov": self.nesterov}

  def tensor_flags(self, params: Any) -> list[dict[str, bool]]:
    return _spec.decay_flags(self.weight_decay, self.mask, params)

  def state_dtypes(self) -> list[Any]:
    return [None, self.nu_dtype]

  def state_signs(self) -> list[bool]:
    return [True, False]

  def check_params(self, params: Any) -> None:
    _spec.check_state_dtype("nu_dtype", self.nu_dtype, params)
    if self.mu_dtype is None:
      return
    mu_complex = _trees.is_complex(self.mu_dtype)
    for name, p in zip(_trees.leaf_names(params), jax.tree.leaves(params)):
      if _trees.is_complex(p.dtype) != mu_complex:
        raise ValueError(
            f"jaxfuse: mu_dtype {jnp.dtype(self.mu_dtype).name} does not fit params leaf {name} "
            f"({p.dtype.name}): the first moment of real params is real, of complex params "
            "complex")

  def states(self, state: Any) -> list[Any]:
    return [state[0].mu, state[0].nu]

  def with_states(self, state: Any, trees: list[Any]) -> Any:
    return (state[0]._replace(mu=trees[0], nu=trees[1]), *state[1:])

  def hyper(self, count: jax.Array) -> dict[str, Any]:
    wd = self.weight_decay if _spec.decays(self.weight_decay) else 0.0
    values = dict(learning_rate=self.learning_rate, b1=self.b1,
                  one_minus_b1=_spec.one_minus(self.b1), b2=self.b2,
                  one_minus_b2=_spec.one_minus(self.b2), eps=self.eps,
                  eps_root=self.eps_root, weight_decay=wd)
    return {k: _spec.scalar(v, count) for k, v in values.items()}

  def xla_hyper(self, count: jax.Array) -> dict[str, Any]:
    h = self.hyper(count)
    t = optax.safe_increment(count)
    h.update(bc1=1 - h["b1"] ** t, bc1_next=1 - h["b1"] ** optax.safe_increment(t),
             bc2=1 - h["b2"] ** t)  # optax's bias corrections, in JAX's default float type
    return h

  def leaf_math(self, k, g, p, states, flags):
    u, new_states = scaled_moment(k, g, p, states, flags["decay"], self.nesterov)
    return u * -k["learning_rate"], new_states


def scaled_moment(k, g, p, states, decay: bool, nesterov: bool) -> tuple[jax.Array, list]:
  """adam_scaled_moment() (optim/families/adam.h) for one leaf as XLA operations: the direction
  m_hat / (sqrt(v_hat + eps_root) + eps) + wd * p before the learning rate, and the new moments."""
  m, v = states
  new_v = k["one_minus_b2"] * _spec.abs_sq(g) + k["b2"] * v
  new_m = k["one_minus_b1"] * g + k["b1"] * m
  if nesterov:
    m_hat = k["b1"] * (new_m / k["bc1_next"]) + k["one_minus_b1"] * (g / k["bc1"])
  else:
    m_hat = new_m / k["bc1"]
  u = m_hat / (jnp.sqrt(new_v / k["bc2"] + k["eps_root"]) + k["eps"])
  if decay:
    u = u + k["weight_decay"] * p
  return u, [new_m, new_v]


@_families.family(AdamSpec, weight_decay=None, mask=None)
def adam(learning_rate: ScalarOrSchedule, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8,
         eps_root: float = 0.0, mu_dtype: Optional[Any] = None, *, nesterov: bool = False,
         nu_dtype: Optional[Any] = None, moment_bits: Optional[int] = None,
         master_weights: Union[bool, str] = False, skip_nonfinite: bool = False,
         stochastic_rounding: bool = False,
         seed: Optional[int] = None,
         packed: Packing = False) -> optax.GradientTransformationExtraArgs:
  """Adam (Kingma & Ba, 2015) as one fused kernel; same arguments and math as ``optax.adam``.

  Args:
    learning_rate: a float, or an optax schedule evaluated on the step count.
    b1, b2: decay rates of the first and second moment estimates.
    eps, eps_root: added to the denominator outside / inside the square root.
    mu_dtype: storage dtype of the first moment (None: the params' dtype, as optax).
    nesterov: use Nesterov momentum (NAdam, Dozat 2016), as optax does.
    nu_dtype: storage dtype of the second moment (None: the params' dtype, as optax); the math
      stays in float32 and the stored value is rounded once.

  Returns:
    An optax ``GradientTransformationExtraArgs``.
  """


@_families.family(AdamSpec, variants={
    "masked decay": dict(learning_rate=1e-3, weight_decay=0.1, mask=_families.some_leaves),
})
def adamw(learning_rate: ScalarOrSchedule, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8,
          eps_root: float = 0.0, mu_dtype: Optional[Any] = None,
          weight_decay: ScalarOrSchedule = 1e-4, mask: Any = None, *, nesterov: bool = False,
          nu_dtype: Optional[Any] = None, moment_bits: Optional[int] = None,
          master_weights: Union[bool, str] = False, skip_nonfinite: bool = False,
          stochastic_rounding: bool = False,
          seed: Optional[int] = None,
          packed: Packing = False) -> optax.GradientTransformationExtraArgs:
  """AdamW (Loshchilov & Hutter, 2019) as one fused kernel; same arguments and math as
  ``optax.adamw``.

  Args:
    learning_rate: a float, or an optax schedule evaluated on the step count.
    b1, b2: decay rates of the first and second moment estimates.
    eps, eps_root: added to the denominator outside / inside the square root.
    mu_dtype: storage dtype of the first moment (None: the params' dtype, as optax).
    weight_decay: decoupled weight decay rate (a float or a schedule).
    mask: pytree of bools (a prefix of params) or a callable returning one: True where weight
      decay applies. Must be static.
    nesterov: use Nesterov momentum (NAdamW), as optax does.
    nu_dtype: storage dtype of the second moment (None: the params' dtype, as optax); the math
      stays in float32 and the stored value is rounded once.

  Returns:
    An optax ``GradientTransformationExtraArgs``.
  """


@_families.family(AdamSpec, nesterov=True, weight_decay=None, mask=None, variants={
    "nesterov": dict(learning_rate=1e-3),
})
def nadam(learning_rate: ScalarOrSchedule, b1: float = 0.9, b2: float = 0.999,
          eps: float = 1e-8, eps_root: float = 0.0, mu_dtype: Optional[Any] = None, *,
          nu_dtype: Optional[Any] = None, moment_bits: Optional[int] = None,
          master_weights: Union[bool, str] = False, skip_nonfinite: bool = False,
          stochastic_rounding: bool = False,
          seed: Optional[int] = None,
          packed: Packing = False) -> optax.GradientTransformationExtraArgs:
  """NAdam (Dozat, 2016, https://openreview.net/forum?id=OM0jvwB8jIp57ZJjtNEZ): ``adam`` with
  ``nesterov=True``, as ``optax.nadam``."""


@_families.family(AdamSpec, nesterov=True)
def nadamw(learning_rate: ScalarOrSchedule, b1: float = 0.9, b2: float = 0.999,
           eps: float = 1e-8, eps_root: float = 0.0, mu_dtype: Optional[Any] = None,
           weight_decay: ScalarOrSchedule = 1e-4, mask: Any = None, *,
           nu_dtype: Optional[Any] = None, moment_bits: Optional[int] = None,
           master_weights: Union[bool, str] = False, skip_nonfinite: bool = False,
           stochastic_rounding: bool = False,
           seed: Optional[int] = None,
           packed: Packing = False) -> optax.GradientTransformationExtraArgs:
  """NAdamW: ``adamw`` with ``nesterov=True``, as ``optax.nadamw``."""
