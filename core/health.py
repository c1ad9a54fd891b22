"""Peer and path health: cool-down, probes, quarantine, reconnect-once, retry rules.

A *path* is one (peer, transport) pair. :class:`HealthTracker` keeps, per path,
a count of consecutive failures; each failure pauses the path for an
exponentially growing cool-down (``base_cooldown * 2**(failures-1)``, capped
at ``max_cooldown``). A paused path is skipped. When its cool-down has passed,
exactly one request is let through as a probe (:meth:`HealthTracker.admit`
returns ``"probe"`` once; others still see the path as paused until the probe
reports). A success resets the path.

A peer whose paths fail ``quarantine_after`` times in a row (across all its
paths, with no success in between) is quarantined with the same back-off, so
requests to healthy peers are not held up by one that keeps failing; after
its quarantine one probe goes through, as for a path.

Only failures that say something about the path count
(:func:`counts_against_path`): :func:`is_retryable` tells which errors
retrying on another transport can fix (the error's ``retryable`` attribute
from :mod:`mpcomm.errors`, except bounds, permission, cancellation, stale
regions and timeouts whose transport could not confirm the stop); the others
are the request's fault and are neither retried nor counted. Nor is a
request's own deadline: a :class:`~mpcomm.errors.TransferTimeout` reported
once the request's deadline has passed says only that the caller allowed too
little time, whoever reports it (the transport's copy loop or the engine's
timer). A caller's 1 ms deadline on 64 MiB must not pause a healthy path.

A probe slot is held by one request; whatever ends it (success, a counted
failure, an uncounted one, the deadline, a cancel) frees it: a
:meth:`HealthTracker.success` or :meth:`HealthTracker.failure` report does,
and :meth:`HealthTracker.release_probe` for an ending that is no report.

:class:`ConnectBackoff` rate-limits connection attempts per peer address:
after a failed connect, new requests to that address fail fast (without
dialling) until a window has passed; the window doubles per consecutive
failure up to a cap, and a successful connect clears it. The engine's peer
table applies it (``[health] connect_backoff_ms``).

:class:`EpochWatch` says "reconnect once" when a peer shows a new epoch (it
restarted): whatever the number of callers, one runs the reconnect and the
rest wait for its result (single-flight).

:class:`FailoverPlan` walks one request down its route: which transport to try
next (skipping paused paths, within the deadline and ``max_attempts``), what
to record after each attempt, and when to give up with which error. It is a
state machine, so a synchronous caller and a completion callback drive it the
same way.

:class:`HealthMetrics` counts retries, failovers and quarantines and keeps the
queue backlog and connection count per peer; :meth:`HealthMetrics.snapshot`
is a plain dict for telemetry.

Every time comes from a clock object passed in (:class:`MonotonicClock` by
default; tests pass a :class:`ManualClock` and move it).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import CancelledError
from dataclasses import dataclass
from typing import Any, Generic, NamedTuple, TypeVar

from .errors import (
    AccessError,
    MpcommError,
    OutOfBoundsError,
    PeerConnectionError,
    PermissionDeniedError,
    StaleRegionError,
    TransferTimeout,
)

__all__ = [
    "ConnectBackoff",
    "EpochWatch",
    "FailoverPlan",
    "HealthMetrics",
    "HealthPolicy",
    "HealthTracker",
    "ManualClock",
    "MonotonicClock",
    "counts_against_path",
    "is_retryable",
]

T = TypeVar("T")


class MonotonicClock:
    """The real clock (``time.monotonic``)."""

    def now(self) -> float:
        return time.monotonic()


class ManualClock:
    """A clock that moves only when told to (for tests and simulations)."""

    def __init__(self, start: float = 1000.0) -> None:
        self._t = start
        self._lock = threading.Lock()

    def now(self) -> float:
        with self._lock:
            return self._t

    def advance(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError("a clock does not go backwards")
        with self._lock:
            self._t += seconds


# Errors whose class says retrying elsewhere cannot help, whatever ``retryable`` says:
# StaleRegionError is "retryable" only after re-opening the region, not as is.
_NEVER_RETRY = (OutOfBoundsError, PermissionDeniedError, StaleRegionError)


def is_retryable(exc: BaseException) -> bool:
    """May the same request succeed on the next transport of its route?"""
    if isinstance(exc, CancelledError) or not isinstance(exc, MpcommError):
        return False
    if isinstance(exc, _NEVER_RETRY):
        return False
    if isinstance(exc, TransferTimeout) and not exc.confirmed:
        return False  # bytes of the first attempt may still land: a retry would race them
    if isinstance(exc, AccessError):
        return False  # the target's own checks refused it
    return bool(exc.retryable)


def counts_against_path(exc: BaseException, *, deadline_passed: bool = False) -> bool:
    """Does this failed attempt say something about the path it was made on?

    Only transport and connection failures do (:func:`is_retryable`), and a
    timeout only while the request still had time: ``deadline_passed`` says
    the request's own deadline had passed when the attempt ended, so its
    :class:`~mpcomm.errors.TransferTimeout` is the caller's budget running
    out, not the path failing. A timeout before the deadline (a handshake or
    a peer's answer that took longer than its own limit) counts.
    """
    if not is_retryable(exc):
        return False
    return not (deadline_passed and isinstance(exc, TransferTimeout))


@dataclass(frozen=True)
class HealthPolicy:
    """Tuning of :class:`HealthTracker` (seconds and counts)."""

    base_cooldown: float = 0.05
    max_cooldown: float = 30.0
    quarantine_after: int = 5
    max_attempts: int = 3
    #: Consecutive failures before a path is paused: one failed request (a
    #: blip, a restarted peer) does not make the next ones fail fast.
    pause_after: int = 3

    def cooldown(self, failures: int) -> float:
        n = failures - self.pause_after + 1
        if n <= 0:
            return 0.0
        return min(self.max_cooldown, self.base_cooldown * (2 ** min(n - 1, 62)))


class _Backoff:
    """Consecutive failures, pause deadline and probe state of one path or peer."""

    __slots__ = ("failures", "until", "probing")

    def __init__(self) -> None:
        self.failures = 0
        self.until = 0.0
        self.probing = False


class HealthTracker:
    """Per-path cool-down and per-peer quarantine (see the module docstring).

    Thread-safe. Peers are identified by whatever key the caller uses
    (node id or address); transports by name.
    """

    def __init__(self, policy: HealthPolicy | None = None, clock: Any = None,
                 metrics: HealthMetrics | None = None) -> None:
        self.policy = policy or HealthPolicy()
        self.clock = clock or MonotonicClock()
        self.metrics = metrics or HealthMetrics()
        self._paths: dict[tuple[str, str], _Backoff] = {}
        self._peers: dict[str, _Backoff] = {}
        self._lock = threading.Lock()

    # -- queries ---------------------------------------------------------------------

    def _admit(self, b: _Backoff | None, now: float) -> str:
        if b is None or b.failures < self.policy.pause_after:
            return "ok"
        if now < b.until or b.probing:
            return "paused"
        return "probe"

    def admit(self, peer: str, transport: str) -> str:
        """``"ok"``, ``"probe"`` (this caller is the one probe: report its outcome)
        or ``"paused"``. The peer's quarantine applies first."""
        now = self.clock.now()
        with self._lock:
            qb = self._peers.get(peer)
            q = self._admit(qb, now) if qb is not None and qb.failures >= self.policy.quarantine_after else "ok"
            if q == "paused":
                return "paused"
            pb = self._paths.get((peer, transport))
            p = self._admit(pb, now)
            if p == "paused":
                return "paused"
            if q == "probe":
                qb.probing = True  # type: ignore[union-attr]
            if p == "probe":
                pb.probing = True  # type: ignore[union-attr]
            return "probe" if "probe" in (p, q) else "ok"

    def usable(self, peer: str, transports: Iterable[str]) -> list[tuple[str, str]]:
        """The route's transports that may be tried now, in order, each with its
        admission (``"ok"``/``"probe"``). Admitting marks probes as taken, so
        call it once per request and report each attempt."""
        out = []
        for t in transports:
            a = self.admit(peer, t)
            if a != "paused":
                out.append((t, a))
        return out

    def any_failures(self) -> bool:
        """False while no path has failed: the request path then skips admission."""
        return bool(self._paths or self._peers)

    def failure_tables(self) -> tuple[dict[Any, Any], dict[Any, Any]]:
        """The two tables :meth:`any_failures` looks at (kept for the tracker's life, never
        replaced), for the engine's C inline lane to test for emptiness without a call."""
        return self._paths, self._peers

    def quarantined(self, peer: str) -> bool:
        now = self.clock.now()
        with self._lock:
            b = self._peers.get(peer)
            return b is not None and b.failures >= self.policy.quarantine_after and (now < b.until or b.probing)

    def paused(self, peer: str, transport: str) -> bool:
        now = self.clock.now()
        with self._lock:
            return self._admit(self._paths.get((peer, transport)), now) == "paused"

    def path_state(self, peer: str, transport: str) -> dict[str, Any]:
        now = self.clock.now()
        with self._lock:
            b = self._paths.get((peer, transport))
            if b is None:
                return {"failures": 0, "paused_for": 0.0, "probing": False}
            return {"failures": b.failures, "paused_for": max(0.0, b.until - now), "probing": b.probing}

    # -- reports ------------------------------------------------------------------------

    def success(self, peer: str, transport: str) -> None:
        with self._lock:
            self._paths.pop((peer, transport), None)
            self._peers.pop(peer, None)

    def failure(self, peer: str, transport: str, error: BaseException | None = None, *,
                deadline_passed: bool = False) -> bool:
        """Count a failed attempt; returns whether it counted (see
        :func:`counts_against_path`: a request's own fault, e.g. out of bounds,
        or its own deadline, does not count against the path). Either way
        the path's probe slot is free afterwards."""
        if error is not None and not counts_against_path(error, deadline_passed=deadline_passed):
            self.release_probe(peer, transport)
            return False
        now = self.clock.now()
        newly_quarantined = False
        with self._lock:
            pb = self._paths.setdefault((peer, transport), _Backoff())
            pb.failures += 1
            pb.probing = False
            pb.until = now + self.policy.cooldown(pb.failures)
            qb = self._peers.setdefault(peer, _Backoff())
            qb.failures += 1
            qb.probing = False
            n = qb.failures - self.policy.quarantine_after + 1
            if n >= 1:
                # The n-th step of a quarantine pauses base * 2**(n-1) from its
                # first failure on (cooldown() counts from pause_after, for paths).
                qb.until = now + self.policy.cooldown(n + self.policy.pause_after - 1)
                newly_quarantined = n == 1
        if newly_quarantined:
            self.metrics.count("quarantines", peer)
        return True

    def release_probe(self, peer: str, transport: str) -> None:
        """A probe ended without saying anything about the path (e.g. cancelled)."""
        with self._lock:
            for b in (self._paths.get((peer, transport)), self._peers.get(peer)):
                if b is not None:
                    b.probing = False

    def forget(self, peer: str) -> None:
        """The peer restarted (new epoch): its history says nothing about the new one."""
        with self._lock:
            for key in [k for k in self._paths if k[0] == peer]:
                del self._paths[key]
            self._peers.pop(peer, None)


class _ConnectFailure(NamedTuple):
    """The last failed connect to one address (replaced whole, so readers need no lock)."""

    failures: int
    failed_at: float
    until: float
    error: BaseException


class ConnectBackoff:
    """Per-address back-off of connection attempts (see the module docstring).

    After ``n`` consecutive failed connects to an address, no new attempt is
    made for ``min(cap, start * 2**(n-1))`` seconds: :meth:`refusal` returns
    the retryable :class:`~mpcomm.errors.PeerConnectionError` to fail the
    request with instead. Once the window has passed, the next caller dials
    again (the caller makes sure only one does: the engine's connects are
    single-flight per address). A success (:meth:`succeeded`) clears the
    record, so a peer that is back is used at once by everyone.

    ``start = 0`` turns the back-off off. :meth:`refusal` is one dict look-up,
    without a lock, while no failure is recorded for the address.
    """

    def __init__(self, start: float, cap: float, clock: Any = None, metrics: HealthMetrics | None = None) -> None:
        if start < 0 or cap < start:
            raise ValueError(f"connect back-off needs 0 <= start <= cap, not start={start}, cap={cap}")
        self.start = start
        self.cap = cap
        self.clock = clock or MonotonicClock()
        self.metrics = metrics or HealthMetrics()
        self._records: dict[str, _ConnectFailure] = {}
        self._lock = threading.Lock()  # writers only: readers see whole records

    @classmethod
    def from_ms(cls, start_ms: int, cap_ms: int, **kw: Any) -> ConnectBackoff:
        return cls(start_ms / 1000.0, cap_ms / 1000.0, **kw)

    def window(self, failures: int) -> float:
        """How long no attempt is made after ``failures`` consecutive failed connects."""
        if failures <= 0 or self.start <= 0:
            return 0.0
        return min(self.cap, self.start * (2 ** min(failures - 1, 62)))

    def refusal(self, address: str) -> PeerConnectionError | None:
        """The error to fail a request to ``address`` with now, or None: dial.

        The error says when and why the last connect failed and when the next
        one is allowed; ``error.retry_after`` holds those seconds and
        ``__cause__`` the last connect's own error. Counted as
        ``connect_backoffs`` in the metrics.
        """
        rec = self._records.get(address)
        if rec is None:
            return None
        now = self.clock.now()
        if now >= rec.until:
            return None
        left = rec.until - now
        last = rec.error
        err = PeerConnectionError(
            f"not connecting to {address} for another {left:.3g}s: the last connect attempt failed "
            f"{now - rec.failed_at:.3g}s ago ({type(last).__name__}: {last}); {rec.failures} failed in a row, "
            f"so new attempts are held back for {self.window(rec.failures):.3g}s "
            "(health.connect_backoff_ms, doubling up to health.connect_backoff_max_ms); retry after that",
            peer=address, retryable=True)
        err.retry_after = left  # type: ignore[attr-defined]
        err.__cause__ = last
        self.metrics.count("connect_backoffs", address)
        return err

    def failed(self, address: str, error: BaseException) -> float:
        """Record a failed connect to ``address``; returns the window it opens (0 when off)."""
        if self.start <= 0:
            return 0.0
        now = self.clock.now()
        with self._lock:
            old = self._records.get(address)
            n = (old.failures if old is not None else 0) + 1
            w = self.window(n)
            self._records[address] = _ConnectFailure(n, now, now + w, error)
        return w

    def succeeded(self, address: str) -> None:
        if address in self._records:  # no lock on the common path: nothing to clear
            with self._lock:
                self._records.pop(address, None)

    def state(self, address: str) -> dict[str, Any]:
        """``{"failures": n, "retry_in": seconds}`` (zeros when nothing is recorded)."""
        rec = self._records.get(address)
        if rec is None:
            return {"failures": 0, "retry_in": 0.0}
        return {"failures": rec.failures, "retry_in": max(0.0, rec.until - self.clock.now())}

    def snapshot(self) -> dict[str, dict[str, Any]]:
        """:meth:`state` of every address with a recorded failure."""
        with self._lock:
            addresses = list(self._records)
        return {a: self.state(a) for a in addresses}


class FailoverPlan:
    """One request's walk down its route (see the module docstring).

    ::

        plan = FailoverPlan(route.transports, peer, tracker, deadline)
        while (t := plan.next()) is not None:
            try:
                result = attempt(t, plan.time_left())   # the whole range, every time
            except MpcommError as exc:
                plan.failed(t, exc)
                continue
            plan.succeeded(t)
            break
        else:
            raise plan.error()

    ``deadline`` is on ``tracker.clock``. A transport is tried at most once
    per request; paused paths are skipped (a probe slot is taken only when
    the transport is actually tried).
    """

    def __init__(self, transports: Iterable[str], peer: str, tracker: HealthTracker, deadline: float,
                 max_attempts: int | None = None) -> None:
        self.transports = tuple(transports)
        self.peer = peer
        self.tracker = tracker
        self.deadline = deadline
        self.max_attempts = tracker.policy.max_attempts if max_attempts is None else max_attempts
        self.attempts: list[tuple[str, BaseException | None]] = []
        self._index = 0
        self._last_error: BaseException | None = None
        self._stopped = False
        self._skipped: list[str] = []

    def time_left(self) -> float:
        return self.deadline - self.tracker.clock.now()

    def next(self) -> str | None:
        """The transport to try now, or None: done, out of attempts or time, or nothing admitted."""
        if self._stopped or len(self.attempts) >= self.max_attempts or self.time_left() <= 0:
            return None
        while self._index < len(self.transports):
            t = self.transports[self._index]
            self._index += 1
            if self.tracker.admit(self.peer, t) == "paused":
                self._skipped.append(t)
                continue
            if self.attempts:
                self.tracker.metrics.retry(self.peer)
                self.tracker.metrics.failover(self.peer, self.attempts[-1][0], t)
            return t
        return None

    def failed(self, transport: str, exc: BaseException) -> bool:
        """Record a failed attempt; True when the request may go on to the next transport."""
        self.attempts.append((transport, exc))
        self._last_error = exc
        self.tracker.failure(self.peer, transport, exc, deadline_passed=self.time_left() <= 0)
        if not is_retryable(exc):
            self._stopped = True
            return False
        return True

    def succeeded(self, transport: str) -> None:
        self.attempts.append((transport, None))
        self._stopped = True
        self.tracker.success(self.peer, transport)

    def error(self) -> BaseException:
        """What to fail the request with when :meth:`next` returned None without success."""
        if self._last_error is not None and (self._stopped or not is_retryable(self._last_error)):
            return self._last_error
        tried = ", ".join(f"{t}: {type(e).__name__}: {e}" for t, e in self.attempts if e is not None)
        skipped = f"; paused: {', '.join(self._skipped)}" if self._skipped else ""
        if self.time_left() <= 0:
            why = "the deadline passed"
        elif len(self.attempts) >= self.max_attempts:
            why = f"{self.max_attempts} attempts failed"
        else:
            why = "no transport of the route is usable now"
        cls = TransferTimeout if self.time_left() <= 0 else PeerConnectionError
        err = cls(f"{why} for peer {self.peer} (route {', '.join(self.transports)}; tried {tried or 'none'}{skipped})",
                  peer=self.peer)
        err.__cause__ = self._last_error
        return err


class EpochWatch(Generic[T]):
    """Reconnect once per new epoch of a peer, whatever the number of callers.

    ``observe(peer, epoch)`` records what a caller saw and says whether it is
    new. ``reconnect(peer, epoch, fn)`` runs ``fn()`` for that (peer, epoch)
    exactly once while it succeeds: concurrent callers wait for the one
    running and share its result (or its exception; after a failure the next
    caller tries again).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._epochs: dict[str, str] = {}
        self._flights: dict[tuple[str, str], _Flight[T]] = {}
        self._done: dict[str, tuple[str, T]] = {}
        #: How many times a reconnect function actually ran (for tests and metrics).
        self.reconnects = 0

    def observe(self, peer: str, epoch: str) -> bool:
        """True when ``epoch`` differs from the last one seen for ``peer``."""
        with self._lock:
            old = self._epochs.get(peer)
            self._epochs[peer] = epoch
            return old is not None and old != epoch

    def known(self, peer: str) -> str | None:
        with self._lock:
            return self._epochs.get(peer)

    def reconnect(self, peer: str, epoch: str, fn: Callable[[], T], timeout: float | None = None) -> T:
        with self._lock:
            done = self._done.get(peer)
            if done is not None and done[0] == epoch:
                return done[1]
            flight = self._flights.get((peer, epoch))
            leader = flight is None
            if leader:
                flight = self._flights[(peer, epoch)] = _Flight()
                self.reconnects += 1
        assert flight is not None
        if not leader:
            return flight.wait(timeout)
        try:
            result = fn()
        except BaseException as exc:
            with self._lock:
                self._flights.pop((peer, epoch), None)
            flight.fail(exc)
            raise
        with self._lock:
            self._flights.pop((peer, epoch), None)
            self._done[peer] = (epoch, result)
            self._epochs[peer] = epoch
        flight.succeed(result)
        return result


class _Flight(Generic[T]):
    def __init__(self) -> None:
        self._event = threading.Event()
        self._result: Any = None
        self._error: BaseException | None = None

    def succeed(self, result: T) -> None:
        self._result = result
        self._event.set()

    def fail(self, exc: BaseException) -> None:
        self._error = exc
        self._event.set()

    def wait(self, timeout: float | None) -> T:
        if not self._event.wait(timeout):
            raise TimeoutError(f"reconnect still running after {timeout}s")
        if self._error is not None:
            raise self._error
        return self._result  # type: ignore[no-any-return]


class HealthMetrics:
    """Counters and gauges the deployment checklist asks to watch.

    Counters (monotonic, per peer and total): ``retries``, ``failovers``,
    ``quarantines``, ``connect_failures`` (connection attempts that failed)
    and ``connect_backoffs`` (requests failed by :class:`ConnectBackoff`
    without dialling). Gauges: ``queue_backlog`` (requests waiting for a
    queue slot, engine-wide) and ``connections`` per peer.
    """

    COUNTERS = ("retries", "failovers", "quarantines", "connect_failures", "connect_backoffs")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: dict[str, dict[str, int]] = {c: {} for c in self.COUNTERS}
        self._connections: dict[str, int] = {}
        self._backlog = 0
        self._failover_paths: dict[tuple[str, str], int] = {}

    def count(self, counter: str, peer: str, n: int = 1) -> None:
        if counter not in self._counts:
            raise ValueError(f"unknown counter {counter!r} (known: {', '.join(self.COUNTERS)})")
        with self._lock:
            per = self._counts[counter]
            per[peer] = per.get(peer, 0) + n

    def retry(self, peer: str) -> None:
        self.count("retries", peer)

    def failover(self, peer: str, from_transport: str, to_transport: str) -> None:
        self.count("failovers", peer)
        with self._lock:
            key = (from_transport, to_transport)
            self._failover_paths[key] = self._failover_paths.get(key, 0) + 1

    def set_backlog(self, n: int) -> None:
        with self._lock:
            self._backlog = max(0, n)

    def add_backlog(self, delta: int) -> None:
        with self._lock:
            self._backlog = max(0, self._backlog + delta)

    def set_connections(self, peer: str, n: int) -> None:
        with self._lock:
            if n <= 0:
                self._connections.pop(peer, None)
            else:
                self._connections[peer] = n

    def snapshot(self) -> dict[str, Any]:
        """``{"retries": {"total": n, "by_peer": {...}}, ..., "queue_backlog": n,
        "connections": {peer: n}, "failover_paths": {"a->b": n}}``."""
        with self._lock:
            out: dict[str, Any] = {
                c: {"total": sum(per.values()), "by_peer": dict(per)} for c, per in self._counts.items()
            }
            out["queue_backlog"] = self._backlog
            out["connections"] = dict(self._connections)
            out["failover_paths"] = {f"{a}->{b}": n for (a, b), n in self._failover_paths.items()}
        return out
