"""A small write's flush goes out with its put: one round trip over tcp, not two.

Over tcp a put completes only when the target acknowledges it. The small-request path
(``Endpoint.rma_flush_now``: the helper's ``mpcomm_ucx_rma_one``, or the same calls in Python
without it) used to issue the endpoint flush only once the put had completed, so every 4 KiB
write waited for two acknowledgements in turn. Two workers of one process talk over real tcp
sockets here; the target worker is not progressed while the write is issued, so nothing can
have been acknowledged: the call must come back with the flush already in flight.
"""

from __future__ import annotations

import ctypes as C
import mmap
import time
from typing import Any

import pytest

from mpcomm.plugins.ucx import _native

ucp: Any = pytest.importorskip("mpcomm.plugins.ucx._ucp")

try:
    ucp.load()
except Exception as exc:  # noqa: BLE001 - no UCX here: nothing to test
    pytest.skip(f"UCX unavailable: {exc}", allow_module_level=True)


def _progress_until(done: Any, *workers: Any, timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < end, "timed out"
        for w in workers:
            w.progress()


@pytest.fixture(params=["helper", "python"])
def tcp_pair(request: Any, monkeypatch: Any) -> Any:
    if request.param == "helper":
        if _native.load() is None:
            pytest.skip(f"the ucx helper is not built here: {_native.reason}")
    else:
        monkeypatch.setattr(ucp, "_native_helper", lambda: None)
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
        yield tgt, ini, ep, rk, m, buf, src
    finally:
        ctx.close()


def test_a_write_comes_back_with_its_flush_in_flight_not_its_put(tcp_pair: Any) -> None:
    tgt, ini, ep, rk, m, buf, src = tcp_pair
    for i in range(5):
        src[:] = bytes([i + 1]) * 4096
        st = ep.rma_flush_now(True, ucp.buffer_address(src), 4096, m.address + 4096, rk)
        # The target was not progressed: no acknowledgement can have come back.
        assert isinstance(st, ucp.Request), st
        assert st.name == "ucp_ep_flush_nbx", "the put was left in flight alone: its flush waits for its ack"
        _progress_until(lambda: st.done, tgt, ini)
        assert st.status() == 0
        st.free()
        assert buf[4096:8192] == bytes([i + 1]) * 4096 and buf[4095] == 0 and buf[8192] == 0


def test_a_read_still_comes_back_with_its_get(tcp_pair: Any) -> None:
    tgt, ini, ep, rk, m, buf, src = tcp_pair
    buf[0:4096] = b"r" * 4096
    st = ep.rma_flush_now(False, ucp.buffer_address(src), 4096, m.address, rk)
    assert isinstance(st, ucp.Request) and st.name == "ucp_get_nbx"
    _progress_until(lambda: st.done, tgt, ini)
    assert st.status() == 0
    st.free()
    assert src[:] == b"r" * 4096


RMA = C.CFUNCTYPE(C.c_void_p, C.c_void_p, C.c_void_p, C.c_size_t, C.c_uint64, C.c_void_p, C.c_void_p)
CHECK = C.CFUNCTYPE(C.c_uint8, C.c_void_p)
FREE = C.CFUNCTYPE(None, C.c_void_p)
PROGRESS = C.CFUNCTYPE(C.c_uint, C.c_void_p)
FLUSH = C.CFUNCTYPE(C.c_void_p, C.c_void_p, C.c_void_p)


def test_rma_one_releases_a_put_waiting_for_its_peer_and_flushes_at_once() -> None:
    """The helper's order of calls with stand-in UCX functions: the put, local progress until it
    stops, then the put's release and the flush (not a wait for the put); a put that failed is
    reported and no flush is issued."""
    lib = _native.load()
    if lib is None:
        pytest.skip(f"the ucx helper is not built here: {_native.reason}")
    calls: list[str] = []
    state = {"put_status": 1}

    def check(r: int) -> int:
        calls.append(f"check {r:#x}")
        return (state["put_status"] if r == 0x1000 else 1) & 0xFF

    keep = (RMA(lambda *a: calls.append("put") or 0x1000), CHECK(check), FREE(lambda r: calls.append(f"free {r:#x}")),
            PROGRESS(lambda w: calls.append("progress") or 0), FLUSH(lambda ep, p: calls.append("flush") or 0x2000))
    fn, chk, rfree, progress, flush = (C.cast(k, C.c_void_p) for k in keep)
    pending = C.c_void_p()
    st = lib.mpcomm_ucx_rma_one(fn, chk, rfree, progress, flush, None, None, 0x2000, 64, 0x3000, None, None, None,
                                1, C.byref(pending))
    assert st == 2 and pending.value == 0x2000
    assert calls == ["put", "check 0x1000", "progress", "free 0x1000", "flush", "check 0x2000", "progress"]
    calls.clear()
    state["put_status"] = -3  # UCS_ERR_IO_ERROR
    pending = C.c_void_p()
    st = lib.mpcomm_ucx_rma_one(fn, chk, rfree, progress, flush, None, None, 0x2000, 64, 0x3000, None, None, None,
                                1, C.byref(pending))
    assert st == -3 and pending.value is None and "flush" not in calls
