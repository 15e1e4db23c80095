"""The family protocol of the generic fused optimizer: what a family (Adam, SGD, Lion, ...)
declares, as a :class:`Spec` subclass (its hyperparameters, its optax twin, where its state lists
live in the optax state, its element math as XLA operations) beside its C++ family struct
(csrc/optim/optimizer.h), and the helpers the families share. The generic optimizer
(optimizer.py) runs every family with it: the optax protocol (xla_path.py) and the fused in-place
step (kernel_path.py), both on one step's checked and flattened arguments (step.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from typing import Any, Callable, ClassVar, NamedTuple, Optional, Union

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxfuse._core import ffi as _ffi
from jaxfuse._core import packing as _packing
from jaxfuse._core import trees as _trees
from jaxfuse._optim import moments as _moments
from jaxfuse._optim import split as _split

ScalarOrSchedule = Union[float, jax.Array, Callable[[jax.Array], jax.Array]]
# The `packed` option: False, True, or the mesh axis (or axes) the packed state is split over.
Packing = Union[bool, str, tuple[str, ...]]


class ExtraState(NamedTuple):
  """jaxfuse's additions to the optax state, appended only when an opt-in feature is on.

  Attributes:
    master_params: copy of the params (``master_weights=True``) in float32, or in the params'
      own dtype where that is wider (float64, complex), else None.
    skipped_steps: int32 count of steps skipped for non-finite gradients
      (``skip_nonfinite=True``), else None.
    param_remainders: with ``master_weights="remainder"``, per params leaf an int16 array:
      for a bfloat16 leaf the low halves of its float32 master (``bits(master) =
      bits(param) * 2**16 + remainder``), for a leaf of another dtype an empty one (it is its
      own master); else None.
  """

  master_params: Any = None
  skipped_steps: Any = None
  param_remainders: Any = None


def check_number(owner: str, name: str, value: Any, *, schedule: bool = False) -> None:
  """Raises unless hyperparameter `name` of `owner` is a real number, a real scalar array (a
  tracer under ``optax.inject_hyperparams``) or, where `schedule`, a callable. A string would
  otherwise reach the kernels' vectors as a number (numpy reads '1e-3' as 0.001)."""
  expected = "a float, an array or a schedule" if schedule else "a float or an array"
  if schedule and callable(value):
    return
  if isinstance(value, (bool, np.bool_)):
    raise TypeError(f"{owner}: {name}={value!r} is a bool; expected {expected}")
  if isinstance(value, (int, float, np.integer, np.floating)):
    return
  dtype = getattr(value, "dtype", None)
  if dtype is None or not hasattr(value, "shape"):
    raise TypeError(f"{owner}: {name}={value!r} is a {type(value).__name__}; expected {expected}")
  if not (jnp.issubdtype(dtype, jnp.integer) or jnp.issubdtype(dtype, jnp.floating)):
    raise TypeError(f"{owner}: {name} is a {jnp.dtype(dtype).name} array; expected a real "
                    "number (integer or floating dtype)")
  if np.ndim(value) != 0:
    raise TypeError(f"{owner}: {name} is an array of shape {np.shape(value)}; expected a scalar")


def scalar(value: Any, count: jax.Array) -> Any:
  """A hyperparameter's value at this step: schedules evaluated on the count."""
  return value(count) if callable(value) else value


def one_minus(b: Any) -> Any:
  """``1 - b`` as optax writes it: with a Python float the difference is taken in float64 and
  then rounded, with an array in the array's dtype. The kernels get it precomputed so that the
  rounding matches."""
  return 1.0 - b if isinstance(b, (int, float)) else 1.0 - jnp.asarray(b)


def abs_sq(x: jax.Array) -> jax.Array:
  """|x|^2 elementwise, real (optax.numerics.abs_sq): re^2 + im^2 for complex x."""
  return (jnp.conj(x) * x).real if jnp.iscomplexobj(x) else x * x


# The mesh axes over which leaf_math's leaves are chunks of whole leaves (a split state's
# step, in its shard_map): a leaf's sums add the chunks' over them. Set by sums_over().
_chunk_axes: list[tuple[str, ...]] = [()]


@contextlib.contextmanager
def sums_over(axes: tuple[str, ...]):
  """Within it (at trace time), trust_ratio()'s leaves are chunks split over mesh `axes`."""
  _chunk_axes.append(tuple(axes))
  try:
    yield
  finally:
    _chunk_axes.pop()


def _leaf_sum(x: jax.Array) -> jax.Array:
  total = jnp.sum(x)
  return jax.lax.psum(total, _chunk_axes[-1]) if _chunk_axes[-1] else total


def trust_ratio(p: jax.Array, d: jax.Array, trust_coefficient: Any = 1.0,
                eps: Any = 0.0) -> jax.Array:
  """optax.scale_by_trust_ratio's ratio (min_norm 0) for one whole leaf as XLA operations, in
  the compute type (the kernels sum the squares in float64; optax in the leaf's dtype); real,
  also for complex leaves (their |x| norms). Under sums_over(), `p` and `d` are chunks."""
  param_norm = jnp.sqrt(_leaf_sum(abs_sq(p)))
  update_norm = jnp.sqrt(_leaf_sum(abs_sq(d)))
  ratio = trust_coefficient * param_norm / (update_norm + eps)
  return jnp.where((param_norm == 0) | (update_norm == 0), jnp.ones_like(ratio), ratio)


def decays(weight_decay: Any) -> bool:
  """Whether an update has a weight-decay term: optax's add_decayed_weights is dropped for a
  Python zero (not for a zero array or a schedule reaching zero), so that 0 * inf never reaches
  it."""
  return weight_decay is not None and not (isinstance(weight_decay, (int, float))
                                           and weight_decay == 0)


def decay_flags(weight_decay: Any, mask: Any, params: Any) -> list[dict[str, bool]]:
  """Per leaf, whether decoupled weight decay applies: optax's add_decayed_weights with its
  (static) mask, evaluated once."""
  n = len(jax.tree.leaves(params))
  if not decays(weight_decay):
    return [{"decay": False}] * n
  if mask is None:
    return [{"decay": True}] * n
  return [{"decay": d} for d in _trees.static_bool_mask(mask, params)]


def check_real(name: str, params: Any) -> None:
  """Raises unless every params leaf is real, naming the first complex one."""
  for leaf_name, p in zip(_trees.leaf_names(params), jax.tree.leaves(params)):
    if _trees.is_complex(p.dtype):
      raise TypeError(f"{name}: params leaf {leaf_name} is {p.dtype.name}; this optimizer takes "
                      "real leaves only")


def check_state_dtype(what: str, dtype: Any, params: Any) -> None:
  """Raises unless a state dtype chosen by the user is a kernel dtype that fits every params
  leaf (real state for real params, complex for complex), naming the leaf at fault."""
  if dtype is None:
    return
  if jnp.dtype(dtype) not in _trees.KERNEL_DTYPES:
    raise ValueError(f"jaxfuse: {what} {jnp.dtype(dtype).name} is not supported; use None or "
                     f"one of {', '.join(t.name for t in _trees.KERNEL_DTYPES)}")
  for name, p in zip(_trees.leaf_names(params), jax.tree.leaves(params)):
    if _trees.is_complex(p.dtype) != _trees.is_complex(dtype):
      raise ValueError(
          f"jaxfuse: {what} {jnp.dtype(dtype).name} does not fit params leaf {name} "
          f"({p.dtype.name}): the state of real params is real, of complex params complex")


@dataclasses.dataclass(frozen=True, eq=False, kw_only=True)
class Spec:
  """Everything a jaxfuse optimizer transform was built with; a family subclasses it.

  A family defines ``op`` (its XLA target), ``name`` (for messages), and the hooks below."""

  op: ClassVar[str]
  name: ClassVar[str]
  learning_rate: ScalarOrSchedule
  master_weights: Union[bool, str] = False
  skip_nonfinite: bool = False
  stochastic_rounding: bool = False
  seed: Optional[int] = None  # None: 0 (a default of 0 would be a hyperparameter to optax's
                              # inject_hyperparams, and change its state's structure)
  moment_bits: Optional[int] = None  # None: 32, for the same reason
  packed: Packing = False

  def check_options(self) -> None:
    """Raises on a combination of the generic options that this family cannot run."""
    if self.master_weights not in (False, True, "remainder"):
      raise ValueError(f"{self.name}: master_weights={self.master_weights!r}; expected False, "
                       "True or 'remainder'")
    if self.stochastic_rounding and self.master_weights:
      raise ValueError(f"{self.name}: stochastic_rounding rounds params that have no master; "
                       "with master_weights the master keeps every update (use one or the other)")
    if self.keeps_remainders and "trust_sums_op" in self.contract.names:
      raise ValueError(f"{self.name}: master_weights='remainder' is not supported by trust-ratio "
                       "families; use master_weights=True")
    bits = self.moment_bits
    if bits is not None and not (isinstance(bits, (int, np.integer)) and bits in (8, 32)):
      raise ValueError(f"{self.name}: moment_bits={bits!r}; expected 8 or 32 (None: 32), static "
                       "(under optax.inject_hyperparams: static_args=('moment_bits',))")
    if self.moment_bits == 8 and "trust_sums_op" in self.contract.names:
      raise ValueError(f"{self.name}: moment_bits=8 is not supported by trust-ratio families "
                       "(their first pass reads the states as floats)")
    if self.moment_bits == 8 and not self.state_signs():
      raise ValueError(f"{self.name}: moment_bits=8, but this configuration keeps no state")
    axes = (self.packed,) if isinstance(self.packed, str) else self.packed
    if not isinstance(self.packed, (bool, np.bool_)) and not (
        isinstance(axes, tuple) and axes and all(isinstance(a, str) for a in axes)):
      raise TypeError(f"{self.name}: packed={self.packed!r}; expected a bool, or the name of a "
                      "mesh axis (or a tuple of names) to split the packed state over (static: "
                      "under optax.inject_hyperparams, static_args=('packed',))")
    seed = self.rounding_seed
    seed_ok = 0 <= seed < 2**32 if isinstance(seed, (int, np.integer)) else (
        jnp.shape(seed) == () and jnp.issubdtype(jnp.result_type(seed), jnp.integer))
    if not seed_ok:  # an int, or an integer scalar array (e.g. under inject_hyperparams)
      raise ValueError(f"{self.name}: seed={self.seed!r}; expected an int in [0, 2**32)")

  # ---- the family's hooks ----------------------------------------------------------------

  def optax_twin(self) -> optax.GradientTransformation:
    """The optax transform this one reproduces (its state layout is ours, less extensions)."""
    raise NotImplementedError

  def flags(self) -> dict[str, bool]:
    """The call's flags by the op's flag names (the contract's ``flags``)."""
    return {}

  def tensor_flags(self, params: Any) -> list[dict[str, bool]]:
    """Per leaf, its flags by the op's tensor-flag names (e.g. the weight-decay mask, evaluated
    once; raises on a traced or misshapen mask)."""
    return [{} for _ in jax.tree.leaves(params)]

  def check_params(self, params: Any) -> None:
    """Family-specific trace-time checks of the params (e.g. a moment dtype that does not fit)."""

  def states(self, state: Any) -> list[Any]:
    """The trees of the state lists in the op's list order (the contract's ``lists``)."""
    raise NotImplementedError

  def state_dtypes(self) -> list[Any]:
    """Per state list, a storage dtype that replaces the optax twin's (None: keep it), for
    the state dtypes optax has no argument for (e.g. Adam's ``nu_dtype``)."""
    return []

  def state_signs(self) -> list[bool]:
    """Per state list, whether its values take both signs (True: e.g. a first moment) or are
    never negative (False: e.g. a second moment): the 8-bit formats of ``moment_bits=8``. Empty:
    the family has no 8-bit states."""
    return []

  def with_states(self, state: Any, trees: list[Any]) -> Any:
    """``state`` (the optax part) with its state-list trees replaced."""
    raise NotImplementedError

  def hyper(self, count: jax.Array) -> dict[str, Any]:
    """The step's hyperparameters by the op's hyper field names, schedules evaluated on the
    count: what the kernels read as a vector."""
    raise NotImplementedError

  def xla_hyper(self, count: jax.Array) -> dict[str, Any]:
    """The scalars the XLA element math reads (by default the kernels' ones)."""
    return self.hyper(count)

  def step_count(self, state: Any) -> jax.Array:
    """The step count the schedules, bias corrections and rounding streams read (the whole
    state): the first ``count`` in it (every optax count advances together), zero when it keeps
    none."""
    counts = optax.tree_utils.tree_get_all_with_path(state, "count")
    return counts[0][1] if counts else jnp.zeros([], jnp.int32)

  def state_hyper(self, state: Any) -> dict[str, Any]:
    """Hyperparameters read from scalars the optax state keeps beyond its counts (e.g.
    schedule-free's averaging weight, from its weight sum), added to hyper() and xla_hyper().
    `state` is the whole state."""
    return {}

  def advance(self, core: Any, skip: jax.Array) -> Any:
    """The optax part of the state with the scalars it keeps beyond its counts advanced by one
    step as the optax twin advances them, or kept where `skip` (a skipped step). The counts are
    advanced by the generic step."""
    return core

  def leaf_math(self, k: dict[str, jax.Array], g: jax.Array, p: Optional[jax.Array],
                states: list[jax.Array], flags: dict[str, bool]) -> tuple[jax.Array, list]:
    """The family's element math for one leaf as XLA operations, in the kernels' operation
    order, on values of the compute type: (update, new states). ``k`` holds xla_hyper() in the
    compute type's real dtype, ``g`` is unscaled, ``p`` the param value the math reads (the
    master copy with master weights; None when update() got no params)."""
    raise NotImplementedError

  # What the family's math reads the params for, where needs_params says it does (for messages).
  params_role: ClassVar[str] = "weight decay"

  @property
  def needs_params(self) -> bool:
    """Whether update() needs params (e.g. for weight decay)."""
    return bool(self.master_weights) or self.stochastic_rounding

  # ---- derived ---------------------------------------------------------------------------

  @property
  def split_axes(self) -> tuple[str, ...]:
    """The mesh axes a packed state is split over (``packed="data"``), () for none."""
    if isinstance(self.packed, str):
      return (self.packed,)
    return tuple(self.packed) if isinstance(self.packed, tuple) else ()

  @property
  def rounding_seed(self) -> Any:
    return 0 if self.seed is None else self.seed

  @property
  def keeps_master(self) -> bool:
    """Whether the state keeps a master copy of the params (``master_weights=True``)."""
    return self.master_weights is True

  @property
  def keeps_remainders(self) -> bool:
    """Whether the state keeps param remainders (``master_weights="remainder"``)."""
    return self.master_weights == "remainder"

  @property
  def quantizes_states(self) -> bool:
    """Whether large leaves keep their state lists in 8 bits (``moment_bits=8``)."""
    return self.moment_bits == 8

  @property
  def moment_block(self) -> int:
    return self.contract.numbers["moment_block"]

  @property
  def has_extra_state(self) -> bool:
    return bool(self.master_weights) or self.skip_nonfinite

  @property
  def contract(self) -> _ffi.Contract:
    return _ffi.contract(self.op)

  def flag_bits(self) -> int:
    names = self.contract.names["flags"]
    return sum(1 << names.index(k) for k, on in self.flags().items() if on)

  def lists(self, master: bool = False, remainders: bool = False,
            quantized: bool = False) -> dict[str, tuple[str, ...]]:
    """The lists of a call by name: its "operands", "results" and "trailing_operands"."""
    return self.contract.call("lists", flags=self.flag_bits(), master=master,
                              remainders=remainders,
                              stochastic_rounding=self.stochastic_rounding,
                              quantized_states=quantized).names

  def twin_init(self, params: Any, quantized: Optional[list[bool]] = None) -> Any:
    """The optax twin's state for `params`, with the state dtypes of state_dtypes(), and with
    ``moment_bits=8`` each quantizable leaf's states quantized (`quantized`, when given, says
    which: `params` are then chunks of the leaves, checked whole)."""
    state = self.optax_twin().init(params)
    trees = self.states(state)
    dtypes = self.state_dtypes() + [None] * (len(trees) - len(self.state_dtypes()))
    if not any(d is not None for d in dtypes) and not self.quantizes_states:
      return state
    trees = [t if d is None else jax.tree.map(lambda x: x.astype(d), t)
             for t, d in zip(trees, dtypes)]
    if self.quantizes_states and quantized is not None:
      block = self.moment_block
      quantize = lambda signed: lambda q, x: _moments.quantize(x, signed, block) if q else x
      trees = [jax.tree.structure(params).unflatten(
          [quantize(signed)(q, x) for q, x in zip(quantized, jax.tree.leaves(t))])
          for t, signed in zip(trees, self.state_signs())]
    elif self.quantizes_states:
      block = self.moment_block
      for name, p in zip(_trees.leaf_names(params), jax.tree.leaves(params)):
        split = _moments.quantizable(p.shape, p.dtype, block) and \
            _moments.split_block_dims(p, block)
        if split:
          raise ValueError(f"{self.name}: params leaf {name} is sharded along dimension(s) "
                           f"{split}, which its 8-bit blocks of {block} elements run along "
                           "(moment_bits=8); shard it along a dimension before those, or "
                           "replicate it")
      _moments.warn_float_leaves(self.name, params, block)
      quantized = lambda signed: lambda p, x: _moments.quantize(x, signed, block) \
          if _moments.quantizable(p.shape, p.dtype, block) else x
      trees = [jax.tree.map(quantized(signed), params, t)
               for t, signed in zip(trees, self.state_signs())]
    return self.with_states(state, trees)

  def init(self, params: Any, mesh: Any = None) -> Any:
    """The state for `params`: the optax twin's, plus ExtraState; with ``packed`` (or packed
    params) each state list, the master copy and the remainders as a Packed tree, split over
    the mesh axes ``packed`` names (of `mesh`, else the mesh set or the params' own)."""
    params = _trees.as_arrays(params)
    packed_params = _packing.is_packed(params)
    params = params.unpack() if packed_params else params
    if self.split_axes:
      return _split.init(self, params, mesh)
    state = self.unpacked_init(params)
    return self.pack_state(state) if self.packed or packed_params else state

  def pack_state(self, state: Any, pack: Callable[[Any], Any] = _packing.pack) -> Any:
    """`state` (of unpacked params) with its state lists, master copy and remainders each
    `pack`ed."""
    core = state[:-1] if self.has_extra_state else state
    core = self.with_states(core, [pack(t) for t in self.states(state)])
    if not self.has_extra_state:
      return core
    extra = state[-1]
    maybe = lambda t: None if t is None else pack(t)
    return (*core, extra._replace(master_params=maybe(extra.master_params),
                                  param_remainders=maybe(extra.param_remainders)))

  def split_chunks(self, params: Any, shards: int) -> list[int]:
    """Per params leaf, its chunk in a state split in `shards`: a `shards`-th of it, rounded up
    to whole 8-bit blocks where its states are quantized (no block crosses two segments)."""
    chunks = []
    for p in jax.tree.leaves(params):
      unit = self.moment_block if self.quantizes_states and _moments.quantizable(
          jnp.shape(p), p.dtype, self.moment_block) else 1
      share = -(-math.prod(jnp.shape(p)) // shards)
      chunks.append(-(-share // unit) * unit)
    return chunks

  @staticmethod
  def with_extra(core: Any, extra: ExtraState) -> Any:
    """The state of an optimizer with opt-ins: the optax part's entries, then `extra`. A chain's
    state (a tuple) is extended; a single transform's state (a NamedTuple, e.g. schedule-free's)
    becomes the first entry, so that ``state[:-1]`` is the optax part as a tuple either way."""
    return (*core, extra) if type(core) is tuple else (core, extra)

  def unpacked_init(self, params: Any, quantized: Optional[list[bool]] = None) -> Any:
    """The state of (unpacked) `params`, every list a tree like them (`quantized` as
    twin_init() takes it)."""
    self.check(params)
    skipped = jnp.zeros([], jnp.int32) if self.skip_nonfinite else None
    if self.keeps_remainders:
      # The params are the masters' roundings with remainder 0; the state as if the params were
      # the masters.
      remainders = jax.tree.map(
          lambda p: jnp.zeros(p.shape if p.dtype == jnp.bfloat16 else (0,), jnp.int16), params)
      wide = jax.tree.map(lambda p: p.astype(jnp.promote_types(p.dtype, jnp.float32)), params)
      return self.with_extra(self.twin_init(wide, quantized),
                             ExtraState(None, skipped, remainders))
    if not self.master_weights:
      state = self.twin_init(params, quantized)
      return self.with_extra(state, ExtraState(None, skipped)) if self.skip_nonfinite else state
    # A copy even where the dtype stays: the master must not be the params' buffer (both are
    # donated). The state as if the params were the master.
    wide = lambda p: jnp.promote_types(p.dtype, jnp.float32)
    master = jax.tree.map(lambda p: jnp.array(p, dtype=wide(p), copy=True), params)
    return self.with_extra(self.twin_init(master, quantized), ExtraState(master, skipped))

  def check(self, params: Any) -> list[int]:
    """Trace-time checks of params against this spec, naming the leaf. Returns the per-leaf
    tensor flags as the op's bits. Packed params are checked as the tree they pack."""
    if _packing.is_packed(params):
      params = params.layout.shapes()
    _trees.check_float_leaves(params, "params")
    self.check_params(params)
    if self.keeps_remainders:
      for name, p in zip(_trees.leaf_names(params), jax.tree.leaves(params)):
        if p.dtype == jnp.float16:
          raise TypeError(f"{self.name}: params leaf {name} is float16; master_weights="
                          "'remainder' completes bfloat16 params to float32 (use "
                          "master_weights=True for float16)")
    names = self.contract.names["tensor_flags"]
    return [sum(1 << names.index(k) for k, on in f.items() if on)
            for f in self.tensor_flags(params)]
