"""Packed trees: a pytree's arrays kept in one flat buffer per dtype, each leaf at a static offset.

A step's host cost grows with the arrays it passes (jit flattens every argument leaf and checks
and hands over every buffer), so a model of thousands of leaves is host-bound before any kernel
runs. A :class:`Packed` tree is a handful of arrays for any number of leaves: the optimizers'
``packed=True`` states hold each state list so, and :func:`pack` does it for params, whose
leaves a step takes as views (:func:`unpack`) inside the jit. The layout (the tree's structure,
each leaf's shape, dtype, buffer and offset) is static, part of the pytree's structure, so a
packed tree checkpoints and restores like any other pytree, and a state packed for other params
is refused by structure.

A *split* layout (``layout_of(..., shards=N, axes=...)``, the optimizers' ``packed="data"``)
divides every leaf into N equal chunks, device d's segment of each buffer holding chunk d of
every leaf, at offsets that are the same on every device: a buffer of N segments sharded over the
mesh axes ``axes`` is one device's share of the state (ZeRO's first stage, Rajbhandari et al.,
2020, https://arxiv.org/abs/1910.02054) laid out so that one SPMD program updates every segment.
Seen whole (:meth:`Packed.unpack`, :func:`pack`), it is the same tree.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp

from jaxfuse._core import partition as _partition
from jaxfuse._core import trees as _trees

# Every leaf starts at a multiple of this many elements: 16-byte vector access for any dtype
# (the kernels' 4-element groups), whole 128-byte lines for float32.
ALIGN = 32


def _aligned(n: int) -> int:
  return -(-n // ALIGN) * ALIGN


class Place(NamedTuple):
  """Where one leaf lives in a packed tree: its buffer, element offset, shape and dtype; in a
  split layout its chunk (elements per segment, the last ones padded) at that offset of every
  segment."""

  buffer: int
  offset: int
  shape: tuple[int, ...]
  dtype: Any
  chunk: Optional[int] = None

  @property
  def size(self) -> int:
    return math.prod(self.shape)


@dataclasses.dataclass(frozen=True)
class Layout:
  """The static part of a packed tree: the unpacked tree's structure, and per leaf its Place;
  per buffer its dtype and element count; for a split layout the number of segments and the
  mesh axes they are sharded over."""

  treedef: Any
  places: tuple[Place, ...]
  buffer_dtypes: tuple[Any, ...]
  buffer_sizes: tuple[int, ...]
  shards: int = 1
  axes: tuple[str, ...] = ()

  def __hash__(self) -> int:  # once: jit hashes the treedefs of its arguments on every call
    return self._hash

  @functools.cached_property
  def _hash(self) -> int:
    return hash((self.treedef, self.places, self.buffer_dtypes, self.buffer_sizes, self.shards,
                 self.axes))

  def __repr__(self) -> str:  # short: it shows inside every treedef that holds it
    buffers = ", ".join(f"{jnp.dtype(d).name}[{n}]"
                        for d, n in zip(self.buffer_dtypes, self.buffer_sizes))
    split = f", split over {self.axes} in {self.shards}" if self.split else ""
    return f"Layout({len(self.places)} leaves in {buffers}{split})"

  @property
  def split(self) -> bool:
    return bool(self.axes)

  def local(self) -> "Layout":
    """The layout of one segment of a split layout: each leaf its chunk, a vector."""
    return Layout(self.treedef, tuple(Place(p.buffer, p.offset, (p.chunk,), p.dtype)
                                      for p in self.places),
                  self.buffer_dtypes, tuple(n // self.shards for n in self.buffer_sizes))

  @property
  def num_leaves(self) -> int:
    return len(self.places)

  def leaf_names(self) -> list[str]:
    return _trees.leaf_names(self.treedef.unflatten(range(self.num_leaves)))

  def shapes(self) -> Any:
    """The unpacked tree as ShapeDtypeStructs."""
    return self.treedef.unflatten([jax.ShapeDtypeStruct(p.shape, p.dtype) for p in self.places])


def layout_of(tree: Any, shards: int = 1, axes: tuple[str, ...] = (),
              chunks: Optional[list[int]] = None) -> Layout:
  """The layout that :func:`pack` gives `tree` (arrays or ShapeDtypeStructs): leaves in tree
  order, one buffer per dtype in order of first appearance. With `axes`, split in `shards`
  segments, leaf i's chunk `chunks[i]` (at least its size over `shards`), each segment laid out
  as the tree of chunks would be."""
  if axes:
    leaves, treedef = jax.tree.flatten(tree)
    if len(chunks) != len(leaves) or any(c * shards < math.prod(jnp.shape(x))
                                         for c, x in zip(chunks, leaves)):
      raise AssertionError(f"chunks {chunks} do not cover {len(leaves)} leaves in {shards}")
    local = layout_of(treedef.unflatten(
        [jax.ShapeDtypeStruct((c,), x.dtype) for c, x in zip(chunks, leaves)]))
    return Layout(treedef, tuple(Place(p.buffer, p.offset, tuple(jnp.shape(x)), p.dtype, p.size)
                                 for p, x in zip(local.places, leaves)),
                  local.buffer_dtypes, tuple(n * shards for n in local.buffer_sizes),
                  shards, tuple(axes))
  leaves, treedef = jax.tree.flatten(tree)
  dtypes: list[Any] = []
  sizes: list[int] = []
  places = []
  for x in leaves:
    dtype = jnp.dtype(x.dtype)
    if dtype not in dtypes:
      dtypes.append(dtype)
      sizes.append(0)
    b = dtypes.index(dtype)
    shape = tuple(jnp.shape(x))
    places.append(Place(b, sizes[b], shape, dtype))
    sizes[b] += _aligned(math.prod(shape))
  return Layout(treedef, tuple(places), tuple(dtypes), tuple(sizes))


@jax.tree_util.register_pytree_node_class
class Packed:
  """A pytree's arrays in one flat buffer per dtype (:func:`pack`); :meth:`unpack` gives the
  tree back. As a pytree its leaves are the buffers and its structure includes the layout."""

  def __init__(self, buffers: Any, layout: Layout):
    self.buffers = tuple(buffers)
    self.layout = layout

  def tree_flatten(self):
    return self.buffers, self.layout

  @classmethod
  def tree_unflatten(cls, layout: Layout, buffers: Any) -> "Packed":
    return cls(buffers, layout)

  def __repr__(self) -> str:
    return f"Packed({self.layout!r})"

  def __contains__(self, key: Any) -> bool:
    """Whether the packed tree is a mapping with this key (flax's TrainState asks its params)."""
    top = self.layout.treedef.unflatten(range(self.layout.num_leaves))
    return isinstance(top, dict) and key in top

  def unpack(self) -> Any:
    """The tree: each leaf a slice of its buffer, reshaped (inside a jit, a view XLA fuses into
    what reads it). Its gradient is packed again in one concatenation per buffer."""
    return _unpack(self.layout, self.buffers)


def check_not_split(tree: Any) -> None:
  """Raises, naming the leaf, unless every leaf is whole on every device: a packed buffer keeps
  whole leaves (params split over devices keep their states per leaf)."""
  for name, x in zip(_trees.leaf_names(tree), jax.tree.leaves(tree)):
    if axes := _partition.split_axes(x):
      raise ValueError(
          f"jaxfuse: leaf {name} is split over mesh axes {axes}; a packed tree (packed=True, "
          "jaxfuse.pack) keeps whole leaves, replicated (data parallelism). Keep the state of "
          "params split over devices per leaf (packed=False)")


def _checked_layout(tree: Any, layout: Layout) -> Layout:
  own = layout_of(tree, layout.shards, layout.axes, [p.chunk for p in layout.places])
  if own != layout:
    raise ValueError(f"jaxfuse: a tree laid out as {own!r} cannot be packed as {layout!r}")
  return layout


def _slices(layout: Layout, buffers: tuple) -> Any:
  if layout.split:  # leaf = its chunks from every segment, in order, less the padding
    n = layout.shards
    segments = [_gathered(b).reshape(n, -1) for b in buffers]
    return layout.treedef.unflatten([
        segments[p.buffer][:, p.offset:p.offset + p.chunk].reshape(-1)[:p.size].reshape(p.shape)
        for p in layout.places])
  return layout.treedef.unflatten([
      jax.lax.slice(buffers[p.buffer], (p.offset,), (p.offset + p.size,)).reshape(p.shape)
      for p in layout.places])


def _gathered(buffer: jax.Array) -> jax.Array:
  """`buffer`, whole on every device where its type splits it (explicit sharding, whose
  indexing would otherwise need its result's sharding spelled out)."""
  mesh = _partition.mesh_with(_partition.split_axes(buffer), buffer)
  if mesh is None or not set(_partition.split_axes(buffer)) & set(mesh.explicit_axes):
    return buffer
  return _partition.constrain(buffer, mesh, jax.sharding.PartitionSpec())


# A slice's own transpose pads its cotangent to the whole buffer: one buffer-sized add per
# leaf, quadratic in the leaves. Packing the cotangents is one pass.
@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _unpack(layout: Layout, buffers: tuple) -> Any:
  return _slices(layout, buffers)


def _unpack_fwd(layout: Layout, buffers: tuple) -> tuple[Any, None]:
  return _slices(layout, buffers), None


def _unpack_bwd(layout: Layout, _, cotangents: Any) -> tuple[tuple]:
  return (pack(cotangents, layout).buffers,)


_unpack.defvjp(_unpack_fwd, _unpack_bwd)


def is_packed(x: Any) -> bool:
  return isinstance(x, Packed)


def pack(tree: Any, layout: Optional[Layout] = None) -> Packed:
  """`tree`'s arrays in one flat buffer per dtype, each leaf at an offset aligned to
  :data:`ALIGN` elements (the gaps are zeros); `layout`, when given, must be tree's."""
  tree = _trees.as_arrays(tree)
  layout = layout_of(tree) if layout is None else _checked_layout(tree, layout)
  check_not_split(tree)
  if layout.split:
    return Packed(_concatenate(layout, [_chunked(x, p, layout.shards) for x, p in
                                        zip(jax.tree.leaves(tree), layout.places)]), layout)
  return Packed(_concatenate(layout, [jnp.ravel(x) for x in jax.tree.leaves(tree)]), layout)


def _chunked(x: jax.Array, place: Place, shards: int) -> jax.Array:
  """Leaf `x` as [shards, chunk], zero-padded."""
  flat = jnp.ravel(x)
  return jnp.pad(flat, (0, shards * place.chunk - place.size)).reshape(shards, place.chunk)


def _concatenate(layout: Layout, parts: list[jax.Array]) -> list[jax.Array]:
  """The buffers of `layout` from each leaf's `parts`: a vector of its elements, or for a split
  layout [shards, chunk] (a whole buffer) or a chunk (one segment); zeros between."""
  lead = parts[0].shape[:-1] if parts else ()
  pieces: list[list[jax.Array]] = [[] for _ in layout.buffer_dtypes]
  for x, p in zip(parts, layout.places):
    pieces[p.buffer].append(x)
    length = x.shape[-1]
    if _aligned(length) > length:
      pieces[p.buffer].append(jnp.zeros((*lead, _aligned(length) - length), p.dtype))
  return [jnp.concatenate(x, axis=-1).reshape(-1) if x else jnp.zeros((0,), d)
          for x, d in zip(pieces, layout.buffer_dtypes)]


def local_segment(tree: Any, layout: Layout, index: jax.Array) -> Packed:
  """Segment `index` (a traced device index) of `tree` packed in the split `layout`, as a Packed
  tree of layout.local(): each leaf's chunk taken from the whole leaf, no other chunk read."""
  chunks = []
  for x, p in zip(jax.tree.leaves(tree), layout.places):
    flat = jnp.pad(jnp.ravel(x), (0, layout.shards * p.chunk - p.size))
    chunks.append(jax.lax.dynamic_slice(flat, (index * p.chunk,), (p.chunk,)))
  local = layout.local()
  return Packed(_concatenate(local, chunks), local)


def unpack(tree: Any) -> Any:
  """`tree` with every :class:`Packed` in it unpacked (anything else is kept)."""
  return jax.tree.map(lambda x: x.unpack() if is_packed(x) else x, tree, is_leaf=is_packed)


def contains_packed(tree: Any) -> bool:
  return any(is_packed(x) for x in jax.tree.leaves(tree, is_leaf=is_packed))


def repack(tree: Any, like: Any) -> Any:
  """`tree`, an unpacked tree of `like`, with each part that `like` keeps packed packed again (in
  the same layout)."""
  treedef = jax.tree.structure(like, is_leaf=is_packed)
  parts = treedef.flatten_up_to(tree)
  return treedef.unflatten([pack(part, x.layout) if is_packed(x) else part
                            for part, x in zip(parts, treedef.flatten_up_to(like))])


def unpack_shapes(tree: Any) -> Any:
  """`tree` (e.g. from jax.eval_shape) with every Packed in it replaced by the ShapeDtypeStructs
  of the tree it packs."""
  return jax.tree.map(lambda x: x.layout.shapes() if is_packed(x) else x, tree,
                      is_leaf=is_packed)


def layout_difference(expected: Layout, got: Layout) -> str:
  """What differs between two layouts, naming the first leaf at fault."""
  if (expected.axes, expected.shards) != (got.axes, got.shards):
    where = lambda x: f"split over {x.axes} in {x.shards} segments" if x.split else "not split"
    return f"it is {where(got)}, this transform's state is {where(expected)}"
  names, got_names = expected.leaf_names(), got.leaf_names()
  if expected.treedef != got.treedef:
    missing = [n for n in names if n not in got_names]
    extra = [n for n in got_names if n not in names]
    where = (f"no leaf {missing[0]}" if missing else f"a leaf {extra[0]} the params do not have"
             if extra else "its leaves in another structure")
    return (f"it packs a tree of {got.num_leaves} leaves, with {where}; these params have "
            f"{expected.num_leaves} leaves")
  for name, e, g in zip(names, expected.places, got.places):
    if (e.shape, jnp.dtype(e.dtype)) != (g.shape, jnp.dtype(g.dtype)):
      return (f"its leaf {name} is {jnp.dtype(g.dtype).name}{list(g.shape)}, these params make "
              f"it {jnp.dtype(e.dtype).name}{list(e.shape)}")
  return f"it is laid out as {got!r}, these params as {expected!r}"
