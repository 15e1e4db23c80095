"""Packed trees: a pytree's arrays kept in one flat buffer per dtype, each leaf at a static offset.

A step's host cost grows with the arrays it passes (jit flattens every argument leaf and checks
and hands over every buffer), so a model of thousands of leaves is host-bound before any kernel
runs. A :class:`Packed` tree is a handful of arrays for any number of leaves: the optimizers'
``packed=True`` states hold each state list so, and :func:`pack` does it for params, whose
leaves a step takes as views (:func:`unpack`) inside the jit. The layout (the tree's structure,
each leaf's shape, dtype, buffer and offset) is static, part of the pytree's structure, so a
packed tree checkpoints and restores like any other pytree, and a state packed for other params
is refused by structure.
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
  """Where one leaf lives in a packed tree: its buffer, element offset, shape and dtype."""

  buffer: int
  offset: int
  shape: tuple[int, ...]
  dtype: Any

  @property
  def size(self) -> int:
    return math.prod(self.shape)


@dataclasses.dataclass(frozen=True)
class Layout:
  """The static part of a packed tree: the unpacked tree's structure, and per leaf its Place;
  per buffer its dtype and element count."""

  treedef: Any
  places: tuple[Place, ...]
  buffer_dtypes: tuple[Any, ...]
  buffer_sizes: tuple[int, ...]

  def __hash__(self) -> int:  # once: jit hashes the treedefs of its arguments on every call
    return self._hash

  @functools.cached_property
  def _hash(self) -> int:
    return hash((self.treedef, self.places, self.buffer_dtypes, self.buffer_sizes))

  def __repr__(self) -> str:  # short: it shows inside every treedef that holds it
    buffers = ", ".join(f"{jnp.dtype(d).name}[{n}]"
                        for d, n in zip(self.buffer_dtypes, self.buffer_sizes))
    return f"Layout({len(self.places)} leaves in {buffers})"

  @property
  def num_leaves(self) -> int:
    return len(self.places)

  def leaf_names(self) -> list[str]:
    return _trees.leaf_names(self.treedef.unflatten(range(self.num_leaves)))

  def shapes(self) -> Any:
    """The unpacked tree as ShapeDtypeStructs."""
    return self.treedef.unflatten([jax.ShapeDtypeStruct(p.shape, p.dtype) for p in self.places])


def layout_of(tree: Any) -> Layout:
  """The layout that :func:`pack` gives `tree` (arrays or ShapeDtypeStructs): leaves in tree
  order, one buffer per dtype in order of first appearance."""
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
  own = layout_of(tree)
  if own != layout:
    raise ValueError(f"jaxfuse: a tree laid out as {own!r} cannot be packed as {layout!r}")
  return layout


def _slices(layout: Layout, buffers: tuple) -> Any:
  return layout.treedef.unflatten([
      jax.lax.slice(buffers[p.buffer], (p.offset,), (p.offset + p.size,)).reshape(p.shape)
      for p in layout.places])


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
  parts: list[list[jax.Array]] = [[] for _ in layout.buffer_dtypes]
  for x, p in zip(jax.tree.leaves(tree), layout.places):
    parts[p.buffer].append(jnp.ravel(x))
    gap = _aligned(p.size) - p.size
    if gap:
      parts[p.buffer].append(jnp.zeros((gap,), p.dtype))
  return Packed([jnp.concatenate(x) if x else jnp.zeros((0,), d)
                 for x, d in zip(parts, layout.buffer_dtypes)], layout)


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
