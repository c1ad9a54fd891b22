"""Notifications: small messages a peer attaches to a request, delivered after the data.

Bounded by policy: at most ``runtime.notify_queue`` notifications wait for
``wait_notification()``; when the queue is full the **oldest** is dropped (and
counted in :attr:`Notifications.dropped`), so a peer that floods us costs a
fixed amount of memory and the newest messages survive. Callbacks registered
with ``on_notification`` consume a notification instead of the queue when
``consume=True``; otherwise it is also queued.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

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
    def __init__(self, limit: int) -> None:
        self._limit = max(1, limit)
        self._q: deque[Notification] = deque()
        self._cond = threading.Condition(threading.Lock())
        self._callbacks: list[tuple[Callable[[Notification], None], bool]] = []
        #: Notifications dropped because the queue was full.
        self.dropped = 0

    def __len__(self) -> int:
        return len(self._q)

    def subscribe(self, callback: Callable[[Notification], None], consume: bool) -> None:
        self._callbacks.append((callback, consume))

    def deliver(self, note: Notification) -> None:
        consumed = False
        for cb, consume in list(self._callbacks):
            try:
                cb(note)
            except Exception:  # noqa: BLE001
                log.exception("notification callback failed")
            consumed = consumed or consume
        if consumed:
            return
        with self._cond:
            if len(self._q) >= self._limit:
                self._q.popleft()
                self.dropped += 1
            self._q.append(note)
            self._cond.notify()

    def wait(self, timeout: float | None) -> Notification:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while not self._q:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise TimeoutError(f"no notification within {timeout}s")
                self._cond.wait(left)
            return self._q.popleft()
