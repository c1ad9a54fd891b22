"""A bound tcp pair (engine/bound.py ``Binding`` without a move) over a real tcp target.

Once a plain request of a (local region, remote region, kind) pair was routed
to tcp, the pair is bound: its later requests take the one request path with
the cached routing, skipping the route decision (``Pipeline._launch`` and what
it calls), straight to a posted Operation. Each test checks one
promise: the bytes, what the handle says, and that anything the lane must not
decide (bad arguments, a closing region, a full queue, a failing path) gets
exactly the full path's answer.
"""

from __future__ import annotations

import hashlib
import threading
from typing import Any

import pytest

import mpcomm
from mpcomm.engine import requests
from mpcomm.errors import BackPressureError, MpcommError, OutOfBoundsError, RegionClosedError


def _bound(ini: mpcomm.Engine, local: Any, remote: Any, kind: str) -> Any:
    return ini._pipeline.bindings.get((id(local), id(remote), kind))


def _bound_write(spawn: Any, make_engine: Any, config: dict[str, Any] | None = None,
                 size: int = 1 << 16) -> tuple[Any, mpcomm.Engine, Any, Any]:
    """A tcp target, an initiator, and a local region whose writes to the target's "kv" are bound."""
    target = spawn()
    ini = make_engine(config)
    remote = ini.open(target.address, "kv")
    src = ini.allocate(size)
    for _ in range(2):  # the first routes the pair (the route cached), the second binds it from there
        assert ini.write(src, remote, 0, 4096).result(10) == 4096
    assert _bound(ini, src, remote, "write") is not None
    return target, ini, remote, src


class _Counting:
    """Counts requests that took the full routing (Pipeline._launch: link, route, admit, post)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.n = 0
        orig = requests.Pipeline._launch

        def launch(pipe: Any, *a: Any, **k: Any) -> Any:
            self.n += 1
            return orig(pipe, *a, **k)

        monkeypatch.setattr(requests.Pipeline, "_launch", launch)


def test_later_requests_of_a_pair_take_the_bound_lane(spawn: Any, make_engine: Any,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    target = spawn()
    ini = make_engine()
    remote = ini.open(target.address, "kv")
    src = ini.allocate(1 << 16)
    dst = ini.allocate(1 << 16)
    first = ini.write(src, remote, 0, 4096)
    assert first.result(10) == 4096
    assert ini.read(dst, remote, 0, 4096).result(10) == 4096
    # The first requests' full routing cached the route: every later one is bound from it (none routes).
    full = _Counting(monkeypatch)
    for i in range(20):
        src.view[:4096] = bytes([i]) * 4096
        t = ini.write(src, remote, 4096 * (i % 8), 4096)
        assert t.result(10) == 4096
        assert (t.transport, t.route, t.route_rule) == (first.transport, first.route, first.route_rule)
        assert t.status is mpcomm.TransferStatus.COMPLETED and t.bytes_moved == 4096
        assert target.cmd(f"sha kv {4096 * (i % 8)} 4096") == hashlib.sha256(bytes([i]) * 4096).hexdigest()
        assert ini.read(dst, remote, 4096 * (i % 8), 4096).result(10) == 4096
        assert bytes(dst.view[:4096]) == bytes([i]) * 4096
    assert full.n == 0
    assert _bound(ini, src, remote, "write") is not None and _bound(ini, dst, remote, "read") is not None
    assert t.request is not None and t.request.length == 4096 and t.request.remote_offset == 4096 * 3


def test_bad_arguments_get_the_full_paths_errors(spawn: Any, make_engine: Any) -> None:
    _target, ini, remote, src = _bound_write(spawn, make_engine)
    with pytest.raises(OutOfBoundsError):
        ini.write(src, remote, remote.size - 100, 4096)
    with pytest.raises(OutOfBoundsError):
        ini.write(src, remote, 0, 4096, local_offset=src.size - 10)
    with pytest.raises(MpcommError, match="timeout"):
        ini.write(src, remote, 0, 4096, timeout=0)
    with pytest.raises(MpcommError, match="timeout"):
        ini.write(src, remote, 0, 4096, timeout=float("nan"))
    with pytest.raises((MpcommError, TypeError)):
        ini.write(src, remote, "0", 4096)  # type: ignore[arg-type]
    assert ini.write(src, remote, 0, 4096).result(10) == 4096  # and the lane still works


def test_a_full_queue_is_the_full_paths_back_pressure(spawn: Any, make_engine: Any) -> None:
    _target, ini, remote, src = _bound_write(spawn, make_engine, {"runtime": {"queue_depth": 2,
                                                                            "backpressure": "raise"}})
    slots = ini._pipeline.slots
    assert slots.try_acquire() and slots.try_acquire()  # every slot taken
    try:
        with pytest.raises(BackPressureError):
            ini.write(src, remote, 0, 4096)
        assert src._held == []  # declined before it held anything
    finally:
        slots.release()
        slots.release()
    assert ini.write(src, remote, 0, 4096).result(10) == 4096
    assert slots.in_use == 0


def test_unregistering_the_local_region_unbinds_it(spawn: Any, make_engine: Any) -> None:
    _target, ini, remote, src = _bound_write(spawn, make_engine)
    ini.unregister(src)
    assert _bound(ini, src, remote, "write") is None
    with pytest.raises(RegionClosedError):
        ini.write(src, remote, 0, 4096)


def test_a_region_closing_under_the_lane_is_refused_not_raced(spawn: Any, make_engine: Any) -> None:
    """close() waits for the lane's leases and, once closing, the lane takes none."""
    _target, ini, remote, src = _bound_write(spawn, make_engine)
    binding = _bound(ini, src, remote, "write")
    handles: list[Any] = []
    errors: list[BaseException] = []
    stop = threading.Event()

    def writer() -> None:
        while not stop.is_set():
            try:
                handles.append(ini.write(src, remote, 0, 4096))
            except RegionClosedError:
                return
            except BaseException as exc:  # noqa: BLE001
                errors.append(exc)
                return

    th = threading.Thread(target=writer)
    th.start()
    while len(handles) < 20:
        pass
    ini.unregister(src, timeout=10)
    stop.set()
    th.join(10)
    assert not th.is_alive() and errors == []
    for h in handles:
        assert h.result(10) == 4096  # every handle it gave out ended, and landed before close returned
    assert src._held == []
    # The binding is gone with the region, and none is made for it again: nothing is posted.
    assert binding is not None and _bound(ini, src, remote, "write") is None
    assert ini._pipeline._cached("write", src, remote, 0, 0, 4096, 5.0) is None
    assert _bound(ini, src, remote, "write") is None


def test_callbacks_chain_through_the_lane(spawn: Any, make_engine: Any) -> None:
    _target, ini, remote, src = _bound_write(spawn, make_engine)
    done = threading.Event()
    count = [0]

    def again(t: Any) -> None:
        assert t.result() == 4096
        count[0] += 1
        if count[0] == 300:
            done.set()
            return
        ini.write(src, remote, 0, 4096).add_done_callback(again)

    ini.write(src, remote, 0, 4096).add_done_callback(again)
    assert done.wait(30)


def test_close_resolves_what_the_lane_posted(spawn: Any, make_engine: Any) -> None:
    _target, ini, remote, src = _bound_write(spawn, make_engine, size=1 << 20)
    handles = [ini.write(src, remote, 0, 4096) for _ in range(50)]
    ini.close(timeout=10)
    for h in handles:
        assert h.done()
        try:
            assert h.result(0) == 4096
        except mpcomm.errors.EngineClosedError:
            pass
