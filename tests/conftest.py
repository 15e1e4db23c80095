"""Fixtures and hooks only (shared helper functions are in helpers.py): every test that takes
`device` runs on the CPU backend (always) and on CUDA where jaxfuse's CUDA handlers can run."""

import functools
import os
import sys

# Under pytest-xdist (`-n auto`) every worker is a process with its own jax client on the same
# GPU: each takes the memory it uses instead of jax's default 75% of the card. (Read when the
# backend starts, so before any test touches a device.)
if "PYTEST_XDIST_WORKER" in os.environ:
  os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax
import pytest

import jaxfuse
from jaxfuse._core import ffi as _ffi

# `from helpers import ...` in the test modules: this directory on sys.path under any import mode
# (the default "prepend" mode adds it already; --import-mode=importlib does not).
_TESTS = os.path.dirname(os.path.abspath(__file__))
if _TESTS not in sys.path:
  sys.path.insert(0, _TESTS)

from helpers import emulated_cuda_module  # noqa: E402

emulated_cuda_module()  # registered before any test traces


def pytest_collection_modifyitems(config, items):
  """The tests marked long first: pytest-xdist hands tests out in this order, and one of a minute
  begun last would be the run's tail, the other workers idle."""
  items[:] = sorted(items, key=lambda item: item.get_closest_marker("long") is None)


@functools.cache
def cuda_skip_reason():
  """Why the "gpu" parameter cannot run here, or None when it can: the CUDA extension must have
  been built and jax must see a CUDA device (jax.devices("gpu") would include ROCm)."""
  cuda = jaxfuse.backends()["cuda"]
  if not _ffi.CUDA_BUILT:
    return f"CUDA extension not built: {cuda['problem']}"
  try:
    devices = jax.devices("cuda")
  except RuntimeError:
    devices = []
  if not devices:
    return f"no CUDA device: {cuda['problem'] or 'jax sees none'}"
  return None


BACKENDS = [
    pytest.param("cpu", id="cpu"),
    pytest.param("gpu", id="gpu", marks=[
        pytest.mark.gpu,
        pytest.mark.skipif(cuda_skip_reason() is not None, reason=str(cuda_skip_reason())),
    ]),
]


@pytest.fixture(params=BACKENDS)
def device(request):
  """The device the test's arrays live on (jit runs where its inputs are)."""
  return jax.devices("cuda" if request.param == "gpu" else request.param)[0]
