"""Requests and their completion handles.

A :class:`Transfer` is a :class:`concurrent.futures.Future`, so
``concurrent.futures.wait`` and ``as_completed`` work on it, ``await transfer``
works in asyncio, and ``add_done_callback`` runs the callback at once when the
transfer is already done (callback errors are logged, never raised).

Lifecycle (``Transfer.status``)::

    PENDING ──post──> POSTED ──> COMPLETED
       │                 ├─────> FAILED      (result() raises the MpcommError)
       │                 ├─────> TIMED_OUT   (result() raises TransferTimeout, a TimeoutError)
       └──cancel()──> CANCELLED <──cancel() (transports with in-flight cancel)

**Completion** means every byte is in the destination memory (the remote
region for a write, the local one for a read) and no lease is held any more.

**Threads.** Handles are resolved by the engine: on the caller's thread when a
request finished inside ``write()``, otherwise on the engine's completion
thread, which also runs the callbacks. No callback runs on a transport's
thread, on the deadline timer or under a lock, so a callback may submit more
transfers and wait on them with ``result()``. ``result()`` itself wakes as
soon as the transport reported (one thread hop, not two); a transport that
implements :meth:`~mpcomm.Transport.drive` (tcp, shm) reports on the waiting
thread itself, with no hop at all: the outcome reaches a waiter with no
other Python thread scheduled (docs/contract.md, "What a waiter gets").

**Timeouts.** Every request has a deadline (``runtime.request_timeout_ms``
unless given). When it passes, the engine asks the transport to abort; the
handle becomes TIMED_OUT only when the transport guarantees no more bytes of
the request will land (``TransferTimeout.confirmed``). Before that moment
some, all or none of the bytes may have landed: the destination range is
undefined and must be rewritten.

**Cancellation.** ``cancel()`` never blocks. Before the request is posted it
always succeeds: the lease is released, then callbacks run, and nothing was
transferred. After posting, a transport that declares
``Capabilities.inflight_cancel`` is asked to abort: ``cancel()`` returns at once
(False while the abort is under way) and the handle becomes CANCELLED once no
more bytes can land — ``await transfer.acancel()`` or ``cancel(timeout=...)``
waits for that. Without the capability ``cancel()`` returns False once posted,
as Future.cancel does for a running future. A cancelled write may have
written part of its range; a cancelled read may have filled part of the local
buffer.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import math
import threading
import time
from collections.abc import Callable, Generator, Sequence
from concurrent.futures import CancelledError, Future
from dataclasses import dataclass
from threading import get_ident
from typing import TYPE_CHECKING, Any

from .transport import DONE, FAILED, Operation, OperationGroup, Transport

if TYPE_CHECKING:
    from .remote import RemoteRegion

__all__ = ["Batch", "Operation", "Request", "Transfer", "TransferStatus"]

log = logging.getLogger("mpcomm.transfer")


class TransferStatus(str, enum.Enum):
    PENDING = "pending"
    POSTED = "posted"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"
    TIMED_OUT = "timed_out"


PENDING = TransferStatus.PENDING
POSTED = TransferStatus.POSTED
COMPLETED = TransferStatus.COMPLETED
CANCELLED = TransferStatus.CANCELLED


@dataclass(slots=True)
class Request:
    """One transfer to describe for :meth:`Engine.submit`.

    ``op`` is ``"write"`` (local → remote) or ``"read"`` (remote → local).
    ``length`` defaults to the local buffer's length from ``local_offset``.
    ``notify`` is a small message (≤ 64 KiB) delivered to the target after the data.
    ``timeout`` in seconds overrides ``runtime.request_timeout_ms``.
    ``route`` is an ordered transport list (e.g. ``("shm", "tcp")``) that
    overrides the ``[[route]]`` rules for this request (``route_rule == "hint"``).
    """

    op: str
    local: Any  # Region, or any buffer (registered for the request's duration)
    remote: RemoteRegion
    remote_offset: int = 0
    length: int | None = None
    local_offset: int = 0
    notify: bytes | None = None
    timeout: float | None = None
    route: tuple[str, ...] | None = None


#: The slot descriptors of Request's fields, in the order engine/_fastlane.c's scan reads them
#: (it plans a batch of Requests by these, not by attribute names).
Request.FIELDS = (Request.op, Request.local, Request.remote, Request.remote_offset,  # type: ignore[attr-defined]
                  Request.length, Request.local_offset, Request.notify, Request.timeout, Request.route)


class Dispatch:
    """What the engine plugs into a handle (its completion thread and canceller)."""

    __slots__ = ("push", "on_dispatch_thread", "cancel", "undriven")

    def __init__(self, push: Callable[[Any], None], on_dispatch_thread: Callable[[], bool],
                 cancel: Callable[[Transfer], None], *, undriven: bool = False) -> None:
        self.push = push
        self.on_dispatch_thread = on_dispatch_thread
        self.cancel = cancel
        #: Its handles are reaped by their user (a completion queue's ``poll``): no ``result()``
        #: caller is expected to drive them (:meth:`Transfer.waits_undriven`).
        self.undriven = undriven


_depth = threading.local()
#: What Future.__init__ sets: reading one of them builds a handle's Future base.
_FUTURE_FIELDS = frozenset(vars(Future()))
_MAX_INLINE_DEPTH = 16


class _FutureField:
    """One of a handle's lazily built fields: reading it while the instance lacks it builds the
    handle's Future base (``_future()``), whose stores land in the instance's ``__dict__``, which a
    non-data descriptor lets win from then on. What a ``__getattr__`` hook did, without it: a class
    with one pays a slower lookup for every attribute of every handle, ``result`` included."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def __get__(self, h: Any, owner: Any = None) -> Any:
        if h is None:
            return self
        if not h._built:
            h._future()
        try:
            return h.__dict__[self.name]
        except KeyError:
            raise AttributeError(self.name) from None


_OPEN = threading.Lock()  # the wake lock of handles born done: never held, never waited on


class Transfer(Future):  # type: ignore[type-arg]
    """Completion handle of one request (see the module docstring).

    Attributes:
        status: a :class:`TransferStatus`.
        transport: name of the transport that carried it (None until posted).
        route: the ordered transports the route policy chose (empty until posted).
        route_rule: the routing rule that chose them (None until posted).
        stripes: ``(offset, length, transport)`` per stripe of a split request.
        bytes_moved: bytes in the destination once COMPLETED.
        submitted_at, finished_at: ``time.monotonic()`` stamps.
    """

    # Fields that start at a default are class attributes: a handle stores them only once they
    # change, which keeps building one (once per request) cheap.
    status = PENDING
    transport: str | None = None
    #: The ordered transport list the route policy chose, and the name of the
    #: rule that chose it ("default", "hint" or a [[route]] name).
    route: tuple[str, ...] = ()
    route_rule: str | None = None
    #: For a request the route policy split (a rule's ``split_min``): one
    #: ``(offset, length, transport)`` per stripe, offsets relative to the
    #: request, transport the one that finally carried it; ``transport`` is
    #: then those names joined with "+". Empty for a request sent whole.
    stripes: tuple[tuple[int, int, str], ...] = ()
    bytes_moved = 0
    finished_at: float | None = None
    # The engine's side of a handle (public names so the engine's modules may use them;
    # applications read the attributes documented above instead):
    #: The engine's request behind this handle (Operation or group) while it is in flight.
    operation: Any = None
    #: ``(error, nbytes)`` once the engine recorded how the request ended (:meth:`record_outcome`).
    outcome: tuple[BaseException | None, int] | None = None
    _settled = False
    _cbs_ran = False
    _waiters_n = 0  # threads blocked in result()/exception() (under _lock)
    #: The thread id of a result() caller driving this request now (0: none). Stored and cleared
    #: without the lock (single stores under the GIL); a recorder reads it under ``_lock``.
    _driver = 0
    _left_to_waiter = False  # the engine left settling to a waiter (no completion-thread push)
    #: How many times done() answered False, up to 2: a second one is a poller's (see done()). A plain
    #: store, read unlocked.
    _polls = 0
    #: Held until the outcome is recorded; a result() waiter with no outcome after its drive
    #: blocks on it, and whoever records the outcome releases it: the waiter wakes directly,
    #: not through the completion thread. Made (under _lock) by the first waiter that has to
    #: block: a request whose waiter drove it to its end never needs one.
    _wake: Any = None
    # The Future base (its Condition and fields) is built only when something asks for it
    # (see _future): result(), done() and the rest answer from the outcome without it.
    _built = False  # the Future base exists
    _applied = False  # the outcome is applied (status, bytes_moved): the handle is done

    def __init__(self, request: Request | None = None, *, _dispatch: Dispatch | None = None) -> None:  # noqa: D107
        # No Future.__init__ here: see _future.
        self._request = request
        self.submitted_at = time.monotonic()
        self.dispatch = _dispatch
        self._callbacks: list[Callable[[Transfer], Any]] = []
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"<Transfer {self.status.value} via={self.transport} bytes={self.bytes_moved}>"

    def __await__(self) -> Generator[Any, None, Any]:
        return asyncio.wrap_future(self).__await__()

    @property
    def request(self) -> Request | None:
        """The request this handle stands for."""
        if self._request is None and isinstance(self.operation, Operation):
            op = self.operation
            self._request = Request(op.kind, op.local, op.remote, op.remote_offset, op.length, op.local_offset)
        elif self._request is None and getattr(self, "_request_args", None) is not None:
            self._request = Request(*self._request_args)
        return self._request

    @property
    def elapsed(self) -> float | None:
        """Seconds from submit to completion (None while pending)."""
        return None if self.finished_at is None else self.finished_at - self.submitted_at

    # -- the Future base, built on demand ---------------------------------------------
    #
    # Most handles are waited on with result() or a callback and never need the
    # Future machinery (a Condition, its fields, set_result's notify): building
    # and resolving it cost about 2 µs per request. So it is built on first
    # access to one of the Future's own fields (concurrent.futures.wait and
    # as_completed read them directly, a handle no engine owns is resolved
    # through them) and, if the outcome is already applied, resolved at once;
    # an outcome applied later resolves it in _settle. Both steps look at
    # _built/_applied under _lock, so exactly one of them resolves it. Nothing
    # of the Future's internals is named here: it is built by Future.__init__
    # and resolved by Future's own methods.

    # Each of _FUTURE_FIELDS is a _FutureField (set below the class).

    def _future(self) -> None:
        """Build the Future base (any thread; once)."""
        with self._lock:
            if self._built:
                return
            Future.__init__(self)
            self._built = True
            replay = self._applied
        if replay:
            self._to_future()

    def _to_future(self) -> None:
        """Resolve the built Future base with the applied outcome."""
        error, nbytes = self.outcome  # type: ignore[misc]
        if isinstance(error, CancelledError):
            Future.cancel(self)  # never RUNNING: the Future is PENDING until settled
            Future.set_running_or_notify_cancel(self)  # tell concurrent.futures.wait()
        elif error is None:
            Future.set_result(self, nbytes)
        else:
            Future.set_exception(self, error)

    # -- observing -----------------------------------------------------------------

    def _sync(self) -> None:
        if not self._settled and self.outcome is not None:
            self.settle()

    def done(self) -> bool:
        """True once the request is over. Never blocks.

        A second False answer is a poll (an event loop's, or ``MPI_Test``'s): whoever asks may
        never drive this request in ``result()``, so it hands the request to its transport as a
        callback does (:meth:`Transport.undriven`: tcp's reader reads its reply at once rather
        than leaving it to a driver), once per handle; other answers only look. The first False
        answer does not: ``if not t.done(): t.result()`` is a check before a wait, whose
        ``result()`` reads its own reply.
        """
        self._sync()
        if self._applied:
            return True
        if self._built and Future.done(self):
            return True
        polls = self._polls
        if polls < 2:
            self._polls = polls + 1  # before the hand-over: a post racing it sees it (waits_undriven)
            if polls:
                undriven(self._driven())
        return False

    def running(self) -> bool:
        return self.status is POSTED and not self.done()

    def cancelled(self) -> bool:
        self._sync()
        if self._applied:
            return self.status is CANCELLED
        return self._built and Future.cancelled(self)

    def _await_outcome(self, timeout: float | None) -> float | None:
        """Wait for the report (not for the completion thread); returns what is left of ``timeout``.

        The usual end, a request whose report its own waiter reads in ``drive()``, takes one hold
        of the lock in all: the recording (:meth:`record_outcome_for_waiter`), which sees this
        thread as the driver and applies the outcome in the same hold. The driver mark is a plain
        store set before the drive and cleared after it, each waiter then looking at the outcome:
        a recorder that saw the mark leaves the settling to a waiter that will see its outcome.
        Only a waiter that has to block counts itself under the lock (:meth:`_wake_for_waiter`).
        """
        if self._settled or self.outcome is not None:
            self._sync()
            return 0
        end = None if timeout is None else time.monotonic() + max(timeout, 0)
        me = get_ident()
        wake = None
        try:
            for op in self._driven() if timeout != 0 else ():
                t = getattr(op, "transport", None)
                if getattr(type(t), "drive", Transport.drive) is Transport.drive or op.done:
                    continue
                self._driver = me  # marked first, so a report made by this very call is applied here
                try:
                    t.drive(op, math.inf if end is None else end)
                except Exception:  # noqa: BLE001 - the caller still waits the usual way
                    log.exception("transport %s failed in drive()", t.name)
                if self.outcome is not None or (end is not None and time.monotonic() >= end):
                    break
            if self.outcome is None:
                # Not in (no drive, or it ended first): counted for the wake lock while still marked,
                # so a report made meanwhile sees one or the other.
                wake = self._wake_for_waiter()
        finally:
            if self._driver:
                self._driver = 0  # cleared before the looks below (see the docstring)
        settled_here = False
        if wake is not None:
            try:
                if end is not None:
                    timeout = max(end - time.monotonic(), 0)
                if wake.acquire(timeout=-1 if timeout is None else max(timeout, 0)):
                    wake.release()  # pass it on to the next waiter
            finally:
                settled_here = self._uncount()
        if self.outcome is not None and not self._settled:
            settled_here = self.settle() or settled_here
        if self.outcome is not None:
            # Settled here: the engine may have left that to this waiter (leave_to_waiter).
            if settled_here and self._left_to_waiter and self.dispatch is not None:
                with self._lock:
                    left = bool(self._callbacks)
                if left:
                    # Nobody handed it to the completion thread: callbacks added meanwhile run there.
                    self.dispatch.push(self)
            return 0
        # No report in time. A handle no engine owns (or one settled another
        # way, e.g. cancel()) may still be resolved through the Future itself.
        return 0 if self.dispatch is not None else timeout

    def _uncount(self) -> bool:
        """A blocked waiter leaves: uncounted, and settled (settle()'s step) if the outcome is in,
        under one hold of the lock; True if this call settled it."""
        with self._lock:
            self._waiters_n -= 1
            settled_here = not self._settled and self.outcome is not None
            if settled_here:
                self._settled = True
                self._apply()
                built = self._built
        if settled_here and built:
            self._to_future()
        return settled_here

    def _wake_for_waiter(self) -> Any:
        """The wake lock a waiter blocks on (made here, held, by the first one), the waiter counted
        (:meth:`_uncount` when it leaves); None, uncounted, once the outcome is in."""
        with self._lock:
            if self.outcome is not None:
                return None
            self._waiters_n += 1  # counted where the outcome is looked at: a later report sees it
            wake = self._wake
            if wake is None:
                wake = self._wake = threading.Lock()
                wake.acquire()
            return wake

    def _driven(self) -> tuple[Any, ...]:
        """The posted units a waiter may drive (Transport.drive): this request's own."""
        return () if self.operation is None else (self.operation,)

    def waits_undriven(self) -> bool:
        """True when this handle is waited on other than by a ``result()`` caller that drives it:
        it is reaped from a completion queue, a callback waits for it, or ``done()`` was polled on
        it in flight. Read when its request is posted (:attr:`Operation.undriven`), so a request
        held before it was posted (its peer still connecting, ``post=False``, a busy transport)
        is handed over as one posted at once would have been."""
        d = self.dispatch
        return self._polls > 1 or bool(self._callbacks) or (d is not None and d.undriven)

    def leave_to_waiter(self) -> bool:
        """Engine, after :meth:`record_outcome`: True when a ``result()`` waiter will settle this handle.

        Then the completion thread need not wake for it (one thread hop less
        per request waited on). Only without callbacks or a settle hook; a
        callback added later finds the handle done and runs at once, or, added
        before the waiter settles, is pushed to the completion thread by it.
        The waiter counts down under the same lock before it looks at the
        outcome, so a waiter that saw no outcome was not counted here.
        """
        with self._lock:
            return self._leave_to_waiter_locked()

    def _leave_to_waiter_locked(self) -> bool:
        self._left_to_waiter = ((self._waiters_n > 0 or self._driver != 0) and not self._callbacks
                                and "on_settled" not in self.__dict__)
        return self._left_to_waiter

    def result(self, timeout: float | None = None) -> Any:
        left = self._await_outcome(timeout)
        if not self._applied:
            if self.outcome is not None:
                self.settle()  # applied by now, here or by the thread that holds the lock
            if not self._applied:
                # Not done in time, or a handle resolved through the Future itself.
                return Future.result(self, left)
        error = self.outcome[0]  # type: ignore[index]
        if error is None:
            return self.bytes_moved
        try:
            raise error
        finally:
            error = None  # as Future.result: no cycle through the traceback's frame
            del self

    def exception(self, timeout: float | None = None) -> BaseException | None:
        left = self._await_outcome(timeout)
        if not self._applied:
            if self.outcome is not None:
                self.settle()
            if not self._applied:
                return Future.exception(self, left)
        error = self.outcome[0]  # type: ignore[index]
        if isinstance(error, CancelledError):
            raise error
        return error

    def add_done_callback(self, fn: Callable[[Transfer], Any]) -> None:  # type: ignore[override]
        """Run ``fn(transfer)`` once done: on the engine's completion thread, or
        at once when already done (queued instead when called from a callback,
        so chains of callbacks never recurse)."""
        self._sync()
        with self._lock:
            if not self._settled or self._callbacks:
                # Not done, or done with earlier callbacks still waiting for the
                # completion thread: run after them, in registration order.
                first = not self._callbacks and self.outcome is None
                self._callbacks.append(fn)
            else:
                first = None
        if first is None:
            self._call_now(fn)
        elif first:
            undriven(self._driven())  # a callback waits: its answer must not wait for a driver

    def _call_now(self, fn: Callable[[Transfer], Any]) -> None:
        """Done, no earlier callback waiting: run ``fn`` here (queued when that would recurse)."""
        d = self.dispatch
        depth = getattr(_depth, "n", 0)
        if d is not None and (d.on_dispatch_thread() or depth >= _MAX_INLINE_DEPTH):
            d.push((self, fn))
            return
        _depth.n = depth + 1
        try:
            call_guarded(fn, self)
        finally:
            _depth.n = depth

    # -- cancelling ----------------------------------------------------------------

    def cancel(self, timeout: float | None = 0) -> bool:  # type: ignore[override]
        """Request cancellation; never blocks unless ``timeout`` is given.

        Returns True once the handle is CANCELLED (at once for a request not
        yet posted). For a posted request on a transport with in-flight cancel
        the abort is started and, with ``timeout``, waited for up to that many
        seconds (None: until done).
        """
        if self.done():
            return self.cancelled()
        d = self.dispatch
        if d is None:  # a handle no engine owns (tests, wrappers)
            ok = Future.cancel(self)
            if ok:
                self.status = CANCELLED
                self.finished_at = time.monotonic()
                Future.set_running_or_notify_cancel(self)
                self.run_callbacks()
            return ok
        d.cancel(self)
        if timeout != 0 and not self.done():
            try:
                self.exception(timeout)
            except (CancelledError, TimeoutError):
                pass
        return self.cancelled()

    async def acancel(self) -> bool:
        """Cancel and wait, without blocking the event loop, until the outcome is known."""
        self.cancel()
        if not self.done():
            try:
                await asyncio.wrap_future(self)
            except BaseException:  # noqa: BLE001 - the outcome is read below
                pass
        return self.cancelled()

    # -- the engine's side ---------------------------------------------------------
    #
    # Called by the engine's pipeline (core/engine/), never by applications: they record,
    # settle and deliver an outcome. ``dispatch`` (set at construction) is the engine's
    # completion thread or queue and canceller for this handle.

    def record_outcome(self, error: BaseException | None, nbytes: int) -> bool:
        """The request ended (any thread): remember how, wake result() waiters.

        The first outcome wins; False if one was recorded already.
        """
        with self._lock:
            if self.outcome is not None:
                return False
            self.outcome = (error, nbytes)
            wake = self._wake  # None: no waiter blocks (one makes it under this lock)
        if wake is not None:
            wake.release()
        return True

    def record_outcome_for_waiter(self, error: BaseException | None, nbytes: int) -> bool | None:
        """:meth:`record_outcome` and :meth:`leave_to_waiter` under one hold of the lock (the engine's
        own handles, once per request): None if an outcome was recorded already, else whether a
        ``result()`` waiter settles it."""
        with self._lock:
            if self.outcome is not None:
                return None
            self.outcome = (error, nbytes)
            wake = self._wake
            left = self._leave_to_waiter_locked()
            # Recorded by the waiter's own drive (the usual end of a waited request): applied in this
            # same hold, so the waiter, back from its drive, finds the handle settled.
            mine = left and self._driver == get_ident() and not self._settled
            if mine:
                self._settled = True
                self._apply()
                built = self._built
        if wake is not None:
            wake.release()
        if mine and built:
            self._to_future()
        return left

    def drop_operation(self) -> None:
        """Forget the engine's Operation (it was released), keeping what :attr:`request` needs."""
        op = self.operation
        self._request_args = (op.kind, op.local, op.remote, op.remote_offset, op.length, op.local_offset)
        self.operation = None

    def settle(self) -> bool:
        """Apply the recorded outcome (caller's or completion thread); True if this call did.

        Whoever returns from it, True or False, finds the handle done: the
        outcome is applied under the same lock that marks it settled.
        """
        with self._lock:
            if self._settled:
                return False
            self._settled = True
            self._apply()
            built = self._built
        if built:
            self._to_future()
        return True

    def _apply(self) -> None:
        """Set status and byte count from the recorded outcome (``_lock`` held)."""
        error, nbytes = self.outcome  # type: ignore[misc]
        self.finished_at = time.monotonic()
        if error is None:
            self.bytes_moved = nbytes
            self.status = COMPLETED
        elif isinstance(error, CancelledError):
            self.status = CANCELLED
        else:
            self.status = TransferStatus.TIMED_OUT if isinstance(error, TimeoutError) else TransferStatus.FAILED
        self._applied = True

    def run_callbacks(self) -> None:
        while True:
            with self._lock:
                cbs, self._callbacks = self._callbacks, []
                if not cbs:
                    self._cbs_ran = True
                    return
            for fn in cbs:
                call_guarded(fn, self)

    def finish_inline(self) -> None:
        """Settle on the posting thread; callbacks (only the engine's own can exist yet) run here."""
        if not self._callbacks:
            # Nobody else holds the handle yet: settle and close the callback
            # list in one step (the common path of a request finished in write()).
            with self._lock:
                if self._callbacks or self._settled:
                    mine = False
                else:
                    self._settled = True
                    self._cbs_ran = True
                    self._apply()
                    mine = True
                    built = self._built
            if mine:
                if built:
                    self._to_future()
                return
        self.settle()
        self.run_callbacks()


for _name in _FUTURE_FIELDS:
    setattr(Transfer, _name, _FutureField(_name))

_materialising = threading.Lock()


class LandedOrigin:
    """What carried the requests of one inline lane: shared by every :class:`Landed` handle it made."""

    __slots__ = ("transport", "route", "rule", "dispatch")

    def __init__(self, transport: str, route: tuple[str, ...], rule: str, dispatch: Dispatch) -> None:
        self.transport, self.route, self.rule, self.dispatch = transport, route, rule, dispatch


class Landed(Transfer):
    """A handle born COMPLETED: the engine's inline lane, a request that landed inside ``write()``.

    It costs a few attribute stores: no lock, no wake-up, no outcome to
    record. Its Future base (a Condition and the Future's own fields) is built
    only when something outside this class asks for it -- ``concurrent.futures.wait``
    or ``as_completed`` look at a Future's fields directly -- by running
    ``Future.__init__`` and ``Future.set_result`` on the first read of one of
    its fields (:class:`_FutureField`); nothing of the Future's internals is
    named or touched here.
    """

    # The five attributes __init__ sets are slots: engine/_fastlane.c sets them through these
    # descriptors (FIELDS, handed to it when a pair is bound), by no name.
    __slots__ = ("bytes_moved", "_origin", "_request_args", "submitted_at", "finished_at")

    status = COMPLETED
    stripes: tuple[tuple[int, int, str], ...] = ()
    _applied = True
    operation = None
    _request = None
    _settled = True
    _cbs_ran = True
    _waiters_n = 0
    _left_to_waiter = False
    _wake = _OPEN

    def __init__(self, nbytes: int, origin: LandedOrigin, request: tuple[Any, ...],
                 submitted_at: float) -> None:  # noqa: D107 - no Future.__init__ on purpose
        """``origin`` says what carried it (shared by every handle of its lane); ``request`` holds
        the arguments of the :class:`Request` it stands for, built only if asked for. Five stores
        and a clock read: this runs once per request on the fastest path there is.
        engine/_fastlane.c makes these handles too, setting the same five attributes (FIELDS, in
        this order) without this frame: keep the two in step (tests/core/test_fastlane.py
        compares them)."""
        self.bytes_moved = nbytes
        self._origin = origin
        self._request_args = request
        self.submitted_at = submitted_at
        self.finished_at = time.monotonic()

    # What carried it, read from its origin: attributes the handle itself never stores.
    transport = property(lambda self: self._origin.transport)
    route = property(lambda self: self._origin.route)
    route_rule = property(lambda self: self._origin.rule)
    dispatch = property(lambda self: self._origin.dispatch)
    outcome = property(lambda self: (None, self.bytes_moved))

    # Transfer.__init__'s two fields, built with the Future's (no __getattr__: see _FutureField).
    _callbacks = _FutureField("_callbacks")
    _lock = _FutureField("_lock")

    def _future(self) -> None:
        with _materialising:
            if "_future_built" not in self.__dict__:
                self._callbacks = []
                self._lock = threading.Lock()
                Future.__init__(self)
                Future.set_result(self, self.bytes_moved)
                self.__dict__["_future_built"] = True

    def done(self) -> bool:
        return True

    def running(self) -> bool:
        return False

    def cancelled(self) -> bool:
        return False

    def result(self, timeout: float | None = None) -> Any:
        return self.bytes_moved

    def exception(self, timeout: float | None = None) -> BaseException | None:
        return None

    def cancel(self, timeout: float | None = 0) -> bool:  # type: ignore[override]
        return False

    def add_done_callback(self, fn: Callable[[Transfer], Any]) -> None:  # type: ignore[override]
        self._call_now(fn)

    def __await__(self) -> Generator[Any, None, Any]:
        return self.bytes_moved
        yield  # a generator that finishes at once: nothing to wait for


def undriven(units: tuple[Any, ...]) -> None:
    """A callback waits for these posted units, perhaps with no ``result()`` caller to drive them:
    each transport that leaves answers to drivers reads them promptly instead (Transport.undriven)."""
    for op in units:
        t = getattr(op, "transport", None)
        if getattr(type(t), "undriven", Transport.undriven) is not Transport.undriven and not op.done:
            try:
                t.undriven(op)
            except Exception:  # noqa: BLE001 - the answer still comes, later
                log.exception("transport %s failed in undriven()", t.name)


def call_guarded(fn: Callable[[Any], Any], arg: Any) -> None:
    try:
        fn(arg)
    except Exception:  # a callback must never stop completion
        log.exception("transfer callback %r failed", fn)
    except BaseException:
        if threading.current_thread() is threading.main_thread():
            raise  # Ctrl-C or sys.exit() in a callback run on the caller's main thread
        # SystemExit (or the like) would end the completion thread silently, and with it
        # every later callback of the engine.
        log.exception("transfer callback %r raised; ignored", fn)


#: The descriptors of the attributes Landed.__init__ sets, in its order (engine/_fastlane.c's FIELD_*).
Landed.FIELDS = (Landed.bytes_moved, Landed._origin, Landed._request_args,  # type: ignore[attr-defined]
                  Landed.submitted_at, Landed.finished_at)


class Batch(Transfer):
    """Handle of many requests (:meth:`Engine.submit`, ``write_many``, ``read_many``).

    Completes when every request is done: with the total byte count if all
    succeeded, else with the error of the first failed request (in index order;
    the others stay inspectable through :attr:`errors`, :attr:`failed` and
    :attr:`statuses`). Cancelling the batch cancels every request in it.

    Attributes:
        count: number of requests.
        statuses: one :class:`TransferStatus` per request, in submission order.
        errors: ``{index: exception}`` for the requests that failed.
        failed: indices of failed requests, ascending.
        bytes_per_request: bytes in the destination per request (0 for failed ones).
        transfers: one :class:`Transfer` per request (made on first access).
    """

    def __init__(self, count: int, *, _dispatch: Dispatch | None = None) -> None:
        super().__init__(None, _dispatch=_dispatch)
        self.count = count
        #: (first index, group or op) for each part of the batch; engine-private.
        self.parts: list[tuple[int, Any]] = []
        self._members: list[Transfer] | None = None
        self.requests: Sequence[Request] | None = None

    def __repr__(self) -> str:
        return f"<Batch x{self.count} {self.status.value} bytes={self.bytes_moved}>"

    # -- the engine's side: its parts, and who hands the finished batch on ----------
    #: Parts (groups or single requests) that have not ended yet.
    left = 0
    #: The engine's thread is posting the parts now (it hands the batch on when done).
    posting = False
    #: The finished batch was handed on: settled on the posting thread or pushed to ``dispatch``.
    handed = False
    #: ``submit(..., post=False)``: the parts wait for ``Engine.post()``.
    staged = False

    def part_ended(self) -> bool:
        """One part ended: True for the last one.

        After the last one the engine reads no part's back reference to this batch any
        more (each part's ending calls this as its last use of it), so the groups hold
        it weakly from then on: the batch keeps its groups for :meth:`index_state`, and
        a strong reference back made every finished batch a cycle for the collector.
        """
        with self._lock:
            self.left -= 1
            last = self.left == 0
        if last:
            for _, part in self.parts:
                release = getattr(part, "release_owner", None)  # a group, or the engine's BatchOp
                if release is not None:
                    release()
        return last

    def take_handover(self) -> bool:
        """True for the one caller that hands the finished batch on: never while it is being
        posted (the posting thread does, :meth:`end_posting`), and only once."""
        with self._lock:
            if self.posting or self.handed:
                return False
            self.handed = True
            return True

    def end_posting(self) -> bool:
        """The posting thread is done: True when the batch finished meanwhile and this thread
        hands it on (exactly one of it and :meth:`take_handover` does)."""
        with self._lock:
            self.posting = False
            if self.outcome is None or self.handed:
                return False
            self.handed = True
            return True

    def index_state(self) -> tuple[list[TransferStatus], dict[int, BaseException], list[int]]:
        statuses = [PENDING] * self.count
        errors: dict[int, BaseException] = {}
        lengths = [0] * self.count
        for start, part in self.parts:
            if isinstance(part, OperationGroup):
                st = part.status
                for i in range(part.count):
                    code = st[i]
                    if code == DONE:
                        statuses[start + i] = COMPLETED
                        lengths[start + i] = part.lengths[i]
                    elif code == FAILED:
                        err = part.errors.get(i)
                        errors[start + i] = err  # type: ignore[assignment]
                        statuses[start + i] = _status_of(err)
                    elif self.status is not PENDING:
                        statuses[start + i] = POSTED
            else:
                t: Transfer = part.transfer
                t._sync()
                statuses[start] = t.status
                if t.status is COMPLETED:
                    lengths[start] = t.bytes_moved
                elif t.done():
                    errors[start] = CancelledError() if t.cancelled() else t.exception()  # type: ignore[assignment]
        return statuses, errors, lengths

    @property
    def statuses(self) -> list[TransferStatus]:
        return self.index_state()[0]

    @property
    def errors(self) -> dict[int, BaseException]:
        return self.index_state()[1]

    @property
    def failed(self) -> list[int]:
        return sorted(self.index_state()[1])

    @property
    def bytes_per_request(self) -> list[int]:
        return self.index_state()[2]

    @property
    def transfers(self) -> list[Transfer]:
        if self._members is None:
            self._members = _members_of(self)
        return self._members

    def cancel(self, timeout: float | None = 0) -> bool:  # type: ignore[override]
        return super().cancel(timeout)

    def _driven(self) -> tuple[Any, ...]:
        # Every part (a group or a lone request), each on its own transport and connections.
        return tuple(part for _, part in self.parts)


def _status_of(err: BaseException | None) -> TransferStatus:
    if isinstance(err, CancelledError):
        return CANCELLED
    if isinstance(err, TimeoutError):
        return TransferStatus.TIMED_OUT
    return TransferStatus.FAILED


class _Member(Transfer):
    """One request of a vectorised part of a :class:`Batch`; resolves when its part does.

    It can be cancelled alone while its part is not posted yet; once posted,
    the part is one posting and only the whole batch can be cancelled.
    """

    #: The vectorised part it belongs to, and its index there (the engine's cancel reads them).
    group: OperationGroup | None = None
    index = -1


def _members_of(batch: Batch) -> list[Transfer]:
    out: list[Transfer | None] = [None] * batch.count
    reqs = batch.requests
    for start, part in batch.parts:
        if isinstance(part, OperationGroup):
            for i in range(part.count):
                m = _Member(reqs[start + i] if reqs is not None else None, _dispatch=batch.dispatch)
                m.group, m.index = part, i
                m.transport = batch.transport
                m.status = POSTED if batch.status is not PENDING else PENDING
                out[start + i] = m
            part.member_handles.append((start, out))
            if part.done:
                resolve_members(part)
        else:
            out[start] = part.transfer
    return out  # type: ignore[return-value]


def resolve_members(group: OperationGroup) -> None:
    """The group finished: settle the member handles made for it (if any)."""
    for start, out in group.member_handles:
        for i in range(group.count):
            m = out[start + i]
            if m is None:
                continue
            if group.status[i] == DONE:
                m.record_outcome(None, group.lengths[i])
            else:
                m.record_outcome(group.errors.get(i) or CancelledError(), 0)
            m.finish_inline()
            # Settled: the engine's cancel no longer needs its group, and group ->
            # member_handles -> member -> group would keep both for the cycle collector.
            m.group = None
