"""Sharded jaxfuse: runs tests/sharded_cases.py on 8 fake CPU devices in a process of its own (the
device count must be set before jax starts its backend), and the two-process test."""

import os
import socket
import subprocess
import sys

import pytest

_TESTS = os.path.dirname(os.path.abspath(__file__))


def _env(**extra):
  """The environment of the child processes: fake CPU devices only (also on a GPU machine)."""
  env = dict(os.environ)
  env.pop("XLA_FLAGS", None)
  env.pop("JAX_NUM_CPU_DEVICES", None)
  env.update(JAX_PLATFORMS="cpu", **extra)
  return env


@pytest.mark.long
def test_sharded_cases_on_8_devices(request):
  marks = request.config.getoption("markexpr")  # -m "not slow" leaves out sharded_cases' slow
  result = subprocess.run(
      [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "sharded_cases.py",
       *(["-m", marks] if marks else [])],
      cwd=_TESTS, capture_output=True, text=True, timeout=900,
      env=_env(XLA_FLAGS="--xla_force_host_platform_device_count=8"))
  report = result.stdout[-6000:] + result.stderr[-3000:]
  assert result.returncode == 0 and " passed" in result.stdout, report
  assert "skipped" not in result.stdout.splitlines()[-1], report


def _free_port():
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def test_two_processes():
  """jax.distributed with two local processes (coordinator on localhost, gloo CPU collectives):
  the sharded fused clip+AdamW step and global norm equal the single-process run."""
  port = str(_free_port())
  procs = [subprocess.Popen([sys.executable, "multiprocess_case.py", str(i), port], cwd=_TESTS,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=_env())
           for i in range(2)]
  try:
    outputs = [proc.communicate(timeout=300)[0] for proc in procs]
  finally:  # a no-op on the processes that exited
    for p in procs:
      p.kill()
  for i, (proc, out) in enumerate(zip(procs, outputs)):
    assert proc.returncode == 0 and f"process {i}: ok" in out, out[-4000:]
