"""A packed optimizer state split over data-parallel devices (``packed="data"``): ZeRO's first
stage (Rajbhandari et al., 2020, https://arxiv.org/abs/1910.02054) for any tree.

The state's buffers are laid out in segments (packing.py's split layouts), device d's holding
chunk d of every leaf, sharded over the mesh axes ``packed`` names: each device keeps and
updates 1/N of the state, whatever the leaves' shapes. Everything runs under ``jax.shard_map``:
``init`` makes each device's segment from its chunks of the params (no device ever holds the
whole state); a step takes each device's chunks of the whole (replicated) grads and params,
updates its segment with the ordinary step over packed lists (the same kernels, or the same XLA
math), and all-gathers the new params (or the updates): large leaves one by one, the small ones
packed, one all-gather per dtype; the state never moves. Every element's math is the unsplit step's, so the results are its bits, except
for what depends on where an element sits: stochastic rounding draws one stream per chunk (as
for any leaf split over devices), and the trust ratios of LAMB and LARS add each leaf's sums
over its chunks (one small all-reduce) in another order.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Any, Callable

import jax
from jax.sharding import PartitionSpec as P

from jaxfuse._core import packing as _packing
from jaxfuse._core import partition as _partition
from jaxfuse._optim import moments as _moments

# segment_step(spec, grads, state, params, segment, *replicated) -> (out, new state): one
# device's step on its segment (Packed trees of local layouts; `segment` the Shards of the split;
# `spec` with its traced hyperparameters this device's), `out` (new params or updates) a Packed
# tree of the chunks' layout, gathered by run().
SegmentStep = Callable[..., tuple[_packing.Packed, Any]]


class _Split:
  """How a state of `spec` for `params` splits: the mesh, its axes and their sizes, the number of
  segments, each params leaf's chunk."""

  def __init__(self, spec: Any, params: Any, mesh: Any):
    self.axes = spec.split_axes
    self.mesh = mesh
    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes))
    self.shards = math.prod(sizes[a] for a in self.axes)
    self.segment = _partition.Shards(self.axes, tuple(sizes[a] for a in self.axes))
    self.params = params
    self.chunks = spec.split_chunks(params, self.shards)

  def layout(self, tree: Any) -> _packing.Layout:
    """The split layout of `tree`, like the params (params, grads, updates) or a state tree of
    them (a list, the master copy, the remainders): a state leaf's chunk is its params leaf's in
    proportion (an 8-bit state's scales: one per block)."""
    sizes = [math.prod(jax.numpy.shape(p)) for p in jax.tree.leaves(self.params)]
    parts = jax.tree.structure(self.params).flatten_up_to(tree)
    chunks = [c * math.prod(jax.numpy.shape(x)) // n if n else 0
              for part, c, n in zip(parts, self.chunks, sizes) for x in jax.tree.leaves(part)]
    return _packing.layout_of(tree, self.shards, self.axes, chunks)

  def index(self) -> jax.Array:
    """This device's segment, inside the shard_map."""
    return _partition.linear_index(self.segment, self.axes)


def _mesh(spec: Any, *trees: Any, mesh: Any = None) -> Any:
  if mesh is None:
    mesh = _partition.mesh_with(spec.split_axes, *trees)
  if mesh is None:
    raise ValueError(
        f"{spec.name}: packed={spec.packed!r} splits the state over mesh axes {spec.split_axes}, "
        "and no mesh has them: set one (jax.set_mesh) or place the params on one")
  return mesh


def _specs(tree: Any, axes: tuple[str, ...]) -> list[P]:
  """Per leaf of `tree`, its sharding: split over `axes` for a split packed tree's buffers."""
  mark = lambda x: _packing.Packed([P(axes)] * len(x.buffers), x.layout) \
      if _packing.is_packed(x) and x.layout.split else jax.tree.map(lambda _: P(), x)
  specs = jax.tree.map(mark, tree, is_leaf=_packing.is_packed)
  return jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P))


def _arrays(spec: Any) -> tuple[list[str], list[jax.Array]]:
  """The spec's fields that are arrays (hyperparameters under optax.inject_hyperparams): they
  enter a shard_map as operands (its body may not close over arrays sharded on Explicit axes),
  and the body's spec is ``dataclasses.replace(spec, **dict(zip(names, local)))``."""
  names = [f.name for f in dataclasses.fields(spec) if isinstance(getattr(spec, f.name), jax.Array)]
  return names, [getattr(spec, name) for name in names]


def _localized(state: Any) -> Any:
  """`state` with each split packed tree seen as one segment (its local layout)."""
  local = lambda x: _packing.Packed(x.buffers, x.layout.local()) \
      if _packing.is_packed(x) and x.layout.split else x
  return jax.tree.map(local, state, is_leaf=_packing.is_packed)


def _shapes(layout: _packing.Layout) -> _packing.Packed:
  """A Packed tree of `layout` whose buffers are ShapeDtypeStructs."""
  return _packing.Packed([jax.ShapeDtypeStruct((n,), d) for n, d in
                          zip(layout.buffer_sizes, layout.buffer_dtypes)], layout)


def init(spec: Any, params: Any, mesh: Any = None) -> Any:
  """spec.init(params) (unpacked params) split over `mesh` (None: the mesh set or the params'):
  every device makes only its segment, the state of its chunks of the params."""
  _packing.check_not_split(params)
  split = _Split(spec, params, _mesh(spec, params, mesh=mesh))
  whole = jax.eval_shape(spec.unpacked_init, params)  # checks the params, warns once
  states = spec.states(whole)
  quantized = [_moments.is_quantized(x) for x in
               jax.tree.structure(params).flatten_up_to(states[0])] if states else None
  target = spec.pack_state(whole, lambda tree: _shapes(split.layout(tree)))
  leaves, params_def = jax.tree.flatten(params)
  params_layout = split.layout(params)
  names, arrays = _arrays(spec)

  def body(*local):
    own = dataclasses.replace(spec, **dict(zip(names, local[len(leaves):])))
    chunks = _packing.local_segment(params_def.unflatten(local[:len(leaves)]), params_layout,
                                    split.index())
    segment = own.pack_state(own.unpacked_init(chunks.unpack(), quantized))
    if jax.tree.structure(segment) != jax.tree.structure(_localized(target)):
      raise AssertionError(f"{spec.name}: a segment's state {jax.tree.structure(segment)}")
    return jax.tree.leaves(segment)

  results, state_def = jax.tree.flatten(target)
  return state_def.unflatten(_partition.manual_call(
      body, split.mesh, split.axes, leaves + arrays, [P()] * (len(leaves) + len(arrays)),
      results, _specs(target, split.axes)))


def run(spec: Any, grads: Any, state: Any, params: Any, segment_step: SegmentStep,
        out_dtypes: list[Any], *replicated: jax.Array) -> tuple[Any, Any]:
  """One step on a state split as ``spec.packed`` says, with checked arguments: every device
  runs `segment_step` on its segment; returns (`segment_step`'s out, of `out_dtypes` (per params
  leaf), gathered whole as a tree like the params; the new state, still split)."""
  whole_params, whole_grads = _packing.unpack(params), _packing.unpack(grads)
  _packing.check_not_split((whole_params, whole_grads))
  split = _Split(spec, whole_params, _mesh(spec, state, params, grads))
  params_layout, grads_layout = split.layout(whole_params), split.layout(whole_grads)
  out_layout = split.layout(jax.tree.map(lambda p, d: jax.ShapeDtypeStruct(p.shape, d),
                                         whole_params,
                                         jax.tree.structure(whole_params).unflatten(out_dtypes)))
  traced, arrays = _arrays(spec)
  replicated = arrays + list(replicated)
  grads_leaves, grads_def = jax.tree.flatten(whole_grads)
  params_leaves, params_def = jax.tree.flatten(whole_params)
  state_leaves, state_def = jax.tree.flatten(state)
  operands = grads_leaves + state_leaves + params_leaves + replicated
  state_specs = _specs(state, split.axes)
  cut = list(itertools.accumulate([len(grads_leaves), len(state_leaves), len(params_leaves),
                                   len(traced)]))
  gather = _Gather(out_layout, split)

  def body(*local):
    index = split.index()
    out, new_state = segment_step(
        dataclasses.replace(spec, **dict(zip(traced, local[cut[2]:cut[3]]))),
        _packing.local_segment(grads_def.unflatten(local[:cut[0]]), grads_layout, index),
        _localized(state_def.unflatten(local[cut[0]:cut[1]])),
        _packing.local_segment(params_def.unflatten(local[cut[1]:cut[2]]), params_layout, index),
        split.segment, *local[cut[3]:])
    if out.layout != out_layout.local():
      raise AssertionError(f"{spec.name}: a segment's {out.layout!r}, not {out_layout!r}'s")
    return gather.gathered(out, split.axes) + jax.tree.leaves(new_state)

  out = _partition.manual_call(
      body, split.mesh, split.axes, operands,
      [P()] * len(grads_leaves) + state_specs + [P()] * (len(params_leaves) + len(replicated)),
      gather.results + state_leaves, [P()] * len(gather.results) + state_specs)
  n = len(gather.results)
  return gather.tree(out[:n]), state_def.unflatten(out[n:])


class _Gather:
  """How a step's out (new params or updates: Packed chunks of `layout`) is gathered whole:
  leaves of GATHERED_ALONE elements or more each in an all-gather of their own, which lands
  them whole and in place (XLA's all-gather combiner, where it runs, merges such gathers); the
  smaller ones packed, one all-gather per dtype, then copied out of the gathered segments."""

  GATHERED_ALONE = 1 << 16

  def __init__(self, layout: _packing.Layout, split: _Split):
    self.layout = layout
    places = layout.places
    self.alone = [i for i, p in enumerate(places) if p.size >= self.GATHERED_ALONE]
    self.small = [i for i, p in enumerate(places) if p.size < self.GATHERED_ALONE]
    self.small_layout = _packing.layout_of(
        [jax.ShapeDtypeStruct(places[i].shape, places[i].dtype) for i in self.small],
        split.shards, split.axes, [places[i].chunk for i in self.small])
    self.results = [jax.ShapeDtypeStruct((places[i].chunk * split.shards,), places[i].dtype)
                    for i in self.alone] + list(_shapes(self.small_layout).buffers)

  def gathered(self, out: _packing.Packed, axes: tuple[str, ...]) -> list[jax.Array]:
    """In the shard_map: the all-gathers of this device's `out`, as `results` lists them."""
    chunks = jax.tree.leaves(out.unpack())
    small = _packing.pack([chunks[i] for i in self.small], self.small_layout.local())
    return [jax.lax.all_gather(x, axes, tiled=True)
            for x in [chunks[i] for i in self.alone] + list(small.buffers)]

  def tree(self, gathered: list[jax.Array]) -> Any:
    """The whole tree from the gathered arrays."""
    leaves: list[Any] = [None] * len(self.layout.places)
    for i, x in zip(self.alone, gathered):
      p = self.layout.places[i]
      leaves[i] = x[:p.size].reshape(p.shape)
    small = _packing.Packed(gathered[len(self.alone):], self.small_layout).unpack()
    for i, x in zip(self.small, small):
      leaves[i] = x
    return self.layout.treedef.unflatten(leaves)
