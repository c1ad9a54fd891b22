"""shm copies handed off by ``post`` that the ``result()`` caller may run itself.

A copy past ``inline_threshold`` is not run inside ``post``: it waits in a slot of a
ring (``_copyloop.c``, "Posted copies"). The thread that then waits in ``result()``
claims it (:meth:`PostedCopies.claim`, from ``ShmTransport.drive``) and copies on its
own thread with the GIL released, so its outcome reaches it with no other Python
thread scheduled (docs/contract.md, "What a waiter gets"). A copy nobody claims within
``delay`` is taken by one of this object's workers, which wait for it in C without the
GIL: an engine whose callers do not wait (callbacks, polling) pays ``delay`` once per
posted copy. Each job runs exactly once (a claim is a compare-and-swap of its id) and
reports as it did on the engine's workers, so abort, deadline, revocation and close
behave the same whichever thread runs it.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from array import array
from collections.abc import Callable
from typing import Any

__all__ = ["Job", "PostedCopies"]

_SLOTS = 64  # copies waiting at once; more are handed to the engine's workers as before
_TAKE_NS = 500_000_000  # a worker looks at its shutdown flag this often


class Job:
    """One copy waiting in a slot: ``run()`` once claimed."""

    __slots__ = ("id", "slot", "fn", "args")

    def __init__(self, id_: int, slot: int, fn: Callable[..., None], args: tuple[Any, ...]) -> None:
        self.id, self.slot, self.fn, self.args = id_, slot, fn, args

    def run(self) -> None:
        self.fn(*self.args)


class PostedCopies:
    """The ring of waiting copies and its workers (one per shm transport)."""

    def __init__(self, loop: Any, workers: int, delay: float, log: logging.Logger) -> None:
        self._loop = loop
        self._workers_n = max(1, workers)
        self._delay_ns = int(delay * 1e9)
        self._log = log
        self._states = array("q", bytes(8 * _SLOTS))
        self._dues = array("q", bytes(8 * _SLOTS))
        self._seq = array("i", (0,))
        self._states_at = self._states.buffer_info()[0]
        self._dues_at = self._dues.buffer_info()[0]
        self._seq_at = self._seq.buffer_info()[0]
        self._jobs: list[Job | None] = [None] * _SLOTS
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._closed = False

    def post(self, fn: Callable[..., None], *args: Any) -> Job | None:
        """Publish ``fn(*args)``; None when every slot is taken (run it another way)."""
        with self._lock:
            if self._closed:
                return None
            try:
                slot = self._jobs.index(None)
            except ValueError:
                return None
            job = Job(next(self._ids), slot, fn, args)
            self._jobs[slot] = job
            self._dues[slot] = time.monotonic_ns() + self._delay_ns
            self._states[slot] = job.id  # published: a worker or a claim may take it from now on
            if len(self._threads) < self._workers_n:
                t = threading.Thread(target=self._work, name=f"mpcomm-shm-posted-{len(self._threads)}",
                                     daemon=True)
                self._threads.append(t)
                t.start()
        self._loop.posted_kick(self._seq_at)
        return job

    def claim(self, job: Job) -> bool:
        """The caller's thread takes ``job`` if nobody has (then it must ``run()`` it)."""
        if not self._loop.posted_claim(self._states_at + 8 * job.slot, job.id):
            return False
        self._free(job.slot)
        return True

    def _free(self, slot: int) -> None:
        with self._lock:
            self._jobs[slot] = None
            self._states[slot] = 0

    def _work(self) -> None:
        take = self._loop.posted_take
        while True:
            slot = take(self._states_at, self._dues_at, _SLOTS, self._seq_at, _TAKE_NS)
            if slot < 0:
                with self._lock:
                    if self._closed and all(j is None for j in self._jobs):
                        return
                continue
            job = self._jobs[slot]
            self._free(slot)
            if job is None:  # pragma: no cover - a taken slot always holds its job
                continue
            try:
                job.run()
            except Exception:  # noqa: BLE001 - the job reports through its operation
                self._log.exception("shm: a posted copy failed")

    def close(self) -> None:
        """No new jobs; the workers run what waits (aborted copies end at once), then exit."""
        with self._lock:
            self._closed = True
        self._loop.posted_kick(self._seq_at)
