"""Registration of jaxfuse's XLA FFI handlers, and what was built and what is usable.

Two developer switches, read at import (tools/sanitize.sh and tools/cuda_on_cpu.sh set them):

``JAXFUSE_EXTENSION_DIR``
  load the native modules from this directory instead of the package (a sanitizer build, or
  the CUDA-on-CPU build).
``JAXFUSE_CPU_TARGETS=cuda_on_cpu``
  on the CPU platform, run the CUDA handlers compiled for the host (``_jaxfuse_cuda_on_cpu``
  from ``JAXFUSE_EXTENSION_DIR``) instead of the C++ CPU handlers; see tools/cuda_on_cpu.sh.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import glob
import importlib
import importlib.util
import os
from types import ModuleType
from typing import Any, Callable, Iterator, Optional, Sequence

import jax
import jax.numpy as jnp

# CPU-platform handler sets and the suffix of their target names.
_CPU_TARGET_SUFFIX = {"native": "", "cuda_on_cpu": "_cuda_on_cpu"}


def _load_module(name: str) -> Optional[ModuleType]:
  ext_dir = os.environ.get("JAXFUSE_EXTENSION_DIR")
  if not ext_dir:
    try:
      return importlib.import_module(f"jaxfuse.{name}")
    except ImportError:
      return None
  paths = sorted(glob.glob(os.path.join(ext_dir, f"{name}.*.so")))
  if not paths:
    return None
  spec = importlib.util.spec_from_file_location(f"jaxfuse.{name}", paths[0])
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


_jaxfuse_cpu = _load_module("_jaxfuse_cpu")
if _jaxfuse_cpu is None:
  raise ImportError("jaxfuse: the native module _jaxfuse_cpu is missing (JAXFUSE_EXTENSION_DIR="
                    f"{os.environ.get('JAXFUSE_EXTENSION_DIR')!r})")
_jaxfuse_cuda = _load_module("_jaxfuse_cuda")  # present when the build found a CUDA compiler
_jaxfuse_cuda_on_cpu = (_load_module("_jaxfuse_cuda_on_cpu")
                        if os.environ.get("JAXFUSE_EXTENSION_DIR") else None)

CUDA_BUILT = _jaxfuse_cuda is not None
CUDA_ON_CPU = _jaxfuse_cuda_on_cpu is not None

_cpu_targets = os.environ.get("JAXFUSE_CPU_TARGETS", "native")
if _cpu_targets not in _CPU_TARGET_SUFFIX:
  raise ValueError(f"jaxfuse: JAXFUSE_CPU_TARGETS={_cpu_targets!r}; expected one of "
                   f"{sorted(_CPU_TARGET_SUFFIX)}")
if _cpu_targets == "cuda_on_cpu" and not CUDA_ON_CPU:
  raise ImportError("jaxfuse: JAXFUSE_CPU_TARGETS=cuda_on_cpu needs JAXFUSE_EXTENSION_DIR to "
                    "hold a _jaxfuse_cuda_on_cpu build (tools/cuda_on_cpu.sh makes one)")


def _register() -> None:
  # One target name carries both handlers; registering CUDA targets on a CPU-only jax is harmless.
  for name, capsule in _jaxfuse_cpu.registrations().items():
    jax.ffi.register_ffi_target(name, capsule, platform="cpu")
  if _jaxfuse_cuda is not None:
    for name, capsule in _jaxfuse_cuda.registrations().items():
      jax.ffi.register_ffi_target(name, capsule, platform="CUDA")
  if _jaxfuse_cuda_on_cpu is not None:
    suffix = _CPU_TARGET_SUFFIX["cuda_on_cpu"]
    for name, capsule in _jaxfuse_cuda_on_cpu.registrations().items():
      jax.ffi.register_ffi_target(name + suffix, capsule, platform="cpu")


_register()


def target(name: str) -> str:
  """The XLA target name for handler `name` under the current CPU handler set."""
  return name + _CPU_TARGET_SUFFIX[_cpu_targets]


@dataclasses.dataclass(frozen=True)
class Contract:
  """What an op's C++ side says Python must agree with (``contract()`` in the op's header under
  src_cuda/include/jaxfuse/): ``numbers`` (e.g. a slot count), ``names`` (ordered name lists:
  operand layouts, the fields of a device vector), ``shapes`` (named shapes) and ``functions``
  (layouts that depend on the call, e.g. a workspace size; integer keyword arguments in, a
  Contract's numbers, names and shapes out).
  """

  numbers: dict[str, int]
  names: dict[str, tuple[str, ...]]
  functions: dict[str, Callable[..., dict]]
  shapes: dict[str, tuple[int, ...]] = dataclasses.field(default_factory=dict)

  def call(self, function: str, **args: int) -> "Contract":
    out = self.functions[function](**{k: int(v) for k, v in args.items()})
    return _contract_of({**out, "functions": {}})


@functools.cache
def contract(op: str) -> Contract:
  """The contract of target ``op`` (e.g. "jaxfuse_adam"), from the always-built CPU module."""
  return _contract_of(_jaxfuse_cpu.contract()[op])


def traced_contract(op: str) -> Contract:
  """The contract of ``op`` as the handlers this trace calls see it: the CUDA-on-CPU build's
  under ``cpu_targets("cuda_on_cpu")`` (that build may shrink the multi-tensor chunks, which
  size some workspaces), else the CPU module's (the CUDA module is built with its constants)."""
  if _cpu_targets == "cuda_on_cpu":
    return _contract_of(_jaxfuse_cuda_on_cpu.contract()[op])
  return contract(op)


def _contract_of(c: dict) -> Contract:
  """A Contract from what a module's ``contract()`` returns for one op."""
  return Contract(dict(c["numbers"]), dict(c["names"]), dict(c["functions"]), dict(c["shapes"]))


def vector_dtype() -> jnp.dtype:
  """The dtype of the small device vectors (hyperparameters, gradient control): float64 under
  ``jax_enable_x64``, so that float64 math gets exact values and bias corrections are computed
  in JAX's default float type as optax computes them, else float32. Kernels round each value to
  their compute type once (ScalarVector in dtype.h)."""
  return jnp.dtype(jnp.float64 if jax.config.jax_enable_x64 else jnp.float32)


def device_vector(field_names: Sequence[str], **values: Any) -> jax.Array:
  """A small device vector (of vector_dtype()) whose layout C++ defines (a contract's
  field-name list), built from one value per field name."""
  if set(values) != set(field_names):
    raise ValueError(f"jaxfuse: vector fields {sorted(values)} do not match the kernel's "
                     f"layout {list(field_names)}")
  dtype = vector_dtype()
  return jnp.stack([jnp.asarray(values[name], dtype) for name in field_names])


def aliases(operands: Sequence[str], results: Sequence[str], size: int = 1,
            operand_offset: int = 0, result_offset: int = 0) -> dict[int, int]:
  """input_output_aliases for a call whose operand and result groups are named (``size``
  buffers each, after the offsets): a name in both is updated in place."""
  return {operand_offset + i * size + t: result_offset + results.index(name) * size + t
          for i, name in enumerate(operands) if name in results for t in range(size)}


@contextlib.contextmanager
def cpu_targets(kind: str) -> Iterator[None]:
  """Within the block, trace jaxfuse ops with the CPU handler set `kind` ("native" or
  "cuda_on_cpu"). jax's caches are cleared on entry and exit: compiled functions hold the
  target names they were traced with."""
  global _cpu_targets
  if kind not in _CPU_TARGET_SUFFIX:
    raise ValueError(f"cpu_targets: {kind!r}; expected one of {sorted(_CPU_TARGET_SUFFIX)}")
  if kind == "cuda_on_cpu" and not CUDA_ON_CPU:
    raise RuntimeError("cpu_targets: no _jaxfuse_cuda_on_cpu module was loaded")
  previous = _cpu_targets
  _cpu_targets = kind
  jax.clear_caches()
  try:
    yield
  finally:
    _cpu_targets = previous
    jax.clear_caches()


def op_of_target(target: str) -> Optional[str]:
  """The jaxfuse op an XLA custom-call target runs (either CPU handler set), or None."""
  for suffix in _CPU_TARGET_SUFFIX.values():
    if suffix and target.endswith(suffix):
      target = target[:-len(suffix)]
  return target if target in _op_names() else None


@functools.cache
def _op_names() -> frozenset[str]:
  return frozenset(_jaxfuse_cpu.registrations())


def call_cost(op: str, emulated: bool, operands: list, results: list,
              attrs: dict[str, int]) -> dict[str, Any]:
  """What a call of ``op`` with these buffers ((dims, element bytes, complex) each) and
  integer attributes costs: op.h's CallCost, from the op's own ``cost()``. ``emulated``: the
  call runs the CUDA handlers on the CPU (cuda_on_cpu), whose build may shrink the multi-tensor
  tables, so that build's module answers."""
  module = _jaxfuse_cuda_on_cpu if emulated else _jaxfuse_cpu
  return module.call_cost(op, operands, results, attrs)


@functools.cache
def export_safety_checks() -> list:
  """The ``disabled_checks`` that ``jax.export.export`` needs for a function with jaxfuse calls.

  jax.export refuses custom calls it does not know, since an exported artifact with them runs
  only where their handlers are registered: ``import jaxfuse`` (of a version with the same ops)
  before deserializing and calling it. One check per jaxfuse XLA target::

      exported = jax.export.export(jax.jit(step),
                                   disabled_checks=jaxfuse.export_safety_checks())(*args)
  """
  import jax.export

  return [jax.export.DisabledSafetyCheck.custom_call(target(name)) for name in sorted(_op_names())]


def _cuda_devices_present() -> bool:
  try:
    return bool(jax.devices("cuda"))  # not "gpu": that includes ROCm, which jaxfuse does not build
  except RuntimeError:
    return False


def _version(v: int) -> Optional[str]:
  return f"{v // 1000}.{v % 1000 // 10}" if v else None


@functools.cache
def _cuda_status() -> dict[str, Any]:
  if _jaxfuse_cuda is None:
    return {"built": False, "usable": False, "runtime_version": None, "driver_version": None,
            "problem": "jaxfuse was built without CUDA (no CUDA compiler at build time)"}
  info = _jaxfuse_cuda.cuda_info()
  problem = info["driver_problem"] or None
  if problem is None and not _cuda_devices_present():
    problem = "jax sees no CUDA device (is the jax CUDA plugin installed?)"
  return {"built": True, "usable": problem is None,
          "runtime_version": _version(info["runtime_version"]),
          "driver_version": _version(info["driver_version"]), "problem": problem}


def backends() -> dict[str, dict[str, Any]]:
  """Which jaxfuse backends were built into this install and which can run now.

  Returns ``{"cpu": {...}, "cuda": {...}}``; each has ``built`` and ``usable``. The CUDA entry also
  has ``runtime_version`` (the CUDA toolkit jaxfuse was built with, e.g. ``"13.0"``),
  ``driver_version`` (the newest CUDA the NVIDIA driver supports, ``None`` without a driver) and
  ``problem`` (why it is not usable, e.g. a driver too old for the runtime, or ``None``).
  """
  return {"cpu": {"built": True, "usable": True}, "cuda": dict(_cuda_status())}
