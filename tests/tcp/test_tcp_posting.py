"""Posting never waits on the peer; many requests are in flight per connection (target in a child process)."""

from __future__ import annotations

import hashlib
import socket
import time
from typing import Any

import pytest

import mpcomm


def _pool(engine: mpcomm.Engine) -> Any:
    pools = list(engine.transports["tcp"]._pools.values())
    assert len(pools) == 1
    return pools[0]


def test_write_to_a_stopped_target_returns_at_once(spawn: Any, make_engine: Any) -> None:
    target = spawn()
    ini = make_engine({"runtime": {"abort_grace_ms": 400}})
    remote = ini.open(target.address, "kv")
    src = ini.allocate(1 << 20)
    ini.write(src, remote, 0, 4096).result(5)  # connection up
    target.stop()
    try:
        t0 = time.monotonic()
        t = ini.write(src, remote, 0, 4096, timeout=2)
        posted = time.monotonic() - t0
        big = ini.write(src, remote, 0, 1 << 20, timeout=2)
        posted_big = time.monotonic() - t0 - posted
        assert posted < 0.2 and posted_big < 0.2, (posted, posted_big)
        with pytest.raises(mpcomm.TransferTimeout) as info:
            t.result(10)
        assert time.monotonic() - t0 < 2 + 0.4 + 1.5
        # Stopped, not dead: its kernel took the bytes, nobody can say they won't land.
        assert info.value.confirmed is False
        with pytest.raises(mpcomm.TransferTimeout):
            big.result(10)
    finally:
        target.cont()


def test_first_request_to_a_silent_data_port_does_not_block_the_poster(make_engine: Any) -> None:
    """The data port accepts (kernel backlog) but never answers HELLO: connection set-up is off the poster's thread."""
    target = make_engine()
    target.register(bytearray(1 << 16), name="kv")
    ini = make_engine({"transport": {"handshake_timeout_ms": 1500}})
    remote = ini.open(target.address, "kv")
    silent = socket.create_server(("127.0.0.1", 0), backlog=64)  # accepts in the kernel, says nothing
    try:
        t_info = ini._peers._links[target.address].info  # what the engine routes on
        t_info.transports["tcp"]["port"] = silent.getsockname()[1]
        t0 = time.monotonic()
        t = ini.write(b"x" * 4096, remote, 0, timeout=1.0)
        assert time.monotonic() - t0 < 0.2
        with pytest.raises(mpcomm.MpcommError):
            t.result(5)
    finally:
        silent.close()


def test_a_stalled_peer_slows_no_other(spawn: Any, make_engine: Any) -> None:
    slow, fast = spawn(), spawn()
    ini = make_engine({"runtime": {"abort_grace_ms": 300}})
    r_slow, r_fast = ini.open(slow.address, "kv"), ini.open(fast.address, "kv")
    data = b"\x5a" * 4096
    ini.write(data, r_slow, 0).result(5)
    slow.stop()
    try:
        stuck = [ini.write(data, r_slow, 0, timeout=3) for _ in range(8)]
        t0 = time.monotonic()
        for i in range(50):
            ini.write(data, r_fast, i * 4096).result(2)
        assert time.monotonic() - t0 < 2.0
        assert fast.cmd(f"sha kv 0 {4096}") == hashlib.sha256(data).hexdigest()
        assert not any(t.done() for t in stuck), [(t.status, t.exception() if t.done() else None) for t in stuck]
    finally:
        slow.cont()
    for t in stuck:
        try:
            t.result(10)
        except mpcomm.MpcommError:
            pass


def test_requests_are_pipelined_on_one_connection(spawn: Any, make_engine: Any) -> None:
    target = spawn({"kv": [1 << 20, "buffer"]})
    ini = make_engine({"plugins": {"tcp": {"connections": 1}}})
    remote = ini.open(target.address, "kv")
    src = ini.allocate(64 * 4096)
    src.view[:] = bytes(range(256)) * (64 * 16)
    ini.write(src, remote, 0, 4096).result(5)
    target.stop()
    try:
        ts = [ini.write(src, remote, i * 4096, 4096, local_offset=i * 4096, timeout=20) for i in range(32)]
        ts += [ini.read(bytearray(4096), remote, i * 4096, timeout=20) for i in range(32, 40)]
        pool = _pool(ini)
        # Every request is out on one connection, none waits for an earlier reply.
        assert len(pool._conns) == 1
        assert len(pool._conns[0].pending) == 40
    finally:
        target.cont()
    for t in ts:
        t.result(20)
    assert target.cmd(f"sha kv 0 {32 * 4096}") == hashlib.sha256(src.view[: 32 * 4096]).hexdigest()


def test_integrity_across_sizes_and_stripes(spawn: Any, make_engine: Any) -> None:
    target = spawn({"kv": [40 << 20, "allocate"]})
    ini = make_engine({"plugins": {"tcp": {"stripe_threshold": 1 << 20, "connections": 3}}})
    remote = ini.open(target.address, "kv")
    src = ini.allocate(24 << 20)
    src.view[:] = (bytes(range(251)) * ((24 << 20) // 251 + 1))[: 24 << 20]
    for n, off in ((1, 3), (4095, 1), (300_000, 4097), (5 << 20, 11), (24 << 20, 4096)):
        ini.write(src, remote, off, n).result(20)
        assert target.cmd(f"sha kv {off} {n}") == hashlib.sha256(src.view[:n]).hexdigest(), n
        dst = ini.allocate(n)
        ini.read(dst, remote, off, n).result(20)
        assert bytes(dst.view) == bytes(src.view[:n]), n
    assert len(_pool(ini)._conns) <= 3
