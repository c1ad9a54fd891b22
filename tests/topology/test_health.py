"""Path cool-down, probes, quarantine, reconnect-once and retry rules, on a clock the test moves."""

from __future__ import annotations

import threading
import time
from concurrent.futures import CancelledError

import pytest

from mpcomm.errors import (
    BackPressureError,
    MpcommError,
    OutOfBoundsError,
    PeerConnectionError,
    PermissionDeniedError,
    ProtocolError,
    RegionBusyError,
    StaleRegionError,
    TransferTimeout,
    UnknownRegionError,
)
from mpcomm.health import (
    EpochWatch,
    HealthMetrics,
    HealthPolicy,
    HealthTracker,
    ManualClock,
    counts_against_path,
    is_retryable,
)

CONN = PeerConnectionError("reset")


def tracker(**kw) -> tuple[HealthTracker, ManualClock]:
    clock = ManualClock()
    return HealthTracker(HealthPolicy(**{"base_cooldown": 1.0, "max_cooldown": 8.0, "quarantine_after": 4, "pause_after": 1, **kw}),
                         clock), clock


def test_retry_classification() -> None:
    assert is_retryable(PeerConnectionError("x"))
    assert is_retryable(TransferTimeout("x"))
    assert is_retryable(BackPressureError("x"))
    assert is_retryable(RegionBusyError("x"))
    unconfirmed = TransferTimeout("x")
    unconfirmed.confirmed = False
    assert not is_retryable(unconfirmed)
    for exc in (OutOfBoundsError("x"), PermissionDeniedError("x"), StaleRegionError("x"), CancelledError(),
                UnknownRegionError("x"), ProtocolError("x"), MpcommError("x"), ValueError("x")):
        assert not is_retryable(exc), exc
    assert is_retryable(MpcommError("x", retryable=True))
    assert not is_retryable(StaleRegionError("x", retryable=True))  # re-open first; never as is


def test_cooldown_grows_and_probe_is_single() -> None:
    h, clock = tracker()
    assert h.admit("p", "rdma") == "ok"
    assert h.failure("p", "rdma", CONN)
    assert h.admit("p", "rdma") == "paused"
    assert h.admit("p", "tcp") == "ok"  # another path to the same peer is unaffected
    clock.advance(0.99)
    assert h.paused("p", "rdma")
    clock.advance(0.02)
    assert h.admit("p", "rdma") == "probe"
    assert h.admit("p", "rdma") == "paused"  # one probe at a time
    h.failure("p", "rdma", CONN)  # the probe failed: 2 s now
    clock.advance(1.5)
    assert h.admit("p", "rdma") == "paused"
    clock.advance(0.6)
    assert h.admit("p", "rdma") == "probe"
    h.success("p", "rdma")
    assert h.admit("p", "rdma") == "ok" and h.path_state("p", "rdma")["failures"] == 0


def test_a_requests_own_deadline_never_counts_against_the_path() -> None:
    h, clock = tracker()
    assert not counts_against_path(TransferTimeout("deadline"), deadline_passed=True)
    assert counts_against_path(PeerConnectionError("reset"), deadline_passed=True)  # a broken link, whenever
    assert not h.failure("p", "shm", TransferTimeout("the caller's 1 ms"), deadline_passed=True)
    assert h.path_state("p", "shm")["failures"] == 0 and h.admit("p", "shm") == "ok"
    # A timeout while the request still had time (a handshake past its own limit) is the path's.
    assert h.failure("p", "shm", TransferTimeout("handshake did not finish in time"))
    clock.advance(1.01)
    assert h.admit("p", "shm") == "probe"
    # The probe ends by its own deadline: not counted, and its slot is free for the next request.
    assert not h.failure("p", "shm", TransferTimeout("the probe's deadline"), deadline_passed=True)
    assert h.path_state("p", "shm") == {"failures": 1, "paused_for": 0.0, "probing": False}
    assert h.admit("p", "shm") == "probe"
    h.release_probe("p", "shm")  # cancelled: freed again
    assert h.admit("p", "shm") == "probe"
    h.success("p", "shm")
    assert h.admit("p", "shm") == "ok"


def test_a_peers_probe_slot_is_freed_by_an_uncounted_ending() -> None:
    h, clock = tracker(quarantine_after=2)
    h.failure("p", "a", CONN)
    h.failure("p", "b", CONN)
    assert h.quarantined("p")
    clock.advance(2.01)
    assert h.admit("p", "a") == "probe"
    assert h.quarantined("p")  # one probe at a time
    h.failure("p", "a", TransferTimeout("the probe's deadline"), deadline_passed=True)
    assert not h.quarantined("p") and h.admit("p", "a") == "probe"


def test_cooldown_is_capped() -> None:
    h, clock = tracker(quarantine_after=100)
    for _ in range(20):
        h.failure("p", "rdma", CONN)
    assert h.path_state("p", "rdma")["paused_for"] == pytest.approx(8.0)
    assert HealthPolicy(base_cooldown=0.05, max_cooldown=30, pause_after=1).cooldown(10_000) == 30


def test_usable_skips_paused_paths_in_order() -> None:
    h, clock = tracker()
    h.failure("p", "rdma", CONN)
    assert h.usable("p", ["rdma", "ucx", "tcp"]) == [("ucx", "ok"), ("tcp", "ok")]
    clock.advance(1.0)
    assert h.usable("p", ["rdma", "ucx", "tcp"]) == [("rdma", "probe"), ("ucx", "ok"), ("tcp", "ok")]


def test_request_faults_do_not_count_and_release_the_probe() -> None:
    h, clock = tracker()
    assert not h.failure("p", "tcp", OutOfBoundsError("past the end"))
    assert h.admit("p", "tcp") == "ok"
    h.failure("p", "tcp", CONN)
    clock.advance(1.0)
    assert h.admit("p", "tcp") == "probe"
    h.failure("p", "tcp", PermissionDeniedError("read-only"))  # says nothing about the path
    assert h.admit("p", "tcp") == "probe"  # the probe slot is free again


def test_quarantine_after_consecutive_failures_across_paths() -> None:
    h, clock = tracker()
    for t in ("rdma", "ucx", "tcp"):
        h.failure("bad", t, CONN)
    assert not h.quarantined("bad")
    h.failure("bad", "tcp", CONN)
    assert h.quarantined("bad")
    assert h.metrics.snapshot()["quarantines"] == {"total": 1, "by_peer": {"bad": 1}}
    # every path to it is refused, even one that never failed ...
    assert h.admit("bad", "shm") == "paused"
    # ... while a healthy peer is untouched
    assert h.admit("good", "tcp") == "ok"
    clock.advance(1.0)  # quarantine cool-down over; the path cool-downs of rdma/ucx too
    assert h.admit("bad", "shm") == "probe"
    assert h.admit("bad", "ucx") == "paused"  # the peer's one probe is out
    h.success("bad", "shm")
    assert not h.quarantined("bad")
    assert h.admit("bad", "ucx") == "probe"  # its own path cool-down has passed: probed before reuse


def test_quarantine_backs_off_when_probes_keep_failing() -> None:
    h, clock = tracker()
    for t in ("rdma", "ucx", "shm", "tcp"):
        h.failure("bad", t, CONN)
    clock.advance(1.0)
    assert h.admit("bad", "tcp") == "probe"
    h.failure("bad", "tcp", CONN)
    clock.advance(1.0)
    assert h.quarantined("bad")  # 2 s now
    clock.advance(1.0)
    assert not h.quarantined("bad")
    assert h.metrics.snapshot()["quarantines"]["total"] == 1  # counted once per episode


def test_forget_on_new_epoch() -> None:
    h, _clock = tracker()
    for _ in range(5):
        h.failure("p", "tcp", CONN)
    h.forget("p")
    assert h.admit("p", "tcp") == "ok" and not h.quarantined("p")


def test_reconnect_once_whatever_the_number_of_callers() -> None:
    watch: EpochWatch[str] = EpochWatch()
    assert not watch.observe("peer", "e1")
    assert watch.observe("peer", "e2")
    calls = []
    gate = threading.Event()

    def connect() -> str:
        calls.append(1)
        gate.wait(5)
        return "link-e2"

    results: list[str] = []
    threads = [threading.Thread(target=lambda: results.append(watch.reconnect("peer", "e2", connect, timeout=10)))
               for _ in range(32)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 5
    while not calls and time.monotonic() < deadline:
        time.sleep(0.001)
    time.sleep(0.05)  # let every thread reach the flight
    gate.set()
    for t in threads:
        t.join(10)
    assert len(calls) == 1 and watch.reconnects == 1
    assert results == ["link-e2"] * 32
    # later callers for the same epoch get the result without reconnecting
    assert watch.reconnect("peer", "e2", connect) == "link-e2" and len(calls) == 1
    assert watch.known("peer") == "e2"


def test_failed_reconnect_is_shared_then_retried() -> None:
    watch: EpochWatch[int] = EpochWatch()
    attempts = []

    def flaky() -> int:
        attempts.append(1)
        if len(attempts) == 1:
            raise PeerConnectionError("still booting")
        return 7

    with pytest.raises(PeerConnectionError):
        watch.reconnect("p", "e9", flaky)
    assert watch.reconnect("p", "e9", flaky) == 7
    assert len(attempts) == 2


def test_metrics_snapshot() -> None:
    m = HealthMetrics()
    m.retry("a")
    m.retry("a")
    m.failover("a", "rdma", "tcp")
    m.set_connections("a", 2)
    m.set_connections("b", 1)
    m.set_connections("b", 0)
    m.add_backlog(3)
    m.add_backlog(-1)
    snap = m.snapshot()
    assert snap["retries"] == {"total": 2, "by_peer": {"a": 2}}
    assert snap["failovers"]["total"] == 1 and snap["failover_paths"] == {"rdma->tcp": 1}
    assert snap["connections"] == {"a": 2}
    assert snap["queue_backlog"] == 2
    with pytest.raises(ValueError, match="unknown counter"):
        m.count("bogus", "a")


def test_manual_clock_refuses_to_go_back() -> None:
    c = ManualClock(5.0)
    c.advance(1.5)
    assert c.now() == 6.5
    with pytest.raises(ValueError):
        c.advance(-1)


# -- FailoverPlan: one request down its route ------------------------------------------

from mpcomm.health import FailoverPlan  # noqa: E402


def run(plan: FailoverPlan, outcomes: dict, clock: ManualClock | None = None, cost: float = 0.0):
    """Drive ``plan`` as the engine would; ``outcomes[t]`` is an exception to raise or a result."""
    while (t := plan.next()) is not None:
        if clock is not None:
            clock.advance(cost)
        out = outcomes[t]
        if isinstance(out, BaseException):
            plan.failed(t, out)
            continue
        plan.succeeded(t)
        return t, out
    raise plan.error()


def test_failover_to_the_next_transport() -> None:
    h, clock = tracker()
    plan = FailoverPlan(["rdma", "ucx", "tcp"], "p", h, deadline=clock.now() + 5)
    used, result = run(plan, {"rdma": PeerConnectionError("QP error"), "ucx": PeerConnectionError("ep closed"),
                              "tcp": 4096})
    assert (used, result) == ("tcp", 4096)
    assert [t for t, _ in plan.attempts] == ["rdma", "ucx", "tcp"]
    snap = h.metrics.snapshot()
    assert snap["retries"]["total"] == 2 and snap["failovers"]["total"] == 2
    assert snap["failover_paths"] == {"rdma->ucx": 1, "ucx->tcp": 1}
    assert h.paused("p", "rdma") and not h.paused("p", "tcp")
    # the next request skips the paused paths and goes straight to tcp
    plan2 = FailoverPlan(["rdma", "ucx", "tcp"], "p", h, deadline=clock.now() + 5)
    assert plan2.next() == "tcp"


def test_no_retry_for_request_faults() -> None:
    h, clock = tracker()
    plan = FailoverPlan(["rdma", "tcp"], "p", h, deadline=clock.now() + 5)
    with pytest.raises(OutOfBoundsError):
        run(plan, {"rdma": OutOfBoundsError("past the end"), "tcp": 1})
    assert [t for t, _ in plan.attempts] == ["rdma"]
    assert h.metrics.snapshot()["retries"]["total"] == 0
    assert not h.paused("p", "rdma")  # the path is fine; the request was wrong


def test_attempts_and_deadline_bound_the_walk() -> None:
    h, clock = tracker(max_attempts=2)
    plan = FailoverPlan(["a", "b", "c"], "p", h, deadline=clock.now() + 5)
    with pytest.raises(PeerConnectionError, match="2 attempts failed") as ei:
        run(plan, {t: PeerConnectionError(f"{t} down") for t in "abc"})
    assert isinstance(ei.value.__cause__, PeerConnectionError) and "b down" in str(ei.value)
    h2, clock2 = tracker()
    plan = FailoverPlan(["a", "b", "c"], "q", h2, deadline=clock2.now() + 1.0)
    with pytest.raises(TransferTimeout, match="the deadline passed"):
        run(plan, {t: PeerConnectionError("slow death") for t in "abc"}, clock2, cost=0.6)
    assert len(plan.attempts) == 2  # the third never started: no time left


def test_a_timeout_at_the_deadline_does_not_count_in_a_plan() -> None:
    h, clock = tracker()
    plan = FailoverPlan(["shm", "tcp"], "p", h, deadline=clock.now() + 1.0)
    with pytest.raises(TransferTimeout):
        run(plan, {"shm": TransferTimeout("deadline"), "tcp": 1}, clock, cost=1.5)
    assert h.path_state("p", "shm")["failures"] == 0 and not h.paused("p", "shm")


def test_everything_paused_says_so() -> None:
    h, clock = tracker()
    for t in ("a", "b"):
        h.failure("p", t, CONN)
    plan = FailoverPlan(["a", "b"], "p", h, deadline=clock.now() + 5)
    assert plan.next() is None
    err = plan.error()
    assert isinstance(err, PeerConnectionError) and "paused: a, b" in str(err)
