"""Notifications: small messages a peer attaches to a request, delivered after the data.

Bounded by policy (docs/security.md): at most ``limits.max_queued_notifications``
notifications and ``limits.max_queued_notify_bytes`` bytes wait for
``wait_notification()``. When full, a new notification is **refused**: the
sender's request fails with a retryable BackPressureError, so nothing is
silently lost and a flooding peer costs a fixed amount of memory. A sender
gets ``limits.notify_rate`` notifications a second into this queue in total,
over all its connections and paths (one bucket per sender node id, at most
``limits.max_notify_senders`` held: senders.py); over it, the same retryable
BackPressureError. Callbacks
registered with ``on_notification(..., consume=True)`` take notifications
instead of the queue (a consumer that only uses callbacks never fills it).

One queue: where a transport serves notifications below the interpreter (tcp's
native data port, ``Transport.notification_queue``), the engine adopts that
native queue (:meth:`Notifications.adopt`) and the control channel delivers
into it too, so both paths meet the same limits, refusal and FIFO order, and
``wait_notification`` waits on it with the GIL released. A natively delivered
notification is acknowledged to its sender as soon as it is queued; the
callbacks run afterwards on this engine's callback thread
(``mpcomm-notify-callbacks``), and the notification counts against the limits
until they ran (until it is consumed or taken). One that came over the control
channel runs the callbacks on the control thread before its ack, as before.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..control import NotificationQueue
from ..errors import BackPressureError
from .senders import SenderRates

__all__ = ["MAX_NOTIFY", "Notification", "Notifications"]

log = logging.getLogger("mpcomm.engine")

#: Largest notification payload, on the sender and on the receiver.
MAX_NOTIFY = 64 << 10
#: Longest region name a notification carries (the control channel truncates to it too).
MAX_REGION = 256


@dataclass(frozen=True)
class Notification:
    """A message a peer attached to a request; delivered after the data landed."""

    peer: str  # the sender's node id
    region: str  # the target region the data went to ("" for bare notifications)
    data: bytes


class _PyQueue:
    """The Python queue: a :class:`NotificationQueue` and the senders' rate buckets (senders.py).

    A note is admitted by its sender's rate first, then by the room, and the
    token is spent only when both admit (as the native queue does)."""

    def __init__(self, max_count: int, max_bytes: int, rate: int, max_senders: int) -> None:
        self.q = NotificationQueue(max_count, max_bytes)
        self.rates = SenderRates(rate, max_senders)

    def put(self, note: Notification, size: int, rated: bool = True) -> None:
        if rated:
            self.rates.take(note.peer, lambda: self.q.put(note, size))
        else:
            self.q.put(note, size)

    def reserve(self, peer: str, size: int) -> None:
        self.rates.take(peer, lambda: self.q.reserve(size))

    def take(self, peer: str) -> None:
        self.rates.take(peer)

    def put_reserved(self, note: Notification, size: int) -> None:
        self.q.put_reserved(note, size)

    def cancel(self, size: int) -> None:
        self.q.cancel(size)

    def get(self, timeout: float | None = None) -> Notification:
        note: Notification = self.q.get(timeout)
        return note

    def __len__(self) -> int:
        return len(self.q)

    def awaiting_callbacks(self) -> int:
        return 0

    def senders(self) -> int:
        return len(self.rates)


class _NativeQueue:
    """:class:`_PyQueue`'s interface over a native queue (``_dataport.c`` ``Notes``, which holds the
    senders' rate buckets itself, with the same rule)."""

    def __init__(self, notes: Any) -> None:
        self.notes = notes

    def put(self, note: Notification, size: int, rated: bool = True) -> None:
        refused = self.notes.put(note.peer, note.region, note.data, True, rated)  # callbacks ran: settled
        if refused is not None:
            raise BackPressureError(refused)

    def reserve(self, peer: str, size: int) -> None:
        refused = self.notes.reserve(size, peer)
        if refused is not None:
            raise BackPressureError(refused)

    def take(self, peer: str) -> None:
        refused = self.notes.take(peer)
        if refused is not None:
            raise BackPressureError(refused)

    def put_reserved(self, note: Notification, size: int) -> None:
        self.notes.commit(note.peer, note.region, note.data, True)  # callbacks ran: settled

    def cancel(self, size: int) -> None:
        self.notes.cancel(size)

    def get(self, timeout: float | None = None) -> Notification:
        got = self.notes.get(timeout)  # waits with the GIL released
        if got is None:
            raise TimeoutError(f"no notification within {timeout}s")
        return _note(got)

    def __len__(self) -> int:
        return int(self.notes.size()[0])

    def awaiting_callbacks(self) -> int:
        return int(self.notes.size()[2])

    def senders(self) -> int:
        return int(self.notes.senders())


def _note(got: tuple[str, str, bytes]) -> Notification:
    peer, region, data = got
    return Notification(peer, region[:MAX_REGION], data)


class Notifications:
    def __init__(self, max_count: int, max_bytes: int, rate: int = 10_000, max_senders: int = 4096) -> None:
        self._q: _PyQueue | _NativeQueue = _PyQueue(max_count, max_bytes, rate, max_senders)
        self._callbacks: list[tuple[Callable[[Notification], None], bool]] = []
        self._lock = threading.Lock()
        self._native: Any = None
        self._dispatcher: threading.Thread | None = None
        self._closed = False

    def __len__(self) -> int:
        return len(self._q)

    def awaiting_callbacks(self) -> int:
        """Notifications queued whose callbacks have not run yet (natively delivered ones only)."""
        return self._q.awaiting_callbacks()

    def senders(self) -> int:
        """Senders' rate buckets held now (at most ``limits.max_notify_senders``)."""
        return self._q.senders()

    def adopt(self, notes: Any) -> bool:
        """Make the native queue ``notes`` the one queue (False: one was adopted already).

        Called once the transports started, before the control channel
        listens; anything queued before moves over in order (no rate: it was
        admitted). From then on the native queue's rate buckets count.
        """
        with self._lock:
            if self._native is not None or self._closed:
                return False
            old, self._q = self._q, _NativeQueue(notes)
            self._native = notes
            while len(old):
                self._q.put(old.get(0), 0, rated=False)
            if self._callbacks:
                self._start_dispatcher()
        return True

    def subscribe(self, callback: Callable[[Notification], None], consume: bool) -> None:
        with self._lock:
            self._callbacks.append((callback, consume))
            if self._native is not None:
                self._start_dispatcher()

    def deliver(self, note: Notification) -> None:
        """The control channel's delivery: queue ``note`` (raises BackPressureError over its sender's
        rate or when full) and run the callbacks, before the sender's ack. A note a callback consumes
        is not queued, but its sender's rate counts it too."""
        callbacks = list(self._callbacks)
        if any(consume for _, consume in callbacks):
            self._q.take(note.peer)
        else:
            self._q.put(note, len(note.data))
        _run(callbacks, note)

    # -- a note whose data must land first (a transport's serving thread, in Python) -----------
    # tcp's Python server takes a WRITE frame that carries its notification this way
    # (plugins/tcp/server.py _write_note): room first, so a full queue refuses the request
    # before a byte of its data lands; then the note after the data, or the room back.

    def reserve(self, size: int, peer: str) -> tuple[int, bool]:
        """Hold room for a note of ``size`` bytes from sender ``peer`` (BackPressureError over its rate
        or when the queue is full). No room is held while a callback consumes notes (they are not
        queued; the rate still counts them). Returns what commit/cancel take."""
        held = not any(consume for _, consume in self._callbacks)
        if held:
            self._q.reserve(peer, size)
        else:
            self._q.take(peer)
        return size, held

    def commit(self, held: tuple[int, bool], peer: str, region: str, data: bytes) -> None:
        """Queue the note into its room and run the callbacks (before the sender's ack, as
        :meth:`deliver`)."""
        size, reserved = held
        note = Notification(peer, region[:MAX_REGION], data)
        callbacks = list(self._callbacks)
        if reserved:
            if any(consume for _, consume in callbacks):
                self._q.cancel(size)  # a consuming callback came meanwhile: it takes the note
            else:
                self._q.put_reserved(note, size)
        _run(callbacks, note)

    def cancel(self, held: tuple[int, bool]) -> None:
        """Give the room back: the note's data did not land."""
        size, reserved = held
        if reserved:
            self._q.cancel(size)

    def wait(self, timeout: float | None) -> Notification:
        note: Notification = self._q.get(timeout)
        return note

    def close(self) -> None:
        """Stop the callback thread; notifications still waiting for callbacks stay for wait()."""
        with self._lock:
            self._closed = True
            if self._native is not None:
                self._native.close()

    # -- natively delivered notifications: their callbacks, after the sender's ack -------------

    def _start_dispatcher(self) -> None:
        """(lock held) From now on native deliveries wait in the queue for the callbacks."""
        self._native.set_callbacks(True)
        if self._dispatcher is None and not self._closed:
            self._dispatcher = threading.Thread(target=self._dispatch, args=(self._native,),
                                                name="mpcomm-notify-callbacks", daemon=True)
            self._dispatcher.start()

    def _dispatch(self, notes: Any) -> None:
        while True:
            got = notes.dispatch(None)  # the GIL released while it waits; None once closed
            if got is None:
                return
            seq, raw = got
            note = _note(raw)
            callbacks = list(self._callbacks)
            consumed = False
            try:
                _run(callbacks, note)
                consumed = any(consume for _, consume in callbacks)
            finally:
                notes.settle(seq, consumed)


def _run(callbacks: list[tuple[Callable[[Notification], None], bool]], note: Notification) -> None:
    for cb, _consume in callbacks:
        try:
            cb(note)
        except Exception:  # noqa: BLE001
            log.exception("notification callback failed")
