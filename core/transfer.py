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

**Timeouts.** Every request has a deadline (``runtime.request_timeout_ms``
unless given). When it passes, the engine asks the transport to abort; the
handle becomes TIMED_OUT only when the transport guarantees no more bytes of
the request will land. Before that moment some, all or none of the bytes may
have landed: the destination range is undefined and must be rewritten.

**Cancellation.** ``cancel()`` before the request is posted always succeeds and
nothing is transferred. After posting, a transport that declares
``Capabilities.inflight_cancel`` aborts the request: ``cancel()`` waits until no
more bytes can land and returns True, or returns False when the request
completed first. Without that capability ``cancel()`` returns False once
posted, as Future.cancel does for a running future. A cancelled write may have
written part of its range; a cancelled read may have filled part of the local
buffer.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import threading
import time
from collections.abc import Callable, Generator, Sequence
from concurrent.futures import CancelledError, Future
from concurrent.futures._base import CANCELLED, CANCELLED_AND_NOTIFIED, FINISHED, RUNNING
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .errors import MpcommError, TransferTimeout

if TYPE_CHECKING:
    from .memory import Region
    from .remote import RemoteRegion
    from .transport import Transport

__all__ = ["Batch", "Operation", "Request", "Transfer", "TransferStatus"]

log = logging.getLogger("mpcomm.transfer")


class TransferStatus(str, enum.Enum):
    PENDING = "pending"
    POSTED = "posted"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"
    TIMED_OUT = "timed_out"


@dataclass
class Request:
    """One transfer to describe for :meth:`Engine.submit`.

    ``op`` is ``"write"`` (local → remote) or ``"read"`` (remote → local).
    ``length`` defaults to what fits in both regions from their offsets.
    ``notify`` is a small message (≤ 64 KiB) delivered to the target after the data.
    ``timeout`` in seconds overrides ``runtime.request_timeout_ms``.
    """

    op: str
    local: Any  # Region, or any buffer (registered for the request's duration)
    remote: RemoteRegion
    remote_offset: int = 0
    length: int | None = None
    local_offset: int = 0
    notify: bytes | None = None
    timeout: float | None = None


class Transfer(Future):  # type: ignore[type-arg]
    """Completion handle of one request (see the module docstring)."""

    def __init__(self, request: Request | None = None) -> None:
        super().__init__()
        self.request = request
        self.status = TransferStatus.PENDING
        #: Name of the transport that carried it (None until posted).
        self.transport: str | None = None
        #: issue 10: the ordered transport list the route policy chose, and the
        #: name of the rule that chose it ("default", "hint" or a [[route]] name).
        self.route: tuple[str, ...] = ()
        self.route_rule: str | None = None
        self.bytes_moved = 0
        self.submitted_at = time.monotonic()
        self.finished_at: float | None = None
        self._finalizers: list[Callable[[], None]] = []
        self._canceller: Callable[[float | None], bool] | None = None
        self._fin_lock = threading.Lock()

    def __repr__(self) -> str:
        return f"<Transfer {self.status.value} via={self.transport} bytes={self.bytes_moved}>"

    def __await__(self) -> Generator[Any, None, Any]:
        return asyncio.wrap_future(self).__await__()

    @property
    def elapsed(self) -> float | None:
        """Seconds from submit to completion (None while pending)."""
        return None if self.finished_at is None else self.finished_at - self.submitted_at

    def cancel(self, timeout: float | None = None) -> bool:
        """Cancel the request; see the module docstring for what may have happened.

        ``timeout`` bounds the wait for an in-flight abort (default: until the
        request's own deadline plus the abort grace).
        """
        with self._condition:
            if self._state in (CANCELLED, CANCELLED_AND_NOTIFIED, FINISHED):
                return self._state != FINISHED
            if self._state != RUNNING:
                ok = super().cancel()
                if ok:
                    self.status = TransferStatus.CANCELLED
                    self.finished_at = time.monotonic()
        if self._state != RUNNING:
            self._run_finalizers()
            return self.cancelled()
        canceller = self._canceller
        if canceller is None:
            return False
        return canceller(timeout)

    # -- producer side (the engine and transports), not for users -------------

    def _add_finalizer(self, fn: Callable[[], None]) -> None:
        self._finalizers.append(fn)

    def _run_finalizers(self) -> None:
        with self._fin_lock:
            fins, self._finalizers = self._finalizers, []
        for fn in reversed(fins):
            try:
                fn()
            except Exception:  # a finalizer must never stop completion
                log.exception("transfer finalizer failed")

    def _mark_posted(self, transport: str) -> bool:
        """PENDING → POSTED; False if it was cancelled meanwhile."""
        if not self.set_running_or_notify_cancel():
            return False
        self.transport = transport
        self.status = TransferStatus.POSTED
        return True

    def _complete(self, nbytes: int) -> None:
        self.bytes_moved = nbytes
        self.status = TransferStatus.COMPLETED
        self.finished_at = time.monotonic()
        self._run_finalizers()
        self.set_result(nbytes)

    def _fail(self, exc: BaseException) -> None:
        self.finished_at = time.monotonic()
        self._run_finalizers()
        if isinstance(exc, CancelledError):
            self.status = TransferStatus.CANCELLED
            with self._condition:
                # A running future cannot be cancelled through the public API;
                # this is the same transition Future.cancel() makes for pending ones.
                self._state = CANCELLED_AND_NOTIFIED
                for waiter in self._waiters:
                    waiter.add_cancelled(self)
                self._condition.notify_all()
            self._invoke_callbacks()
            return
        self.status = TransferStatus.TIMED_OUT if isinstance(exc, TimeoutError) else TransferStatus.FAILED
        self.set_exception(exc)


class Batch(Transfer):
    """Handle for :meth:`Engine.submit`: one Transfer per request in ``transfers``.

    The batch completes when every member is done: with the total byte count
    if all succeeded, else with the first member's error (the others stay
    inspectable). Cancelling the batch cancels every member.
    """

    def __init__(self, transfers: Sequence[Transfer]) -> None:
        super().__init__(None)
        self.transfers = list(transfers)
        self._left = len(self.transfers)
        self._lock = threading.Lock()
        self.set_running_or_notify_cancel()
        self.status = TransferStatus.POSTED
        if not self.transfers:
            self._complete(0)
        for t in self.transfers:
            t.add_done_callback(self._member_done)

    def _member_done(self, _t: Future) -> None:  # type: ignore[type-arg]
        with self._lock:
            self._left -= 1
            if self._left:
                return
        failed = [t for t in self.transfers if t.cancelled() or t.exception() is not None]
        if not failed:
            self._complete(sum(t.bytes_moved for t in self.transfers))
            return
        first = failed[0]
        self._fail(CancelledError() if first.cancelled() else first.exception())  # type: ignore[arg-type]

    def cancel(self, timeout: float | None = None) -> bool:
        results = [t.cancel(timeout) for t in self.transfers]
        return all(results)


@dataclass(eq=False)
class Operation:
    """What a transport receives for one posted request.

    The transport moves ``length`` bytes between ``local_view`` and
    ``remote`` at ``remote_offset`` and then calls exactly one of
    :meth:`complete` or :meth:`fail`. Bounds and access were checked against
    the descriptor before posting; targets whose CPU serves the request check
    them again.

    When :attr:`abort_exc` becomes set (timeout, cancel, peer lost), the
    transport's :meth:`Transport.abort` is called; the transport stops as soon
    as it can and calls :meth:`fail` only once no more bytes can land.
    """

    kind: str  # "write" | "read"
    local: Region
    local_offset: int
    remote: RemoteRegion
    remote_offset: int
    length: int
    deadline: float  # time.monotonic()
    deadline_wall: float  # time.time(), for the peer's own guard
    transfer: Transfer
    peer: Any = None
    transport: Transport | None = None
    abort_exc: BaseException | None = None
    #: Free slot for the transport's per-operation state.
    state: Any = None
    #: Run before completing (the engine sends a notification here); an error fails the request.
    before_complete: Callable[[], None] | None = None
    _done: bool = False
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _on_finish: list[Callable[[Operation, BaseException | None], None]] = field(default_factory=list)

    @property
    def local_view(self) -> memoryview:
        return self.local.view[self.local_offset : self.local_offset + self.length]

    @property
    def aborted(self) -> bool:
        return self.abort_exc is not None

    @property
    def done(self) -> bool:
        return self._done

    def time_left(self) -> float:
        return self.deadline - time.monotonic()

    def abort(self, exc: BaseException) -> None:
        """Ask the transport to stop (first reason wins)."""
        with self._lock:
            if self._done or self.abort_exc is not None:
                return
            self.abort_exc = exc
        if self.transport is not None:
            try:
                self.transport.abort(self)
            except Exception:
                log.exception("transport %s failed to abort", self.transport.name)

    def _finish(self, error: BaseException | None) -> bool:
        with self._lock:
            if self._done:
                return False
            self._done = True
        for fn in self._on_finish:
            fn(self, error)
        return True

    def complete(self, nbytes: int | None = None) -> None:
        """Every byte landed (the transport's word)."""
        if self.before_complete is not None and not self._done:
            try:
                self.before_complete()
            except BaseException as exc:  # noqa: BLE001
                self.fail(exc if isinstance(exc, MpcommError) else MpcommError(f"after the data landed: {exc}"))
                return
        if self._finish(None):
            self.transfer._complete(self.length if nbytes is None else nbytes)

    def fail(self, exc: BaseException) -> None:
        """The request failed and no more of its bytes can land.

        If an abort was requested, its reason (timeout, cancel) is reported
        instead of the incidental error the abort caused.
        """
        if self.abort_exc is not None:
            if isinstance(self.abort_exc, MpcommError) and exc is not self.abort_exc:
                self.abort_exc.__cause__ = self.abort_exc.__cause__ or exc
            exc = self.abort_exc
        if self._finish(exc):
            self.transfer._fail(exc)


def timeout_error(op: Operation) -> TransferTimeout:
    return TransferTimeout(
        f"{op.kind} of {op.length} bytes to region {op.remote.name!r} on {op.remote.address} "
        "timed out; the destination range is undefined",
        region=op.remote.name,
        peer=op.remote.address,
    )
