"""Shared pieces of the fault suite: the richer target process (host.py), the
transports to run on, resource figures of a process, and range checks.

Everything here talks to real processes; nothing is simulated.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import sys
import time
from pathlib import Path
from typing import Any

import pytest

import mpcomm
from mpcomm.testing import LineProcess, TargetProcess
from mpcomm.testing.patterns import pattern
from mpcomm.wire import PROTOCOL_VERSION

HOST = Path(__file__).with_name("host.py")

# The tcp data request header as plugins/tcp/transport.py reads it today: (field, struct code, a
# valid value: a constant, or a name test_faults_generated.valid_values() fills from a real
# descriptor). Network byte order. The tcp plugin's wire format is being changed: update this
# table (and DATA_MAGIC/OP_*), and every raw data-port client here follows.
DATA_FRAME: list[tuple[str, str, Any]] = [
    ("magic", "2s", b"MD"),
    ("version", "B", PROTOCOL_VERSION),
    ("op", "B", "op"),  # OP_WRITE, OP_READ
    ("flags", "I", 0),
    ("req_id", "Q", 1),
    ("region_id", "Q", "region_id"),
    ("token", "Q", "token"),
    ("epoch", "Q", "epoch"),  # the descriptor's epoch (hex) as an integer
    ("offset", "Q", "offset"),
    ("length", "Q", "length"),
    ("deadline", "d", "deadline"),  # wall-clock seconds (time.time())
]
DATA_HEADER = struct.Struct("!" + "".join(code for _, code, _ in DATA_FRAME))
DATA_MAGIC, OP_WRITE, OP_READ = b"MD", 1, 2


def data_request(remote: mpcomm.RemoteRegion, op: int, offset: int, length: int, deadline: float) -> bytes:
    """A well-formed tcp data request header for ``remote`` (what a holder of the descriptor can send)."""
    values = {"op": op, "region_id": remote.region_id, "token": remote.token, "epoch": int(remote.epoch, 16),
              "offset": offset, "length": length, "deadline": deadline}
    return DATA_HEADER.pack(*(values[w] if isinstance(w, str) else w for _, _, w in DATA_FRAME))
SLACK = 3.0  # seconds beyond deadline + abort grace, on a loaded 2-core machine


class HostProcess(TargetProcess):
    """A target engine in a child process (tests/faults/host.py), driven over stdin/stdout."""

    def __init__(self, transport: str, regions: dict[str, list[Any]], *, config: dict[str, Any] | None = None,
                 endpoint: str = "127.0.0.1:0", prefix: list[str] | None = None, start_timeout: float = 30.0) -> None:
        self.spec = {"transport": transport, "endpoint": endpoint, "config": config or {}, "regions": regions}
        # host.py speaks the kit target's protocol (and more): the line process, not the kit's target program.
        LineProcess.__init__(self, [sys.executable, str(HOST), json.dumps(self.spec)], start_timeout=start_timeout,
                             prefix=prefix or ())
        self.address: str = self.hello["address"]
        self.node_id: str = self.hello["node_id"]
        self.epoch: str = self.hello["epoch"]
        #: What each transport published in the handshake (tcp: {"port": data port}).
        self.transport_info: dict[str, Any] = self.hello.get("transports", {})

    def restart(self) -> HostProcess:
        """A new process on the same endpoint (a new epoch), after this one is gone."""
        self.kill()
        deadline = time.monotonic() + 15
        while True:
            try:
                return HostProcess(self.spec["transport"], self.spec["regions"], config=self.spec["config"],
                                   endpoint=self.address)
            except RuntimeError:  # the port is still held for a moment: try again
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)

    #: The raw answer, ``error Class: message`` included (``cmd`` raises on those).
    reply = LineProcess.request

    def pong(self) -> bool:
        return self.alive and self.cmd("ping", timeout=10) == "pong"


def transports() -> list[Any]:
    """tcp, shm, and ucx where it can run (else a skip that says why)."""
    from mpcomm.registry import load_plugins

    out: list[Any] = []
    installed = load_plugins().transports
    for name in ("tcp", "shm", "ucx"):
        entry = installed.get(name)
        if entry is None:
            why = "no plugin provides it"
        else:
            avail = entry.cls.availability()
            why = "" if avail else avail.reason
        out.append(pytest.param(name, id=name, marks=pytest.mark.skipif(bool(why), reason=f"{name}: {why}")))
    return out


def resources(pid: int) -> dict[str, int]:
    """VmRSS (bytes), threads and open descriptors of process ``pid``."""
    with open(f"/proc/{pid}/status") as f:
        status = dict(line.split(":", 1) for line in f if ":" in line)
    return {"rss": int(status["VmRSS"].split()[0]) * 1024, "threads": int(status["Threads"]),
            "fds": len(os.listdir(f"/proc/{pid}/fd"))}


def back_to_baseline(pid: int, base: dict[str, int], *, rss_slack: int = 64 << 20, count_slack: int = 2,
                     within: float = 15.0) -> dict[str, int]:
    """Wait until threads and fds are within ``count_slack`` of ``base`` and RSS within ``rss_slack``."""
    deadline = time.monotonic() + within
    while True:
        now = resources(pid)
        if (now["threads"] <= base["threads"] + count_slack and now["fds"] <= base["fds"] + count_slack
                and now["rss"] <= base["rss"] + rss_slack):
            return now
        if time.monotonic() > deadline:
            raise AssertionError(f"process {pid} did not return to its baseline within {within}s: {base} -> {now}")
        time.sleep(0.2)


def sha(data: Any) -> str:
    return hashlib.sha256(data).hexdigest()


def background_sha(seed: int, size: int, offset: int, length: int) -> str:
    return sha(pattern(seed, size)[offset : offset + length])


def outside_untouched(t: HostProcess, name: str, seed: int, size: int, spans: list[tuple[int, int]]) -> None:
    """Every byte of region ``name`` outside ``spans`` (offset, length) still holds ``pattern(seed)``."""
    bg = pattern(seed, size)
    pos = 0
    for off, ln in [*sorted(spans), (size, 0)]:
        if off > pos:
            assert t.sha(name, pos, off - pos) == sha(bg[pos:off]), f"{name}: bytes changed in [{pos}, {off})"
        pos = max(pos, off + ln)


def ended_in_time(fut: Any, deadline_s: float, grace: float) -> tuple[bool, BaseException | None, float]:
    """Wait for a Transfer; (ok, error, seconds). A hang shows as a failed assertion, not a stuck test."""
    t0 = time.monotonic()
    try:
        fut.result(deadline_s + grace + SLACK + 30)
        return True, None, time.monotonic() - t0
    except BaseException as exc:  # noqa: BLE001 - examined by the caller
        return False, exc, time.monotonic() - t0
