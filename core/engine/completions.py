"""Where completions become visible: the engine's completion thread and user-polled queues.

Transports report "done/failed, n bytes" from whatever thread they run on;
the engine records the outcome on the handle (which wakes ``result()``
waiters at once) and hands the handle to one of:

* :class:`CompletionThread` — one thread per engine that settles handles
  (the Future transition) and runs user callbacks, never under a lock. A
  callback that calls ``add_done_callback`` on a finished handle is queued
  behind, not run recursively, so chains of any length work.
* :class:`CompletionQueue` — for callers that reap in bulk on their own
  thread (like Mooncake TENT's poll loop, or libfabric's ``fi_cq_read``):
  handles posted with ``completion_queue=q`` are settled by ``q.poll()`` on the
  caller's thread, with no thread hop at all.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from queue import SimpleQueue
from typing import Any

from ..transfer import Transfer, call_guarded

__all__ = ["CompletionQueue", "CompletionThread"]

log = logging.getLogger("mpcomm.engine")

_STOP = object()


class CompletionThread:
    """Settles handles and runs their callbacks, one at a time, in order."""

    def __init__(self, name: str = "mpcomm-completions") -> None:
        self._q: SimpleQueue[Any] = SimpleQueue()
        self._name = name
        self._thread: threading.Thread | None = None
        self._start_lock = threading.Lock()
        self._ident = -1
        self._stopped = False

    def push(self, item: Any) -> None:
        """A handle whose outcome is recorded, or ``(handle, callback)`` to run later. Any thread."""
        if self._thread is None:
            self._start()
        self._q.put(item)

    def on_thread(self) -> bool:
        return threading.get_ident() == self._ident

    def _start(self) -> None:
        with self._start_lock:
            if self._thread is None and not self._stopped:
                t = threading.Thread(target=self._run, name=self._name, daemon=True)
                t.start()
                self._thread = t

    def _run(self) -> None:
        self._ident = threading.get_ident()
        get = self._q.get
        while True:
            item = get()
            if item is _STOP:
                return
            try:
                if type(item) is tuple:
                    call_guarded(item[1], item[0])
                else:
                    item.settle()
                    hook = item.__dict__.get("on_settled")
                    if hook is not None:
                        hook(item)
                    item.run_callbacks()
            except Exception:  # never let one handle stop the others
                log.exception("completion of %r failed", item)

    def stop(self, timeout: float = 5.0) -> None:
        """Run what is queued, then end the thread (not joined from the thread itself)."""
        self._stopped = True
        t = self._thread
        if t is None:
            return
        self._q.put(_STOP)
        if threading.get_ident() != self._ident:
            t.join(timeout)


class CompletionQueue:
    """Finished handles, reaped in bulk by the caller: ``q.poll(64)``.

    Pass it as ``completion_queue=q`` to ``write``/``read``/``submit``/
    ``write_many``/``read_many``. Such a handle is settled (and its callbacks
    run) by :meth:`poll` on the polling thread; ``result()`` on it still works
    from any thread. The queue is bounded by the number of requests in flight
    (``runtime.queue_depth``): an unreaped handle holds no slot, but the queue
    never holds more handles than were posted with it.
    """

    def __init__(self) -> None:
        self._items: deque[Transfer] = deque()
        self._cond = threading.Condition(threading.Lock())
        self._waiting = 0

    def __len__(self) -> int:
        return len(self._items)

    def push(self, item: Any) -> None:
        if type(item) is tuple:  # a queued callback: run it at the next poll
            t, fn = item
            with self._cond:
                self._items.append(_Deferred(t, fn))  # type: ignore[arg-type]
                if self._waiting:
                    self._cond.notify()
            return
        with self._cond:
            self._items.append(item)
            if self._waiting:
                self._cond.notify()

    def on_thread(self) -> bool:
        return False

    def poll(self, max_items: int = 64, timeout: float | None = 0.0) -> list[Transfer]:
        """Up to ``max_items`` finished handles, settled, in completion order.

        Waits up to ``timeout`` seconds (None: until one is there) when none is.
        """
        out: list[Transfer] = []
        items = self._items
        if not items and timeout != 0:
            deadline = None if timeout is None else time.monotonic() + timeout
            with self._cond:
                self._waiting += 1
                try:
                    while not items:
                        left = None if deadline is None else deadline - time.monotonic()
                        if left is not None and left <= 0:
                            break
                        self._cond.wait(left)
                finally:
                    self._waiting -= 1
        while items and len(out) < max_items:
            try:
                t = items.popleft()
            except IndexError:
                break
            if isinstance(t, _Deferred):
                call_guarded(t.fn, t.transfer)
                continue
            t.settle()
            hook = t.__dict__.get("on_settled")
            if hook is not None:
                hook(t)
            t.run_callbacks()
            out.append(t)
        return out


class _Deferred:
    __slots__ = ("transfer", "fn")

    def __init__(self, transfer: Transfer, fn: Any) -> None:
        self.transfer = transfer
        self.fn = fn

