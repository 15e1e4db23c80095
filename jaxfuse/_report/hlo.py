"""A reader of compiled HLO text (``jax.stages.Compiled.as_text()``): the computations, their
instructions with shapes, operands and attributes, and which instructions a step executes and
how often. jaxfuse.report counts launches and bytes from it.

Only what the report needs is parsed; the text format is XLA's HloModule::ToString.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import re
from typing import Iterator, Optional

# Bytes per element of HLO element types (sub-byte types round up to a byte).
_ELEMENT_BYTES = {
    "pred": 1, "s2": 1, "u2": 1, "s4": 1, "u4": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2,
    "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8,
    "c64": 8, "c128": 16, "token": 0,
}
_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([0-9,]*)\]")
_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*\(.*\{\s*$")
_NAME = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*")

# Instructions that launch nothing: bookkeeping, control flow (its computations are walked
# instead) and the second half of async pairs.
_NOT_LAUNCHED = frozenset({
    "parameter", "constant", "get-tuple-element", "tuple", "bitcast", "while", "conditional",
    "call", "after-all", "add-dependency", "opt-barrier", "partition-id", "replica-id", "domain",
    "async-update", "async-done", "all-reduce-done", "all-gather-done", "collective-permute-done",
    "copy-done", "send-done", "recv-done",
})


@dataclasses.dataclass(frozen=True)
class Array:
  """One array of an HLO shape."""

  element_type: str
  dims: tuple[int, ...]

  @property
  def element_bytes(self) -> int:
    if self.element_type not in _ELEMENT_BYTES and not self.element_type.startswith("f8"):
      raise ValueError(f"unknown HLO element type {self.element_type!r}")
    return _ELEMENT_BYTES.get(self.element_type, 1)

  @property
  def complex(self) -> bool:
    return self.element_type in ("c64", "c128")

  @property
  def bytes(self) -> int:
    return self.element_bytes * math.prod(self.dims)


def arrays(shape_text: str) -> list[Array]:
  """The arrays of an HLO shape, tuple elements in order (layouts are ignored)."""
  shape_text = re.sub(r"\{[^{}]*\}", "", shape_text)  # layouts hold no arrays
  return [Array(t, tuple(int(d) for d in dims.split(",") if d))
          for t, dims in _ARRAY.findall(shape_text)]


@dataclasses.dataclass
class Instruction:
  name: str
  opcode: str
  shape: list[Array]
  operands: list[str]
  attrs: str  # everything after the operand list
  computation: str = ""

  def attr(self, key: str) -> Optional[str]:
    """The value of attribute ``key=...`` (up to the next top-level comma), or None."""
    m = re.search(r"(?:^|,\s*)" + re.escape(key) + r"=", self.attrs)
    if m is None:
      return None
    return _balanced_prefix(self.attrs[m.end():], stop=",")

  def called(self, key: str) -> list[str]:
    """Computation names of attribute ``key`` (``calls=%f`` or ``branch_computations={%a, %b}``)."""
    value = self.attr(key)
    return [] if value is None else re.findall(r"%?([\w.\-]+)", value)

  def known_trip_count(self) -> Optional[int]:
    config = self.attr("backend_config")
    if config is None:
      return None
    try:
      return int(json.loads(config)["known_trip_count"]["n"])
    except (ValueError, KeyError, TypeError):
      return None


def _balanced_prefix(text: str, stop: str) -> str:
  """The prefix of ``text`` up to the first ``stop`` character outside brackets and quotes."""
  depth, quoted = 0, False
  for i, ch in enumerate(text):
    if ch == '"' and (i == 0 or text[i - 1] != "\\"):
      quoted = not quoted
    elif quoted:
      continue
    elif ch == stop and depth == 0:
      return text[:i].strip()
    elif ch in "([{<":
      depth += 1
    elif ch in ")]}>":
      depth -= 1
  return text.strip()


def _parse_instruction(line: str) -> Optional[Instruction]:
  m = _NAME.match(line)
  if m is None:
    return None
  rest = line[m.end():]
  if rest.startswith("("):  # a tuple shape
    shape_text = "(" + _balanced_prefix(rest[1:], stop=")") + ")"
  else:
    shape_text = rest.split(" ", 1)[0]
  rest = rest[len(shape_text):].lstrip()
  opcode_match = re.match(r"([\w\-]+)\(", rest)
  if opcode_match is None:
    return None
  body = rest[opcode_match.end():]
  operand_text = _balanced_prefix(body, stop=")")
  attrs = body[len(operand_text):].lstrip(")").lstrip(", ")
  operands = [o.split(" ")[-1].lstrip("%") for o in _split_top(operand_text)]
  return Instruction(m.group(1), opcode_match.group(1), arrays(shape_text), operands, attrs)


def _split_top(text: str) -> list[str]:
  """``text`` split at top-level commas."""
  parts = []
  while text.strip():
    part = _balanced_prefix(text, stop=",")
    parts.append(part)
    text = text[text.index(part) + len(part):].lstrip().removeprefix(",")
  return parts


@dataclasses.dataclass
class Module:
  computations: dict[str, list[Instruction]]
  entry: str

  @classmethod
  def parse(cls, text: str) -> "Module":
    text = re.sub(r"/\*.*?\*/", "", text)
    computations: dict[str, list[Instruction]] = {}
    entry, current = None, None
    for line in text.splitlines():
      header = _HEADER.match(line)
      if header and "=" not in line.split("(", 1)[0]:
        name = header.group(2)
        current = computations.setdefault(name, [])
        entry = header.group(2) if header.group(1) else entry
      elif line.strip() == "}":
        current = None
      elif current is not None:
        instruction = _parse_instruction(line)
        if instruction is not None:
          instruction.computation = name
          current.append(instruction)
    if entry is None:
      raise ValueError("no ENTRY computation in the HLO text")
    return cls(computations, entry)

  def executed(self) -> Iterator[tuple[Instruction, int, bool]]:
    """(instruction, runs per step, exact) for each launching instruction a step executes,
    walking while bodies (times their known trip count; once, inexact, when unknown),
    conditional branches (each once, inexact: one runs) and called computations."""
    yield from self._walk(self.entry, 1, True)

  def _walk(self, computation: str, runs: int, exact: bool):
    for ins in self.computations.get(computation, []):
      if ins.opcode == "while":
        trips = ins.known_trip_count()
        inner = (runs * trips, exact) if trips is not None else (runs, False)
        for name in ins.called("body") + ins.called("condition"):
          yield from self._walk(name, *inner)
      elif ins.opcode == "conditional":
        for name in ins.called("branch_computations") or (ins.called("true_computation") +
                                                          ins.called("false_computation")):
          yield from self._walk(name, runs, False)
      elif ins.opcode == "call":
        for name in ins.called("to_apply"):
          yield from self._walk(name, runs, exact)
      elif ins.opcode not in _NOT_LAUNCHED:
        yield ins, runs, exact

  def operand_shapes(self, ins: Instruction) -> list[list[Array]]:
    """The shape of each operand of ``ins``."""
    shapes = self._shapes[ins.computation]
    return [shapes[name] for name in ins.operands]

  @functools.cached_property
  def _shapes(self) -> dict[str, dict[str, list[Array]]]:
    """Instruction shapes by computation and name, indexed once."""
    return {comp: {i.name: i.shape for i in instructions}
            for comp, instructions in self.computations.items()}
