"""``mpcomm doctor`` names stale native build artefacts: the MPComm provider's files an old build
scheme left in an editable install's package dir (they shadow build/native/: an old libmpcomm was
loaded), a provider library older than its source, a compiled helper older than its C source.
Real files in a temporary tree laid out as a checkout (or as a wheel's package dir)."""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

import pytest

from mpcomm import native_helper
from mpcomm.cli.doctor import stale_native_checks
from mpcomm.tent import build

BUSYPOLL = "mpcomm.plugins.tcp._mpcomm_busypoll"


def _checkout(root: Path) -> Path:
    """A tree shaped as an editable install's checkout; returns its package dir (core/)."""
    root.mkdir(exist_ok=True)
    (root / "pyproject.toml").write_text("[project]\nname = 'mpcomm'\n")
    (root / "tent" / "native").mkdir(parents=True)
    (root / "tent" / "native" / "mpcomm.cpp").write_text("// the provider's source\n")
    (root / "core").mkdir()
    return root / "core"


def _layout(root: Path, version: str) -> Path:
    """A provider root as build_native lays it out (real files, not a working library); its library."""
    (root / "lib").mkdir(parents=True)
    (root / "lib" / build.SONAME).write_bytes(f"\x7fELF a build of {version}".encode())
    (root / "include").mkdir()
    (root / "include" / "mpcomm.h").write_text(f"// {version}\n")
    (root / build.STATUS_FILE).write_text(json.dumps({"built": True, "version": version}))
    return root / "lib" / build.SONAME


def _old_layout(pkg: Path) -> None:
    """What the old scheme built into the package dir itself."""
    _layout(pkg, "1.0.0")


def _warned(checks: list[Any]) -> dict[str, Any]:
    assert all(c.status == "warn" for c in checks), checks
    return {c.value.split(": ", 1)[0]: c for c in checks}


def test_an_old_layout_in_a_checkout_is_named_with_what_to_do(tmp_path: Path) -> None:
    pkg = _checkout(tmp_path)
    assert [c.status for c in stale_native_checks(str(pkg), {})] == ["pass"]
    _old_layout(pkg)
    assert build.native_root(pkg) == build.editable_root(tmp_path)  # named, never loaded
    warned = _warned(stale_native_checks(str(pkg), {}))
    assert set(warned) == {str(pkg / build.STATUS_FILE), str(pkg / "lib"), str(pkg / "include")}
    for path, check in warned.items():
        assert "old build scheme" in check.value and str(build.editable_root(tmp_path)) in check.value
        assert check.hint == f"remove it (rm -r {path})"
    for name in ("lib", "include"):
        shutil.rmtree(pkg / name)
    (pkg / build.STATUS_FILE).unlink()
    assert [c.status for c in stale_native_checks(str(pkg), {})] == ["pass"]


def test_a_checkout_takes_its_build_native_never_an_old_build_in_its_package_dir(tmp_path: Path) -> None:
    """The old files in core/ used to win over build/native/, so an old libmpcomm was loaded."""
    pkg = _checkout(tmp_path)
    _old_layout(pkg)
    root = build.editable_root(tmp_path)
    assert build.native_root(pkg) == root
    st = build.native_status(pkg)
    assert not st["built"] and st["root"] == str(root), st  # not built yet, and says so: the old one is not taken
    lib = _layout(root, build.PROVIDER_VERSION)
    st = build.native_status(pkg)
    assert st["built"] and st["library"] == str(lib) and st["version"] == build.PROVIDER_VERSION, st
    # Newer file times do not bring the old build back (a checkout or a copy resets them).
    later = time.time() + 3600
    for path in (pkg / "lib" / build.SONAME, pkg / build.STATUS_FILE):
        os.utime(path, (later, later))
    assert build.native_root(pkg) == root and build.native_status(pkg)["library"] == str(lib)
    # A wheel's package dir holds the same files legitimately: there it is the provider root.
    wheel = tmp_path / "site-packages" / "mpcomm"
    wheel.mkdir(parents=True)
    _old_layout(wheel)
    assert build.native_root(wheel) == wheel and build.native_status(wheel)["version"] == "1.0.0"


def test_a_provider_older_than_its_source_is_named(tmp_path: Path) -> None:
    pkg = _checkout(tmp_path)
    lib = _layout(build.editable_root(tmp_path), build.PROVIDER_VERSION)
    src = tmp_path / "tent" / "native" / "mpcomm.cpp"
    os.utime(lib, (src.stat().st_mtime - 60, src.stat().st_mtime - 60))
    warned = _warned(stale_native_checks(str(pkg), {}))
    assert warned[str(lib)].value == f"{lib}: older than its source {src}"
    assert "python -m mpcomm.tent.build" in warned[str(lib)].hint


def test_a_wheels_package_dir_is_its_provider_root_not_stale(tmp_path: Path) -> None:
    pkg = tmp_path / "site-packages" / "mpcomm"
    pkg.mkdir(parents=True)
    _old_layout(pkg)  # a wheel's own layout: the same files, legitimately there
    os.utime(pkg / "lib" / build.SONAME, (0, 0))
    assert [c.status for c in stale_native_checks(str(pkg), {})] == ["pass"]


def test_a_helper_older_than_its_c_source_is_named(tmp_path: Path) -> None:
    h = native_helper.load(BUSYPOLL, 3, "mpcomm_tcp_abi")
    if isinstance(h, str):
        pytest.skip(h)
    built = tmp_path / h.path.name  # a copy of the real built helper, with its source beside it
    shutil.copyfile(h.path, built)
    source = tmp_path / "_busypoll.c"
    source.write_text("/* edited after the build */\n")
    t = built.stat().st_mtime
    os.utime(source, (t - 60, t - 60))
    assert native_helper.stale({BUSYPOLL: built}) == []
    os.utime(source, (t + 60, t + 60))
    assert native_helper.stale({BUSYPOLL: built}) == [(built, source)]
    pkg = _checkout(tmp_path / "tree")
    warned = _warned(stale_native_checks(str(pkg), {BUSYPOLL: built}))
    assert warned[str(built)].value == f"{built}: older than its source {source}"
    assert "build_ext --inplace" in warned[str(built)].hint
    source.unlink()  # a wheel ships no sources: nothing to compare
    assert native_helper.stale({BUSYPOLL: built}) == []


def test_doctor_runs_the_check(invoke: Any) -> None:
    data = json.loads(invoke("doctor", "--json").stdout)
    mine = [c for c in data["checks"] if c["name"].startswith("stale_native")]
    assert mine and all(c["status"] in ("pass", "warn") for c in mine), mine
