"""Retries and backlog: failover to the route's next transport, and units a busy transport handed back."""

from __future__ import annotations

import time
from collections import deque
from typing import Any

from ..errors import BackPressureError, MpcommError, PeerConnectionError
from ..health import counts_against_path, is_retryable
from ..transport import Operation, Transport
from .stripes import Striped
from .units import WAITING


class Retries:
    """The :class:`~mpcomm.engine.requests.Pipeline`'s retries (a mixin: its state lives on the Pipeline)."""

    def _retried(self, unit: Any, error: BaseException | None) -> bool:
        """An attempt ended (``error`` None: it succeeded): its path's health hears of it, and a failed
        ``unit`` is posted again on the next transport of its route if that may help (True)."""
        t = unit.transport
        health = self.e.health
        if error is None:
            if health.any_failures() and t is not None:
                unit.probe = None  # the success report ends the probe
                health.success(unit.remote.address, t.name)
            return False
        if isinstance(t, Striped):
            return False  # each stripe was retried on its own
        # A note this write carried with its data (see below). If the target refused it (its queue is
        # full: BackPressureError) before a byte landed, that says nothing about the path, and another
        # transport reaches the same queue (and would land the data before the note is refused).
        noted = getattr(unit, "notification", None) is not None
        peer = unit.remote.address
        if (t is not None and unit.abort_exc is None and not (noted and isinstance(error, BackPressureError))
                and counts_against_path(error, deadline_passed=unit.time_left() <= 0)):
            # Only the transport's own failures count against the path: the
            # request's deadline (reported by the transport or by our timer), a
            # cancel or a closing engine say nothing about it. The report ends
            # the path's probe, if this unit held it.
            unit.probe = None
            health.failure(peer, t.name, error)
        else:
            self._end_probe(unit)
        # Its note went in the same frame as the data: a connection lost after the target
        # queued it but before the reply came cannot be told apart from one lost before, and
        # a second attempt would deliver the note twice. The caller gets the error (still
        # retryable where it was) and decides (docs/contract.md §7).
        if (noted or t is None or unit.abort_exc is not None or not is_retryable(error) or self.closed
                or unit.time_left() <= 0 or getattr(unit, "tries", 1) >= health.policy.max_attempts):
            return False
        try:
            nxt = self._admit(unit, unit.candidates, unit.attempt + 1)
        except PeerConnectionError:
            return False
        unit.tries = getattr(unit, "tries", 1) + 1
        health.metrics.retry(peer)
        health.metrics.failover(peer, t.name, nxt.name)
        # The whole range is moved again: a partial first attempt is rewritten.
        if isinstance(unit, Operation):
            if self.e.telemetry.enabled:
                self.e.telemetry.on_retry(unit, error)
            unit.rearm()
        else:
            unit.rearm_failed()
        unit.state = None
        unit.transport = nxt
        unit.transfer.transport = nxt.name
        try:
            self.executor.submit(self.repost, unit, nxt)
        except RuntimeError:
            return False
        return True

    def repost(self, unit: Any, t: Transport) -> None:
        """Post ``unit`` (a retry, or a stripe) on ``t``, registering its buffer there first where need be."""
        if self._lazy or unit.ephemeral:
            try:
                self.regions.ensure_registered(unit.local, t)
            except Exception as exc:  # noqa: BLE001 - the request fails, not the retrying thread
                unit.fail(exc if isinstance(exc, MpcommError) else MpcommError(f"transport {t.name} failed: {exc}"))
                return
        for waiting in self._hand_to(t, unit):
            self._to_backlog(t, waiting)

    def backlog(self) -> int:
        """Requests waiting now for a queue slot or for a busy transport."""
        with self._backlog_lock:
            busy = sum(len(q) for q in self._backlog.values())
        return self.slots.waiting + busy

    def _to_backlog(self, transport: Transport, unit: Any, delay: float = 0.001) -> None:
        unit.stage = WAITING  # claimable again: by the drain, a cancel or the deadline
        with self._backlog_lock:
            self._backlog.setdefault(transport.name, deque()).append(unit)
        # Finishing requests drain the backlog; the timer makes sure it is
        # drained even when none of them is the engine's (a group's members).
        self._schedule_drain(transport.name, delay)

    def _schedule_drain(self, name: str, delay: float) -> None:
        self.timer.schedule(time.monotonic() + delay, lambda: self._kick_backlog(name, delay))

    def _kick_backlog(self, name: str, delay: float = 0.001) -> None:
        """Drain ``name``'s backlog on a worker, if anything waits there."""
        if self._backlog.get(name):
            try:
                self.executor.submit(self._drain_backlog, name, delay)
            except RuntimeError:
                pass  # closing

    def _drain_backlog(self, name: str, delay: float = 0.001) -> None:
        t = self.transports.get(name)
        while t is not None:
            with self._backlog_lock:
                q = self._backlog.get(name)
                if not q:
                    return
                unit = q.popleft()
            if not self.claim(unit, WAITING):
                continue
            if unit.abort_exc is not None:  # timed out, cancelled or closed while it waited
                unit.fail(unit.abort_exc)
                continue
            busy = self._hand_to(t, unit)
            if busy:  # still full: back to the front, in order, and try again later
                with self._backlog_lock:
                    for waiting in reversed(busy):
                        waiting.stage = WAITING
                        self._backlog.setdefault(name, deque()).appendleft(waiting)
                self._schedule_drain(name, min(delay * 2, 0.05))
                return

    def _end_probe(self, unit: Any) -> None:
        """Free the probe slot ``unit`` holds, if any, with no verdict on the path.

        Every ending that is not a success or a counted failure comes here
        (deadline, cancel, close, the request's own error, a unit that fails
        before it is posted): a slot left taken refuses the path for good.
        """
        name = getattr(unit, "probe", None)
        if name is not None:
            unit.probe = None
            self.e.health.release_probe(unit.remote.address, name)
