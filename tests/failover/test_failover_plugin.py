"""Failover through a real plugin: ``faulty`` (tests/failover/faulty_plugin) first, tcp second.

The faulty transport is installed through its entry point (conftest.py) and
fails every N-th request *after moving part of its range corrupted*, so the
only way the destination ends up right is a retry that moves the whole range
again on the next transport of the route, within the request's deadline.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import time
from concurrent.futures import CancelledError

import pytest

import mpcomm
from mpcomm.errors import OutOfBoundsError, PeerConnectionError, PermissionDeniedError, StaleRegionError

RULES = [{"name": "faulty-first", "transports": ["faulty", "tcp"]}]
TIMEOUT = 20.0


def _cfg(**faulty: object) -> dict:
    return {"route": RULES, "plugins": {"faulty": dict(faulty)}}


def _pair(initiator_opts: dict, target_opts: dict | None = None):
    target = mpcomm.Engine(_cfg(**(target_opts or {})), transports=["faulty", "tcp"], endpoint="127.0.0.1:0")
    try:
        initiator = mpcomm.Engine(_cfg(**initiator_opts), transports=["faulty", "tcp"], endpoint="127.0.0.1:0")
    except BaseException:
        target.close()
        raise
    return target, initiator


def _sha(b: object) -> str:
    return hashlib.sha256(memoryview(b)).hexdigest()  # type: ignore[arg-type]


def test_the_plugin_is_found_through_its_entry_point(faulty) -> None:
    with mpcomm.Engine(_cfg(), transports=["faulty", "tcp"], endpoint="127.0.0.1:0") as e:
        assert list(e.transports) == ["faulty", "tcp"]
        status = {s.name: s for s in e.transport_status()}
        assert status["faulty"].distribution == "mpcomm-test-faulty" and status["faulty"].running


def test_writes_fail_over_to_tcp_and_every_byte_arrives(faulty) -> None:
    target, initiator = _pair({"fail_every": 2})
    with target, initiator:
        sizes = [1, 4096, 65536 + 7, 300_000, 1 << 20, 3 << 20] * 3
        total = sum(sizes)
        kv = target.allocate(total, "kv")
        remote = initiator.open(target.address, "kv")
        src = bytearray(os.urandom(total))
        handles = []
        off = 0
        for n in sizes:  # one at a time: which ones fail is then exactly every second post
            t = initiator.write(memoryview(src)[off:off + n], remote, remote_offset=off, timeout=TIMEOUT)
            assert t.result(TIMEOUT) == n
            assert t.elapsed is not None and t.elapsed < TIMEOUT
            handles.append(t)
            off += n
        assert _sha(kv.view) == _sha(src), "the destination differs from the source"
        assert all(t.route == ("faulty", "tcp") and t.route_rule == "faulty-first" for t in handles)
        via = [t.transport for t in handles]
        assert via == ["faulty", "tcp"] * (len(sizes) // 2), via
        injected = faulty.counters["injected"]
        assert injected == len(sizes) // 2
        h = initiator.stats()["health"]
        assert h["retries"]["total"] == injected
        assert h["failovers"]["total"] == injected
        assert h["failovers"]["by_peer"] == {target.address: injected}
        assert h["failover_paths"] == {"faulty->tcp": injected}


def test_reads_fail_over_and_the_local_range_is_rewritten(faulty) -> None:
    target, initiator = _pair({"fail_every": 1})  # every read on faulty fails half-way
    with target, initiator:
        # A cool-down a loaded machine cannot outrun before the check at the end (50 ms by default).
        initiator.health.policy = dataclasses.replace(initiator.health.policy, base_cooldown=30.0)
        size = 2 << 20
        kv = target.allocate(size, "kv")
        data = os.urandom(size)
        kv.view[:] = data
        remote = initiator.open(target.address, "kv")
        dst = initiator.allocate(size)
        for k in range(4):
            t = initiator.read(dst, remote, remote_offset=k * (size // 4), length=size // 4,
                               local_offset=k * (size // 4), timeout=TIMEOUT)
            assert t.result(TIMEOUT) == size // 4
            assert t.transport == "tcp" and t.route == ("faulty", "tcp")
        assert _sha(dst.view) == _sha(data)
        # Three failures in a row pause the faulty path (health.pause_after): the
        # fourth read goes straight to tcp, without another failed attempt.
        pause_after = initiator.health.policy.pause_after
        assert pause_after == 3
        assert faulty.counters["injected"] == pause_after
        assert initiator.stats()["health"]["failovers"]["total"] == pause_after
        assert initiator.health.paused(target.address, "faulty")


def test_concurrent_writes_and_a_batch_all_land(faulty) -> None:
    target, initiator = _pair({"fail_every": 3})
    with target, initiator:
        n, piece = 64, 64 << 10
        kv = target.allocate(2 * n * piece, "kv")
        remote = initiator.open(target.address, "kv")
        src = initiator.allocate(2 * n * piece)
        src.view[:] = os.urandom(2 * n * piece)
        handles = [initiator.write(src, remote, remote_offset=i * piece, length=piece, local_offset=i * piece,
                                   timeout=TIMEOUT) for i in range(n)]
        batch = initiator.write_many(src, remote, [n * piece + i * piece for i in range(n)],
                                     [n * piece + i * piece for i in range(n)], [piece] * n, timeout=TIMEOUT)
        for t in handles:
            assert t.result(TIMEOUT) == piece
        batch.result(TIMEOUT)
        assert _sha(kv.view) == _sha(src.view)
        assert faulty.counters["injected"] > 0
        assert initiator.stats()["health"]["retries"]["total"] >= 1
        assert {t.transport for t in handles} <= {"faulty", "tcp"}


@pytest.mark.parametrize("refuse, exc", [("bounds", OutOfBoundsError), ("permission", PermissionDeniedError),
                                         ("stale", StaleRegionError)])
def test_errors_retrying_cannot_fix_are_not_retried(faulty, refuse: str, exc: type) -> None:
    target, initiator = _pair({"refuse": refuse})
    with target, initiator:
        kv = target.allocate(1 << 16, "kv")
        remote = initiator.open(target.address, "kv")
        t = initiator.write(b"\x5a" * 4096, remote, timeout=TIMEOUT)
        with pytest.raises(exc):
            t.result(TIMEOUT)
        assert t.transport == "faulty", "the request moved on to tcp although retrying cannot fix it"
        assert bytes(kv.view[:4096]) == bytes(4096), "bytes landed although the request failed"
        h = initiator.stats()["health"]
        assert h["retries"]["total"] == 0 and h["failovers"]["total"] == 0
        # ...and a request's own fault does not pause the path: the next one is tried on faulty again.
        t2 = initiator.write(b"\x5a" * 4096, remote, timeout=TIMEOUT)
        with pytest.raises(exc):
            t2.result(TIMEOUT)
        assert faulty.counters["injected"] == 2


def test_a_probe_ending_in_a_plugin_exception_frees_the_slot(faulty) -> None:
    """A transport whose post() raises (a plugin bug) fails the probe; the next request probes again."""
    target, initiator = _pair({"refuse": "a mode the plugin does not know"})  # post() raises ValueError
    with target, initiator:
        target.allocate(1 << 16, "kv")
        remote = initiator.open(target.address, "kv")
        h = initiator.health
        for _ in range(h.policy.pause_after):
            h.failure(target.address, "faulty", PeerConnectionError("reset by the test"))
        assert h.paused(target.address, "faulty")
        for attempt in range(1, 4):
            deadline = time.monotonic() + 10
            while h.paused(target.address, "faulty"):  # the cool-down (50 ms)
                assert time.monotonic() < deadline
                time.sleep(0.01)
            t = initiator.write(b"\x5a" * 4096, remote, timeout=TIMEOUT)
            with pytest.raises(mpcomm.MpcommError, match="transport faulty failed"):
                t.result(TIMEOUT)
            assert t.transport == "faulty"
            assert faulty.counters["injected"] == attempt  # it reached the transport: admitted as the probe
            assert h.path_state(target.address, "faulty")["probing"] is False


def test_a_cancelled_request_is_not_retried(faulty) -> None:
    target, initiator = _pair({})
    with target, initiator:
        size = 64 << 20
        target.allocate(size, "kv")
        remote = initiator.open(target.address, "kv")
        src = initiator.allocate(size)
        outcomes = []
        for _ in range(5):
            t = initiator.write(src, remote, timeout=TIMEOUT)
            t.cancel()
            try:
                t.result(TIMEOUT)
                outcomes.append("completed")
            except CancelledError:
                outcomes.append("cancelled")
            except mpcomm.MpcommError as e:  # an abort the target could not confirm
                outcomes.append(type(e).__name__)
            assert t.transport == "faulty"
        assert "cancelled" in outcomes, f"no cancel won the race against 64 MiB over loopback: {outcomes}"
        h = initiator.stats()["health"]
        assert h["retries"]["total"] == 0 and h["failovers"]["total"] == 0
