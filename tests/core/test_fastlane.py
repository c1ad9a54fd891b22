"""A bound pair's inline step (core/engine/_fastlane.c, the only one) against the full request path.

The C step (``bound.native_step``) runs a bound pair's plain request inline and
may only land what the full path (the same request with a ``route=`` hint)
lands, with the same outcome; what it declines, the full path raises or takes
on. It holds the local region's lease only while the move runs and leaves
nothing behind (no reference, no lease). It is driven with stand-ins for the
peer link and the move (:class:`Pair`), and through a real engine whose
transport's move is a stand-in (:class:`EnginePair`); the engine-level tests
show a real pair lands with the inline lane and without it (``MPCOMM_FASTLANE=0``).
"""

from __future__ import annotations

import gc
import logging
import math
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from types import SimpleNamespace
from typing import Any

import pytest
from core_support import fastlane_c

import mpcomm
from mpcomm.engine.bound import Binding, native_step
from mpcomm.health import HealthTracker
from mpcomm.memory import Region
from mpcomm.remote import RemoteRegion
from mpcomm.transfer import COMPLETED, Dispatch, Landed

LSIZE, RSIZE = 1 << 16, 1 << 15


class _Pipe:
    """What the C step is given of its pipeline: the engine's health, ``unbind`` (drops the pair from ``table``)."""

    def __init__(self, engine: Any, table: dict[Any, Any]) -> None:
        self.e = engine
        self.table = table

    def unbind(self, key: Any) -> None:
        self.table.pop(key, None)


class Pair:
    """A bound pair's C step with stand-ins only for what is not under test: the peer link, the move."""

    def __init__(self) -> None:
        self.local = Region(memoryview(bytearray(LSIZE)), name="src", access="rw")
        self.remote = RemoteRegion("127.0.0.1:1", "n", "e", "kv", 7, RSIZE, 0, "rw", 1)
        self.link = SimpleNamespace(alive=True)
        self.engine = SimpleNamespace(health=HealthTracker())
        self.table: dict[Any, Any] = {}
        self.moves: list[tuple[Any, ...]] = []
        self.answer: Any = True
        self.leases_seen: list[int] = []
        self.pushed: list[Any] = []
        self.pipe = _Pipe(self.engine, self.table)
        self.dispatch = Dispatch(self.pushed.append, lambda: False, lambda t: None)
        self.key = (id(self.local), id(self.remote), "write")
        self.fast = Binding("write", self.local, self.remote, self.link, SimpleNamespace(name="shm"),  # type: ignore[arg-type]
                            (), "default", ("shm", "tcp"), self.move, self.dispatch)
        self.run = native_step(self.fast, self.pipe)
        assert type(self.run).__name__ == "builtin_function_or_method"
        self.table[self.key] = self.run

    def move(self, lo: int, ro: int, n: int) -> Any:
        self.moves.append((lo, ro, n))
        self.leases_seen.append(self.local.leases)
        a = self.answer
        if isinstance(a, BaseException):
            raise a
        return a(lo, ro, n) if callable(a) else a


ARGS = [
    (0, 0, None, None), (0, 0, 16, None), (16, 32, 4096, 5), (0, 0, 16, 0.5), (LSIZE - 8, 0, None, None),
    (0, RSIZE - 8, 8, None), (0, 0, 0, None), (LSIZE, 0, None, None),
    # declined: the full path raises the proper error for each
    (-1, 0, 16, None), (0, -1, 16, None), (0, 0, -1, None), (0, 0, RSIZE + 1, None), (0, 0, None, None),
    (LSIZE - 8, 0, 16, None), (0, RSIZE - 8, 16, None), (LSIZE + 1, 0, None, None),
    (True, 0, 16, None), (0, False, 16, None), (0, 0, 16.0, None), (1.0, 0, 16, None), ("0", 0, 16, None),
    (0, 0, 10**30, None), (10**30, 0, 16, None), (0, 0, 16, 0), (0, 0, 16, -1), (0, 0, 16, math.nan),
    (0, 0, 16, math.inf), (0, 0, 16, True), (0, 0, 16, "1"), (0, 0, 16, 1e-9),
    # near the int64 limits (issue 28: `lo + n > lsize` wrapped and the C lane moved from lo = 2**63 - 1)
    (2**63 - 1, 0, 8, None), (0, 2**63 - 1, 8, None), (0, 0, 2**63 - 1, None), (2**63 - 8, 2**63 - 8, 8, None),
    (2**62, 0, 2**62, None), (2**63 - 1, 0, None, None), (2**63, 0, 8, None), (2**64 - 1, 0, 8, None),
    (0, 0, 2**64 - 1, None), (LSIZE - 1, 0, 2**63 - 1, None), (0, RSIZE + 1, 0, None),
]


def _outcome(pair: Pair, args: tuple[Any, ...]) -> Any:
    h = pair.run(*args)
    if h is None:
        return None
    r = h.request
    assert r.local is pair.local and r.remote is pair.remote
    return (h.bytes_moved, h.transport, h.route, h.route_rule, (r.op, r.remote_offset, r.length, r.local_offset),
            sorted(vars(h)), h.status)


class EnginePair:
    """A real engine's pair (LSIZE bytes to RSIZE over shm), bound with its C step to a stand-in
    move as :class:`Pair`'s; :meth:`full` sends the same request down the full path instead
    (a ``route=`` hint: no binding, the transport's post())."""

    def __init__(self) -> None:
        self.target = mpcomm.Engine(transports=["shm"])
        self.ini = mpcomm.Engine(transports=["shm"])
        self.target.allocate(RSIZE, name="kv")
        self.remote = self.ini.open(self.target.address, "kv")
        self.local = self.ini.allocate(LSIZE, name="src")
        self.moves: list[tuple[Any, ...]] = []
        self.leases_seen: list[int] = []
        self.answer: Any = True
        self.ini.transports["shm"].inline_path = lambda kind, local, remote: self.move
        assert self.ini.write(self.local, self.remote, 0, 16).result(5) == 16  # routed in full: the route cached
        assert isinstance(self.ini.write(self.local, self.remote, 0, 16), Landed)  # the stand-in moved it: bound
        self.key = (id(self.local), id(self.remote), "write")
        self.pipe = self.ini._pipeline
        assert self.key in self.pipe.bindings and self.key in self.pipe.native
        self.binding = self.pipe.bindings[self.key]
        self.moves.clear()
        self.leases_seen.clear()

    move = Pair.move

    def write(self, lo: Any, ro: Any, n: Any, timeout: Any, route: Any = None) -> Any:
        return self.ini.write(self.local, self.remote, ro, n, local_offset=lo, timeout=timeout, route=route)

    def outcome(self, args: tuple[Any, ...]) -> Any:
        """("landed", bytes, request, fields, status) for a handle born done, ("posted", result) for one
        the transport answers, or ("raised", class)."""
        try:
            h = self.write(*args)
        except Exception as exc:  # noqa: BLE001 - the outcome compared
            return ("raised", type(exc))
        if isinstance(h, Landed):
            r = h.request
            return ("landed", h.bytes_moved, (r.op, r.remote_offset, r.length, r.local_offset), sorted(vars(h)),
                    h.status)
        try:
            return ("posted", h.result(5))
        except Exception as exc:  # noqa: BLE001 - e.g. a float length the full path posts (not this test's concern)
            return ("posted", type(exc))

    def full(self, args: tuple[Any, ...]) -> Any:
        """The same request down the full path: ("posted", result, request), or ("raised", class)."""
        try:
            h = self.write(*args, route="shm")
            r = h.request
            return ("posted", h.result(5), (r.op, r.remote_offset, r.length, r.local_offset))
        except Exception as exc:  # noqa: BLE001 - the outcome compared
            return ("raised", type(exc))

    def close(self) -> None:
        self.ini.close(timeout=5)
        self.target.close(timeout=5)


@pytest.fixture
def one() -> Any:
    p = EnginePair()
    yield p
    p.close()


#: What the C step declines although the full path takes it: a type only the one check converts
#: (bool and float offsets or lengths, a bool timeout).
TAKEN_BY_THE_FULL_PATH_ONLY = {(True, 0, 16, None), (0, False, 16, None), (0, 0, 16.0, None), (1.0, 0, 16, None),
                               (0, 0, 16, True)}


def test_the_c_step_lands_what_the_full_path_lands_and_declines_what_it_refuses(one: EnginePair) -> None:
    """Each of ARGS through the C step (a stand-in pair) and down the full path (a real engine,
    route= hint): whatever C lands, the full path moves the same bytes for the same request, and
    what C declines, the full path raises (but for the few a type rule of the one check takes)."""
    # RSIZE < LSIZE: a whole-region write (length None) does not fit the remote one.
    for args in ARGS:
        c = Pair()
        got_c = _outcome(c, args)
        got_full = one.full(args)
        if got_c is None:
            assert c.moves == [] and (got_full[0] == "raised" or args in TAKEN_BY_THE_FULL_PATH_ONLY), (args, got_full)
        else:
            assert got_full == ("posted", got_c[0], got_c[4]), args
            assert c.moves == [(got_c[4][3], got_c[4][1], got_c[4][2])], args
        assert c.local.leases == one.local.leases == 0, args


def test_a_bound_engine_pair_takes_the_full_routing_for_what_changed_after_binding(one: EnginePair) -> None:
    one.binding.link.alive = False  # as the link's reader marks a lost peer
    assert one.outcome((0, 0, 16, None)) == ("posted", 16) and one.moves == []
    one.binding.link.alive = True
    one.ini.health.failure(one.remote.address, "shm")
    assert one.outcome((0, 0, 16, None)) == ("posted", 16) and one.moves == []
    one.ini.health.success(one.remote.address, "shm")
    one.answer = False  # the move declines (a shut gate, a revoked region): asked anew, declines again
    assert one.outcome((0, 0, 16, None)) == ("posted", 16)
    assert one.moves == [(0, 0, 16), (0, 0, 16)] and one.local.leases == 0
    one.answer = True
    assert one.outcome((0, 0, 16, None))[0] == "landed" and one.key in one.pipe.bindings


def test_a_closed_engine_runs_no_c_step_and_binds_no_pair(one: EnginePair, monkeypatch: pytest.MonkeyPatch) -> None:
    """The C step reads no engine state: Engine.close empties the tables of C steps after setting
    ``closed`` (a write while it still waits for the requests in flight raises), and a pair kept
    while it closes is let go of at once."""
    during: list[Any] = []
    real = one.pipe.close

    def close(timeout: float) -> None:  # the engine is closing: it waits for the requests in flight
        during.append(one.outcome((0, 0, 16, None)))
        real(timeout)

    monkeypatch.setattr(one.pipe, "close", close)
    one.ini.close(timeout=5)
    assert during == [("raised", mpcomm.errors.EngineClosedError)]
    assert not one.pipe.native and not one.pipe.bindings
    with pytest.raises(mpcomm.errors.EngineClosedError):
        one.write(0, 0, 16, None)
    assert one.moves == []
    one.pipe._keep(one.binding, lambda *a: None)  # kept by a request that passed the check before close
    assert not one.pipe.native and not one.pipe.bindings


def test_a_bound_engine_pair_refuses_an_unregistering_region_holding_no_lease(one: EnginePair) -> None:
    one.local._refusing = True  # what close() sets first
    with pytest.raises(mpcomm.errors.RegionClosedError):
        one.write(0, 0, 16, None)
    assert one.moves == [] and one.local.leases == 0
    one.local._refusing = False


def test_a_bound_engine_pair_logs_a_move_that_raises_and_routes_in_full(one: EnginePair,
                                                                caplog: pytest.LogCaptureFixture) -> None:
    one.answer = ValueError("plugin bug")
    with caplog.at_level(logging.ERROR, logger="mpcomm.engine"):
        assert one.outcome((0, 0, 16, None)) == ("posted", 16)
    rec = [r for r in caplog.records if "inline_path move" in r.getMessage()]
    assert rec and rec[0].exc_info and rec[0].exc_info[1] is one.answer
    assert "test_fastlane.py" in caplog.text and one.local.leases == 0


def test_an_interrupt_in_a_bound_engine_pairs_move_goes_up_with_the_lease_released(one: EnginePair) -> None:
    one.answer = KeyboardInterrupt()
    with pytest.raises(KeyboardInterrupt):
        one.write(0, 0, 16, None)
    assert one.local.leases == 0

    def bad(lo: int, ro: int, n: int) -> Any:
        class Bool:
            def __bool__(self) -> bool:
                raise RuntimeError("no truth")
        return Bool()

    one.answer = bad  # a truthiness that raises is a plugin bug too: declined, routed in full
    assert one.outcome((0, 0, 16, None)) == ("posted", 16) and one.local.leases == 0


def test_unregister_waits_for_a_request_inside_a_bound_engine_pairs_move(one: EnginePair) -> None:
    inside, go = threading.Event(), threading.Event()

    def slow(lo: int, ro: int, n: int) -> bool:
        inside.set()
        assert go.wait(5)
        return True

    one.answer = slow
    out: list[Any] = []
    w = threading.Thread(target=lambda: out.append(one.write(0, 0, 16, None)))
    w.start()
    assert inside.wait(5)
    closed = threading.Thread(target=one.ini.unregister, args=(one.local,), kwargs={"timeout": 5})
    closed.start()
    time.sleep(0.1)
    assert closed.is_alive() and not one.local.closed  # held by the move
    go.set()
    w.join(5)
    closed.join(5)
    assert one.local.closed and out and isinstance(out[0], Landed)
    with pytest.raises(mpcomm.errors.RegionClosedError):
        one.write(0, 0, 16, None)
    assert one.key not in one.pipe.bindings


def test_a_landed_handle_is_whole_and_born_done() -> None:
    p = Pair()
    before = time.monotonic()
    h = p.run(16, 32, 4096, None)
    assert isinstance(h, Landed) and h.status is COMPLETED and h.done() and h.result(0) == 4096
    assert before <= h.submitted_at <= h.finished_at <= time.monotonic() and h.elapsed >= 0
    assert (h.transport, h.route, h.route_rule) == ("shm", ("shm", "tcp"), "default")
    r = h.request
    assert (r.op, r.local, r.remote, r.remote_offset, r.length, r.local_offset) == (
        "write", p.local, p.remote, 32, 4096, 16)
    assert p.leases_seen == [1] and p.local.leases == 0
    got: list[Any] = []
    h.add_done_callback(got.append)
    assert got == [h]


def test_what_changes_after_binding_makes_the_lane_decline() -> None:
    p = Pair()
    p.link.alive = False
    assert p.run(0, 0, 16, None) is None
    p.link.alive = True
    paths, peers = p.engine.health.failure_tables()
    peers["127.0.0.1:1"] = object()
    assert p.run(0, 0, 16, None) is None
    peers.clear()
    paths[("127.0.0.1:1", "shm")] = object()
    assert p.run(0, 0, 16, None) is None
    paths.clear()
    p.answer = False  # the transport's move declines (a shut gate, a revoked region)
    assert p.run(0, 0, 16, None) is None
    assert p.moves == [(0, 0, 16)] and p.local.leases == 0
    p.answer = True
    assert p.run(0, 0, 16, None) is not None and p.key in p.table


def test_an_unregistering_region_unbinds_the_pair_and_holds_no_lease() -> None:
    p = Pair()
    p.local._refusing = True  # what close() sets first
    assert p.run(0, 0, 16, None) is None
    assert p.moves == [] and p.local.leases == 0 and p.key not in p.table


def test_a_move_that_raises_is_logged_and_declines(caplog: pytest.LogCaptureFixture) -> None:
    p = Pair()
    p.answer = ValueError("plugin bug")
    with caplog.at_level(logging.ERROR, logger="mpcomm.engine"):
        assert p.run(0, 0, 16, None) is None
    rec = [r for r in caplog.records if "inline_path move" in r.getMessage()]
    assert rec and rec[0].exc_info and rec[0].exc_info[1] is p.answer
    assert "test_fastlane.py" in caplog.text  # the traceback reaches the log
    assert p.local.leases == 0


def test_an_interrupt_in_the_move_goes_up_with_the_lease_released() -> None:
    p = Pair()
    p.answer = KeyboardInterrupt()
    with pytest.raises(KeyboardInterrupt):
        p.run(0, 0, 16, None)
    assert p.local.leases == 0

    def bad(lo: int, ro: int, n: int) -> Any:
        class Bool:
            def __bool__(self) -> bool:
                raise RuntimeError("no truth")
        return Bool()

    p.answer = bad  # a truthiness that raises is a plugin bug too: declined
    assert p.run(0, 0, 16, None) is None and p.local.leases == 0


def test_unregister_waits_for_a_request_inside_the_move() -> None:
    """close() waits while the lane's lease is held, and is woken when the lane lets go."""
    p = Pair()
    inside, go = threading.Event(), threading.Event()

    def slow(lo: int, ro: int, n: int) -> bool:
        inside.set()
        assert go.wait(5)
        return True

    p.answer = slow
    out: list[Any] = []
    w = threading.Thread(target=lambda: out.append(p.run(0, 0, 16, None)))
    w.start()
    assert inside.wait(5)
    closed = threading.Thread(target=p.local.close, kwargs={"timeout": 5})
    closed.start()
    time.sleep(0.1)
    assert closed.is_alive() and not p.local.closed  # held by the move
    go.set()
    w.join(5)
    closed.join(5)
    assert p.local.closed and out and out[0] is not None
    assert p.run(0, 0, 16, None) is None and p.key not in p.table  # refused from now on


def test_the_c_lane_keeps_no_reference() -> None:
    p = Pair()
    watched = [p.local, p.remote, p.link, p.engine, p.fast]
    for _ in range(50):
        p.run(0, 0, 16, None)
    gc.collect()
    before = [sys.getrefcount(o) for o in watched]
    for _ in range(2000):
        h = p.run(0, 0, 16, None)
        h.request  # builds the Request once
        p.run(-1, 0, 16, None)
    del h
    p.answer = ValueError("x")
    logging.getLogger("mpcomm.engine").disabled = True
    try:
        for _ in range(200):
            p.run(0, 0, 16, None)
    finally:
        logging.getLogger("mpcomm.engine").disabled = False
    gc.collect()
    assert [sys.getrefcount(o) for o in watched] == before
    del p.table[p.key]
    run = p.run
    del p.run
    assert sys.getrefcount(run) == 2  # nothing but this name holds it: no cycle through the pair


# -- through a real engine --------------------------------------------------------------


@contextmanager
def _shm_pair(native: bool, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Any, Any, Any, Any]]:
    """Two shm engines with the inline lane (a bound pair's C step) or without it (MPCOMM_FASTLANE=0:
    the pair's binding is posted): ``(target, initiator, kv, remote)`` with a 1 MiB target region "kv"."""
    if not native:
        monkeypatch.setenv("MPCOMM_FASTLANE", "0")
    with mpcomm.Engine(transports=["shm"]) as target, mpcomm.Engine(transports=["shm"]) as ini:
        kv = target.allocate(1 << 20, name="kv")
        yield target, ini, kv, ini.open(target.address, "kv")


@pytest.mark.parametrize("native", [True, False], ids=["c", "off"])
def test_a_bound_shm_pair_lands_through_each_lane(native: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    with _shm_pair(native, monkeypatch) as (target, ini, kv, remote):
        src = ini.allocate(1 << 16, name="src")
        src.view[:4096] = b"\x11" * 4096
        for _ in range(2):  # the first connects and caches the route; the second lands inline and binds
            assert ini.write(src, remote, 0, 4096).result(5) == 4096
        assert ini._pipeline.bindings, "the pair should be bound after an inline write"
        runs = list(ini._pipeline.native.values())  # the bound pairs' C steps
        assert bool(runs) is native
        assert all(type(r).__name__ == "builtin_function_or_method" for r in runs)
        for i in range(1, 64):
            src.view[:4096] = bytes([i]) * 4096
            t = ini.write(src, remote, i * 4096, 4096)
            assert t.done() and t.transport == "shm" and t.result(0) == 4096
        assert all(bytes(kv.view[i * 4096:(i + 1) * 4096]) == bytes([i]) * 4096 for i in range(1, 64))
        dst = ini.allocate(1 << 16, name="dst")
        assert ini.read(dst, remote, 5 * 4096, 4096).result(5) == 4096
        assert bytes(dst.view[:4096]) == b"\x05" * 4096
        with pytest.raises(mpcomm.OutOfBoundsError):
            ini.write(src, remote, (1 << 20) - 8, 4096)
        ini.unregister(src)
        with pytest.raises(mpcomm.errors.RegionClosedError):
            ini.write(src, remote, 0, 4096)
        assert not ini._pipeline.native and not ini._pipeline.bindings


class _Shadowed(Region):
    """A region whose ``_refusing`` is a property: the protocol's slot stays unset beneath it."""

    @property  # type: ignore[override]
    def _refusing(self) -> bool:
        raise LookupError("no _refusing today")

    @_refusing.setter
    def _refusing(self, value: bool) -> None:
        pass


def test_the_c_step_reads_the_lease_state_from_the_regions_slots(monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 28: the C lane looked ``_refusing`` up per request (and, when that failed, called into
    Python with the exception pending). It now reads the region's slots (memory.LEASE_SLOTS): no
    lookup, no Python call; an unset slot refuses, holding nothing; a subclass's slots are the
    region's; lane() takes slots of the region's class only."""
    p = Pair()
    seen: list[tuple[Any, ...]] = []
    real = fastlane_c("lane")
    monkeypatch.setattr(fastlane_c(), "lane", lambda *args: seen.append(args) or real(*args))
    for cls in (Region, _Shadowed):
        local = cls(memoryview(bytearray(LSIZE)), name="src", access="rw")
        p.local = local
        p.fast = Binding("write", local, p.remote, p.link, SimpleNamespace(name="shm"),  # type: ignore[arg-type]
                         (), "default", ("shm",), p.move, p.dispatch)
        p.key = p.fast.key
        p.table[p.key] = p.run = native_step(p.fast, p.pipe)
        if cls is Region:
            assert p.run(0, 0, 16, None) is not None and p.moves[-1] == (0, 0, 16)
        else:
            p.moves.clear()
            assert p.run(0, 0, 16, None) is None and p.moves == [] and p.key not in p.table
        assert local.leases == 0
    args = list(seen[0])
    at = next(i for i, a in enumerate(args) if a is mpcomm.memory.LEASE_SLOTS)
    for slots in (Landed.FIELDS[:2], mpcomm.memory.LEASE_SLOTS[:1], (property(lambda s: False),) * 2):
        args[at] = slots
        with pytest.raises(TypeError):
            real(*args)


def test_a_region_open_again_after_a_refused_lease_gets_its_c_step_back() -> None:
    """The C step unbinds the whole pair (binding and C step) when its region refuses a lease (a
    close under way); a close that timed out leaves the region open, and the pair binds again."""
    with mpcomm.Engine(transports=["shm"]) as target, mpcomm.Engine(transports=["shm"]) as ini:
        target.allocate(1 << 20, name="kv")
        remote = ini.open(target.address, "kv")
        src = ini.allocate(1 << 16, name="src")
        for _ in range(2):
            assert ini.write(src, remote, 0, 4096).result(5) == 4096
        key = (id(src), id(remote), "write")
        assert key in ini._pipeline.native and key in ini._pipeline.bindings
        src._refusing = True  # what close() sets first
        with pytest.raises(mpcomm.errors.RegionClosedError):
            ini.write(src, remote, 0, 4096)
        assert key not in ini._pipeline.native and key not in ini._pipeline.bindings
        src._refusing = False  # the close timed out: open again
        assert isinstance(ini.write(src, remote, 0, 4096), Landed)
        assert key in ini._pipeline.native and key in ini._pipeline.bindings


@pytest.mark.parametrize("native", [True, False], ids=["c", "off"])
def test_the_write_step_finds_each_pair_and_nothing_after_its_unbinding(native: bool,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Engine.write's first step looks its pair's C step up each time: two pairs in turn land each in
    its place, and a pair dropped from the table (forget_fast: routes changed) is no longer run."""
    with _shm_pair(native, monkeypatch) as (target, ini, kv, remote):
        a, b = ini.allocate(4096, name="a"), ini.allocate(4096, name="b")
        a.view[:] = b"\xaa" * 4096
        b.view[:] = b"\xbb" * 4096
        for _ in range(2):
            ini.write(a, remote, 0, 4096).result(5)
            ini.write(b, remote, 4096, 4096).result(5)
        assert len(ini._pipeline.native) == (2 if native else 0)
        for i in range(8):
            src = a if i % 2 == 0 else b
            kv.view[i * 4096:(i + 1) * 4096] = b"\0" * 4096
            assert ini.write(src, remote, i * 4096, 4096).result(0) == 4096
            assert bytes(kv.view[i * 4096:(i + 1) * 4096]) == bytes(src.view)
        ini._pipeline.forget_fast()
        seen: list[Any] = []
        real = ini._pipeline.single
        monkeypatch.setattr(ini._pipeline, "single", lambda *args: seen.append(args) or real(*args))
        assert ini.write(a, remote, 0, 4096).result(5) == 4096
        assert len(seen) == 1, "a forgotten pair must take the one Python path"


def test_a_handles_attributes_take_the_plain_lookup_and_its_future_is_built_on_demand() -> None:
    """No __getattr__ hook on Transfer (a class with one pays a slower lookup for every attribute,
    result() included: issue 28, shm 4 KiB latency); the Future base is still built on the first
    read of one of its fields, for a born-done handle and for a posted one."""
    import concurrent.futures as cf

    assert not hasattr(mpcomm.Transfer, "__getattr__") and not hasattr(Landed, "__getattr__")
    p = Pair()
    h = p.run(0, 0, 64, None)
    assert isinstance(h, Landed) and "_future_built" not in h.__dict__
    with pytest.raises(AttributeError):
        h.no_such_field  # noqa: B018
    assert "_future_built" not in h.__dict__
    done, pending = cf.wait([h], timeout=0)
    assert done == {h} and not pending and "_future_built" in h.__dict__
    assert list(cf.as_completed([h], timeout=1)) == [h] and h.result(0) == 64
    t = mpcomm.Transfer()
    assert not t._built
    fut_state = t._state  # builds it
    assert t._built and fut_state == "PENDING"


def test_the_c_step_takes_only_object_slots_of_the_handle_class_as_its_fields(monkeypatch: pytest.MonkeyPatch) -> None:
    """The C step stores a born-done handle's five fields straight into their slots (issue 28, shm
    4 KiB latency): lane() refuses anything else as FIELDS (a property, another class's slot)."""
    mod = fastlane_c()
    seen: list[tuple[Any, ...]] = []
    real = mod.lane
    monkeypatch.setattr(mod, "lane", lambda *args: seen.append(args) or real(*args))
    p = Pair()
    assert p.run is not None and len(seen) == 1
    args = list(seen[0])
    at = next(i for i, a in enumerate(args) if a is Landed.FIELDS)

    class Other:
        __slots__ = ("a", "b", "c", "d", "e")

    settable = property(lambda self: None, lambda self, v: None)
    for fields in ((settable,) * 5, (Other.a, Other.b, Other.c, Other.d, Other.e), Landed.FIELDS[:4]):
        args[at] = fields
        with pytest.raises(TypeError):
            real(*args)
    args[at] = Landed.FIELDS
    assert callable(real(*args))
    size_at = args.index(LSIZE)  # the sizes, converted once here: exact ints in [0, 2**63) only
    for size in (-1, 2**63, 2**64 - 1, float(LSIZE), True):
        args[size_at] = size
        with pytest.raises(TypeError):
            real(*args)
