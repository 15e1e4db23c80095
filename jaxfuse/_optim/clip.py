"""Global norm and clip-by-global-norm on device, with no host sync.

``global_norm(tree)`` is the L2 norm over every leaf (``sqrt(sum |x|^2)``, complex leaves
included), computed in one FFI call (on the GPU: one multi-tensor launch writing a partial per
block, one tiny launch summing them in a fixed order), accumulated in float64 whatever the
leaves' dtypes, so that the norm of a 16- or 32-bit tree is its exact norm rounded once at any
size: bitwise the same from run to run on one device. The result has optax's dtype for the tree
(float64 when a leaf is float64 or complex128, else float32; optax returns a 16-bit norm for an
all-16-bit tree, jaxfuse a float32 one).

``clip_by_global_norm(max_norm)`` follows ``optax.clip_by_global_norm`` (Pascanu et al., 2013,
https://arxiv.org/abs/1211.5063): with ``n = global_norm(g)``, updates are unchanged when
``n < max_norm`` and ``(g / n) * max_norm`` otherwise, with no epsilon. Its state is optax's.
The norm, the scale and their application never leave the device. Through the optax protocol
the norm is one jaxfuse call and the scaling XLA operations, which XLA fuses into whatever reads
the clipped gradients next (an Adam's update), so the clip costs one read of the gradients.
Directly before any jaxfuse optimizer (every family) under :func:`jaxfuse.fused_step`, the clip
folds into the optimizer's kernel, which reads the scale through a pointer: with AdamW, 3
launches and 32 bytes per fp32 param.

Loss scaling: pass ``grad_scale`` (a device scalar) as an extra argument to ``update`` or to
``fused_step``. The norm is that of ``g / grad_scale``. Only the optimizer divides the gradients
by it (so that a chain of clip and optimizer divides once): the optax-protocol output of
``clip_by_global_norm`` keeps the loss scale in.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Optional

import jax
import jax.numpy as jnp
import optax

from jaxfuse._core import ffi as _ffi
from jaxfuse._core import partition as _partition
from jaxfuse._core import trees as _trees
from jaxfuse._optim import inplace as _inplace
from jaxfuse._optim import spec as _spec

_CONTRACT = _ffi.contract("jaxfuse_global_norm")


@dataclasses.dataclass(frozen=True, eq=False)
class ClipSpec:
  """What a jaxfuse clip transform was built with (read by :func:`jaxfuse.fused_step`)."""

  max_norm: Any
  axis_name: Any = None


_SUM_WORDS = _CONTRACT.numbers["norm_sum_words"]
GRAD_CTRL_NAMES = _CONTRACT.names["grad_ctrl"]  # GradCtrl (norm_math.h), what optimizers read


def _no_peers() -> jax.Array:
  return jnp.zeros((0, _SUM_WORDS), jnp.uint32)


def _norm_ffi(norm_params: jax.Array, peer_sums: jax.Array, leaves: list, norm_dtype, *,
              clip: bool, skip_nonfinite: bool, clip_apply_loss_scale: bool):
  """One jaxfuse_global_norm call: (norm, grad_ctrl, own_sum) of ``leaves`` plus the peers'
  rows (clip.h)."""
  call = jax.ffi.ffi_call(
      _ffi.target("jaxfuse_global_norm"),
      [jax.ShapeDtypeStruct((), norm_dtype),
       jax.ShapeDtypeStruct((len(_CONTRACT.names["grad_ctrl"]),), _ffi.vector_dtype()),
       jax.ShapeDtypeStruct((_CONTRACT.numbers["workspace_bytes"],), jnp.uint8),
       jax.ShapeDtypeStruct((_SUM_WORDS,), jnp.uint32)],
      vmap_method="sequential")
  norm, grad_ctrl, _, own_sum = call(norm_params, peer_sums, *leaves, clip=clip,
                                     skip_nonfinite=skip_nonfinite,
                                     clip_apply_loss_scale=clip_apply_loss_scale)
  return norm, grad_ctrl, own_sum


def _sharded_norm(shards: _partition.Shards, norm_params, leaves: list, call) -> tuple:
  """The norm of leaves split over devices, inside a partitioned body: every device sums its
  shards (one call per set of mesh axes the leaves are replicated over, counted only on the
  first replica), puts its total in its own row of a zero matrix, one all-reduce of the rows
  (exact: every sum adds one row to zeros), and a second call adds the rows in row order. Every
  device gets the same norm, bitwise, and it equals the unsharded norm to float64 rounding."""
  axes = shards.axis_names
  me = _partition.linear_index(shards, axes)
  groups: dict[tuple[str, ...], list[int]] = {}
  for i in range(len(leaves)):
    split = {a for dim_axes in shards.operand_axes[i + 1] for a in dim_axes}
    groups.setdefault(tuple(a for a in axes if a not in split), []).append(i)
  rows = []
  for group in groups.values():
    own = call(norm_params, _no_peers(),
               [_partition.without_padding(shards, i + 1, leaves[i]) for i in group])[2]
    # The leaves of a group are replicated over the same axes: one's first replica is all's.
    row = jnp.where(_partition.first_replica(shards, group[0] + 1), own, jnp.zeros_like(own))
    rows.append(jnp.zeros((shards.size(axes), _SUM_WORDS), jnp.uint32).at[me].set(row))
  peers = jax.lax.psum(jnp.concatenate(rows), axes) if rows else _no_peers()
  norm, grad_ctrl, _ = call(norm_params, peers, [])
  return norm, grad_ctrl


def _norm_layout(leaves: list) -> _partition.Layout:
  """norm_params, then the leaves (each dimension a factor of its own); norm and grad_ctrl are
  replicated."""
  names = ("norm_params",) + tuple(f"grads leaf {n}" for n in range(len(leaves)))
  return _partition.Layout(((None,),) + _partition.leaf_dims(leaves, "grads"), ((), (None,)),
                           names)


def _axis_shards(axis_name: Any, leaves: list) -> _partition.Shards:
  """Inside shard_map: every leaf is split over all of ``axis_name`` (one device's shards)."""
  names = tuple(axis_name) if isinstance(axis_name, (tuple, list)) else (axis_name,)
  return _partition.Shards(names, tuple(jax.lax.axis_size(n) for n in names),
                           ((),) + tuple((names,) for _ in leaves))


def norm_and_grad_ctrl(grads: Any, *, max_norm: Any = None, grad_scale: Any = None,
                       skip_nonfinite: bool = False, clip_apply_loss_scale: bool = True,
                       axis_name: Any = None) -> tuple[jax.Array, jax.Array]:
  """The global norm of ``grads / grad_scale`` and the gradient-control vector (GradCtrl in
  norm_math.h) that the Adam and clip kernels read. With ``max_norm`` None the vector does not
  clip. One jaxfuse_global_norm call on one device; over sharded leaves, per-shard sums and one
  small all-reduce (:func:`_sharded_norm`). ``axis_name``: inside ``shard_map``, the mesh axes
  the leaves are split over (each device then holds different parts of the tree)."""
  if axis_name is not None and not _partition.in_manual_region():
    raise ValueError("jaxfuse: axis_name is for calls inside jax.shard_map (it names the mesh "
                     "axes the gradients are split over there); outside, shardings are read from "
                     "the arrays")
  leaves = _trees.check_float_leaves(_trees.as_arrays(grads), "grads")
  params = _ffi.device_vector(_CONTRACT.names["norm_params"],
                              loss_scale=1.0 if grad_scale is None else grad_scale,
                              max_norm=math.inf if max_norm is None else max_norm)
  wide = any(_trees.is_wide(x.dtype) for x in leaves)  # a zero-size leaf counts: optax's dtype
  leaves = [leaves[i] for i in _trees.nonempty(leaves)]
  call = functools.partial(_norm_ffi, norm_dtype=jnp.float64 if wide else jnp.float32,
                           clip=max_norm is not None, skip_nonfinite=bool(skip_nonfinite),
                           clip_apply_loss_scale=bool(clip_apply_loss_scale))

  def body(shards, norm_params, *local):
    local = list(local)
    if axis_name is not None:
      return _sharded_norm(_axis_shards(axis_name, local), norm_params, local, call)
    if not shards.axis_names:
      return call(norm_params, _no_peers(), local)[:2]
    return _sharded_norm(shards, norm_params, local, call)

  norm, grad_ctrl = _partition.partitioned_call("jaxfuse.global_norm", body,
                                                _norm_layout(leaves), [params, *leaves])
  return norm, grad_ctrl


def global_norm(tree: Any, *, grad_scale: Optional[Any] = None,
                axis_name: Any = None) -> jax.Array:
  """L2 norm over all leaves of ``tree`` (of ``tree / grad_scale`` if given), as a 0-d device
  array (float64 for a tree with float64 or complex128 leaves, else float32). Matches
  ``optax.tree.norm`` to the rounding of its dtype; deterministic.

  Sharded leaves (any mesh, Auto or Explicit axes) give the norm of the whole arrays on every
  device: per-shard sums and one small all-reduce, nothing gathered. Inside ``jax.shard_map``,
  where each call sees one device's shards, pass ``axis_name`` (a mesh axis name or a tuple of
  them) to sum over the devices that split the tree; without it the norm is the local one."""
  return norm_and_grad_ctrl(tree, grad_scale=grad_scale, axis_name=axis_name)[0]


def apply_grad_ctrl(g: jax.Array, grad_ctrl: jax.Array, loss_scale: bool = True) -> jax.Array:
  """A gradient value (of the compute type) as the kernels read it under `grad_ctrl`
  (norm_math.h's GradScaling), as XLA operations: unscaled by the loss scale (unless
  `loss_scale` is False), then clipped as optax does, ``(g / clip_div) * clip_mul``. Dividing
  and multiplying by 1 is exact, so the factors apply unconditionally."""
  real = jnp.finfo(g.dtype).dtype
  factor = lambda name: grad_ctrl[GRAD_CTRL_NAMES.index(name)].astype(real)
  if loss_scale:
    g = g / factor("loss_scale")
  return (g / factor("clip_div")) * factor("clip_mul")


def scale_by_grad_ctrl(grads: Any, grad_ctrl: jax.Array) -> Any:
  """``(g / clip_div) * clip_mul`` for every leaf (computed in at least float32, rounded to the
  leaf's dtype), as XLA operations: XLA fuses the scaling into whatever reads the gradients next
  (an optax or jaxfuse Adam's element math), so clipping costs no extra pass over them."""

  def scale(g):
    c = jnp.promote_types(g.dtype, jnp.float32)
    return apply_grad_ctrl(g.astype(c), grad_ctrl, loss_scale=False).astype(g.dtype)

  return jax.tree.map(scale, _trees.as_arrays(grads))


def clip_by_global_norm(max_norm: Any, *,
                        axis_name: Any = None) -> optax.GradientTransformationExtraArgs:
  """Clips updates to a maximum global L2 norm, as ``optax.clip_by_global_norm``.

  Args:
    max_norm: the maximum global norm (a float or a device scalar).
    axis_name: only inside ``jax.shard_map`` (see :func:`global_norm`): the mesh axes the
      updates are split over, so that the norm is the whole tree's.

  Returns:
    An optax ``GradientTransformationExtraArgs`` with optax's (empty) state. ``update`` accepts
    the extra argument ``grad_scale`` (see the module docstring).
  """
  _spec.check_number("jaxfuse.clip_by_global_norm", "max_norm", max_norm)
  spec = ClipSpec(max_norm, axis_name)

  def init_fn(params):
    del params
    return optax.EmptyState()

  def update_fn(updates, state, params=None, *, grad_scale=None, **extra_args):
    del params, extra_args
    in_place = _inplace.current()
    if in_place is not None:  # fused_step: the Adam that receives these leaves folds the clip
      in_place.record_clip(spec, updates)
      return updates, state
    _, grad_ctrl = norm_and_grad_ctrl(updates, max_norm=max_norm, grad_scale=grad_scale,
                                      clip_apply_loss_scale=False, axis_name=axis_name)
    return scale_by_grad_ctrl(updates, grad_ctrl), state

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
