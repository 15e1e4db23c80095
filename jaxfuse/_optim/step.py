"""One step's arguments, checked (naming the leaf at fault) and flattened into per-leaf lists;
the state after a step; and gradient control (loss scale, clip, non-finite skip): what the optax
protocol (xla_path.py) and the fused in-place step (kernel_path.py) share."""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxfuse._core import ffi as _ffi
from jaxfuse._core import trees as _trees
from jaxfuse._optim import clip as _clip
from jaxfuse._optim import moments as _moments
from jaxfuse._optim.spec import ExtraState, Spec


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


class Leaves(NamedTuple):
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

  def select(self, idx: list[int]) -> "Leaves":
    pick = lambda x: None if x is None else [x[i] for i in idx]
    remainders = pick(self.remainders)
    if remainders is not None and not any(np.size(r) for r in remainders):
      remainders = None
    return Leaves(pick(self.grads), pick(self.params), [pick(s) for s in self.states],
                   pick(self.master_params), remainders, pick(self.positions))

  def family(self, i: int) -> tuple[bool, bool, bool, bool]:
    """(computed in double, complex, has remainders, 8-bit states) for leaf i: leaves of one
    family share FFI calls."""
    dtypes = [state_dtype(x[i]) for x in (self.grads, self.params, *self.states,
                                           self.master_params) if x is not None]
    remainder = self.remainders is not None and np.size(self.remainders[i]) > 0
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
  the dtypes of the state that init() would make from them (the optax twin's)."""
  shapes = jax.tree.map(lambda g: jax.ShapeDtypeStruct(jnp.shape(g), g.dtype), grads)
  return shapes if not spec.states(state) else jax.tree.structure(grads).unflatten(
      [jax.ShapeDtypeStruct(jnp.shape(g), state_dtype(s)) for g, s in
       zip(jax.tree.leaves(grads), jax.tree.structure(grads).flatten_up_to(
           spec.states(state)[-1]))])


def checked_leaves(spec: Spec, grads: Any, state: Any, params: Any) -> tuple[Leaves, list[int]]:
  """Checks one step's arguments (naming the leaf at fault) and flattens them: the per-leaf
  lists and the tensor flags. All leaves are JAX arrays (as_arrays)."""
  _trees.check_float_leaves(grads, "grads")
  reference = _stand_in_params(spec, grads, state) if params is None else params
  flags = spec.check(reference)
  _trees.check_same_structure(reference, grads, "params", "grads")
  _check_state(spec, state, reference)
  treedef = jax.tree.structure(grads)
  leaves = Leaves(jax.tree.leaves(grads), None if params is None else jax.tree.leaves(params),
                   [treedef.flatten_up_to(s) for s in spec.states(state)],
                   treedef.flatten_up_to(state[-1].master_params) if spec.keeps_master
                   else None,
                   treedef.flatten_up_to(state[-1].param_remainders) if spec.keeps_remainders
                   else None,
                   list(range(treedef.num_leaves)))
  return leaves, flags


def step_count(state: Any) -> jax.Array:
  """The step count the schedules and bias corrections read: the first ``count`` in the state
  (every optax count advances together), zero when the state keeps none."""
  counts = optax.tree_utils.tree_get_all_with_path(state, "count")
  return counts[0][1] if counts else jnp.zeros([], jnp.int32)


def new_state(spec: Spec, state: Any, treedef: Any, states: list[list],
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
