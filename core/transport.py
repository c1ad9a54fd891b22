"""The transport contract: what a plugin implements and what the engine gives it.

A transport moves bytes between a local :class:`~mpcomm.Region` and a
:class:`~mpcomm.RemoteRegion`. The engine does everything else: handshake and
peer identity, region look-ups, leases, deadlines, back-pressure,
notifications, completion handles, user callbacks and tracing.

**What a transport receives.** One :class:`Operation` per request
(:meth:`Transport.post`), or one :class:`OperationGroup` for a vectorised
batch of N requests between one local region and one remote region
(:meth:`Transport.post_many`). Bounds and access were checked against the
descriptor before either reaches the transport; targets whose CPU serves the
request check them again (the target's word is final).

**Threads.** ``post``/``post_many`` are called on an engine-chosen thread
(usually the caller's) and must **never wait on the peer**: they start the
work and return. Small requests may be finished right there when that needs no
round trip (a shared-memory copy). A transport whose queues are full raises
:class:`TransportBusy` from ``post``; the engine keeps the request and posts it
again after one of the transport's operations finished.

**Reporting.** The transport calls exactly one of ``op.complete(n)`` /
``op.fail(exc)`` per operation (for a group: every index is reported once, by
``group.complete(...)`` / ``group.fail(...)``), from any thread. Reporting is
cheap and takes no engine lock; user callbacks and Future transitions never
run on the reporting thread.

**Aborts.** On :meth:`Transport.abort` (deadline, cancel, peer lost, engine
closed) the transport stops where it can and reports failure only once *no
further byte of that operation can land*. If it cannot stop in-flight work it
must not declare ``Capabilities.inflight_cancel``; the engine then waits for the
natural end, up to the deadline plus ``runtime.abort_grace_ms``, and reports an
unconfirmed timeout after that.

**Revocation.** When :meth:`Transport.unregister` returns, no peer can read or
write the region through this transport any more (``Capabilities.revocation``
says how that is achieved); the conformance kit checks it.

Native errors are mapped onto :mod:`mpcomm.errors` (``map_errors``) before
they reach ``fail``. :meth:`Transport.close` releases everything, even when a
graceful close fails.
"""

from __future__ import annotations

import inspect
import logging
import threading
import time
import weakref
from array import array
from collections.abc import Callable, Iterable
from concurrent.futures import Executor
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from .errors import MpcommError, PeerConnectionError, TransferTimeout

if TYPE_CHECKING:
    from .config import Config
    from .memory import Region
    from .peer import PeerInfo
    from .remote import RemoteRegion

__all__ = [
    "TRANSPORT_CONTRACT",
    "Availability",
    "Capabilities",
    "ContractMember",
    "ControlRequester",
    "Operation",
    "OperationGroup",
    "RegionServer",
    "Transport",
    "TransportBusy",
    "TransportContext",
    "contract_problems",
    "effective_capabilities",
]

log = logging.getLogger("mpcomm.transport")


class TransportBusy(Exception):
    """Raised by ``post``/``post_many`` when the transport's queues are full.

    Not an error the user sees: the engine holds the request (within
    ``runtime.queue_depth``) and posts it again once one of this transport's
    operations finished. ``pending``: the member operations of a group that
    were not posted yet (the default ``post_many`` sets it), posted later one
    by one.
    """

    def __init__(self, message: str = "", *, pending: list[Operation] | None = None) -> None:
        super().__init__(message)
        self.pending = pending


@dataclass(frozen=True)
class Availability:
    """Whether a transport (or a route to a peer) can be used, and why not."""

    available: bool
    reason: str = ""

    def __bool__(self) -> bool:
        return self.available

    @classmethod
    def yes(cls, reason: str = "") -> Availability:
        return cls(True, reason)

    @classmethod
    def no(cls, reason: str) -> Availability:
        return cls(False, reason)


#: Bandwidth classes a transport may declare, slowest first (route policy, issue 10).
BANDWIDTH_CLASSES = ("low", "medium", "high", "memory")


@dataclass(frozen=True)
class Capabilities:
    """What a transport can do; shown by ``mpcomm plugins`` and used for routing.

    Attributes:
        memory_kinds: kinds of local memory it can move (``host``, ``cuda``:
            :mod:`mpcomm.memory_kinds`); declared statically, narrowed at run
            time by :meth:`Transport.memory_kind_availability`.
        remote_memory_kinds: kinds of the peer's memory it can reach (None:
            the same as ``memory_kinds``). A request moves one (local, remote)
            pair: :meth:`moves`.
        intra_node, inter_node: same-host and cross-host reach.
        one_sided: the target's CPU takes no part in a transfer.
        zero_copy: no staging copy on either side in the default mode.
        inflight_cancel: it can stop a posted request before its natural end.
        modes: ``transport.mode`` values it supports.
        revocation: how ``unregister`` stops peers (``"target-check"``: the
            target's CPU checks every access; ``"fence"``: initiators are told
            and acknowledge before unregister returns; ``"key"``: the target
            destroys the memory key).
        bandwidth_class: one of :data:`BANDWIDTH_CLASSES`; ranks transports in
            the default route when no ``[[route]]`` rule matches: ``"memory"``
            for memory-to-memory copies on one host, ``"high"`` for RDMA-class
            NICs, ``"medium"`` for transports that pick the best fabric at run
            time, ``"low"`` (the default) for kernel sockets. Never plugin names.
    """

    memory_kinds: frozenset[str] = frozenset({"host"})
    #: Kinds of the peer's memory it can reach; None: the same as ``memory_kinds``.
    remote_memory_kinds: frozenset[str] | None = None
    intra_node: bool = True
    inter_node: bool = True
    one_sided: bool = True
    zero_copy: bool = True
    inflight_cancel: bool = False
    modes: frozenset[str] = frozenset({"zero-copy"})
    revocation: str = "target-check"
    bandwidth_class: str = "low"

    @property
    def remote_kinds(self) -> frozenset[str]:
        return self.memory_kinds if self.remote_memory_kinds is None else self.remote_memory_kinds

    def moves(self, local_kind: str, remote_kind: str) -> bool:
        """Can it move between local memory of ``local_kind`` and remote memory of ``remote_kind``?"""
        return local_kind in self.memory_kinds and remote_kind in self.remote_kinds

    def without_kinds(self, kinds: Any) -> Capabilities:
        """These capabilities less ``kinds`` on both sides (kinds unavailable at run time)."""
        drop = frozenset(kinds)
        if not drop:
            return self
        return replace(self, memory_kinds=self.memory_kinds - drop,
                       remote_memory_kinds=None if self.remote_memory_kinds is None
                       else self.remote_memory_kinds - drop)

    def to_dict(self) -> dict[str, Any]:
        return {
            "memory_kinds": sorted(self.memory_kinds),
            "remote_memory_kinds": sorted(self.remote_kinds),
            "intra_node": self.intra_node,
            "inter_node": self.inter_node,
            "one_sided": self.one_sided,
            "zero_copy": self.zero_copy,
            "inflight_cancel": self.inflight_cancel,
            "modes": sorted(self.modes),
            "revocation": self.revocation,
            "bandwidth_class": self.bandwidth_class,
        }


class RegionServer(Protocol):
    """The target-side region table a transport checks peers' accesses against."""

    def serve(self, region_id: int, token: int, epoch: str | None, offset: int, length: int,
              access: str) -> Region:
        """Check a peer's access and lease the region; the caller must ``release()`` it.

        Raises the :class:`~mpcomm.AccessError` subclass that says why nothing
        may be touched (unknown region, bad token, rights, bounds, stale epoch).
        """
        ...


class ControlRequester(Protocol):
    """Sends a request to ``peer``'s instance of ``transport`` over the control channel."""

    def __call__(self, peer: PeerInfo, transport: str, body: dict[str, Any], timeout: float) -> dict[str, Any]:
        """Blocks up to ``timeout`` seconds; never call it from ``post``."""
        ...


@dataclass
class TransportContext:
    """What the engine hands a transport.

    Attributes:
        config: the engine's whole :class:`~mpcomm.Config`.
        options: this transport's ``[plugins.<name>]`` table, defaults applied.
        mode: ``"zero-copy"`` or ``"copy"`` (``transport.mode``).
        node_id, epoch: this engine's identity.
        host: this engine's host identity (see :func:`mpcomm.peer.host_identity`).
        bind_host: the host the control endpoint is bound to; transports that
            listen should listen there too.
        advertise_host: the host peers should dial.
        executor: the engine's worker pool (``runtime.worker_threads``).
        regions: the target-side region table (:class:`RegionServer`).
        control: control-channel requests to a peer (:class:`ControlRequester`).
        log: a logger named after the transport.
        notifications: the engine's notification queue, for notes a peer's request carries
            with its data (:meth:`Transport.carries_notification`) that the target side
            receives in Python: ``held = reserve(size)`` (BackPressureError when full) before
            the data lands, then ``commit(held, peer_node_id, region_name, data)`` after it, or
            ``cancel(held)``. None where the engine gives none.
    """

    config: Config
    options: dict[str, Any]
    mode: str
    node_id: str
    epoch: str
    host: dict[str, Any]
    bind_host: str
    advertise_host: str
    executor: Executor
    regions: RegionServer
    control: ControlRequester
    log: logging.Logger = field(default_factory=lambda: logging.getLogger("mpcomm.transport"))
    notifications: Any = None


# -- what a transport receives ------------------------------------------------------


class Operation:
    """One posted request, as a transport sees it.

    The transport moves ``length`` bytes between ``local_view`` and
    ``remote`` at ``remote_offset`` and then calls exactly one of
    :meth:`complete` or :meth:`fail`, from any thread.

    When :attr:`abort_exc` becomes set (timeout, cancel, peer lost, close),
    the transport's :meth:`Transport.abort` is called; the transport stops as
    soon as it can and calls :meth:`fail` only once no more bytes can land.

    Attributes:
        kind: ``"write"`` (local → remote) or ``"read"`` (remote → local).
        local, local_offset: the local region and where in it.
        remote, remote_offset: the remote descriptor and where in it.
        length: bytes to move.
        deadline: ``time.monotonic()`` by which it must be done.
        deadline_wall: the same as ``time.time()``, for the target's own guard.
        peer: the target's :class:`~mpcomm.peer.PeerInfo` (from the handshake).
        transport: the transport it was posted to.
        state: a free slot for the transport's per-operation state.
        index: position in its :class:`OperationGroup` (-1 for a lone request).
        undriven: no ``result()`` caller is expected to drive it (read-only, see there).
    """

    __slots__ = ("kind", "local", "local_offset", "remote", "remote_offset", "length", "deadline",
                 "deadline_wall", "peer", "transport", "abort_exc", "state", "index", "before_complete",
                 "_done", "lock", "sink", "__weakref__", "__dict__")

    def __init__(self, kind: str, local: Region, local_offset: int, remote: RemoteRegion, remote_offset: int,
                 length: int, deadline: float, deadline_wall: float, peer: PeerInfo | None = None,
                 sink: Callable[[Operation, BaseException | None, int], None] | None = None,
                 index: int = -1) -> None:
        self.kind = kind
        self.local = local
        self.local_offset = local_offset
        self.remote = remote
        self.remote_offset = remote_offset
        self.length = length
        self.deadline = deadline
        self.deadline_wall = deadline_wall
        self.peer = peer
        self.transport: Transport | None = None
        self.abort_exc: BaseException | None = None
        self.state: Any = None
        self.index = index
        #: Kept for transports written against the first contract; the engine
        #: no longer sets it (notifications are the engine's business).
        self.before_complete: Callable[[], None] | None = None
        self._done = False
        #: Guards ``done`` and ``abort_exc``; the engine moves its own bookkeeping of the
        #: request under it too. ``sink`` is who hears the report (the engine).
        self.lock = threading.Lock()
        self.sink = sink

    #: A notification this operation carries with its data, or None. The engine sets it only
    #: on a write whose transport said :meth:`Transport.carries_notification`; that
    #: transport then delivers it with the data (docs/contract.md, "Notifications").
    notification: bytes | None = None

    def __repr__(self) -> str:
        return (f"<Operation {self.kind} {self.length}B local+{self.local_offset} -> "
                f"{self.remote.name}+{self.remote_offset} done={self._done}>")

    @property
    def local_view(self) -> memoryview:
        return self.local.view[self.local_offset : self.local_offset + self.length]

    @property
    def aborted(self) -> bool:
        return self.abort_exc is not None

    @property
    def done(self) -> bool:
        return self._done

    @property
    def undriven(self) -> bool:
        """No ``result()`` caller is expected to :meth:`Transport.drive` this request, as far as the
        engine knows when it is posted: its handle is reaped from a completion queue, or a callback
        or a ``done()`` poller already waits for it. A transport that leaves answers to a driver for
        a while reads this one's promptly from the start, as after :meth:`Transport.undriven` (which
        covers a callback or poller that comes after the post). Cheap; False for a request no
        engine made."""
        return _undriven(self)

    def time_left(self) -> float:
        return self.deadline - time.monotonic()

    def abort(self, exc: BaseException) -> None:
        """Ask the transport to stop (first reason wins); thread-safe, never blocks."""
        with self.lock:
            if self._done or self.abort_exc is not None:
                return
            self.abort_exc = exc
        t = self.transport
        if t is not None:
            try:
                t.abort(self)
            except Exception:
                log.exception("transport %s failed to abort", t.name)

    def _finish(self, error: BaseException | None, nbytes: int) -> bool:
        with self.lock:
            if self._done:
                return False
            self._done = True
        sink = self.sink
        if sink is not None:
            sink(self, error, nbytes)
        return True

    def rearm(self) -> None:
        """The engine, before posting it again on another transport (failover): not done any more."""
        with self.lock:
            self._done = False

    def complete(self, nbytes: int | None = None) -> None:
        """Every byte landed (the transport's word). Later reports are ignored."""
        self._finish(None, self.length if nbytes is None else nbytes)

    def fail(self, exc: BaseException, *, confirmed: bool = True) -> None:
        """The request failed and no more of its bytes can land.

        If an abort was requested, its reason (timeout, cancel, close) is
        reported instead of the incidental error the abort caused.

        ``confirmed=False``: the transport gave up on the request and will not
        touch the local buffer any more, but could not make sure the target
        stopped (bytes may still land there). The caller then sees
        ``TransferTimeout(confirmed=False)`` (or a TransferError saying so).
        """
        self._finish(_final_error(self, exc, confirmed), 0)


def _final_error(unit: Operation | OperationGroup, exc: BaseException, confirmed: bool) -> BaseException:
    """What the caller sees: the abort's reason (timeout, cancel, close) over the incidental error.

    A lost connection reported once the unit's deadline has passed is its timeout too, even
    where the engine's timer has not aborted it yet (a loaded machine runs it late): the target
    enforces the same deadline and drops the connection of a request that outlived it, so the
    deadline is the reason, and the path is not to blame.
    """
    abort = unit.abort_exc
    if abort is None and isinstance(exc, PeerConnectionError) and time.monotonic() >= unit.deadline:
        abort = timeout_error(unit)
    if abort is not None:
        if isinstance(abort, MpcommError) and exc is not abort and abort.__cause__ is None:
            abort.__cause__ = exc
        exc = abort
    if confirmed:
        return exc
    if isinstance(exc, TransferTimeout):
        out = TransferTimeout(f"{exc}; the transport could not confirm that the target stopped, so bytes may "
                              "still land in the destination range", region=exc.region, peer=exc.peer)
    else:
        from .errors import TransferError

        what = "cancelled" if type(exc).__name__ == "CancelledError" else str(exc)
        out = TransferError(f"{what}; the transport could not confirm that the target stopped, so bytes may "
                            "still land in the destination range",
                            region=getattr(exc, "region", None), peer=getattr(exc, "peer", None))
    out.confirmed = False  # type: ignore[attr-defined]
    out.__cause__ = exc
    return out


def int64_array(values: Any, count: int | None, what: str, copy: bool = True) -> array:  # type: ignore[type-arg]
    """Sequences, ``array('q')`` and numpy integer arrays → a new ``array('q')`` (no per-item Python
    work for an array or numpy).

    Always a copy (``copy=False`` only for an ``array('q')`` the engine made itself): the
    engine checks the values once and the transports read them later, on other threads, so
    the caller must not be able to change them after the call (issue 28). A value outside
    int64 is out of every region's bounds: OutOfBoundsError, as for any other bad offset.
    """
    if isinstance(values, array) and values.typecode == "q":
        out = values if not copy and type(values) is array else array("q", values)
    elif hasattr(values, "__array_interface__") or hasattr(values, "dtype"):
        import numpy as np  # only reached when the caller already uses numpy

        a = np.asarray(values)
        if a.dtype.kind not in "iu":
            raise MpcommError(f"{what} must be integers, not a {a.dtype} array")
        a = np.ascontiguousarray(a, dtype=np.int64)
        if a.ndim != 1:
            raise MpcommError(f"{what} must be one-dimensional, not shape {a.shape}")
        out = array("q")
        out.frombytes(a.tobytes())
    else:
        try:
            out = array("q", values)
        except OverflowError as exc:
            from .errors import OutOfBoundsError

            raise OutOfBoundsError(f"{what} holds a value outside int64, past the end of any region: {exc}; "
                                   "nothing was transferred") from None
        except TypeError as exc:
            raise MpcommError(f"{what} must be a sequence of integers: {exc}") from None
    if count is not None and len(out) != count:
        raise MpcommError(f"{what} has {len(out)} entries, expected {count}")
    return out


#: Per-index states of an :class:`OperationGroup` (``group.status[i]``).
PENDING, DONE, FAILED = 0, 1, 2


def _undriven(unit: Operation | OperationGroup) -> bool:
    """:attr:`Operation.undriven` and :attr:`OperationGroup.undriven`: asks the handle the engine
    made for the unit (``transfer``, :meth:`~mpcomm.transfer.Transfer.waits_undriven`) and, for a
    lone request of a batch, the batch's handle (``batch``: its callbacks and pollers wait there)."""
    d = unit.__dict__
    t = d.get("transfer")
    if t is None:
        return False
    if t.waits_undriven():
        return True
    b = d.get("batch")
    return b is not None and b is not t and b.waits_undriven()


class OperationGroup:
    """A vectorised batch, as a transport sees it: N requests of one ``kind``
    between one local region and one remote region.

    ``local_offsets[i]``, ``remote_offsets[i]`` and ``lengths[i]`` describe
    request ``i`` (``array('q')``; pass them to native code through the buffer
    protocol). They are the group's own copies, made when it was built (the
    caller of ``write_many`` and the like cannot change them afterwards;
    ``copy=False`` is for arrays the engine made and checked itself, such as a
    prepared batch's, which nobody changes). Every request was bounds- and
    access-checked, vectorised, before the group reached the transport; a
    transport that moves bytes natively still checks each range against the
    region sizes it holds, at the point of use.

    The transport reports every index exactly once, from any thread:
    :meth:`complete` (all still pending, or the given indices) or :meth:`fail`
    (with one error, for all still pending or the given indices). Aborts work
    as for :class:`Operation`: :meth:`Transport.abort` is called with the group,
    and failure is reported only once no byte of a failed index can land.
    """

    def __init__(self, kind: str, local: Region, remote: RemoteRegion, local_offsets: Any, remote_offsets: Any,
                 lengths: Any, deadline: float, deadline_wall: float, peer: PeerInfo | None = None,
                 sink: Callable[[OperationGroup], None] | None = None, *, copy: bool = True) -> None:
        self.kind = kind
        self.local = local
        self.remote = remote
        self.lengths = int64_array(lengths, None, "lengths", copy)
        #: Whether ``lengths`` is this group's own array (False: a prepared batch's, shared by its postings).
        self.owns_lengths = copy
        self.count = len(self.lengths)
        #: The sum of ``lengths``, where a transport's native bounds pass summed them anyway
        #: (saves summing 64 ints in Python when the group ends); None: not known yet.
        self.total: int | None = None
        self.local_offsets = int64_array(local_offsets, self.count, "local_offsets", copy)
        self.remote_offsets = int64_array(remote_offsets, self.count, "remote_offsets", copy)
        self.deadline = deadline
        self.deadline_wall = deadline_wall
        self.peer = peer
        self.transport: Transport | None = None
        self.abort_exc: BaseException | None = None
        self.state: Any = None
        #: ``PENDING``/``DONE``/``FAILED`` per index.
        self.status = bytearray(self.count)
        #: The error of each failed index.
        self.errors: dict[int, BaseException] = {}
        #: Indices not reported yet; ``lock`` guards them, ``status`` and ``errors`` (the engine
        #: uses it too); ``sink`` is who hears the report (the engine).
        self.left = self.count
        self.lock = threading.Lock()
        self.sink = sink
        self._members: list[Operation] | None = None
        #: (first index, handles) of the per-request handles a Batch made for this group
        #: (``Batch.members``); the engine settles them when the group finishes.
        self.member_handles: list[tuple[int, list[Any]]] = []

    def release_owner(self) -> None:
        """Every part of the owning batch ended: the engine's back references to it (``batch``,
        ``transfer``) become weak proxies. The batch calls this.

        They are held strongly while the group may still be working, so a batch whose
        caller dropped the handle still completes and runs its callbacks. Afterwards the
        batch still holds the group (``parts``, for its per-request state), so strong both
        ways was a cycle: every finished batch waited for the cyclic garbage collector. A
        proxy and not None, so a late reader (a timer racing the last report) finds the
        same batch for as long as anyone holds it, and reads stay plain attribute reads on
        the hot path (a descriptor cost ~6% of a 64-request shm batch). A proxy is not the
        batch itself (``is`` compares false); nothing that reads these compares identities.
        """
        d = self.__dict__
        held = d.get("batch")
        if held is None or type(held) is weakref.ProxyType:
            return
        d["batch"] = proxy = weakref.proxy(held)
        if d.get("transfer") is held:
            d["transfer"] = proxy

    def __repr__(self) -> str:
        return f"<OperationGroup {self.kind} x{self.count} -> {self.remote.name} left={self.left}>"

    def drop(self, i: int) -> None:
        """Request ``i`` moves nothing (its length becomes 0); the caller holds :attr:`lock`.

        A group of a prepared batch shares that batch's arrays with every other
        posting of it, so it takes its own copy first: cancelling a request of
        one posting must not empty that request in every later one.
        """
        if not self.owns_lengths:
            self.lengths = array("q", self.lengths)
            self.owns_lengths = True
        self.lengths[i] = 0

    @property
    def done(self) -> bool:
        return self.left == 0

    @property
    def aborted(self) -> bool:
        return self.abort_exc is not None

    @property
    def undriven(self) -> bool:
        """As :attr:`Operation.undriven`, for the group's batch."""
        return _undriven(self)

    @property
    def total_bytes(self) -> int:
        """The sum of ``lengths`` (from :attr:`total` where a transport's bounds pass already summed them)."""
        total = self.total
        return sum(self.lengths) if total is None else total

    def time_left(self) -> float:
        return self.deadline - time.monotonic()

    def abort(self, exc: BaseException) -> None:
        """Ask the transport to stop the group (first reason wins); never blocks."""
        with self.lock:
            if self.left == 0 or self.abort_exc is not None:
                return
            self.abort_exc = exc
            members = self._members
        if members is not None:  # the default post_many: abort each member
            for op in members:
                op.abort(exc)
            return
        t = self.transport
        if t is not None:
            try:
                t.abort(self)  # type: ignore[arg-type]
            except Exception:
                log.exception("transport %s failed to abort a group", t.name)

    def _report(self, indices: Iterable[int] | None, code: int, exc: BaseException | None) -> None:
        status = self.status
        with self.lock:
            if self.left == 0:
                return
            if indices is None:
                if self.left == self.count:
                    status[:] = bytes((code,)) * self.count
                    hit = range(self.count) if exc is not None else ()
                    self.left = 0
                else:
                    hit = [i for i in range(self.count) if status[i] == PENDING]
                    for i in hit:
                        status[i] = code
                    self.left = 0
            else:
                hit = []
                for i in indices:
                    if status[i] == PENDING:
                        status[i] = code
                        hit.append(i)
                self.left -= len(hit)
            if exc is not None:
                for i in hit:
                    self.errors[i] = exc
            last = self.left == 0
        if last and self.sink is not None:
            self.sink(self)

    def rearm_failed(self) -> None:
        """The engine, before posting it again on another transport (failover): failed indices pending again."""
        with self.lock:
            for i in range(self.count):
                if self.status[i] == FAILED:
                    self.status[i] = PENDING
                    self.errors.pop(i, None)
                    self.left += 1

    def complete(self, indices: Iterable[int] | None = None) -> None:
        """These indices (default: every one still pending) landed in full."""
        self._report(indices, DONE, None)

    def fail(self, exc: BaseException, indices: Iterable[int] | None = None, *, confirmed: bool = True) -> None:
        """These indices (default: every one still pending) failed; none of their bytes can land any more.

        An abort's reason (timeout, cancel, close) is reported instead of the
        incidental error the abort caused. ``confirmed=False`` as for
        :meth:`Operation.fail`.
        """
        self._report(indices, FAILED, _final_error(self, exc, confirmed))

    def members(self) -> list[Operation]:
        """Every request as a lone :class:`Operation` (made once, then the same list).

        For a transport that posts a group member by member: once it asked for
        them, the group's abort reaches each member (:meth:`Operation.abort`)
        instead of :meth:`Transport.abort` with the group.
        """
        with self.lock:
            if self._members is None:
                self._members = [self.member(i) for i in range(self.count)]
            return self._members

    def member(self, i: int) -> Operation:
        """Request ``i`` as a lone :class:`Operation` that reports back to this group."""
        op = Operation(self.kind, self.local, self.local_offsets[i], self.remote, self.remote_offsets[i],
                       self.lengths[i], self.deadline, self.deadline_wall, self.peer,
                       sink=self._member_done, index=i)
        op.transport = self.transport
        return op

    def _member_done(self, op: Operation, error: BaseException | None, _nbytes: int) -> None:
        if error is None:
            self._report((op.index,), DONE, None)
        else:
            self._report((op.index,), FAILED, error)


class Transport:
    """Base class of every transport (see the module docstring for the contract)."""

    #: Entry-point-independent identifier used in config and descriptors.
    name: ClassVar[str] = ""
    capabilities: ClassVar[Capabilities] = Capabilities()
    #: Accepted ``[plugins.<name>]`` keys and their defaults; others are config errors.
    default_options: ClassVar[dict[str, Any]] = {}
    #: Allowed ranges of numeric options, ``{"chunk": (4096, 1 << 30)}``; the core
    #: refuses a value outside with a ConfigError naming the option.
    option_ranges: ClassVar[dict[str, Any]] = {}
    #: True when :meth:`post` may wait on something slow (a connection being
    #: made, a full socket): the engine then never calls it on a caller's
    #: thread through a pair's binding (each request takes the full routing), and posts through its posting pool instead.
    post_may_block: ClassVar[bool] = False

    def __init__(self, ctx: TransportContext) -> None:
        self.ctx = ctx

    @classmethod
    def availability(cls) -> Availability:
        """Can this transport run on this machine? Cheap and side-effect free; any thread."""
        return Availability.yes()

    @classmethod
    def memory_kind_availability(cls) -> dict[str, Availability]:
        """Whether each declared memory kind other than ``host`` works on this machine, and why not.

        Cheap after the first call, side-effect free. A kind reported
        unavailable is dropped from the capabilities the router uses
        (:func:`effective_capabilities`); kinds not listed are available.
        """
        return {}

    @classmethod
    def version(cls) -> str:
        """Version of the native library behind the transport, if any."""
        return ""

    def start(self) -> dict[str, Any]:
        """Start listening if needed; return JSON-able info peers receive in the handshake.

        Called once, on the thread that creates the engine. Raising makes the
        transport unavailable on this engine (with the error as the reason).
        """
        return {}

    def reach(self, peer: PeerInfo) -> Availability:
        """Can this transport talk to ``peer`` (which published ``peer.transports[name]``)?

        Called on the posting thread; must not wait on the peer (cache it).
        """
        return Availability.yes()

    def allocate(self, size: int, alignment: int) -> tuple[memoryview, Any] | None:
        """Optionally back ``Engine.allocate`` memory (shared or pinned memory).

        Returns ``(view, backing)`` or None to let the next transport or the
        engine's anonymous mapping serve it. Raises RegionError when the size
        cannot be had.
        """
        return None

    def register(self, region: Region) -> dict[str, Any] | None:
        """Prepare ``region`` for access (pin it, map it, make an rkey).

        Returns JSON-able info that peers receive in the RemoteRegion
        (``transports[name]``), or None when the transport cannot serve it.
        Called at most once per region (the engine serialises it); may block
        (never on the request path of another peer).
        """
        return {}

    def unregister(self, region: Region) -> None:
        """Undo :meth:`register`; called only when the region holds no lease.

        When it returns, no peer can reach the region through this transport
        (see ``Capabilities.revocation``).
        """

    def post(self, op: Operation) -> None:
        """Start moving ``op``'s bytes; never waits on the peer.

        Raises :class:`TransportBusy` when full (the engine retries later), or
        an :class:`~mpcomm.MpcommError` for a request it refuses before anything
        moved (the engine fails the request with it). Anything else is
        reported through ``op.complete``/``op.fail``.
        """
        raise NotImplementedError

    def post_many(self, group: OperationGroup) -> None:
        """Start a vectorised batch; the same rules as :meth:`post`.

        The default posts each request on its own through :meth:`post`, which
        is correct for every transport; transports override it to move the
        whole group with one native call, frame or work-request list.
        """
        members = group.members()
        for i, op in enumerate(members):
            if group.abort_exc is not None:
                op.fail(group.abort_exc)
                continue
            try:
                self.post(op)
            except TransportBusy as busy:
                # The engine holds the members not posted yet and posts them as room frees.
                raise TransportBusy(str(busy) or f"transport {self.name} is full", pending=members[i:]) from None
            except MpcommError as exc:
                op.fail(exc)
            except Exception as exc:  # noqa: BLE001 - a plugin bug fails the request, not the caller
                log.exception("transport %s failed to post", self.name)
                op.fail(MpcommError(f"transport {self.name} failed: {exc}"))

    def inline_path(self, kind: str, local: Region, remote: RemoteRegion) -> Callable[[int, int, int], bool] | None:
        """Optional fast lane: ``move(local_offset, remote_offset, length) -> bool`` for one
        (kind, local region, remote region), or None (no fast lane for this pair now).

        The engine asks when a plain request of the pair (no notification,
        route hint, completion queue, telemetry or split) is routed to this
        transport as the first choice and its peer is linked, and keeps the
        move (in the pair's binding) once it landed a request, until the
        route, the peer link or the engine's health changes or either region
        goes away. Each call comes on the caller's thread for a request the
        engine has checked (bounds, timeout, access), with the local region
        leased for the call. Return True once every byte is in the
        destination (the request is complete; the engine hands back a handle
        born COMPLETED); return False to decline (the engine then builds the
        request and calls :meth:`post`, so whatever the move moved must be
        what :meth:`post` moves again: the same range, retried whole). Never
        wait on a peer in a move, never raise for a refusal or a failure:
        decline, and let :meth:`post` report it. The move must itself notice
        a revocation of the remote memory on every call and decline then. A
        move may also go stale for good (its transport shut it): when it
        declines a request no longer than one it landed, the engine asks
        again. The default binds :meth:`post_inline` where a plugin overrides
        that (the older form of this lane), else None.
        """
        if type(self).post_inline is Transport.post_inline:
            return None
        post_inline = self.post_inline

        def move(local_offset: int, remote_offset: int, length: int) -> bool:
            return post_inline(kind, local, local_offset, remote, remote_offset, length)

        return move

    def post_inline(self, kind: str, local: Region, local_offset: int, remote: RemoteRegion, remote_offset: int,
                    length: int) -> bool:
        """Optional, the older form of :meth:`inline_path`: one request moved now, or declined (False).

        The engine itself only calls :meth:`inline_path`, whose default binds
        this method when a plugin overrides it, under the same contract. The
        default here is :meth:`inline_path`'s move for the one request (False
        when the transport has no fast lane), for callers of the older form.
        """
        if type(self).inline_path is Transport.inline_path:
            return False
        move = self.inline_path(kind, local, remote)
        return move is not None and bool(move(local_offset, remote_offset, length))

    def drive(self, op: Operation | OperationGroup, until: float) -> None:
        """Optional: a thread is about to block in ``result()`` on ``op``; report it from here if you can.

        Called on the waiting caller's thread, outside every engine lock, for a
        posted request this transport carries, when the caller's thread would
        otherwise sleep until another thread reports ``op``: a transport whose
        reports come from a reader thread can instead read the answer here and
        save the caller a thread wake-up. Return as soon as ``op`` is reported
        (through ``complete``/``fail``, as the transport's own threads would),
        once ``until`` (``time.monotonic()``) passes, or at once when this
        thread cannot help; the caller then waits as usual. Never block past
        ``until``, never wait on another operation, never leave a half-read
        frame behind, and never raise (an exception is logged and ignored).
        Reports of other operations made on the way are allowed. The default
        returns at once. With it, a waiter's outcome reaches it with no other
        Python thread scheduled (docs/contract.md, "What a waiter gets";
        ``python -m mpcomm.testing.completion NAME REGION`` checks it): tcp reads
        its reply frames here, shm runs the copies nobody started yet.
        """

    def undriven(self, op: Operation | OperationGroup) -> None:
        """Optional: a callback or a poller now waits for the posted ``op``, and maybe no ``result()``
        caller will :meth:`drive` it. A transport that leaves answers to a driver for a while reads
        ``op``'s promptly instead. Called by ``Transfer.add_done_callback`` and by the second
        ``Transfer.done()`` that answers False, on that thread, outside every engine lock; never
        blocks, never raises. What is known at post (a completion queue reaps it, or a callback or
        poller came before the post) is ``op.undriven``: read it in :meth:`post`/:meth:`post_many`
        and treat it as this call. The default does nothing (tcp: docs/tcp.md, "Paths")."""

    def abort(self, op: Operation | OperationGroup) -> None:
        """``op.abort_exc`` is set: stop ``op`` as soon as possible.

        Called from any thread (the deadline timer, a canceller, close); must
        not block.
        """

    def peer_changed(self, peer: PeerInfo) -> None:
        """``peer`` died or restarted: drop connections, mappings and keys for it.

        Called on a control thread; may block briefly (no peer round trips).
        """

    def handle_control(self, peer: PeerInfo | None, body: dict[str, Any]) -> dict[str, Any]:
        """Answer a control-channel request a peer's instance of this transport sent.

        ``peer`` is the authenticated sender; ``body`` is untrusted input.
        Called on that peer's control thread.
        """
        return {}

    def notification_queue(self) -> Any:
        """A native bounded notification queue this transport's serving threads fill, or None.

        Offered by a transport that takes notifications from peers below the
        interpreter (tcp's native data port: ``_dataport.c`` ``Notes``). The
        engine adopts the first one offered, after :meth:`start`, as its only
        notification queue: the control channel then delivers into it too, so
        every notification meets the same limits, refusal and order. Called once.
        """
        return None

    def notify(self, peer: PeerInfo, remote: Any, data: bytes, deadline: float) -> bool:
        """Deliver a notification about ``remote`` to its owner on this transport's connections.

        Returns False (the default) to leave it to the control channel. True
        means the target took it into its queue; a refusal raises (a full
        queue: BackPressureError). ``deadline`` is ``time.monotonic()``. The
        engine calls it only after the request the notification follows
        completed, so it arrives after the data whatever the connection.
        """
        return False

    def carries_notification(self, op: Operation) -> bool:
        """Whether :meth:`post` of this write can carry its notification with the data.

        Asked just before each post of a write that has a notification. True: the
        engine sets ``op.notification`` (its bytes; the region name is
        ``op.remote.name``) and sends nothing else for it. The transport then
        delivers it with the data: the target queues it after every byte of the
        data landed and before it answers, as the target's node and with its limits.
        ``op`` completes only once both happened. A refusal (a full queue:
        BackPressureError; over the target's limits: LimitError) fails ``op`` with
        the target's region untouched. False (the default): the engine sends the
        notification itself after ``op`` completed (:meth:`notify`, or the control
        channel), on one of its notify workers.
        """
        return False

    def close(self) -> None:
        """Release every resource; must not raise. Called once, after the last post."""

    @classmethod
    def node_checks(cls) -> list[Any]:
        """Read-only checks of this machine that matter to this transport, for ``mpcomm doctor``.

        Returns :class:`mpcomm.cli.nodecheck.Check` objects (section, name,
        status, value, hint), in report order. Called without an engine, on
        any machine, also where :meth:`availability` says no (that is where
        the hints help most): import native libraries lazily, and never
        change the system. An exception becomes one WARN check. The default
        contributes none.
        """
        return []


@dataclass(frozen=True)
class ContractMember:
    """One entry of :data:`TRANSPORT_CONTRACT`."""

    #: ``"attribute"``, ``"method"`` or ``"classmethod"``.
    kind: str
    #: The transport must define it itself (the base's default is not enough).
    required: bool = False
    #: For attributes: the type the value must have.
    type: Any = None


#: Every member a transport may define, and whether it must. The registry
#: verifies each plugin class against this table when it loads it (as pluggy
#: verifies hook implementations against their specs): a plugin that breaks
#: it is reported and skipped, not found broken on the request path. The
#: documentation of each member is on :class:`Transport`.
TRANSPORT_CONTRACT: dict[str, ContractMember] = {
    "name": ContractMember("attribute", required=True, type=str),
    "capabilities": ContractMember("attribute", type=Capabilities),
    "default_options": ContractMember("attribute", type=dict),
    "option_ranges": ContractMember("attribute", type=dict),
    "post_may_block": ContractMember("attribute", type=bool),
    "availability": ContractMember("classmethod"),
    "memory_kind_availability": ContractMember("classmethod"),
    "version": ContractMember("classmethod"),
    "node_checks": ContractMember("classmethod"),
    "start": ContractMember("method"),
    "reach": ContractMember("method"),
    "allocate": ContractMember("method"),
    "register": ContractMember("method"),
    "unregister": ContractMember("method"),
    "post": ContractMember("method", required=True),
    "post_many": ContractMember("method"),
    "post_inline": ContractMember("method"),
    "inline_path": ContractMember("method"),
    "drive": ContractMember("method"),
    "undriven": ContractMember("method"),
    "abort": ContractMember("method"),
    "peer_changed": ContractMember("method"),
    "handle_control": ContractMember("method"),
    "notification_queue": ContractMember("method"),
    "notify": ContractMember("method"),
    "carries_notification": ContractMember("method"),
    "close": ContractMember("method"),
}


def contract_problems(cls: type[Transport]) -> list[str]:
    """What ``cls`` gets wrong against :data:`TRANSPORT_CONTRACT` (empty: nothing).

    Checked: required members are defined by the plugin; attributes have
    their type; a classmethod stays a classmethod and a method a plain
    method; an override accepts every argument the engine passes (the
    base's parameter names, in order, or ``*args``/``**kwargs``), and any
    parameter it adds has a default.
    """
    problems: list[str] = []
    for attr, spec in TRANSPORT_CONTRACT.items():
        owner = next((k for k in cls.__mro__ if attr in vars(k)), None)
        if spec.required and owner in (None, Transport):
            problems.append(f"does not define {attr!r} (required by the transport contract)")
            continue
        if owner is None or owner is Transport:
            continue
        raw = vars(owner)[attr]
        if spec.kind == "attribute":
            value = getattr(cls, attr)
            # bool is an int subclass, so check it exactly where bool is asked for.
            ok = type(value) is bool if spec.type is bool else isinstance(value, spec.type)
            if not ok or (spec.type is str and not value):
                problems.append(f"{attr} must be a {'non-empty ' if spec.type is str else ''}"
                                f"{spec.type.__name__}, not {value!r}")
            continue
        is_cm = isinstance(raw, classmethod)
        if spec.kind == "classmethod" and not is_cm:
            problems.append(f"{attr} must be a classmethod (the engine calls it on the class)")
            continue
        if spec.kind == "method" and (is_cm or isinstance(raw, staticmethod) or not callable(raw)):
            problems.append(f"{attr} must be a plain method")
            continue
        func = raw.__func__ if is_cm else raw
        why = _signature_mismatch(inspect.signature(vars(Transport)[attr].__func__ if is_cm
                                                    else vars(Transport)[attr]),
                                  inspect.signature(func))
        if why:
            problems.append(f"{attr}{why}")
    return problems


def _signature_mismatch(base: Any, impl: Any) -> str:
    P = inspect.Parameter
    b = [p for p in base.parameters.values() if p.kind in (P.POSITIONAL_ONLY, P.POSITIONAL_OR_KEYWORD)]
    i = [p for p in impl.parameters.values() if p.kind in (P.POSITIONAL_ONLY, P.POSITIONAL_OR_KEYWORD)]
    varargs = any(p.kind is P.VAR_POSITIONAL for p in impl.parameters.values())
    varkw = any(p.kind is P.VAR_KEYWORD for p in impl.parameters.values())
    for n, bp in enumerate(b[1:], start=1):  # [0] is self/cls
        if n < len(i):
            if i[n].name != bp.name and not varkw:
                return f"() takes {i[n].name!r} where the contract passes {bp.name!r}"
        elif not varargs:
            return f"() does not accept the contract's argument {bp.name!r}"
    for p in i[len(b):]:
        if p.default is P.empty:
            return f"() adds the argument {p.name!r} without a default (the engine never passes it)"
    impl_kw = {p.name for p in impl.parameters.values() if p.kind is P.KEYWORD_ONLY}
    for p in base.parameters.values():
        if p.kind is P.KEYWORD_ONLY and p.name not in impl_kw and not varkw:
            return f"() does not accept the contract's keyword {p.name!r}"
    for p in impl.parameters.values():
        if p.kind is P.KEYWORD_ONLY and p.default is P.empty and p.name not in {
                q.name for q in base.parameters.values()}:
            return f"() adds the keyword {p.name!r} without a default (the engine never passes it)"
    return ""


def effective_capabilities(cls: type[Transport]) -> tuple[Capabilities, dict[str, str]]:
    """``cls.capabilities`` less the memory kinds unavailable here, and why each is.

    The router uses the first (a transport that declares ``cuda`` but finds no
    GPU or no CUDA library moves host memory only); ``mpcomm plugins`` and
    ``doctor`` show the second.
    """
    caps = cls.capabilities
    try:
        avail = cls.memory_kind_availability()
    except Exception as exc:  # noqa: BLE001 - a broken probe leaves the transport host-only
        avail = {k: Availability.no(f"memory kind check failed: {type(exc).__name__}: {exc}")
                 for k in (caps.memory_kinds | caps.remote_kinds) - {"host"}}
    missing = {k: a.reason for k, a in avail.items() if not a and k != "host"}
    return caps.without_kinds(missing), missing


def timeout_error(op: Operation | OperationGroup) -> TransferTimeout:
    size = op.length if isinstance(op, Operation) else f"{op.count} requests"
    return TransferTimeout(
        f"{op.kind} of {size}{' bytes' if isinstance(op, Operation) else ''} to region {op.remote.name!r} "
        f"on {op.remote.address} timed out; the destination range is undefined",
        region=op.remote.name,
        peer=op.remote.address,
    )
