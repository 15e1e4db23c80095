"""One step's arguments, checked (naming the leaf at fault) and flattened into per-leaf lists;
the state after a step; and gradient control (loss scale, clip, non-finite skip): what the optax
protocol (xla_path.py) and the fused in-place step (kernel_path.py) share."""

from __future__ import annotations

import functools
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxfuse._core import ffi as _ffi
from jaxfuse._core import packing as _packing
from jaxfuse._core import partition as _partition
from jaxfuse._core import trees as _trees
from jaxfuse._optim import clip as _clip
from jaxfuse._optim import moments as _moments
from jaxfuse._optim.spec import ExtraState, Spec


def _check_packed_state(spec: Spec, expected: Any, state: Any) -> None:
  """Raises, naming the leaf, where `state` holds a packed tree laid out for other params than
  the `expected` state's, or is packed where it is not expected to be or the reverse."""
  packed = _packing.is_packed
  exp = jax.tree.leaves(expected, is_leaf=packed)
  got = jax.tree.leaves(state, is_leaf=packed)
  expect_packed, got_packed = any(map(packed, exp)), any(map(packed, got))
  if expect_packed != got_packed:
    raise ValueError(
        f"jaxfuse: opt_state is {'' if got_packed else 'not '}packed, this {spec.name} "
        f"transform's state for these params is{'' if expect_packed else ' not'} (packed=True, "
        "or packed params); jaxfuse.convert_state moves a state between the two")
  for e, g in zip(exp, got):
    if packed(e) and packed(g) and e.layout != g.layout:
      raise ValueError("jaxfuse: opt_state was packed for other params: "
                       + _packing.layout_difference(e.layout, g.layout))


def _check_state(spec: Spec, state: Any, params: Any) -> None:
  """Raises unless `state` is what spec.init(params) makes (structure, shapes, dtypes)."""
  mesh = _partition.mesh_with(spec.split_axes, state, params) if spec.split_axes else None
  expected = jax.eval_shape(functools.partial(spec.init, mesh=mesh), params)
  exp_def, got_def = jax.tree.structure(expected), jax.tree.structure(state)
  if exp_def != got_def:
    _check_packed_state(spec, expected, state)
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


class Slot:
  """A leaf of a packed tree in the fused step (:mod:`jaxfuse._core.packing`): the index of its
  buffer in the step's buffer table (Leaves.buffers) and its place there."""

  def __init__(self, buffer: int, place: _packing.Place):
    self.buffer, self.place = buffer, place
    self.shape, self.dtype, self.size = place.shape, jnp.dtype(place.dtype), place.size
    self.offset = place.offset


def is_slot(x: Any) -> bool:
  return isinstance(x, Slot)


def _size(x: Any) -> int:
  return x.size if hasattr(x, "size") else np.size(x)


class Leaves(NamedTuple):
  """The flat per-leaf lists of one step: grads, params (None in the optax protocol called
  without params), one list per state list, master params (None without master weights),
  param remainders (None without them; a leaf's is empty where it has none), and each leaf's
  place in the params tree (the rounding keys'). In the fused step a leaf of a packed tree is a
  Slot into `buffers`, the step's packed buffers (a call replaces the ones it updates)."""

  grads: list
  params: Optional[list]
  states: list[list]
  master_params: Optional[list]
  remainders: Optional[list]
  positions: list[int]
  buffers: Optional[list] = None

  def select(self, idx: list[int]) -> "Leaves":
    pick = lambda x: None if x is None else [x[i] for i in idx]
    remainders = pick(self.remainders)
    if remainders is not None and not any(_size(r) for r in remainders):
      remainders = None
    return Leaves(pick(self.grads), pick(self.params), [pick(s) for s in self.states],
                   pick(self.master_params), remainders, pick(self.positions), self.buffers)

  def buffer_key(self, i: int) -> tuple:
    """The packed buffers leaf i's lists live in: leaves of one call share them."""
    items = [x[i] for x in (self.grads, self.params, self.master_params, self.remainders)
             if x is not None] + [s[i] for s in self.states]
    items = [y for x in items for y in (x if _moments.is_quantized(x) else [x])]
    return tuple(x.buffer if is_slot(x) else None for x in items)

  def family(self, i: int) -> tuple[bool, bool, bool, bool]:
    """(computed in double, complex, has remainders, 8-bit states) for leaf i: leaves of one
    family share FFI calls."""
    dtypes = [state_dtype(x[i]) for x in (self.grads, self.params, *self.states,
                                           self.master_params) if x is not None]
    remainder = self.remainders is not None and _size(self.remainders[i]) > 0
    return (any(_trees.is_wide(d) for d in dtypes), _trees.is_complex(self.grads[i].dtype),
            remainder, self.quantized(i))

  def quantized(self, i: int) -> bool:
    """Whether leaf i's states are 8-bit codes."""
    return bool(self.states) and _moments.is_quantized(self.states[0][i])


def state_dtype(x: Any) -> Any:
  """The dtype of a state leaf as the math sees it (a quantized one's values are float32)."""
  return jnp.dtype(jnp.float32) if _moments.is_quantized(x) else x.dtype


def _stand_in_params(spec: Spec, grads: Any, state: Any) -> Any:
  """Shapes and dtypes of the params for checks when update() gets none: the grads' shapes with
  the dtypes of the state that init() would make from them (the optax twin's); packed grads
  stand for packed params of their own layout."""
  shapes = jax.tree.map(lambda g: jax.ShapeDtypeStruct(jnp.shape(g), g.dtype), grads)
  if _packing.is_packed(grads) or not spec.states(state):
    return shapes
  last = _packing.unpack_shapes(spec.states(state)[-1])
  return jax.tree.structure(grads).unflatten(
      [jax.ShapeDtypeStruct(jnp.shape(g), state_dtype(s)) for g, s in
       zip(jax.tree.leaves(grads), jax.tree.structure(grads).flatten_up_to(last))])


def _per_leaf(tree: Any, treedef: Any, buffers: list) -> list:
  """`tree` (like the params) as one entry per params leaf; a Packed tree's leaves are Slots into
  `buffers`, to which its buffers are appended."""
  if _packing.is_packed(tree):
    base = len(buffers)
    buffers.extend(tree.buffers)
    tree = tree.layout.treedef.unflatten([Slot(base + p.buffer, p) for p in tree.layout.places])
  return treedef.flatten_up_to(tree)


def checked_leaves(spec: Spec, grads: Any, state: Any, params: Any) -> tuple[Leaves, list[int]]:
  """Checks one step's arguments (naming the leaf at fault) and flattens them: the per-leaf
  lists and the tensor flags. All leaves are JAX arrays (as_arrays); packed trees (params and
  grads, the state's lists) give Slots into the Leaves' buffers."""
  reference, flags = check_arguments(spec, grads, state, params)
  return flat_leaves(spec, grads, state, params), flags


def flat_leaves(spec: Spec, grads: Any, state: Any, params: Any) -> Leaves:
  """The per-leaf lists of one step's (checked) arguments; packed trees give Slots into the
  Leaves' buffers."""
  treedef = grads.layout.treedef if _packing.is_packed(grads) else jax.tree.structure(grads)
  buffers: list = []
  leaf = lambda tree: None if tree is None else _per_leaf(tree, treedef, buffers)
  grads_, params_, *states, master, remainders = [
      leaf(t) for t in _packed_trees(spec, grads, state, params)]
  return Leaves(grads_, params_, states, master, remainders, list(range(treedef.num_leaves)),
                buffers)


def check_arguments(spec: Spec, grads: Any, state: Any, params: Any) -> tuple[Any, list[int]]:
  """Checks one step's arguments, naming the leaf at fault: (the params, or a stand-in for them
  with their shapes and dtypes when update() got none; the tensor flags)."""
  _trees.check_float_leaves(grads, "grads")
  reference = _stand_in_params(spec, grads, state) if params is None else params
  flags = spec.check(reference)
  _check_packed_grads(reference, grads)
  _trees.check_same_structure(reference, grads, "params", "grads")
  _check_state(spec, state, reference)
  return reference, flags


def _packed_trees(spec: Spec, grads: Any, state: Any, params: Any) -> list:
  """The trees checked_leaves flattens, in its order."""
  return [grads, params, *spec.states(state),
          state[-1].master_params if spec.keeps_master else None,
          state[-1].param_remainders if spec.keeps_remainders else None]


def packed_results(spec: Spec, grads: Any, state: Any, params: Any, buffers: list) -> list:
  """For each of params, the state lists, master params and remainders: the Packed tree with
  its buffers now at its place in `buffers` (the table checked_leaves filled), or None where
  the tree is not packed."""
  out, at = [], 0
  for tree in _packed_trees(spec, grads, state, params):
    if _packing.is_packed(tree):
      out.append(_packing.Packed(buffers[at:at + len(tree.buffers)], tree.layout))
      at += len(tree.buffers)
    else:
      out.append(None)
  return out[1:]


def _check_packed_grads(params: Any, grads: Any) -> None:
  """Raises unless packed params get grads packed alike (the gradient of the packed params)."""
  if not _packing.is_packed(params):
    return
  if not _packing.is_packed(grads):
    raise TypeError("jaxfuse: the params are packed (jaxfuse.pack) and the grads are not; take "
                    "the gradient with respect to the packed params (jax.grad(lambda p: "
                    "loss(jaxfuse.unpack(p)))(packed)) so that it is packed alike")
  if grads.layout != params.layout:
    raise ValueError(f"jaxfuse: the grads are packed as {grads.layout!r}, the params as "
                     f"{params.layout!r}: not the gradient of these params")


def new_state(spec: Spec, state: Any, states: list, master_params: Any, remainders: Any,
              count: jax.Array, skip: jax.Array) -> Any:
  """The state after a step: its state-list trees, master params and remainders (trees like the
  params, or Packed ones; None where the spec keeps none) replaced, the skip count advanced,
  every optax `count` in it (the family's, the schedules') advanced together, and the family's
  own scalars (Spec.advance) advanced unless `skip`."""
  core = state[:-1] if spec.has_extra_state else state
  core = spec.advance(spec.with_states(core, states), skip)
  if spec.has_extra_state:
    extra = state[-1]
    core = (*core, ExtraState(
        master_params if spec.keeps_master else None,
        extra.skipped_steps + skip.astype(jnp.int32) if spec.skip_nonfinite else None,
        remainders if spec.keeps_remainders else None))
  if optax.tree_utils.tree_get_all_with_path(core, "count"):
    core = optax.tree_utils.tree_set(core, count=count)
  return core


# ---- gradient control ----------------------------------------------------------------------------


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


def skip_flag(grad_ctrl: jax.Array) -> jax.Array:
  return grad_ctrl[_clip.GRAD_CTRL_NAMES.index("skip")] != 0
