"""Notifications: small messages a peer attaches to a request, delivered after the data.

Bounded by policy (docs/security.md): at most ``limits.max_queued_notifications``
notifications and ``limits.max_queued_notify_bytes`` bytes wait for
``wait_notification()``. When full, a new notification is **refused**: the
sender's request fails with a retryable BackPressureError, so nothing is
silently lost and a flooding peer costs a fixed amount of memory. Callbacks
registered with ``on_notification(..., consume=True)`` take notifications
instead of the queue (a consumer that only uses callbacks never fills it).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from ..control import NotificationQueue

__all__ = ["MAX_NOTIFY", "Notification", "Notifications"]

log = logging.getLogger("mpcomm.engine")

#: Largest notification payload, on the sender and on the receiver.
MAX_NOTIFY = 64 << 10


@dataclass(frozen=True)
class Notification:
    """A message a peer attached to a request; delivered after the data landed."""

    peer: str  # the sender's node id
    region: str  # the target region the data went to ("" for bare notifications)
    data: bytes


class Notifications:
    def __init__(self, max_count: int, max_bytes: int) -> None:
        self._q = NotificationQueue(max_count, max_bytes)
        self._callbacks: list[tuple[Callable[[Notification], None], bool]] = []

    def __len__(self) -> int:
        return len(self._q)

    def subscribe(self, callback: Callable[[Notification], None], consume: bool) -> None:
        self._callbacks.append((callback, consume))

    def deliver(self, note: Notification) -> None:
        """Queue ``note`` (raises BackPressureError when full) and run the callbacks."""
        callbacks = list(self._callbacks)
        if not any(consume for _, consume in callbacks):
            self._q.put(note, len(note.data))
        for cb, _consume in callbacks:
            try:
                cb(note)
            except Exception:  # noqa: BLE001
                log.exception("notification callback failed")

    def wait(self, timeout: float | None) -> Notification:
        note: Notification = self._q.get(timeout)
        return note
