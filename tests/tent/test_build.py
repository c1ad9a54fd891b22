"""The install-time build: where it cannot build, it records why (and doctor reports it)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from mpcomm.tent import build


def test_no_compiler_is_recorded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    st = build.build_native(tmp_path)
    assert not st["built"] and "no C++ compiler" in st["reason"]
    assert json.loads((tmp_path / "native-status.json").read_text())["reason"] == st["reason"]
    assert build.native_status(tmp_path)["reason"] == st["reason"]


def test_missing_python_headers_are_recorded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real = build.sysconfig.get_paths
    monkeypatch.setattr(build.sysconfig, "get_paths", lambda *a, **k: {**real(*a, **k), "include": str(tmp_path)})
    st = build.build_native(tmp_path)
    assert not st["built"] and "Python headers missing" in st["reason"]


def _dynamic(lib: Path) -> str:
    proc = subprocess.run(["readelf", "-d", str(lib)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


@pytest.fixture(scope="module")
def wheel_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The provider as a wheel lays it out (no interpreter recorded: it is found where it is installed)."""
    root = tmp_path_factory.mktemp("wheelroot")
    st = build.build_native(root, for_wheel=True)
    if not st["built"]:
        pytest.skip(st["reason"])
    return root


def test_the_provider_links_no_libpython_and_names_no_interpreter(wheel_root: Path) -> None:
    if shutil.which("readelf") is None:
        pytest.skip("no readelf")
    lib = wheel_root / "lib"
    for so in (lib / build.SONAME, *lib.glob("libmpcomm_python*.so")):
        dyn = _dynamic(so)
        assert "libpython" not in dyn and "RPATH" not in dyn and "RUNPATH" not in dyn, dyn
        assert sys.executable.encode() not in so.read_bytes() and sys.prefix.encode() + b"/bin" not in so.read_bytes()
    assert "(SONAME)             Library soname: [libmpcomm.so.1]" in _dynamic(lib / build.SONAME)
    # The link-time name: a one-line ld script in a wheel (no symlinks in a zip), not a second copy.
    assert (lib / "libmpcomm.so").read_text().strip().endswith("INPUT(libmpcomm.so.1)")
    status = json.loads((wheel_root / build.STATUS_FILE).read_text())
    assert "python" not in status and status["python_version"] == f"{sys.version_info[0]}.{sys.version_info[1]}"


INIT_HOST = r"""
#include <mpcomm.h>
#include <cstdio>
int main() {
    mpcomm::MPComm c;
    int rc = c.init("127.0.0.1:x", "", 0);
    std::printf("INIT %d %s\n", rc, mpcomm::MPComm::lastErrorMessage().c_str());
    char buf[64];
    int again = c.registerMemory(buf, sizeof buf);
    std::printf("LATER %d %s\n", again, mpcomm::MPComm::lastErrorMessage().c_str());
    std::printf("INIT2 %d\n", c.init("127.0.0.1:x", "", 0));
    return 0;
}
"""


def test_a_missing_or_wrong_interpreter_is_an_error_code_not_a_crash(wheel_root: Path, tmp_path: Path) -> None:
    """init() with MPCOMM_PYTHON naming nothing, a non-Python, or another Python version: MPCOMM_ERR_RUNTIME
    (-13) and a message naming the problem, for init and every later call; the host carries on."""
    src = tmp_path / "init_host.cpp"
    src.write_text(INIT_HOST)
    exe, why = build.compile_host(src, tmp_path / "init_host", wheel_root)
    if exe is None:
        pytest.skip(why)
    other = tmp_path / "python9"
    other.write_text("#!/bin/sh\necho 3.99; echo /nowhere; echo libpython3.99.so; echo 1\n")
    other.chmod(0o755)
    cases = {str(tmp_path / "nonexistent"): "does not exist", "/bin/true": "printed nothing for its sysconfig",
             "/bin/false": "failed to report its sysconfig", str(other): "is Python 3.99, but this libmpcomm.so.1"}
    for python, words in cases.items():
        proc = subprocess.run([str(exe)], capture_output=True, text=True, timeout=60,
                              env={**os.environ, "MPCOMM_PYTHON": python})
        assert proc.returncode == 0, (python, proc.stdout, proc.stderr)
        lines = dict(line.split(" ", 1) for line in proc.stdout.splitlines())
        assert lines["INIT"].startswith("-13 ") and words in lines["INIT"], (python, proc.stdout)
        assert lines["LATER"].startswith("-13 ") and words in lines["LATER"], (python, proc.stdout)
        assert lines["INIT2"] == "-13", proc.stdout
    # The [tent] python key of the MPCOMM_CONFIG file names the interpreter when MPCOMM_PYTHON is unset.
    cfg = tmp_path / "mpcomm.toml"
    cfg.write_text(f'[transport]\nsecret = ""\n\n[tent]\n# the interpreter\npython = "{tmp_path / "nowhere"}"\n')
    env = {k: v for k, v in os.environ.items() if k != "MPCOMM_PYTHON"}
    proc = subprocess.run([str(exe)], capture_output=True, text=True, timeout=60, env={**env, "MPCOMM_CONFIG": str(cfg)})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"{tmp_path / 'nowhere'} (from tent.python in {cfg}), does not exist" in proc.stdout, proc.stdout
    from mpcomm.config import load_config

    assert load_config(str(cfg)).tent.python == str(tmp_path / "nowhere")  # the same file validates for the engine
    # ... and a real interpreter named there starts: the provider loads its libpython and runs.
    cfg.write_text(f'[tent]\npython = "{sys.executable}"\n')
    proc = subprocess.run([str(exe)], capture_output=True, text=True, timeout=120,
                          env={**env, "MPCOMM_CONFIG": str(cfg), "MPCOMM_TENT_BIND": "127.0.0.1"})
    assert proc.returncode == 0 and "INIT 0 " in proc.stdout, proc.stdout + proc.stderr


def test_a_missing_library_is_reported_even_without_a_record(tmp_path: Path) -> None:
    st = build.native_status(tmp_path)
    assert not st["built"] and "missing" in st["reason"]


def test_build_into_a_fresh_root(tmp_path: Path) -> None:
    st = build.build_native(tmp_path)
    if not st["built"]:
        pytest.skip(st["reason"])
    for rel in ("include/mpcomm.h", "lib/libmpcomm.so.1", "lib/libmpcomm.so",
                "lib/cmake/mpcomm/mpcommConfig.cmake", "lib/cmake/mpcomm/mpcommConfigVersion.cmake"):
        assert (tmp_path / rel).exists(), rel
    assert build.native_status(tmp_path)["built"]
