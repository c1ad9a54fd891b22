"""What a hostile or broken peer can make the tcp target hold: bounded, with deadlines (target in a child process)."""

from __future__ import annotations

import hashlib
import resource
import socket
import time
from typing import Any

import pytest
from tcp_support import both_waits  # noqa: F401 - autouse: every test here runs with the one-call waits and without
from tcp_support import closed, count_closed, error_code, reply, req, wait_for

import mpcomm
from mpcomm.plugins.tcp import wire



def assert_serves(target: Any, make_engine: Any, seed: int = 1) -> None:
    ini = make_engine()
    remote = ini.open(target.address, "kv", timeout=5)
    data = bytes([seed]) * 4096
    ini.write(data, remote, 64).result(5)
    assert target.cmd(f"sha kv 64 4096") == hashlib.sha256(data).hexdigest()
    ini.close()


@pytest.mark.parametrize(("key", "value"), [("connections", 0), ("chunk", -1), ("max_connections", 0),
                                            ("idle_timeout_ms", 5), ("stripe_threshold", 1), ("max_batch", 0)])
def test_out_of_range_options_are_refused_by_name(key: str, value: int) -> None:
    with pytest.raises(mpcomm.ConfigError) as info:
        mpcomm.Engine({"plugins": {"tcp": {key: value}}}, transports=["tcp"])
    assert f"plugins.tcp.{key}" in str(info.value)


def test_idle_connections_cost_no_buffer_and_are_closed(spawn: Any, make_engine: Any) -> None:
    target = spawn(config={"plugins": {"tcp": {"idle_timeout_ms": 1500}}})
    rss0, threads0 = target.rss(), target.threads()
    socks = [target.raw() for _ in range(60)]
    assert wait_for(lambda: target.threads() >= threads0 + 55, 5)
    grown = target.rss() - rss0
    assert grown < 24 << 20, f"60 idle connections cost {grown >> 20} MiB"  # no scratch buffer per connection
    assert all(closed(s, timeout=6) for s in socks)  # the idle timeout closes them
    assert wait_for(lambda: target.threads() <= threads0 + 2, 5)
    for s in socks:
        s.close()
    assert_serves(target, make_engine)


def test_connection_limits_per_peer_and_in_total(spawn: Any, make_engine: Any) -> None:
    target = spawn(config={"plugins": {"tcp": {"max_connections_per_peer": 5, "max_connections": 14}}})
    flood = [target.raw(source="127.0.0.2", hello=False) for _ in range(9)]
    assert count_closed(flood, 4) == 4  # five kept from 127.0.0.2, the rest closed at once
    assert_serves(target, make_engine)  # another peer host is still served
    more = [target.raw(source="127.0.0.3", hello=False) for _ in range(5)]
    more += [target.raw(source="127.0.0.4", hello=False) for _ in range(5)]
    assert count_closed(more, 1) == 1  # 14 in total
    for s in [*flood, *more]:
        s.close()
    assert_serves(target, make_engine)


def test_running_out_of_descriptors_does_not_kill_the_accept_loop(spawn: Any, make_engine: Any) -> None:
    target = spawn()
    ini = make_engine()
    remote = ini.open(target.address, "kv")
    ini.write(b"a" * 4096, remote, 0).result(5)  # the engine's own data connection is up
    soft, hard = resource.prlimit(target.pid, resource.RLIMIT_NOFILE)
    resource.prlimit(target.pid, resource.RLIMIT_NOFILE, (target.fds() + 2, hard))
    socks: list[socket.socket] = []
    try:
        for _ in range(12):
            try:
                socks.append(target.raw(hello=False, timeout=1))
            except OSError:
                break
        cpu0 = sum(target.ps.cpu_times()[:2])
        time.sleep(1.0)
        spent = sum(target.ps.cpu_times()[:2]) - cpu0
        assert spent < 0.5, f"the accept loop spun: {spent:.2f} s of CPU in 1 s"
        assert target.proc.poll() is None
    finally:
        resource.prlimit(target.pid, resource.RLIMIT_NOFILE, (soft, hard))
    for s in socks:
        s.close()
    # Descriptors are back: new connections are accepted and served again.
    ini.write(b"b" * 4096, remote, 0).result(5)
    raw = target.raw()
    raw.sendall(req(remote=remote, offset=0, length=4096))
    status, _rid, _n, body = reply(raw)
    assert status == wire.ST_OK and body == b"b" * 4096
    raw.close()
    assert_serves(target, make_engine)


@pytest.mark.parametrize("deadline", [float("nan"), float("inf"), float("-inf"), -1.0, 0.0])
def test_a_non_finite_or_negative_deadline_is_rejected(spawn: Any, make_engine: Any, deadline: float) -> None:
    target = spawn()
    ini = make_engine()
    remote = ini.open(target.address, "kv")
    target.cmd("fill kv 3")
    before = target.cmd(f"sha kv 0 {1 << 20}")
    s = target.raw()
    s.sendall(req(wire.OP_WRITE, remote=remote, length=8, deadline=deadline) + b"\xee" * 8)
    assert closed(s)
    assert target.cmd(f"sha kv 0 {1 << 20}") == before
    assert_serves(target, make_engine)


GARBAGE = {
    "random": bytes(range(256)) * 2,
    "wrong magic": req(magic=b"ZZ"),
    "unknown op": req(op=9),
    "batch of zero": req(op=wire.OP_READV, count=0),
    "batch over max_batch": req(op=wire.OP_READV, count=1 << 20),
    "truncated header": req()[:17],
}


@pytest.mark.parametrize("what", sorted(GARBAGE))
def test_garbage_closes_that_connection_only(spawn: Any, make_engine: Any, what: str) -> None:
    target = spawn()
    ini = make_engine()
    remote = ini.open(target.address, "kv")
    good = target.raw()
    bad = target.raw()
    bad.sendall(GARBAGE[what])
    if what == "truncated header":
        bad.shutdown(socket.SHUT_WR)
    assert closed(bad)
    good.sendall(req(remote=remote, length=16))
    status, _rid, _n, body = reply(good)
    assert status == wire.ST_OK and len(body) == 16
    assert target.proc.poll() is None
    assert_serves(target, make_engine)


def test_refusals_keep_the_connection_usable_and_touch_nothing(spawn: Any, make_engine: Any) -> None:
    target = spawn()
    ini = make_engine()
    remote = ini.open(target.address, "kv")
    target.cmd("fill kv 7")
    before = target.cmd(f"sha kv 0 {remote.size}")
    e = int(remote.epoch, 16)
    cases = {
        "unknown region": req(region_id=999_999, token=remote.token, epoch=e, length=8),
        "wrong token": req(region_id=remote.region_id, token=remote.token ^ 1, epoch=e, length=8),
        "stale epoch": req(region_id=remote.region_id, token=remote.token, epoch=e ^ 1, length=8),
        "oversized read": req(remote=remote, length=1 << 60),
        "past the end": req(remote=remote, offset=remote.size - 4, length=8),
        "expired": req(remote=remote, length=8, deadline=1.0),
        "refused write": req(wire.OP_WRITE, remote=remote, offset=remote.size - 4, length=8) + b"\xaa" * 8,
    }
    s = target.raw()
    for i, (what, frame) in enumerate(cases.items()):
        s.sendall(frame[:8] + (100 + i).to_bytes(8, "big") + frame[16:])
        status, rid, _n, body = reply(s)
        assert (status, rid) == (wire.ST_ERR, 100 + i), what
        assert error_code(body) in ("unknown_region", "permission_denied", "stale_region", "out_of_bounds",
                                    "timeout"), what
    assert target.cmd(f"sha kv 0 {remote.size}") == before
    assert_serves(target, make_engine)


def test_a_stalled_reader_cannot_hold_the_lease_past_the_deadline(spawn: Any, make_engine: Any) -> None:
    target = spawn({"kv": [64 << 20, "buffer"]}, config={"runtime": {"abort_grace_ms": 500}})
    ini = make_engine()
    remote = ini.open(target.address, "kv")
    s = target.raw()
    s.sendall(req(remote=remote, length=64 << 20, deadline=time.time() + 1.0))  # then read nothing for a while
    time.sleep(1.0 + 0.5 + 0.5)  # past the deadline and the grace
    got = 0
    s.settimeout(2)
    try:
        while chunk := s.recv(1 << 20):  # what the socket buffers held, then the target's close
            got += len(chunk)
    except ConnectionResetError:
        pass  # the target cut the frame with a reset
    assert got < 32 << 20, "the target went on sending past the request's deadline"
    assert target.try_unregister("kv")  # the lease was released (before the connection was closed)
    s.close()


def test_a_stalled_writer_cannot_hold_the_lease_past_the_deadline(spawn: Any, make_engine: Any) -> None:
    target = spawn({"kv": [4 << 20, "buffer"]}, config={"runtime": {"abort_grace_ms": 500}})
    ini = make_engine()
    remote = ini.open(target.address, "kv")
    s = target.raw()
    t0 = time.monotonic()
    s.sendall(req(wire.OP_WRITE, remote=remote, length=4 << 20, deadline=time.time() + 1.0) + b"\x01" * 1024)
    assert closed(s, timeout=5)  # the frame never finished: dropped after the deadline and the grace
    assert time.monotonic() - t0 < 1.0 + 0.5 + 1.0
    assert target.try_unregister("kv")
