"""mpcomm.tent's raw-address semantics through the Python MPComm API (real engines, loopback)."""

from __future__ import annotations

import ctypes
import mmap
import threading

import pytest

from mpcomm import Engine
from mpcomm.tent import MPComm, broadcast, codes, gather, scatter
from mpcomm.tent.provider import DIRECTORY_SIZE

SIZE = 1 << 20


class Mem:
    def __init__(self, n: int = SIZE, fill: int = 0) -> None:
        self.mm = mmap.mmap(-1, n)
        self.mm.write(bytes([fill]) * n)
        self._anchor = ctypes.c_char.from_buffer(self.mm)
        self.addr = ctypes.addressof(self._anchor)


def _node(name: str, port: int = 0) -> MPComm:
    c = MPComm()
    assert c.init(f"127.0.0.1:{name}", "", port) == codes.SUCCESS, c.last_error
    assert c.start_accept_thread() == codes.SUCCESS
    return c


@pytest.fixture
def pair():  # type: ignore[no-untyped-def]
    a, b = _node("a"), _node("b")
    ma, mb = Mem(fill=0xAA), Mem(fill=0x11)
    assert a.register_memory(ma.addr, SIZE) == 0 and a.publish_buffer(ma.addr, SIZE, -1) == 0
    assert b.register_memory(mb.addr, SIZE) == 0
    assert b.connect("A", "127.0.0.1", a.get_tcp_port()) == 0
    rc, bufs = b.query_remote_buffer("A", "127.0.0.1", a.get_tcp_port())
    assert rc == 0 and [(x.addr, x.length) for x in bufs] == [(ma.addr, SIZE)]
    yield a, b, ma, mb
    b.shutdown()
    a.shutdown()


def _done(c: MPComm, h: int) -> int:
    assert h, c.last_error
    rc = c.wait_transfer(h, 10_000)
    assert c.release_transfer(h) == 0
    return rc


def test_put_get_by_raw_address(pair) -> None:  # type: ignore[no-untyped-def]
    a, b, ma, mb = pair
    mb.mm[100:105] = b"hello"
    assert _done(b, b.put_async(mb.addr + 100, "A", ma.addr + 4000, 5)) == 0
    assert ma.mm[4000:4005] == b"hello"
    ma.mm[0:3] = b"xyz"
    assert _done(b, b.get_async(mb.addr + 10, "A", ma.addr, 3)) == 0
    assert mb.mm[10:13] == b"xyz"


def test_outside_every_range_is_refused_and_nothing_moves(pair) -> None:  # type: ignore[no-untyped-def]
    a, b, ma, mb = pair
    before = bytes(ma.mm)
    for args, code in [((mb.addr, "A", ma.addr + SIZE - 1, 2), codes.ERR_OUT_OF_RANGE),
                       ((mb.addr, "A", ma.addr - 1, 2), codes.ERR_OUT_OF_RANGE),
                       ((mb.addr + SIZE, "A", ma.addr, 1), codes.ERR_OUT_OF_RANGE),
                       ((mb.addr, "nobody", ma.addr, 1), codes.ERR_UNKNOWN_HOST),
                       ((mb.addr, "A", ma.addr, 0), codes.ERR_INVALID_ARGUMENT)]:
        assert b.put_async(*args) == 0
        assert b.last_error[0] == code, (args, b.last_error)
    assert bytes(ma.mm) == before


def test_handles_are_released_exactly_once(pair) -> None:  # type: ignore[no-untyped-def]
    a, b, ma, mb = pair
    h = b.put_async(mb.addr, "A", ma.addr, 64)
    assert b.wait_transfer(h, 10_000) == 0
    assert b.get_transfer_result(h).bytes_transferred == 64
    assert b.release_transfer(h) == 0
    assert b.release_transfer(h) == codes.ERR_INVALID_HANDLE
    assert b.is_transfer_complete(h) is True
    assert b.get_transfer_result(h).error_code == codes.ERR_INVALID_HANDLE
    assert b.wait_transfer(h) == codes.ERR_INVALID_HANDLE
    assert b.release_transfer(123456789) == codes.ERR_INVALID_HANDLE


def test_unpublish_revokes_a_peers_old_keys(pair) -> None:  # type: ignore[no-untyped-def]
    a, b, ma, mb = pair
    assert a.unpublish_buffer(ma.addr) == 0
    before = bytes(ma.mm)
    h = b.put_async(mb.addr, "A", ma.addr, 64)  # b still holds the old keys
    if h:
        assert _done(b, h) != 0
    assert bytes(ma.mm) == before
    rc, bufs = b.query_remote_buffer("A")
    assert rc == 0 and bufs == []


def test_overlapping_registration_is_refused(pair) -> None:  # type: ignore[no-untyped-def]
    a, b, ma, mb = pair
    assert b.register_memory(mb.addr + 4096, 4096) == codes.ERR_INVALID_ARGUMENT
    assert b.unregister_memory(mb.addr + 1) == codes.ERR_OUT_OF_RANGE


def test_many_threads_issue_at_once(pair) -> None:  # type: ignore[no-untyped-def]
    a, b, ma, mb = pair
    mb.mm[:] = bytes(range(256)) * (SIZE // 256)
    errors: list[object] = []

    def worker(t: int) -> None:
        for j in range(t, 64, 4):
            off = j * (SIZE // 64)
            h = b.put_async(mb.addr + off, "A", ma.addr + off, SIZE // 64)
            rc = b.wait_transfer(h, 10_000) if h else b.last_error
            if rc != 0:
                errors.append(rc)
            b.release_transfer(h)

    ts = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert not errors
    assert bytes(ma.mm) == bytes(mb.mm)


def test_restarted_peer_is_reconnected_without_a_new_query(pair) -> None:  # type: ignore[no-untyped-def]
    a, b, ma, mb = pair
    port = a.get_tcp_port()
    a.shutdown()
    a2 = _node("a", port)  # the same host id and port, a new epoch and new buffers
    try:
        m2 = Mem(fill=0)
        assert a2.register_memory(m2.addr, SIZE) == 0 and a2.publish_buffer(m2.addr, SIZE, -1) == 0
        mb.mm[0:4] = b"back"
        assert _done(b, b.put_async(mb.addr, "A", m2.addr, 4)) == 0
        assert m2.mm[0:4] == b"back"
    finally:
        a2.shutdown()


def test_multi_host_calls_one_handle() -> None:
    a, b, c = _node("a"), _node("b"), _node("c")
    try:
        ma, mb, mc = Mem(), Mem(), Mem()
        for node, m in ((a, ma), (b, mb)):
            assert node.publish_buffer(m.addr, SIZE, -1) == 0
        assert c.register_memory(mc.addr, SIZE) == 0
        for name, node in (("A", a), ("B", b)):
            assert c.connect(name, "127.0.0.1", node.get_tcp_port()) == 0
            assert c.query_remote_buffer(name)[0] == 0
        mc.mm[:] = bytes([1]) * (SIZE // 2) + bytes([2]) * (SIZE // 2)
        assert _done(c, c.scatter_async(mc.addr, ["A", "B"], [ma.addr, mb.addr], SIZE // 2)) == 0
        assert ma.mm[: SIZE // 2] == bytes([1]) * (SIZE // 2) and mb.mm[: SIZE // 2] == bytes([2]) * (SIZE // 2)
        mc.mm[:1000] = b"z" * 1000
        assert _done(c, c.broadcast_async(mc.addr, ["A", "B"], [ma.addr + 10, mb.addr + 20], 1000)) == 0
        assert ma.mm[10:1010] == b"z" * 1000 and mb.mm[20:1020] == b"z" * 1000
        assert _done(c, c.gather_async(mc.addr, ["A", "B"], [ma.addr + 10, mb.addr], 16)) == 0
        assert mc.mm[:16] == b"z" * 16 and mc.mm[16:32] == bytes([2]) * 16
        before = bytes(ma.mm)
        assert c.broadcast_async(mc.addr, ["A", "B"], [ma.addr, 0x1000], 64) == 0  # one bad address: none posted
        assert c.last_error[0] == codes.ERR_OUT_OF_RANGE and bytes(ma.mm) == before
    finally:
        for n in (a, b, c):
            n.shutdown()


def test_shutdown_with_transfers_in_flight() -> None:
    a, b = _node("a"), _node("b")
    ma, mb = Mem(8 << 20), Mem(8 << 20)
    assert a.publish_buffer(ma.addr, 8 << 20, -1) == 0 and b.register_memory(mb.addr, 8 << 20) == 0
    assert b.connect("A", "127.0.0.1", a.get_tcp_port()) == 0 and b.query_remote_buffer("A")[0] == 0
    hs = [b.put_async(mb.addr, "A", ma.addr, 8 << 20) for _ in range(16)]
    assert all(hs)
    assert b.shutdown() == 0
    results = [b.get_transfer_result(h).error_code for h in hs]
    assert all(b.is_transfer_complete(h) for h in hs)
    assert all(r in (codes.SUCCESS, codes.ERR_SHUTDOWN) for r in results), results
    assert all(b.release_transfer(h) == 0 for h in hs)
    assert b.put_async(mb.addr, "A", ma.addr, 1) == 0 and b.last_error[0] == codes.ERR_NOT_INITIALIZED
    a.shutdown()


def test_garbage_directory_from_a_peer_is_an_error_not_a_crash(pair) -> None:  # type: ignore[no-untyped-def]
    a, b, ma, mb = pair
    buf = a.provider._dir_buf  # noqa: SLF001 - play the hostile peer
    saved = bytes(buf)
    buf[12:16] = b"\0\0\0\0"  # wrong CRC: looks torn forever
    rc, _ = b.query_remote_buffer("A")
    assert rc == codes.ERR_BUSY
    import json
    import zlib

    bad = json.dumps({"buffers": [["x"]]}).encode()
    buf[16:16 + len(bad)] = bad
    buf[8:12] = len(bad).to_bytes(4, "little")
    buf[12:16] = zlib.crc32(bad).to_bytes(4, "little")
    rc, _ = b.query_remote_buffer("A")
    assert rc == codes.ERR_GENERIC
    buf[:] = saved
    assert b.query_remote_buffer("A")[0] == 0
    assert len(saved) == DIRECTORY_SIZE


def test_collectives_on_an_engine() -> None:
    with Engine() as t1, Engine() as t2, Engine() as ini:
        r1, r2 = t1.register(bytearray(4096), name="kv"), t2.register(bytearray(4096), name="kv")
        rem = [ini.open(t1.address, "kv"), ini.open(t2.address, "kv")]
        src = bytearray(b"a" * 100 + b"b" * 100)
        scatter(ini, src, [(rem[0], 0), (rem[1], 50)], 100).result(10)
        assert bytes(r1.view[:100]) == b"a" * 100 and bytes(r2.view[50:150]) == b"b" * 100
        broadcast(ini, b"hello", rem, 5).result(10)
        assert bytes(r1.view[:5]) == bytes(r2.view[:5]) == b"hello"
        dst = bytearray(10)
        gather(ini, dst, rem, 5).result(10)
        assert bytes(dst) == b"hellohello"


def test_bulk_polling_reaps_every_handle_once(pair) -> None:  # type: ignore[no-untyped-def]
    """poll_completions settles finished handles on the caller's thread (the engine's CompletionQueue)."""
    a, b, ma, mb = pair
    mb.mm[:64] = bytes(range(64))
    hs = {b.put_async(mb.addr + i, "A", ma.addr + 1000 + i, 1) for i in range(64)}
    assert all(hs)
    seen: list[int] = []
    import time

    deadline = time.monotonic() + 10
    while len(seen) < len(hs) and time.monotonic() < deadline:
        seen += b.poll_completions(16, timeout=0.1)
    assert sorted(seen) == sorted(hs) and len(set(seen)) == len(seen)
    assert all(b.get_transfer_result(h).error_code == 0 for h in hs)
    assert ma.mm[1000:1064] == bytes(range(64))
    assert all(b.release_transfer(h) == 0 for h in hs)
    assert b.poll_completions() == []
