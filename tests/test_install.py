"""The install's self-checks (jaxfuse/_core/install.py): what `import jaxfuse` warns about, where
the CUDA handlers come from, and ``python -m jaxfuse``, against planted mismatches: the running
jaxlib's FFI version lowered below the CPU module's, package metadata and jax plugins replaced, a
Python module standing in on sys.path for a CUDA package (finding it is what is tested).
"""

import os
import subprocess
import sys
import warnings

import pytest

import jaxfuse
from jaxfuse._core import ffi as _ffi
from jaxfuse._core import install, notices


def test_backends_say_what_each_backend_was_built_from():
  cpu, cuda = jaxfuse.backends()["cpu"], jaxfuse.backends()["cuda"]
  assert cpu["usable"] and cpu["problem"] is None and cpu["package"] == "jaxfuse"
  built = _ffi._jaxfuse_cpu.build_info()
  assert cpu["jaxlib"] == built["jaxlib"] and cpu["ffi_api"] == "%d.%d" % built["ffi_api"]
  runtime = install.runtime_ffi_api()
  assert runtime is not None and runtime[0] == built["ffi_api"][0]
  assert built["ffi_api"][1] <= runtime[1]  # built against the oldest jaxlib we support
  assert cuda["built"] == _ffi.CUDA_BUILT and (cuda["usable"] or cuda["problem"])


def test_a_module_built_against_a_newer_ffi_than_the_running_jaxlib_is_named(monkeypatch):
  major, minor = _ffi._jaxfuse_cpu.build_info()["ffi_api"]
  problem = install.ffi_problem("CPU module", _ffi._jaxfuse_cpu, (major, minor - 1))
  assert f"XLA FFI API {major}.{minor}" in problem and f"has FFI API {major}.{minor - 1}" in problem
  assert "will not register" in problem and "pip install -U jax jaxlib" in problem
  assert install.ffi_problem("CPU module", _ffi._jaxfuse_cpu, (major + 1, 0)) is not None
  assert install.ffi_problem("CPU module", _ffi._jaxfuse_cpu, (major, minor + 3)) is None
  # as import would: one InstallWarning, and the backend reported unusable
  monkeypatch.setattr(install, "runtime_ffi_api", lambda: (major, minor - 1))
  notices.forget()
  _ffi._cpu_status.cache_clear()
  try:
    with pytest.warns(install.InstallWarning, match="CPU module was built against jaxlib"):
      _ffi.check_install()
    assert not jaxfuse.backends()["cpu"]["usable"]
  finally:
    _ffi._cpu_status.cache_clear()


def _versions(monkeypatch, **versions):
  monkeypatch.setattr(install, "installed_version", lambda dist: versions.get(dist))


def test_a_cuda_package_that_does_not_fit_is_named(monkeypatch):
  _versions(monkeypatch, **{"jaxfuse": "0.2.0+cpu", "jaxfuse-cuda13": "0.1.0+cu130",
                            "jax-cuda13-plugin": "0.11.2"})
  (version,) = install.cuda_package_problems("jaxfuse_cuda13", 13)
  assert "jaxfuse-cuda13 0.1.0+cu130 is installed beside jaxfuse 0.2.0+cpu" in version
  assert "pip install 'jaxfuse[cuda13]==0.2.0'" in version
  _versions(monkeypatch, **{"jaxfuse": "0.1.0+cpu", "jaxfuse-cuda13": "0.1.0+cu130"})
  (no_plugin,) = install.cuda_package_problems("jaxfuse_cuda13", 13)
  assert "jax has no CUDA plugin" in no_plugin and "pip install 'jax[cuda13]'" in no_plugin
  _versions(monkeypatch, **{"jaxfuse": "0.1.0+cpu", "jaxfuse-cuda13": "0.1.0+cu130",
                            "jax-cuda12-plugin": "0.11.2"})
  (major,) = install.cuda_package_problems("jaxfuse_cuda13", 13)
  assert "built for CUDA 13 but jax's plugin is jax-cuda12-plugin" in major
  assert "pip install 'jaxfuse[cuda12]'" in major
  _versions(monkeypatch, **{"jaxfuse": "0.1.0+cpu", "jaxfuse-cuda12": "0.1.0+cu129",
                            "jax-cuda12-plugin": "0.11.2"})
  assert install.cuda_package_problems("jaxfuse_cuda12", 12) == []
  _versions(monkeypatch)  # a source build beside a jax without a CUDA plugin: a developer's
  assert install.cuda_package_problems("jaxfuse", 13) == []


def test_the_cuda_handlers_come_from_the_package_for_jaxs_cuda(monkeypatch, tmp_path):
  for major in (12, 13):
    package = tmp_path / f"jaxfuse_cuda{major}"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "_jaxfuse_cuda.py").write_text(f"MAJOR = {major}\n")
  monkeypatch.syspath_prepend(str(tmp_path))
  monkeypatch.delenv("JAXFUSE_EXTENSION_DIR", raising=False)
  for name in [m for m in sys.modules if m.startswith("jaxfuse_cuda")]:
    monkeypatch.delitem(sys.modules, name)
  none = lambda name: None  # no module in jaxfuse itself: not a source build
  _versions(monkeypatch, **{"jax-cuda12-plugin": "0.11.2"})
  module, package = install.find_cuda_module(none)
  assert (module.MAJOR, package) == (12, "jaxfuse_cuda12")
  _versions(monkeypatch)  # no jax plugin: the newest
  module, package = install.find_cuda_module(none)
  assert (module.MAJOR, package) == (13, "jaxfuse_cuda13")
  source = object()
  assert install.find_cuda_module(lambda name: source) == (source, "jaxfuse")


def test_a_gpu_without_cuda_handlers_is_told_once(monkeypatch):
  monkeypatch.setattr(_ffi, "CUDA_BUILT", False)
  monkeypatch.setattr(_ffi, "_told_no_cuda", False)
  monkeypatch.setattr(_ffi, "_cuda_devices_present", lambda: True)
  notices.forget()
  with pytest.warns(install.InstallWarning, match=r"jax sees a CUDA GPU, but this jaxfuse install "
                                                  r"has no CUDA handlers.*jaxfuse\[cuda13\]"):
    _ffi.target("jaxfuse_adam")
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    _ffi.target("jaxfuse_adam")


def test_python_m_jaxfuse_reports_and_runs_each_usable_backend():
  out = subprocess.run([sys.executable, "-m", "jaxfuse"], capture_output=True, text=True,
                       timeout=300, env={**os.environ, "JAX_PLATFORMS": "cpu"})
  assert out.returncode == 0, out.stdout + out.stderr
  assert "  cpu: built in jaxfuse against jaxlib" in out.stdout
  assert any(line.startswith("  cpu self-test on ") and line.endswith(": ok")
             for line in out.stdout.splitlines()), out.stdout
  assert "  cuda: " in out.stdout
