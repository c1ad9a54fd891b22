"""The install-time build: where it cannot build, it records why (and doctor reports it)."""

from __future__ import annotations

import json
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


def test_static_python_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real = build.sysconfig.get_config_var
    monkeypatch.setattr(build.sysconfig, "get_config_var",
                        lambda name: 0 if name == "Py_ENABLE_SHARED" else real(name))
    st = build.build_native(tmp_path)
    assert not st["built"] and "--enable-shared" in st["reason"]


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
