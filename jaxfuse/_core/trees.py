"""Pytree flattening with leaf names, and the trace-time checks every jaxfuse op makes."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

# Storage dtypes the kernels read and write (complex ones as pairs of their real dtype).
KERNEL_DTYPES = tuple(jnp.dtype(t) for t in (jnp.float32, jnp.bfloat16, jnp.float16, jnp.float64,
                                            jnp.complex64, jnp.complex128))
_KERNEL_DTYPE_NAMES = ", ".join(t.name for t in KERNEL_DTYPES)


def is_wide(dtype: Any) -> bool:
  """Whether `dtype` is float64 or complex128: jaxfuse computes such leaves in double."""
  return jnp.finfo(dtype).bits == 64


def is_complex(dtype: Any) -> bool:
  return jnp.issubdtype(jnp.dtype(dtype), jnp.complexfloating)


def as_arrays(tree: Any) -> Any:
  """`tree` with NumPy arrays and Python or NumPy scalars turned into JAX arrays, as optax's jnp
  operations would take them (with JAX's dtype rules: float64 becomes float32 unless
  jax_enable_x64 is on). JAX arrays and tracers are left as they are."""
  def convert(leaf):
    if isinstance(leaf, jax.Array):
      return leaf
    if isinstance(leaf, (np.ndarray, np.generic, int, float, complex)):
      return jnp.asarray(leaf)
    return leaf
  return jax.tree.map(convert, tree)


def nonempty(leaves: list[Any]) -> list[int]:
  """The indices of the leaves with elements: the only leaves jaxfuse's multi-tensor ops pass to
  their kernels. A zero-size leaf has nothing to read or update, so the op makes its results
  directly. That also keeps it out of the shard_map or custom_partitioning that runs the kernels
  on sharded leaves: a zero-size shard_map operand segfaults jaxlib 0.11.2's compiler."""
  return [i for i, x in enumerate(leaves) if (x.size if hasattr(x, "size") else np.size(x))]


def leaf_names(tree: Any) -> list[str]:
  """Readable names of a tree's leaves, e.g. "['dense']['kernel']", in flatten order."""
  paths, _ = jax.tree_util.tree_flatten_with_path(tree)
  return [jax.tree_util.keystr(path) or "<root>" for path, _ in paths]


def check_float_leaves(tree: Any, what: str) -> list[jax.Array]:
  """Flattens `tree`, raising a TypeError that names the leaf if one is not a supported float
  (see KERNEL_DTYPES; convert NumPy and Python leaves with as_arrays first)."""
  leaves = jax.tree.leaves(tree)
  for name, leaf in zip(leaf_names(tree), leaves):
    dtype = getattr(leaf, "dtype", None)
    if dtype is None:
      raise TypeError(f"jaxfuse: {what} leaf {name} is not an array (got {type(leaf).__name__})")
    if jnp.dtype(dtype) not in KERNEL_DTYPES:
      raise TypeError(
          f"jaxfuse: {what} leaf {name} has dtype {jnp.dtype(dtype).name}; jaxfuse kernels take "
          f"{_KERNEL_DTYPE_NAMES} leaves")
  return leaves


def check_same_structure(reference: Any, other: Any, ref_what: str, other_what: str) -> None:
  """Raises a ValueError naming the first leaf where `other` differs from `reference` in
  structure or shape."""
  ref_def = jax.tree.structure(reference)
  other_def = jax.tree.structure(other)
  if ref_def != other_def:
    ref_names, other_names = set(leaf_names(reference)), set(leaf_names(other))
    only_ref = sorted(ref_names - other_names)[:3]
    only_other = sorted(other_names - ref_names)[:3]
    detail = ""
    if only_ref:
      detail += f"; leaves only in {ref_what}: {', '.join(only_ref)}"
    if only_other:
      detail += f"; leaves only in {other_what}: {', '.join(only_other)}"
    raise ValueError(
        f"jaxfuse: {other_what} and {ref_what} have different tree structures{detail}\n"
        f"  {ref_what}: {ref_def}\n  {other_what}: {other_def}")
  for name, a, b in zip(leaf_names(reference), jax.tree.leaves(reference), jax.tree.leaves(other)):
    if jnp.shape(a) != jnp.shape(b):
      raise ValueError(
          f"jaxfuse: leaf {name} has shape {jnp.shape(b)} in {other_what} but {jnp.shape(a)} in "
          f"{ref_what}")


def static_bool_mask(mask: Any, params: Any) -> list[bool]:
  """Per-leaf booleans from an optax-style mask: a pytree of bools that is a prefix of `params`,
  or a callable returning one. The mask must be static (Python or NumPy bools)."""
  if callable(mask):
    mask = mask(params)
  try:
    full = jax.tree.map(lambda m, sub: jax.tree.map(lambda _: m, sub), mask, params)
  except ValueError as e:
    raise ValueError(f"jaxfuse: weight-decay mask is not a prefix of the params tree: {e}") from None
  out = []
  for name, m in zip(leaf_names(params), jax.tree.leaves(full)):
    if isinstance(m, jax.core.Tracer):
      raise TypeError(f"jaxfuse: weight-decay mask entry for {name} is traced; masks must be "
                      "static Python bools")
    out.append(bool(np.asarray(m)))
  return out
