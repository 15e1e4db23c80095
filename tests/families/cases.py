"""Each optimizer family's configurations, declared once, for the conformance suite
(test_conformance.py): the registry's variants (jaxfuse/_optim/families) and the options below,
each a jaxfuse function and its keyword arguments, whose optax twin is optax's function of the
same name with the arguments optax knows. A family in the registry without an entry here fails
test_every_family_has_cases."""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxfuse
from jaxfuse._optim import families
from lockstep import EPS32


def optax_function(name: str) -> Callable:
  """optax's optimizer of this name (optax's or optax.contrib's)."""
  return getattr(optax, name) if hasattr(optax, name) else getattr(optax.contrib, name)


@dataclasses.dataclass(frozen=True)
class Config:
  """A jaxfuse optimizer call, ``jaxfuse.<function>(**kwargs, **options)``."""

  function: str
  kwargs: dict

  def ours(self, **options: Any) -> optax.GradientTransformation:
    return getattr(jaxfuse, self.function)(**self.kwargs, **options)

  def twin(self, **kwargs: Any) -> optax.GradientTransformation:
    """optax's transform of the same name on the arguments it takes (jaxfuse-only storage
    options, such as nu_dtype, are what the bounds check: lockstep.py)."""
    fn = optax_function(self.function)
    known = inspect.signature(fn).parameters
    return fn(**{k: v for k, v in dict(self.kwargs, **kwargs).items() if k in known})

  @property
  def optax_layout(self) -> bool:
    """Whether the state is optax's twin's leaf for leaf (no jaxfuse-only storage option)."""
    return set(self.kwargs) <= set(inspect.signature(optax_function(self.function)).parameters)


def _lion_near_zero(b1: float) -> Callable:
  """Lion's update is sign(x), x = (1 - b1) g + b1 mu: where x is within rounding of zero the
  sign may legitimately flip (an update 2 lr apart); those elements are left out of the params'
  and updates' checks (the momentum is always checked)."""

  def masks(grads, state):
    mu = next(s.mu for s in jax.tree.leaves(
        state, is_leaf=lambda x: isinstance(x, optax.ScaleByLionState))
              if isinstance(s, optax.ScaleByLionState))

    def leaf(g, m):
      a, b = (1.0 - b1) * np.asarray(g, np.float64), b1 * np.asarray(m, np.float64)
      return np.abs(a + b) <= 8 * EPS32 * (np.abs(a) + np.abs(b))

    return jax.tree.map(leaf, grads, mu)

  return masks


@dataclasses.dataclass
class FamilyCases:
  """The options a family's checks run with, beside the registry's variants."""

  configs: dict[str, Config]
  # inject_hyperparams: (the arguments, the changes halfway; a hyperparameter given as a
  # schedule is written into the state each step, so the changes name others)
  inject: tuple[dict, dict]
  near_zero: Optional[Callable] = None  # (b1 of the config) -> masks, for discontinuous steps


def _every_other(params):
  """A mask tree of the params dict: every other leaf in sorted order."""
  return {k: i % 2 == 0 for i, k in enumerate(sorted(params))}


CASES = {
    "adam": FamilyCases({
        "adam": Config("adam", dict(learning_rate=1e-2)),
        "adamw warmup cosine": Config("adamw", dict(
            learning_rate=optax.warmup_cosine_decay_schedule(0.0, 1e-2, 2, 20),
            weight_decay=0.05)),
        "eps_root": Config("adam", dict(learning_rate=1e-2, eps=1e-6, eps_root=1e-8, b1=0.8,
                                        b2=0.99)),
        "mu bf16": Config("adamw", dict(learning_rate=1e-2, mu_dtype=jnp.bfloat16)),
        "nu bf16": Config("adamw", dict(learning_rate=1e-2, nu_dtype=jnp.bfloat16)),
        "decay schedule": Config("adamw", dict(
            learning_rate=1e-2, weight_decay=optax.linear_schedule(0.1, 0.0, 30))),
        "nadamw": Config("nadamw", dict(learning_rate=1e-2, weight_decay=0.1)),
    }, inject=(dict(learning_rate=optax.linear_schedule(1e-2, 1e-3, 6), b1=0.9,
                    weight_decay=0.1), dict(b1=0.8, weight_decay=0.05))),
    "sgd": FamilyCases({
        "schedule": Config("sgd", dict(learning_rate=optax.linear_schedule(0.1, 0.01, 15),
                                       momentum=0.5)),
    }, inject=(dict(learning_rate=0.05, momentum=0.9), dict(learning_rate=0.01, momentum=0.5))),
    "lion": FamilyCases({
        "mu bf16": Config("lion", dict(learning_rate=1e-2, mu_dtype=jnp.bfloat16)),
        "decay mask tree": Config("lion", dict(learning_rate=1e-2, weight_decay=0.3,
                                               mask=_every_other)),
        "schedules": Config("lion", dict(learning_rate=optax.linear_schedule(1e-2, 1e-3, 8),
                                         weight_decay=optax.linear_schedule(0.1, 0.0, 8),
                                         b1=0.8, b2=0.95)),
    }, inject=(dict(learning_rate=1e-2, b1=0.9, weight_decay=0.1),
               dict(learning_rate=3e-3, b1=0.8)), near_zero=_lion_near_zero),
    "adagrad": FamilyCases({
        "options": Config("adagrad", dict(learning_rate=0.05, initial_accumulator_value=0.5,
                                          eps=1e-3)),
        "zero start": Config("adagrad", dict(learning_rate=optax.linear_schedule(0.1, 0.01, 15),
                                             initial_accumulator_value=0.0)),
    }, inject=(dict(learning_rate=0.05, eps=1e-6), dict(learning_rate=0.01))),
    "rmsprop": FamilyCases({
        "momentum": Config("rmsprop", dict(learning_rate=1e-2, momentum=0.9)),
        # At step 1 a centered, bias-corrected variance is 0 up to rounding: a large eps keeps
        # the step well conditioned (optax's own result is rounding noise otherwise).
        "centered bias correction": Config("rmsprop", dict(learning_rate=1e-2, centered=True,
                                                           bias_correction=True, eps=0.1)),
        "initial scale": Config("rmsprop", dict(learning_rate=1e-2, initial_scale=1.0,
                                                decay=0.8)),
        "schedule": Config("rmsprop", dict(learning_rate=optax.linear_schedule(1e-2, 1e-3, 8),
                                           bias_correction=True)),
    }, inject=(dict(learning_rate=1e-2, decay=0.9, momentum=0.9),
               dict(learning_rate=3e-3, decay=0.8))),
    "lamb": FamilyCases({
        "lamb": Config("lamb", dict(learning_rate=1e-2)),
        "eps": Config("lamb", dict(learning_rate=1e-2, b1=0.8, eps=1e-3, eps_root=1e-8)),
        "nu bf16": Config("lamb", dict(learning_rate=1e-2, nu_dtype=jnp.bfloat16)),
    }, inject=(dict(learning_rate=1e-2, weight_decay=0.1), dict(learning_rate=3e-3))),
    "lars": FamilyCases({
        "masks": Config("lars", dict(learning_rate=0.1, weight_decay=0.05,
                                     weight_decay_mask=_every_other, trust_coefficient=0.02,
                                     eps=1e-3, trust_ratio_mask=families.some_leaves)),
        "no momentum": Config("lars", dict(learning_rate=0.1, weight_decay=0.01, momentum=0.0)),
    }, inject=(dict(learning_rate=0.05, trust_coefficient=0.01), dict(trust_coefficient=0.05))),
    "schedule_free_adamw": FamilyCases({
        "defaults": Config("schedule_free_adamw", {}),
        "warmup": Config("schedule_free_adamw", dict(learning_rate=1e-2, warmup_steps=3,
                                                     weight_decay=0.05)),
        "b1 b2 eps power": Config("schedule_free_adamw", dict(
            learning_rate=1e-2, b1=0.95, b2=0.99, eps=1e-6, weight_lr_power=1.0)),
        "z float32": Config("schedule_free_adamw", dict(learning_rate=1e-2,
                                                        state_dtype=jnp.float32)),
    }, inject=(dict(learning_rate=1e-2, b1=0.9, weight_decay=0.1),
               dict(learning_rate=3e-3, b1=0.85))),
    "schedule_free_sgd": FamilyCases({
        "warmup": Config("schedule_free_sgd", dict(learning_rate=0.5, warmup_steps=2)),
        "schedules": Config("schedule_free_sgd", dict(
            learning_rate=optax.linear_schedule(0.5, 0.1, 6), b1=1.5,
            weight_decay=optax.linear_schedule(0.1, 0.0, 6))),
    }, inject=(dict(learning_rate=0.1, b1=0.9), dict(learning_rate=0.03, b1=0.8))),
}


def family_configs(family: families.Family) -> dict[str, Config]:
  """The registry's variants of `family`, then its options above."""
  variants = {v.name: Config(v.function.__name__, v.kwargs) for v in family.variants}
  return {**variants, **CASES[family.name].configs}


def first(family: families.Family) -> Config:
  """The family's first variant: the one every option runs on."""
  v = family.variants[0]
  return Config(v.function.__name__, v.kwargs)
