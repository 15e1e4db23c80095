"""Moving optimizer states between precisions: the full-precision params any jaxfuse state keeps,
and a state converted to another transform's layout (e.g. optax's AdamW to jaxfuse's AdamW with
bf16 moments and param remainders, and back), also inside chains."""

from __future__ import annotations

from typing import Any, Optional

import jax
import jax.numpy as jnp
import optax

from jaxfuse._core import packing as _packing
from jaxfuse._core import trees as _trees
from jaxfuse._optim import moments as _moments
from jaxfuse._optim import rounding as _rounding
from jaxfuse._optim.spec import ExtraState


def _is_optimizer_state(x: Any) -> bool:
  """Whether `x` is a jaxfuse optimizer's state with opt-ins: optax's part, then ExtraState."""
  return isinstance(x, tuple) and bool(x) and isinstance(x[-1], ExtraState)


def _extras(state: Any) -> list[ExtraState]:
  """The ExtraStates in `state` (a transform's, or those inside a chain or partition)."""
  return [x for x in jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, ExtraState))
          if isinstance(x, ExtraState)]


def _extra(state: Any) -> ExtraState:
  """The first ExtraState in `state`, or an empty one."""
  found = _extras(state)
  return found[0] if found else ExtraState()


def master_params(params: Any, state: Any) -> Any:
  """The full-precision params that `state` (of a jaxfuse or optax transform, or a chain ending
  in one) keeps for `params`: its master copy, the params joined to their remainders
  (``master_weights="remainder"``), or else the params themselves, in float32 or wider. A state
  whose groups each keep theirs (``jaxfuse.muon``'s, an ``optax.partition`` of jaxfuse
  optimizers) gives each leaf its group's. Packed params and states (``packed=True``,
  :func:`jaxfuse.pack`) give the tree of leaves."""
  params, state = _packing.unpack(_trees.as_arrays(params)), _packing.unpack(state)
  extras = _extras(state) or [ExtraState()]
  groups = [_kept(params, extra) for extra in extras]
  return groups[0] if len(groups) == 1 else _merged(params, groups)


def _kept(params: Any, extra: ExtraState) -> Any:
  """master_params() of one optimizer's ExtraState: a tree like `params`, with MaskedNodes
  where the optimizer is one group of a partition and a leaf is not its."""
  if extra.master_params is not None:
    return extra.master_params
  wide = lambda p: p.astype(jnp.promote_types(p.dtype, jnp.float32))
  if extra.param_remainders is None:
    return jax.tree.map(wide, params)
  join = lambda r, p: r if _is_masked(r) else \
      _rounding.join_remainder(p.astype(jnp.bfloat16), r) if r.size else wide(p)
  return jax.tree.map(join, extra.param_remainders, params, is_leaf=_is_masked)


def _is_masked(x: Any) -> bool:
  return isinstance(x, optax.MaskedNode)


def _merged(params: Any, groups: list) -> Any:
  """Per params leaf, the first of the `groups`' trees (like `params`, MaskedNodes where a leaf
  is not the group's) that holds it."""
  treedef = jax.tree.structure(params)
  columns = [treedef.flatten_up_to(g) for g in groups]
  return treedef.unflatten([next(c for c in leaf if not _is_masked(c)) for leaf in zip(*columns)])


def _cast(state: Any, target: Any) -> Any:
  """`state` leaf by leaf in `target`'s dtypes, 8-bit moments through float32 (kept as they are
  where the target keeps the same format)."""
  quantized = _moments.is_quantized
  if jax.tree.structure(state, is_leaf=quantized) != jax.tree.structure(target, is_leaf=quantized):
    raise ValueError("jaxfuse.convert_state: the state is not one of this transform's optimizer "
                     f"for these params\n  state:  {jax.tree.structure(state)}\n"
                     f"  target: {jax.tree.structure(target)}")

  def cast(t, x):
    if quantized(t) and quantized(x) and jax.tree.map(jnp.shape, t) == jax.tree.map(
        jnp.shape, x) and t.codes.dtype == x.codes.dtype:
      return x
    x = _moments.dequantize(x) if quantized(x) else x
    return _moments.like(x, t) if quantized(t) else jnp.asarray(x).astype(t.dtype)

  return jax.tree.map(cast, target, state, is_leaf=quantized)


def _entries(core: Any) -> tuple:
  """An optimizer's optax state as the entries it has beside an ExtraState: a chain's tuple, or
  a single transform's state (Spec.with_extra) as a 1-tuple."""
  return core if type(core) is tuple else (core,)


def _convert_optimizer(state: Any, target: Any, master: Any,
                       params: Any) -> tuple[Any, Any]:
  """One optimizer's state (with or without its ExtraState) in `target`'s layout, and the params
  that go with it."""
  core = _entries(state[:-1] if _is_optimizer_state(state) else state)
  if not _is_optimizer_state(target):
    cast = _cast(core, _entries(target))
    return (cast if type(target) is tuple else cast[0]), \
        jax.tree.map(lambda m, p: m.astype(p.dtype), master, params)
  extra, goal = _extra(state), target[-1]
  new_params = jax.tree.map(lambda m, p: m.astype(p.dtype), master, params)
  remainders = None
  if goal.param_remainders is not None:
    pairs = jax.tree.map(lambda m, p: _rounding.split_remainder(m) if p.dtype == jnp.bfloat16
                         else (m.astype(p.dtype), jnp.zeros((0,), jnp.int16)), master, params)
    new_params = jax.tree.map(lambda _, pair: pair[0], params, pairs)
    remainders = jax.tree.map(lambda _, pair: pair[1], params, pairs)
  skipped = None
  if goal.skipped_steps is not None:
    skipped = extra.skipped_steps if extra.skipped_steps is not None else jnp.zeros([], jnp.int32)
  kept = None
  if goal.master_params is not None:
    kept = jax.tree.map(lambda m, t: m.astype(t.dtype), master, goal.master_params)
  return (*_cast(core, target[:-1]), ExtraState(kept, skipped, remainders)), new_params


def _convert(state: Any, target: Any, master: Any,
             params: Any) -> tuple[Any, Optional[Any]]:
  """`state` in `target`'s layout, walking chains (plain tuples) down to the optimizer; the new
  params where an optimizer's state was converted, else None."""
  if _is_optimizer_state(state) or _is_optimizer_state(target):
    return _convert_optimizer(state, target, master, params)
  if type(state) is tuple and type(target) is tuple and len(state) == len(target):
    parts = [_convert(s, t, master, params) for s, t in zip(state, target)]
    new_params = next((p for _, p in parts if p is not None), None)
    return tuple(s for s, _ in parts), new_params
  return _cast(state, target), None


def _target_params(params: Any, dtype: Any) -> Any:
  if dtype is None:
    return params
  if jax.tree.leaves(dtype) != [dtype]:  # a tree of dtypes, one per leaf (a dict is no dtype)
    return jax.tree.map(lambda p, d: p.astype(d), params, dtype)
  single = jnp.dtype(dtype)
  return jax.tree.map(lambda p: p.astype(single), params)


def convert_state(state: Any, params: Any, tx: Any, dtype: Any = None) -> tuple[Any, Any]:
  """``(params, state)`` for continuing with transform `tx` from `state`, the state of another
  transform of the same optimizer (or chain) for `params`: e.g. ``optax.adamw`` and
  ``jaxfuse.adamw`` with other state dtypes, master weights or param remainders, either way.

  The full-precision params (:func:`master_params` of `params` and `state`) become `tx`'s master
  copy, or its param remainders, or, without either, its params; the params returned are in
  `dtype` (a dtype, a tree of them like `params`, or None: the dtypes of `params`), rounded to
  nearest (for remainders with ties away from zero, as remainders need). The optax part of the
  state is cast leaf by leaf to `tx`'s dtypes for those params. E.g. float32 training onward in
  bf16 with remainders: ``convert_state(state, params, tx16, jnp.bfloat16)``; and back:
  ``convert_state(state16, params16, optax.adamw(...), jnp.float32)``. Packed and per-leaf
  layouts convert both ways, bit for bit (a ``packed=True`` state to optax's and back); packed
  params (:func:`jaxfuse.pack`) come back packed.
  """
  packed_params = _packing.is_packed(params)
  params = _packing.unpack(_trees.as_arrays(params))
  state = _packing.unpack(state)
  master = master_params(params, state)
  target_params = jax.tree.map(lambda m, t: jax.ShapeDtypeStruct(m.shape, t.dtype), master,
                               _target_params(params, dtype))
  target = jax.eval_shape(lambda p: tx.init(_packing.pack(p) if packed_params else p),
                          target_params)
  new_state, new_params = _convert(state, _packing.unpack_shapes(target), master, target_params)
  if new_params is None:
    new_params = jax.tree.map(lambda m, p: m.astype(p.dtype), master, target_params)
  new_state = _packing.repack(new_state, target)
  return (_packing.pack(new_params) if packed_params else new_params), new_state
