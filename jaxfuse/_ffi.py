"""Registration of jaxfuse's XLA FFI handlers, and what was built and what is usable."""

from __future__ import annotations

import functools

import jax

from jaxfuse import _jaxfuse_cpu

try:  # Present only when the build found a CUDA compiler.
  from jaxfuse import _jaxfuse_cuda
except ImportError:  # pragma: no cover - depends on the build
  _jaxfuse_cuda = None

CUDA_BUILT = _jaxfuse_cuda is not None


def _register() -> None:
  # One target name carries both handlers; registering CUDA targets on a CPU-only jax is harmless.
  for name, capsule in _jaxfuse_cpu.registrations().items():
    jax.ffi.register_ffi_target(name, capsule, platform="cpu")
  if _jaxfuse_cuda is not None:
    for name, capsule in _jaxfuse_cuda.registrations().items():
      jax.ffi.register_ffi_target(name, capsule, platform="CUDA")


_register()


@functools.cache
def _cuda_devices_present() -> bool:
  try:
    return bool(jax.devices("cuda"))  # not "gpu": that includes ROCm, which jaxfuse does not build
  except RuntimeError:
    return False


def backends() -> dict[str, dict[str, bool]]:
  """Which jaxfuse backends were built into this install and which can run now.

  Returns ``{"cpu": {"built": True, "usable": True}, "cuda": {"built": ..., "usable": ...}}``;
  CUDA is usable when it was built and jax sees a CUDA GPU.
  """
  return {
      "cpu": {"built": True, "usable": True},
      "cuda": {"built": CUDA_BUILT, "usable": CUDA_BUILT and _cuda_devices_present()},
  }
