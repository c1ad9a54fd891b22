"""Notifying: a request's notification, carried with its data or sent after it landed.

Where the transport a write is posted to carries notifications with the data
(:meth:`Transport.carries_notification`: tcp's WRITE frame with FLAG_NOTE), the
request is one Operation and its note goes with it: the target queues the note
after the data and answers both at once, so no notify worker and no second
round trip is involved and the waiter in ``result()`` gets the outcome as for a
write without one. Elsewhere the note is sent after the data landed, on the
engine's notify workers (below).
"""

from __future__ import annotations

from collections import deque

from ..errors import EngineClosedError, MpcommError
from ..transport import Operation, Transport


class Notifying:
    """The :class:`~mpcomm.engine.requests.Pipeline`'s notifying (a mixin: its state lives on the Pipeline)."""

    @staticmethod
    def _carry_notification(op: Operation, t: Transport) -> None:
        """Just before ``t.post(op)`` of a request with a notification: hand the note to ``t`` when it
        carries it with the data, else leave it to the notify workers. Asked at each post (a
        request a busy transport handed back is asked again). One whose note was carried is not
        failed over after a failed attempt (Retries._retried: the note might be delivered twice)."""
        op.notification = op.notify_after if op.kind == "write" and t.carries_notification(op) else None

    def _queue_notification(self, op: Operation, nbytes: int) -> None:
        """Send ``op``'s notification on a notify worker, at most ``_notify_per_peer`` per peer.

        Raises RuntimeError (nothing queued) when the engine's notify pool is shut down.
        """
        addr = op.remote.address
        with self._notify_lock:
            lane = self._notify_lanes.setdefault(addr, [deque(), 0])  # [waiting (op, nbytes), workers]
            if lane[1] < self._notify_per_peer:  # else a worker of this peer's takes it next
                try:
                    self.notifier.submit(self._drain_notifications, addr)
                except RuntimeError:
                    if not lane[0] and not lane[1]:
                        del self._notify_lanes[addr]
                    raise
                lane[1] += 1
            # (The worker takes it under this lock, so it finds it queued.)
            lane[0].append((op, nbytes))

    def _drain_notifications(self, addr: str) -> None:
        """Notify worker: send ``addr``'s waiting notifications in order until none is left."""
        while True:
            with self._notify_lock:
                lane = self._notify_lanes[addr]
                if not lane[0]:
                    lane[1] -= 1
                    if not lane[1]:
                        del self._notify_lanes[addr]
                    return
                op, nbytes = lane[0].popleft()
            self._notify_then_finish(op, nbytes)

    def _notify_then_finish(self, op: Operation, nbytes: int) -> None:
        error: BaseException | None = None
        try:
            self.e.notify(op.remote, op.notify_after, max(op.time_left(), 0.001))
        except BaseException as exc:  # noqa: BLE001
            error = exc if isinstance(exc, MpcommError) else MpcommError(f"after the data landed: {exc}")
            if self.closed and not isinstance(error, EngineClosedError):
                cause, error = error, EngineClosedError("the engine was closed before the target took the "
                                                        "notification (the data had landed)")
                error.__cause__ = cause
        self._finish(op, error, nbytes)
