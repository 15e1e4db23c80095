"""Whether :func:`jaxfuse.fused_step`'s params and state were donated to the jitted step.

The in-place step aliases each params and state buffer to its result. A buffer the caller did
not donate cannot be written in place, so XLA copies it first: the step still gives the right
values but moves twice the bytes, and nothing says so. jax knows the donations only while it
lowers the jitted function: they are attributes of the ``main`` function's arguments
(``tf.aliasing_output``, ``jax.buffer_donor``). So fused_step passes params and state through
an identity primitive whose lowering looks at where each operand comes from: an argument of
``main`` without a donation attribute is a buffer that will be copied, and a warning (once per
message) says so. Operands that come from elsewhere (computed in the step, arguments of an inner
function) are not judged. The primitive adds no operation to the program.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import numpy as np
from jax.extend import core as _jex_core
from jax.interpreters import ad, batching, mlir
from jax.interpreters import partial_eval as pe

from jaxfuse._core import notices as _notices

ir = mlir.ir

_probe = _jex_core.Primitive("jaxfuse_donation_check")
_probe.multiple_results = True
_DONATION_ATTRIBUTES = ("tf.aliasing_output", "jax.buffer_donor")


def check(params: Any, opt_state: Any) -> tuple[Any, Any]:
  """``(params, opt_state)`` unchanged, checked for donation when the step is lowered (see the
  module docstring)."""
  leaves, treedef = jax.tree.flatten((params, opt_state))
  arrays = [i for i, leaf in enumerate(leaves) if isinstance(leaf, jax.Array)]  # tracers too
  if not arrays:
    return params, opt_state
  n_params = sum(i < len(jax.tree.leaves(params)) for i in arrays)
  out = _probe.bind(*(leaves[i] for i in arrays), n_params=n_params)
  for i, leaf in zip(arrays, out):
    leaves[i] = leaf
  return jax.tree.unflatten(treedef, leaves)


def _impl(*leaves: Any, n_params: int) -> list:
  _notices.warn_once("jaxfuse.fused_step runs outside jax.jit here, so each of its calls copies "
                     "params and state before updating them: jit the step, donating params and "
                     "opt_state (jax.jit(step, donate_argnums=...)).")
  return list(leaves)


def _abstract_eval(*avals: Any, n_params: int) -> list:
  return list(avals)


def _main_argument_donated(value: ir.Value) -> bool | None:
  """Whether `value`, if it is an argument of the module's ``main``, was donated; None when it
  is not one (nothing to judge)."""
  # Newer MLIR bindings give values their concrete class; older ones have isinstance().
  is_argument = isinstance(value, ir.BlockArgument) or (
      hasattr(ir.BlockArgument, "isinstance") and ir.BlockArgument.isinstance(value))
  if not is_argument:
    return None
  argument = ir.BlockArgument(value)
  function = argument.owner.owner.operation
  if function.name != "func.func" or ir.StringAttr(function.attributes["sym_name"]).value != "main":
    return None
  if "arg_attrs" not in function.attributes:
    return False
  attributes = ir.ArrayAttr(function.attributes["arg_attrs"])[argument.arg_number]
  attributes = ir.DictAttr(attributes)
  return any(name in attributes for name in _DONATION_ATTRIBUTES)


def _lowering(ctx: Any, *operands: ir.Value, n_params: int) -> list:
  undonated = {"params": [], "opt_state": []}
  for i, (value, aval) in enumerate(zip(operands, ctx.avals_in)):
    if _main_argument_donated(value) is False:
      nbytes = math.prod(aval.shape) * np.dtype(aval.dtype).itemsize
      undonated["params" if i < n_params else "opt_state"].append(nbytes)
  counts = {"params": n_params, "opt_state": len(operands) - n_params}
  parts = [f"{name} ({len(sizes)} of {counts[name]} leaves)" for name, sizes in undonated.items()
           if sizes]
  if parts:
    total = sum(sum(sizes) for sizes in undonated.values())
    _notices.warn_once(
        f"jaxfuse.fused_step: {' and '.join(parts)} are not donated to the jitted step, so XLA "
        f"copies them ({total / 1e6:.3g} MB) before updating them in place, every step. Donate "
        "them, in the order the step returns them: jax.jit(step, donate_argnums=...). A donated "
        "array is deleted: to keep using the originals (to compare with optax, say), pass "
        "copies, jax.tree.map(jnp.copy, params).")
  return list(operands)


def _batching(args: Any, dims: Any, *, n_params: int) -> tuple[list, Any]:
  return _probe.bind(*args, n_params=n_params), dims


def _jvp(primals: Any, tangents: Any, *, n_params: int) -> tuple[list, Any]:
  # The tangents pass by unchecked, so that differentiating a step reaches the kernels' own
  # error ("cannot be differentiated").
  return _probe.bind(*primals, n_params=n_params), tangents


def _dce(used_outputs: list[bool], *args: Any) -> tuple[list[bool], Any]:
  # Leaves the step does not read stay unread: jit drops them from the executable (and from its
  # donations), as it would without the check. The equation comes last (jax 0.12 passes the
  # live inputs before it).
  eqn = args[-1]
  if not any(used_outputs):
    return used_outputs, None
  n_params = sum(used_outputs[:eqn.params["n_params"]])
  keep = lambda xs: [x for x, used in zip(xs, used_outputs) if used]
  return used_outputs, eqn.replace(invars=keep(eqn.invars), outvars=keep(eqn.outvars),
                                   params={**eqn.params, "n_params": n_params})


_probe.def_impl(_impl)
_probe.def_abstract_eval(_abstract_eval)
mlir.register_lowering(_probe, _lowering, cacheable=False)  # inlined: it reads main's arguments
batching.primitive_batchers[_probe] = _batching
ad.primitive_jvps[_probe] = _jvp
pe.dce_rules[_probe] = _dce
