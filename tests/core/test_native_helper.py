"""mpcomm.native_helper: the compiled modules are built at install (setup.py), only loaded at run time.
The engine's module is required (no build, no install; no module, no ``import mpcomm``, saying how
to rebuild); an optional helper's absence is a WARNING with its cost, never an error."""

from __future__ import annotations

import ast
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import mpcomm
from mpcomm import native_helper

ROOT = Path(__file__).resolve().parents[2]
REQUIRED = "mpcomm.engine._mpcomm_fastlane"
PKG = Path(mpcomm.__file__).resolve().parent


def _setup_helpers() -> dict[str, str]:
    tree = ast.parse((ROOT / "setup.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "HELPERS":
            return ast.literal_eval(node.value)
    raise AssertionError("setup.py has no HELPERS table")


def test_setup_builds_exactly_the_helpers_the_library_loads() -> None:
    if not (ROOT / "setup.py").exists():
        pytest.skip("no source tree")
    built = _setup_helpers()
    assert set(built) == set(native_helper.HELPERS) == set(native_helper.COST) | {REQUIRED}
    for name, src in built.items():
        assert (ROOT / src).is_file(), src
        # package-dir maps mpcomm -> core/, mpcomm.plugins -> plugins/: the library's path is the source's
        assert src.replace("core/", "", 1) == native_helper.HELPERS[name][1]
        stem = name.rsplit(".", 1)[1]
        assert f"PyInit_{stem}" in (ROOT / src).read_text()  # the module name the C file declares


def test_every_helper_loads_from_the_install_without_compiling() -> None:
    for name in native_helper.HELPERS:
        h = native_helper.load(name, _abi(name), _abi_symbol(name))
        if isinstance(h, str):
            pytest.skip(f"{name} was not built by this install: {h}")
        assert h.path.parent.is_relative_to(PKG.parent) and h.path.suffix == ".so"
        assert h.module.__file__ == str(h.path)


def _abi(name: str) -> int:
    from mpcomm.engine import fastlane
    from mpcomm.plugins.shm import _copyloop
    from mpcomm.plugins.tcp import busypoll, dataport
    from mpcomm.plugins.ucx import _native

    return {fastlane.MODULE: fastlane.ABI, _copyloop.MODULE: _copyloop.ABI, busypoll.MODULE: busypoll.ABI,
            _native.MODULE: _native.ABI, dataport.MODULE: dataport.ABI}[name]


def _abi_symbol(name: str) -> str:
    return {"mpcomm.engine._mpcomm_fastlane": "mpcomm_fastlane_abi", "mpcomm.plugins.shm._mpcomm_copyloop": "mp_abi",
            "mpcomm.plugins.tcp._mpcomm_busypoll": "mpcomm_tcp_abi",
            "mpcomm.plugins.tcp._mpcomm_dataport": "mpcomm_dataport_abi",
            "mpcomm.plugins.ucx._mpcomm_ucxloop": "mpcomm_ucx_abi"}[name]


def test_a_wrong_abi_is_refused_in_words() -> None:
    name = "mpcomm.plugins.tcp._mpcomm_busypoll"
    why = native_helper.load(name, 999, "mpcomm_tcp_abi")
    if "not installed" in str(why):
        pytest.skip(str(why))
    assert isinstance(why, str) and "ABI" in why and "reinstall mpcomm" in why


HIDE_ONE = """
import logging, sys
sys.modules["mpcomm.plugins.shm._mpcomm_copyloop"] = None  # as if the install had no compiler for it
logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s %(message)s")
import mpcomm
for _ in range(2):
    with mpcomm.Engine(transports=["tcp"]):
        pass
"""


def test_an_engine_warns_once_which_helper_is_missing_and_what_it_costs() -> None:
    proc = subprocess.run([sys.executable, "-c", HIDE_ONE], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    warnings = [ln for ln in proc.stderr.splitlines() if ln.startswith("WARNING mpcomm.native")]
    assert len(warnings) == 1, proc.stderr  # two engines, one warning
    assert "shm copy loop" in warnings[0] and native_helper.COST["mpcomm.plugins.shm._mpcomm_copyloop"] in warnings[0]


@pytest.mark.parametrize("how", ["missing", "stale"])
def test_import_mpcomm_fails_without_the_engines_module_saying_how_to_rebuild(how: str) -> None:
    """The engine's module has no Python twin: missing, or of another ABI (a build of other sources),
    ``import mpcomm`` raises ImportError naming the module, why, and the fix."""
    hide = (f"sys.modules[{REQUIRED!r}] = None" if how == "missing" else
            f"import types\nold = sys.modules[{REQUIRED!r}] = types.ModuleType({REQUIRED!r})\n"
            "old.ABI, old.__file__ = 1, '/an/old/build.so'")
    code = f"import sys\n{hide}\ntry:\n    import mpcomm\nexcept ImportError as e:\n    print('ImportError', e)\n"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.startswith("ImportError "), proc.stdout + proc.stderr
    assert REQUIRED in proc.stdout and "pip install -e ." in proc.stdout and "reinstall mpcomm" in proc.stdout
    assert ("not installed" if how == "missing" else "ABI") in proc.stdout


def _build_wheel(tmp_path: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    if not (ROOT / "setup.py").exists():
        pytest.skip("no source tree")
    src = tmp_path / "src"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(".git", ".venv*", "build", "dist", "*.egg-info",
                                                             "__pycache__", "*.so", "native-build.json"))
    return subprocess.run([sys.executable, "-m", "build", "--wheel", "--outdir", str(tmp_path / "dist"), str(src)],
                          env={**os.environ, **env}, capture_output=True, text=True, timeout=600)


def test_a_build_without_a_compiler_fails_naming_the_engines_module(tmp_path: Path) -> None:
    proc = _build_wheel(tmp_path, {"CC": "/nonexistent/cc", "CXX": "/nonexistent/c++",
                                   "LDSHARED": "/nonexistent/cc -shared"})
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and not list((tmp_path / "dist").glob("*.whl")), out[-3000:]
    assert f"the engine's native module {REQUIRED}" in out and "is required" in out and "pip install -e ." in out


def test_a_build_whose_optional_helpers_fail_succeeds_and_records_what_failed(tmp_path: Path) -> None:
    """A compiler that fails every plugin's C file (and builds the engine's): the wheel builds, ships
    the engine's module only, and native-build.json says why the others are missing."""
    cc = tmp_path / "cc"
    cc.write_text('#!/bin/sh\ncase "$*" in *plugins/*) echo "no plugins today" >&2; exit 1;; esac\nexec gcc "$@"\n')
    cc.chmod(0o755)
    proc = _build_wheel(tmp_path, {"CC": str(cc)})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (wheel,) = (tmp_path / "dist").glob("mpcomm-*.whl")
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        record = json.loads(z.read(f"mpcomm/{native_helper.BUILD_RECORD}"))
    assert set(record["failed"]) == set(native_helper.COST), record
    assert [n for n in names if "/_mpcomm_" in n and n.endswith(".so")] == [
        n for n in names if n.startswith("mpcomm/engine/_mpcomm_fastlane") and n.endswith(".so")] != [], names
    assert "pure-Python fallback will serve" in proc.stdout + proc.stderr


DOCTOR = """
import sys
sys.modules["mpcomm.plugins.shm._mpcomm_copyloop"] = None  # as if the install had no compiler for it
sys.argv = ["mpcomm", "doctor", "--json"]
from mpcomm.cli import main
main()
"""


def test_doctor_warns_which_helper_is_missing_and_what_it_costs() -> None:
    pytest.importorskip("typer")
    proc = subprocess.run([sys.executable, "-c", DOCTOR], capture_output=True, text=True, timeout=120)
    assert proc.returncode in (0, 1), proc.stderr  # 1 only for an unrelated FAIL on this node
    checks = {c["name"]: c for c in json.loads(proc.stdout)["checks"]}
    c = checks["compiled:shm copy loop"]
    assert c["status"] == "warn" and native_helper.COST["mpcomm.plugins.shm._mpcomm_copyloop"] in c["value"], c
    assert "compiled:engine inline lane" not in checks  # the others are there
