"""Newton-Schulz orthogonalization for :func:`jaxfuse.muon`, batched by shape.

optax.contrib.muon orthogonalizes each matrix on its own: a chain of small matmuls per leaf,
dozens of chains per model. Here the matrices of one shape (a tall one transposed to its wide
form first, so a (768, 3072) and a (3072, 768) matrix share a stack) and dtype are stacked and
orthogonalized by one chain of batched matmuls, which XLA runs as one dot per product on tensor
cores. The math is optax's, operation for operation (its preconditionings, coefficient rows,
``c2 * a @ a`` association; for complex matrices the Schatten preconditioning's Gram matrix is
Hermitian, where optax's is x @ x.T), so the standard iteration gives optax's result;
``method="gram"`` runs the same polynomial through the Gram matrix instead (Zhang, Amsel, Chen
and Dao, "Gram Newton-Schulz", 2026): for a wide r x c matrix each iteration works on r x r
matrices and the long c dimension is touched only at the start, at a restart, and at the end,
so it needs fewer flops when c is well above r (a square matrix runs the standard iteration).
"""

from __future__ import annotations

import math
import operator
from typing import Any, NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxfuse._core import trees as _trees
from jaxfuse._optim import spec as _spec

PRECONDITIONINGS = ("frobenius", "spectral", "aol", "schatten")
METHODS = ("standard", "gram")


class Matrices(NamedTuple):
  """How one leaf becomes a stack of matrices and back: optax's reshape for its dimension
  numbers (batch axes, then reduction, then output), then transposed where the matrix is tall."""

  transpose: tuple[int, ...]  # of the leaf: batch axes, reduction axes, output axes
  flat: tuple[int, int, int]  # (batch, reduction, output)
  tall: bool                  # reduction > output: stacked as its transpose

  @property
  def key(self) -> tuple[int, int]:
    """The (rows, columns) of its matrices as stacked: rows <= columns."""
    _, m, n = self.flat
    return (n, m) if self.tall else (m, n)


def axes(ndim: int, dims: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
  """A MuonDimensionNumbers' reduction and output axes as tuples of non-negative ints."""
  as_tuple = lambda a: (a,) if isinstance(a, int) else tuple(a)
  return (tuple(a % ndim for a in as_tuple(dims.reduction_axis)),
          tuple(a % ndim for a in as_tuple(dims.output_axis)))


def matrices(shape: Sequence[int], dims: Any, name: str) -> Matrices:
  """How a leaf of `shape` is orthogonalized under MuonDimensionNumbers `dims`; raises, naming
  the leaf, where optax would."""
  if len(shape) < 2:
    raise ValueError(f"jaxfuse.muon: leaf {name} has shape {tuple(shape)}; Muon orthogonalizes "
                     "leaves of rank >= 2 (label it for Adam with muon_weight_dimension_numbers)")
  reduction, output = axes(len(shape), dims)
  if set(reduction) & set(output):
    raise ValueError(f"jaxfuse.muon: leaf {name}: reduction axes {reduction} and output axes "
                     f"{output} overlap")
  batch = tuple(a for a in range(len(shape)) if a not in reduction and a not in output)
  size = lambda group: math.prod(shape[a] for a in group)
  flat = (size(batch), size(reduction), size(output))
  return Matrices(batch + reduction + output, flat, flat[1] > flat[2])


def to_stack(x: jax.Array, m: Matrices) -> jax.Array:
  """The leaf `x` as (batch, rows, columns), rows <= columns."""
  y = x.transpose(m.transpose).reshape(m.flat)
  return jnp.swapaxes(y, 1, 2) if m.tall else y


def from_stack(y: jax.Array, m: Matrices, shape: Sequence[int]) -> jax.Array:
  """The inverse of to_stack for a leaf of `shape`."""
  y = jnp.swapaxes(y, 1, 2) if m.tall else y
  unflat = tuple(shape[a] for a in m.transpose)
  inverse = sorted(range(len(shape)), key=lambda i: m.transpose[i])
  return y.reshape(unflat).transpose(inverse)


def _gram(x: jax.Array) -> jax.Array:
  return x @ jnp.swapaxes(x, -1, -2).conj()


def _norm(x: jax.Array) -> jax.Array:
  """Each matrix's Frobenius norm, shaped to divide it."""
  return jnp.sqrt(jnp.sum(_spec.abs_sq(x), axis=(-2, -1), keepdims=True)).astype(x.dtype)


# The floor optax's AOL and Schatten first iterations clip their norms at (they do not take the
# transform's eps).
_FIRST_ITERATION_EPS = 1e-8


def precondition(x: jax.Array, kind: str, eps: Any) -> tuple[jax.Array, Optional[jax.Array]]:
  """optax's preconditioning of each matrix of the stack: (x scaled, and for 'aol' and
  'schatten' its Gram matrix scaled alike, which their first iteration reads; else None). `eps`
  is cast to the stack's precision, so that a traced one (optax.inject_hyperparams) does not
  promote a bf16 stack to float32."""
  eps = jnp.asarray(eps, jnp.finfo(x.dtype).dtype)
  floor = jnp.asarray(_FIRST_ITERATION_EPS, jnp.finfo(x.dtype).dtype)
  if kind == "frobenius":
    return x / (_norm(x) + eps), None
  if kind == "spectral":
    return x / (jnp.linalg.norm(x, ord=2, axis=(-2, -1), keepdims=True) + eps), None
  a = _gram(x)
  if kind == "aol":
    s = jax.lax.rsqrt(jnp.clip(jnp.abs(a).sum(axis=-1), min=floor))[..., None]
    return x * s, a * s * jnp.swapaxes(s, -1, -2)
  # schatten: the Gram matrix's Frobenius norm. (optax forms x @ x.T without the conjugate, the
  # same for real x; for complex x this is the Hermitian Gram matrix, as in every iteration.)
  s = jax.lax.rsqrt(jnp.clip(jnp.linalg.norm(a, ord="fro", axis=(-2, -1), keepdims=True),
                             min=floor))
  return x * s, a * s ** 2


def _rows(coeffs: jax.Array, steps: int) -> list[jax.Array]:
  """The coefficient row of each iteration: one row for all (shape (3,)) or one per iteration."""
  return [coeffs] * steps if coeffs.ndim == 1 else [coeffs[i] for i in range(coeffs.shape[0])]


def _standard(x: jax.Array, a0: Optional[jax.Array], rows: list) -> jax.Array:
  for i, c in enumerate(rows):
    a = a0 if i == 0 and a0 is not None else _gram(x)
    b = c[1] * a + c[2] * a @ a
    x = c[0] * x + b @ x
  return x


def _gram_iterations(x: jax.Array, a0: Optional[jax.Array], rows: list,
                     restarts: Sequence[int]) -> jax.Array:
  """The standard iteration's polynomial kept as Q (x_t = Q x_0) and R = x_t x_t^H, both r x r:
  with Z = b R + c R^2, x_{t+1} = (a I + Z) x_t, so Q <- Q Z + a Q and R <- (a I + Z) R (a I +
  Z), which commute. A restart applies Q to x and recomputes R, bounding the error that builds
  up in R (squared condition) in low precision."""
  r = a0 if a0 is not None else _gram(x)
  eye = jnp.eye(x.shape[-2], dtype=x.dtype)
  q = None
  for i, c in enumerate(rows):
    if i in restarts and i:
      x = q @ x
      r, q = _gram(x), None
    z = c[1] * r + c[2] * r @ r
    q = z + c[0] * eye if q is None else q @ z + c[0] * q
    if i + 1 < len(rows) and i + 1 not in restarts:
      rz = r @ z + c[0] * r
      r = z @ rz + c[0] * rz
  return q @ x


def orthogonalize(x: jax.Array, coeffs: jax.Array, steps: int, preconditioning: str, eps: Any,
                  method: str = "standard", restarts: Sequence[int] = (2,)) -> jax.Array:
  """Newton-Schulz on a stack (batch, rows, columns) with rows <= columns, in x's dtype:
  optax.contrib.muon's orthogonalize_via_newton_schulz for each matrix. `coeffs` is (3,) (the
  same row `steps` times) or (k, 3) (one row per iteration; `steps` unread)."""
  coeffs = coeffs.astype(x.dtype)
  x, a0 = precondition(x, preconditioning, eps)
  if coeffs.ndim == 2:
    rows = _rows(coeffs, coeffs.shape[0])
  else:
    try:
      rows = _rows(coeffs, operator.index(steps))
    except TypeError:  # a traced count (optax.inject_hyperparams): one row, looped
      first = _standard(x, a0, [coeffs])
      return jax.lax.fori_loop(1, steps, lambda i, x: _standard(x, None, [coeffs]), first)
  if method == "gram" and x.shape[-2] < x.shape[-1]:
    return _gram_iterations(x, a0, rows, restarts)
  return _standard(x, a0, rows)


def owner_mesh(leaves: list[jax.Array]) -> Any:
  """The mesh whose devices share the orthogonalization (owner compute): the one set by
  ``jax.set_mesh``, else the one the leaves are placed on (Explicit axes); None with one device,
  none known, or inside a ``jax.shard_map`` (the caller has split the work)."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    mesh = next((m for m in (getattr(jax.typeof(x).sharding, "mesh", None) for x in leaves)
                 if m is not None and not m.empty), None)
  if mesh is None or mesh.empty or mesh.manual_axes or mesh.size == 1:
    return None
  return mesh


def orthogonalize_leaves(leaves: list[jax.Array], shapes: list[Matrices], coeffs: jax.Array,
                         steps: int, preconditioning: str, eps: Any, method: str,
                         dtype: Optional[Any] = None) -> list[jax.Array]:
  """Each leaf orthogonalized as optax does, the leaves of one stacked shape and dtype in one
  batched chain (in `dtype` where given, the result in the leaf's dtype).

  With a multi-device mesh (owner_mesh()), each stack's matrices are split over all its devices
  along the stack's batch dimension: every device orthogonalizes the whole matrices it owns, a
  chain with no collective inside, and the matrices move to their owners and back once per step
  (XLA's resharding of the stack, from and to the leaves' layouts), instead of the all-reduces
  and all-gathers that partitioning every matmul of every iteration takes. On Explicit axes the
  stacks are built in an Auto region whose results come back in the leaves' shardings."""
  mesh = owner_mesh(leaves)
  run = lambda leaves, coeffs, eps: _orthogonalize_stacks(
      leaves, shapes, coeffs, steps, preconditioning, eps, method, dtype, mesh)
  explicit = () if mesh is None else tuple(a for a in mesh.axis_names
                                           if a in mesh.explicit_axes)
  if not explicit:
    return run(leaves, coeffs, eps)
  out = [jax.typeof(x).sharding for x in leaves]
  return list(jax.sharding.auto_axes(run, axes=explicit, out_sharding=out)(
      leaves, coeffs, jnp.asarray(eps)))


def _orthogonalize_stacks(leaves, shapes, coeffs, steps, preconditioning, eps, method, dtype,
                          mesh) -> list[jax.Array]:
  groups: dict[tuple, list[int]] = {}
  for i, (x, m) in enumerate(zip(leaves, shapes)):
    if x.size:
      groups.setdefault((m.key, jnp.dtype(x.dtype)), []).append(i)
  if mesh is not None and not jax.sharding.get_abstract_mesh().empty:
    mesh = jax.sharding.get_abstract_mesh()  # in auto_axes: the same axes, now Auto
  owners = lambda x: x if mesh is None else jax.lax.with_sharding_constraint(
      x, jax.sharding.NamedSharding(mesh, P(tuple(mesh.axis_names), None, None)))
  out = [jnp.zeros_like(x) for x in leaves]  # an empty leaf stays empty
  for (_, leaf_dtype), idx in groups.items():
    stack = owners(jnp.concatenate([to_stack(leaves[i], shapes[i]) for i in idx]))
    work = stack if dtype is None else stack.astype(
        jnp.promote_types(dtype, jnp.complex64) if _trees.is_complex(stack.dtype) else dtype)
    result = owners(orthogonalize(work, coeffs, steps, preconditioning, eps, method)
                    .astype(leaf_dtype))
    at = 0
    for i in idx:
      b = shapes[i].flat[0]
      out[i] = from_stack(result[at:at + b], shapes[i], leaves[i].shape)
      at += b
  return out
