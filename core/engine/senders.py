"""The notification rate: one token bucket per sender node id (``limits.notify_rate``).

A sender gets ``notify_rate`` notifications a second (a burst of as many) into
this engine's queue in total, whichever connections and paths they take (tcp's
native data port, notes carried on tcp WRITE frames, tcp's Python server, the
control channel): the buckets belong to the queue, keyed by the sender's node
id, not to a connection. This is the Python queue's rule; tcp's native queue
(``plugins/tcp/_dataport.c``) implements the same rule in C, and
tests/tcp/test_tcp_notify_rate.py checks the two against each other.

The rule is GCRA on integers, so both sides compute exactly the same thing:
with ``R = rate``, time in units of ns x R and a note costing ``10**9`` of them,
a bucket is one number, ``tat``; a note at ``now`` is admitted when
``tat <= now*R + (R-1)*10**9``, and then ``tat = max(tat, now*R) + 10**9``. That
is a bucket of R tokens refilling R a second, starting full. A bucket with
``tat <= now*R`` is full again (idle): it says nothing a fresh one would not.

A bucket is keyed by the first :data:`KEY_BYTES` bytes of the sender's node id
(UTF-8): the width of the tcp HELLO's id field, so the id a data connection
proved and the one the control channel names meet in one bucket (engine node
ids are 16 characters).

At most ``max_senders`` buckets (``limits.max_notify_senders``) are held. A new
sender that finds the table full makes it forget every idle bucket; if none is
idle (every sender sent within the last second), its note is refused with a
retryable BackPressureError. So a peer inventing node ids holds at most
``max_senders`` buckets, each idle within a second of its sender's last note.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from ..errors import BackPressureError

__all__ = ["KEY_BYTES", "NS", "SenderRates", "admit", "idle"]

NS = 1_000_000_000  # what one note costs, in units of ns x rate
KEY_BYTES = 16  # of a node id, key its bucket (plugins/tcp/wire.py ident, _dataport.c SENDER_KEY_MAX)


def admit(tat: int, now_ns: int, rate: int) -> int | None:
    """The bucket ``tat`` after a note at ``now_ns``, or None: over the rate (``tat`` unchanged)."""
    v = now_ns * rate
    if tat > v + (rate - 1) * NS:
        return None
    return max(tat, v) + NS


def idle(tat: int, now_ns: int, rate: int) -> bool:
    """Whether the bucket is full again (forgetting it changes nothing)."""
    return tat <= now_ns * rate


class SenderRates:
    """The senders' buckets of one queue, bounded to ``max_senders``."""

    def __init__(self, rate: int, max_senders: int, clock: Callable[[], int] = time.monotonic_ns) -> None:
        if not 1 <= rate < 1 << 32 or not 1 <= max_senders <= 1 << 24:
            raise ValueError("rate must be within [1, 2**32) and max_senders within [1, 2**24]")
        self.rate = rate
        self.max_senders = max_senders
        self._clock = clock
        self._tat: dict[bytes, int] = {}
        self._sweep_at = 0  # no bucket is idle before now*rate reaches this (<= every tat held)
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._tat)

    def take(self, sender: str, then: Callable[[], None] | None = None) -> None:
        """Spend one of ``sender``'s tokens, or raise BackPressureError (over its rate, or too many
        senders at once). ``then`` (the queue taking the note) runs once the rate admits it, under
        this table's lock; if it raises, no token is spent."""
        key = sender.encode("utf-8", "replace")[:KEY_BYTES]
        with self._lock:
            now = self._clock()
            tat = self._tat.get(key)
            if tat is None:
                tat = self._new_sender(now)
            after = admit(tat, now, self.rate)
            if after is None:
                raise BackPressureError(
                    f"more than {self.rate} notifications a second from this node (limits.notify_rate, one "
                    "budget per sender across all its connections); retry later")
            self._tat[key] = tat  # held from here on, spent or not (as the native table)
            if then is not None:
                then()
            self._tat[key] = after

    def _new_sender(self, now: int) -> int:
        if len(self._tat) >= self.max_senders:
            self._sweep(now)
        if len(self._tat) >= self.max_senders:
            raise BackPressureError(
                f"too many notification senders at once ({len(self._tat)} sent within the last second; "
                f"limits.max_notify_senders={self.max_senders}); retry later")
        self._sweep_at = 0  # the new bucket's tat (0) is below every other
        return 0

    def _sweep(self, now: int) -> None:
        if now * self.rate < self._sweep_at:
            return
        self._tat = {s: t for s, t in self._tat.items() if not idle(t, now, self.rate)}
        self._sweep_at = min(self._tat.values(), default=1 << 128)
