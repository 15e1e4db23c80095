"""Moving optimizer states between precisions: the full-precision master of any jaxfuse state, and
a state converted to another transform's layout (e.g. optax's AdamW to jaxfuse's AdamW with bf16
moments and param remainders, and back)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jaxfuse import _rounding
from jaxfuse import _trees
from jaxfuse._optimizer import ExtraState


def _split(state: Any) -> tuple[Any, ExtraState]:
  """(the optax part, jaxfuse's ExtraState or an empty one) of a state."""
  if isinstance(state, tuple) and state and isinstance(state[-1], ExtraState):
    return state[:-1], state[-1]
  return state, ExtraState()


def master_params(params: Any, state: Any) -> Any:
  """The full-precision params that `state` (of a jaxfuse or optax transform) keeps for
  `params`: its master copy, the params joined to their remainders
  (``master_weights="remainder"``), or else the params themselves, in float32 or wider."""
  _, extra = _split(state)
  if extra.master_params is not None:
    return extra.master_params
  wide = lambda p: p.astype(jnp.promote_types(p.dtype, jnp.float32))
  if extra.param_remainders is None:
    return jax.tree.map(wide, params)
  return jax.tree.map(
      lambda p, r: _rounding.join_remainder(p.astype(jnp.bfloat16), r) if r.size else wide(p),
      params, extra.param_remainders)


def convert_state(state: Any, params: Any, tx: Any) -> tuple[Any, Any]:
  """``(params, state)`` for continuing with transform `tx` from `state`, the state of another
  transform of the same optimizer for `params` (e.g. ``optax.adamw`` and ``jaxfuse.adamw`` with
  other state dtypes, master weights or param remainders, in either direction).

  The optax part of the state is cast leaf by leaf to `tx`'s dtypes. The full-precision params
  (:func:`master_params`) become `tx`'s master copy, or its param remainders, or, without either,
  the params; the params returned are their rounding to the dtypes of `params` (to nearest; for
  remainders ties away from zero, as remainders need). Pass `params` already cast to leave a
  16-bit training, e.g. float32 params for ``optax.adamw``.
  """
  params = _trees.as_arrays(params)
  target = jax.eval_shape(tx.init, params)
  core, _ = _split(state)
  target_core, target_extra = _split(target)
  if jax.tree.structure(core) != jax.tree.structure(target_core):
    raise ValueError("jaxfuse.convert_state: the state is not one of this transform's optimizer "
                     f"for these params\n  state:  {jax.tree.structure(core)}\n"
                     f"  target: {jax.tree.structure(target_core)}")
  new_core = jax.tree.map(lambda x, t: jnp.asarray(x).astype(t.dtype), core, target_core)
  master = master_params(params, state)
  new_params = jax.tree.map(lambda m, p: m.astype(p.dtype), master, params)
  if target is target_core:
    return new_params, new_core
  remainders = None
  if target_extra.param_remainders is not None:
    def split(m, p, r):
      if p.dtype != jnp.bfloat16:  # a leaf without remainders
        return m.astype(p.dtype), jnp.zeros(r.shape, r.dtype)
      return _rounding.split_remainder(m)
    pairs = jax.tree.map(split, master, params, target_extra.param_remainders)
    new_params = jax.tree.map(lambda _, pr: pr[0], params, pairs)
    remainders = jax.tree.map(lambda _, pr: pr[1], params, pairs)
  _, extra = _split(state)
  skipped = None
  if target_extra.skipped_steps is not None:
    skipped = extra.skipped_steps if extra.skipped_steps is not None else jnp.zeros([], jnp.int32)
  kept_master = None
  if target_extra.master_params is not None:
    kept_master = jax.tree.map(lambda m, t: m.astype(t.dtype), master,
                               target_extra.master_params)
  return new_params, (*new_core, ExtraState(kept_master, skipped, remainders))
