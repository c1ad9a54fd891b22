"""The engine's inline lane (Transport.post_inline): small shm requests finished inside write().

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
    shm = ini.transports["shm"]
    seen: list[bool] = []
    real = shm.post_inline

    def counted(*a: Any) -> bool:
        ok = real(*a)
        seen.append(ok)
        return ok

    monkeypatch.setattr(shm, "post_inline", counted)
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
    monkeypatch.setattr(shm, "post_inline", lambda *a: False)
    assert ini.write(src, remote, 0, 64).result(5) == 64
    hits = threading.Event()

    def broken(*a: Any) -> bool:
        hits.set()
        raise RuntimeError("plugin bug")

    monkeypatch.setattr(shm, "post_inline", broken)
    with caplog.at_level(logging.ERROR, logger="mpcomm"):
        assert ini.write(src, remote, 0, 64).result(5) == 64  # the full path carried it
    assert hits.is_set() and "post_inline" in caplog.text


def test_revoked_region_fails_through_the_full_path(lane_pair: Any) -> None:
    target, ini, kv, remote, src = lane_pair
    target.unregister(kv)
    t = ini.write(src, remote, 0, 64)
    with pytest.raises((mpcomm.UnknownRegionError, mpcomm.StaleRegionError)):
        t.result(5)


def test_the_base_transport_declines() -> None:
    assert Transport.post_inline(Transport.__new__(Transport), "write", None, 0, None, 0, 1) is False  # type: ignore[arg-type]
