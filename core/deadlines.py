"""One timer thread for every deadline of an engine.

The thread sleeps on a condition until the earliest deadline (no polling), so
an idle engine costs no CPU. Callbacks run on the timer thread and must be
quick: they only ask transports to abort.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
from collections.abc import Callable

log = logging.getLogger("mpcomm.deadlines")


class DeadlineTimer:
    def __init__(self, name: str = "mpcomm-deadlines") -> None:
        self._heap: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = itertools.count()
        self._cond = threading.Condition()
        self._closed = False
        self._name = name
        self._thread: threading.Thread | None = None

    def schedule(self, when: float, fn: Callable[[], None]) -> None:
        """Run ``fn`` at monotonic time ``when`` (callbacks check whether still needed)."""
        with self._cond:
            if self._closed:
                return
            heapq.heappush(self._heap, (when, next(self._seq), fn))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
            elif self._heap[0][2] is fn:
                self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._closed:
                    if not self._heap:
                        self._cond.wait()
                        continue
                    left = self._heap[0][0] - time.monotonic()
                    if left <= 0:
                        break
                    self._cond.wait(left)
                if self._closed:
                    return
                _, _, fn = heapq.heappop(self._heap)
            try:
                fn()
            except Exception:
                log.exception("deadline callback failed")

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._heap.clear()
            self._cond.notify_all()
