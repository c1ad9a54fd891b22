"""The busy-poll helper: polls a real socket without sleeping, bounded in time and in threads."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from mpcomm.plugins.tcp import busypoll

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
        assert len(busypoll._slots) == busypoll.limit()
        taken = [slot.acquire(False) for slot in busypoll._slots]
        try:
            assert all(taken)
            b.send(b"x")
            assert not busypoll.wait_readable(a.fileno(), 1_000_000_000)  # no slot: the caller blocks instead
        finally:
            for slot in busypoll._slots:
                slot.release()
        assert busypoll.wait_readable(a.fileno(), 1_000_000_000)


def test_busy_polling_off_still_serves(spawn, make_engine) -> None:  # type: ignore[no-untyped-def]
    target = spawn(config={"plugins": {"tcp": {"busy_poll_us": 0}}})
    ini = make_engine({"plugins": {"tcp": {"busy_poll_us": 0}}})
    remote = ini.open(target.address, "kv")
    for i in range(20):
        assert ini.write(bytes([i]) * 4096, remote, 0).result(10) == 4096
    assert sum(c.driven for p in ini.transports["tcp"]._pools.values() for c in p._conns) > 0


def test_the_module_and_the_plain_library_answer_alike(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Where Python.h is installed the poll is a module function; without it, the same C through ctypes."""
    import ctypes

    from mpcomm import native_helper

    if native_helper.python_include() is not None:
        assert "extension module" in busypoll.reason
    monkeypatch.setenv("MPCOMM_CACHE_DIR", str(tmp_path))
    h = native_helper.load(busypoll.SOURCE, "tcp", "busypoll", busypoll.ABI, "mpcomm_tcp_abi", "_mpcomm_busypoll",
                           None)  # no Python.h: the plain library
    assert not isinstance(h, str) and h.module is None, h
    plain = h.lib.mpcomm_tcp_spin_readable
    plain.restype, plain.argtypes = ctypes.c_int, [ctypes.c_int, ctypes.c_longlong]
    a, b = socket.socketpair()
    with a, b:
        for spin in (plain, busypoll._spin):
            assert spin(a.fileno(), 1_000_000) == 0  # nothing within 1 ms
        b.send(b"x")
        for spin in (plain, busypoll._spin):
            assert spin(a.fileno(), 1_000_000) == 1
