"""A small write's flush goes out with its put: one round trip over tcp, not two.

Over tcp a put completes only when the target acknowledges it. The small-request paths used to
issue the endpoint flush only once the put had completed, so every 4 KiB write waited for two
acknowledgements in turn. Now the fast path (a bound lane's move, ``mp_move`` in _ucxloop.c)
and the general path (``UcxTransport._start``) both send the flush right behind a put still in
flight. Two workers of one process talk over real tcp sockets here; the target worker is not
progressed while the write is issued, so nothing can have been acknowledged: the call must come
back with the flush already in flight.
"""

from __future__ import annotations

import mmap
import time
from typing import Any

import pytest
from ucx_support import ERR_IO, StandInLane, StoppableTarget

import mpcomm
from mpcomm.plugins.ucx import _native
from mpcomm.testing.fixtures import make_engine  # noqa: F401 (fixture)

ucp: Any = pytest.importorskip("mpcomm.plugins.ucx._ucp")

try:
    ucp.load()
except Exception as exc:  # noqa: BLE001 - no UCX here: nothing to test
    pytest.skip(f"UCX unavailable: {exc}", allow_module_level=True)

TCP = {"plugins": {"ucx": {"tls": "tcp,self"}}}


def _progress_until(done: Any, *workers: Any, timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < end, "timed out"
        for w in workers:
            w.progress()


@pytest.fixture
def tcp_pair() -> Any:
    if _native.module() is None:
        pytest.skip(f"no extension module for the ucx helper: {_native.reason}")
    ctx = ucp.Context(env={"TLS": "tcp", "RNDV_THRESH": "inf"})
    try:
        tgt, ini = ctx.create_worker(), ctx.create_worker()
        buf = mmap.mmap(-1, 1 << 16)
        m = ctx.mem_map(ucp.buffer_address(buf), 1 << 16)
        ep = ini.connect(tgt.address, error_handling=True)
        rk = ep.unpack_rkey(m.pack_rkey())
        src = mmap.mmap(-1, 4096)
        # Wire-up over tcp needs both workers' progress: one write through to the end first.
        f = ep.flush()
        _progress_until(lambda: f is None or f.done, tgt, ini)
        if f is not None:
            f.free()

        def lane(write: bool) -> Any:
            gates = (_native.gate(), _native.gate())
            got = ep.rma_lane(write, rk, None, gates, (ucp.buffer_address(src), 4096), (m.address, 1 << 16),
                              1 << 20, 1 << 20, set(), lambda: None, lambda *a: False)
            assert got is not None
            return got[1]  # raw: the answer as a tuple

        yield tgt, ini, lane, buf, src
    finally:
        ctx.close()


def test_a_write_comes_back_with_its_flush_in_flight_not_its_put(tcp_pair: Any) -> None:
    tgt, ini, lane, buf, src = tcp_pair
    move = lane(True)
    for i in range(5):
        src[:] = bytes([i + 1]) * 4096
        code, st, failed = move(0, 4096, 4096)
        # The target was not progressed: no acknowledgement can have come back.
        assert code == 2 and failed == {}
        assert st.name == "ucp_ep_flush_nbx", "the put was left in flight alone: its flush waits for its ack"
        _progress_until(lambda: st.done, tgt, ini)
        assert st.status() == 0
        st.free()
        assert buf[4096:8192] == bytes([i + 1]) * 4096 and buf[4095] == 0 and buf[8192] == 0


def test_a_read_left_in_flight_is_completed_by_its_flush(tcp_pair: Any) -> None:
    tgt, ini, lane, buf, src = tcp_pair
    buf[0:4096] = b"r" * 4096
    code, st, failed = lane(False)(0, 0, 4096)
    assert code == 2 and st.name == "ucp_ep_flush_nbx" and failed == {}
    _progress_until(lambda: st.done, tgt, ini)
    assert st.status() == 0
    st.free()
    assert src[:] == b"r" * 4096


def test_the_lane_releases_a_put_waiting_for_its_peer_and_flushes_at_once() -> None:
    """The fast path's order of calls with stand-in UCX functions: the put, local progress while it
    is in flight and progress does work, then its release (UCX frees it once done) and the flush
    at once (not a wait for the put); a put UCX refused is reported and, nothing having been
    issued, no flush goes out."""
    s = StandInLane(request=0x1000, status=1, flush_request=0x2000)
    assert s.raw(0, 0, 64) == (2, 0x2000, None)
    assert s.log == ["put", "check 0x1000", "progress", "free 0x1000", "flush", "check 0x2000", "progress"]
    refused = StandInLane(refuse_at=0)
    code, _pending, statuses = refused.raw(0, 0, 64)
    assert code == 0 and statuses == bytes([ERR_IO & 0xFF]) and "flush" not in refused.log


def test_the_general_path_sends_a_write_flush_with_its_put(make_engine: Any, monkeypatch: Any) -> None:
    """Without a fast path (no extension module: no lane), a small write over tcp to a stopped
    target is handed off with its put and its flush both in flight."""
    monkeypatch.setattr(ucp, "_native_module", lambda: None)
    with StoppableTarget() as target:
        ini = make_engine(TCP, transports=["ucx"])
        remote = ini.open(target.address, "kv", timeout=10)
        src = ini.allocate(4096)
        for _ in range(3):
            assert ini.write(src, remote, 0, 4096).result(5) == 4096  # attached and wired up
        tr = ini.transports["ucx"]

        def post() -> tuple[Any, list[tuple[bool, bool]]]:
            fut = ini.write(src, remote, 4096, 4096)
            end = time.monotonic() + 2
            while True:
                with tr._lock:
                    seen = [(bool(w.reqs), w.flush is not None) for w in tr._active]
                if seen or fut.done() or time.monotonic() > end:
                    return fut, seen
                time.sleep(0.001)

        src.view[:] = b"g" * 4096
        fut, seen = target.paused(0.3, post)
        assert fut.result(5) == 4096
        assert seen == [(True, True)], "the put was handed off alone: its flush waited for its ack"
        back = bytearray(4096)
        assert ini.read(back, remote, 4096).result(5) == 4096 and bytes(back) == b"g" * 4096
