"""put/get and the local file: what FILE is decides how it is written; a file that changes while read is an error.

Real processes throughout: a ``mpcomm serve`` subprocess, ``mpcomm get``/``put``
subprocesses, a FIFO with a reading process, a character device node, a
second actor that truncates the file ``put`` is reading.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from mpcomm_cli_helpers import Server, start_server

import mpcomm as mpcomm_engine
from mpcomm.cli._common import EXIT_USAGE

PATTERN = bytes(range(256)) * 1024  # 256 KiB, nonzero from its first byte


def mpcomm(*args: Any, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MPCOMM_")}
    return subprocess.run([sys.executable, "-m", "mpcomm.cli", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, env=env, stdin=subprocess.DEVNULL)


@pytest.fixture
def loaded(server: Server, tmp_path: Path) -> Server:
    """The server's ``kv`` holds PATTERN at offset 0."""
    src = tmp_path / "pattern.bin"
    src.write_bytes(PATTERN)
    put = mpcomm("put", src, server.address, "kv")
    assert put.returncode == 0, put.stderr
    return server


def _leftovers(directory: Path) -> list[str]:
    """Hidden files in ``directory``: a temporary file get left behind."""
    return [p.name for p in directory.iterdir() if p.name.startswith(".")]


# -- get: by what FILE is -------------------------------------------------------------


def test_get_into_a_fifo_feeds_its_reader_and_leaves_the_fifo(loaded: Server, tmp_path: Path) -> None:
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    received = tmp_path / "received"
    with open(received, "wb") as sink:
        reader = subprocess.Popen(["cat", str(fifo)], stdout=sink)
    try:
        get = mpcomm("get", loaded.address, "kv", fifo, "--length", len(PATTERN), "--chunk", "64KiB")
        assert get.returncode == 0, get.stderr
        assert reader.wait(timeout=20) == 0  # the old get replaced the FIFO: its reader waited forever
    finally:
        reader.kill()
        reader.wait()
    assert received.read_bytes() == PATTERN
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)
    assert _leftovers(tmp_path) == []


def test_get_into_a_fifo_whose_reader_leaves_is_exit_2(loaded: Server, tmp_path: Path) -> None:
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    reader = subprocess.Popen(["head", "-c", "100", str(fifo)], stdout=subprocess.DEVNULL)
    try:
        get = mpcomm("get", loaded.address, "kv", fifo, "--chunk", "4KiB", "--inflight", "1")
        assert reader.wait(timeout=20) == 0
    finally:
        reader.kill()
        reader.wait()
    assert get.returncode == EXIT_USAGE and f"{fifo}: write failed after" in get.stderr, get.stderr
    assert get.stdout == "" and "Traceback" not in get.stderr
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)


@pytest.mark.skipif(os.geteuid() != 0, reason="mknod of a character device needs root")
def test_get_into_a_character_device_writes_in_place(loaded: Server, tmp_path: Path) -> None:
    # Our own null device (same major/minor as /dev/null) in a temporary directory: the
    # machine's /dev/null is never a target here, whatever get does.
    dev = tmp_path / "null"
    os.mknod(dev, 0o666 | stat.S_IFCHR, os.makedev(1, 3))
    before = os.lstat(dev)
    system_null = os.lstat("/dev/null")
    get = mpcomm("get", loaded.address, "kv", dev, "--length", "100000", "--verify")
    assert get.returncode == 0, get.stderr
    after = os.lstat(dev)
    assert stat.S_ISCHR(after.st_mode) and after.st_rdev == before.st_rdev and after.st_ino == before.st_ino
    assert _leftovers(tmp_path) == []
    # Read-only check: the system's /dev/null is still the character device it was.
    now = os.lstat("/dev/null")
    assert stat.S_ISCHR(now.st_mode) and (now.st_ino, now.st_rdev) == (system_null.st_ino, system_null.st_rdev)


def test_get_into_a_directory_or_a_socket_is_a_usage_error(loaded: Server, tmp_path: Path) -> None:
    target = tmp_path / "dir"
    target.mkdir()
    get = mpcomm("get", loaded.address, "kv", target, "--length", "10")
    assert get.returncode == EXIT_USAGE and "is a directory" in get.stderr
    assert list(target.iterdir()) == [] and _leftovers(tmp_path) == []
    with socket.socket(socket.AF_UNIX) as listening:  # neither a file nor a FIFO nor a device: refused too
        listening.bind(str(tmp_path / "sock"))
        get = mpcomm("get", loaded.address, "kv", tmp_path / "sock", "--length", "10")
    assert get.returncode == EXIT_USAGE and "not a regular file, FIFO or device" in get.stderr
    assert stat.S_ISSOCK(os.lstat(tmp_path / "sock").st_mode)


def test_get_with_a_255_character_file_name(loaded: Server, tmp_path: Path) -> None:
    name = tmp_path / ("n" * 255)  # NAME_MAX: a temporary name built from it would not fit
    for _ in range(2):  # a new file, then replacing it
        get = mpcomm("get", loaded.address, "kv", name, "--length", len(PATTERN))
        assert get.returncode == 0, get.stderr
        assert name.read_bytes() == PATTERN
    assert _leftovers(tmp_path) == []


def test_get_replaces_a_regular_file_by_rename_and_keeps_a_symlink(loaded: Server, tmp_path: Path) -> None:
    out = tmp_path / "out.bin"
    out.write_bytes(b"old")
    os.chmod(out, 0o640)
    inode = os.stat(out).st_ino
    reader = open(out, "rb")  # an open reader keeps the old bytes: the file was replaced, not rewritten
    try:
        get = mpcomm("get", loaded.address, "kv", out, "--length", 1000)
        assert get.returncode == 0, get.stderr
        assert reader.read() == b"old"
    finally:
        reader.close()
    assert out.read_bytes() == PATTERN[:1000] and os.stat(out).st_ino != inode
    assert stat.S_IMODE(os.stat(out).st_mode) == 0o640
    link = tmp_path / "link.bin"
    link.symlink_to(out)
    get = mpcomm("get", loaded.address, "kv", link, "--length", 2000)
    assert get.returncode == 0, get.stderr
    assert link.is_symlink() and out.read_bytes() == PATTERN[:2000]
    assert _leftovers(tmp_path) == []


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None, reason="needs root and unshare(1)")
def test_get_onto_a_full_file_system_is_a_clear_error(loaded: Server, tmp_path: Path) -> None:
    """The temporary file is mapped: its blocks are reserved first, so a full disk is exit 2 naming it (before:
    the copy into the unbacked page failed, a SIGBUS or, over tcp, an error blamed on the peer, exit 3)."""
    small = tmp_path / "small"
    small.mkdir()
    script = (f"mount -t tmpfs -o size=256k none {small} && echo old > {small}/out.bin && "
              f"{sys.executable} -m mpcomm.cli get {loaded.address} kv {small}/out.bin; echo \"rc=$?\"; "
              f"cat {small}/out.bin; ls -a {small}")
    proc = subprocess.run(["unshare", "-m", "sh", "-c", script], capture_output=True, text=True, timeout=120,
                          env={k: v for k, v in os.environ.items() if not k.startswith("MPCOMM_")})
    lines = proc.stdout.split()
    assert f"rc={EXIT_USAGE}" in lines, (proc.stdout, proc.stderr)  # a 1 MiB region onto 256 KiB
    assert "No space left on device" in proc.stderr and "Traceback" not in proc.stderr
    assert lines[lines.index(f"rc={EXIT_USAGE}") + 1] == "old"  # the file is as it was
    assert not any(name.startswith(".mpcomm-") for name in lines)  # and no temporary file is left


# -- put: a file that changes while it is read -------------------------------------------


def _put_and_change(tmp_path: Path, change: Any, transport: str = "tcp") -> tuple[subprocess.CompletedProcess[str], Path]:
    """Start a slow put (64 KiB requests, one in flight) of a 64 MiB file; once its first bytes reached the
    region (read through an engine of this test), stop put, ``change(path)``, and let it go on."""
    size = 64 << 20
    src = tmp_path / "src.bin"
    with open(src, "wb") as f:
        f.write(PATTERN * (size // len(PATTERN)))
    srv = start_server("--region", "kv=64MiB", "-t", "shm")
    try:
        env = {k: v for k, v in os.environ.items() if not k.startswith("MPCOMM_")}
        proc = subprocess.Popen([sys.executable, "-m", "mpcomm.cli", "put", str(src), srv.address, "kv",
                                 "--chunk", "64KiB", "--inflight", "1", "-t", transport, "--json"],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        try:
            with mpcomm_engine.Engine(endpoint="127.0.0.1:0", transports=["tcp"]) as watcher:
                remote = watcher.open(srv.address, "kv")
                probe = watcher.allocate(16)

                def remote_bytes(at: int) -> bytes:
                    watcher.read(probe, remote, at, 16).result(timeout=30)
                    return bytes(probe.view)

                deadline = time.monotonic() + 60
                while remote_bytes(0) != PATTERN[:16]:
                    assert proc.poll() is None, proc.communicate()
                    assert time.monotonic() < deadline, "put never started writing"
                proc.send_signal(signal.SIGSTOP)
                try:
                    assert remote_bytes(size - 16) == bytes(16), "put finished before it could be stopped"
                    change(src)
                finally:
                    proc.send_signal(signal.SIGCONT)
            out, err = proc.communicate(timeout=120)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    finally:
        srv.stop()
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err), src


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_put_of_a_file_truncated_while_read_is_exit_2(tmp_path: Path, transport: str) -> None:
    proc, src = _put_and_change(tmp_path, lambda p: os.truncate(p, 0), transport)
    # Before: put mapped the file; the pages past the new end killed it with SIGBUS where it
    # copied them itself (shm into the target's memory), and failed the connection (exit 3)
    # where the kernel did (tcp's send).
    assert proc.returncode == EXIT_USAGE, (proc.returncode, proc.stderr)
    assert f"{src} changed while it was read" in proc.stderr
    assert proc.stdout == ""  # no summary: nothing partial reported as done
    assert "Traceback" not in proc.stderr


def test_put_of_a_file_rewritten_while_read_is_exit_2(tmp_path: Path) -> None:
    def rewrite_tail(p: Path) -> None:  # same size, other bytes: only the mtime tells
        time.sleep(0.01)
        with open(p, "r+b") as f:
            f.seek(-1, os.SEEK_END)
            f.write(b"\xff")

    proc, src = _put_and_change(tmp_path, rewrite_tail)
    assert proc.returncode == EXIT_USAGE, (proc.returncode, proc.stderr)
    assert f"{src} changed while it was read" in proc.stderr and proc.stdout == ""
