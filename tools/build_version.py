"""The version of a jaxfuse build: the base version plus a local label naming what it builds.

pip shows a build's own output only when it fails or runs with -v, but it always prints the
version it installs ("Successfully installed jaxfuse-0.1.0+cu130"). So the label is how a plain
`pip install` says which handlers it built:
  +cuXY   CPU and CUDA handlers, compiled with nvcc X.Y (PyTorch's convention: +cu130 is 13.0)
  +cpu    CPU handlers only

scikit-build-core calls `dynamic_metadata` (pyproject.toml: tool.scikit-build.metadata.version)
before CMake runs, so the label is decided here, with the same rules CMake follows: JAXFUSE_CUDA
(AUTO, ON or OFF) from the environment, the compiler from $CUDACXX, else `nvcc` on the PATH, else
$CUDA_PATH/bin. It is a promise, not a guess: CMakeLists.txt reads the label back
(SKBUILD_PROJECT_VERSION_FULL) and fails the build rather than build anything else.
Its one setting is `base`, the version without label. JAXFUSE_PLAIN_VERSION=1 in the environment
gives the base version alone: for an sdist or wheel bound for an index that refuses local
versions, such as PyPI.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Mapping
from typing import Any

__all__ = ["dynamic_metadata", "cuda_label"]

_MODES = ("AUTO", "ON", "OFF")


def _find_nvcc() -> str | None:
  """The CUDA compiler CMake's check_language(CUDA) would try first, or None."""
  cudacxx = os.environ.get("CUDACXX", "").split()
  if cudacxx:
    return cudacxx[0]
  cuda_path = os.environ.get("CUDA_PATH", "")
  return shutil.which("nvcc") or (shutil.which("nvcc", path=os.path.join(cuda_path, "bin"))
                                  if cuda_path else None)


def _nvcc_release(nvcc: str) -> tuple[int, int] | None:
  """(major, minor) from `nvcc --version`, or None if it does not run."""
  try:
    out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=120,
                         check=True).stdout
  except (OSError, subprocess.SubprocessError):
    return None
  found = re.search(r"release (\d+)\.(\d+)", out)
  return (int(found[1]), int(found[2])) if found else None


def cuda_label() -> str:
  """'cuXY' if this build will compile the CUDA handlers with nvcc X.Y, else 'cpu'."""
  mode = os.environ.get("JAXFUSE_CUDA", "AUTO") or "AUTO"
  if mode not in _MODES:
    raise ValueError(f"JAXFUSE_CUDA must be one of {', '.join(_MODES)}, not {mode!r}")
  if mode == "OFF":
    return "cpu"
  nvcc = _find_nvcc()
  release = _nvcc_release(nvcc) if nvcc else None
  if release is None:
    if mode == "ON":
      where = f"{nvcc!r} did not run (`--version`)" if nvcc else (
          "none found ($CUDACXX, nvcc on the PATH, $CUDA_PATH/bin)")
      raise RuntimeError(f"JAXFUSE_CUDA=ON needs a CUDA compiler: {where}")
    return "cpu"
  return f"cu{release[0]}{release[1]}"


def dynamic_metadata(field: str, settings: Mapping[str, Any]) -> str:
  if field != "version":
    raise ValueError(f"tools/build_version.py provides the version only, not {field!r}")
  if set(settings) != {"base"} or not isinstance(settings["base"], str):
    raise ValueError("tools/build_version.py takes one setting, base (a string); "
                     f"got {dict(settings)}")
  plain = os.environ.get("JAXFUSE_PLAIN_VERSION", "")
  if plain not in ("", "0", "1"):
    raise ValueError(f"JAXFUSE_PLAIN_VERSION must be 0 or 1, not {plain!r}")
  if plain == "1":
    return settings["base"]
  return f"{settings['base']}+{cuda_label()}"
