"""The inline step of the one request path (Transport.inline_path): small shm requests finished inside write().

The lane must be invisible in behaviour: the same handle fields, the same
errors, the same callbacks, and the full path whenever it declines.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import pytest

import mpcomm
from mpcomm.transport import Transport


@pytest.fixture
def lane_pair() -> Any:
    target = mpcomm.Engine(transports=["shm"])
    ini = mpcomm.Engine(transports=["shm"])
    kv = target.allocate(1 << 20, name="kv")
    remote = ini.open(target.address, "kv")
    src = ini.allocate(1 << 20, name="src")
    ini.write(src, remote, 0, 4096).result(5)  # attaches and caches the route: later requests take the lane
    yield target, ini, kv, remote, src
    ini.close(timeout=5)
    target.close(timeout=5)


def _count_lane(monkeypatch: pytest.MonkeyPatch, ini: mpcomm.Engine) -> list[bool]:
    """What the moves the engine asks for from now on answer (a bound pair's move, asked for
    earlier, is not counted)."""
    shm = ini.transports["shm"]
    seen: list[bool] = []
    real = shm.inline_path

    def asked(kind: str, local: Any, remote: Any) -> Any:
        move = real(kind, local, remote)
        if move is None:
            return None

        def counted(lo: int, ro: int, n: int) -> bool:
            ok = move(lo, ro, n)
            seen.append(ok)
            return ok
        return counted

    monkeypatch.setattr(shm, "inline_path", asked)
    return seen


def test_small_write_and_read_finish_in_the_call(lane_pair: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    target, ini, kv, remote, src = lane_pair
    seen = _count_lane(monkeypatch, ini)
    src.view[:4096] = b"\x5a" * 4096
    t = ini.write(src, remote, 8192, 4096, local_offset=0)
    assert seen == [True]
    assert t.done() and t.status is mpcomm.TransferStatus.COMPLETED
    assert t.result(0) == 4096 and t.bytes_moved == 4096
    assert t.transport == "shm" and t.route == ("shm",) and t.route_rule is not None
    assert t.request.op == "write" and t.request.remote_offset == 8192 and t.request.length == 4096
    assert bytes(kv.view[8192:12288]) == b"\x5a" * 4096
    assert ini.stats()["requests_held"] == 0
    assert t.elapsed is not None and t.elapsed > 0  # the copy's time, as for any handle
    got: list[Any] = []
    t.add_done_callback(got.append)  # done: runs at once, on this thread
    assert got == [t]
    r = ini.read(src, remote, 8192, 4096, local_offset=4096)
    assert seen == [True, True] and r.result(0) == 4096
    assert bytes(src.view[4096:8192]) == b"\x5a" * 4096


def test_lane_keeps_the_full_paths_errors(lane_pair: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    target, ini, kv, remote, src = lane_pair
    seen = _count_lane(monkeypatch, ini)
    with pytest.raises(mpcomm.OutOfBoundsError):
        ini.write(src, remote, (1 << 20) - 100, 4096)
    with pytest.raises(mpcomm.MpcommError, match="timeout must be"):
        ini.write(src, remote, 0, 64, timeout=0)
    assert seen == []  # refused before any copy


def test_notification_and_completion_queue_take_the_full_path(lane_pair: Any,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    target, ini, kv, remote, src = lane_pair
    seen = _count_lane(monkeypatch, ini)
    ini.write(src, remote, 0, 64, notify=b"hello").result(5)
    assert target.wait_notification(timeout=5).data == b"hello"
    cq = ini.completion_queue()
    t = ini.write(src, remote, 0, 64, completion_queue=cq)
    assert cq.poll(timeout=5) == [t]
    assert seen == []


def test_a_declining_or_broken_lane_falls_back(lane_pair: Any, monkeypatch: pytest.MonkeyPatch,
                                               caplog: pytest.LogCaptureFixture) -> None:
    target, ini, kv, remote, src = lane_pair
    shm = ini.transports["shm"]
    monkeypatch.setattr(shm, "inline_path", lambda *a: lambda lo, ro, n: False)
    assert ini.write(src, remote, 0, 64).result(5) == 64
    assert not ini._pipeline.bindings  # a move that never landed binds nothing
    hits = threading.Event()

    def broken(*a: Any) -> bool:
        hits.set()
        raise RuntimeError("plugin bug")

    monkeypatch.setattr(shm, "inline_path", lambda *a: broken)
    with caplog.at_level(logging.ERROR, logger="mpcomm"):
        assert ini.write(src, remote, 0, 64).result(5) == 64  # the full path carried it
    assert hits.is_set() and "inline_path move" in caplog.text

    def asked_broken(*a: Any) -> Any:
        raise RuntimeError("plugin bug in inline_path")

    caplog.clear()
    monkeypatch.setattr(shm, "inline_path", asked_broken)
    with caplog.at_level(logging.ERROR, logger="mpcomm"):
        assert ini.write(src, remote, 0, 64).result(5) == 64
    assert "failed in inline_path" in caplog.text


def test_revoked_region_fails_through_the_full_path(lane_pair: Any) -> None:
    target, ini, kv, remote, src = lane_pair
    target.unregister(kv)
    t = ini.write(src, remote, 0, 64)
    with pytest.raises((mpcomm.UnknownRegionError, mpcomm.StaleRegionError)):
        t.result(5)


def test_the_base_transport_declines() -> None:
    assert Transport.post_inline(Transport.__new__(Transport), "write", None, 0, None, 0, 1) is False  # type: ignore[arg-type]
    assert Transport.inline_path(Transport.__new__(Transport), "write", None, None) is None  # type: ignore[arg-type]


# -- a bound pair (its binding keeps the move): later requests skip the route and the inline_path lookup ---


def _bind(ini: mpcomm.Engine, src: Any, remote: Any) -> None:
    for _ in range(2):  # the first lands through a move inline_path gave, and binds the pair
        assert ini.write(src, remote, 0, 64).result(5) == 64
    assert ini._pipeline.bindings, "the pair should be bound after an inline write"


def test_bound_lane_moves_without_asking_inline_path_again(lane_pair: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    target, ini, kv, remote, src = lane_pair
    _bind(ini, src, remote)
    seen = _count_lane(monkeypatch, ini)
    src.view[:4096] = b"\x3c" * 4096
    t = ini.write(src, remote, 4096, 4096)
    assert seen == [] and t.done() and t.result(0) == 4096  # landed in the call, through the bound move
    assert bytes(kv.view[4096:8192]) == b"\x3c" * 4096
    assert t.transport == "shm" and t.route == ("shm",) and t.request.remote_offset == 4096
    # The full path's errors, unchanged, for a bound pair.
    with pytest.raises(mpcomm.OutOfBoundsError):
        ini.write(src, remote, (1 << 20) - 100, 4096)
    with pytest.raises(mpcomm.OutOfBoundsError):
        ini.write(src, remote, 0, 64, local_offset=-1)
    with pytest.raises(mpcomm.MpcommError, match="timeout must be"):
        ini.write(src, remote, 0, 64, timeout=0)
    with pytest.raises(mpcomm.MpcommError, match="timeout must be"):
        ini.write(src, remote, 0, 64, timeout=float("nan"))
    # Long copies up to one chunk take the bound move too, counted in flight rather than under the lock.
    src.view[:512 << 10] = b"\x5b" * (512 << 10)
    big = ini.write(src, remote, 0, 512 << 10)
    assert seen == [] and big.done() and big.result(0) == 512 << 10
    assert bytes(kv.view[:512 << 10]) == b"\x5b" * (512 << 10)


@pytest.mark.parametrize("n", [64, 256 << 10])  # under the mapping's lock; counted in flight
def test_bound_lane_sees_revocation(lane_pair: Any, n: int) -> None:
    target, ini, kv, remote, src = lane_pair
    _bind(ini, src, remote)
    ini.write(src, remote, 0, n).result(5)
    target.unregister(kv)  # on return no peer may touch the memory: the bound move must decline
    t = ini.write(src, remote, 0, n)
    with pytest.raises((mpcomm.UnknownRegionError, mpcomm.StaleRegionError)):
        t.result(5)
    assert t.status is not mpcomm.TransferStatus.COMPLETED


def test_bound_lane_lets_go_of_an_unregistered_region(lane_pair: Any) -> None:
    target, ini, kv, remote, src = lane_pair
    _bind(ini, src, remote)
    ini.unregister(src)
    assert not ini._pipeline.bindings and not ini._pipeline.native  # nothing keeps the region (and its buffer) alive
    with pytest.raises(mpcomm.RegionClosedError):
        ini.write(src, remote, 0, 64)


def test_landed_handle_is_a_full_future(lane_pair: Any) -> None:
    import asyncio
    import concurrent.futures as cf

    target, ini, kv, remote, src = lane_pair
    _bind(ini, src, remote)
    handles = [ini.write(src, remote, 0, 64) for _ in range(3)]
    assert all(type(h).__name__ == "Landed" for h in handles)
    done, pending = cf.wait(handles, timeout=1)
    assert len(done) == 3 and not pending
    assert sorted(f.result() for f in cf.as_completed(handles, timeout=1)) == [64, 64, 64]
    assert handles[0].exception() is None and not handles[0].cancel() and not handles[0].running()

    async def main() -> list[int]:
        t = ini.write(src, remote, 0, 64)
        return [await t, await asyncio.wrap_future(ini.write(src, remote, 0, 64))]

    assert asyncio.run(main()) == [64, 64]
    order: list[str] = []
    t = ini.write(src, remote, 0, 64)
    t.add_done_callback(lambda h: order.append(h.status.value))
    assert order == ["completed"]


def test_the_bound_move_in_c_decides_as_the_one_rule() -> None:
    """The shm fast path is _copyloop.c's mover: for every (lo, ro, n) near the edges it moves
    exactly when both ranges fit (checks.fits), the right bytes and nothing else, and it declines
    once the target revoked the region. Without the compiled copy loop there is no fast path (no
    Python twin): inline_path is None, post_inline declines, and the request lands through the
    general path."""
    from mpcomm.engine import checks

    target = mpcomm.Engine(transports=["shm"])
    fast = mpcomm.Engine(transports=["shm"])
    slow = mpcomm.Engine({"plugins": {"shm": {"native": False}}}, transports=["shm"])
    try:
        kv = target.allocate(1 << 16, name="kv")
        remote = fast.open(target.address, "kv")
        src = fast.allocate(1 << 15, name="src")
        src.view[:] = bytes(range(256)) * 128
        fast.write(src, remote, 0, 64).result(5)  # attaches
        move = fast.transports["shm"].inline_path("write", src, remote)
        if type(move).__name__ != "Mover":
            pytest.skip("the compiled copy loop is not in use here")
        edges = [0, 1, 4095, 4096, (1 << 15) - 1, 1 << 15, (1 << 15) + 1, (1 << 16) - 1, 1 << 16, (1 << 16) + 1,
                 -1, 2**31, 2**32, 2**63 - 1, 2**64 - 1, -(2**63)]
        data = bytes(src.view)
        for lo in edges:
            for ro in edges:
                for n in edges:
                    kv.view[:] = b"\0" * (1 << 16)
                    fits = checks.fits(lo, n, 1 << 15) and checks.fits(ro, n, 1 << 16)
                    assert move(lo, ro, n) is fits, (lo, ro, n)
                    want = bytearray(1 << 16)
                    if fits:
                        want[ro:ro + n] = data[lo:lo + n]
                    assert bytes(kv.view) == bytes(want), (lo, ro, n)
        for odd in (True, 1.0, "1", None):  # not an exact int: the C move declines, the general path decides
            assert move(0, 0, odd) is False
        with pytest.raises(TypeError):
            move(0, 0)

        premote = slow.open(target.address, "kv")
        psrc = slow.allocate(1 << 15, name="src")
        psrc.view[:4096] = b"\x77" * 4096
        shm = slow.transports["shm"]
        assert slow.write(psrc, premote, 0, 64).result(5) == 64  # attaches
        assert shm.inline_path("write", psrc, premote) is None
        assert shm.post_inline("write", psrc, 0, premote, 0, 4096) is False
        t = slow.write(psrc, premote, 8192, 4096)
        assert t.result(5) == 4096 and t.transport == "shm"
        assert bytes(kv.view[8192:12288]) == b"\x77" * 4096

        target.unregister(kv)
        assert move(0, 0, 64) is False and move(0, 0, 1 << 15) is False
    finally:
        for e in (fast, slow, target):
            e.close(timeout=5)


def test_the_c_move_reads_the_mappings_error_through_its_slot_descriptor() -> None:
    """The mover reads a mapping's ``error`` at the offset of its slot, under the mapping's lock (no
    call per request: issue 28, shm 4 KiB latency); it takes only the descriptor of an object slot
    of the mapping's class, and declines once ``error`` is set."""
    import ctypes
    import operator
    import threading

    from mpcomm.plugins.shm import _copyloop
    from mpcomm.plugins.shm import transport as shm_transport

    mover = _copyloop.get().mover
    if mover is None:
        pytest.skip("the compiled copy loop is not in use here")
    m = shm_transport._Mapping("map", 0, 64, "rw", 0)
    dst, src = ctypes.create_string_buffer(64), ctypes.create_string_buffer(b"\x42" * 64, 64)
    lock = threading.Lock()

    def make(error: Any, mapping: Any) -> Any:
        return mover(lock.acquire, lock.release, error, m.enter, m.exit, mapping, 64, ctypes.addressof(dst),
                     ctypes.addressof(src), 64, -1, 64, 64, True, False, 0)

    class Other:
        __slots__ = ("error",)

    refused = ((operator.attrgetter("error"), m), (Other.error, m), (shm_transport._MAPPING_ERROR, Other()))
    for error, mapping in refused:
        with pytest.raises(TypeError):
            make(error, mapping)
    move = make(shm_transport._MAPPING_ERROR, m)
    assert move(0, 0, 64) is True and dst.raw == b"\x42" * 64 and not lock.locked()
    m.error = mpcomm.MpcommError("revoked")
    ctypes.memset(dst, 0, 64)
    assert move(0, 0, 64) is False and dst.raw == b"\0" * 64 and not lock.locked()
