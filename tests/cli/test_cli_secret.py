"""``mpcomm secret`` and ``mpcomm serve --secret-file``: secrets never on the command line."""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any

from mpcomm_cli_helpers import start_server

import mpcomm
from mpcomm.auth import secret_strength


def test_secret_prints_a_new_256_bit_hex_secret(invoke: Any) -> None:
    a, b = invoke("secret"), invoke("secret")
    assert a.exit_code == 0 and b.exit_code == 0
    sa, sb = a.stdout.strip(), b.stdout.strip()
    assert len(sa) == 64 and int(sa, 16) >= 0 and sa != sb
    assert secret_strength(sa) == 32


def test_secret_to_a_private_file_never_overwrites(invoke: Any, tmp_path: Path) -> None:
    f = tmp_path / "secret"
    assert invoke("secret", "--file", f).exit_code == 0
    assert stat.S_IMODE(os.stat(f).st_mode) == 0o600
    assert len(f.read_text().strip()) == 64
    again = invoke("secret", "--file", f)
    assert again.exit_code == 2 and "already exists" in " ".join(again.output.split())


def test_serve_refuses_a_secret_on_the_command_line(invoke: Any) -> None:
    result = invoke("serve", "--secret", "a1" * 32, "--region", "kv=4KiB")
    assert result.exit_code == 2
    text = " ".join(result.output.split())  # rich wraps lines
    assert "process list" in text and "--secret-file" in text


def test_serve_with_a_secret_file(tmp_path: Path) -> None:
    f = tmp_path / "secret"
    f.write_text("c3" * 32 + "\n")
    f.chmod(0o600)
    srv = start_server("--region", "kv=4KiB", "--secret-file", str(f))
    try:
        with mpcomm.Engine(transports=["tcp"], secret="c3" * 32) as e:
            e.write(b"x", e.open(srv.address, "kv", timeout=5)).result(5)
        with mpcomm.Engine(transports=["tcp"], secret="d4" * 32) as e:
            try:
                e.open(srv.address, "kv", timeout=5)
                raise AssertionError("a wrong secret got in")
            except mpcomm.AuthenticationError:
                pass
    finally:
        code, err = srv.stop()
    assert code == 0, err


def test_serve_refuses_a_weak_secret_file(invoke: Any, tmp_path: Path) -> None:
    f = tmp_path / "secret"
    f.write_text("hunter2\n")
    result = invoke("serve", "--secret-file", f, "--region", "kv=4KiB")
    assert result.exit_code == 2 and "mpcomm secret" in " ".join(result.output.split())
