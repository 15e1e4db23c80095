"""What a jitted step launches, moves and holds: ``jaxfuse.report(fn, *args)``.

The report compiles ``fn(*args, **kwargs)`` where its arguments live (nothing runs) and reads
the compiled HLO:

* XLA kernels: the instructions the step executes that launch work (fusions, copies, library
  calls such as cuBLAS, collectives), counted once per run: the body of a ``while`` loop with
  a known trip count counts that many times; one with an unknown count, and each branch of a
  conditional, counts once and marks the report inexact.
* Custom calls, and for jaxfuse's own, what each op says a call of that shape costs
  (``cost()`` in its C++ header, csrc/): the CUDA kernels and memsets it
  enqueues, and the bytes it reads and writes. On the CPU a jaxfuse call is one XLA thunk that
  runs the op on XLA's thread pool; its CUDA launches are given beside it.
* Bytes moved per step: jaxfuse's accounting for its calls, and for XLA's instructions the
  bytes of their operands and results (exact for element-wise fusions and copies, more than
  moved when a fusion reads part of an operand). XLA's own cost analysis is shown beside when
  it has one: it cannot cost custom calls, so it has none for steps that contain them.
* Peak memory: the compiled executable's arguments, results and temporaries, less what aliasing
  (donation) shares (``memory_analysis()``).
* Optimizer-state bytes per parameter, when an argument holds optax or jaxfuse state.
* Arrays: those the step takes as arguments (jit flattens, checks and hands over each on every
  call: a many-leaf step's host cost), and those of its optimizer states (``packed=True``
  keeps them a handful for any tree).

``python3 benchmarks/report_gpt2.py`` prints the report of a GPT-2-small step: jaxfuse's fused
clip+AdamW against optax's chain.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from typing import Any, Callable, Optional

import jax
import numpy as np

from jaxfuse._core import ffi as _ffi
from jaxfuse._core import packing as _packing
from jaxfuse._optim import moments as _moments
from jaxfuse._report import hlo as _hlo


@dataclasses.dataclass(frozen=True)
class Row:
  """One kind of launching instruction in a step: an XLA opcode or a custom-call target."""

  name: str             # "fusion", "copy", ..., or the custom call's target
  custom_call: bool     # a custom call (jaxfuse's or another library's)
  jaxfuse: bool         # a jaxfuse op
  instructions: int     # in the compiled HLO
  runs: int             # executions per step (loops expanded)
  launches: int         # per step on the report's platform
  cuda_launches: int    # per step on a GPU: kernels (XLA: one per instruction run)
  cuda_memsets: int
  bytes_read: int
  bytes_written: int


@dataclasses.dataclass
class Report:
  """A step's launches, bytes and memory; see the module docstring for how each is counted.
  Counts are per step; ``exact`` is False when a loop's trip count is unknown or a conditional
  is in the step (each counted once), or when a jaxfuse op's bytes are an upper bound (the
  decoder reads the KV cache only up to each row's position). The global norm's partial sums
  (at most 16 kB per call) count at their bound without clearing ``exact``."""

  platform: str
  xla_kernels: int
  custom_calls: int
  jaxfuse_calls: int
  jaxfuse_launches: int
  jaxfuse_cuda_launches: int
  jaxfuse_cuda_memsets: int
  bytes_read: int
  bytes_written: int
  xla_cost_bytes: Optional[float]
  xla_flops: Optional[float]  # XLA's cost analysis: its matmuls and element math
  peak_bytes: int
  memory: dict[str, int]
  params: Optional[int]
  state_bytes: Optional[int]
  float_state_leaves: list[str]  # with moment_bits=8, the params leaves whose states stay floats
  argument_arrays: int  # the step's argument arrays (pytree leaves)
  state_arrays: Optional[int]  # the arrays of its optimizer states (None: no state argument)
  exact: bool
  rows: list[Row]
  cuda_graph_ready: bool  # XLA may capture the jaxfuse calls into CUDA graphs
  cuda_graphs: str        # why or why not
  label: str = "step"
  baseline: Optional["Report"] = None

  @property
  def launches(self) -> int:
    """Everything the step launches on its platform: XLA kernels, other custom calls (one
    each), jaxfuse's launches."""
    return self.xla_kernels + self.custom_calls - self.jaxfuse_calls + self.jaxfuse_launches

  @property
  def bytes_moved(self) -> int:
    return self.bytes_read + self.bytes_written

  @property
  def state_bytes_per_param(self) -> Optional[float]:
    if self.state_bytes is None or not self.params:
      return None
    return self.state_bytes / self.params

  def ratios(self) -> dict[str, Optional[float]]:
    """Baseline over this step for each cost (above 1: this step costs less)."""
    if self.baseline is None:
      raise ValueError("report: no baseline to compare with")
    return {key: _ratio(getattr(self.baseline, key), getattr(self, key))
            for key in ("launches", "xla_kernels", "bytes_moved", "peak_bytes")}

  def __str__(self) -> str:
    return _format(self)


def report(fn: Callable, *args: Any, baseline: Optional[tuple] = None, **kwargs: Any) -> Report:
  """Compiles ``fn(*args, **kwargs)`` (a jitted or plain function; arguments may be arrays or
  ``jax.ShapeDtypeStruct``) without running it, for the devices its arguments are on (jax's
  default device for abstract ones), and reports what one call launches, moves and holds (see
  the module docstring).

  ``baseline=(fn2, args2)`` or ``(fn2, args2, kwargs2)`` reports a second step beside it;
  ``report.ratios()`` then gives baseline / step for launches, XLA kernels, bytes and memory.
  """
  step = _analyze(fn, args, kwargs, "step")
  if baseline is not None:
    if not isinstance(baseline, tuple) or len(baseline) not in (2, 3):
      raise TypeError("report: baseline must be (fn, args) or (fn, args, kwargs)")
    fn2, args2, kwargs2 = (*baseline, {})[:3]
    step.baseline = _analyze(fn2, tuple(args2), dict(kwargs2), "baseline")
  return step


# ---- analysis --------------------------------------------------------------------------------


def _analyze(fn: Callable, args: tuple, kwargs: dict, label: str) -> Report:
  jitted = fn if hasattr(fn, "lower") else jax.jit(fn)
  compiled = jitted.lower(*args, **kwargs).compile()
  module = _hlo.Module.parse(compiled.as_text())
  platform = _platform(compiled)
  rows, exact = _rows(module, platform)
  jf = [r for r in rows if r.jaxfuse]
  memory = _memory(compiled)
  states = _optimizer_states(args, kwargs)
  params, state_bytes = _state_size(states)
  float_leaves = _float_state_leaves(states)
  state_arrays = len(jax.tree.leaves(states)) if states else None
  graph_ready, graphs = _cuda_graphs(bool(jf))
  return Report(
      platform=platform,
      xla_kernels=sum(r.runs for r in rows if not r.custom_call),
      custom_calls=sum(r.runs for r in rows if r.custom_call),
      jaxfuse_calls=sum(r.runs for r in jf),
      jaxfuse_launches=sum(r.launches for r in jf),
      jaxfuse_cuda_launches=sum(r.cuda_launches for r in jf),
      jaxfuse_cuda_memsets=sum(r.cuda_memsets for r in jf),
      bytes_read=sum(r.bytes_read for r in rows),
      bytes_written=sum(r.bytes_written for r in rows),
      xla_cost_bytes=_xla_cost_bytes(compiled),
      xla_flops=_xla_flops(compiled),
      peak_bytes=memory.get("peak", 0),
      memory=memory,
      params=params,
      state_bytes=state_bytes,
      float_state_leaves=float_leaves,
      argument_arrays=len(jax.tree.leaves((args, kwargs))),
      state_arrays=state_arrays,
      exact=exact,
      rows=rows,
      cuda_graph_ready=graph_ready,
      cuda_graphs=graphs,
      label=label,
  )


def _platform(compiled) -> str:
  """Where the executable runs: the device of its first argument or result sharding."""
  shardings = jax.tree.leaves((compiled.input_shardings, compiled.output_shardings))
  devices = next((s.device_set for s in shardings if isinstance(s, jax.sharding.Sharding)), None)
  device = next(iter(devices)) if devices else jax.devices()[0]
  if device.platform == "gpu" and "cuda" in device.client.platform_version.lower():
    return "cuda"
  return device.platform


_ROW_COUNTS = ("instructions", "runs", "launches", "cuda_launches", "cuda_memsets", "bytes_read",
               "bytes_written")


def _rows(module: _hlo.Module, platform: str) -> tuple[list[Row], bool]:
  """One Row per opcode or custom-call target, and whether every count is exact."""
  totals: dict[str, dict[str, Any]] = {}
  exact = True
  for ins, runs, ins_exact in module.executed():
    exact &= ins_exact
    cost = _instruction_cost(module, ins, platform)
    exact &= not cost.pop("upper_bound")
    kind = {key: cost.pop(key) for key in ("custom_call", "jaxfuse")}
    row = totals.setdefault(cost.pop("name"), {**kind, **dict.fromkeys(_ROW_COUNTS, 0)})
    row["instructions"] += 1
    row["runs"] += runs
    for key, value in cost.items():
      row[key] += runs * value
  rows = [Row(name=name, **t) for name, t in totals.items()]
  rows.sort(key=lambda r: (not r.jaxfuse, -r.bytes_read - r.bytes_written, r.name))
  return rows, exact


def _instruction_cost(module: _hlo.Module, ins: _hlo.Instruction, platform: str) -> dict:
  """What one run of a launching instruction costs (Row fields but the counts)."""
  if ins.opcode == "custom-call":
    target = ins.attr("custom_call_target").strip('"')
    op, handler_set = _ffi.op_of_target(target)
    if op is not None:
      return _jaxfuse_cost(module, ins, op, handler_set, platform=platform)
    name = target
  else:
    name = ins.opcode
  operand_bytes = sum(a.bytes for shape in module.operand_shapes(ins) for a in shape)
  return {"name": name, "custom_call": ins.opcode == "custom-call", "jaxfuse": False,
          "upper_bound": False, "launches": 1,
          "cuda_launches": 1, "cuda_memsets": 0, "bytes_read": operand_bytes,
          "bytes_written": sum(a.bytes for a in ins.shape)}


def _jaxfuse_cost(module, ins, op: str, handler_set: str, platform: str) -> dict:
  operands = _operand_arrays(module, ins)
  cost = _ffi.call_cost(op, handler_set, [_buffer(a) for a in operands],
                        [_buffer(a) for a in ins.shape], _int_attrs(ins.attr("backend_config")))
  # The CUDA handlers run where the platform is CUDA, and on the CPU in a handler set of them.
  on_cuda = platform == "cuda" or _ffi.runs_cuda_kernels(handler_set)
  return {"name": op, "custom_call": True, "jaxfuse": True,
          "upper_bound": cost["bytes_upper_bound"],
          "launches": cost["cuda_kernels"] if on_cuda else 1,
          "cuda_launches": cost["cuda_kernels"], "cuda_memsets": cost["cuda_memsets"],
          "bytes_read": cost["bytes_read"], "bytes_written": cost["bytes_written"]}


def _operand_arrays(module: _hlo.Module, ins: _hlo.Instruction) -> list[_hlo.Array]:
  """One array per operand (a custom call's operands are arrays, never tuples)."""
  constraints = ins.attr("operand_layout_constraints")
  if constraints is not None:
    return _hlo.arrays(constraints)
  return [shape[0] for shape in module.operand_shapes(ins)]


def _buffer(a: _hlo.Array) -> tuple[list[int], int, bool, str]:
  return list(a.dims), a.element_bytes, a.complex, a.element_type


def _int_attrs(config: Optional[str]) -> dict[str, Any]:
  """The integer and boolean attributes of an FFI call's backend_config
  (``{num_tensors = 2 : i64, clip = true, sizes = dense<[3, 4]> : tensor<2xi64>, ...}``), int64
  arrays as lists."""
  out: dict[str, Any] = {}
  if not config:
    return out
  for part in _hlo._split_top(config.strip()[1:-1]):
    key, _, value = (s.strip() for s in part.partition("="))
    if value in ("true", "false"):
      out[key] = int(value == "true")
    elif m := re.fullmatch(r"(-?\d+) : [iu]\d+", value):
      out[key] = int(m.group(1))
    elif m := re.fullmatch(r"dense<\[?([-\d, ]*)\]?> : tensor<(\d+)xi64>", value):
      values = [int(v) for v in m.group(1).split(",") if v.strip()]
      n = int(m.group(2))
      out[key] = values * n if len(values) == 1 and n != 1 else values  # a splat: one value
  return out


def _memory(compiled) -> dict[str, int]:
  stats = compiled.memory_analysis()
  if stats is None:
    return {}
  out = {key: int(getattr(stats, f"{key}_size_in_bytes"))
         for key in ("argument", "output", "alias", "temp")}
  # What the executable holds while it runs: XLA allocates the temporaries as one block.
  out["peak"] = out["argument"] + out["output"] - out["alias"] + out["temp"]
  if getattr(stats, "peak_memory_in_bytes", 0):  # XLA's own figure, where it has one
    out["xla_peak"] = int(stats.peak_memory_in_bytes)
  return out


def _xla_cost(compiled) -> Optional[dict]:
  """XLA's cost analysis of the compiled step, or None where the backend has none."""
  try:
    cost = compiled.cost_analysis()
  except Exception:  # not every backend implements it
    return None
  if isinstance(cost, (list, tuple)):
    cost = cost[0] if cost else None
  return cost or None


def _xla_flops(compiled) -> Optional[float]:
  """XLA's count of the floating-point operations of its own instructions (matmuls, element
  math; custom calls count none), or None where it has none."""
  cost = _xla_cost(compiled)
  flops = None if cost is None else cost.get("flops")
  return None if flops is None or flops < 0 else float(flops)


def _xla_cost_bytes(compiled) -> Optional[float]:
  """XLA's cost-analysis bytes, or None where it has none (custom calls make it negative)."""
  cost = _xla_cost(compiled)
  if not cost or "bytes accessed" not in cost:
    return None
  if any(v < 0 for k, v in cost.items() if k.startswith("bytes accessed")):
    return None
  return float(cost["bytes accessed"])


def _is_optimizer_state(x: Any) -> bool:
  module = type(x).__module__
  return hasattr(x, "_fields") and module.split(".")[0] in ("optax", "jaxfuse")


def _optimizer_states(args: tuple, kwargs: dict) -> list[Any]:
  """The optax and jaxfuse states among a step's arguments."""
  return [x for x in jax.tree.leaves((args, kwargs), is_leaf=_is_optimizer_state)
          if _is_optimizer_state(x)]


def _state_size(states: list[Any]) -> tuple[Optional[int], Optional[int]]:
  """(parameters, bytes of optimizer state) of the step's optimizer states, (None, None) without
  one; the parameter count is the size of the first Adam-style ``mu`` tree, or of every group's
  where the state partitions the params (``optax.partition``, ``jaxfuse.muon``)."""
  if not states:
    return None, None
  state_bytes = sum(_nbytes(leaf) for leaf in jax.tree.leaves(states))
  has_mu = lambda x: _is_optimizer_state(x) and hasattr(x, "mu")
  partition = lambda x: type(x).__name__ == "PartitionState"
  groups = [g for x in jax.tree.leaves(states, is_leaf=partition) if partition(x)
            for g in x.inner_states.values()] or [states]
  codes = lambda leaf: leaf.codes if _moments.is_quantized(leaf) else leaf
  params = None
  for group in groups:
    mu = next((x.mu for x in jax.tree.leaves(group, is_leaf=has_mu) if has_mu(x)), None)
    if mu is not None:
      params = (params or 0) + sum(
          math.prod(jax.numpy.shape(codes(leaf)))
          for leaf in jax.tree.leaves(_packing.unpack_shapes(mu), is_leaf=_moments.is_quantized))
  return params, state_bytes


def _float_state_leaves(states: list[Any]) -> list[str]:
  """The leaves (paths within a state field such as ``mu``) kept in floats beside 8-bit ones in
  the optimizer states (moment_bits=8), each path once."""
  names: dict[str, None] = {}
  for state in states:
    for field in state:
      field = _packing.unpack_shapes(field)
      leaves = jax.tree_util.tree_flatten_with_path(field, is_leaf=_moments.is_quantized)[0]
      if any(_moments.is_quantized(leaf) for _, leaf in leaves):
        names.update((jax.tree_util.keystr(path), None) for path, leaf in leaves
                     if not _moments.is_quantized(leaf))
  return list(names)


def _nbytes(leaf: Any) -> int:
  return math.prod(np.shape(leaf)) * np.dtype(leaf.dtype).itemsize


def _cuda_graphs(has_jaxfuse: bool) -> tuple[bool, str]:
  """Whether XLA may capture the step's jaxfuse calls into CUDA graphs, and why. XLA forms
  graphs when it emits thunks (nothing in the optimized HLO shows them): each run of at least
  --xla_gpu_graph_min_graph_size (default 5) consecutive eligible thunks becomes one graph.
  jaxfuse's CUDA handlers declare themselves command-buffer compatible (op.h), so they are
  eligible whenever CUSTOM_CALL is among the enabled command types (it is by default)."""
  if not has_jaxfuse:
    return False, "no jaxfuse calls"
  flags = re.findall(r"--xla_gpu_enable_command_buffer=(\S*)", os.environ.get("XLA_FLAGS", ""))
  if flags:
    kinds = [k for k in flags[-1].strip("'\"").split(",") if k]
    if kinds and all(k[0] in "+-" for k in kinds):  # edits of the default list
      enabled = "-CUSTOM_CALL" not in kinds
    else:  # a list of its own (empty: none)
      enabled = "CUSTOM_CALL" in kinds
    if not enabled:
      return False, ("not captured: XLA_FLAGS leaves CUSTOM_CALL out of "
                     "--xla_gpu_enable_command_buffer")
  return True, ("capturable: jaxfuse's CUDA handlers are command-buffer compatible; XLA turns "
                "runs of >= 5 eligible thunks into graphs (see its thunk dump)")


# ---- the table -------------------------------------------------------------------------------


def _ratio(baseline: Optional[float], step: Optional[float]) -> Optional[float]:
  if baseline is None or step is None or step == 0:
    return None
  return baseline / step


def _bytes(n: Optional[float]) -> str:
  if n is None:
    return "-"
  for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
    if abs(n) >= scale:
      return f"{n / scale:.2f} {unit}"
  return f"{n:.0f} B"


def _summary_lines(r: Report) -> list[tuple[str, Callable, Callable, bool]]:
  """(label, value of a Report, format of a value, show a ratio) for each line of the table."""
  count = lambda v: "-" if v is None else f"{v:,}"
  return [
      ("kernels launched per step", lambda x: x.launches, count, True),
      ("  XLA kernels", lambda x: x.xla_kernels, count, True),
      ("  custom calls", lambda x: x.custom_calls, count, False),
      (f"  jaxfuse launches ({r.platform})", lambda x: x.jaxfuse_launches, count, False),
      ("jaxfuse CUDA kernels (by construction)", lambda x: x.jaxfuse_cuda_launches, count, False),
      ("jaxfuse CUDA memsets", lambda x: x.jaxfuse_cuda_memsets, count, False),
      ("bytes moved per step", lambda x: x.bytes_moved, _bytes, True),
      ("  read", lambda x: x.bytes_read, _bytes, False),
      ("  written", lambda x: x.bytes_written, _bytes, False),
      ("  XLA cost analysis", lambda x: x.xla_cost_bytes, _bytes, False),
      ("XLA flops per step (matmuls, element math)", lambda x: x.xla_flops,
       lambda v: "-" if v is None else f"{v / 1e9:.3f} G", False),
      ("peak memory", lambda x: x.peak_bytes, _bytes, True),
      ("optimizer state per param", lambda x: x.state_bytes_per_param,
       lambda v: "-" if v is None else f"{v:.2f} B", False),
      ("arrays passed to the step", lambda x: x.argument_arrays, count, True),
      ("  of optimizer state", lambda x: x.state_arrays, count, True),
  ]


def _format(r: Report) -> str:
  reports = [r] + ([r.baseline] if r.baseline else [])
  header = ["", *(x.label for x in reports)] + (["baseline / step"] if r.baseline else [])
  table = [header]
  for label, value, fmt, ratio in _summary_lines(r):
    line = [label, *(fmt(value(x)) for x in reports)]
    if r.baseline:
      q = _ratio(value(r.baseline), value(r)) if ratio else None
      line.append("" if q is None else f"{q:.2f}x")
    table.append(line)
  widths = [max(len(row[i]) for row in table) for i in range(len(header))]
  lines = [f"jaxfuse.report on {r.platform}" + ("" if all(x.exact for x in reports) else
                                                  " (some counts are bounds: see Report.exact)")]
  for row in table:
    lines.append("  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                           for i, (c, w) in enumerate(zip(row, widths))))
  for x in reports:
    lines += ["", f"{x.label}: CUDA graphs: {x.cuda_graphs}"]
    if x.float_state_leaves:
      names = x.float_state_leaves
      lines.append(f"{x.label}: states kept in floats beside 8-bit ones (moment_bits=8): "
                   f"{len(names)} leaves: {', '.join(names[:8])}" + (", ..." if len(names) > 8 else ""))
    lines.append(_format_rows(x))
  return "\n".join(lines)


def _format_rows(r: Report) -> str:
  header = ["op", "instructions", "runs/step", f"launches ({r.platform})", "CUDA launches",
            "bytes read", "bytes written"]
  table = [header] + [[("jaxfuse: " if x.jaxfuse else "") + x.name, f"{x.instructions}",
                       f"{x.runs}", f"{x.launches}",
                       f"{x.cuda_launches}" + (f" +{x.cuda_memsets} memset" if x.cuda_memsets
                                               else ""),
                       _bytes(x.bytes_read), _bytes(x.bytes_written)] for x in r.rows]
  widths = [max(len(row[i]) for row in table) for i in range(len(header))]
  return "\n".join("  " + "  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                                    for i, (c, w) in enumerate(zip(row, widths)))
                   for row in table)
