"""Replies read by the ``result()`` caller (Transport.drive), and the reader thread that takes over.

Every test runs real engines over loopback: the target in a child process where
only the initiator's behaviour matters, in this process where the test must
reach the target's own sockets (to close one, or to send bytes nobody asked for).
"""

from __future__ import annotations

import hashlib
import logging
import os
import socket
import threading
import time
from typing import Any

import pytest
from tcp_support import both_waits  # noqa: F401 - autouse: every test here runs with the one-call waits and without
from tcp_support import wait_for

import mpcomm
from mpcomm.errors import ProtocolError
from mpcomm.plugins.tcp import busypoll, client, wire
from mpcomm.plugins.tcp.server import Server
from mpcomm.plugins.tcp.transport import TcpTransport



def _conns(engine: mpcomm.Engine) -> list[Any]:
    return [c for p in engine.transports["tcp"]._pools.values() for c in p._conns]


def test_a_caller_waiting_in_result_reads_its_own_reply(spawn: Any, make_engine: Any) -> None:
    target = spawn()
    ini = make_engine()
    remote = ini.open(target.address, "kv")
    src = ini.allocate(1 << 16)
    dst = ini.allocate(1 << 16)
    for i in range(50):
        src.view[:4096] = bytes([i]) * 4096
        assert ini.write(src, remote, 4096 * (i % 8), 4096).result(10) == 4096
        assert target.cmd(f"sha kv {4096 * (i % 8)} 4096") == hashlib.sha256(bytes([i]) * 4096).hexdigest()
        assert ini.read(dst, remote, 4096 * (i % 8), 4096).result(10) == 4096
        assert bytes(dst.view[:4096]) == bytes([i]) * 4096
    # The first request goes out before its connection is up, so a few replies are the
    # reader's; the rest were read on this thread.
    assert sum(c.driven for c in _conns(ini)) >= 90


def test_requests_nobody_waits_on_are_read_after_a_driver_left(spawn: Any, make_engine: Any) -> None:
    """A connection whose last replies a driver read still serves callback-only users."""
    target = spawn()
    ini = make_engine({"plugins": {"tcp": {"connections": 1}}})
    remote = ini.open(target.address, "kv")
    ini.write(b"a" * 4096, remote, 0).result(10)
    (conn,) = _conns(ini)
    for _ in range(50):  # the first replies may be the reader's (it reads until a driver came)
        if conn.sticky:
            break
        ini.write(b"a" * 4096, remote, 0).result(10)
    assert conn.sticky  # a driver read the last reply
    done = threading.Event()
    seen: list[Any] = []

    def cb(t: Any) -> None:
        seen.append(t.exception(0))
        if len(seen) == 20:
            done.set()

    for i in range(20):
        ini.write(bytes([i]) * 4096, remote, 4096 * i).add_done_callback(cb)
    assert done.wait(10), f"only {len(seen)} of 20 callbacks ran"
    assert seen == [None] * 20
    assert target.cmd(f"sha kv {4096 * 19} 4096") == hashlib.sha256(bytes([19]) * 4096).hexdigest()
    # Nobody waited on them: the reader took the connection back.
    assert not conn.sticky


def test_many_threads_waiting_on_one_connection(spawn: Any, make_engine: Any) -> None:
    """Drivers, callers that find a driver at work, and the reader share one stream of replies."""
    target = spawn({"kv": [8 << 20, "allocate"]})
    ini = make_engine({"plugins": {"tcp": {"connections": 1}}})
    remote = ini.open(target.address, "kv")
    errors: list[str] = []

    def worker(k: int) -> None:
        src, dst = ini.allocate(1 << 20), ini.allocate(1 << 20)
        base = k * (1 << 20)
        for i in range(150):
            n = (4096, 65536, 300_000)[i % 3]  # the last is larger than what a driver takes whole
            src.view[:n] = os.urandom(n)
            try:
                ini.write(src, remote, base, n).result(20)
                ini.read(dst, remote, base, n).result(20)
            except mpcomm.MpcommError as exc:
                errors.append(repr(exc))
                return
            if dst.view[:n] != src.view[:n]:
                errors.append(f"thread {k}: {n} bytes read back differ")
                return

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    assert sum(c.driven for c in _conns(ini)) > 0


def _target_sockets(engine: mpcomm.Engine) -> list[socket.socket]:
    acc = engine.transports["tcp"]._accept
    with acc._lock:
        return list(acc._open)


def _one_used_connection(make_engine: Any) -> tuple[Any, Any, Any, Any, Any]:
    """A target with region "kv", an initiator limited to one connection that has carried one write."""
    tgt = make_engine()
    region = tgt.allocate(1 << 20, name="kv")
    ini = make_engine({"plugins": {"tcp": {"connections": 1}}})
    remote = ini.open(tgt.address, "kv")
    ini.write(b"a" * 4096, remote, 0).result(10)
    (old,) = _conns(ini)
    return tgt, region, ini, remote, old


def test_a_connection_the_target_closed_while_idle_is_not_reused(make_engine: Any) -> None:
    """Nobody reads an idle connection; the next request checks it first and dials anew."""
    tgt, region, ini, remote, old = _one_used_connection(make_engine)
    for s in _target_sockets(tgt):
        s.shutdown(socket.SHUT_RDWR)  # the target ends it, as its idle timeout or a restart would
    assert wait_for(lambda: not _target_sockets(tgt), 5)
    assert ini.write(b"b" * 4096, remote, 0).result(10) == 4096
    assert bytes(region.view[:4096]) == b"b" * 4096
    assert old.broken and old not in _conns(ini)


def test_bytes_nobody_asked_for_close_an_idle_connection_not_the_next_request(
        make_engine: Any, caplog: pytest.LogCaptureFixture) -> None:
    tgt, region, ini, remote, old = _one_used_connection(make_engine)
    (s,) = _target_sockets(tgt)
    s.sendall(wire.RESP.pack(wire.RESP_MAGIC, wire.ST_OK, 0, 0, 12345, 0))  # a reply to nothing
    time.sleep(0.05)
    with caplog.at_level(logging.WARNING, logger="mpcomm.transport.tcp"):
        assert ini.write(b"c" * 4096, remote, 0).result(10) == 4096
    assert bytes(region.view[:4096]) == b"c" * 4096
    assert old.broken
    assert any("nobody asked for" in r.getMessage() or "not awaiting" in r.getMessage() for r in caplog.records)


class _LyingServer(Server):
    """Takes a write, then answers it OK with a body no write reply has (a hostile or broken target)."""

    def _write(self, sock: socket.socket, req_id: int, region_id: int, token: int, epoch: str, offset: int,
               length: int, end: float) -> None:
        self._drain(sock, length, end)
        sock.sendall(wire.RESP.pack(wire.RESP_MAGIC, wire.ST_OK, 0, 0, req_id, 100) + b"x" * 100)


class _GarbageServer(Server):
    def _write(self, sock: socket.socket, req_id: int, region_id: int, token: int, epoch: str, offset: int,
               length: int, end: float) -> None:
        self._drain(sock, length, end)
        sock.sendall(b"XX" + bytes(wire.RESP.size - 2))


@pytest.mark.parametrize("server", [_LyingServer, _GarbageServer], ids=["bad-length", "bad-magic"])
def test_a_malformed_reply_fails_its_request_at_once_and_only_its_connection(
        make_engine: Any, monkeypatch: pytest.MonkeyPatch, server: type[Server]) -> None:
    monkeypatch.setattr(TcpTransport, "server_class", server)
    tgt = make_engine()
    monkeypatch.undo()
    tgt.allocate(1 << 20, name="kv")
    ini = make_engine({"plugins": {"tcp": {"connections": 1}}})
    remote = ini.open(tgt.address, "kv")
    for _ in range(3):  # each on a fresh connection; the engine stays usable
        t0 = time.monotonic()
        with pytest.raises(ProtocolError):
            ini.write(b"a" * 4096, remote, 0, timeout=30).result(30)
        assert time.monotonic() - t0 < 10  # an error, not the request's 30 s deadline
    assert not [c for c in _conns(ini) if not c.broken]  # each connection that carried a lie is gone


def _voluntary_switches(native_id: int) -> int:
    with open(f"/proc/self/task/{native_id}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("voluntary_ctxt_switches"))


def _reader_wakeups_per_request(make_engine: Any, address: str) -> float:
    """A fresh initiator's reader: its wake-ups per request over 1 s of driven back-to-back writes."""
    readers = {t for t in threading.enumerate() if t.name.startswith("mpcomm-tcp-r-")}
    ini = make_engine({"plugins": {"tcp": {"connections": 1}}})
    remote = ini.open(address, "kv")
    src = ini.allocate(4096)
    for _ in range(200):
        ini.write(src, remote, 0, 4096).result(10)
    (reader,) = [t for t in threading.enumerate() if t.name.startswith("mpcomm-tcp-r-") and t not in readers]
    assert reader.native_id is not None
    before, t0 = _voluntary_switches(reader.native_id), time.monotonic()
    n = 0
    while time.monotonic() - t0 < 1.0:
        ini.write(src, remote, 0, 4096).result(10)
        n += 1
    woke = _voluntary_switches(reader.native_id) - before
    assert sum(c.driven for c in _conns(ini)) >= n - 10  # they were driven
    ini.close()
    return woke / n


def test_the_reader_of_a_connection_whose_replies_are_driven_rarely_wakes(spawn: Any, make_engine: Any,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Back-to-back requests waited on with result(): the connection's reader thread looks at it
    now and then (at most every LOOK_MAX, 20 ms, once the looks find drivers at work), not every
    1 ms: each of its wake-ups takes a CPU from the driver or the target on a small machine (the
    p99 tail). The control, in the same run, is a reader that looks every HANDOFF (1 ms), as
    before; a loaded machine inflates both (a preempted driver leaves replies to the reader), so
    the best of three rounds is compared."""
    if busypoll.load() is None or busypoll.await_reply is None:
        pytest.skip("the reader waits on its condition (no compiled await_reply)")
    target = spawn()
    rounds = []
    look_max = client.LOOK_MAX
    for _ in range(3):
        rarely = _reader_wakeups_per_request(make_engine, target.address)
        monkeypatch.setattr(client, "LOOK_MAX", client.HANDOFF)
        every_ms = _reader_wakeups_per_request(make_engine, target.address)
        monkeypatch.setattr(client, "LOOK_MAX", look_max)
        rounds.append((rarely, every_ms))
        print(f"reader wake-ups per request: {rarely:.4f} (LOOK_MAX) vs {every_ms:.4f} (every 1 ms)")
        if rarely <= 0.4 * every_ms:
            return
    pytest.fail(f"the reader woke as often as one that looks every 1 ms (per request, rarely/every 1 ms): {rounds}")


def test_a_driver_that_leaves_requests_pending_hands_them_to_the_reader_at_once(spawn: Any,
                                                                              make_engine: Any) -> None:
    """After a stretch of driven requests the reader looks only every 20 ms; a driver that leaves with
    another request pending (nobody waits on it) rings the reader, which reads its reply at once."""
    if busypoll.load() is None or busypoll.await_reply is None:
        pytest.skip("the reader waits on its condition (no compiled await_reply)")
    target = spawn()
    ini = make_engine({"plugins": {"tcp": {"connections": 1}}})
    remote = ini.open(target.address, "kv")
    src = ini.allocate(8192)
    lags: list[float] = []
    for _ in range(15):
        t0 = time.monotonic()
        while time.monotonic() - t0 < 0.06:  # driven: the reader's looks grow apart
            ini.write(src, remote, 0, 4096).result(10)
        done = threading.Event()
        first = ini.write(src, remote, 0, 4096)
        second = ini.write(src, remote, 4096, 4096, local_offset=4096)  # nobody waits on it
        second.add_done_callback(lambda _t: done.set())
        first.result(10)  # its driver leaves with the second one pending
        left = time.monotonic()
        assert done.wait(10)
        lags.append(time.monotonic() - left)
    lags.sort()
    assert lags[len(lags) // 2] < 0.005, f"replies left to the reader waited {lags}"


def test_a_callback_after_driven_requests_is_answered_as_promptly_as_before_them(
        spawn: Any, make_engine: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A callback-only request after a stretch of driven ones: adding its callback hands the connection
    to the reader (Transport.undriven, rung through its bell), so its reply is not left for the
    reader's next look, up to LOOK_MAX later (docs/tcp.md, "Paths"). Compared with a callback-only
    write on the same fresh connection before any driven one, median of five engines; LOOK_MAX is
    made 100 ms so a reply left to the next look shows whatever the machine's load."""
    monkeypatch.setattr(client, "LOOK_MAX", 0.1)
    target = spawn()

    def callback_lag(ini: mpcomm.Engine, remote: Any, src: Any) -> float:
        done = threading.Event()
        t0 = time.monotonic()
        ini.write(src, remote, 0, 4096).add_done_callback(lambda _t: done.set())
        assert done.wait(10)
        return time.monotonic() - t0

    before, after = [], []
    for _ in range(5):
        ini = make_engine({"plugins": {"tcp": {"connections": 1}}})
        remote = ini.open(target.address, "kv")
        src = ini.allocate(8192)
        callback_lag(ini, remote, src)  # the connection is dialled
        before.append(callback_lag(ini, remote, src))
        t0 = time.monotonic()
        while time.monotonic() - t0 < 0.3:  # driven: the reader's looks grow LOOK_MAX apart
            ini.write(src, remote, 4096, 4096, local_offset=4096).result(10)
        after.append(callback_lag(ini, remote, src))
        ini.close()
    before.sort()
    after.sort()
    base = before[2]
    print(f"callback-only reply, median of 5: {base * 1e3:.2f} ms before driven requests, {after[2] * 1e3:.2f} after")
    assert after[2] <= 4 * base + 5 * client.HANDOFF, (
        f"callback-only replies after driven requests waited {after}, before them {before} (s)")
