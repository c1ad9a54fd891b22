"""Every command, as a separate process: its result on stdout, its diagnostics on stderr.

``mpcomm demo > out.txt`` used to leave the file empty (the table went to
stderr). The rule (docs/cli.md): what the command was asked for -- a table, a
summary, records, an address, JSON -- goes to stdout; progress bars, status
lines, warnings, logs, telemetry and errors go to stderr.
"""

from __future__ import annotations

import json
import os
import re
import select
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from mpcomm_cli_helpers import Server, start_server

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "topology"))
from etcd_support import EtcdServer, etcd_binary  # noqa: E402


def run(*args: Any, cwd: Path, **env: str) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("MPCOMM_")}
    return subprocess.run([sys.executable, "-m", "mpcomm.cli", *map(str, args)], capture_output=True, text=True,
                          timeout=180, cwd=cwd, env={**base, "COLUMNS": "200", **env}, stdin=subprocess.DEVNULL)


@pytest.fixture(scope="module")
def srv() -> Iterator[Server]:
    s = start_server("--region", "kv=1MiB")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    if etcd_binary() is None:
        pytest.skip("etcd is not installed (Debian: etcd-server)")
    pytest.importorskip("etcd3gw", reason="the etcd3gw client is not installed")
    server = EtcdServer(tmp_path_factory.mktemp("etcd"))
    server.start()
    yield server.url
    server.kill()


def _json_only(out: str) -> bool:
    return bool(out.strip()) and all(isinstance(json.loads(line), dict) for line in out.splitlines())


#: (id, arguments, environment, what stdout holds, what stderr holds (or None: anything but the result)).
#: "{addr}" is the served address; "{etcd}" an etcd URL; files are in the test's directory.
CASES: list[tuple[str, tuple[str, ...], dict[str, str], str, str | None]] = [
    ("version", ("--version",), {}, "mpcomm ", None),
    ("plugins", ("plugins",), {"MPCOMM_PLUGINS": "tcp"}, "mpcomm transports", None),
    ("plugins-json", ("plugins", "--json"), {}, "json", None),
    ("doctor", ("doctor",), {}, "overall:", None),
    ("doctor-manifest", ("doctor", "--manifest"), {}, "plugin:tcp", None),
    ("topology", ("topology",), {}, "== routes ==", None),
    ("calibrate", ("topology", "--calibrate", "-t", "tcp", "--seconds", "0.1", "--rounds", "1"),
     {"MPCOMM_CALIBRATION_FILE": "bandwidth.json"}, "== transports ==", "calibrating tcp"),
    ("regions", ("regions", "--metadata", "{etcd}"), {}, "no regions published", None),
    ("bench", ("bench", "--target", "{addr}", "kv", "--case", "latency", "--quick", "--duration", "0.02"), {},
     "transport=tcp", None),
    ("secret", ("secret",), {}, "hex64", None),
    ("put", ("put", "data.bin", "{addr}", "kv"), {}, "put: data.bin -> kv@", "put data.bin"),
    ("put-json", ("put", "data.bin", "{addr}", "kv", "--json"), {}, "json", "put data.bin"),
    ("get", ("get", "{addr}", "kv", "got.bin", "--length", "5000"), {}, "get: got.bin <- kv@", "get got.bin"),
    ("demo", ("demo", "--size", "64KiB", "--reps", "1"), {"MPCOMM_PLUGINS": "tcp"}, "tcp (best)", None),
    ("demo-json", ("demo", "--size", "64KiB", "--reps", "1", "--json"), {"MPCOMM_PLUGINS": "tcp"}, "json", None),
    ("otel-console", ("--otel", "console", "plugins"), {"MPCOMM_PLUGINS": "tcp"}, "mpcomm transports",
     '"name": "mpcomm plugins"'),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_result_on_stdout_diagnostics_on_stderr(case: Any, srv: Server, request: pytest.FixtureRequest,
                                                  tmp_path: Path) -> None:
    name, args, env, result, diagnostic = case
    etcd = request.getfixturevalue("etcd") if any("{etcd}" in a for a in args) else ""
    (tmp_path / "data.bin").write_bytes(b"z" * 5000)
    args = tuple(a.format(addr=srv.address, etcd=etcd) for a in args)
    proc = run(*args, cwd=tmp_path, **env)
    assert proc.returncode in ((0, 1) if name == "doctor" else (0,)), proc.stderr  # doctor: 1 on a FAIL here
    if result == "json":
        assert _json_only(proc.stdout), proc.stdout
    elif result == "hex64":
        assert re.fullmatch(r"[0-9a-f]{64}\n", proc.stdout), proc.stdout
    else:
        assert result in proc.stdout, proc.stdout
        assert result not in proc.stderr, proc.stderr
    if diagnostic is not None:
        assert diagnostic in proc.stderr and diagnostic not in proc.stdout, (proc.stdout, proc.stderr)


def test_demo_redirected_to_a_file_keeps_its_table(tmp_path: Path) -> None:
    """The issue's words: `mpcomm demo > out.txt` left the file empty."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("MPCOMM_")}
    out = tmp_path / "out.txt"
    with open(out, "w") as f:
        proc = subprocess.run([sys.executable, "-m", "mpcomm.cli", "demo", "--size", "64KiB", "--reps", "1"],
                              stdout=f, stderr=subprocess.PIPE, text=True, timeout=180,
                              env={**base, "MPCOMM_PLUGINS": "tcp"})
    assert proc.returncode == 0, proc.stderr
    text = out.read_text()
    assert "mpcomm demo: two engines" in text and "tcp (best)" in text
    assert "\x1b[" not in text  # no terminal colour codes in a file


def test_secret_file_writes_the_file_and_says_so_on_stderr(tmp_path: Path) -> None:
    proc = run("secret", "--file", "s.key", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == ""  # the result is the file, never the secret on a stream
    assert "wrote a new 256-bit secret to s.key" in proc.stderr
    assert re.fullmatch(r"[0-9a-f]{64}\n", (tmp_path / "s.key").read_text())


def test_serve_prints_only_its_address_on_stdout(tmp_path: Path) -> None:
    base = {k: v for k, v in os.environ.items() if not k.startswith("MPCOMM_")}
    proc = subprocess.Popen([sys.executable, "-m", "mpcomm.cli", "serve", "--region", "kv=4KiB", "--endpoint",
                             "127.0.0.1:0", "-t", "tcp"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=base, cwd=tmp_path)
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], 60)
    address = proc.stdout.readline().strip() if ready else ""
    proc.send_signal(signal.SIGTERM)
    rest, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert re.fullmatch(r"127\.0\.0\.1:\d+", address) and rest == ""
    assert f"serving on {address}" in err and "region kv" in err and "stopped" in err


@pytest.mark.parametrize("args,message", [
    (("put", "missing.bin", "127.0.0.1:1", "kv"), "error: UsageError: missing.bin"),
    (("put", "--no-such-option"), "error: UsageError: No such option"),
    (("regions",), "error: UsageError: no metadata service"),
])
def test_errors_go_to_stderr_only(args: tuple[str, ...], message: str, tmp_path: Path) -> None:
    proc = run(*args, cwd=tmp_path)
    assert proc.returncode == 2 and message in proc.stderr and proc.stdout == "", (proc.stdout, proc.stderr)
