"""Helpers for the tcp tests: target engines in real processes and raw data-port clients.

The target is the conformance kit's target process (``python -m mpcomm.testing.target``)
restricted to tcp; raw clients speak the data protocol (``mpcomm.plugins.tcp.wire``) over
real loopback sockets, the way a hostile or broken peer would.
"""

from __future__ import annotations

import json
import os
import socket
import time
from typing import Any

import psutil
import pytest

import mpcomm
from mpcomm.auth import client_authenticate
from mpcomm.control import PeerLink
from mpcomm.peer import PeerInfo, parse_endpoint
from mpcomm.plugins.tcp import busypoll, wire
from mpcomm.testing import TargetProcess


class Target(TargetProcess):
    """A target engine on tcp in a child process (default: one 1 MiB buffer "kv"), with the data port's
    published info at hand."""

    def __init__(self, regions: dict[str, list[Any]] | None = None, *, config: dict[str, Any] | None = None,
                 secret: str = "") -> None:
        regions = regions or {"kv": [1 << 20, "buffer"]}
        cfg = dict(config or {})
        if secret:
            cfg.setdefault("transport", {})["secret"] = secret
        super().__init__("tcp", config=cfg, regions=regions)
        self.secret = secret or cfg.get("transport", {}).get("secret", "")
        self.config = mpcomm.Config.from_dict(cfg) if cfg else None
        info = self.peer_info()
        self.epoch: str = info.epoch
        self.tcp: dict[str, Any] = info.transports["tcp"]
        self.host = parse_endpoint(self.address)[0]
        self.port = int(self.tcp["port"])
        self.ps = psutil.Process(self.pid)

    def peer_info(self) -> PeerInfo:
        probe = PeerInfo(node_id="probe", epoch="00", address="127.0.0.1:1")
        link = PeerLink(self.address, local_info=probe, secret=self.secret, timeout=5, on_lost=lambda _l: None,
                        config=self.config)
        try:
            return link.info
        finally:
            link.close()

    def raw(self, *, secret: str | None = None, source: str | None = None, hello: bool = True,
            timeout: float = 5, node: str = "raw-client") -> socket.socket:
        """A data connection, HELLO sent (as node id ``node``) and authenticated unless told otherwise."""
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        if source:
            s.bind((source, 0))
        s.settimeout(timeout)
        s.connect((self.host, self.port))
        if hello:
            ident = wire.ident(node)
            s.sendall(wire.HELLO.pack(wire.HELLO_MAGIC, wire.VERSION, 0, ident, wire.ident(self.epoch)))
            client_authenticate(s, self.secret if secret is None else secret, time.monotonic() + timeout,
                                wire.context(ident, wire.ident(self.epoch)))
            s.settimeout(timeout)
        return s

    def stop(self) -> None:
        """SIGSTOP, and wait until the kernel says it is stopped (delivery is not instant under load)."""
        super().stop()
        end = time.monotonic() + 5
        while self.ps.status() != psutil.STATUS_STOPPED and time.monotonic() < end:
            time.sleep(0.002)

    def threads(self) -> int:
        return self.ps.num_threads()

    def rss(self) -> int:
        return self.ps.memory_info().rss

    def fds(self) -> int:
        return self.ps.num_fds()

    def try_unregister(self, name: str) -> bool:
        try:
            self.cmd(f"unregister {name}")
            return True
        except RuntimeError as exc:
            if "RegionBusy" in str(exc):
                return False
            raise


def raw_to(engine: mpcomm.Engine, node: str = "raw-client") -> socket.socket:
    """A data connection to an engine of this process's tcp port, HELLO sent as ``node`` and
    authenticated (no secret): :meth:`Target.raw` for an in-process engine."""
    port = engine.info().transports["tcp"]["port"]
    s = socket.create_connection(("127.0.0.1", port), timeout=5)
    ident, epoch = wire.ident(node), wire.ident(engine.epoch)
    s.sendall(wire.HELLO.pack(wire.HELLO_MAGIC, wire.VERSION, 0, ident, epoch))
    client_authenticate(s, "", time.monotonic() + 5, wire.context(ident, epoch))
    s.settimeout(5)
    return s


def req(op: int = wire.OP_READ, *, remote: mpcomm.RemoteRegion | None = None, region_id: int = 0, token: int = 0,
        epoch: int = 0, offset: int = 0, length: int = 0, deadline: float | None = None, count: int = 0,
        req_id: int = 1, magic: bytes = wire.REQ_MAGIC) -> bytes:
    if remote is not None:
        region_id, token, epoch = remote.region_id, remote.token, int(remote.epoch, 16)
    return wire.REQ.pack(magic, op, 0, count, req_id, region_id, token, epoch, offset, length,
                         time.time() + 10 if deadline is None else deadline)


def recv_exact(s: socket.socket, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        chunk = s.recv(n - len(out))
        if not chunk:
            raise ConnectionError(f"closed after {len(out)} of {n} bytes")
        out += chunk
    return bytes(out)


def reply(s: socket.socket) -> tuple[int, int, int, bytes]:
    """(status, req_id, count, body) of one reply (body: error JSON or read payload)."""
    magic, status, _f, count, rid, length = wire.RESP.unpack(recv_exact(s, wire.RESP.size))
    assert magic == wire.RESP_MAGIC
    return status, rid, count, recv_exact(s, length)


def error_code(body: bytes) -> str:
    return str(json.loads(body)["code"])


def closed(s: socket.socket, timeout: float = 5.0) -> bool:
    """True when the peer closes (EOF or reset) within ``timeout``; what it sends first is ignored."""
    s.settimeout(timeout)
    end = time.monotonic() + timeout
    try:
        while time.monotonic() < end:
            if not s.recv(65536):
                return True
    except (ConnectionResetError, BrokenPipeError):
        return True
    except TimeoutError:
        return False
    return False


def count_closed(socks: list[socket.socket], expect: int, within: float = 2.0, settle: float = 0.3) -> int:
    """How many of ``socks`` the peer closed: waits up to ``within`` for ``expect`` of them, then
    ``settle`` more to see that no other one follows (a loaded machine accepts late; a fixed
    per-socket timeout made the count flaky). Keep ``within`` below the peer's handshake timeout."""
    gone: set[int] = set()
    end = time.monotonic() + within
    extra: float | None = None
    while True:
        for i, s in enumerate(socks):
            if i not in gone and closed(s, timeout=0.01):
                gone.add(i)
        now = time.monotonic()
        if extra is None and (len(gone) >= expect or now >= end):
            extra = now + settle
        if extra is not None and now >= extra:
            return len(gone)


def wait_for(pred: Any, timeout: float, step: float = 0.02) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(step)
    return bool(pred())


def pattern_bytes(n: int, seed: int = 0) -> bytes:
    return (os.urandom(16) * (n // 16 + 1))[:n] if seed < 0 else bytes((i * 7 + seed) & 0xFF for i in range(n))


@pytest.fixture(autouse=True, params=["native-waits", "python-waits"])
def both_waits(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Bind as ``_waits = both_waits`` in a test module: every test there runs twice, with busypoll's
    one-call waits and with their Python twins (in this process and in the targets it starts)."""
    if request.param == "python-waits":
        monkeypatch.setenv("MPCOMM_TCP_NATIVE_WAITS", "0")
        monkeypatch.setattr(busypoll, "next_request", None)
        monkeypatch.setattr(busypoll, "next_reply", None)
    elif busypoll.load() is None or busypoll.next_reply is None:
        pytest.skip(f"busy-poll helper without its extension module: {busypoll.reason}")
