"""The fused in-place step of the generic optimizer (:func:`jaxfuse.fused_step`): one FFI call per
family of dtypes (float32 math, float64, complex64, complex128) and per MAX_LEAVES_PER_CALL
leaves, params, state and master copy aliased in place, a jaxfuse clip directly before it folded
in, on every device's own shards when the leaves are sharded. A trust-ratio family (LAMB, LARS)
first sums each leaf's squares of params and direction (its trust-sums op; over the devices that
split a leaf, one small all-reduce), then steps with each leaf's ratio."""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxfuse._core import ffi as _ffi
from jaxfuse._core import packing as _packing
from jaxfuse._core import partition as _partition
from jaxfuse._core import trees as _trees
from jaxfuse._optim import inplace as _inplace
from jaxfuse._optim import moments as _moments
from jaxfuse._optim import split as _split
from jaxfuse._optim import step as _step
from jaxfuse._optim.spec import Spec

# Leaves per optimizer call (kMaxTensorsPerCall in optim/optimizer.h says why): larger trees are
# split into calls of this many.
MAX_LEAVES_PER_CALL = _ffi.contract("jaxfuse_adam").numbers["max_tensors_per_call"]


class _ListOperands(NamedTuple):
  """Where one list of a call sits among its operands: its first operand, its buffers (one for
  a packed list, else one per leaf) and, packed, each leaf's offset in the buffer."""

  first: int
  count: int
  offsets: Optional[list[int]]


def _packed_attrs(plan: dict[str, _ListOperands], names: list[str], sizes: list[int]) -> dict:
  """The packed-list attributes (tensor_lists.h's PackedLists) of a call of lists `names`."""
  packed = [k for k, name in enumerate(names) if plan[name].offsets is not None]
  return dict(packed_lists=np.int64(sum(1 << k for k in packed)),
              packed_offsets=np.asarray([o for k in packed for o in plan[names[k]].offsets],
                                        np.int64),
              tensor_sizes=np.asarray(sizes if packed else [], np.int64))


def _trust_sums(spec: Spec, shards: _partition.Shards, local: list, plan: dict[str, _ListOperands],
                flags: list[int], sizes: list[int]) -> jax.Array:
  """The trust_sums operand of a trust-ratio family's call (optimizer.h), inside its body: one
  call of the family's trust-sums op (trust_sums.h) over this device's shards, and when leaves
  are split over devices, each device's sums in its own row of a zero matrix (only the first
  replica of a leaf counts it), all-reduced: every device then adds the same rows in the same
  order. `plan` says where each list is among the `local` operands."""
  op = spec.contract.names["trust_sums_op"][0]
  contract = _ffi.traced_contract(op)  # its workspace is a partial per multi-tensor chunk
  words = contract.numbers["sum_words"]
  chunk = contract.numbers["chunk_scalars"]
  source = "master_params" if "master_params" in plan else "params"
  names = ["grads", source,
           *spec.lists()["operands"][2:2 + contract.numbers["direction_states"]]]
  n = len(sizes)
  operands = []
  for name in names:
    at = plan[name].first
    operands += [local[at]] if plan[name].offsets is not None else \
        [_partition.without_padding(shards, at + i, local[at + i]) for i in range(n)]
  grads = plan["grads"]
  complex_ = _trees.is_complex(local[grads.first].dtype)
  scalars = sizes if grads.offsets is not None else [local[grads.first + i].size for i in range(n)]
  # The kernels count scalars: a complex element is two.
  chunks = sum(-(-(x * (2 if complex_ else 1)) // chunk) for x in scalars)
  call = jax.ffi.ffi_call(
      _ffi.target(op),
      [jax.ShapeDtypeStruct((n, words), jnp.uint32),
       jax.ShapeDtypeStruct((chunks * contract.numbers["partial_bytes"],), jnp.uint8)],
      vmap_method="sequential")
  fixed = [local[i] for i in range(len(spec.contract.names["fixed_operands"]))]
  sums, _ = call(*fixed, *operands, num_tensors=np.int64(n), flags=np.int64(spec.flag_bits()),
                 tensor_flags=np.asarray(flags, np.uint8), **_packed_attrs(plan, names, sizes))
  if not shards.axis_names:
    return sums[None]
  axes = shards.axis_names
  firsts = [_partition.first_replica(shards, plan["params"].first + i) for i in range(n)]
  own = jnp.where(jnp.stack(firsts)[:, None], sums, jnp.zeros_like(sums))
  rows = jnp.zeros((shards.size(axes), n, words), jnp.uint32)
  return jax.lax.psum(rows.at[_partition.linear_index(shards, axes)].set(own), axes)


def _rounding_keys(spec: Spec, positions: list[int]) -> jax.Array:
  """The rounding_keys operand (rounding.h's RoundingKey rows) of a call over the leaves at
  `positions` in the params tree, its shard column 0 (_with_shards fills it in)."""
  names = spec.contract.names["rounding_key"]
  n = len(positions)
  columns = {"seed": jnp.full(n, spec.rounding_seed, jnp.uint32),
             "leaf": jnp.asarray(positions, jnp.uint32), "shard": jnp.zeros(n, jnp.uint32)}
  return jnp.stack([columns[name] for name in names], axis=1)


def _with_shards(spec: Spec, keys: jax.Array, shards: _partition.Shards,
                 params_operand: int) -> jax.Array:
  """`keys` inside a call's body with each leaf's shard column set: this device's place among
  the shards of each leaf split over devices (replicas of a shard agree, so they store the same
  bits)."""
  if not shards.axis_names:
    return keys
  index = [_partition.linear_index(
      shards, [a for dim in shards.operand_axes[params_operand + i] for a in dim])
      for i in range(keys.shape[0])]
  column = spec.contract.names["rounding_key"].index("shard")
  return keys.at[:, column].set(jnp.stack(index).astype(jnp.uint32))


def _scales(state_list: str) -> str:
  """The name of a state list's block-scale list (optimizer.h's list_name())."""
  return f"{state_list}_scales"


def _check_whole_blocks(spec: Spec, local: tuple, plan: dict, state: str,
                       positions: list[int]) -> None:
  """Raises unless each leaf's local shard holds its 8-bit states' whole blocks: a leaf split
  along a dimension its blocks run along is refused (its scales are not split there)."""
  for i, position in enumerate(positions):
    codes = local[plan[state].first + i]
    scales = local[plan[_scales(state)].first + i]
    if codes.size != scales.size * spec.moment_block:
      raise ValueError(
          f"{spec.name}: params leaf number {position} (in tree order) is split along one of "
          f"its dimensions {list(range(scales.ndim - 1, codes.ndim))}, which its 8-bit blocks "
          f"of {spec.moment_block} elements run along (moment_bits=8); shard it along one of "
          f"its first {scales.ndim - 1} dimensions, or replicate it")


def _ffi_call(spec: Spec, count, hyper, grad_ctrl, leaves: _step.Leaves, flags: list[int],
              segment: Optional[_partition.Shards]) -> tuple[jax.Array, dict[str, list]]:
  """One FFI call of the family's op over `leaves`, in place, on every device's own shards when
  they are sharded. A list whose leaves are Slots of one packed buffer passes that buffer and
  their offsets (a call with packed lists runs whole on every device), and its new buffer
  replaces the old in ``leaves.buffers``. With `segment` (a split state's step, in its
  shard_map) the leaves are this device's chunks of leaves split over `segment`'s axes. Returns
  (new count, the other lists' result leaves by list name)."""
  n = len(leaves.grads)
  master = leaves.master_params is not None
  remainders = leaves.remainders is not None
  quantized = leaves.quantized(0)
  call_lists = spec.lists(master, remainders, quantized)
  operand_lists, result_lists = call_lists["operands"], call_lists["results"]
  state_names = operand_lists[2:2 + len(leaves.states)]
  by_name = dict(grads=leaves.grads, params=leaves.params, master_params=leaves.master_params,
                 param_remainders=leaves.remainders)
  for name, states in zip(state_names, leaves.states):
    by_name[name] = [s.codes for s in states] if quantized else states
    if quantized:
      by_name[_scales(name)] = [s.scales for s in states]
  fixed = dict(count=count, hyper=hyper, grad_ctrl=grad_ctrl)
  fixed_names = spec.contract.names["fixed_operands"]
  operands = [fixed[name] for name in fixed_names]
  plan: dict[str, _ListOperands] = {}
  for name in operand_lists:
    items = by_name[name]
    if _step.is_slot(items[0]):
      plan[name] = _ListOperands(len(operands), 1, [x.offset for x in items])
      operands.append(leaves.buffers[items[0].buffer])
    else:
      plan[name] = _ListOperands(len(operands), n, None)
      operands += items
  packed = any(x.offsets is not None for x in plan.values())
  sizes = [x.size for x in leaves.grads]
  result_plan, at = {}, len(spec.contract.names["fixed_results"])
  for name in result_lists:
    result_plan[name] = at
    at += plan[name].count
  aliases = {plan[name].first + i: result_plan[name] + i for name in result_lists
             for i in range(plan[name].count)}
  num_list_operands = len(operands)
  if "rounding_keys" in call_lists["trailing_operands"]:
    operands.append(_rounding_keys(spec, leaves.positions))  # whole: the body sets its shards

  def body(shards, *local):
    # Elementwise: each device updates its own shards (trust ratios need whole leaves' sums).
    trailing = []
    for name in call_lists["trailing_operands"]:
      if name == "trust_sums":
        trailing.append(_trust_sums(spec, shards, list(local), plan, flags, sizes))
      else:
        trailing.append(_with_shards(spec, local[num_list_operands], shards,
                                     plan["params"].first))
    if quantized and not packed:
      _check_whole_blocks(spec, local, plan, state_names[0], leaves.positions)
    results = [local[plan[name].first + i] for name in result_lists
               for i in range(plan[name].count)]
    call = jax.ffi.ffi_call(_ffi.target(spec.op),
                            [jax.ShapeDtypeStruct((), jnp.int32)]
                            + [jax.ShapeDtypeStruct(jnp.shape(x), x.dtype) for x in results],
                            input_output_aliases=aliases, vmap_method="sequential")
    return call(*local[:num_list_operands], *trailing, num_tensors=np.int64(n),
                flags=np.int64(spec.flag_bits()),
                master=master, remainders=remainders,
                stochastic_rounding=spec.stochastic_rounding, quantized_states=quantized,
                tensor_flags=np.asarray(flags, np.uint8),
                **_packed_attrs(plan, operand_lists, sizes))

  if segment is not None:  # every operand is this device's chunks of leaves split over it
    segment = dataclasses.replace(
        segment, operand_axes=((segment.axis_names,),) * (len(operands) + n))
    out = body(segment, *operands)
  else:
    partition = _layout(leaves, plan, operand_lists, result_lists, state_names, operands,
                        num_list_operands, fixed_names)
    out = _partition.partitioned_call(spec.name, body, partition, operands)
  lists = {}
  for name, at in result_plan.items():
    if plan[name].offsets is None:
      lists[name] = list(out[at:at + plan[name].count])
    else:  # the packed buffer updated: the next call over it takes this one
      leaves.buffers[by_name[name][0].buffer] = out[at]
  return out[0], lists


def _layout(leaves: _step.Leaves, plan: dict[str, _ListOperands], operand_lists: list,
            result_lists: list, state_names: list, operands: list, num_list_operands: int,
            fixed_names: list) -> _partition.Layout:
  """How a call's operands may be split over devices: each leaf's lists along the leaf's
  dimensions (an 8-bit state's scales along its leading ones), everything whole in a call with
  packed lists (their offsets index whole leaves)."""
  if any(x.offsets is not None for x in plan.values()):
    label = lambda name, i: f"packed {name}" if plan[name].offsets is not None \
        else f"{name} leaf {i}"
    return _partition.Layout(
        operands=tuple(_partition.whole(x) for x in operands),
        results=((),) + tuple(_partition.whole(operands[plan[name].first + i])
                              for name in result_lists for i in range(plan[name].count)),
        names=tuple(fixed_names) + tuple(label(name, i) for name in operand_lists
                                         for i in range(plan[name].count))
        + ("rounding_keys",) * (len(operands) - num_list_operands))
  n = len(leaves.grads)
  leaf_dims = _partition.leaf_dims(leaves.grads, "leaf")
  # A block scale's last dimension counts blocks: never split (a leaf split along a dimension
  # its blocks run along is refused in the body); its others are the leaf's leading ones.
  quantized = leaves.quantized(0)
  scales_ndim = [jnp.ndim(s.scales) for s in leaves.states[0]] if quantized else []
  block_dims = tuple((*dims[:k - 1], None) for dims, k in zip(leaf_dims, scales_ndim))
  scale_lists = {_scales(name) for name in state_names}
  list_dims = lambda name: block_dims if name in scale_lists else leaf_dims
  keys = tuple(operands[num_list_operands:])
  return _partition.Layout(
      operands=tuple(_partition.whole(x) for x in operands[:len(fixed_names)])
      + sum((list_dims(name) for name in operand_lists), ())
      + tuple(_partition.whole(x) for x in keys),
      results=((),) + sum((list_dims(name) for name in result_lists), ()),
      names=tuple(fixed_names)
      + tuple(f"{name} leaf {i}" for name in operand_lists for i in range(n))
      + ("rounding_keys",) * len(keys),
      # The state written back keeps its sharding; the gradients follow it.
      prefer=tuple(plan[name].first + i for name in operand_lists if name != "grads"
                   for i in range(n)))


def _calls(leaves: _step.Leaves, nonempty: list[int]) -> list[list[int]]:
  """The leaves of each FFI call: the ``nonempty`` ones, one family (compute type, real or
  complex, with remainders or not) and one buffer per packed list per call, at most
  MAX_LEAVES_PER_CALL each."""
  families: dict[tuple, list[int]] = {}
  for i in nonempty:
    families.setdefault((leaves.family(i), leaves.buffer_key(i)), []).append(i)
  return [idx[k:k + MAX_LEAVES_PER_CALL] for idx in families.values()
          for k in range(0, len(idx), MAX_LEAVES_PER_CALL)]


def in_place(spec: Spec, grads: Any, state: Any, params: Any,
             grad_ctrl: Optional[jax.Array] = None) -> tuple[Any, Any]:
  """The fused step: (new_params, new_state), params, state lists and master params updated in
  place. `grad_ctrl` is the gradient-control vector (loss scale, clip divisor and multiplier,
  skip flag) that the global-norm kernel produces; None means no clip, no loss scale, and with
  `skip_nonfinite` the caller must pass the vector of a norm call made with it."""
  grads, state, params = _trees.as_arrays((grads, state, params))
  if params is None:
    raise ValueError("jaxfuse.fused_step: params are required")
  if grad_ctrl is None:
    if spec.skip_nonfinite:
      raise ValueError("jaxfuse: skip_nonfinite needs the control vector of a norm call")
    grad_ctrl = _step.default_grad_ctrl()
  if spec.split_axes:
    _, flags = _step.check_arguments(spec, grads, state, params)

    def segment_step(spec, grads, state, params, shards, grad_ctrl):
      leaves = _step.flat_leaves(spec, grads, state, params)
      return _step_leaves(spec, leaves, flags, grads, state, params, grad_ctrl, shards)

    dtypes = [p.dtype for p in jax.tree.leaves(_packing.unpack_shapes(params))]
    new_params, new_state = _split.run(spec, grads, state, params, segment_step, dtypes,
                                       grad_ctrl)
    return _packing.repack(new_params, params), new_state
  leaves, flags = _step.checked_leaves(spec, grads, state, params)
  if leaves.buffers:  # packed lists index whole leaves
    _packing.check_not_split((params, grads))
  return _step_leaves(spec, leaves, flags, grads, state, params, grad_ctrl, None)


def _step_leaves(spec: Spec, leaves: _step.Leaves, flags: list[int], grads: Any, state: Any,
                 params: Any, grad_ctrl: jax.Array,
                 segment: Optional[_partition.Shards]) -> tuple[Any, Any]:
  """in_place() on the flattened `leaves` of (grads, state, params); `segment` as _ffi_call
  takes it."""
  count = spec.step_count(state)
  hyper = _ffi.device_vector(spec.contract.names["hyper"], **spec.hyper(count),
                             **spec.state_hyper(state))
  new_params = list(leaves.params)  # a zero-size leaf is its own result: no call
  states = [list(s) for s in leaves.states]
  masters = None if leaves.master_params is None else list(leaves.master_params)
  remainders = None if leaves.remainders is None else list(leaves.remainders)
  new_count = None
  state_lists = spec.lists()["operands"][2:]
  for idx in _calls(leaves, _trees.nonempty(leaves.grads)):
    c, out = _ffi_call(spec, count, hyper, grad_ctrl, leaves.select(idx), [flags[i] for i in idx],
                       segment)
    new_count = c if new_count is None else new_count
    for k, i in enumerate(idx):  # the lists not packed, leaf by leaf
      if "params" in out:
        new_params[i] = out["params"][k]
      for s, name in zip(states, state_lists):
        if name in out:
          s[i] = _moments.QuantizedMoment(out[name][k], out[_scales(name)][k]) \
              if _scales(name) in out else out[name][k]
      if "master_params" in out:
        masters[i] = out["master_params"][k]
      if "param_remainders" in out:
        remainders[i] = out["param_remainders"][k]
  skip = _step.skip_flag(grad_ctrl)
  if new_count is None:  # no element anywhere: the count still advances, as in optax
    new_count = jnp.where(skip, count, optax.safe_increment(count))
  packed = _step.packed_results(spec, grads, state, params, leaves.buffers)
  treedef = jax.tree.structure(params)
  tree = lambda new, leaves: new if new is not None else \
      None if leaves is None else treedef.unflatten(leaves)
  new_params = tree(packed[0], new_params)
  new_states = [tree(p, s) for p, s in zip(packed[1:-2], states)]
  return new_params, _step.new_state(spec, state, new_states, tree(packed[-2], masters),
                                     tree(packed[-1], remainders), new_count, skip)


def update_in_place(spec: Spec, step: _inplace.InPlaceStep, grads: Any, state: Any,
                     params: Any) -> tuple[Any, Any]:
  """The optimizer of a fused_step: params and state updated in place (a jaxfuse clip directly
  before it folded in), the new params recorded; the updates returned are placeholders."""
  if params is None:
    raise ValueError("jaxfuse.fused_step: params are required")
  norm, grad_ctrl = step_grad_ctrl(spec, step, grads)
  new_params, new_state = in_place(spec, grads, state, params, grad_ctrl)
  return record(spec, step, grads, new_params, norm), new_state


def step_grad_ctrl(spec: Spec, step: _inplace.InPlaceStep, grads: Any) -> tuple[Any, jax.Array]:
  """(global norm or None, gradient-control vector) of an in-place step over `grads`: one
  global-norm call that folds a jaxfuse clip recorded directly before (for these leaves), the
  step's loss scale and `spec`'s non-finite skip."""
  clip = step.take_clip(grads)
  return _step.grad_ctrl_for(spec, grads, step.grad_scale,
                             clip_max_norm=None if clip is None else clip.max_norm,
                             need_norm=step.need_norm,
                             axis_name=None if clip is None else clip.axis_name)


def record(spec: Spec, step: _inplace.InPlaceStep, grads: Any, new_params: Any,
           norm: Any) -> Any:
  """Records the in-place step's new params (and norm) in `step`; returns the placeholder
  updates the optimizer hands back (zeros that nothing reads)."""
  placeholders = jax.tree.map(jnp.zeros_like, _trees.as_arrays(grads))
  step.record_step(spec.name, new_params, norm, placeholders)
  return placeholders
