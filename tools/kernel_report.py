"""The kernel report: what nvcc emitted for every CUDA kernel instance, against its budget.

Reads a built CUDA module (the `_jaxfuse_cuda` extension, a wheel holding it, or a cubin) with
CUDA's binary utilities: `cuobjdump -res-usage` for each instance's registers, stack, shared and
local memory (ptxas's own numbers, stored in the cubin), `cuobjdump -elf` for its block size
(`__launch_bounds__`), and `nvdisasm` for its SASS with the line table. One row per kernel
instance and architecture: registers, local-memory bytes stored / loaded (spills and stack
arrays, in the kernel's own code; CUDA's division and reciprocal slow paths apart), stack, shared
memory, block size,
theoretical occupancy (sm_90 code on an H100, sm_80 code on an A100), global load and store
widths, local-memory instructions and traps. It fails (exit status 1) on

- any unguarded trap (nvcc compiles undefined behaviour, such as device code reading a host
  object, into a trap; only cooperative groups' grid-sync guards, a trap in CUDA's own headers
  that a conditional branch skips or jumps to, are allowed),
- an instance that keeps less in flight per SM than its JF_KERNEL_IN_FLIGHT floor (a multiple
  of Little's law) or loads from fewer arrays at once than its JF_KERNEL_LOADS floor,
- a ring (JF_KERNEL_RING) that keeps less than Little's law in flight, or whose slab loop
  issues its slabs at less than 1.5x the SM's share of HBM (its instructions would set its time)
  or cannot be found,
- any instance over its budget: the JF_KERNEL_BUDGET / JF_KERNEL_GAP declarations beside the
  launch code in csrc/*/cuda (core/cuda/kernel_budget.cuh says what they mean); known gaps
  print with their reasons; a gap that excuses nothing, an instance without exactly one budget, a kernel
  without __launch_bounds__ fail too.

  python3 tools/kernel_report.py [MODULE.so | WHEEL.whl | NAME.sm_XX.cubin] [--markdown FILE]
  python3 tools/kernel_report.py --controls     # the planted bugs must each make it fail

Without a path it reads the installed jaxfuse's CUDA module. The utilities come from the PATH,
from CUDA_HOME/bin, or from the pip packages nvidia-cuda-cuobjdump and nvidia-cuda-nvdisasm
(installed into build/kernel-report-tools when none is found). c++filt (binutils) demangles.
What it cannot know: timing, memory ordering, the device's rounding (docs/building.md).
"""

import argparse
import dataclasses
import glob
import importlib.util
import math
import os
import re
import shutil
import struct
import subprocess
import sys
import sysconfig
import tempfile
import zipfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SOURCES = os.path.join(ROOT, "csrc")
CONTROLS = os.path.join(ROOT, "tools", "kernel_report_controls")

# The GPU each architecture's code is judged on, with what bounds its occupancy: warps, blocks,
# registers (allocated per warp in units of 256) and shared memory (per SM, and 1 KiB the
# runtime reserves per block).
# little: Little's law's bytes in flight per SM to keep HBM busy (rate x loaded latency / SMs:
# H100 SXM 3.35 TB/s x ~700 ns / 132, A100 80GB 2.04 TB/s x ~600 ns / 108); hbm_per_sm: the SM's
# share of the HBM rate (bytes/s), and ghz its boost clock (a ring loop's issue rate, below).
GPUS = {
    "sm_90": dict(gpu="H100", warps=64, blocks=32, registers=65536, shared=233472, little=17765,
                  hbm_per_sm=3.35e12 / 132, ghz=1.98),
    "sm_80": dict(gpu="A100", warps=64, blocks=32, registers=65536, shared=167936, little=11333,
                  hbm_per_sm=2.04e12 / 108, ghz=1.41),
}
# A ring's slab loop must issue its slab at least this many times faster than the SM's share of
# HBM delivers it, so that its instructions hide under its bytes (issue_rate()).
MIN_ISSUE_OVER_HBM = 1.5
RESERVED_SHARED = 1024
SLOW_PATHS = re.compile(r"__cuda_sm\w*_(div|rcp|sqrt|rsqrt)\w*slowpath")


# ---- the tools ----------------------------------------------------------------------------------

TOOLS_DIR = os.path.join(ROOT, "build", "kernel-report-tools")
TOOL_PACKAGES = ["nvidia-cuda-cuobjdump==13.*", "nvidia-cuda-nvdisasm==13.*"]


def find_tool(name):
  """cuobjdump / nvdisasm: on the PATH, in CUDA_HOME/bin, from the nvidia-cuda-* packages in this
  Python or installed once into build/kernel-report-tools (CUDA 13's read CUDA 12's cubins too)."""
  def candidates():
    yield shutil.which(name)
    for var in ("CUDA_HOME", "CUDA_PATH"):
      if os.environ.get(var):
        yield os.path.join(os.environ[var], "bin", name)
    for site in (sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"], TOOLS_DIR):
      yield from glob.glob(os.path.join(site, "nvidia", "cu*", "bin", name))

  for attempt in range(2):
    for c in candidates():
      if c and os.access(c, os.X_OK):
        return c
    if attempt == 0:
      print(f"kernel_report: {name} not found; pip install {' '.join(TOOL_PACKAGES)} into "
            f"{os.path.relpath(TOOLS_DIR, ROOT)}", file=sys.stderr)
      subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--target", TOOLS_DIR,
                      *TOOL_PACKAGES], check=True)
  sys.exit(f"kernel_report: {name} not found after installing {' '.join(TOOL_PACKAGES)}")


def tool_env(tool):
  env = dict(os.environ)
  # cuobjdump -sass and nvdisasm find each other on the PATH.
  env["PATH"] = os.pathsep.join([os.path.dirname(tool), env.get("PATH", "")])
  return env


def run(*cmd, cwd=None):
  res = subprocess.run(cmd, cwd=cwd, env=tool_env(cmd[0]), capture_output=True, text=True)
  if res.returncode != 0:
    sys.exit(f"kernel_report: {' '.join(cmd)} failed:\n{res.stderr}")
  return res.stdout


def run_lines(*cmd):
  """run()'s output line by line, as the command writes it (for outputs of hundreds of MB)."""
  with tempfile.TemporaryFile(mode="w+") as errors, subprocess.Popen(
      cmd, env=tool_env(cmd[0]), stdout=subprocess.PIPE, stderr=errors, text=True) as proc:
    yield from proc.stdout
    if proc.wait() != 0:
      errors.seek(0)
      sys.exit(f"kernel_report: {' '.join(cmd)} failed:\n{errors.read()}")


# ---- reading the binary -------------------------------------------------------------------------

@dataclasses.dataclass
class Instance:
  mangled: str
  arch: str
  name: str = ""
  registers: int = 0
  stack: int = 0
  shared: int = 0
  threads: int = 0  # __launch_bounds__; 0: none declared
  local_stores: int = 0  # bytes of local-memory stores in the kernel's own code (spills, arrays)
  local_loads: int = 0
  slow_path_local: int = 0  # bytes stored and loaded in CUDA's division / reciprocal slow paths
  loads: dict = dataclasses.field(default_factory=dict)  # global load width (bits) -> count
  stores: dict = dataclasses.field(default_factory=dict)
  generic: int = 0  # LD / ST through generic addresses
  async_copies: int = 0  # LDGSTS: cp.async global -> shared
  loads_in_flight: int = 0  # most arrays loaded from in a straight run before a load is read
  bytes_in_flight: int = 0  # most bytes a thread has loaded in such a run
  local_instructions: int = 0
  traps: list = dataclasses.field(default_factory=list)  # (guarded, where)
  occupancy: float = 0.0
  ring: object = None  # its Ring declaration, if it streams through one
  slab_loops: list = dataclasses.field(default_factory=list)  # SlabLoop of each ring loop
  status: str = ""
  failures: list = dataclasses.field(default_factory=list)


def module_path(arg, workdir):
  """The CUDA module (or cubin) to read: the argument, the one inside a wheel (extracted into
  workdir), or the installed one (a source build's, else a CUDA package's)."""
  if arg is None:
    for package in ("jaxfuse", "jaxfuse_cuda13", "jaxfuse_cuda12"):
      if importlib.util.find_spec(package) is None:
        continue
      spec = importlib.util.find_spec(f"{package}._jaxfuse_cuda")
      if spec is not None and spec.origin:
        return spec.origin
    sys.exit("kernel_report: no CUDA module installed (jaxfuse built without nvcc, and no "
             "jaxfuse-cuda12/13 package)")
  if arg.endswith(".whl"):
    with zipfile.ZipFile(arg) as z:
      names = [n for n in z.namelist() if re.search(r"/_jaxfuse_cuda[^/]*\.so$", n)]
      if not names:
        sys.exit(f"kernel_report: {arg} holds no CUDA module")
      return z.extract(names[0], workdir)
  return arg


def extract_cubins(path, cuobjdump, workdir):
  if path.endswith(".cubin"):
    return [path]
  os.makedirs(workdir)
  run(cuobjdump, "-xelf", "all", os.path.abspath(path), cwd=workdir)
  cubins = sorted(glob.glob(os.path.join(workdir, "*.cubin")))
  if not cubins:
    sys.exit(f"kernel_report: {path} holds no cubin (not built for sm_80 / sm_90?)")
  return cubins


def cubin_arch(cubin):
  """sm_XX from the cubin's name (cuobjdump -xelf and compile_control name them so)."""
  m = re.search(r"\.(sm_\d+)\.cubin$", cubin)
  if not m:
    sys.exit(f"kernel_report: {cubin}: the name says no architecture (NAME.sm_XX.cubin)")
  return m.group(1)


def resource_usage(cuobjdump, cubin):
  """mangled name -> dict of REG, STACK, SHARED (bytes), ... as ptxas stored them."""
  out = {}
  for m in re.finditer(r"Function (\S+):\s*\n\s*(REG:.*)", run(cuobjdump, "-res-usage", cubin)):
    out[m.group(1)] = {k: int(v) for k, v in re.findall(r"(\w+):(\d+)", m.group(2))}
  return out


def elf_sections(path):
  """Section name -> contents of an ELF64 file (a cubin)."""
  with open(path, "rb") as f:
    data = f.read()
  shoff, = struct.unpack_from("<Q", data, 0x28)
  shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
  headers = [struct.unpack_from("<IIQQQQ", data, shoff + i * shentsize) for i in range(shnum)]
  names = headers[shstrndx][4]
  out = {}
  for name, _, _, _, offset, size in headers:
    name = data[names + name:data.index(b"\0", names + name)].decode()
    out[name] = data[offset:offset + size]
  return out


# A kernel's .nv.info.NAME section is a list of attributes, each a 4-byte header (format, id,
# and a 16-bit value, or for EIFMT_SVAL the size of the value that follows).
EIFMT_SVAL = 0x04
EIATTR_MAX_THREADS = 0x05  # SVAL: x, y, z; the x is __launch_bounds__'s threads


def kernel_threads(cubin):
  """mangled kernel name -> its __launch_bounds__ threads (0 without); only kernels have an
  entry. Read from the cubin's ELF, not cuobjdump -elf, which prints tens of MB per cubin."""
  out = {}
  for section, info in elf_sections(cubin).items():
    if not section.startswith(".nv.info."):
      continue
    threads, i = 0, 0
    while i + 4 <= len(info):
      fmt, attr, value = struct.unpack_from("<BBH", info, i)
      i += 4
      if fmt == EIFMT_SVAL:
        if attr == EIATTR_MAX_THREADS:
          threads, = struct.unpack_from("<I", info, i)
        i += value
    out[section[len(".nv.info."):]] = threads
  return out


INSTRUCTION = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*(?:\.[A-Z0-9_]+)*)(.*?);")
WIDTH = {"U8": 8, "S8": 8, "U16": 16, "S16": 16, "64": 64, "128": 128}


def access_width(opcode):
  for part in reversed(opcode.split(".")[1:]):
    if part in WIDTH:
      return WIDTH[part]
  return 32


SECTION = re.compile(r"\s*\.section\s+\.text\.([^,\s]+)")
SUBROUTINE = re.compile(r"^(\$__internal_\d+_\$(\S+)):")
SOURCE_LINE = re.compile(r'\s*//## File "([^"]+)", line (\d+)')


def read_sass(nvdisasm, cubin):
  """mangled name -> [(where, predicated, opcode, subroutine, operands)] of its .text section;
  `where` is the instruction's source line, innermost inlined function first (nvdisasm prints it
  where it changes: it holds until the next). nvdisasm's output (hundreds of MB for the module,
  mostly inlining lines) is read as it is written, each line tried against the one pattern its
  first characters call for."""
  functions = {}
  current = None
  subroutine = None
  where, pending = (), []
  for line in run_lines(nvdisasm, "-c", "-gi", cubin):
    if "//##" in line:
      if current is not None:
        m = SOURCE_LINE.match(line)
        if m:
          pending.append((m.group(1), int(m.group(2))))
      continue
    if "/*" in line:
      if current is not None:
        m = INSTRUCTION.search(line)
        if m:
          if pending:
            where, pending = tuple(pending), []
          current.append((where, bool(m.group(1)), m.group(2), subroutine, m.group(3).strip()))
      continue
    m = SECTION.match(line)
    if m:
      current, subroutine, where, pending = functions.setdefault(m.group(1), []), None, (), []
      continue
    m = SUBROUTINE.match(line) if current is not None else None
    if m:
      subroutine = m.group(2)
  return functions


REGISTER = re.compile(r"\bR(\d+)\b")
# Instructions that end a straight run of code: a load issued before one is not counted as in
# flight with the loads after it.
CONTROL = {"BRA", "BRX", "JMP", "JMX", "CALL", "RET", "EXIT", "BSSY", "BSYNC", "BREAK", "BAR",
           "WARPSYNC"}


def track_loads(pending, base, opcode, operands):
  """Updates `pending` (the destination registers and address register of each global load
  issued and not yet read in this straight run) with one instruction; returns how many
  addresses (arrays: loads through one register, scalars of one vector, are one) and how many
  bytes are in flight after it."""
  if base in CONTROL:
    pending.clear()
    return 0, 0
  ops = [o for o in operands.split(",") if o.strip()]
  sources = ops if base.startswith("ST") or base in ("RED", "REDG") else ops[1:]
  read = {int(r) for o in sources for r in REGISTER.findall(o)}
  pending[:] = [(regs, address) for regs, address in pending if not regs & read]
  if base == "LDG" and len(ops) > 1:
    first, address = REGISTER.search(ops[0]), REGISTER.findall(ops[-1].split("[")[-1])
    if first and address:
      r = int(first.group(1))
      pending.append((set(range(r, r + max(1, access_width(opcode) // 32))), address[0]))
  return len({address for _, address in pending}), 4 * sum(len(regs) for regs, _ in pending)


# The pipes that bind a ring loop, with a warp instruction's cycles on a scheduler (the CUDA
# programming guide's throughputs for sm_80 / sm_90): integer logic, shifts, permutes, adds and
# compares (ALU) and integer multiply-adds (IMAD, on the FMA pipe beside it) at 16 lanes a clock,
# 2 cycles; the conversion unit (I2F, F2F, ...) at 4 lanes, 8 cycles; any instruction issues in 1.
ALU = {"LOP3", "LOP", "SHF", "SHL", "SHR", "PRMT", "IADD3", "LEA", "ISETP", "SEL", "FSEL",
       "VIADD", "VIMNMX", "IMNMX", "BMSK", "SGXT", "IABS", "FLO", "POPC", "PLOP3"}
CONVERSIONS = {"I2F", "I2FP", "F2F", "F2FP", "F2I", "FRND"}


@dataclasses.dataclass
class SlabLoop:
  instructions: int
  cycles: int  # a warp's cycles for one slab: max(all, 2 x ALU, 2 x IMAD, 8 x conversions)


def slab_loops(sass):
  """The tensor-core ring loops of an instance's SASS: each from a wait for its cp.async groups
  (DEPBAR on SB0) to the branch after the mmas that consume the slab (the next wait starts the
  next loop)."""
  ops = [opcode for _, _, opcode, _, operands in sass]
  waits = [i for i, (_, _, op, _, operands) in enumerate(sass)
           if op.startswith("DEPBAR") and "SB0" in operands]
  loops = []
  for k, start in enumerate(waits):
    stop = waits[k + 1] if k + 1 < len(waits) else len(ops)
    mma = next((i for i in range(start, stop) if ops[i].startswith("HMMA")), None)
    end = next((i for i in range(mma, stop) if ops[i].startswith("BRA")), None) if mma else None
    if end is None:
      continue
    body = [op.split(".")[0] for op in ops[start:end + 1]]
    alu = sum(op in ALU for op in body)
    imad = body.count("IMAD")
    conv = sum(op in CONVERSIONS for op in body)
    loops.append(SlabLoop(len(body), max(len(body), 2 * alu, 2 * imad, 8 * conv)))
  return loops


def issue_rate(inst):
  """(bytes/s an SM at which inst's slowest slab loop issues its slabs, that over the SM's share
  of HBM): each of a block's warps issues the loop once per slab, four schedulers an SM."""
  gpu = GPUS.get(inst.arch)
  if not inst.ring or not inst.slab_loops or gpu is None or inst.threads == 0:
    return None
  cycles = max(loop.cycles for loop in inst.slab_loops)
  rate = 4 * inst.ring.slab_bytes * gpu["ghz"] * 1e9 / (inst.threads / 32 * cycles)
  return rate, rate / gpu["hbm_per_sm"]


def analyse(inst, sass):
  """Fills the SASS columns of one instance."""
  previous = None
  pending = []
  inst.slab_loops = slab_loops(sass)
  for where, predicated, opcode, subroutine, operands in sass:
    base = opcode.split(".")[0]
    arrays, nbytes = track_loads(pending, base, opcode, operands)
    inst.loads_in_flight = max(inst.loads_in_flight, arrays)
    inst.bytes_in_flight = max(inst.bytes_in_flight, nbytes)
    if base in ("LDL", "STL"):
      nbytes = access_width(opcode) // 8
      if subroutine and SLOW_PATHS.search(subroutine):
        inst.slow_path_local += nbytes
      else:
        inst.local_instructions += 1
        if base == "STL":
          inst.local_stores += nbytes
        else:
          inst.local_loads += nbytes
    elif base == "LDG":
      w = access_width(opcode)
      inst.loads[w] = inst.loads.get(w, 0) + 1
    elif base == "STG":
      w = access_width(opcode)
      inst.stores[w] = inst.stores.get(w, 0) + 1
    elif base in ("LD", "ST"):
      inst.generic += 1
    elif base == "LDGSTS":
      inst.async_copies += 1
    elif opcode.startswith("BPT.TRAP"):
      inner = where[0] if where else ("?", 0)
      outer = next((w for w in reversed(where) if "/csrc/" in w[0] or "/tools/" in w[0]), inner)
      # Cooperative groups' grid-sync check: its trap right after a conditional branch around
      # it, or (several syncs sharing one failure block) after an EXIT or unconditional branch,
      # where only a jump reaches it.
      jumped_to = previous is not None and (previous[2].startswith("EXIT") or (
          previous[2].startswith("BRA") and not previous[1]))
      branched_around = previous is not None and previous[1] and previous[2].startswith("BRA")
      guard = (not predicated and (branched_around or jumped_to)
               and "cooperative_groups" in inner[0])
      inst.traps.append((guard, f"{os.path.basename(inner[0])}:{inner[1]}"
                         + (f" in {os.path.basename(outer[0])}:{outer[1]}" if outer != inner else "")))
    previous = (where, predicated, opcode)


def occupancy(inst):
  """Theoretical occupancy, as the CUDA occupancy calculator computes it."""
  gpu = GPUS.get(inst.arch)
  if gpu is None or inst.threads == 0:
    return 0.0
  warps = math.ceil(inst.threads / 32)
  per_warp = math.ceil(max(inst.registers, 1) * 32 / 256) * 256
  by_registers = (gpu["registers"] // per_warp) // warps
  by_shared = gpu["shared"] // (inst.shared + ring_shared(inst) + RESERVED_SHARED)
  blocks = min(gpu["blocks"], gpu["warps"] // warps, by_registers, by_shared)
  return 100.0 * blocks * warps / gpu["warps"]


# ---- names ----------------------------------------------------------------------------------

DTYPES = ["f32", "bf16", "f16", "f64", "i16", "i8", "u8", "f8e4m3"]  # dtype.h's DType order
PARAMS_MODES = ["plain", "master", "remainders"]


def lists_name(m):
  """An optimizer kernel's layout and dtypes: "2 states, master, bf16 params, f32 states"."""
  states, mode, quantized, dtypes, params, state_dtype = m.groups()
  name = f"{states} states, {mode}{', 8-bit' if quantized == 'true' else ''}"
  if dtypes == "TableDTypes":
    return f"{name}, table dtypes"
  float_states = states != "0" and quantized == "false"
  return f"{name}, {params} params" + (f", {state_dtype} states" if float_states else "")


def short_names(mangled):
  """Demangled names without namespaces, argument lists or enum casts."""
  out = subprocess.run(["c++filt"], input="\n".join(mangled), capture_output=True, text=True,
                       check=True).stdout.splitlines()
  names = {}
  for m, d in zip(mangled, out):
    s = re.sub(r"^void ", "", d)
    s = re.sub(r"\(anonymous namespace\)::|\bjaxfuse::|\bcuda_\w+::", "", s)
    depth, cut = 0, len(s)
    for i, ch in enumerate(s):  # drop the argument list: the first '(' at template depth 0
      if ch == "<":
        depth += 1
      elif ch == ">":
        depth -= 1
      elif ch == "(" and depth == 0:
        cut = i
        break
    s = s[:cut]
    s = re.sub(r"\(ParamsMode\)(\d)", lambda x: PARAMS_MODES[int(x.group(1))], s)
    s = re.sub(r"\(DType\)(\d)", lambda x: DTYPES[int(x.group(1))], s)
    s = re.sub(r"StaticLists<(\d), (\w+), (true|false)>, (FixedDTypes<(\w+), (\w+)>|TableDTypes)",
               lists_name, s)
    names[m] = s.replace(" >", ">")
  return names


# ---- budgets --------------------------------------------------------------------------------

@dataclasses.dataclass
class Budget:
  pattern: str
  max_registers: int
  min_occupancy: int
  max_local_bytes: int
  reason: str = ""  # a known gap's
  where: str = ""
  excused: set = dataclasses.field(default_factory=set)  # (name, arch) it lets pass


def macro_args(text, start):
  """The top-level arguments of the macro call whose '(' is at text[start]."""
  args, depth, current, i = [], 0, "", start
  while i < len(text):
    ch = text[i]
    if ch == '"':
      end = text.index('"', i + 1)
      while text[end - 1] == "\\":
        end = text.index('"', end + 1)
      current += text[i:end + 1]
      i = end + 1
      continue
    if ch == "(":
      depth += 1
      if depth == 1:
        i += 1
        continue
    elif ch == ")":
      depth -= 1
      if depth == 0:
        args.append(current.strip())
        return args
    elif ch == "," and depth == 1:
      args.append(current.strip())
      current = ""
      i += 1
      continue
    current += ch
    i += 1
  raise ValueError("unbalanced macro call")


def string_value(arg):
  parts = re.findall(r'"((?:[^"\\]|\\.)*)"', arg)
  if not parts:
    raise ValueError(f"expected a string literal, found {arg!r}")
  return "".join(parts).replace('\\"', '"').replace("\\\\", "\\")


@dataclasses.dataclass
class LoadsFloor:
  pattern: str
  min_loads: int  # arrays loaded from in one straight run before a load is read
  where: str = ""


@dataclasses.dataclass
class InFlightFloor:
  pattern: str
  min_times: float  # Little's law's bytes in flight per SM, times
  where: str = ""


@dataclasses.dataclass
class Ring:
  pattern: str
  slots: dict  # arch -> slots of dynamic shared memory
  slot_bytes: int
  slab_bytes: int  # bytes a slot's copies fill (slots - 1 slabs in flight)
  where: str = ""


def ring_shared(inst):
  """The dynamic shared memory of inst's ring on its GPU (0: no ring)."""
  return inst.ring.slots.get(inst.arch, 0) * inst.ring.slot_bytes if inst.ring else 0


def ring_in_flight(inst):
  """Bytes of inst's ring in flight per SM at its occupancy (0: no ring)."""
  if not inst.ring or inst.threads == 0:
    return 0
  blocks = inst.occupancy / 100 * GPUS[inst.arch]["warps"] * 32 / inst.threads
  return (inst.ring.slots.get(inst.arch, 0) - 1) * inst.ring.slab_bytes * blocks


def read_budgets(paths, rings=None):
  """The JF_KERNEL_BUDGET, JF_KERNEL_GAP, JF_KERNEL_LOADS and JF_KERNEL_IN_FLIGHT declarations of
  the sources (and the JF_KERNEL_RING ones into `rings`)."""
  budgets, gaps, floors = [], [], []
  rings = [] if rings is None else rings
  for path in paths:
    text = open(path).read()
    for m in re.finditer(r"^\s*JF_KERNEL_(BUDGET|GAP|LOADS|IN_FLIGHT|RING)\s*(?=\()", text,
                         re.M):
      args = macro_args(text, m.end())
      where = f"{os.path.relpath(path, ROOT)}:{text.count(chr(10), 0, m.start()) + 1}"
      want = {"BUDGET": 4, "GAP": 5, "LOADS": 2, "IN_FLIGHT": 2, "RING": 5}[m.group(1)]
      if len(args) != want:
        sys.exit(f"kernel_report: {where}: JF_KERNEL_{m.group(1)} takes {want} arguments")
      if m.group(1) in ("LOADS", "IN_FLIGHT"):
        kind = LoadsFloor if m.group(1) == "LOADS" else InFlightFloor
        floors.append(kind(string_value(args[0]), float(args[1]), where=where))
        re.compile(floors[-1].pattern)
        continue
      if m.group(1) == "RING":
        sizes = [int(a) for a in args[1:]]
        rings.append(Ring(string_value(args[0]), {"sm_90": sizes[0], "sm_80": sizes[1]},
                          sizes[2], sizes[3], where=where))
        re.compile(rings[-1].pattern)
        continue
      b = Budget(string_value(args[0]), *(int(a) for a in args[1:4]), where=where)
      re.compile(b.pattern)
      if m.group(1) == "GAP":
        b.reason = string_value(args[4])
        gaps.append(b)
      else:
        budgets.append(b)
  return budgets, gaps, floors


def budget_sources(module):
  if module.endswith(".cubin"):  # a control: its budget is in its own source beside it
    source = re.sub(r"\.sm_\d+\.cubin$", ".cu", module)
    return [source] if os.path.exists(source) else []
  return sorted(glob.glob(os.path.join(SOURCES, "*", "cuda", "*.cu*")))


def excess(inst, b):
  """{resource: what} for each limit of budget (or gap) b that instance inst exceeds."""
  out = {}
  if inst.registers > b.max_registers:
    out["registers"] = f"{inst.registers} registers > {b.max_registers}"
  if inst.occupancy + 1e-9 < b.min_occupancy:
    out["occupancy"] = f"occupancy {inst.occupancy:.1f}% < {b.min_occupancy}%"
  if inst.local_stores + inst.local_loads > b.max_local_bytes:
    out["local memory"] = (f"local memory {inst.local_stores}+{inst.local_loads} B > "
                           f"{b.max_local_bytes} B")
  return out


def judge(inst, budgets, gaps, floors=()):
  """Sets inst.status: ok, gap (over its budget, within the known gaps that match it), FAIL."""
  unguarded = [w for guarded, w in inst.traps if not guarded]
  if unguarded:
    inst.failures.append(f"unguarded trap at {', '.join(unguarded)}")
  for f in floors:
    if not re.search(f.pattern, inst.name):
      continue
    if isinstance(f, LoadsFloor) and inst.loads_in_flight < f.min_loads:
      inst.failures.append(f"{inst.loads_in_flight} arrays loaded in flight < {f.min_loads:.0f} "
                           f"({f.where})")
    if isinstance(f, InFlightFloor) and GPUS.get(inst.arch):
      little = GPUS[inst.arch]["little"]
      held = sm_in_flight(inst)
      if held < f.min_times * little:
        inst.failures.append(f"{held / 1024:.0f} KB an SM in flight ({held / little:.1f}x "
                             f"Little's law) < {f.min_times:g}x ({f.where})")
  if inst.threads == 0:
    inst.failures.append("no __launch_bounds__: its block size is unknown")
  little = GPUS.get(inst.arch, {}).get("little", 0)
  if inst.ring and ring_in_flight(inst) < little:
    inst.failures.append(f"its ring keeps {ring_in_flight(inst) / 1024:.0f} KB an SM in flight, "
                         f"below Little's law's {little / 1024:.0f} KB ({inst.ring.where})")
  if inst.ring and not inst.slab_loops:
    inst.failures.append("no slab loop found in its SASS (a wait for its copies, mmas, a branch): "
                         "its issue rate is unchecked")
  issue = issue_rate(inst)
  if issue and issue[1] < MIN_ISSUE_OVER_HBM:
    inst.failures.append(f"its slab loop issues {issue[0] / 1e9:.0f} GB/s an SM, "
                         f"{issue[1]:.1f}x the SM's share of HBM < {MIN_ISSUE_OVER_HBM}x")
  mine = [b for b in budgets if re.search(b.pattern, inst.name)]
  if len(mine) != 1:
    inst.failures.append(f"matches {len(mine)} JF_KERNEL_BUDGET declarations, not one"
                         + (f" ({', '.join(b.where for b in mine)})" if mine else ""))
  else:
    # A gap relaxes the resources in which it is looser than the budget; several may match.
    my_gaps = [g for g in gaps if re.search(g.pattern, inst.name)]
    excused = []
    for resource, what in excess(inst, mine[0]).items():
      relaxing = [g for g in my_gaps if resource not in excess(inst, g)]
      if relaxing:
        relaxing[0].excused.add((inst.name, inst.arch))
        excused.append(f"{what} ({relaxing[0].reason})")
      else:
        inst.failures.append(what + (" (beyond its known gaps)" if my_gaps else ""))
    if excused and not inst.failures:
      inst.status = "gap: " + "; ".join(excused)
  inst.status = ("FAIL: " + "; ".join(inst.failures)) if inst.failures else (inst.status or "ok")


# ---- the report -------------------------------------------------------------------------------

def sm_in_flight(inst):
  """Bytes in flight per SM at inst's occupancy: its ring's slabs, or without a ring its deepest
  run of loads over the SM's resident threads."""
  if inst.ring:
    return ring_in_flight(inst)
  gpu = GPUS.get(inst.arch)
  return inst.bytes_in_flight * inst.occupancy / 100 * gpu["warps"] * 32 if gpu else 0


def in_flight(inst):
  """The deepest run of loads: arrays, bytes per thread, and per SM at the instance's occupancy
  against Little's law for its GPU; then its ring's slabs in flight per SM."""
  gpu = GPUS.get(inst.arch)
  text = f"{inst.loads_in_flight}, {inst.bytes_in_flight} B"
  if gpu is None:
    return text
  if inst.bytes_in_flight:
    per_sm = inst.bytes_in_flight * inst.occupancy / 100 * gpu["warps"] * 32
    text += f", {per_sm / 1024:.0f} KB/SM ({per_sm / gpu['little']:.1f}x)"
  if inst.ring:
    ring = ring_in_flight(inst)
    text += (f"; ring {inst.ring.slots[inst.arch] - 1} x {inst.ring.slab_bytes // 1024} KB: "
             f"{ring / 1024:.0f} KB/SM ({ring / gpu['little']:.1f}x)")
    issue = issue_rate(inst)
    if issue:
      most = max(inst.slab_loops, key=lambda loop: loop.cycles)
      text += (f"; slab loop {most.instructions} instr, {most.cycles} cycles: "
               f"{issue[0] / 1e9:.0f} GB/s an SM ({issue[1]:.1f}x HBM)")
  return text


def widths(counts):
  return " ".join(f"{w}:{counts[w]}" for w in sorted(counts, reverse=True)) or "-"


def table(instances):
  rows = ["| kernel | arch | regs | local st/ld B | stack B | shared B | block | occupancy | "
          "global loads (bits:count) | loads in flight | global stores | local instrs | traps | "
          "status |",
          "|---|---|--:|--:|--:|--:|--:|--:|---|--:|---|--:|---|---|"]
  for i in instances:
    spill = f"{i.local_stores}/{i.local_loads}"
    if i.slow_path_local:
      spill += f" (+{i.slow_path_local} slow path)"
    traps = "; ".join(("guarded " if g else "UNGUARDED ") + w for g, w in i.traps) or "-"
    gpu = GPUS.get(i.arch, {}).get("gpu", "?")
    generic = f" (+{i.generic} generic)" if i.generic else ""
    generic += f" (+{i.async_copies} cp.async)" if i.async_copies else ""
    shared = f"{i.shared} + {ring_shared(i)} ring" if i.ring else f"{i.shared}"
    rows.append(f"| `{i.name}` | {i.arch} | {i.registers} | {spill} | {i.stack} | {shared} | "
                f"{i.threads or '?'} | {i.occupancy:.0f}% {gpu} | {widths(i.loads)}{generic} | "
                f"{in_flight(i)} | {widths(i.stores)} | {i.local_instructions} | {traps} | "
                f"{i.status} |")
  return "\n".join(rows)


def report(path):
  """Reads and judges one module or cubin: (its path, the instances, the known gaps, problems
  with the budgets themselves)."""
  cuobjdump, nvdisasm = find_tool("cuobjdump"), find_tool("nvdisasm")
  instances = []
  with tempfile.TemporaryDirectory(prefix="kernel_report_") as work:
    module = module_path(path, work)
    rings = []
    budgets, gaps, floors = read_budgets(budget_sources(module), rings)
    for cubin in extract_cubins(module, cuobjdump, os.path.join(work, "cubins")):
      arch = cubin_arch(cubin)
      usage = resource_usage(cuobjdump, cubin)
      threads = kernel_threads(cubin)
      sass = read_sass(nvdisasm, cubin)
      for mangled, t in threads.items():
        u = usage.get(mangled, {})
        inst = Instance(mangled, arch, registers=u.get("REG", 0), stack=u.get("STACK", 0),
                        shared=u.get("SHARED", 0), threads=t)
        analyse(inst, sass.get(mangled, []))
        instances.append(inst)
  names = short_names([i.mangled for i in instances])
  for i in instances:
    i.name = names[i.mangled]
    i.ring = next((r for r in rings if re.search(r.pattern, i.name)), None)
    i.occupancy = occupancy(i)
    judge(i, budgets, gaps, floors)
  instances.sort(key=lambda i: (i.name, i.arch))
  problems = [f"{g.where}: the known gap {g.pattern!r} excuses no instance: remove it"
              for g in gaps if not g.excused]
  problems += [f"{f.where}: JF_KERNEL_{kind} {f.pattern!r} matches no instance"
               for kind, declared in (("LOADS / IN_FLIGHT", floors), ("RING", rings))
               for f in declared if not any(re.search(f.pattern, i.name) for i in instances)]
  if not instances:
    problems.append(f"{module}: no kernels found")
  return module, instances, gaps, problems


def summary(module, instances, gaps, problems):
  failed = [i for i in instances if i.status.startswith("FAIL")]
  lines = [f"{len(instances)} kernel instances in {os.path.basename(module)}: "
           f"{sum(i.status == 'ok' for i in instances)} within budget, "
           f"{sum(i.status.startswith('gap') for i in instances)} in known gaps, {len(failed)} failing; "
           f"{sum(not g for i in instances for g, _ in i.traps)} unguarded traps, "
           f"{sum(g for i in instances for g, _ in i.traps)} guarded (grid-sync guards)"]
  for g in gaps:
    if g.excused:
      lines.append(f"known gap ({g.where}), {len(g.excused)} instances: {g.reason}")
  lines += [f"FAIL {i.name} [{i.arch}]: {'; '.join(i.failures)}" for i in failed]
  lines += [f"FAIL {p}" for p in problems]
  return "\n".join(lines)


def compile_control(source, workdir):
  """A control's cubin for sm_90, with the CUDA module's language flags (CMakeLists.txt:
  -O3, C++17, --expt-relaxed-constexpr, -lineinfo) and include paths."""
  import jax  # noqa: PLC0415
  nvcc = shutil.which("nvcc") or sys.exit("kernel_report --controls: needs nvcc on the PATH")
  name = os.path.splitext(os.path.basename(source))[0]
  cubin = os.path.join(workdir, f"{name}.sm_90.cubin")
  subprocess.run([nvcc, "-cubin", "-arch=sm_90", "-O3", "-std=c++17", "--expt-relaxed-constexpr",
                  "-lineinfo", "-I", SOURCES, "-isystem", jax.ffi.include_dir(),
                  "-o", cubin, source], check=True)
  shutil.copy(source, os.path.join(workdir, f"{name}.cu"))  # its budget, read beside the cubin
  return cubin


def controls():
  """Each planted bug (tools/kernel_report_controls/*.cu, its expected failure in its first
  line) must make the report fail with that failure."""
  sources = sorted(glob.glob(os.path.join(CONTROLS, "*.cu")))
  caught = 0
  with tempfile.TemporaryDirectory(prefix="kernel_report_controls_") as work:
    for source in sources:
      expect = re.match(r"// expect: (.*)", open(source).readline()).group(1).strip()
      module, instances, gaps, problems = report(compile_control(source, work))
      failures = [f for i in instances for f in i.failures] + problems
      hit = [f for f in failures if expect in f]
      print(f"control {os.path.basename(source)}: "
            + (f"caught ({hit[0]})" if hit else f"NOT CAUGHT (expected '{expect}', got {failures})"))
      caught += bool(hit)
  print(f"{caught} of {len(sources)} planted bugs caught")
  return caught == len(sources) and caught > 0


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("module", nargs="?", help="_jaxfuse_cuda*.so, a wheel or a cubin "
                      "(default: the installed jaxfuse's)")
  parser.add_argument("--markdown", help="also write the table, with the command, to this file")
  parser.add_argument("--controls", action="store_true",
                      help="compile the planted bugs and check that each makes the report fail")
  args = parser.parse_args()
  if args.controls:
    sys.exit(0 if controls() else 1)
  module, instances, gaps, problems = report(args.module)
  text = table(instances)
  result = summary(module, instances, gaps, problems)
  print(text)
  print()
  print(result)
  if args.markdown:
    with open(args.markdown, "w") as f:
      f.write(MARKDOWN_HEADER.format(module=os.path.basename(module)) + text + "\n\n```\n"
              + result + "\n```\n")
  failed = problems or any(i.status.startswith("FAIL") for i in instances)
  sys.exit(1 if failed else 0)


MARKDOWN_HEADER = """\
# Kernel report

Generated by `python3 tools/kernel_report.py --markdown docs/kernel_report.md` from {module}
(what it reads, what it checks and what it cannot know: [building.md](building.md#the-kernel-report)).
One row per kernel instance and architecture; occupancy is theoretical (sm_90 code on an H100,
sm_80 code on an A100, at the block size of the kernel's `__launch_bounds__`); local st/ld are the
bytes of local-memory stores / loads in the kernel's own code, spills and stack arrays alike
(CUDA's division and reciprocal slow paths, run only for special operands, apart); loads in
flight are the most arrays (address registers) a straight run of its SASS loads from before it
reads any of the loaded values, the most bytes a thread so loads, and those bytes over the SM's
resident threads at that occupancy against Little's law (HBM rate x ~700 ns / SMs: about 17 KB
on an H100, 11 KB on an A100; the deepest run anywhere in the kernel, not necessarily its main
loop's), and for a kernel that streams through a ring of dynamic shared memory (cp.async;
its shared B adds the ring's slots to the static bytes) the ring's slabs in flight per SM and
its slowest slab loop (from a wait for its copies to the branch after its mmas): instructions,
a warp's cycles (the most of: one an instruction, two an integer ALU op, two an IMAD, eight a
conversion) and the rate at which the block's warps so issue slabs, against the SM's share of
HBM (at least 1.5x, or the report fails);
a trap is guarded when it is cooperative groups' grid-sync check, branched around or
reached only by a jump; a gap is an instance over its budget and within a known gap, whose
reason names the issue that closes it.

"""

if __name__ == "__main__":
  main()
