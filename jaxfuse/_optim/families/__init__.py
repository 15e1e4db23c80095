"""The optimizer families, and the one list of them.

A family is four files: its element math (``csrc/optim/families/<name>.h``), its CPU and CUDA
handlers (``csrc/optim/cpu/<name>.cc``, ``csrc/optim/cuda/<name>.cu``, which register
themselves), and its Python module here, whose public functions are declared with
:func:`family`. Importing ``jaxfuse`` imports every family module (``jaxfuse/__init__.py`` names
them, the public namespace being the one list), and :func:`registered` returns them: the tests,
tools and benchmarks that cover every family take their cases from it, and the documentation's
tables are checked against it (``tests/test_readme.py``). A public optimizer made of families
(``jaxfuse.muon``: its own element family for the matrices, AdamW for the other leaves) is
declared with :func:`composite` and listed by :func:`composites`.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import textwrap
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import optax

from jaxfuse._core import ffi as _ffi
from jaxfuse._optim import optimizer as _optimizer
from jaxfuse._optim import spec as _spec

# The options every family takes, keyword-only, with their Spec defaults, documented once here
# and appended to each family function's Args (LAMB and LARS take all but moment_bits).
OPTION_DOCS = {
    "moment_bits": "8: the state lists of leaves of at least 4096 elements, a multiple of 128, "
                   "kept block-wise in 8 bits (``jaxfuse.QuantizedMoment``, a float32 scale per "
                   "128 elements), dequantized and requantized in the step; None or 32: as "
                   "floats, in the state dtypes above.",
    "master_weights": "True: keep an fp32 master copy of low-precision params in the state; "
                      "\"remainder\": keep bf16 params' int16 remainders instead, the fp32 master "
                      "in 2 bytes (trust-ratio families, LAMB and LARS: True only; their ratios "
                      "then take the master's norm).",
    "skip_nonfinite": "skip (and count) steps whose gradients are not all finite.",
    "stochastic_rounding": "store 16-bit params rounded stochastically, keyed on `seed`, so that "
                           "updates below half an ulp survive on average without a master copy.",
    "seed": "the stochastic rounding's key, an int in [0, 2**32) (None: 0).",
    "packed": "keep each state list (and the master copy or remainders) as one flat buffer per "
              "dtype (``jaxfuse.Packed``), so that the state is a handful of arrays for any "
              "number of leaves and a step's host cost does not grow with them; the fused step "
              "updates the buffers in place. ``jaxfuse.convert_state`` moves a state between "
              "packed and per-leaf layouts (optax's). Packed params (``jaxfuse.pack``) always "
              "get a packed state. A mesh axis name (or a tuple of names), e.g. ``\"data\"``: "
              "packed and split evenly over that axis (ZeRO's first stage), each device keeping "
              "and updating 1/N of the state, params replicated.",
}


@dataclasses.dataclass(frozen=True)
class Variant:
  """A configuration of a family that takes its own path through the family's kernels (another
  state layout, another flag): ``function(**kwargs, **options)``."""

  family: str
  name: str
  function: Callable[..., optax.GradientTransformationExtraArgs]
  kwargs: dict[str, Any]

  def __call__(self, **options: Any) -> optax.GradientTransformationExtraArgs:
    return self.function(**self.kwargs, **options)

  @property
  def label(self) -> str:
    return f"{self.family} {self.name}"

  def spec(self, **options: Any) -> _spec.Spec:
    """The Spec this variant's transform runs."""
    return self.function._spec_of(**self.kwargs, **options)


@dataclasses.dataclass
class Family:
  """One optimizer family: its Spec subclass, its public functions, its variants."""

  spec: type[_spec.Spec]
  functions: list[Callable[..., optax.GradientTransformationExtraArgs]]
  variants: list[Variant]

  @property
  def name(self) -> str:
    """Its op's name without the prefix, the stem of its files (``lion``:
    ``csrc/optim/families/lion.h``, ...; ``schedule_free_adamw`` and ``schedule_free_sgd`` share
    ``schedule_free``'s)."""
    return self.spec.op.removeprefix("jaxfuse_")

  def takes(self, option: str) -> bool:
    """Whether every function of the family takes the keyword `option`."""
    return all(option in inspect.signature(f).parameters for f in self.functions)

  @property
  def trust_ratio(self) -> bool:
    """Whether it scales each leaf's update by a trust ratio (a first pass of per-leaf sums)."""
    return "trust_sums_op" in _ffi.contract(self.spec.op).names

  @property
  def takes_complex(self) -> bool:
    """Whether it takes complex params (as optax's twin does)."""
    try:
      self.variants[0].spec().check_params({"x": jax.ShapeDtypeStruct((2,), jnp.complex64)})
    except TypeError:
      return False
    return True

  def fullest(self) -> Variant:
    """The first variant that keeps the most state lists."""
    return max(self.variants, key=lambda v: len(v.spec().lists()["operands"]))


_FAMILIES: dict[type[_spec.Spec], Family] = {}
_COMPOSITES: list[Callable[..., optax.GradientTransformationExtraArgs]] = []


def registered() -> tuple[Family, ...]:
  """Every family, in the order ``jaxfuse/__init__.py`` imports them."""
  return tuple(_FAMILIES.values())


def composites() -> tuple[Callable[..., optax.GradientTransformationExtraArgs], ...]:
  """Every public optimizer made of families (declared with :func:`composite`)."""
  return tuple(_COMPOSITES)


def some_leaves(params: Any) -> Any:
  """A static mask (for weight decay, trust ratios) that is False on every third leaf in
  flattening order, True elsewhere: variants run both kinds of leaf in one call."""
  leaves, treedef = jax.tree.flatten(params)
  return jax.tree.unflatten(treedef, [i % 3 != 0 for i in range(len(leaves))])


def _with_option_docs(doc: Optional[str], parameters: Any) -> Optional[str]:
  """`doc` with the shared options this function takes appended to its Args section."""
  if not doc or "\n  Args:\n" not in doc:
    return doc
  lines = [textwrap.fill(f"{name}: {text}", 98, initial_indent="    ", subsequent_indent="      ",
                         break_on_hyphens=False)
           for name, text in OPTION_DOCS.items() if name in parameters]
  head, sep, tail = doc.partition("\n\n  Returns:")
  return head.rstrip() + "\n" + "\n".join(lines) + sep + tail


def _check_options(fn: Callable, parameters: Any, spec: type[_spec.Spec]) -> None:
  """Raises (at import) unless `fn` spells each shared option it takes keyword-only with the
  Spec's default, so that every family's signature says the same."""
  defaults = {f.name: f.default for f in dataclasses.fields(spec)}
  for name in OPTION_DOCS:
    p = parameters.get(name)
    if p is None:
      continue
    if p.kind is not inspect.Parameter.KEYWORD_ONLY or p.default != defaults[name]:
      raise TypeError(f"{fn.__qualname__}: the option {name} must be keyword-only with the "
                      f"default {defaults[name]!r}, as in every family")


# The annotations of the numeric hyperparameters: checked when a transform is made (a string
# would otherwise be read as a number); those that take schedules are marked True.
_NUMBER_ANNOTATIONS = {"float": False, "Optional[float]": False, "ScalarOrSchedule": True,
                       "Optional[ScalarOrSchedule]": True}


def _check_arguments(fn: Callable, parameters: Any, arguments: dict[str, Any]) -> None:
  """Raises unless each numeric hyperparameter is a number, a scalar array or (where its type
  allows) a schedule, and each flag is not a string, naming the argument."""
  owner = f"jaxfuse.{fn.__name__}"
  for name, value in arguments.items():
    annotation = parameters[name].annotation
    if value is None and annotation.startswith("Optional["):
      continue
    if annotation in _NUMBER_ANNOTATIONS:
      _spec.check_number(owner, name, value, schedule=_NUMBER_ANNOTATIONS[annotation])
    elif annotation == "bool" and isinstance(value, (str, bytes)):
      raise TypeError(f"{owner}: {name}={value!r} is a {type(value).__name__}; expected a bool")


def composite(spec: type[_spec.Spec]) -> Callable[[Callable], Callable]:
  """Declares a public optimizer made of families, whose shared options are `spec`'s: checked
  and documented as in every family (:func:`family`), and listed by :func:`composites`."""

  def declare(fn: Callable) -> Callable:
    parameters = inspect.signature(fn).parameters
    _check_options(fn, parameters, spec)
    fn.__doc__ = _with_option_docs(fn.__doc__, parameters)
    _COMPOSITES.append(fn)
    return fn

  return declare


def family(spec: type[_spec.Spec], *, variants: Optional[dict[str, dict[str, Any]]] = None,
           **fixed: Any) -> Callable[[Callable], Callable]:
  """Declares a family's public function: its signature (keyword-only shared options last) and
  docstring are the declaration; a call builds `spec` from the bound arguments (plus `fixed`)
  and returns ``optimizer.transform(spec)``.

  `variants` names configurations (keyword arguments of this function) that take their own path
  through the kernels; the tests, tools and benchmarks that cover every family run each.
  """

  def declare(fn: Callable) -> Callable:
    signature = inspect.signature(fn)
    _check_options(fn, signature.parameters, spec)

    def spec_of(*args: Any, **kwargs: Any) -> _spec.Spec:
      bound = signature.bind(*args, **kwargs)
      bound.apply_defaults()
      _check_arguments(fn, signature.parameters, bound.arguments)
      return spec(**bound.arguments, **fixed)

    @functools.wraps(fn)
    def make(*args: Any, **kwargs: Any) -> optax.GradientTransformationExtraArgs:
      return _optimizer.transform(spec_of(*args, **kwargs))

    make.__doc__ = _with_option_docs(fn.__doc__, signature.parameters)
    make._spec_of = spec_of  # for Variant.spec()
    entry = _FAMILIES.setdefault(spec, Family(spec, [], []))
    entry.functions.append(make)
    entry.variants += [Variant(entry.name, name, make, kwargs)
                       for name, kwargs in (variants or {}).items()]
    return make

  return declare
