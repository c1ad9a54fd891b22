"""The busy-poll helper: polls a real socket without sleeping, bounded in time and in threads."""

from __future__ import annotations

import array
import errno
import os
import socket
import struct
import threading
import time
from typing import Any

import pytest

from mpcomm.plugins.tcp import busypoll, wire

pytestmark = pytest.mark.skipif(busypoll.load() is None, reason=f"busy-polling unavailable: {busypoll.reason}")


def test_it_sees_a_frame_that_arrives_while_it_polls() -> None:
    a, b = socket.socketpair()
    with a, b:
        threading.Timer(0.002, lambda: b.send(b"x")).start()
        assert busypoll.wait_readable(a.fileno(), 2_000_000_000)
        assert a.recv(1) == b"x"


def test_it_gives_up_after_its_budget_and_on_a_closed_peer_says_readable() -> None:
    a, b = socket.socketpair()
    with a:
        t0 = time.monotonic()
        assert not busypoll.wait_readable(a.fileno(), 3_000_000)  # 3 ms of silence
        assert time.monotonic() - t0 >= 0.003
        b.close()
        assert busypoll.wait_readable(a.fileno(), 1_000_000_000)  # the end is readable: recv says which
        assert a.recv(1) == b""


def test_at_most_limit_threads_poll_at_once() -> None:
    a, b = socket.socketpair()
    with a, b:
        b.send(b"x")
        if busypoll._module is None:
            pytest.skip(f"no busy-poll helper: {busypoll.reason}")
        busypoll._module.set_spin_limit(0)  # the extension module counts its pollers: a limit of 0 is "all taken"
        try:
            assert not busypoll.wait_readable(a.fileno(), 1_000_000_000)  # no slot: the caller blocks instead
            assert busypoll.next_reply is not None
            head = bytearray(wire.RESP.size)
            assert busypoll.next_reply(a.fileno(), 10**9, 0, 1 << 20, head) != busypoll.REPLY_NONE  # poll() saw it
        finally:
            busypoll._module.set_spin_limit(busypoll.limit())
        assert busypoll.wait_readable(a.fileno(), 1_000_000_000)


needs_module = pytest.mark.skipif(busypoll.next_reply is None,
                                  reason="the busy-poll helper was not built when mpcomm was installed")


def _reply(status: int, rid: int, body: bytes = b"") -> bytes:
    return wire.RESP.pack(wire.RESP_MAGIC, status, 0, 0, rid, len(body)) + body


@needs_module
def test_next_reply_takes_only_whole_replies_and_consumes_only_their_header() -> None:
    nr = busypoll.next_reply
    assert nr is not None
    a, b = socket.socketpair()
    with a, b:
        fd = a.fileno()
        head = bytearray(wire.RESP.size)
        assert nr(fd, 0, 0, 1 << 20, head) == busypoll.REPLY_NONE  # nothing there
        b.sendall(_reply(wire.ST_OK, 7))
        assert nr(fd, 1_000_000, 100, 1 << 20, head) == busypoll.REPLY_GOT
        assert wire.RESP.unpack(head)[4] == 7
        body = b'{"code": "x", "message": "y"}'
        b.sendall(_reply(wire.ST_ERR, 8, body))  # a whole error reply: header taken, body left
        assert nr(fd, 0, 100, 1 << 20, head) == busypoll.REPLY_GOT and wire.RESP.unpack(head)[4] == 8
        assert a.recv(len(body)) == body
        whole = _reply(wire.ST_ERR, 9, body)
        b.sendall(whole[:10])  # a header partly there
        assert nr(fd, 0, 100, 1 << 20, head) == busypoll.REPLY_SHORT
        b.sendall(whole[10:30])  # the header whole, the body not
        assert nr(fd, 0, 100, 1 << 20, head) == busypoll.REPLY_SHORT
        b.sendall(whole[30:])
        assert nr(fd, 0, 100, 1 << 20, head) == busypoll.REPLY_GOT and wire.RESP.unpack(head)[4] == 9
        assert a.recv(len(body)) == body
        # A whole PARTIAL reply (a batch some of whose indices the target refused) is a driver's too.
        b.sendall(_reply(wire.ST_PARTIAL, 4, b"ab"))
        assert nr(fd, 0, 100, 1 << 20, head) == busypoll.REPLY_GOT and wire.RESP.unpack(head)[4] == 4
        assert a.recv(2) == b"ab"
        # Not for a driver: nothing is consumed, the reader thread reads it all.
        for frame, cap in ((b"XX" + _reply(wire.ST_OK, 1)[2:], 1 << 20), (_reply(3, 2, b"ab"), 1 << 20),
                           (_reply(wire.ST_ERR, 3, b"z" * 100), 50)):
            b.sendall(frame)
            assert nr(fd, 0, 100, cap, head) == busypoll.REPLY_LEAVE
            assert a.recv(len(frame), socket.MSG_DONTWAIT) == frame
        b.close()
        assert nr(fd, 0, 100, 1 << 20, head) == busypoll.REPLY_LEAVE  # the end of the connection
        with pytest.raises(ValueError):
            nr(fd, 0, 0, 1 << 20, bytearray(4))


@needs_module
def test_next_request_polls_then_receives_a_header() -> None:
    nreq = busypoll.next_request
    assert nreq is not None
    a, b = socket.socketpair()
    with a, b:
        head = bytearray(wire.REQ.size)
        threading.Timer(0.002, lambda: b.send(b"q" * wire.REQ.size)).start()
        assert nreq(a.fileno(), 2_000_000_000, head) == wire.REQ.size and head == b"q" * wire.REQ.size
        a.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", 0, 20_000))
        assert nreq(a.fileno(), 1_000_000, head) == -errno.EAGAIN  # nothing within SO_RCVTIMEO
        b.send(b"abc")
        assert nreq(a.fileno(), 0, head) == 3 and head[:3] == b"abc"
        b.close()
        assert nreq(a.fileno(), 0, head) == 0  # the end


def test_busy_polling_off_still_serves(spawn, make_engine) -> None:  # type: ignore[no-untyped-def]
    target = spawn(config={"plugins": {"tcp": {"busy_poll_us": 0}}})
    ini = make_engine({"plugins": {"tcp": {"busy_poll_us": 0}}})
    remote = ini.open(target.address, "kv")
    for i in range(20):
        assert ini.write(bytes([i]) * 4096, remote, 0).result(10) == 4096
    assert sum(c.driven for p in ini.transports["tcp"]._pools.values() for c in p._conns) > 0


def test_the_module_and_ctypes_on_its_file_answer_alike() -> None:
    """The helper is one prebuilt extension module; ctypes on the same file reaches the same C."""
    import ctypes

    from mpcomm import native_helper

    h = native_helper.load(busypoll.MODULE, busypoll.ABI, "mpcomm_tcp_abi")
    if isinstance(h, str):
        pytest.skip(h)
    assert busypoll.reason == f"compiled helper ({h.path})"
    plain = h.lib.mpcomm_tcp_spin_readable
    plain.restype, plain.argtypes = ctypes.c_int, [ctypes.c_int, ctypes.c_longlong]
    a, b = socket.socketpair()
    with a, b:
        for spin in (plain, busypoll._spin):
            assert spin(a.fileno(), 1_000_000) == 0  # nothing within 1 ms
        b.send(b"x")
        for spin in (plain, busypoll._spin):
            assert spin(a.fileno(), 1_000_000) == 1


@needs_module
def test_next_reply_length_check_cannot_wrap() -> None:
    """Issue 28 (one overflow-safe range check): ``avail < RESP_SIZE + length`` wrapped for a
    length near 2**64, and a negative max_len let any length through; such a reply is the
    reader thread's, and nothing of it is consumed."""
    nr = busypoll.next_reply
    assert nr is not None
    a, b = socket.socketpair()
    with a, b:
        fd = a.fileno()
        head = bytearray(wire.RESP.size)
        frame = wire.RESP.pack(wire.RESP_MAGIC, wire.ST_ERR, 0, 0, 5, 2**64 - 10)
        b.sendall(frame)
        assert nr(fd, 0, 100, -1, head) == busypoll.REPLY_LEAVE
        assert a.recv(len(frame), socket.MSG_DONTWAIT) == frame
        frame = wire.RESP.pack(wire.RESP_MAGIC, wire.ST_ERR, 0, 0, 6, 2**63 - 1)
        b.sendall(frame)
        assert nr(fd, 0, 100, 2**63 - 1, head) == busypoll.REPLY_SHORT  # allowed, but never whole
        assert a.recv(len(frame), socket.MSG_DONTWAIT) == frame


def _helper() -> Any:
    from mpcomm import native_helper

    h = native_helper.load(busypoll.MODULE, busypoll.ABI, "mpcomm_tcp_abi")
    if isinstance(h, str):
        pytest.skip(h)
    return h


def test_a_budget_near_2_63_waits_instead_of_wrapping() -> None:
    """``now + budget`` wrapped for a budget near 2^63 (its end lay in the past: nothing was
    waited for); the time spent is compared with the budget instead, in the module and in the
    plain function ctypes calls."""
    import ctypes

    h = _helper()
    plain = h.lib.mpcomm_tcp_spin_readable
    plain.restype, plain.argtypes = ctypes.c_int, [ctypes.c_int, ctypes.c_longlong]
    for spin in (plain, h.module.spin_readable):
        a, b = socket.socketpair()
        with a, b:
            threading.Timer(0.02, lambda: b.send(b"x")).start()
            assert spin(a.fileno(), 2**63 - 1) == 1


def test_every_entry_point_refuses_an_fd_outside_a_c_int() -> None:
    """One argument parser for every entry point: an fd that is no C int is refused, never
    truncated to another descriptor (2^32 + fd used to poll and read fd)."""
    m = _helper().module
    a, b = socket.socketpair()
    with a, b:
        b.send(b"x" * wire.RESP.size)
        far = (1 << 32) + a.fileno()
        head = bytearray(wire.RESP.size)
        calls = [lambda: m.spin_readable(far, 0), lambda: m.next_request(far, 0, head),
                 lambda: m.next_reply(far, 0, 0, 1 << 20, head),
                 lambda: m.await_reply(far, array.array("i", [0, 0]), 1000, 0, 0)]
        for call in calls:
            with pytest.raises(OverflowError):
                call()
        assert a.recv(64, socket.MSG_DONTWAIT) == b"x" * wire.RESP.size  # nothing was read
        with pytest.raises(TypeError, match=r"next_reply\(fd, spin_ns, wait_ms, max_len, head\) takes 5 arguments"):
            m.next_reply(a.fileno(), 0, 0, head)
        with pytest.raises(ValueError):  # a header buffer too short, after the integers parsed
            m.next_request(a.fileno(), 0, bytearray(0))
        with pytest.raises(BufferError):  # a buffer that is not writable
            m.await_reply(a.fileno(), b"\0" * 8, 1000, 0, 0)
        with pytest.raises(OverflowError):  # beyond int64, as before
            m.spin_readable(a.fileno(), 2**64)
        # Out-of-range times are clamped: a negative wait is no wait, a huge handoff/idle is bounded.
        t0 = time.monotonic()
        assert m.next_reply(a.fileno(), -5, -5, -1, head) == busypoll.REPLY_NONE
        assert time.monotonic() - t0 < 1
        assert m.await_reply(a.fileno(), array.array("i", [1, 0]), 2**63 - 1, 2**63 - 1, -1) == busypoll.AWAIT_NONE


@needs_module
def test_next_reply_takes_a_reply_that_arrives_while_it_spins() -> None:
    """The driver's spin looks by peeking (no poll first): a reply that comes mid-spin is taken, whole."""
    nr = busypoll.next_reply
    assert nr is not None
    a, b = socket.socketpair()
    with a, b:
        head = bytearray(wire.RESP.size)
        threading.Timer(0.002, lambda: b.sendall(_reply(wire.ST_OK, 11))).start()
        t0 = time.monotonic()
        assert nr(a.fileno(), 2_000_000_000, 0, 1 << 20, head) == busypoll.REPLY_GOT
        assert time.monotonic() - t0 < 1.5  # taken when it came, not at the end of the spin
        assert wire.RESP.unpack(head)[4] == 11
        b.sendall(_reply(wire.ST_OK, 12)[:5])  # a header partly there ends the spin: short, nothing consumed
        assert nr(a.fileno(), 2_000_000_000, 0, 1 << 20, head) == busypoll.REPLY_SHORT
        assert a.recv(5, socket.MSG_DONTWAIT) == _reply(wire.ST_OK, 12)[:5]


@needs_module
def test_await_reply_takes_a_reply_only_when_the_same_one_sat_there_at_two_looks() -> None:
    """On a sticky connection, replies that a driver takes between the reader's looks are not the
    reader's, even when some reply is there at every look: only one nobody took is."""
    wait = busypoll.await_reply
    assert wait is not None
    look = 0.2  # the reader looks every 200 ms (handoff = look: a constant period)
    a, b = socket.socketpair()
    with a, b:
        flags = array.array("i", (0, 1))  # not driving, sticky
        out: list[tuple[int, float]] = []
        t0 = time.monotonic()
        th = threading.Thread(target=lambda: out.append((wait(a.fileno(), flags, int(look * 1e9), int(look * 1e9),
                                                              5000), time.monotonic() - t0)))
        th.start()
        b.sendall(_reply(wire.ST_OK, 1))
        time.sleep(look / 2)  # half way between the reader's looks (at 200, 400, 600... ms)
        for rid in (2, 3, 4):  # between two looks, a "driver" takes the reply and the next one comes
            if rid > 2:
                time.sleep(look)
            assert a.recv(wire.RESP.size) == _reply(wire.ST_OK, rid - 1)
            b.sendall(_reply(wire.ST_OK, rid))
        replaced = time.monotonic() - t0
        th.join(10)
        assert out and out[0][0] == busypoll.AWAIT_REPLY
        assert out[0][1] > replaced  # not before the last one sat there, untaken, at two looks


@needs_module
def test_await_reply_sees_the_end_of_a_sticky_connection_at_once() -> None:
    """Between its looks the reader sleeps for the connection's end (not for data): a peer that
    ends it wakes it at once, not at its next look."""
    wait = busypoll.await_reply
    assert wait is not None
    a, b = socket.socketpair()
    with a, b:
        flags = array.array("i", (0, 1))
        threading.Timer(0.05, b.close).start()
        t0 = time.monotonic()
        assert wait(a.fileno(), flags, 2_000_000_000, 2_000_000_000, 10_000) == busypoll.AWAIT_END
        assert time.monotonic() - t0 < 1.5


@needs_module
@pytest.mark.parametrize("ring", [1, busypoll.BELL_NOW])
def test_await_reply_after_its_bell_waits_a_handoff_only_for_a_leaving_driver(ring: int) -> None:
    """The bell ends the reader's sleep between looks. A driver that left with replies pending rings
    1: the reader goes on handoff_ns later (the driver may come straight back for its next frames).
    Conn.hand_to_reader rings BELL_NOW (no driver will come: a completion queue, a callback, a
    done() poller waits): the reader goes on at once, and takes the reply sitting there."""
    wait = busypoll.await_reply
    assert wait is not None
    handoff = 0.5  # long, so the two rings differ whatever the machine's load
    a, b = socket.socketpair()
    bell = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
    try:
        with a, b:
            flags = array.array("i", (0, 1))  # not driving, sticky: the reader sleeps between looks
            b.sendall(_reply(wire.ST_OK, 7))
            out: list[tuple[int, float]] = []
            rang = [0.0]
            th = threading.Thread(target=lambda: out.append((wait(a.fileno(), flags, int(handoff * 1e9),
                                                                  int(handoff * 1e9), 10_000, bell),
                                                             time.monotonic())))
            th.start()
            time.sleep(0.05)  # asleep between its looks
            flags[1] = 0  # handed over: no longer sticky (as the callers set it, before ringing)
            rang[0] = time.monotonic()
            os.eventfd_write(bell, ring)
            th.join(10)
            assert out and out[0][0] == busypoll.AWAIT_REPLY
            took = out[0][1] - rang[0]
            if ring == busypoll.BELL_NOW:
                assert took < handoff / 2, took
            else:
                assert took >= handoff * 0.9, took
    finally:
        os.close(bell)
