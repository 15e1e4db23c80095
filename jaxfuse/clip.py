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
The norm, the scale and their application never leave the device. Chained before
``jaxfuse.adam``/``adamw`` and run through :func:`jaxfuse.fused_step`, the clip folds into the
Adam kernel, which reads the scale through a pointer: 3 launches and 32 bytes per fp32 param.

Loss scaling: pass ``grad_scale`` (a device scalar) as an extra argument to ``update`` or to
``fused_step``. The norm is that of ``g / grad_scale``. Only the Adam kernel divides the
gradients by it (so that a chain of clip and Adam divides once): the optax-protocol output of
``clip_by_global_norm`` keeps the loss scale in.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional

import jax
import jax.numpy as jnp
import optax

from jaxfuse import _ffi
from jaxfuse import _trees

_CONTRACT = _ffi.contract("jaxfuse_global_norm")


@dataclasses.dataclass(frozen=True, eq=False)
class ClipSpec:
  """What a jaxfuse clip transform was built with (read by :func:`jaxfuse.fused_step`)."""

  max_norm: Any


def norm_and_grad_ctrl(grads: Any, *, max_norm: Any = None, grad_scale: Any = None,
                       skip_nonfinite: bool = False,
                       clip_apply_loss_scale: bool = True) -> tuple[jax.Array, jax.Array]:
  """One jaxfuse_global_norm call: the global norm of ``grads / grad_scale`` and the
  gradient-control vector (GradCtrl in norm_math.h) that the Adam and clip kernels read. With
  ``max_norm`` None the vector does not clip."""
  leaves = _trees.check_float_leaves(_trees.as_arrays(grads), "grads")
  params = _ffi.device_vector(_CONTRACT.names["norm_params"],
                              loss_scale=1.0 if grad_scale is None else grad_scale,
                              max_norm=math.inf if max_norm is None else max_norm)
  wide = any(_trees.is_wide(x.dtype) for x in leaves)
  norm_dtype = jnp.float64 if wide else jnp.float32
  call = jax.ffi.ffi_call(
      _ffi.target("jaxfuse_global_norm"),
      [jax.ShapeDtypeStruct((), norm_dtype),
       jax.ShapeDtypeStruct((len(_CONTRACT.names["grad_ctrl"]),), _ffi.vector_dtype()),
       jax.ShapeDtypeStruct((_CONTRACT.numbers["workspace_bytes"],), jnp.uint8)],
      vmap_method="sequential")
  norm, grad_ctrl, _ = call(params, *leaves, clip=max_norm is not None,
                            skip_nonfinite=bool(skip_nonfinite),
                            clip_apply_loss_scale=bool(clip_apply_loss_scale))
  return norm, grad_ctrl


def global_norm(tree: Any, *, grad_scale: Optional[Any] = None) -> jax.Array:
  """L2 norm over all leaves of ``tree`` (of ``tree / grad_scale`` if given), as a 0-d device
  array (float64 for a tree with float64 or complex128 leaves, else float32). Matches
  ``optax.tree.norm`` to the rounding of its dtype; deterministic."""
  return norm_and_grad_ctrl(tree, grad_scale=grad_scale)[0]


def apply_grad_ctrl(grads: Any, grad_ctrl: jax.Array) -> Any:
  """Scales every leaf as the control vector says (one jaxfuse_apply_grad_ctrl call)."""
  leaves, treedef = jax.tree.flatten(_trees.as_arrays(grads))
  if not leaves:
    return grads
  call = jax.ffi.ffi_call(
      _ffi.target("jaxfuse_apply_grad_ctrl"),
      [jax.ShapeDtypeStruct(jnp.shape(x), x.dtype) for x in leaves],
      vmap_method="sequential")
  return treedef.unflatten(call(grad_ctrl, *leaves))


def clip_by_global_norm(max_norm: Any) -> optax.GradientTransformationExtraArgs:
  """Clips updates to a maximum global L2 norm, as ``optax.clip_by_global_norm``.

  Args:
    max_norm: the maximum global norm (a float or a device scalar).

  Returns:
    An optax ``GradientTransformationExtraArgs`` with optax's (empty) state. ``update`` accepts
    the extra argument ``grad_scale`` (see the module docstring).
  """
  spec = ClipSpec(max_norm)

  def init_fn(params):
    del params
    return optax.EmptyState()

  def update_fn(updates, state, params=None, *, grad_scale=None, **extra_args):
    del params, extra_args
    _, grad_ctrl = norm_and_grad_ctrl(updates, max_norm=max_norm, grad_scale=grad_scale,
                                      clip_apply_loss_scale=False)
    return apply_grad_ctrl(updates, grad_ctrl), state

  update_fn.jaxfuse_spec = spec
  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
