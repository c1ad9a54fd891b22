"""One timer thread for every deadline of an engine.

The thread sleeps on a condition until the earliest deadline (no polling), so
an idle engine costs no CPU. Callbacks run on the timer thread and must be
quick: they only ask transports to abort.

Most requests finish long before their deadline, so their entries are
cancelled, and the heap is compacted once cancelled entries outnumber live
ones: the thread wakes for deadlines that still matter, not once per request.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import math
import threading
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger("mpcomm.deadlines")


class DeadlineTimer:
    def __init__(self, name: str = "mpcomm-deadlines") -> None:
        # Entries are [when, seq, fn]; fn is None once cancelled.
        self._heap: list[list[Any]] = []
        self._dead = 0
        self._seq = itertools.count()
        # schedule()/cancel() run once per request: they take the plain lock under the
        # condition directly (a C call), not the Condition's Python-level __enter__.
        self._mutex = threading.Lock()
        self._cond = threading.Condition(self._mutex)
        self._closed = False
        self._name = name
        self._thread: threading.Thread | None = None
        #: When the thread wakes next by itself (inf: only when notified); under _mutex.
        self._wakes_at = -math.inf

    def schedule(self, when: float, fn: Callable[[], None]) -> list[Any]:
        """Run ``fn`` at monotonic time ``when``; returns a handle for :meth:`cancel`."""
        entry = [when, next(self._seq), fn]
        with self._mutex:
            if self._closed:
                return entry
            heapq.heappush(self._heap, entry)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
            elif when < self._wakes_at:
                # Only a deadline earlier than the one the thread sleeps towards wakes it: most
                # requests end long before theirs, and a wake-up here would run Python on this
                # thread while the request's caller waits in result() (docs/contract.md).
                self._cond.notify()
        return entry

    def cancel(self, entry: list[Any]) -> None:
        """Forget a scheduled call (no-op if it already ran or was cancelled).

        Once per request, so without the mutex in the usual case: the entry's call is dropped
        by one store (atomic under the GIL; the entry keeps no reference to the request), which
        is all a cancel ever promised -- a call the thread already took runs either way, as it
        did when this took the lock. ``_dead`` counts unlocked: a lost update only moves the
        next compaction a little, and each compaction counts the heap anew.
        """
        if entry[2] is None:
            return
        entry[2] = None
        dead = self._dead = self._dead + 1
        if dead > 64 and dead * 2 > len(self._heap):
            with self._mutex:
                if self._dead * 2 > len(self._heap):  # (not compacted meanwhile by another canceller)
                    self._heap = [e for e in self._heap if e[2] is not None]
                    heapq.heapify(self._heap)
                    self._dead = 0

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._closed:
                    if not self._heap:
                        self._wakes_at = math.inf
                        self._cond.wait()
                        continue
                    when = self._heap[0][0]
                    left = when - time.monotonic()
                    if left <= 0:
                        break
                    self._wakes_at = when
                    # (A lock's wait takes at most TIMEOUT_MAX, ~292 years: a longer request timeout
                    # raised OverflowError here and ended this thread, and every later deadline with it.)
                    self._cond.wait(min(left, threading.TIMEOUT_MAX))
                self._wakes_at = -math.inf  # awake: it looks at the heap before it sleeps again
                if self._closed:
                    return
                entry = heapq.heappop(self._heap)
                fn, entry[2] = entry[2], None
                if fn is None:
                    self._dead -= 1
                    continue
            try:
                fn()
            except Exception:
                log.exception("deadline callback failed")

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._heap.clear()
            self._cond.notify_all()
