"""What this install holds, and whether it fits the jax it runs with.

jaxfuse is packaged as jax is: ``jaxfuse`` (the Python package and the CPU handlers) and one CUDA
handler package per CUDA major, ``jaxfuse-cuda12`` and ``jaxfuse-cuda13`` (``pip install
'jaxfuse[cuda13]'`` beside ``jax[cuda13]``), whose Python packages ``jaxfuse_cuda12`` and
``jaxfuse_cuda13`` hold the module ``_jaxfuse_cuda``. A build from source with a CUDA compiler
puts both modules in ``jaxfuse`` itself.

``import jaxfuse`` checks, cheaply (files and package metadata, no compile, no device), what
would otherwise fail late or silently, and warns once per problem, naming the fix
(:class:`InstallWarning`): a module built against a newer XLA FFI than the running jaxlib has
(its handlers would not register: XLA's "No FFI handler registered" at the first call), a CUDA
package of another jaxfuse version or CUDA major than the rest, one beside a jax without a CUDA
plugin, a driver older than the CUDA runtime. ``python -m jaxfuse`` prints the same and runs each
usable backend's handlers once.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import os
import re
from importlib import metadata
from types import ModuleType
from typing import Any, Callable, Optional

import jax

from jaxfuse._core import notices as _notices

# The CUDA handler packages by CUDA major, the newest first.
CUDA_PACKAGES = {13: "jaxfuse_cuda13", 12: "jaxfuse_cuda12"}


class InstallWarning(UserWarning):
  """A jaxfuse install that does not fit the jax, jaxlib or driver it runs with."""


def distribution(package: str) -> str:
  """The pip name of a Python package of ours: jaxfuse_cuda13 -> jaxfuse-cuda13."""
  return package.replace("_", "-")


def installed_version(dist: str) -> Optional[str]:
  try:
    return metadata.version(dist)
  except metadata.PackageNotFoundError:
    return None


def jax_cuda_plugins() -> dict[int, str]:
  """The CUDA majors of the jax CUDA plugins installed (jax[cuda12], jax[cuda13]): versions."""
  found = {major: installed_version(f"jax-cuda{major}-plugin") for major in CUDA_PACKAGES}
  return {major: v for major, v in found.items() if v is not None}


def find_cuda_module(load: Callable[[str], Optional[ModuleType]]
                     ) -> tuple[Optional[ModuleType], Optional[str]]:
  """The CUDA handlers' module and the package it came from: ``"jaxfuse"`` for a source build
  (or a developer's ``JAXFUSE_EXTENSION_DIR``), else a CUDA package, the one for the CUDA major
  of jax's plugin where several are installed; (None, None) without one. `load` loads a module
  of jaxfuse's own (ffi.load_native_module)."""
  module = load("_jaxfuse_cuda")
  if module is not None or os.environ.get("JAXFUSE_EXTENSION_DIR"):
    return module, ("jaxfuse" if module is not None else None)
  installed = [major for major, package in CUDA_PACKAGES.items()
               if importlib.util.find_spec(package) is not None]
  if not installed:
    return None, None
  plugins = jax_cuda_plugins()
  package = CUDA_PACKAGES[next((m for m in installed if m in plugins), installed[0])]
  return importlib.import_module(f"{package}._jaxfuse_cuda"), package


@functools.cache
def runtime_ffi_api() -> Optional[tuple[int, int]]:
  """The XLA FFI API version (major, minor) of the running jaxlib, from the headers it ships;
  None where they are missing."""
  try:
    with open(os.path.join(jax.ffi.include_dir(), "xla", "ffi", "api", "c_api.h")) as f:
      text = f.read()
  except OSError:
    return None
  found = [re.search(rf"#define XLA_FFI_API_{part} (\d+)", text) for part in ("MAJOR", "MINOR")]
  return None if None in found else (int(found[0][1]), int(found[1][1]))


def ffi_problem(name: str, module: ModuleType,
                runtime: Optional[tuple[int, int]]) -> Optional[str]:
  """Why `module`'s handlers would not register on this jaxlib, or None: a module built against
  FFI headers of another major version, or of a newer minor one, than the running jaxlib's."""
  info = module.build_info()
  built = tuple(info["ffi_api"])
  if runtime is None or (built[0] == runtime[0] and built[1] <= runtime[1]):
    return None
  return (f"jaxfuse's {name} was built against jaxlib {info['jaxlib']} (XLA FFI API "
          f"{built[0]}.{built[1]}), but the running jaxlib {installed_version('jaxlib')} has FFI "
          f"API {runtime[0]}.{runtime[1]}, so its handlers will not register (XLA: \"No FFI "
          "handler registered\"): upgrade jaxlib (pip install -U jax jaxlib), or reinstall "
          "jaxfuse built against this one")


def cuda_package_problems(package: Optional[str], cuda_major: int) -> list[str]:
  """Why a CUDA package does not fit the rest of the install: another jaxfuse version, no jax
  CUDA plugin, or a jax plugin for another CUDA major. A source build (package "jaxfuse") is
  judged on its CUDA major alone, and only when jax has a CUDA plugin."""
  problems = []
  plugins = jax_cuda_plugins()
  if package not in (None, "jaxfuse"):
    dist, ours = distribution(package), installed_version("jaxfuse")
    theirs = installed_version(dist)
    if ours is not None and theirs is not None and theirs.split("+")[0] != ours.split("+")[0]:
      problems.append(f"{dist} {theirs} is installed beside jaxfuse {ours}: their handlers and "
                      f"Python sides must be of one version (pip install 'jaxfuse[cuda{cuda_major}]"
                      f"=={ours.split('+')[0]}')")
    if not plugins:
      problems.append(f"{dist} is installed but jax has no CUDA plugin, so jax sees no GPU: pip "
                      f"install 'jax[cuda{cuda_major}]'")
  if plugins and cuda_major not in plugins:
    have = ", ".join(f"jax-cuda{m}-plugin" for m in sorted(plugins))
    problems.append(f"jaxfuse's CUDA handlers were built for CUDA {cuda_major} but jax's plugin is "
                    f"{have}: install the matching pair, e.g. pip install "
                    f"'jaxfuse[cuda{max(plugins)}]' (or 'jax[cuda{cuda_major}]')")
  return problems


def warn(problem: str) -> None:
  """One InstallWarning per distinct problem in a process."""
  _notices.warn_once(f"jaxfuse: {problem}", InstallWarning, stacklevel=3)


def summary(backends: dict[str, dict[str, Any]]) -> str:
  """A few lines a person reads: versions, what each backend is built from, usable or why not."""
  lines = [f"jaxfuse {installed_version('jaxfuse') or 'unknown (source tree)'}; jax "
           f"{jax.__version__}, jaxlib {installed_version('jaxlib')}; jax CUDA plugins: "
           + (", ".join(f"cuda{m} {v}" for m, v in sorted(jax_cuda_plugins().items())) or "none")]
  for name, b in backends.items():
    state = "usable" if b["usable"] else f"not usable: {b['problem']}"
    built = (f"built in {b['package']} against jaxlib {b['jaxlib']} (FFI {b['ffi_api']})"
             if b["built"] else "not built")
    lines.append(f"  {name}: {built}; {state}")
  return "\n".join(lines)
