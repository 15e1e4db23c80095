"""The build says what it built: the version's local label (+cuXY / +cpu, which pip prints) is
decided by tools/build_version.py, held to by CMakeLists.txt, and agrees with jaxfuse.backends().
"""

import importlib.metadata
import importlib.util
import os
import pathlib
import re
import shutil
import subprocess
import sys

import pytest

import jaxfuse

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture
def build_version(monkeypatch, tmp_path):
  """tools/build_version.py, with a PATH holding no nvcc and no CUDA variables set."""
  spec = importlib.util.spec_from_file_location("build_version", ROOT / "tools" / "build_version.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  for name in ("JAXFUSE_CUDA", "JAXFUSE_PLAIN_VERSION", "CUDACXX", "CUDA_PATH"):
    monkeypatch.delenv(name, raising=False)
  monkeypatch.setenv("PATH", str(tmp_path / "empty"))
  return module


def fake_nvcc(directory, release):
  """An executable `nvcc` whose --version reports `release` (e.g. '12.8'); None: one that fails."""
  directory.mkdir(parents=True, exist_ok=True)
  nvcc = directory / "nvcc"
  nvcc.write_text("#!/bin/sh\nexit 1\n" if release is None else
                  "#!/bin/sh\necho 'nvcc: NVIDIA (R) Cuda compiler driver'\n"
                  f"echo 'Cuda compilation tools, release {release}, V{release}.1'\n")
  nvcc.chmod(0o755)
  return nvcc


def test_label_follows_cmakes_compiler_search(build_version, monkeypatch, tmp_path):
  version = lambda: build_version.dynamic_metadata("version", {"base": "1.2.3"})
  assert version() == "1.2.3+cpu"  # AUTO and no compiler anywhere
  monkeypatch.setenv("CUDA_PATH", str(tmp_path / "toolkit"))
  fake_nvcc(tmp_path / "toolkit" / "bin", "12.4")
  assert version() == "1.2.3+cu124"  # $CUDA_PATH/bin, the last place CMake looks
  monkeypatch.setenv("PATH", str(tmp_path / "on_path"))
  fake_nvcc(tmp_path / "on_path", "12.8")
  assert version() == "1.2.3+cu128"  # the PATH before $CUDA_PATH
  monkeypatch.setenv("CUDACXX", f"{fake_nvcc(tmp_path / 'chosen', '13.0')} -allow-unsupported-compiler")
  assert version() == "1.2.3+cu130"  # $CUDACXX (with flags) before both
  monkeypatch.setenv("JAXFUSE_CUDA", "OFF")
  assert version() == "1.2.3+cpu"
  monkeypatch.setenv("JAXFUSE_PLAIN_VERSION", "1")
  assert version() == "1.2.3"


def test_label_refuses_what_cmake_would_refuse(build_version, monkeypatch, tmp_path):
  monkeypatch.setenv("JAXFUSE_CUDA", "ON")
  with pytest.raises(RuntimeError, match=r"JAXFUSE_CUDA=ON needs a CUDA compiler: none found"):
    build_version.cuda_label()
  monkeypatch.setenv("CUDACXX", str(fake_nvcc(tmp_path, None)))
  with pytest.raises(RuntimeError, match=r"did not run"):
    build_version.cuda_label()
  for auto in ("AUTO", ""):  # exported but empty: AUTO (CMakeLists.txt reads it so too)
    monkeypatch.setenv("JAXFUSE_CUDA", auto)
    assert build_version.cuda_label() == "cpu"  # AUTO with a compiler that does not run: CPU only
  monkeypatch.setenv("JAXFUSE_CUDA", "off")
  with pytest.raises(ValueError, match=r"JAXFUSE_CUDA must be one of AUTO, ON, OFF, not 'off'"):
    build_version.cuda_label()
  with pytest.raises(ValueError, match=r"one setting, base"):
    build_version.dynamic_metadata("version", {"base": "1.2.3", "label": False})
  monkeypatch.setenv("JAXFUSE_PLAIN_VERSION", "yes")
  with pytest.raises(ValueError, match=r"JAXFUSE_PLAIN_VERSION must be 0 or 1, not 'yes'"):
    build_version.dynamic_metadata("version", {"base": "1.2.3"})


@pytest.mark.skipif(bool(os.environ.get("JAXFUSE_EXTENSION_DIR")),
                    reason="the modules come from a developer build, not from the installed package")
def test_installed_label_matches_backends():
  """jaxfuse's label says what jaxfuse itself holds; a CUDA package's, what it holds."""
  if jaxfuse.__version__ == "unknown":
    pytest.skip("jaxfuse is not installed (source tree on sys.path)")
  cuda = jaxfuse.backends()["cuda"]
  label = jaxfuse.__version__.partition("+")[2]
  if not label:  # built with JAXFUSE_PLAIN_VERSION=1: nothing to check against
    pytest.skip(f"version {jaxfuse.__version__} has no local label")
  assert (label != "cpu") == (cuda["package"] == "jaxfuse"), (jaxfuse.__version__, cuda)
  if cuda["built"] and cuda["package"] != "jaxfuse":
    package = importlib.metadata.version(cuda["package"].replace("_", "-"))
    assert package.split("+")[0] == jaxfuse.__version__.split("+")[0], (package, jaxfuse.__version__)
    label = package.partition("+")[2]
  if cuda["built"]:  # the runtime jaxfuse links statically comes with the toolkit that built it
    assert label == "cu" + cuda["runtime_version"].replace(".", ""), (jaxfuse.__version__, cuda)


def test_the_cuda_extras_pin_this_version():
  """`pip install 'jaxfuse[cuda13]'` brings the CUDA package of the same version, and jax's
  plugin for the same CUDA major."""
  text = (ROOT / "pyproject.toml").read_text()
  base = re.search(r'^base = "(.*)"$', text, re.M)[1]
  for major in (12, 13):
    assert f'cuda{major} = ["jaxfuse-cuda{major}=={base}", "jax[cuda{major}]"]' in text


def cmake_configure(tmp_path, version, *defines):
  args = ["cmake", "-S", str(ROOT), "-B", str(tmp_path / "build"), "-DSKBUILD_PROJECT_NAME=jaxfuse",
          f"-DSKBUILD_PROJECT_VERSION_FULL={version}", f"-DPython_EXECUTABLE={sys.executable}",
          *defines]
  return subprocess.run(args, capture_output=True, text=True, timeout=300)


@pytest.mark.skipif(shutil.which("cmake") is None, reason="needs cmake")
def test_cmake_builds_what_the_label_promises_or_fails(tmp_path):
  broken = cmake_configure(tmp_path, "0.1.0+cu999", "-DJAXFUSE_CUDA=OFF")
  assert broken.returncode != 0
  assert "the version 0.1.0+cu999 promises a 'cu999' build" in broken.stdout + broken.stderr
  assert "CMake would build 'cpu'" in broken.stdout + broken.stderr
  kept = cmake_configure(tmp_path, "0.1.0+cpu", "-DJAXFUSE_CUDA=OFF")
  assert kept.returncode == 0, kept.stdout + kept.stderr
  assert "jaxfuse: version 0.1.0+cpu" in kept.stdout
  bad_mode = cmake_configure(tmp_path, "0.1.0+cpu", "-DJAXFUSE_CUDA=off")
  assert "JAXFUSE_CUDA must be AUTO, ON or OFF, not 'off'" in bad_mode.stdout + bad_mode.stderr
