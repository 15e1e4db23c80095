"""jaxfuse.flax works after a plain `import jaxfuse` (it loads on first use: flax is optional)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import jaxfuse

TIMEOUT_S = 300

_LAZY_FLAX = textwrap.dedent("""
    import importlib.util, sys
    sys.modules["flax"] = None          # flax missing: import jaxfuse must not need it
    import jaxfuse
    assert "jaxfuse.flax" not in sys.modules
    assert not hasattr(jaxfuse, "flax")
    try:
      jaxfuse.flax
    except AttributeError as e:
      assert "pip install 'jaxfuse[flax]'" in str(e), e
      assert isinstance(e.__cause__, ModuleNotFoundError), repr(e.__cause__)
    try:
      jaxfuse.no_such_name
    except AttributeError as e:
      assert "no_such_name" in str(e), e
    else:
      raise AssertionError("jaxfuse.no_such_name did not raise AttributeError")
    del sys.modules["flax"]             # flax installed: jaxfuse.flax loads on first use
    if importlib.util.find_spec("flax") is None:
      print("flax not installed")
    else:
      assert jaxfuse.flax.TrainState.__module__ == "jaxfuse.flax"
      assert jaxfuse.flax.Optimizer is sys.modules["jaxfuse.flax"].Optimizer
      print("jaxfuse.flax loaded")
    """)


def test_jaxfuse_flax_loads_without_its_own_import(tmp_path):
  env = dict(os.environ)
  package_root = str(Path(jaxfuse.__file__).resolve().parent.parent)
  env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
  proc = subprocess.run([sys.executable, "-c", _LAZY_FLAX], cwd=tmp_path, env=env,
                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                        timeout=TIMEOUT_S)
  assert proc.returncode == 0, proc.stdout
  if "flax not installed" in proc.stdout:
    pytest.skip("flax is not installed (the missing-flax half ran)")
  assert "jaxfuse.flax loaded" in proc.stdout
