"""The generic fused optimizer: what every element-wise family (Adam, SGD, Lion, ...) shares.

A family is a :class:`Spec` subclass (its hyperparameters, its optax twin, where its state
lists live in the optax state, its element math as XLA operations) plus a C++ family struct
(csrc/optim/optimizer.h). Everything else is here, written once:

* ``init``: the optax twin's state (so checkpoints move both ways), with an :class:`ExtraState`
  appended for the opt-in master weights and non-finite skipping;
* argument checks at trace time, naming the leaf at fault;
* the optax protocol (``tx.update``): the family's element math as XLA operations, which XLA
  fuses with ``optax.apply_updates`` into one pass, as optax's own step is;
* the in-place step of :func:`jaxfuse.fused_step`: one FFI call per family of dtypes (float32
  math, float64, complex64, complex128) and per MAX_LEAVES_PER_CALL leaves, params, state and
  master copy aliased in place, a jaxfuse clip directly before it folded in, on every device's
  own shards when the leaves are sharded. A trust-ratio family (LAMB, LARS) first sums each
  leaf's squares of params and direction (its trust-sums op; over the devices that split a
  leaf, one small all-reduce), then steps with each leaf's ratio.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, ClassVar, NamedTuple, Optional, Union

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxfuse._core import ffi as _ffi
from jaxfuse._core import partition as _partition
from jaxfuse._core import trees as _trees
from jaxfuse._optim import clip as _clip
from jaxfuse._optim import inplace as _inplace
from jaxfuse._optim import moments as _moments
from jaxfuse._optim import rounding as _rounding

ScalarOrSchedule = Union[float, jax.Array, Callable[[jax.Array], jax.Array]]

# Leaves per optimizer call (kMaxTensorsPerCall in optim/optimizer.h says why): larger trees are
# split into calls of this many.
MAX_LEAVES_PER_CALL = _ffi.contract("jaxfuse_adam").numbers["max_tensors_per_call"]


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


def scalar(value: Any, count: jax.Array) -> Any:
  """A hyperparameter's value at this step: schedules evaluated on the count."""
  return value(count) if callable(value) else value


def one_minus(b: Any) -> Any:
  """``1 - b`` as optax writes it: with a Python float the difference is taken in float64 and
  then rounded, with an array in the array's dtype. The kernels get it precomputed so that the
  rounding matches."""
  return 1.0 - b if isinstance(b, (int, float)) else 1.0 - jnp.asarray(b)


def trust_ratio(p: jax.Array, d: jax.Array, trust_coefficient: Any = 1.0,
                eps: Any = 0.0) -> jax.Array:
  """optax.scale_by_trust_ratio's ratio (min_norm 0) for one whole leaf as XLA operations, in
  the compute type (the kernels sum the squares in float64; optax in the leaf's dtype)."""
  param_norm = jnp.sqrt(jnp.sum(p * p))
  update_norm = jnp.sqrt(jnp.sum(d * d))
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

  def leaf_math(self, k: dict[str, jax.Array], g: jax.Array, p: Optional[jax.Array],
                states: list[jax.Array], flags: dict[str, bool]) -> tuple[jax.Array, list]:
    """The family's element math for one leaf as XLA operations, in the kernels' operation
    order, on values of the compute type: (update, new states). ``k`` holds xla_hyper() in the
    compute type's real dtype, ``g`` is unscaled, ``p`` the param value the math reads (the
    master copy with master weights; None when update() got no params)."""
    raise NotImplementedError

  @property
  def needs_params(self) -> bool:
    """Whether update() needs params (e.g. for weight decay)."""
    return bool(self.master_weights) or self.stochastic_rounding

  # ---- derived ---------------------------------------------------------------------------

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

  def twin_init(self, params: Any) -> Any:
    """The optax twin's state for `params`, with the state dtypes of state_dtypes(), and with
    ``moment_bits=8`` each quantizable leaf's states quantized."""
    state = self.optax_twin().init(params)
    trees = self.states(state)
    dtypes = self.state_dtypes() + [None] * (len(trees) - len(self.state_dtypes()))
    if not any(d is not None for d in dtypes) and not self.quantizes_states:
      return state
    trees = [t if d is None else jax.tree.map(lambda x: x.astype(d), t)
             for t, d in zip(trees, dtypes)]
    if self.quantizes_states:
      block = self.moment_block
      for name, p in zip(_trees.leaf_names(params), jax.tree.leaves(params)):
        split = _moments.quantizable(p.shape, p.dtype, block) and \
            _moments.split_block_dims(p, block)
        if split:
          raise ValueError(f"{self.name}: params leaf {name} is sharded along dimension(s) "
                           f"{split}, which its 8-bit blocks of {block} elements run along "
                           "(moment_bits=8); shard it along a dimension before those, or "
                           "replicate it")
      quantized = lambda signed: lambda p, x: _moments.quantize(x, signed, block) \
          if _moments.quantizable(p.shape, p.dtype, block) else x
      trees = [jax.tree.map(quantized(signed), params, t)
               for t, signed in zip(trees, self.state_signs())]
    return self.with_states(state, trees)

  def init(self, params: Any) -> Any:
    params = _trees.as_arrays(params)
    self.check(params)
    skipped = jnp.zeros([], jnp.int32) if self.skip_nonfinite else None
    if self.keeps_remainders:
      # The params are the masters' roundings with remainder 0; the state as if the params were
      # the masters.
      remainders = jax.tree.map(
          lambda p: jnp.zeros(p.shape if p.dtype == jnp.bfloat16 else (0,), jnp.int16), params)
      wide = jax.tree.map(lambda p: p.astype(jnp.promote_types(p.dtype, jnp.float32)), params)
      return (*self.twin_init(wide), ExtraState(None, skipped, remainders))
    if not self.master_weights:
      state = self.twin_init(params)
      return (*state, ExtraState(None, skipped)) if self.skip_nonfinite else state
    # A copy even where the dtype stays: the master must not be the params' buffer (both are
    # donated). The state as if the params were the master.
    wide = lambda p: jnp.promote_types(p.dtype, jnp.float32)
    master = jax.tree.map(lambda p: jnp.array(p, dtype=wide(p), copy=True), params)
    return (*self.twin_init(master), ExtraState(master, skipped))

  def check(self, params: Any) -> list[int]:
    """Trace-time checks of params against this spec, naming the leaf. Returns the per-leaf
    tensor flags as the op's bits."""
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


# ---- checks and flattening ---------------------------------------------------------------------


def _check_state(spec: Spec, state: Any, params: Any) -> None:
  """Raises unless `state` is what spec.init(params) makes (structure, shapes, dtypes)."""
  expected = jax.eval_shape(spec.init, params)
  exp_def, got_def = jax.tree.structure(expected), jax.tree.structure(state)
  if exp_def != got_def:
    raise ValueError(
        f"jaxfuse: opt_state does not match the state of this {spec.name} transform for these "
        "params (a state from another optimizer, or from init() on other params?)\n"
        f"  expected: {exp_def}\n  got:      {got_def}")
  for name, e, g in zip(_trees.leaf_names(expected), jax.tree.leaves(expected),
                        jax.tree.leaves(state)):
    if jnp.shape(g) != e.shape or jnp.dtype(getattr(g, "dtype", type(g))) != e.dtype:
      raise ValueError(
          f"jaxfuse: opt_state leaf {name} has {jnp.dtype(getattr(g, 'dtype', type(g))).name}"
          f"{list(jnp.shape(g))}, expected {e.dtype.name}{list(e.shape)}")


class _Leaves(NamedTuple):
  """The flat per-leaf lists of one step: grads, params (None in the optax protocol called
  without params), one list per state list, master params (None without master weights),
  param remainders (None without them; a leaf's is empty where it has none), and each leaf's
  place in the params tree (the rounding keys')."""

  grads: list
  params: Optional[list]
  states: list[list]
  master_params: Optional[list]
  remainders: Optional[list]
  positions: list[int]

  def select(self, idx: list[int]) -> "_Leaves":
    pick = lambda x: None if x is None else [x[i] for i in idx]
    remainders = pick(self.remainders)
    if remainders is not None and not any(np.size(r) for r in remainders):
      remainders = None
    return _Leaves(pick(self.grads), pick(self.params), [pick(s) for s in self.states],
                   pick(self.master_params), remainders, pick(self.positions))

  def family(self, i: int) -> tuple[bool, bool, bool, bool]:
    """(computed in double, complex, has remainders, 8-bit states) for leaf i: leaves of one
    family share FFI calls."""
    dtypes = [_state_dtype(x[i]) for x in (self.grads, self.params, *self.states,
                                           self.master_params) if x is not None]
    remainder = self.remainders is not None and np.size(self.remainders[i]) > 0
    return (any(_trees.is_wide(d) for d in dtypes), _trees.is_complex(self.grads[i].dtype),
            remainder, self.quantized(i))

  def quantized(self, i: int) -> bool:
    """Whether leaf i's states are 8-bit codes."""
    return bool(self.states) and _moments.is_quantized(self.states[0][i])


def _state_dtype(x: Any) -> Any:
  """The dtype of a state leaf as the math sees it (a quantized one's values are float32)."""
  return jnp.dtype(jnp.float32) if _moments.is_quantized(x) else x.dtype


def _stand_in_params(spec: Spec, grads: Any, state: Any) -> Any:
  """Shapes and dtypes of the params for checks when update() gets none: the grads' shapes with
  the dtypes of the state that init() would make from them (the optax twin's)."""
  shapes = jax.tree.map(lambda g: jax.ShapeDtypeStruct(jnp.shape(g), g.dtype), grads)
  return shapes if not spec.states(state) else jax.tree.structure(grads).unflatten(
      [jax.ShapeDtypeStruct(jnp.shape(g), _state_dtype(s)) for g, s in
       zip(jax.tree.leaves(grads), jax.tree.structure(grads).flatten_up_to(
           spec.states(state)[-1]))])


def _checked_leaves(spec: Spec, grads: Any, state: Any, params: Any) -> tuple[_Leaves, list[int]]:
  """Checks one step's arguments (naming the leaf at fault) and flattens them: the per-leaf
  lists and the tensor flags. All leaves are JAX arrays (as_arrays)."""
  _trees.check_float_leaves(grads, "grads")
  reference = _stand_in_params(spec, grads, state) if params is None else params
  flags = spec.check(reference)
  _trees.check_same_structure(reference, grads, "params", "grads")
  _check_state(spec, state, reference)
  treedef = jax.tree.structure(grads)
  leaves = _Leaves(jax.tree.leaves(grads), None if params is None else jax.tree.leaves(params),
                   [treedef.flatten_up_to(s) for s in spec.states(state)],
                   treedef.flatten_up_to(state[-1].master_params) if spec.keeps_master
                   else None,
                   treedef.flatten_up_to(state[-1].param_remainders) if spec.keeps_remainders
                   else None,
                   list(range(treedef.num_leaves)))
  return leaves, flags


def _count(state: Any) -> jax.Array:
  """The step count the schedules and bias corrections read: the first ``count`` in the state
  (every optax count advances together), zero when the state keeps none."""
  counts = optax.tree_utils.tree_get_all_with_path(state, "count")
  return counts[0][1] if counts else jnp.zeros([], jnp.int32)


def _new_state(spec: Spec, state: Any, treedef: Any, states: list[list],
               master_params: Optional[list], remainders: Optional[list], count: jax.Array,
               skip: jax.Array) -> Any:
  """The state after a step: state lists, master params, remainders and skip count replaced,
  and every optax `count` in it (the family's, the schedules') advanced together."""
  core = state[:-1] if spec.has_extra_state else state
  core = spec.with_states(core, [treedef.unflatten(s) for s in states])
  if spec.has_extra_state:
    extra = state[-1]
    core = (*core, ExtraState(
        treedef.unflatten(master_params) if spec.keeps_master else None,
        extra.skipped_steps + skip.astype(jnp.int32) if spec.skip_nonfinite else None,
        treedef.unflatten(remainders) if spec.keeps_remainders else None))
  if optax.tree_utils.tree_get_all_with_path(core, "count"):
    core = optax.tree_utils.tree_set(core, count=count)
  return core


# ---- gradient control ------------------------------------------------------------------------


def default_grad_ctrl(grad_scale: Any = None) -> jax.Array:
  """Gradient control (GradCtrl in norm_math.h): a loss scale (default 1), no clipping, no skip."""
  return _ffi.device_vector(_clip.GRAD_CTRL_NAMES, clip_div=1.0, clip_mul=1.0, skip=0.0,
                            loss_scale=1.0 if grad_scale is None else grad_scale)


def grad_ctrl_for(spec: Spec, grads: Any, grad_scale: Any = None, *, clip_max_norm: Any = None,
                  need_norm: bool = False, axis_name: Any = None):
  """(global norm or None, gradient-control vector) for one step. The global-norm op runs only
  when something needs it (clipping, the non-finite check, or the norm itself); a bare loss
  scale goes into the vector directly."""
  if clip_max_norm is not None or spec.skip_nonfinite or need_norm:
    return _clip.norm_and_grad_ctrl(grads, max_norm=clip_max_norm, grad_scale=grad_scale,
                              skip_nonfinite=spec.skip_nonfinite, axis_name=axis_name)
  return None, default_grad_ctrl(grad_scale)


def _skip_flag(grad_ctrl: jax.Array) -> jax.Array:
  return grad_ctrl[_clip.GRAD_CTRL_NAMES.index("skip")] != 0


# ---- the optax protocol: XLA element math ------------------------------------------------------


def _compute_dtype(*dtypes) -> Any:
  """The type a leaf is computed in (optimizer.h): float32, float64 where a buffer is 64-bit,
  and the complex type of that width for complex leaves."""
  wide = any(_trees.is_wide(d) for d in dtypes)
  if any(_trees.is_complex(d) for d in dtypes):
    return jnp.dtype(jnp.complex128 if wide else jnp.complex64)
  return jnp.dtype(jnp.float64 if wide else jnp.float32)


def _output_dtype(spec: Spec, grad: jax.Array, states: list) -> Any:
  # optax's updates have the grads' dtype, or wider where its math promotes them (a wider
  # state dtype). Where jaxfuse rounds the params' new value the update is the step between two
  # values of the params' dtype: exact in the grads' dtype with master weights (as before), and
  # in float32 or wider with remainders and stochastic rounding, whose 16-bit params often step
  # across zero (a bf16 difference is exact only between values within a factor 2).
  if spec.keeps_remainders or spec.stochastic_rounding:
    return jnp.promote_types(grad.dtype, jnp.float32)
  if spec.master_weights:
    return grad.dtype
  return jnp.result_type(grad.dtype, *[s.dtype for s in states])


class _LeafParams(NamedTuple):
  """How one leaf's params are kept, for _leaf_update: its params, master copy, remainder
  (None where it has none) and random stream (None unless it is rounded stochastically)."""

  params: Optional[jax.Array]
  master: Optional[jax.Array] = None
  remainder: Optional[jax.Array] = None
  stream: Optional[jax.Array] = None

  def source(self) -> Optional[jax.Array]:
    """The value the math reads: the master (kept, or joined from the remainder) or params."""
    if self.remainder is not None:
      return _rounding.join_remainder(self.params, self.remainder)
    return self.master if self.master is not None else self.params

  def stored(self, value: jax.Array) -> tuple[jax.Array, Optional[jax.Array]]:
    """(new params, new remainder or None) that store the new master `value`."""
    if self.remainder is not None:
      return _rounding.split_remainder(value)
    if self.stream is not None:
      bits = _rounding.element_bits(self.stream, value.shape)
      return _rounding.stochastic_round(value, self.params.dtype, bits), None
    return value.astype(self.params.dtype), None


def _leaf_update(spec: Spec, h: dict, g, leaf: _LeafParams, states: list, flags: dict,
                 skip) -> tuple:
  """optimizer_group() (optimizer.h) for one leaf as XLA operations, in the same operation
  order: (update, new states, new master or None, new remainder or None)."""
  p, master = leaf.params, leaf.master
  stored_states = states  # as kept: 8-bit ones are QuantizedMoments
  states = [_moments.dequantize(s) if _moments.is_quantized(s) else s for s in states]
  c = _compute_dtype(*[x.dtype for x in (g, p, *states, master) if x is not None])
  real = jnp.finfo(c).dtype
  k = {name: jnp.asarray(x, real) for name, x in h.items()}
  gc = g.astype(c)
  if "loss_scale" in k:
    gc = gc / k["loss_scale"]
  source = leaf.source()
  u, new_states = spec.leaf_math(k, gc, None if source is None else source.astype(c),
                                 [s.astype(c) for s in states], flags)
  new_master = new_remainder = None
  if master is not None or leaf.remainder is not None or leaf.stream is not None:
    # The exact step from the params to the new value's rounding: both are values of the
    # params' dtype, so the difference is exact when they are within a factor 2 of each other
    # (Sterbenz), and optax.apply_updates lands on it.
    new_value = source.astype(c) + u
    new_params, new_remainder = leaf.stored(new_value)
    u = new_params.astype(c) - p.astype(c)
    new_master = new_value if master is not None else None
  def keep(new, old):
    if old is None:
      return None
    new = _moments.like(new, old) if _moments.is_quantized(old) else new.astype(old.dtype)
    return new if skip is None else jax.tree.map(lambda n, o: jnp.where(skip, o, n), new, old)

  out_dtype = _output_dtype(spec, g, states)
  update = u.astype(out_dtype) if skip is None else jnp.where(skip, 0, u.astype(out_dtype))
  return (update, [keep(n, o) for n, o in zip(new_states, stored_states)],
          keep(new_master, master),
          keep(new_remainder, leaf.remainder))


def _leaf_params(spec: Spec, leaves: "_Leaves", i: int, count: jax.Array) -> _LeafParams:
  """How leaf i's params are kept, in the optax protocol (one device's view: a leaf's stream
  is its shard 0's)."""
  pick = lambda x: None if x is None else x[i]
  p = pick(leaves.params)
  remainder = pick(leaves.remainders)
  stream = None
  if spec.stochastic_rounding and p is not None and p.dtype in _rounding.ROUNDED_DTYPES:
    stream = _rounding.stream(spec.rounding_seed, leaves.positions[i], 0, count)
  return _LeafParams(p, pick(leaves.master_params),
                     remainder if remainder is not None and remainder.size else None, stream)


def xla_updates(spec: Spec, grads: Any, state: Any, params: Any,
                grad_scale: Any = None) -> tuple[Any, Any]:
  """The optax protocol: (updates, new_state), params untouched, with the element math as XLA
  operations, so that XLA fuses it with what consumes the updates (``optax.apply_updates``):
  the step then reads and writes each buffer once, as optax's does, on every backend. The math
  is the kernels' (16-bit leaves computed in float32 and rounded once, master weights, loss
  scale); with ``skip_nonfinite`` one global-norm call decides the skip."""
  grads, state, params = _trees.as_arrays((grads, state, params))
  leaves, flags = _checked_leaves(spec, grads, state, params)
  names = spec.contract.names["tensor_flags"]
  skip = None
  if spec.skip_nonfinite:
    skip = _skip_flag(grad_ctrl_for(spec, grads, grad_scale)[1])
  count = _count(state)
  h = spec.xla_hyper(count)
  if grad_scale is not None:
    h["loss_scale"] = grad_scale
  n = len(leaves.grads)
  outputs, masters = [None] * n, [None] * n
  remainders = list(leaves.remainders) if leaves.remainders is not None else None
  states = [[None] * n for _ in leaves.states]
  for i in range(n):
    u, new_states, new_master, new_remainder = _leaf_update(
        spec, h, leaves.grads[i], _leaf_params(spec, leaves, i, count),
        [s[i] for s in leaves.states],
        {name: bool(flags[i] >> b & 1) for b, name in enumerate(names)}, skip)
    outputs[i], masters[i] = u, new_master
    if new_remainder is not None:
      remainders[i] = new_remainder
    for s, x in zip(states, new_states):
      s[i] = x
  t = optax.safe_increment(count)
  treedef = jax.tree.structure(grads)
  return treedef.unflatten(outputs), _new_state(
      spec, state, treedef, states, masters if spec.keeps_master else None, remainders,
      t if skip is None else jnp.where(skip, count, t),
      jnp.bool_(False) if skip is None else skip)


# ---- the fused in-place step: the kernels ------------------------------------------------------


def _trust_sums(spec: Spec, shards: _partition.Shards, fixed: list, lists: dict[str, list],
                flags: list[int], first_operand: dict[str, int]) -> jax.Array:
  """The trust_sums operand of a trust-ratio family's call (optimizer.h), inside its body: one
  call of the family's trust-sums op (trust_sums.h) over this device's shards, and when leaves
  are split over devices, each device's sums in its own row of a zero matrix (only the first
  replica of a leaf counts it), all-reduced: every device then adds the same rows in the same
  order. ``first_operand`` gives each list's first operand index (for the shards' axes)."""
  op = spec.contract.names["trust_sums_op"][0]
  contract = _ffi.traced_contract(op)  # its workspace is a partial per multi-tensor chunk
  words = contract.numbers["sum_words"]
  chunk = contract.numbers["chunk_scalars"]
  source = "master_params" if lists.get("master_params") is not None else "params"
  names = ["grads", source,
           *spec.lists()["operands"][2:2 + contract.numbers["direction_states"]]]
  n = len(lists["grads"])
  operands = []
  for name in names:
    at = first_operand[name]
    operands += [_partition.without_padding(shards, at + i, x) for i, x in enumerate(lists[name])]
  chunks = sum(-(-x.size // chunk) for x in lists["grads"])
  call = jax.ffi.ffi_call(
      _ffi.target(op),
      [jax.ShapeDtypeStruct((n, words), jnp.uint32),
       jax.ShapeDtypeStruct((chunks * contract.numbers["partial_bytes"],), jnp.uint8)],
      vmap_method="sequential")
  sums, _ = call(*fixed, *operands, num_tensors=np.int64(n), flags=np.int64(spec.flag_bits()),
                 tensor_flags=np.asarray(flags, np.uint8))
  if not shards.axis_names:
    return sums[None]
  axes = shards.axis_names
  firsts = [_partition.first_replica(shards, first_operand["params"] + i) for i in range(n)]
  own = jnp.where(jnp.stack(firsts)[:, None], sums, jnp.zeros_like(sums))
  rows = jnp.zeros((shards.size(axes), n, words), jnp.uint32)
  return jax.lax.psum(rows.at[_partition.linear_index(shards, axes)].set(own), axes)


def _rounding_keys(spec: Spec, positions: list[int]) -> jax.Array:
  """The rounding_keys operand (rounding.h's RoundingKey rows) of a call over the leaves at
  `positions` in the params tree, its shard column 0 (_with_shards fills it in)."""
  names = spec.contract.names["rounding_key"]
  n = len(positions)
  columns = {"seed": jnp.full(n, spec.rounding_seed, jnp.uint32),
             "leaf": jnp.asarray(positions, jnp.uint32), "shard": jnp.zeros(n, jnp.uint32)}
  return jnp.stack([columns[name] for name in names], axis=1)


def _with_shards(spec: Spec, keys: jax.Array, shards: _partition.Shards,
                 params_operand: int) -> jax.Array:
  """`keys` inside a call's body with each leaf's shard column set: this device's place among
  the shards of each leaf split over devices (replicas of a shard agree, so they store the same
  bits)."""
  if not shards.axis_names:
    return keys
  index = [_partition.linear_index(
      shards, [a for dim in shards.operand_axes[params_operand + i] for a in dim])
      for i in range(keys.shape[0])]
  column = spec.contract.names["rounding_key"].index("shard")
  return keys.at[:, column].set(jnp.stack(index).astype(jnp.uint32))


def _scales(state_list: str) -> str:
  """The name of a state list's block-scale list (optimizer.h's list_name())."""
  return f"{state_list}_scales"


def _check_whole_blocks(spec: Spec, local: tuple, first_operand: dict[str, int], state: str,
                       positions: list[int]) -> None:
  """Raises unless each leaf's local shard holds its 8-bit states' whole blocks: a leaf split
  along a dimension its blocks run along is refused (its scales are not split there)."""
  for i, position in enumerate(positions):
    codes = local[first_operand[state] + i]
    scales = local[first_operand[_scales(state)] + i]
    if codes.size != scales.size * spec.moment_block:
      raise ValueError(
          f"{spec.name}: params leaf number {position} (in tree order) is split along one of "
          f"its dimensions {list(range(scales.ndim - 1, codes.ndim))}, which its 8-bit blocks "
          f"of {spec.moment_block} elements run along (moment_bits=8); shard it along one of "
          f"its first {scales.ndim - 1} dimensions, or replicate it")


def _ffi_call(spec: Spec, count, hyper, grad_ctrl, leaves: _Leaves,
              flags: list[int]) -> tuple[jax.Array, dict[str, list]]:
  """One FFI call of the family's op over `leaves`, in place, on every device's own shards when
  they are sharded. Returns (new count, result leaves by list name)."""
  n = len(leaves.grads)
  master = leaves.master_params is not None
  remainders = leaves.remainders is not None
  quantized = leaves.quantized(0)
  call_lists = spec.lists(master, remainders, quantized)
  operand_lists, result_lists = call_lists["operands"], call_lists["results"]
  state_names = operand_lists[2:2 + len(leaves.states)]
  by_name = dict(grads=leaves.grads, params=leaves.params, master_params=leaves.master_params,
                 param_remainders=leaves.remainders)
  for name, states in zip(state_names, leaves.states):
    by_name[name] = [s.codes for s in states] if quantized else states
    if quantized:
      by_name[_scales(name)] = [s.scales for s in states]
  fixed = dict(count=count, hyper=hyper, grad_ctrl=grad_ctrl)
  fixed_names = spec.contract.names["fixed_operands"]
  operands = [fixed[name] for name in fixed_names]
  operands += [x for name in operand_lists for x in by_name[name]]
  aliases = _ffi.aliases(operand_lists, result_lists, n, operand_offset=len(fixed_names),
                         result_offset=len(spec.contract.names["fixed_results"]))

  first_operand = {name: len(fixed) + k * n for k, name in enumerate(operand_lists)}
  num_list_operands = len(operands)
  if "rounding_keys" in call_lists["trailing_operands"]:
    operands.append(_rounding_keys(spec, leaves.positions))  # whole: the body sets its shards

  def body(shards, *local):
    # Elementwise: each device updates its own shards (trust ratios need whole leaves' sums).
    trailing = []
    for name in call_lists["trailing_operands"]:
      if name == "trust_sums":
        trailing.append(_trust_sums(
            spec, shards, list(local[:len(fixed)]),
            {name: list(local[at:at + n]) for name, at in first_operand.items()}, flags,
            first_operand))
      else:
        trailing.append(_with_shards(spec, local[num_list_operands], shards,
                                     first_operand["params"]))
    if quantized:
      _check_whole_blocks(spec, local, first_operand, state_names[0], leaves.positions)
    call = jax.ffi.ffi_call(_ffi.target(spec.op),
                            [jax.ShapeDtypeStruct((), jnp.int32)]
                            + [jax.ShapeDtypeStruct(jnp.shape(x), x.dtype)
                               for x in [local[first_operand[name] + i]
                                         for name in result_lists for i in range(n)]],
                            input_output_aliases=aliases, vmap_method="sequential")
    return call(*local[:num_list_operands], *trailing, num_tensors=np.int64(n),
                flags=np.int64(spec.flag_bits()),
                master=master, remainders=remainders,
                stochastic_rounding=spec.stochastic_rounding, quantized_states=quantized,
                tensor_flags=np.asarray(flags, np.uint8))

  leaf_dims = _partition.leaf_dims(leaves.grads, "leaf")
  # A block scale's last dimension counts blocks: never split (a leaf split along a dimension
  # its blocks run along is refused in the body); its others are the leaf's leading ones.
  scales_ndim = [jnp.ndim(s.scales) for s in leaves.states[0]] if quantized else []
  block_dims = tuple((*dims[:k - 1], None) for dims, k in zip(leaf_dims, scales_ndim))
  scale_lists = {_scales(name) for name in state_names}
  list_dims = lambda name: block_dims if name in scale_lists else leaf_dims
  keys = tuple(operands[num_list_operands:])
  partition = _partition.Layout(
      operands=tuple(_partition.whole(x) for x in operands[:len(fixed)])
      + sum((list_dims(name) for name in operand_lists), ())
      + tuple(_partition.whole(x) for x in keys),
      results=((),) + sum((list_dims(name) for name in result_lists), ()),
      names=tuple(fixed_names)
      + tuple(f"{name} leaf {i}" for name in operand_lists for i in range(n))
      + ("rounding_keys",) * len(keys),
      # The state written back keeps its sharding; the gradients follow it.
      prefer=tuple(len(fixed) + k * n + i for k, name in enumerate(operand_lists)
                   if name != "grads" for i in range(n)))
  out = _partition.partitioned_call(spec.name, body, partition, operands)
  lists = {name: list(out[1 + i * n:1 + (i + 1) * n]) for i, name in enumerate(result_lists)}
  return out[0], lists


def _calls(leaves: _Leaves, nonempty: list[int]) -> list[list[int]]:
  """The leaves of each FFI call: the ``nonempty`` ones, one family (compute type, real or
  complex, with remainders or not) per call, at most MAX_LEAVES_PER_CALL each."""
  families: dict[tuple[bool, bool, bool], list[int]] = {}
  for i in nonempty:
    families.setdefault(leaves.family(i), []).append(i)
  return [idx[k:k + MAX_LEAVES_PER_CALL] for idx in families.values()
          for k in range(0, len(idx), MAX_LEAVES_PER_CALL)]


def in_place(spec: Spec, grads: Any, state: Any, params: Any,
             grad_ctrl: Optional[jax.Array] = None) -> tuple[Any, Any]:
  """The fused step: (new_params, new_state), params, state lists and master params updated in
  place. `grad_ctrl` is the gradient-control vector (loss scale, clip divisor and multiplier,
  skip flag) that the global-norm kernel produces; None means no clip, no loss scale, and with
  `skip_nonfinite` the caller must pass the vector of a norm call made with it."""
  grads, state, params = _trees.as_arrays((grads, state, params))
  if params is None:
    raise ValueError("jaxfuse.fused_step: params are required")
  leaves, flags = _checked_leaves(spec, grads, state, params)
  if grad_ctrl is None:
    if spec.skip_nonfinite:
      raise ValueError("jaxfuse: skip_nonfinite needs the control vector of a norm call")
    grad_ctrl = default_grad_ctrl()
  count = _count(state)
  hyper = _ffi.device_vector(spec.contract.names["hyper"], **spec.hyper(count))
  new_params = list(leaves.params)  # a zero-size leaf is its own result: no call
  states = [list(s) for s in leaves.states]
  masters = None if leaves.master_params is None else list(leaves.master_params)
  remainders = None if leaves.remainders is None else list(leaves.remainders)
  new_count = None
  state_lists = spec.lists()["operands"][2:]
  for idx in _calls(leaves, _trees.nonempty(leaves.grads)):
    c, out = _ffi_call(spec, count, hyper, grad_ctrl, leaves.select(idx), [flags[i] for i in idx])
    new_count = c if new_count is None else new_count
    for k, i in enumerate(idx):
      new_params[i] = out["params"][k]
      for s, name in zip(states, state_lists):
        s[i] = _moments.QuantizedMoment(out[name][k], out[_scales(name)][k]) \
            if _scales(name) in out else out[name][k]
      if masters is not None:
        masters[i] = out["master_params"][k]
      if "param_remainders" in out:
        remainders[i] = out["param_remainders"][k]
  skip = _skip_flag(grad_ctrl)
  if new_count is None:  # no element anywhere: the count still advances, as in optax
    new_count = jnp.where(skip, count, optax.safe_increment(count))
  treedef = jax.tree.structure(params)
  return treedef.unflatten(new_params), _new_state(spec, state, treedef, states, masters,
                                                   remainders, new_count, skip)


def _update_in_place(spec: Spec, step: _inplace.InPlaceStep, grads: Any, state: Any,
                     params: Any) -> tuple[Any, Any]:
  """The optimizer of a fused_step: params and state updated in place (a jaxfuse clip directly
  before it folded in), the new params recorded; the updates returned are placeholders."""
  if params is None:
    raise ValueError("jaxfuse.fused_step: params are required")
  clip = step.take_clip(grads)
  norm, grad_ctrl = grad_ctrl_for(spec, grads, step.grad_scale,
                                  clip_max_norm=None if clip is None else clip.max_norm,
                                  need_norm=step.need_norm,
                                  axis_name=None if clip is None else clip.axis_name)
  new_params, new_state = in_place(spec, grads, state, params, grad_ctrl)
  placeholders = jax.tree.map(jnp.zeros_like, _trees.as_arrays(grads))
  step.record_step(spec.name, new_params, norm, placeholders)
  return placeholders, new_state


def transform(spec: Spec) -> optax.GradientTransformationExtraArgs:
  """The optax transform of `spec`: the optax protocol, or the in-place step under
  :func:`jaxfuse.fused_step`."""
  spec.check_options()  # also fails early when the op is not built

  def init_fn(params):
    return spec.init(params)

  def update_fn(updates, state, params=None, *, grad_scale=None, **extra_args):
    del extra_args
    if params is None and spec.needs_params:
      why = "master weights" if spec.master_weights else "stochastic rounding" \
          if spec.stochastic_rounding else "weight decay"
      raise ValueError(f"{spec.name}: update() needs params (for {why}), as optax's does")
    step = _inplace.current()
    if step is not None:
      return _update_in_place(spec, step, updates, state, params)
    return xla_updates(spec, updates, state, params, grad_scale)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
