"""Registration of jaxfuse's XLA FFI handlers, and what was built and what is usable.

``JAXFUSE_EXTENSION_DIR`` (a developer switch, read at import): load the native modules from
this directory instead of the package (a sanitizer build's, tools/sanitize.sh).

The CPU platform's handlers come in sets: the native modules' (``"native"``) and any a developer
tool adds with :func:`add_cpu_handlers` under target names of their own; :func:`cpu_targets`
says which set a trace calls.
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

from jaxfuse._core import install as _install


def load_native_module(name: str) -> Optional[ModuleType]:
  """The native module ``name`` (e.g. "_jaxfuse_cpu") from ``JAXFUSE_EXTENSION_DIR`` when it is
  set, else from the package; None where there is none."""
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


_jaxfuse_cpu = load_native_module("_jaxfuse_cpu")
if _jaxfuse_cpu is None:
  raise ImportError("jaxfuse: the native module _jaxfuse_cpu is missing (JAXFUSE_EXTENSION_DIR="
                    f"{os.environ.get('JAXFUSE_EXTENSION_DIR')!r})")
# A source build's, or a CUDA package's (jaxfuse-cuda13, ...): see install.py.
_jaxfuse_cuda, _cuda_package = _install.find_cuda_module(load_native_module)

CUDA_BUILT = _jaxfuse_cuda is not None


@dataclasses.dataclass(frozen=True)
class _HandlerSet:
  module: ModuleType   # registrations(), contract() and call_cost() of its handlers
  suffix: str          # of its target names
  cuda_kernels: bool   # its handlers launch CUDA kernels (jaxfuse.report counts them)


def _register() -> None:
  # One target name carries both platforms' handlers; registering CUDA targets on a CPU-only jax
  # is harmless.
  for name, capsule in _jaxfuse_cpu.registrations().items():
    jax.ffi.register_ffi_target(name, capsule, platform="cpu")
  if _jaxfuse_cuda is not None:
    for name, capsule in _jaxfuse_cuda.registrations().items():
      jax.ffi.register_ffi_target(name, capsule, platform="CUDA")


_register()
_cpu_sets = {"native": _HandlerSet(_jaxfuse_cpu, "", cuda_kernels=False)}
_cpu_set = "native"


def add_cpu_handlers(name: str, module: ModuleType, cuda_kernels: bool) -> None:
  """Registers another set of handlers for the CPU platform, a native module's (e.g. a
  developer build of the CUDA handlers compiled for the host), under target names suffixed
  ``_<name>``; :func:`cpu_targets` traces with it. ``cuda_kernels``: its handlers run the CUDA
  code, so ``jaxfuse.report`` counts their kernel launches."""
  if name in _cpu_sets:
    raise ValueError(f"jaxfuse: a CPU handler set named {name!r} is registered already")
  suffix = f"_{name}"
  for op, capsule in module.registrations().items():
    jax.ffi.register_ffi_target(op + suffix, capsule, platform="cpu")
  _cpu_sets[name] = _HandlerSet(module, suffix, cuda_kernels)


def target(name: str) -> str:
  """The XLA target name for handler `name` under the current CPU handler set (called as each
  op is traced)."""
  tell_if_gpu_unused()
  return name + _cpu_sets[_cpu_set].suffix


@dataclasses.dataclass(frozen=True)
class Contract:
  """What an op's C++ side says Python must agree with (``contract()`` in the op's header under
  csrc/): ``numbers`` (e.g. a slot count), ``names`` (ordered name lists: operand layouts, the
  fields of a device vector), ``shapes`` (named shapes) and ``functions`` (layouts that depend on
  the call, e.g. a workspace size; integer keyword arguments in, a Contract's numbers, names and
  shapes out).
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
  """The contract of ``op`` as the handlers this trace calls see it: an added CPU handler set's
  under ``cpu_targets`` of it (a developer build may shrink the multi-tensor chunks, which size
  some workspaces), else the CPU module's (the CUDA module is built with its constants)."""
  if _cpu_set != "native":
    return _contract_of(_cpu_sets[_cpu_set].module.contract()[op])
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


def use_cpu_handlers(name: str) -> None:
  """Traces jaxfuse ops with the CPU handler set ``name`` from now on (see cpu_targets)."""
  global _cpu_set
  if name not in _cpu_sets:
    raise ValueError(f"jaxfuse: no CPU handler set {name!r}; registered: {sorted(_cpu_sets)}")
  _cpu_set = name


@contextlib.contextmanager
def cpu_targets(name: str) -> Iterator[None]:
  """Within the block, trace jaxfuse ops with the CPU handler set ``name`` ("native" or one
  added by add_cpu_handlers). jax's caches are cleared on entry and exit: compiled functions
  hold the target names they were traced with."""
  previous = _cpu_set
  use_cpu_handlers(name)
  jax.clear_caches()
  try:
    yield
  finally:
    use_cpu_handlers(previous)
    jax.clear_caches()


def op_of_target(target: str) -> tuple[Optional[str], str]:
  """The jaxfuse op an XLA custom-call target runs and the CPU handler set whose target it is,
  or (None, "native") for a target of no jaxfuse op."""
  for name, handlers in _cpu_sets.items():
    if handlers.suffix and target.endswith(handlers.suffix):
      op = target[:-len(handlers.suffix)]
      if op in _op_names():
        return op, name
  return (target if target in _op_names() else None), "native"


def runs_cuda_kernels(handler_set: str) -> bool:
  """Whether the CPU handler set ``handler_set`` runs the CUDA code (its kernels launched)."""
  return _cpu_sets[handler_set].cuda_kernels


@functools.cache
def _op_names() -> frozenset[str]:
  return frozenset(_jaxfuse_cpu.registrations())


def call_cost(op: str, handler_set: str, operands: list, results: list,
              attrs: dict[str, int]) -> dict[str, Any]:
  """What a call of ``op`` with these buffers ((dims, element bytes, complex) each) and
  integer attributes costs: op.h's CallCost, from the op's own ``cost()``, as the module of the
  CPU handler set that the call's target names answers (a developer build may shrink the
  multi-tensor tables)."""
  return _cpu_sets[handler_set].module.call_cost(op, operands, results, attrs)


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


def _module_info(module: ModuleType, package: str) -> dict[str, Any]:
  info = module.build_info()
  return {"package": package, "jaxlib": info["jaxlib"],
          "ffi_api": ".".join(str(v) for v in info["ffi_api"])}


@functools.cache
def _cpu_status() -> dict[str, Any]:
  problem = _install.ffi_problem("CPU module", _jaxfuse_cpu, _install.runtime_ffi_api())
  return {"built": True, "usable": problem is None, "problem": problem,
          **_module_info(_jaxfuse_cpu, "jaxfuse")}


@functools.cache
def _cuda_status() -> dict[str, Any]:
  if _jaxfuse_cuda is None:
    return {"built": False, "usable": False, "runtime_version": None, "driver_version": None,
            "problem": "no CUDA handlers in this install: pip install 'jaxfuse[cuda13]' (or "
                       "[cuda12], as jax's CUDA plugin), or build from source with a CUDA compiler",
            "package": None, "jaxlib": None, "ffi_api": None}
  info = _jaxfuse_cuda.cuda_info()
  problems = _cuda_install_problems()
  problem = "; ".join(problems) or info["driver_problem"] or None
  if problem is None and not _cuda_devices_present():
    problem = "jax sees no CUDA device (is the jax CUDA plugin installed?)"
  return {"built": True, "usable": problem is None,
          "runtime_version": _version(info["runtime_version"]),
          "driver_version": _version(info["driver_version"]), "problem": problem,
          **_module_info(_jaxfuse_cuda, _cuda_package)}


@functools.cache
def _cuda_install_problems() -> tuple[str, ...]:
  """What does not fit in the CUDA module's install (install.py), and a driver that exists but
  is too old for its runtime."""
  if _jaxfuse_cuda is None:
    return ()
  info = _jaxfuse_cuda.cuda_info()
  problems = [p for p in [_install.ffi_problem("CUDA module", _jaxfuse_cuda,
                                               _install.runtime_ffi_api())] if p]
  problems += _install.cuda_package_problems(_cuda_package, info["runtime_version"] // 1000)
  if info["driver_version"] and info["driver_problem"]:
    problems.append(info["driver_problem"])
  return tuple(problems)


def check_install() -> None:
  """Warns once about each problem of this install (install.py), at import: cheap (files and
  package metadata; no compile, no device)."""
  problem = _cpu_status()["problem"]
  for p in ([problem] if problem else []) + list(_cuda_install_problems()):
    _install.warn(p)


_told_no_cuda = False


def tell_if_gpu_unused() -> None:
  """Once per process, at the first trace of a jaxfuse op: a GPU that jax sees and this install
  has no CUDA handlers for is worth a warning (a computation on it would fail with XLA's "No
  FFI handler registered")."""
  global _told_no_cuda
  if _told_no_cuda or CUDA_BUILT:
    return
  _told_no_cuda = True
  if _cuda_devices_present():
    _install.warn("jax sees a CUDA GPU, but this jaxfuse install has no CUDA handlers, so its "
                  "ops cannot run there: pip install 'jaxfuse[cuda13]' (or [cuda12], as jax's "
                  "CUDA plugin)")


def backends() -> dict[str, dict[str, Any]]:
  """Which jaxfuse backends were built into this install and which can run now.

  Returns ``{"cpu": {...}, "cuda": {...}}``; each has ``built``, ``usable``, ``problem`` (why it
  is not usable, or ``None``), ``package`` (where its handlers come from: ``"jaxfuse"``, or a
  CUDA package such as ``"jaxfuse_cuda13"``), ``jaxlib`` and ``ffi_api`` (what they were built
  against). The CUDA entry also has ``runtime_version`` (the CUDA toolkit jaxfuse was built
  with, e.g. ``"13.0"``) and ``driver_version`` (the newest CUDA the NVIDIA driver supports,
  ``None`` without a driver). ``python -m jaxfuse`` prints them and runs each usable backend.
  """
  return {"cpu": dict(_cpu_status()), "cuda": dict(_cuda_status())}


check_install()
