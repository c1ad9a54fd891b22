"""Units: what the engine keeps on a request (an Operation or an OperationGroup) besides what a transport sees.

These fields are the engine's bookkeeping; they are public names so every room of the
pipeline (:mod:`.admission`, :mod:`.posting`, :mod:`.endings`, ...) may read them, but
transports never read or set them.
"""

from __future__ import annotations

import threading
import time
import weakref
from typing import Any

from ..transport import Operation, OperationGroup

# Unit stages (``unit.stage``), moved on under ``unit._lock``.
WAITING, POSTED, FINISHED = 0, 1, 2


class Unit:
    """What the engine keeps on a unit (an :class:`Op` or a :class:`Group`), at these class-level
    defaults: a unit stores only the fields that leave them (most never do), which keeps making
    one cheap on the hottest path."""

    __slots__ = ()
    stage = WAITING
    ephemeral = False
    notify_after: bytes | None = None
    route_hint: tuple[str, ...] | None = None
    holds_slot = False
    posting = False
    handed = False
    batch: Any = None
    deadline_entry: Any = None
    tracked = False
    released = False
    probe: str | None = None  # the health probe slot it holds (see Retries._end_probe)


class Op(Unit, Operation):
    """An engine's request."""


class Group(Unit, OperationGroup):
    """An engine's vectorised part of a batch (its ``batch``, ``transfer`` and ``first_index`` set
    when a batch adopts it: :meth:`Admission._adopt`)."""


class BatchOp(Op):
    """A lone request inside a batch (a notifying one in ``submit``)."""

    def release_owner(self) -> None:
        """The batch's last part ended (``Batch.part_ended`` calls this): hold it weakly, as a
        group does (:meth:`OperationGroup.release_owner`); the batch holds this in ``parts``."""
        held = self.batch
        if held is not None and type(held) is not weakref.ProxyType:
            self.batch = weakref.proxy(held)


class BoundOp(Op):
    """A request posted through its pair's binding (:meth:`BoundPairs._cached`): it starts
    claimed (POSTED, nobody else can see it yet), holding its slot, on its first candidate.
    Class-level, so making one writes none of them."""

    stage = POSTED
    holds_slot = True
    attempt = 0
    #: Posted inside write()/read(), before its handle exists, with no completion queue: nothing but
    #: result() can wait on it yet (Operation.undriven, read by a transport's post).
    undriven = False


class Slots:
    """A counting semaphore for ``runtime.queue_depth`` whose uncontended path takes no lock:
    a free slot is a token in a list, taken by ``pop()`` and given back by ``append()`` (each
    one C call, atomic under the GIL). Only a thread that has to wait takes the lock, to sleep
    on the condition; a release wakes it when someone waits."""

    def __init__(self, n: int) -> None:
        self.capacity = n
        self._tokens: list[None] = [None] * n
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._waiting = 0  # under _lock; read by release() without it (see there)

    @property
    def in_use(self) -> int:
        return self.capacity - len(self._tokens)

    @property
    def waiting(self) -> int:
        """Threads waiting for a slot now (``Engine.stats()``'s queue backlog counts them)."""
        return self._waiting

    def try_acquire(self) -> bool:
        """A slot if one is free now, else False (the per-request path: no lock, no keyword parsing)."""
        try:
            self._tokens.pop()
        except IndexError:
            return False
        return True

    def acquire(self, deadline: float) -> bool:
        """A slot, waiting for one until ``deadline`` (``time.monotonic()``); False when none came."""
        if self.try_acquire():
            return True
        with self._lock:
            # Counted before it looks again: a release that did not see the count came before
            # that look, so its token is seen; one that did takes the lock to notify, which it
            # gets only once this thread sleeps on the condition.
            self._waiting += 1
            try:
                while not self.try_acquire():
                    left = deadline - time.monotonic()
                    if left <= 0:
                        return False
                    self._cond.wait(left)
                return True
            finally:
                self._waiting -= 1

    def release(self) -> None:
        self._tokens.append(None)
        if self._waiting:
            with self._lock:
                self._cond.notify()
