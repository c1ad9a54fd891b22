"""mpcomm.native_helper: the optional C helpers' build rules (private cache, hashed names, atomic, checked)."""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

import pytest

from mpcomm import native_helper

SRC = "int mp_answer(void) { return 42; }\n"


def _source(tmp_path: Path, text: str = SRC) -> Path:
    p = tmp_path / "helper.c"
    p.write_text(text)
    return p


def test_names_change_with_the_source_the_variant_and_the_abi(tmp_path: Path) -> None:
    src = _source(tmp_path)
    a = native_helper.artifact_name("h", src, 1)
    assert a.startswith("h-") and a.endswith(".so")
    assert native_helper.artifact_name("h", src, 1) == a  # stable
    assert native_helper.artifact_name("h", src, 2) != a
    assert native_helper.artifact_name("h", src, 1, module=True) != a
    src.write_text(SRC + "/* edited */\n")
    assert native_helper.artifact_name("h", src, 1) != a


def test_builds_once_into_the_cache_and_loads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if native_helper.compiler() is None:
        pytest.skip("no C compiler here")
    monkeypatch.setenv("MPCOMM_CACHE_DIR", str(tmp_path / "cache"))
    d = native_helper.cache_dir("demo")
    assert d == tmp_path / "cache" / "demo" and oct(d.stat().st_mode & 0o777) == "0o700"
    src = _source(tmp_path)
    out = d / native_helper.artifact_name("demo", src, 1)
    built = native_helper.build(out, src)
    assert built == out and native_helper.private_file(out)
    assert ctypes.CDLL(str(out)).mp_answer() == 42
    assert not [p for p in d.iterdir() if p.name.endswith(".tmp")]  # nothing half-written left
    mtime = out.stat().st_mtime_ns
    assert native_helper.build(out, src) == out and out.stat().st_mtime_ns == mtime  # not rebuilt


def test_reasons_in_words(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    src = _source(tmp_path, "this is not C\n")
    if native_helper.compiler() is not None:
        why = native_helper.build(tmp_path / "bad.so", src)
        assert isinstance(why, str) and "failed" in why and not (tmp_path / "bad.so").exists()
    monkeypatch.setenv("CC", "/nonexistent/cc")
    assert native_helper.build(tmp_path / "x.so", _source(tmp_path)) == "no C compiler (set CC or install cc)"


def test_a_file_others_can_write_is_not_private(tmp_path: Path) -> None:
    f = tmp_path / "lib.so"
    f.write_bytes(b"\0")
    os.chmod(f, 0o644)
    assert native_helper.private_file(f)
    os.chmod(f, 0o664)
    assert not native_helper.private_file(f)


def test_a_cache_others_can_write_is_skipped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    shared = tmp_path / "shared"
    (shared / "demo").mkdir(parents=True)
    os.chmod(shared, 0o777)
    monkeypatch.setenv("MPCOMM_CACHE_DIR", str(shared))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert native_helper.cache_dir("demo") == tmp_path / "xdg" / "mpcomm" / "demo"
