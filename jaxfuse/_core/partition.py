"""How jaxfuse's custom calls run on sharded arrays.

Each op is written once as a *body* over the shards one device holds (the body calls
``jax.ffi.ffi_call``; the norm's body also all-reduces), with a *layout* that names, per operand
and result dimension, the factor that dimension belongs to (dimensions of one factor are split
alike) or None for a dimension that is never split (small control vectors, decoder weights, the
decoder's model dimensions). :func:`partitioned_call` then runs the body the way the operands
are sharded:

* **Auto axes** (sharding decided by the compiler; plain ``jit`` with ``in_shardings``, a mesh
  set with ``jax.set_mesh`` and Auto axis types): ``jax.experimental.custom_partitioning`` with a
  Shardy sharding rule built from the layout. At compile time, after sharding propagation, its
  partition callback gives the factors an operand carries together the mesh axes of the operand
  most split along them (splitting a replicated operand is a local slice; gathering a split one
  would move data; ties go to ``Layout.prefer``, e.g. the params over the gradients), so each device
  runs the body on its own shards and nothing is gathered. This is the mechanism JAX's own
  libraries use (TransformerEngine-JAX's primitives), and the only one that sees shardings that
  the compiler, not the types, decides.
* **Explicit axes** (sharding in types, ``AxisType.Explicit``): the shardings are known at trace
  time, so the body runs under ``jax.shard_map`` with the operands' own specs. The results
  carry their shardings in their types, as ``lax.scan`` carries and donation need.
* **Manual axes** (inside a ``shard_map`` body): every array is already one device's shard; the
  body runs on it directly (the norm reduces over devices only when given ``axis_name``).

With one device none of this is traced and the HLO is the plain custom call.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Optional, Sequence

import jax
import jax.numpy as jnp
from jax.experimental.custom_partitioning import (ArrayMapping, SdyShardingRule,
                                                  custom_partitioning)
from jax.sharding import NamedSharding, PartitionSpec as P

# Per array dimension: the name of its factor, or None for a dimension that is never split.
Dims = tuple[Optional[str], ...]
# Per array dimension: the mesh axes that split it (major to minor), () when whole.
Axes = tuple[tuple[str, ...], ...]


@dataclasses.dataclass(frozen=True)
class Shards:
  """Where a body's operands sit: the mesh axes the call is split over (``axis_names``, with
  their sizes) and, per operand, the mesh axes that split each dimension and the operand's
  global shape. With no axes the body sees whole arrays (one device, or a manual region)."""

  axis_names: tuple[str, ...] = ()
  axis_sizes: tuple[int, ...] = ()
  operand_axes: tuple[Axes, ...] = ()
  global_shapes: tuple[tuple[int, ...], ...] = ()

  def size(self, axes: Sequence[str]) -> int:
    return math.prod(self.axis_sizes[self.axis_names.index(a)] for a in axes)


def _entry_axes(entry: Any) -> tuple[str, ...]:
  """The mesh axes of one PartitionSpec entry (None, a name or a tuple of names)."""
  if entry is None or entry is P.UNCONSTRAINED:
    return ()
  return tuple(entry) if isinstance(entry, tuple) else (entry,)


def split_axes(x: Any) -> tuple[str, ...]:
  """The mesh axes an array is split over, as far as its placement (a concrete array) or its
  type (explicit sharding, under a trace) says; () where it is whole on every device."""
  if isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer):
    spec = getattr(x.sharding, "spec", None)
  else:
    spec = getattr(getattr(jax.typeof(x), "sharding", None), "spec", None)
  return tuple(a for entry in (spec or ()) for a in _entry_axes(entry))


def mesh_with(axes: Sequence[str], *trees: Any) -> Any:
  """The (abstract) mesh that has the mesh axes `axes`: the one set by ``jax.set_mesh``, else
  the one an array of `trees` is placed on (its type's); None where neither has them."""
  meshes = [jax.sharding.get_abstract_mesh()]
  for x in jax.tree.leaves(trees):
    meshes.append(getattr(getattr(jax.typeof(x), "sharding", None), "mesh", None)
                  if isinstance(x, jax.Array) else None)
  for mesh in meshes:
    if mesh is not None and not mesh.empty and set(axes) <= set(mesh.axis_names):
      return mesh
  return None


def manual_call(body: Callable[..., Sequence[jax.Array]], mesh: Any, axes: Sequence[str],
                operands: Sequence[jax.Array], in_specs: Sequence[P],
                results: Sequence[jax.ShapeDtypeStruct], out_specs: Sequence[P]) -> list:
  """``body`` on every device's shards of `operands` (`in_specs`), under ``jax.shard_map`` over
  `mesh` (directly where `axes` are already manual: inside the caller's shard_map), returning
  the arrays `results` describes (global shapes), sharded as `out_specs`. Zero-size arrays stay
  out of the shard_map, in and out (they crash jaxlib 0.11.2's compiler): ``body`` gets them,
  and the caller its zero-size results, as zeros."""
  manual = set(axes) <= set(jax.sharding.get_abstract_mesh().manual_axes)

  def run(*nonempty):
    it = iter(nonempty)
    local = [next(it) if x.size else jnp.zeros(
        x.shape if manual else _local_shape(x.shape, spec, mesh), x.dtype)
        for x, spec in zip(operands, in_specs)]
    return [x for x in body(*local) if x.size]

  kept = [x for x in operands if x.size]
  if manual:
    nonempty = run(*kept)
  else:
    # Jitted: an eager shard_map would compile its body's operations one by one.
    nonempty = jax.jit(jax.shard_map(
        run, mesh=mesh, in_specs=tuple(s for s, x in zip(in_specs, operands) if x.size),
        out_specs=[s for s, x in zip(out_specs, results) if math.prod(x.shape)],
        check_vma=False))(*kept)
  it = iter(nonempty)
  return [next(it) if math.prod(x.shape) else jnp.zeros(x.shape, x.dtype) for x in results]


def _local_shape(shape: tuple[int, ...], spec: P, mesh: Any) -> tuple[int, ...]:
  sizes = dict(zip(mesh.axis_names, mesh.axis_sizes))
  return tuple(n // math.prod(sizes[a] for a in _entry_axes(spec[d])) if d < len(spec) else n
               for d, n in enumerate(shape))


def constrain(x: jax.Array, mesh: Any, spec: P) -> jax.Array:
  """`x` sharded as `spec` on `mesh` (abstract), eagerly or under a trace, on Explicit axes
  (jax.sharding.reshard) or Auto ones (a sharding constraint); kept as it is on Manual ones
  (inside a shard_map, `x` is one device's)."""
  axes = {a for entry in spec for a in _entry_axes(entry)}
  if axes & set(mesh.manual_axes):
    return x
  sharding = NamedSharding(mesh, spec)
  axes |= set(split_axes(x))
  if any(a in mesh.explicit_axes for a in axes):
    return jax.sharding.reshard(x, sharding)
  return jax.lax.with_sharding_constraint(x, sharding)


def _spec_axes(spec: P, ndim: int) -> Axes:
  return tuple(_entry_axes(spec[d]) if d < len(spec) else () for d in range(ndim))


def _spec(axes: Axes) -> P:
  return P(*[(a[0] if len(a) == 1 else a) if a else None for a in axes])


@dataclasses.dataclass(frozen=True)
class Layout:
  """An op's operands and results, as factors per dimension (see the module docstring);
  ``names`` label the operands in error messages; ``prefer`` lists operands whose sharding wins
  a tie (e.g. the params and moments an update writes back over the gradients)."""

  operands: tuple[Dims, ...]
  results: tuple[Dims, ...]
  names: tuple[str, ...]
  prefer: tuple[int, ...] = ()

  def factor_axes(self, operand_axes: Sequence[Axes], mesh_shape: dict[str, int],
                  op: str) -> dict[str, tuple[str, ...]]:
    """The mesh axes of every factor. The factors an operand carries together (one leaf's
    dimensions, say) take their axes from one operand, so that no mesh axis splits two
    dimensions: the operand split over the most devices along them (on a tie the first in
    ``prefer``, then in operand order). Raises, naming the operand, where an operand is split
    along a dimension the op cannot split."""
    for name, dims, axes in zip(self.names, self.operands, operand_axes):
      for d, (factor, a) in enumerate(zip(dims, axes)):
        if factor is None and a:
          raise ValueError(
              f"{op}: {name} is sharded over mesh axes {a} along dimension {d}, which {op} "
              f"does not split; {self.supported(op)}")
    best: dict[frozenset, tuple[int, dict[str, tuple[str, ...]]]] = {}
    for i in self.preference_order():
      split = {f: a for f, a in zip(self.operands[i], operand_axes[i]) if f is not None}
      if not split:
        continue
      devices = math.prod(mesh_shape[a] for axes in split.values() for a in axes)
      key = frozenset(split)
      if key not in best or devices > best[key][0]:
        best[key] = (devices, split)
    return {f: a for _, split in best.values() for f, a in split.items()}

  def preference_order(self) -> list[int]:
    """Operand indices, those in ``prefer`` first."""
    return list(self.prefer) + [i for i in range(len(self.operands)) if i not in self.prefer]

  def supported(self, op: str) -> str:
    """What the op can split, for error messages."""
    split = [f"{n} along dimension(s) {[d for d, f in enumerate(dims) if f is not None]}"
             for n, dims in zip(self.names, self.operands) if any(f is not None for f in dims)]
    return (f"{op} splits only {', '.join(split)}; reshard the rest to be replicated"
            if split else f"{op} takes only replicated operands")

  def axes_of(self, dims: Dims, factor_axes: dict[str, tuple[str, ...]]) -> Axes:
    return tuple(factor_axes.get(f, ()) if f is not None else () for f in dims)

  def sharding_rule(self) -> SdyShardingRule:
    """The Shardy rule: dimensions of a factor share it; a never-split dimension gets a factor
    of its own that needs replication."""
    replicated: list[str] = []

    def mapping(kind: str, i: int, dims: Dims) -> ArrayMapping:
      factors = []
      for d, f in enumerate(dims):
        if f is None:
          f = f"{kind}{i}_{d}"
          replicated.append(f)
        factors.append(f)
      return ArrayMapping(*factors)

    operands = tuple(mapping("o", i, dims) for i, dims in enumerate(self.operands))
    results = tuple(mapping("r", i, dims) for i, dims in enumerate(self.results))
    return SdyShardingRule(operands, results, need_replication_factors=tuple(replicated))


Body = Callable[..., Sequence[jax.Array]]  # body(shards: Shards, *operands) -> results


def whole(x: Any) -> Dims:
  """The layout of an operand that is never split (a control vector, a weight)."""
  return (None,) * jnp.ndim(x)


def leaf_dims(leaves: Sequence[Any], prefix: str) -> tuple[Dims, ...]:
  """Each leaf's dimensions as factors of their own (``prefix`` names the op's leaf lists, so that
  the lists of one elementwise op share a leaf's factors)."""
  return tuple(tuple(f"{prefix}{i}_{d}" for d in range(jnp.ndim(x))) for i, x in enumerate(leaves))


def _explicit_mesh(operands: Sequence[Any]):
  """The abstract mesh whose Explicit axes the operands' types are sharded over, or None."""
  for x in operands:
    sharding = getattr(jax.typeof(x), "sharding", None)
    mesh = getattr(sharding, "mesh", None)
    if mesh is not None and not mesh.empty and mesh.explicit_axes:
      return mesh
  mesh = jax.sharding.get_abstract_mesh()
  return mesh if not mesh.empty and mesh.explicit_axes else None


def in_manual_region() -> bool:
  mesh = jax.sharding.get_abstract_mesh()
  return not mesh.empty and bool(mesh.manual_axes)


def partitioned_call(op: str, body: Body, layout: Layout,
                     operands: Sequence[jax.Array]) -> list[jax.Array]:
  """Runs ``body`` on every device's shards of ``operands`` (see the module docstring) and
  returns the results, each sharded as its layout says. Ops keep zero-size arrays out of
  ``operands`` (a zero-size shard_map operand segfaults jaxlib 0.11.2's compiler): they leave
  zero-size leaves out (_trees.nonempty) and make placeholders inside ``body``."""
  operands = list(operands)
  if len(operands) != len(layout.operands):
    raise AssertionError(f"{op}: {len(operands)} operands for a layout of {len(layout.operands)}")
  if in_manual_region() or jax.device_count() == 1:
    return list(body(Shards(), *operands))
  mesh = _explicit_mesh(operands)
  if mesh is not None:
    return _explicit_call(op, body, layout, operands, mesh)
  return _auto_call(op, body, layout, operands)


def _explicit_call(op: str, body: Body, layout: Layout, operands: list, mesh) -> list:
  """The body under ``jax.shard_map`` over the mesh's Explicit axes, with the operands' specs
  from their types (an operand split otherwise than its factor is resharded first)."""
  names = tuple(n for n in mesh.axis_names if n in mesh.explicit_axes)
  mesh_shape = dict(zip(mesh.axis_names, mesh.axis_sizes))
  types = [_spec_axes(jax.typeof(x).sharding.spec, jnp.ndim(x)) for x in operands]
  types = [tuple(tuple(a for a in axes if a in names) for axes in t) for t in types]
  factor_axes = layout.factor_axes(types, mesh_shape, op)
  in_axes = [layout.axes_of(dims, factor_axes) for dims in layout.operands]
  operands = [x if t == a else jax.sharding.reshard(x, _spec(a))
              for x, t, a in zip(operands, types, in_axes)]
  shards = Shards(names, tuple(mesh_shape[n] for n in names), tuple(in_axes),
                  tuple(tuple(jnp.shape(x)) for x in operands))
  out_specs = tuple(_spec(layout.axes_of(dims, factor_axes)) for dims in layout.results)
  run = jax.shard_map(lambda *xs: tuple(body(shards, *xs)), mesh=mesh,
                      in_specs=tuple(_spec(a) for a in in_axes), out_specs=out_specs,
                      axis_names=frozenset(names), check_vma=False)
  return list(run(*operands))


def _auto_call(op: str, body: Body, layout: Layout, operands: list) -> list:
  """The body as a ``custom_partitioning`` op: the compiler's shardings reach the partition
  callback; under ``jax.vmap`` the op runs once per mapped element (``lax.map``). The operands
  are passed with the preferred ones first, as Shardy resolves a factor split differently by
  two operands in favour of the earlier one."""
  order = layout.preference_order()
  layout = Layout(tuple(layout.operands[i] for i in order), layout.results,
                  tuple(layout.names[i] for i in order))
  restore = lambda xs: [xs[order.index(i)] for i in range(len(xs))]
  run = lambda shards, *xs: tuple(body(shards, *restore(xs)))

  def partition(mesh, arg_shapes, result_shape):
    del result_shape
    mesh_shape = dict(mesh.shape)
    arg_axes = [_spec_axes(a.sharding.spec, len(a.shape)) if isinstance(a.sharding, NamedSharding)
                else tuple(() for _ in a.shape) for a in arg_shapes]
    factor_axes = layout.factor_axes(arg_axes, mesh_shape, op)
    in_axes = tuple(layout.axes_of(dims, factor_axes) for dims in layout.operands)
    shards = Shards(tuple(mesh.axis_names), tuple(mesh_shape[n] for n in mesh.axis_names),
                    tuple(restore(in_axes)), tuple(restore([tuple(a.shape) for a in arg_shapes])))
    arg_shardings = tuple(NamedSharding(mesh, _spec(a)) for a in in_axes)
    result_shardings = tuple(NamedSharding(mesh, _spec(layout.axes_of(dims, factor_axes)))
                             for dims in layout.results)
    return mesh, lambda *xs: run(shards, *xs), result_shardings, arg_shardings

  call = custom_partitioning(lambda *xs: run(Shards(), *xs))
  call.def_partition(partition=partition, sharding_rule=layout.sharding_rule())
  mapped = jax.custom_batching.custom_vmap(call)

  @mapped.def_vmap
  def _one_at_a_time(axis_size, in_batched, *xs):
    xs = [x if b else jnp.broadcast_to(x, (axis_size, *jnp.shape(x)))
          for x, b in zip(xs, in_batched)]
    out = tuple(jax.lax.map(lambda args: mapped(*args), xs))
    return out, (True,) * len(out)

  return list(mapped(*[operands[i] for i in order]))


def linear_index(shards: Shards, axes: Sequence[str]) -> jax.Array:
  """This device's index among the shards of ``axes`` (major to minor), inside a body."""
  index = jnp.zeros((), jnp.int32)
  for a in axes:
    index = index * shards.size([a]) + jax.lax.axis_index(a)
  return index


def first_replica(shards: Shards, i: int) -> jax.Array:
  """Whether this device holds the first copy of operand ``i``'s shard, inside a body: index 0
  along every mesh axis that does not split the operand (a reduction counts each shard once)."""
  split = {a for dim_axes in shards.operand_axes[i] for a in dim_axes}
  first = jnp.bool_(True)
  for a in shards.axis_names:
    if a not in split:
      first = first & (jax.lax.axis_index(a) == 0)
  return first


def without_padding(shards: Shards, i: int, x: jax.Array) -> jax.Array:
  """Operand ``i``'s local shard with the padding of an uneven split zeroed: the compiler pads
  the last shards of a dimension that the mesh does not divide, with unspecified values, which a
  reduction must not see. (Explicit and manual shards are always even; a Shards without global
  shapes has none.)"""
  if not shards.global_shapes:
    return x
  for d, axes in enumerate(shards.operand_axes[i]):
    if not axes or shards.global_shapes[i][d] % shards.size(axes) == 0:
      continue
    local = x.shape[d]
    valid = shards.global_shapes[i][d] - linear_index(shards, axes) * local
    keep = jax.lax.broadcasted_iota(jnp.int32, x.shape, d) < valid
    x = jnp.where(keep, x, jnp.zeros((), x.dtype))
  return x

