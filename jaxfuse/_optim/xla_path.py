"""The optax protocol of the generic fused optimizer: ``tx.update`` as the family's element math
in XLA operations, which XLA fuses with ``optax.apply_updates`` into one pass, as optax's own
step is."""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import optax

from jaxfuse._core import packing as _packing
from jaxfuse._core import partition as _partition
from jaxfuse._core import trees as _trees
from jaxfuse._optim import moments as _moments
from jaxfuse._optim import rounding as _rounding
from jaxfuse._optim import spec as _spec
from jaxfuse._optim import split as _split
from jaxfuse._optim import step as _step
from jaxfuse._optim.spec import Spec


def compute_dtype(*dtypes) -> Any:
  """The type a leaf is computed in (optimizer.h): float32, float64 where a buffer is 64-bit,
  and the complex type of that width for complex leaves."""
  wide = any(_trees.is_wide(d) for d in dtypes)
  if any(_trees.is_complex(d) for d in dtypes):
    return jnp.dtype(jnp.complex128 if wide else jnp.complex64)
  return jnp.dtype(jnp.float64 if wide else jnp.float32)


def _output_dtype(spec: Spec, grad: jax.Array, states: list) -> Any:
  # optax's updates have the grads' dtype, or wider where its math promotes them (a wider
  # state dtype). Where jaxfuse rounds the params' new value the update is the step between two
  # values of the params' dtype: exact in the grads' dtype with master weights (as before), and
  # in float32 or wider with remainders and stochastic rounding, whose 16-bit params often step
  # across zero (a bf16 difference is exact only between values within a factor 2).
  if spec.keeps_remainders or spec.stochastic_rounding:
    return jnp.promote_types(grad.dtype, jnp.float32)
  if spec.master_weights:
    return grad.dtype
  return jnp.result_type(grad.dtype, *[s.dtype for s in states])


class _LeafParams(NamedTuple):
  """How one leaf's params are kept, for _leaf_update: its params, master copy, remainder
  (None where it has none) and random stream (None unless it is rounded stochastically)."""

  params: Optional[jax.Array]
  master: Optional[jax.Array] = None
  remainder: Optional[jax.Array] = None
  stream: Optional[jax.Array] = None

  def source(self) -> Optional[jax.Array]:
    """The value the math reads: the master (kept, or joined from the remainder) or params."""
    if self.remainder is not None:
      return _rounding.join_remainder(self.params, self.remainder)
    return self.master if self.master is not None else self.params

  def stored(self, value: jax.Array) -> tuple[jax.Array, Optional[jax.Array]]:
    """(new params, new remainder or None) that store the new master `value`."""
    if self.remainder is not None:
      return _rounding.split_remainder(value)
    if self.stream is not None:
      bits = _rounding.element_bits(self.stream, value.shape)
      return _rounding.stochastic_round(value, self.params.dtype, bits), None
    return value.astype(self.params.dtype), None


def _leaf_update(spec: Spec, h: dict, g, leaf: _LeafParams, states: list, flags: dict,
                 skip) -> tuple:
  """optimizer_group() (optimizer.h) for one leaf as XLA operations, in the same operation
  order: (update, new states, new master or None, new remainder or None)."""
  p, master = leaf.params, leaf.master
  stored_states = states  # as kept: 8-bit ones are QuantizedMoments
  states = [_moments.dequantize(s) if _moments.is_quantized(s) else s for s in states]
  c = compute_dtype(*[x.dtype for x in (g, p, *states, master) if x is not None])
  real = jnp.finfo(c).dtype
  k = {name: jnp.asarray(x, real) for name, x in h.items()}
  gc = g.astype(c)
  if "loss_scale" in k:
    gc = gc / k["loss_scale"]
  source = leaf.source()
  u, new_states = spec.leaf_math(k, gc, None if source is None else source.astype(c),
                                 [s.astype(c) for s in states], flags)
  new_master = new_remainder = None
  if master is not None or leaf.remainder is not None or leaf.stream is not None:
    # The exact step from the params to the new value's rounding: both are values of the
    # params' dtype, so the difference is exact when they are within a factor 2 of each other
    # (Sterbenz), and optax.apply_updates lands on it.
    new_value = source.astype(c) + u
    new_params, new_remainder = leaf.stored(new_value)
    u = new_params.astype(c) - p.astype(c)
    new_master = new_value if master is not None else None
  def keep(new, old):
    if old is None:
      return None
    new = _moments.like(new, old) if _moments.is_quantized(old) else new.astype(old.dtype)
    return new if skip is None else jax.tree.map(lambda n, o: jnp.where(skip, o, n), new, old)

  out_dtype = _output_dtype(spec, g, states)
  update = u.astype(out_dtype) if skip is None else jnp.where(skip, 0, u.astype(out_dtype))
  return (update, [keep(n, o) for n, o in zip(new_states, stored_states)],
          keep(new_master, master),
          keep(new_remainder, leaf.remainder))


def _leaf_params(spec: Spec, leaves: "_step.Leaves", i: int, count: jax.Array,
                 shard: Any) -> _LeafParams:
  """How leaf i's params are kept, in the optax protocol (one device's view: a leaf's stream
  is its shard 0's, or with a split state this device's chunk's, `shard`)."""
  pick = lambda x: None if x is None else x[i]
  p = pick(leaves.params)
  remainder = pick(leaves.remainders)
  stream = None
  if spec.stochastic_rounding and p is not None and p.dtype in _rounding.ROUNDED_DTYPES:
    stream = _rounding.stream(spec.rounding_seed, leaves.positions[i], shard, count)
  return _LeafParams(p, pick(leaves.master_params),
                     remainder if remainder is not None and remainder.size else None, stream)


def xla_updates(spec: Spec, grads: Any, state: Any, params: Any,
                grad_scale: Any = None, skip: Any = None) -> tuple[Any, Any]:
  """The optax protocol: (updates, new_state), params untouched, with the element math as XLA
  operations, so that XLA fuses it with what consumes the updates (``optax.apply_updates``):
  the step then reads and writes each buffer once, as optax's does, on every backend. The math
  is the kernels' (16-bit leaves computed in float32 and rounded once, master weights, loss
  scale); with ``skip_nonfinite`` one global-norm call decides the skip. Packed trees (a
  ``packed`` state, packed params and grads) are unpacked into views and the results packed
  again: XLA fuses the math into the concatenation, one pass as without packing. `skip`: with
  ``skip_nonfinite``, the skip flag a caller decided on more gradients than these (a composite
  transform's whole tree); None: decided on these."""
  grads, state, params = _trees.as_arrays((grads, state, params))
  if _packing.contains_packed((grads, state, params)) or spec.split_axes:
    _, flags = _step.check_arguments(spec, grads, state, params)  # the packed trees' checks
    if _packing.is_packed(grads) and (spec.keeps_remainders or spec.stochastic_rounding):
      raise ValueError(
          f"{spec.name}: with packed params, master_weights='remainder' and stochastic_rounding "
          "run in jaxfuse.fused_step only (their exact updates are float32, which a tree packed "
          "like the 16-bit params cannot hold)")
    if spec.split_axes:
      return _split_updates(spec, flags, grads, state, params, grad_scale)
    updates, new = xla_updates(dataclasses.replace(spec, packed=False), _packing.unpack(grads),
                               _packing.unpack(state), _packing.unpack(params), grad_scale)
    return _packing.repack(updates, grads), _packing.repack(new, state)
  leaves, flags = _step.checked_leaves(spec, grads, state, params)
  if not spec.skip_nonfinite:
    skip = None
  elif skip is None:
    skip = _step.skip_flag(_step.grad_ctrl_for(spec, grads, grad_scale)[1])
  return _updates(spec, leaves, flags, grads, state, grad_scale, skip, 0)


def _split_updates(spec: Spec, flags: list[int], grads: Any, state: Any, params: Any,
                   grad_scale: Any) -> tuple[Any, Any]:
  """The optax protocol on a state split over devices (split.py), with checked arguments:
  each device's updates of its chunks, gathered."""
  replicated = [] if grad_scale is None else [jnp.asarray(grad_scale)]
  if spec.skip_nonfinite:
    replicated.append(_step.skip_flag(_step.grad_ctrl_for(spec, grads, grad_scale)[1]))
  whole_grads = jax.tree.leaves(_packing.unpack_shapes(grads))
  states = [jax.tree.leaves(_packing.unpack_shapes(t), is_leaf=_moments.is_quantized)
            for t in spec.states(state)]
  dtypes = [_output_dtype(spec, g, [jax.ShapeDtypeStruct((), _step.state_dtype(s[i]))
                                    for s in states])
            for i, g in enumerate(whole_grads)]

  def segment_step(spec, grads, state, params, segment, *replicated):
    plain = dataclasses.replace(spec, packed=False)
    scale = replicated[0] if grad_scale is not None else None
    skip = replicated[-1] if spec.skip_nonfinite else None
    grads, views, params = _packing.unpack((grads, state, params))
    leaves = _step.flat_leaves(plain, grads, views, params)
    with _spec.sums_over(segment.axis_names):
      updates, new = _updates(plain, leaves, flags, grads, views, scale, skip,
                              _partition.linear_index(segment, segment.axis_names))
    return _packing.pack(updates), _packing.repack(new, state)

  updates, new_state = _split.run(spec, grads, state, params, segment_step, dtypes, *replicated)
  return _packing.repack(updates, grads), new_state


def _updates(spec: Spec, leaves: "_step.Leaves", flags: list[int], grads: Any, state: Any,
             grad_scale: Any, skip: Any, shard: Any) -> tuple[Any, Any]:
  """xla_updates() on the flattened `leaves` of (grads, state, params); `shard` is this
  device's place for the rounding streams."""
  names = spec.contract.names["tensor_flags"]
  count = spec.step_count(state)
  h = {**spec.xla_hyper(count), **spec.state_hyper(state)}
  if grad_scale is not None:
    h["loss_scale"] = grad_scale
  n = len(leaves.grads)
  outputs, masters = [None] * n, [None] * n
  remainders = list(leaves.remainders) if leaves.remainders is not None else None
  states = [[None] * n for _ in leaves.states]
  for i in range(n):
    u, new_states, new_master, new_remainder = _leaf_update(
        spec, h, leaves.grads[i], _leaf_params(spec, leaves, i, count, shard),
        [s[i] for s in leaves.states],
        {name: bool(flags[i] >> b & 1) for b, name in enumerate(names)}, skip)
    outputs[i], masters[i] = u, new_master
    if new_remainder is not None:
      remainders[i] = new_remainder
    for s, x in zip(states, new_states):
      s[i] = x
  t = optax.safe_increment(count)
  treedef = jax.tree.structure(grads)
  tree = lambda x: None if x is None else treedef.unflatten(x)
  return treedef.unflatten(outputs), _step.new_state(
      spec, state, [treedef.unflatten(s) for s in states],
      tree(masters if spec.keeps_master else None), tree(remainders),
      t if skip is None else jnp.where(skip, count, t),
      jnp.bool_(False) if skip is None else skip)
