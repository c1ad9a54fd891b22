"""The request pipeline: prepare → lease → slot → route → post → report → settle.

One request is an :class:`~mpcomm.transport.Operation`; a vectorised batch is
one :class:`~mpcomm.transport.OperationGroup` (one lease, one slot, one
deadline, one ``post_many``), whatever its size. Both are "units" below and
take the same path:

1. **prepare** (caller's thread): every argument checked, bounds vectorised for
   groups; errors raised before anything is held.
2. **lease + slot**: the local region is leased and one of
   ``runtime.queue_depth`` slots taken (back-pressure: wait up to the deadline,
   or raise at once with ``runtime.backpressure = "raise"``).
3. **link**: a connected peer is used at once; otherwise the unit waits in
   that peer's queue and the connecting thread posts it (``write()`` returns
   at once either way).
4. **route + post**: the transport is chosen (cached per peer, region and
   memory kind) and handed the unit; it never waits on the peer there.
5. **report** (any thread): the transport says done/failed; the engine
   releases the slot, the lease and the deadline entry — only then is the
   outcome recorded on the handle, so when a callback runs nothing is held.
6. **settle**: on the posting thread if the unit finished inside ``post`` (no
   hop), else on the completion thread or the caller's completion queue.

A unit is *claimed* exactly once by whoever moves it on from a waiting stage
(the poster, a canceller, the deadline, close), so a cancel racing a post
can neither double-post nor lose a request.
"""

from __future__ import annotations

import functools
import logging
import operator
import threading
import time
from collections import deque
from collections.abc import Sequence
from concurrent.futures import CancelledError
from typing import TYPE_CHECKING, Any

from ..errors import (
    BackPressureError,
    EngineClosedError,
    MemoryKindUnsupported,
    MpcommError,
    OutOfBoundsError,
    PeerConnectionError,
    PermissionDeniedError,
    RegionClosedError,
    StaleRegionError,
    TransferTimeout,
    TransportUnavailable,
)
from ..health import counts_against_path, is_retryable
from ..memory import Region, region_of
from ..peer import same_host
from ..remote import RemoteRegion
from ..transfer import Batch, LandedOrigin, Request, Transfer, TransferStatus, _Dispatch, _Landed, _resolve_members
from ..routing import Route, RouteQuery, SplitPlan
from ..transport import FAILED, PENDING, Operation, OperationGroup, Transport, TransportBusy, _int64, timeout_error
from . import checks, fastlane
from .completions import CompletionQueue
from .notify import MAX_NOTIFY
from .regions import release_view

if TYPE_CHECKING:
    from ..control import PeerLink
    from . import Engine

__all__ = ["Pipeline"]

log = logging.getLogger("mpcomm.engine")

# Unit stages (``unit._stage``), moved on under ``unit._lock``.
WAITING, POSTED, FINISHED = 0, 1, 2


class _Op(Operation):
    """An engine's request: an Operation whose bookkeeping starts at these class-level defaults.

    A request stores only the fields that leave their default (most never
    do), which keeps building one cheap on the hottest path.
    """

    _stage = WAITING
    _ephemeral = False
    _notify: bytes | None = None
    _hint: tuple[str, ...] | None = None
    _slot = False
    _posting = False
    _handed = False
    _batch: Any = None
    _dl: Any = None
    _tracked = False
    _released = False


class _Slots:
    """A counting semaphore for ``runtime.queue_depth`` whose uncontended path is
    one C-level lock (``threading.BoundedSemaphore`` is a Python Condition)."""

    def __init__(self, n: int) -> None:
        self.capacity = n
        self._free = n
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._waiting = 0

    @property
    def in_use(self) -> int:
        return self.capacity - self._free

    def acquire(self, blocking: bool = True, timeout: float | None = None) -> bool:
        with self._lock:
            if self._free:
                self._free -= 1
                return True
            if not blocking:
                return False
            deadline = None if timeout is None else time.monotonic() + timeout
            self._waiting += 1
            try:
                while not self._free:
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        return False
                    self._cond.wait(left)
                self._free -= 1
                return True
            finally:
                self._waiting -= 1

    def release(self) -> None:
        with self._lock:
            self._free += 1
            if self._waiting:
                self._cond.notify()


_FAST_MAX = 256


def _leased_call(local: Region, transport: str, fn: Any, *args: Any) -> bool:
    """The inline lane's copy, ``local`` leased by the caller (released here): True once it landed.

    A plugin bug is logged and counts as declining: the full path reports what post() says.
    """
    try:
        return bool(fn(*args))
    except Exception:  # noqa: BLE001
        log.exception("transport %s failed in post_inline (or its inline_path move)", transport)
        return False
    finally:
        local.release()


def _move_failed(transport: str, exc: BaseException) -> None:
    log.error("transport %s failed in its inline_path move", transport, exc_info=exc)


#: The engine's state as the C lane reads it per request: the read _plain makes (fastlane.lane).
_ENGINE_CLOSED = operator.attrgetter("_closed")


def _plain(path: Any, lo: int, ro: int, length: int | None, timeout: float | None) -> int | None:
    """What a bound pair (``_FastPath``, ``_PostPath``) rechecks per request: the length it
    moves, or None for anything unusual (the full path then takes the request and raises
    what it raises). Exact ints in bounds and a timeout the bound lanes take (both by the
    one rule in :mod:`.checks`), a live link, an open engine with no failing path."""
    if type(lo) is not int or type(ro) is not int or (length is not None and type(length) is not int):
        return None
    length = checks.span(lo, ro, length, path.lsize, path.rsize)
    if (length is None or not checks.timeout_ok(timeout)
            or not path.link.alive or path.engine._closed or path.failing()):
        return None
    return length


class _FastPath(LandedOrigin):
    """One (local region, remote region, kind) whose requests land inline: what is left to check per request.

    Bound after the inline lane landed a request of the pair, with every
    check of that lane done; per request it redoes only what can change:
    the bounds, the timeout, the local region's lease, the peer link, the
    engine's health and state. Revocation of the remote memory is the
    transport's ``move`` to notice. Anything unusual returns None and the
    request takes the slower lanes, which raise the proper errors.

    The engine's table holds :meth:`runner`'s callable, which ``Engine.write``
    and ``read`` call before anything else: this is the hottest path there
    is, so what it reads per request is bound once (the engine, its health
    tables, the table it sits in). It is the origin of the handles the Python
    lane makes.
    """

    __slots__ = ("kind", "local", "remote", "move", "link", "lsize", "rsize", "engine", "failing", "table")

    def __init__(self, kind: str, local: Region, remote: RemoteRegion, move: Any, link: PeerLink,
                 transport: str, route: tuple[str, ...], rule: str, pipe: Pipeline) -> None:
        super().__init__(transport, route, rule, pipe.dispatch)
        self.kind, self.local, self.remote, self.move, self.link = kind, local, remote, move, link
        self.lsize, self.rsize = local.size, remote.size
        self.engine, self.failing, self.table = pipe.e, pipe.e.health.any_failures, pipe._fast

    def runner(self) -> Any:
        """``run(lo, ro, length, timeout) -> handle | None`` for the engine's table: the C lane
        (engine/_fastlane.c) where it is built, else :meth:`_run`.

        Nothing this returns is kept on this object, and the C lane is bound to
        what it needs, not to this object: either way round would be a cycle
        that keeps both regions alive, after the table let go of them, until
        the garbage collector runs.
        """
        key = (id(self.local), id(self.remote), self.kind)
        paths, peers = self.engine.health.failure_tables()
        return fastlane.lane(self.local, self.local._held, self.move, self.link, self.engine, paths, peers, _Landed,
                             LandedOrigin(self.transport, self.route, self.rule, self.dispatch), self.kind,
                             self.remote, self.lsize, self.rsize, functools.partial(self.table.pop, key, None),
                             functools.partial(_move_failed, self.transport), closed=_ENGINE_CLOSED) or self._run

    def _run(self, lo: int, ro: int, length: int | None, timeout: float | None) -> Transfer | None:
        length = _plain(self, lo, ro, length, timeout)
        if length is None:
            return None
        local = self.local
        t0 = time.monotonic()
        try:
            local.acquire()
        except RegionClosedError:
            self.table.pop((id(local), id(self.remote), self.kind), None)
            return None
        try:  # _leased_call, inlined
            if not self.move(lo, ro, length):
                return None
        except Exception as exc:  # noqa: BLE001 - a plugin bug declines; the full path reports what post() says
            _move_failed(self.transport, exc)
            return None
        finally:
            local.release()
        return _Landed(length, self, (self.kind, local, self.remote, ro, length, lo), t0)


class _PostPath:
    """One (local region, remote region, kind) whose requests a transport answers later (tcp, rdma).

    The full path's decisions that hold for every request of the pair -- the
    access check, the route and its transport, the peer link -- are made
    once, by the request that bound it (:meth:`Pipeline._bind_posted`). Per
    request it redoes what can change: the bounds and the timeout, the
    engine's state and health, the link, the local region's lease and a
    ``queue_depth`` slot. The request is then an ordinary Operation, posted,
    tracked, timed and settled as on the full path. Anything unusual (a
    closing region, no free slot, a failing path) returns None and the full
    path takes the request whole, raising what it raises.

    It sits in the same table as the inline lane's runners, and is dropped
    with them (region unregistered, peer restarted or lost).
    """

    __slots__ = ("kind", "local", "remote", "link", "transport", "cands", "rule", "names", "lsize", "rsize",
                 "pipe", "engine", "failing")

    def __init__(self, kind: str, local: Region, remote: RemoteRegion, link: PeerLink, transport: Transport,
                 cands: tuple[Transport, ...], rule: str, names: tuple[str, ...], pipe: Pipeline) -> None:
        self.kind, self.local, self.remote, self.link = kind, local, remote, link
        self.transport, self.cands, self.rule, self.names = transport, cands, rule, names
        self.lsize, self.rsize = local.size, remote.size
        self.pipe, self.engine, self.failing = pipe, pipe.e, pipe.e.health.any_failures

    def run(self, lo: int, ro: int, length: int | None, timeout: float | None) -> Transfer | None:
        length = _plain(self, lo, ro, length, timeout)
        if length is None:
            return None
        pipe = self.pipe
        local = self.local
        try:
            local.acquire()
        except RegionClosedError:
            return None
        if not pipe.slots.acquire(blocking=False):
            local.release()  # full: the full path waits for a slot or raises, as configured
            return None
        op = pipe._op(self.kind, local, lo, self.remote, ro, length,
                      pipe._default_timeout if timeout is None else timeout, pipe.dispatch)
        op._slot = True
        op._stage = POSTED  # nobody else can see it yet: no claim to race
        op._attempt = 0
        pipe._posted(op, self.link, self.transport, self.cands, self.rule, self.names, True)
        return op.transfer


class Pipeline:
    """Every request of one engine goes through here (see the module docstring)."""

    def __init__(self, engine: Engine) -> None:
        self.e = engine
        cfg = engine.config
        self.slots = _Slots(cfg.runtime.queue_depth)
        self._raise_on_full = cfg.runtime.backpressure == "raise"
        self._default_timeout = cfg.request_timeout
        self._grace = cfg.runtime.abort_grace_ms / 1000
        self._lazy = cfg.memory.registration == "lazy"
        self._inflight: set[Any] = set()
        self._inflight_lock = threading.Lock()
        self._routes: dict[tuple[Any, ...], tuple[tuple[Transport, ...], str, tuple[str, ...]]] = {}
        self._backlog: dict[str, deque[Any]] = {}
        self._backlog_lock = threading.Lock()
        # Notifications waiting per peer, and how many notify workers each peer holds: a
        # stopped peer ties up at most _notify_per_peer of them (each waits out its
        # request's deadline), so notifications to every other peer keep flowing.
        self._notify_lanes: dict[str, list[Any]] = {}
        self._notify_lock = threading.Lock()
        self._notify_per_peer = max(1, cfg.runtime.worker_threads // 4)
        self.dispatch = _Dispatch(engine._completions.push, engine._completions.on_thread, self.cancel)
        #: The inline lane's bound pairs, per (id(local), id(remote), kind): _FastPath.runner()'s.
        self._fast: dict[tuple[int, int, str], Any] = {}
        #: Nothing but the copy may be left to do for the inline lane to apply (set by policy_ready).
        self._inline_ok = False

    def policy_ready(self) -> None:
        """The engine's route policy is set: decide once whether the inline lane can ever apply."""
        self._inline_ok = not self._lazy and not self.e.telemetry.enabled and not self._splits()
        if self._inline_ok:
            fastlane.module()  # imported here, not inside the first bound request

    # -- prepare ----------------------------------------------------------------------

    def _dispatch_for(self, cq: Any) -> _Dispatch:
        if cq is None:
            return self.dispatch
        if not isinstance(cq, CompletionQueue):
            raise MpcommError(f"completion_queue must come from Engine.completion_queue(), not {cq!r}")
        # Kept on the queue itself (one per engine that posts to it): no table here to outlive it.
        per_engine = cq.__dict__.setdefault("_dispatch", {})
        d = per_engine.get(id(self))
        if d is None:
            d = per_engine[id(self)] = _Dispatch(cq.push, cq.on_thread, self.cancel)
        return d

    def _local(self, buf: Any, name: str) -> tuple[Region, bool]:
        if isinstance(buf, Region):
            if buf.closed:
                raise RegionClosedError(f"region {buf.name!r} is unregistered", region=buf.name)
            return buf, False
        return region_of(buf, name=name), True  # host buffer, DLPack / CUDA array, DeviceBuffer

    def _timeout(self, timeout: float | None) -> float:
        return checks.timeout_seconds(timeout, self._default_timeout)

    def _hint(self, route: Any, request: Any = None) -> tuple[str, ...] | None:
        """A per-request ``route=`` hint as a tuple of installed transport names (None: the rules decide)."""
        if route is None:
            return None
        names = (route,) if isinstance(route, str) else route
        if not isinstance(names, (list, tuple)) or not names or not all(isinstance(n, str) and n for n in names):
            raise MpcommError(f"route must be a transport name or a non-empty list of them, not {route!r}",
                              request=request)
        installed = self.e.route_policy.installed
        for n in names:
            if n not in installed:
                raise MpcommError(f"route names transport {n!r}, which is not installed "
                                  f"(installed: {', '.join(installed) or 'none'})", request=request)
        return tuple(names)

    @staticmethod
    def _check_access(kind: str, local: Region, remote: RemoteRegion, request: Any = None) -> None:
        if not isinstance(remote, RemoteRegion):
            raise MpcommError(f"remote must be a RemoteRegion (from Engine.open), not {type(remote).__name__}",
                              request=request)
        if kind == "write":
            if "w" not in remote.access:
                raise PermissionDeniedError(f"remote region {remote.name!r} is read-only", region=remote.name,
                                            peer=remote.address, request=request)
        elif kind == "read":
            if "w" not in local.access:
                raise PermissionDeniedError(f"local buffer {local.name!r} is read-only; it cannot receive a read",
                                            region=local.name, request=request)
            if "r" not in remote.access:
                raise PermissionDeniedError(f"remote region {remote.name!r} may not be read", region=remote.name,
                                            peer=remote.address, request=request)
        else:
            raise MpcommError(f"request op must be 'write' or 'read', not {kind!r}", request=request)

    @staticmethod
    def _check_bounds(local: Region, remote: RemoteRegion, lo: int, ro: int, length: int | None,
                      request: Any = None) -> int:
        return checks.check_span(local.name, local.size, remote.name, remote.size, remote.address, lo, ro, length,
                                 request)

    def _op(self, kind: str, local: Region, lo: int, remote: RemoteRegion, ro: int, length: int,
            timeout: float, dispatch: _Dispatch, request: Request | None = None) -> Operation:
        now = time.monotonic()
        op = _Op(kind, local, lo, remote, ro, length, now + timeout, time.time() + timeout, sink=self._reported)
        t = Transfer(request, _dispatch=dispatch)
        t._op = op
        op.transfer = t
        return op

    # -- public entry points -----------------------------------------------------------

    def single(self, kind: str, buf: Any, remote: RemoteRegion, ro: int, length: int | None, lo: int,
               notify: bytes | None, timeout: float | None, cq: Any, route: Any = None) -> Transfer:
        if self.e._closed:
            raise EngineClosedError("the engine is closed")
        if self._inline_ok and notify is None and route is None and cq is None:
            if isinstance(buf, Region):
                # Engine.write/read already tried the pair's bound run: if there is one, it declined.
                landed = self._inline_lane(kind, buf, remote, ro, length, lo, timeout,
                                           (id(buf), id(remote), kind) in self._fast)
                if landed is not None:
                    return landed
        hint = self._hint(route)
        local, ephemeral = self._local(buf, "ephemeral")
        self._check_access(kind, local, remote)
        length = self._check_bounds(local, remote, lo, ro, length)
        if notify is not None and len(notify) > MAX_NOTIFY:
            raise MpcommError(f"notification of {len(notify)} bytes exceeds {MAX_NOTIFY}")
        op = self._op(kind, local, lo, remote, ro, length, self._timeout(timeout), self._dispatch_for(cq))
        op._ephemeral = ephemeral
        op._notify = notify
        op._hint = hint
        self._hold(op)
        self._launch(op, inline=True)
        return op.transfer

    def _inline_lane(self, kind: str, local: Region, remote: RemoteRegion, ro: int, length: int | None, lo: int,
                     timeout: float | None, declined: bool = False) -> Transfer | None:
        """A small request its transport finishes on this thread: no Operation, slot, deadline or table.

        Taken only when nothing but the copy is left to do: the peer is
        connected at the descriptor's epoch, the route for this region is
        cached and its first transport is healthy and offers
        :meth:`Transport.post_inline`, and no notification, hint, completion
        queue, telemetry, split rule or lazy registration is involved. The
        checks (access, bounds, timeout) are those of the full path and raise
        the same errors. The request holds the local region's lease for the
        call, as a posted one does; it takes no ``queue_depth`` slot, since
        it is never in flight once ``write()`` returns. None: take the full
        path (which redoes the request whole). ``declined``: the pair's bound
        move declined this request; if the lane lands it anyway, that move is
        stale (a transport may shut a bound move for good) and is bound anew.
        """
        if local.closed:
            return None
        # First what rules the lane out for good (no cached route, a transport without the
        # lane: tcp, rdma): such requests go straight to the full path, which checks them.
        entry = self._routes.get((remote.address, remote.epoch, remote.region_id, local.kind, None))
        if entry is None:
            return None
        transport = entry[0][0]
        if type(transport).post_inline is Transport.post_inline:
            return None
        self._check_access(kind, local, remote)
        length = self._check_bounds(local, remote, lo, ro, length)
        self._timeout(timeout)
        link = self.e._peers.ready(remote.address)
        if link is None or link.info.epoch != remote.epoch or self.e.health.any_failures():
            return None
        try:
            local.acquire()  # released by _leased_call
        except RegionClosedError:
            return None
        t0 = time.monotonic()
        if not _leased_call(local, transport.name, transport.post_inline, kind, local, lo, remote, ro, length):
            return None
        fast = None
        if declined or (id(local), id(remote), kind) not in self._fast:
            fast = self._bind_fast(kind, local, remote, transport, link, entry)
        origin = fast if fast is not None else LandedOrigin(transport.name, entry[2], entry[1], self.dispatch)
        return _Landed(length, origin, (kind, local, remote, ro, length, lo), t0)

    def _bind_fast(self, kind: str, local: Region, remote: RemoteRegion, transport: Transport, link: PeerLink,
                   entry: tuple[tuple[Transport, ...], str, tuple[str, ...]]) -> _FastPath | None:
        """After a request of this pair landed inline: keep the transport's bound move for the next ones."""
        try:
            move = transport.inline_path(kind, local, remote)
        except Exception:  # noqa: BLE001 - a plugin bug: the slower lanes still work
            log.exception("transport %s failed in inline_path", transport.name)
            return None
        if move is None:
            return None
        if len(self._fast) >= _FAST_MAX:
            self._fast.clear()  # bounded; the pairs in use bind again on their next request
        fast = _FastPath(kind, local, remote, move, link, transport.name, entry[2], entry[1], self)
        self._fast[(id(local), id(remote), kind)] = fast.runner()
        return fast

    def _bind_posted(self, op: Operation, link: PeerLink, transport: Transport, cands: tuple[Transport, ...],
                     rule: str, names: tuple[str, ...]) -> None:
        """After a plain request of a pair was routed to a transport that answers later: bind the routing.

        Only for what the inline lane never takes (the transport has no
        ``post_inline``: tcp, rdma; ucx and shm have that lane) and only when nothing but the route
        decided the request: no hint, notification, completion queue, size
        rule, lazy or ephemeral registration, and a transport whose post()
        never waits on the peer.
        """
        if (op._hint is not None or op._notify is not None or op._ephemeral
                or op.transfer._dispatch is not self.dispatch or self.e.route_policy.size_rules
                or type(transport).post_inline is not Transport.post_inline
                or transport.post_may_block or self.e.health.any_failures()):
            return
        key = (id(op.local), id(op.remote), op.kind)
        if key in self._fast:
            return
        if len(self._fast) >= _FAST_MAX:
            self._fast.clear()  # bounded; the pairs in use bind again on their next request
        self._fast[key] = _PostPath(op.kind, op.local, op.remote, link, transport, cands, rule, names, self).run

    def forget_fast(self) -> None:
        """Drop every bound inline move (routes, health or regions changed): the next request rebinds."""
        self._fast.clear()

    def vector(self, kind: str, buf: Any, remote: RemoteRegion, local_offsets: Any, remote_offsets: Any,
               lengths: Any, timeout: float | None, cq: Any, post: bool = True, route: Any = None) -> Batch:
        if self.e._closed:
            raise EngineClosedError("the engine is closed")
        hint = self._hint(route)
        local, ephemeral = self._local(buf, "ephemeral-batch")
        self._check_access(kind, local, remote)
        t = self._timeout(timeout)
        now = time.monotonic()
        group = OperationGroup(kind, local, remote, local_offsets, remote_offsets, lengths, now + t, time.time() + t,
                               sink=self._group_reported)
        self._check_group(group)
        batch = Batch(group.count, _dispatch=self._dispatch_for(cq))
        if group.count == 0:
            batch._record(None, 0)
            self._deliver_inline(batch, batch._finish_inline)
            return batch
        self._adopt(group, batch, 0, ephemeral)
        group._hint = hint
        batch._left = 1
        batch._posting = False
        batch._staged = not post
        self._hold(group)
        if post:
            self._post_batch(batch, [group])
        else:
            self._stage(group)
        return batch

    def _plan(self, requests: Sequence[Request], timeout: float | None, route: Any = None) -> _Plan:
        """Check and group requests (same kind, local buffer, remote descriptor and timeout).

        Every request is checked before anything is held: access once per group,
        bounds vectorised per group.
        """
        plan = _Plan(requests)
        groups: dict[tuple[Any, ...], tuple[list[int], list[int], list[int], list[int]]] = {}
        locals_ = plan.locals
        # Consecutive requests usually share local buffer and group: remember the last ones.
        last_obj: Any = _NONE
        last_key: Any = _NONE
        local: Region = None  # type: ignore[assignment]
        g: Any = None
        for i, req in enumerate(requests):
            if type(req) is not Request and not isinstance(req, Request):
                raise MpcommError(f"submit() takes Request objects, not {type(req).__name__} (index {i})")
            obj = req.local
            if obj is not last_obj:
                got = locals_.get(id(obj))
                if got is None:
                    got = locals_[id(obj)] = self._local(obj, f"ephemeral-{i}")
                local, last_obj = got[0], obj
            length = req.length
            if length is None:
                length = local.size - req.local_offset
            hint = self._hint(req.route if req.route is not None else route, req)
            if req.notify is not None:
                self._check_access(req.op, local, req.remote, req)
                # The offsets are read once: what was checked is what is posted.
                lo, ro = req.local_offset, req.remote_offset
                length = self._check_bounds(local, req.remote, lo, ro, length, req)
                if len(req.notify) > MAX_NOTIFY:
                    raise MpcommError(f"notification of {len(req.notify)} bytes exceeds {MAX_NOTIFY}", request=req)
                plan.singles.append((i, req, local, lo, ro, length,
                                     self._timeout(req.timeout if req.timeout is not None else timeout),
                                     locals_[id(obj)][1], hint))
                last_key = _NONE
                continue
            key = (req.op, id(local), id(req.remote), req.timeout, hint)
            if key != last_key:
                g = groups.get(key)
                if g is None:
                    # Access is checked once per group, bounds vectorised per group below.
                    self._check_access(req.op, local, req.remote, req)
                    g = groups[key] = ([], [], [], [])
                last_key = key
            g[0].append(i)
            g[1].append(req.local_offset)
            g[2].append(req.remote_offset)
            g[3].append(length)
        for key, (idx, lo, ro, ln) in groups.items():
            req = requests[idx[0]]
            local, ephemeral = locals_[id(req.local)]
            t = self._timeout(req.timeout if req.timeout is not None else timeout)
            # A group covers consecutive indices only; runs keep the index mapping exact.
            for s0, s1 in _runs(idx):
                spec = _GroupSpec(key[0], local, req.remote, _int64(lo[s0:s1], None, "local_offsets"),
                                  _int64(ro[s0:s1], None, "remote_offsets"), _int64(ln[s0:s1], None, "lengths"),
                                  t, ephemeral, idx[s0])
                spec.hint = key[-1]
                self._check_spec(spec, idx[s0:s1], requests)
                plan.groups.append(spec)
        return plan

    def submit(self, requests: Sequence[Request], timeout: float | None, cq: Any, post: bool,
               route: Any = None) -> Batch:
        """Group the requests into vectorised parts and post (or stage) them."""
        if self.e._closed:
            raise EngineClosedError("the engine is closed")
        return self._start_plan(self._plan(requests, timeout, route), cq, post)

    def prepare(self, requests: Sequence[Request], timeout: float | None) -> PreparedBatch:
        if self.e._closed:
            raise EngineClosedError("the engine is closed")
        plan = self._plan(requests, timeout)
        if plan.singles or any(g.ephemeral for g in plan.groups):
            raise MpcommError("prepare() takes requests between registered Regions without notify; "
                              "register the buffers first (or use submit())")
        return PreparedBatch(self, plan)

    def prepare_many(self, kind: str, local: Any, remote: RemoteRegion, local_offsets: Any, remote_offsets: Any,
                     lengths: Any, timeout: float | None) -> PreparedBatch:
        if self.e._closed:
            raise EngineClosedError("the engine is closed")
        if not isinstance(local, Region):
            raise MpcommError("prepare_many() needs a registered Region as the local buffer")
        region, _ = self._local(local, "")
        self._check_access(kind, region, remote)
        spec = _GroupSpec(kind, region, remote, _int64(local_offsets, None, "local_offsets"), None, None,
                          self._timeout(timeout), False, 0)
        spec.lengths = _int64(lengths, None, "lengths")
        spec.remote_offsets = _int64(remote_offsets, len(spec.lengths), "remote_offsets")
        if len(spec.local_offsets) != len(spec.lengths):
            raise MpcommError(f"local_offsets has {len(spec.local_offsets)} entries, expected {len(spec.lengths)}")
        self._check_spec(spec)
        plan = _Plan(None)
        plan.groups.append(spec)
        plan.count = len(spec.lengths)
        return PreparedBatch(self, plan)

    def _check_spec(self, spec: _GroupSpec, index: list[int] | None = None,
                    requests: Sequence[Request] | None = None) -> None:
        g = OperationGroup(spec.kind, spec.local, spec.remote, spec.local_offsets, spec.remote_offsets,
                           spec.lengths, 0.0, 0.0, copy=False)
        self._check_group(g, index, requests)

    def _start_plan(self, plan: _Plan, cq: Any, post: bool) -> Batch:
        batch = Batch(plan.count, _dispatch=self._dispatch_for(cq))
        batch._requests = plan.requests
        batch._posting = False
        batch._staged = not post
        units: list[Any] = []
        now = time.monotonic()
        wall = time.time()
        for spec in plan.groups:
            local = spec.local
            if local.closed:
                raise RegionClosedError(f"region {local.name!r} is unregistered", region=local.name)
            # The plan's arrays are the engine's own copies, checked once (prepare/submit): no copy per post.
            g = OperationGroup(spec.kind, local, spec.remote, spec.local_offsets, spec.remote_offsets,
                               spec.lengths, now + spec.timeout, wall + spec.timeout, sink=self._group_reported,
                               copy=False)
            self._adopt(g, batch, spec.start, spec.ephemeral)
            g._hint = spec.hint
            units.append(g)
        dispatch = batch._dispatch
        for i, req, local, lo, ro, length, t, ephemeral, hint in plan.singles:
            op = self._op(req.op, local, lo, req.remote, ro, length, t, dispatch, req)
            op._notify = req.notify
            op._ephemeral = ephemeral
            op._hint = hint
            op._batch = batch
            batch._parts.append((i, op))
            units.append(op)
        if plan.singles:
            batch._parts.sort(key=lambda p: p[0])
        batch._left = len(units)
        if not units:
            batch._record(None, 0)
            self._deliver_inline(batch, batch._finish_inline)
            return batch
        held: list[Any] = []
        try:
            for u in units:
                self._hold(u)
                held.append(u)
        except BaseException:
            for u in held:
                self._unhold(u)
            raise
        if post:
            self._post_batch(batch, units)
        else:
            for u in units:
                self._stage(u)
        return batch

    def post_staged(self, batch: Batch) -> Batch:
        """Post the parts of a ``submit(..., post=False)`` batch that are still waiting."""
        if not getattr(batch, "_staged", False):
            return batch
        batch._staged = False
        units = [part for _, part in batch._parts]
        self._post_batch(batch, units, staged=True)
        return batch

    # -- holding resources ---------------------------------------------------------------

    def _adopt(self, group: OperationGroup, batch: Batch, start: int, ephemeral: bool) -> None:
        group.transfer = batch
        group._batch = batch
        group._start = start
        group._stage = WAITING
        group._ephemeral = ephemeral
        group._slot = False
        group._posting = False
        group._dl = None
        group._notify = None
        group._tracked = False
        group._released = False
        group._hint = None
        batch._parts.append((start, group))
        batch._op = group if not batch._op else batch._op

    def _check_group(self, g: OperationGroup, index: list[int] | None = None,
                     requests: Sequence[Request] | None = None) -> None:
        n = g.count
        if n == 0:
            return
        lo, ro, ln = g.local_offsets, g.remote_offsets, g.lengths
        i = checks.first_bad(lo, ro, ln, g.local.size, g.remote.size)
        if i < 0:
            return
        try:  # the error path only: name the first bad index
            self._check_bounds(g.local, g.remote, lo[i], ro[i], ln[i])
        except OutOfBoundsError as exc:
            k = i if index is None else index[i]
            raise OutOfBoundsError(f"request {k} of the batch: {exc}; nothing was transferred",
                                   region=exc.region, peer=exc.peer,
                                   request=requests[k] if requests is not None else None) from None

    def _hold(self, unit: Any) -> None:
        """Lease the local region and take a queue_depth slot; raise (holding nothing) if either fails."""
        unit.local.acquire()
        if self._raise_on_full:
            ok = self.slots.acquire(blocking=False)
        else:
            ok = self.slots.acquire(timeout=max(0.0, unit.deadline - time.monotonic()))
        if not ok:
            unit.local.release()
            raise BackPressureError(
                f"{self.slots.capacity} requests already in flight (runtime.queue_depth)",
                request=getattr(unit.transfer, "_request", None),
            )
        unit._slot = True

    def _unhold(self, unit: Any) -> None:
        if unit._slot:
            unit._slot = False
            self.slots.release()
        unit.local.release()

    def _stage(self, unit: Any) -> None:
        self._arm(unit)
        self._track(unit)

    # -- posting -----------------------------------------------------------------------

    def _post_batch(self, batch: Batch, units: list[Any], staged: bool = False) -> None:
        batch._posting = True
        try:
            for u in units:
                if staged and not self._claim(u, WAITING):
                    continue
                if staged:
                    u._stage = WAITING  # _launch claims it again
                self._launch(u, inline=False)
        finally:
            with batch._lock:
                batch._posting = False
                # Exactly one of this thread and _batch_done hands the batch on.
                mine = batch._outcome is not None and not batch.__dict__.get("_handed", False)
                if mine:
                    batch._handed = True
            if mine:
                self._deliver_inline(batch, lambda: self._settle_batch_inline(batch))

    def _launch(self, unit: Any, inline: bool) -> None:
        """Route and post ``unit`` now if its peer is connected, else queue it on that peer."""
        remote = unit.remote
        link = self.e._peers.ready(remote.address)
        if link is None:
            self._track(unit)
            self._arm(unit)
            try:
                self.e._peers.when_ready(remote.address, unit.deadline,
                                         lambda lk, err, u=unit: self._connected(u, lk, err))
            except MpcommError as exc:
                self._abandon(unit, exc)
            return
        self._post(unit, link, inline)

    def _connected(self, unit: Any, link: PeerLink | None, error: BaseException | None) -> None:
        if error is not None:
            self._abandon(unit, error)
            return
        assert link is not None
        self._post(unit, link, False)

    def _claim(self, unit: Any, expect: int, to: int = POSTED) -> bool:
        with unit._lock:
            if unit._stage != expect:
                return False
            unit._stage = to
            return True

    def _post(self, unit: Any, link: PeerLink, inline: bool) -> None:
        if not self._claim(unit, WAITING):
            return  # cancelled, timed out or closed while it waited
        remote = unit.remote
        try:
            if link.info.epoch != remote.epoch:
                raise StaleRegionError(
                    f"{remote.address} restarted since {remote.name!r} was opened; open it again",
                    region=remote.name, peer=remote.address)
            cands, rule, names = self._route(link, unit)
            transport = self._admit(unit, cands, 0)
            if self._lazy or unit._ephemeral:
                self.e._regions.ensure_registered(unit.local, transport)
        except BaseException as exc:  # noqa: BLE001 - the unit fails with it, nothing moved
            self._fail_unposted(unit, exc, inline)
            return
        if isinstance(unit, Operation) and self._splits():
            plan = self._split_plan(link, unit, cands, rule)
            if plan is not None:
                self._post_split(unit, link, plan, cands, rule, names, inline)
                return
        if inline and self._inline_ok and unit._batch is None and isinstance(unit, Operation):
            self._bind_posted(unit, link, transport, cands, rule, names)
        self._posted(unit, link, transport, cands, rule, names, inline)

    def _posted(self, unit: Any, link: PeerLink, transport: Transport, cands: tuple[Transport, ...], rule: str,
                names: tuple[str, ...], inline: bool) -> None:
        """Hand a routed, claimed unit to ``transport``; settle it here if it finished inside post()."""
        unit.peer = link.info
        unit.transport = transport
        unit._cands = cands
        transfer = unit.transfer
        transfer.transport = transport.name
        transfer.route, transfer.route_rule = names, rule
        transfer.status = TransferStatus.POSTED
        if unit._batch is not None:
            unit._batch.status = TransferStatus.POSTED
        if self.e.telemetry.enabled and isinstance(unit, Operation):
            self.e.telemetry.on_post(unit, transport.name)
        unit._posting = inline
        if transport.post_may_block:
            # A transport written for the first contract may wait on the peer
            # inside post(): its deadline and close() must be able to interrupt it.
            self._track(unit)
            self._arm(unit)
        busy = self._hand_to(transport, unit)
        for waiting in busy:
            self._to_backlog(transport, waiting)
        if inline:
            with unit._lock:
                unit._posting = False
                # Exactly one of this thread and _push hands the handle on.
                mine = (transfer._outcome is not None and isinstance(unit, Operation) and unit._batch is None
                        and not unit._handed)
                if mine:
                    unit._handed = True
            if mine:
                self._deliver_inline(transfer, transfer._finish_inline)
                return
        if not unit.done:
            # Tracked (for close() and peer loss) only when it outlives post():
            # requests finished inline never touch the table or the timer.
            self._track(unit)
            self._arm(unit)

    def _track(self, unit: Any) -> None:
        if unit._tracked:
            return
        with self._inflight_lock:
            self._inflight.add(unit)
        unit._tracked = True
        if unit.done and unit._released:  # finished between post() and here
            with self._inflight_lock:
                self._inflight.discard(unit)

    # -- split requests (a rule's split_min) ----------------------------------------------
    #
    # A split request stays one Operation for the engine (one lease, slot,
    # deadline and handle); it is carried by parallel stripe Operations, one
    # per stripe of the policy's SplitPlan, each posted to its own transport
    # and failed over on its own (its own route: its transport first, then
    # the rest). The parent's ``transport`` is a _Striped stand-in, so an
    # abort (deadline, cancel, close) reaches every stripe; the parent reports
    # once the last stripe has, with the first error if any stripe failed.

    def _splits(self) -> bool:
        s = getattr(self, "_split_rules", None)
        if s is None:
            s = self._split_rules = any(r.split_min is not None for r in self.e.route_policy.rules)
        return s

    def _split_plan(self, link: PeerLink, op: Operation, cands: tuple[Transport, ...], rule: str) -> SplitPlan | None:
        q = self._query(link, op)
        if q.hint:
            return None
        return self.e.route_policy.split(q, Route(tuple(t.name for t in cands), rule))

    def _post_split(self, op: Operation, link: PeerLink, plan: SplitPlan, cands: tuple[Transport, ...], rule: str,
                    names: tuple[str, ...], inline: bool) -> None:
        self._end_probe(op)  # the stripes carry it: each is admitted (and probes) on its own
        subs: list[Operation] = []
        try:
            for s in plan.stripes:
                first = next((t for t in cands if t.name == s.transport), cands[0])
                own = (first, *(t for t in cands if t is not first))
                sub = Operation(op.kind, op.local, op.local_offset + s.offset, op.remote, op.remote_offset + s.offset,
                                s.length, op.deadline, op.deadline_wall, link.info, sink=self._stripe_reported)
                sub._parent = op
                sub._stage = POSTED
                sub._ephemeral = op._ephemeral
                sub._hint = None
                sub._batch = None
                sub._cands = own
                sub.transfer = op.transfer
                sub.transport = self._admit(sub, own, 0)
                if self._lazy or op._ephemeral:
                    self.e._regions.ensure_registered(op.local, sub.transport)
                subs.append(sub)
        except BaseException as exc:  # noqa: BLE001 - nothing posted yet
            self._fail_unposted(op, exc, inline)
            return
        op.peer = link.info
        op._cands = ()
        op._stripes = subs
        op._stripes_left = len(subs)
        op._stripe_error = None
        op._stripe_lock = threading.Lock()
        op.transport = _Striped(self, subs)
        transfer = op.transfer
        transfer.transport = "+".join(dict.fromkeys(s.transport.name for s in subs))
        transfer.route, transfer.route_rule = names, rule
        transfer.status = TransferStatus.POSTED
        if op._batch is not None:
            op._batch.status = TransferStatus.POSTED
        if self.e.telemetry.enabled:
            self.e.telemetry.on_post(op, transfer.transport)
        with self._inflight_lock:
            self._inflight.add(op)
        op._posting = inline
        self._arm(op)  # before posting: a stripe transport may wait on the peer in post()
        for sub in subs:
            if op.abort_exc is not None:
                sub.abort_exc = op.abort_exc  # not retried
                sub.fail(op.abort_exc)
                continue
            self._repost(sub, sub.transport)
        if inline:
            with op._lock:
                op._posting = False
            if transfer._outcome is not None and op._batch is None:
                transfer._finish_inline()

    def _stripe_reported(self, sub: Operation, error: BaseException | None, nbytes: int) -> None:
        if error is not None and self._retry(sub, error):
            return
        if error is None:
            self._succeeded(sub)
        self._end_probe(sub)  # a stripe is never released: its own ending frees its probe
        name = sub.transport.name if sub.transport is not None else ""
        if self._backlog.get(name):  # a stripe holds no slot: release() would not drain for it
            try:
                self.e._executor.submit(self._drain_backlog, name)
            except RuntimeError:
                pass
        op = sub._parent
        with op._stripe_lock:
            if error is not None and op._stripe_error is None:
                op._stripe_error = error
            op._stripes_left -= 1
            last = op._stripes_left == 0
        if not last:
            return
        op.transfer.stripes = tuple((s.local_offset - op.local_offset, s.length, s.transport.name)
                                    for s in op._stripes)
        op.transfer.transport = "+".join(dict.fromkeys(s.transport.name for s in op._stripes))
        if op._stripe_error is None:
            op.complete(op.length)
        else:
            op.fail(op._stripe_error)

    def _fail_unposted(self, unit: Any, exc: BaseException, inline: bool) -> None:
        unit._stage = FINISHED
        err = exc if isinstance(exc, MpcommError) else MpcommError(str(exc))
        if inline and isinstance(unit, Operation) and unit._batch is None:
            # The caller is still in write(): raise, holding nothing.
            self._release(unit)
            raise err
        self._finish(unit, err, 0, failed_group=True)

    def _abandon(self, unit: Any, exc: BaseException) -> None:
        """Finish a unit that never got posted (connection failed, cancelled, closed, deadline)."""
        if not self._claim(unit, WAITING, FINISHED):
            return
        self._finish(unit, exc, 0, failed_group=True)

    def _route(self, link: PeerLink, unit: Any) -> tuple[tuple[Transport, ...], str, tuple[str, ...]]:
        """The transports that may carry ``unit``, in the route policy's order, and the rule's name.

        Cached per peer epoch, region and memory kind (and per chosen list when
        the rules look at sizes, so the cache stays bounded by the rules).
        """
        remote = unit.remote
        local_kind = unit.local.kind
        policy = self.e.route_policy
        key: tuple[Any, ...] = (remote.address, remote.epoch, remote.region_id, local_kind,
                                getattr(unit, "_hint", None))
        route = None
        if policy.size_rules:
            route = policy.choose(self._query(link, unit))
            key += route.transports
        cached = self._routes.get(key)
        if cached is not None:
            return cached
        if route is None:
            try:
                route = policy.choose(self._query(link, unit))
            except MemoryKindUnsupported as exc:
                why = "; ".join(f"{t}: {k} unavailable here: {r}" for t, kinds in
                                self.e.memory_kinds_unavailable.items() for k, r in kinds.items()
                                if k in (exc.local_kind, exc.remote_kind))
                msg = f"{remote.name!r} at {remote.address}: {exc}" + (f" ({why})" if why else "")
                raise MemoryKindUnsupported(msg, peer=remote.address, region=remote.name, local_kind=exc.local_kind,
                                            remote_kind=exc.remote_kind) from None
            except TransportUnavailable as exc:
                raise TransportUnavailable(f"no transport reaches {remote.address} for {remote.name!r}: {exc}",
                                           peer=remote.address, region=remote.name) from None
        cands = []
        reasons = []
        for name in route.transports:
            t = self.e._transports.get(name)
            if t is None:
                continue
            avail = t.reach(link.info)
            if not avail:
                reasons.append(f"{name}: {avail.reason}")
                continue
            cands.append(t)
        if not cands:
            raise TransportUnavailable(f"no transport reaches {remote.address} for {remote.name!r} "
                                       f"(route {route.rule!r}): " + "; ".join(reasons),
                                       peer=remote.address, region=remote.name)
        entry = (tuple(cands), route.rule, route.transports)
        self._routes[key] = entry
        return entry

    def _query(self, link: PeerLink, unit: Any) -> RouteQuery:
        remote = unit.remote
        size = unit.length if isinstance(unit, Operation) else unit.total_bytes
        return RouteQuery(
            same_host=same_host(self.e.host, link.info.host, need=("net_ns",)),
            local_kind=unit.local.kind, remote_kind=remote.kind, size=size,
            peer_transports=frozenset(n for n in remote.transports if n in link.info.transports),
            hint=getattr(unit, "_hint", None))

    def _admit(self, unit: Any, cands: tuple[Transport, ...], start: int) -> Transport:
        """The first of ``cands[start:]`` whose path to the peer is not cooling down."""
        health = self.e.health
        if not health.any_failures():
            if start < len(cands):
                unit._attempt = start
                return cands[start]
        else:
            peer = unit.remote.address
            for i in range(start, len(cands)):
                admitted = health.admit(peer, cands[i].name)
                if admitted != "paused":
                    unit._attempt = i
                    # The probe slot this unit holds until it reports (see _end_probe).
                    unit._probe = cands[i].name if admitted == "probe" else None
                    return cands[i]
        state = "quarantined" if self.e.health.quarantined(unit.remote.address) else "cooling down after failures"
        raise PeerConnectionError(f"every path to {unit.remote.address} is {state}; try again later",
                                  peer=unit.remote.address, region=unit.remote.name, retryable=True)

    def _retry(self, unit: Any, error: BaseException) -> bool:
        """After a failed attempt: post ``unit`` again on the next transport of its route if that may help."""
        t = unit.transport
        if isinstance(t, _Striped):
            return False  # each stripe was retried on its own
        cands = getattr(unit, "_cands", ())
        health = self.e.health
        peer = unit.remote.address
        if t is not None and unit.abort_exc is None and counts_against_path(
                error, deadline_passed=unit.time_left() <= 0):
            # Only the transport's own failures count against the path: the
            # request's deadline (reported by the transport or by our timer), a
            # cancel or a closing engine say nothing about it. The report ends
            # the path's probe, if this unit held it.
            unit._probe = None
            health.failure(peer, t.name, error)
        else:
            self._end_probe(unit)
        if (t is None or unit.abort_exc is not None or not is_retryable(error) or self.e._closed
                or unit.time_left() <= 0 or getattr(unit, "_tries", 1) >= health.policy.max_attempts):
            return False
        try:
            nxt = self._admit(unit, cands, unit._attempt + 1)
        except PeerConnectionError:
            return False
        unit._tries = getattr(unit, "_tries", 1) + 1
        health.metrics.retry(peer)
        health.metrics.failover(peer, t.name, nxt.name)
        if self.e.telemetry.enabled and isinstance(unit, Operation):
            self.e.telemetry.on_retry(unit, error)
        # The whole range is moved again: a partial first attempt is rewritten.
        if isinstance(unit, Operation):
            with unit._lock:
                unit._done = False
        else:
            with unit._lock:
                for i in range(unit.count):
                    if unit.status[i] == FAILED:
                        unit.status[i] = PENDING
                        unit.errors.pop(i, None)
                        unit._left += 1
        unit.state = None
        unit.transport = nxt
        unit.transfer.transport = nxt.name
        try:
            self.e._executor.submit(self._repost, unit, nxt)
        except RuntimeError:
            return False
        return True

    def _repost(self, unit: Any, t: Transport) -> None:
        if self._lazy or unit._ephemeral:
            try:
                self.e._regions.ensure_registered(unit.local, t)
            except Exception as exc:  # noqa: BLE001 - the request fails, not the retrying thread
                unit.fail(exc if isinstance(exc, MpcommError) else MpcommError(f"transport {t.name} failed: {exc}"))
                return
        for waiting in self._hand_to(t, unit):
            self._to_backlog(t, waiting)

    def _hand_to(self, t: Transport, unit: Any) -> tuple[Any, ...]:
        """Post ``unit`` on ``t``; what a full transport handed back (to queue), else ().

        A refusal (MpcommError) or a plugin bug (anything else, logged) fails
        the unit here: the request fails, never the thread that posted it.
        """
        try:
            if isinstance(unit, Operation):
                t.post(unit)
            else:
                t.post_many(unit)
        except TransportBusy as busy:
            return tuple(busy.pending or (unit,))
        except MpcommError as exc:
            unit.fail(exc)
        except Exception as exc:  # noqa: BLE001 - a plugin bug fails the request, not the caller
            log.exception("transport %s failed to post", t.name)
            unit.fail(MpcommError(f"transport {t.name} failed: {exc}"))
        return ()

    def backlog(self) -> int:
        """Requests waiting now for a queue slot or for a busy transport."""
        with self._backlog_lock:
            busy = sum(len(q) for q in self._backlog.values())
        return self.slots._waiting + busy

    def forget_routes(self, address: str) -> None:
        self._fast.clear()
        for key in [k for k in list(self._routes) if k[0] == address]:
            self._routes.pop(key, None)

    def _to_backlog(self, transport: Transport, unit: Any, delay: float = 0.001) -> None:
        unit._stage = WAITING  # claimable again: by the drain, a cancel or the deadline
        with self._backlog_lock:
            self._backlog.setdefault(transport.name, deque()).append(unit)
        # Finishing requests drain the backlog; the timer makes sure it is
        # drained even when none of them is the engine's (a group's members).
        self._schedule_drain(transport.name, delay)

    def _schedule_drain(self, name: str, delay: float) -> None:
        def kick() -> None:
            try:
                self.e._executor.submit(self._drain_backlog, name, delay)
            except RuntimeError:
                pass  # closing

        self.e._timer.schedule(time.monotonic() + delay, kick)

    def _drain_backlog(self, name: str, delay: float = 0.001) -> None:
        t = self.e._transports.get(name)
        while t is not None:
            with self._backlog_lock:
                q = self._backlog.get(name)
                if not q:
                    return
                unit = q.popleft()
            if not self._claim(unit, WAITING):
                continue
            if unit.abort_exc is not None:  # timed out, cancelled or closed while it waited
                unit.fail(unit.abort_exc)
                continue
            busy = self._hand_to(t, unit)
            if busy:  # still full: back to the front, in order, and try again later
                with self._backlog_lock:
                    for waiting in reversed(busy):
                        waiting._stage = WAITING
                        self._backlog.setdefault(name, deque()).appendleft(waiting)
                self._schedule_drain(name, min(delay * 2, 0.05))
                return

    # -- deadlines -------------------------------------------------------------------------

    def _arm(self, unit: Any) -> None:
        if unit._dl is None:
            unit._dl = self.e._timer.schedule(unit.deadline, lambda u=unit: self._on_deadline(u))
            if unit.done:
                self.e._timer.cancel(unit._dl)

    def _on_deadline(self, unit: Any) -> None:
        if unit.done:
            return
        err = timeout_error(unit)
        if self._claim(unit, WAITING, FINISHED):  # never posted: nothing moved
            self._finish(unit, err, 0, failed_group=True)
            return
        unit.abort(err)
        self.e._timer.schedule(time.monotonic() + self._grace, lambda: self._on_abort_overdue(unit))

    def _on_abort_overdue(self, unit: Any) -> None:
        if unit.done:
            return
        name = unit.transport.name if unit.transport else "?"
        log.error("transport %s did not stop a timed-out %s within runtime.abort_grace_ms; failing it",
                  name, unit.kind)
        err = TransferTimeout(
            f"{unit.kind} to {unit.remote.address} timed out and transport {name} did not confirm that it "
            "stopped; bytes may still land in the destination range",
            region=unit.remote.name, peer=unit.remote.address)
        err.confirmed = False
        # The transport may still touch the local buffer: keep the lease (and
        # so the buffer) until it reports, but resolve the handle now.
        self._resolve_unconfirmed(unit, err)

    def _resolve_unconfirmed(self, unit: Any, err: BaseException) -> None:
        unit._unconfirmed = True
        self._end_probe(unit)  # resolved by its deadline: the transport's late report says nothing
        if isinstance(unit, Operation):
            unit.transfer._record(err, 0)
            self._push(unit)
        else:
            # As for an Operation: the handle fails now with the unconfirmed error, while
            # the group keeps its lease and slot until the transport reports (failing the
            # group here released them with bytes still able to land, and replaced the
            # error with the abort's confirmed-looking timeout).
            batch = unit._batch
            if batch._record(err, 0):
                with batch._lock:
                    if batch._posting or batch.__dict__.get("_handed", False):
                        return
                    batch._handed = True
                batch._dispatch.push(batch)

    # -- reports (any thread) -------------------------------------------------------------

    def _reported(self, op: Operation, error: BaseException | None, nbytes: int) -> None:
        """An Operation's sink: the transport's word that it ended."""
        if error is not None and self._retry(op, error):
            return
        if error is None:
            self._succeeded(op)
        if error is None and op._notify is not None:
            try:
                self._queue_notification(op, nbytes)
                return
            except RuntimeError:
                error = EngineClosedError("the engine was closed before the notification was sent")
        self._finish(op, error, nbytes)

    def _queue_notification(self, op: Operation, nbytes: int) -> None:
        """Send ``op``'s notification on a notify worker, at most ``_notify_per_peer`` per peer.

        Raises RuntimeError (nothing queued) when the engine's notify pool is shut down.
        """
        addr = op.remote.address
        with self._notify_lock:
            lane = self._notify_lanes.get(addr)
            if lane is None:
                lane = self._notify_lanes[addr] = [deque(), 0]
            lane[0].append((op, nbytes))
            if lane[1] >= self._notify_per_peer:
                return  # a worker of this peer's takes it next
            try:
                self.e._notifier.submit(self._drain_notifications, addr)
            except RuntimeError:
                lane[0].pop()
                if not lane[0] and not lane[1]:
                    del self._notify_lanes[addr]
                raise
            lane[1] += 1

    def _drain_notifications(self, addr: str) -> None:
        """Notify worker: send ``addr``'s waiting notifications in order until none is left."""
        while True:
            with self._notify_lock:
                lane = self._notify_lanes[addr]
                if not lane[0]:
                    lane[1] -= 1
                    if not lane[1]:
                        del self._notify_lanes[addr]
                    return
                op, nbytes = lane[0].popleft()
            self._notify_then_finish(op, nbytes)

    def _notify_then_finish(self, op: Operation, nbytes: int) -> None:
        error: BaseException | None = None
        try:
            self.e._send_notify(op.remote, op._notify, max(op.time_left(), 0.001))
        except BaseException as exc:  # noqa: BLE001
            error = exc if isinstance(exc, MpcommError) else MpcommError(f"after the data landed: {exc}")
            if self.e._closed and not isinstance(error, EngineClosedError):
                cause, error = error, EngineClosedError("the engine was closed before the target took the "
                                                        "notification (the data had landed)")
                error.__cause__ = cause
        self._finish(op, error, nbytes)

    def _group_reported(self, group: OperationGroup) -> None:
        if group.errors:
            first = group.errors[min(group.errors)]
            if self._retry(group, first):
                return
        else:
            self._succeeded(group)
        self._finish(group, None, 0)

    def _succeeded(self, unit: Any) -> None:
        health = self.e.health
        if health.any_failures() and unit.transport is not None:
            unit._probe = None  # the success report ends the probe
            health.success(unit.remote.address, unit.transport.name)

    def _end_probe(self, unit: Any) -> None:
        """Free the probe slot ``unit`` holds, if any, with no verdict on the path.

        Every ending that is not a success or a counted failure comes here
        (deadline, cancel, close, the request's own error, a unit that fails
        before it is posted): a slot left taken refuses the path for good.
        """
        name = getattr(unit, "_probe", None)
        if name is not None:
            unit._probe = None
            self.e.health.release_probe(unit.remote.address, name)

    def _release(self, unit: Any) -> None:
        dl = unit._dl
        if dl is not None:
            self.e._timer.cancel(dl)
        self._end_probe(unit)
        if unit._tracked:
            with self._inflight_lock:
                self._inflight.discard(unit)
        if not unit._released:
            unit._released = True
            self._unhold(unit)
            t = unit.transfer if unit._batch is None and isinstance(unit, Operation) else None
            if t is not None and t._op is unit:
                # Break handle <-> operation: a finished request's buffer is freed when the
                # engine and the caller drop it, not at the next cyclic GC (8 MiB requests
                # piled up to GiBs between collections). The handle keeps what `request` needs.
                t._request_args = (unit.kind, unit.local, unit.remote, unit.remote_offset, unit.length,
                                   unit.local_offset)
                t._op = None
            if unit._ephemeral:
                local = unit.local
                if unit._batch is None or all(p.local is not local or p.done for _, p in unit._batch._parts):
                    self.e._regions.unregister_from(local, self.e._transports)
                    release_view(local)
        t = unit.transport
        if t is None:
            return
        if self._backlog.get(t.name):
            try:
                self.e._executor.submit(self._drain_backlog, t.name)
            except RuntimeError:
                pass

    def _finish(self, unit: Any, error: BaseException | None, nbytes: int, failed_group: bool = False) -> None:
        """Release what the unit held, then publish its outcome."""
        unit._stage = FINISHED
        if failed_group and isinstance(unit, OperationGroup) and not unit.done:
            unit._sink = None  # we publish here, not through the sink
            unit.fail(error)  # type: ignore[arg-type]
        if failed_group and isinstance(unit, Operation) and not unit.done:
            unit._sink = None
            unit.fail(error)  # type: ignore[arg-type]
            if unit.abort_exc is not None and error is not unit.abort_exc:
                error = unit.abort_exc
        self._release(unit)
        batch = unit._batch
        if batch is None:
            t = unit.transfer
            if not t._record(error, nbytes):
                return  # resolved already (an unconfirmed timeout): the resources are free now
            self._push(unit)
            return
        if isinstance(unit, Operation):
            unit.transfer._record(error, nbytes)
            unit.transfer._dispatch.push(unit.transfer)
        with batch._lock:
            batch._left -= 1
            last = batch._left == 0
        if last:
            self._batch_done(batch)

    def _push(self, op: Operation) -> None:
        with op._lock:
            if op._posting or op._handed:
                return  # the posting thread settles it when post() returns
            op._handed = True
        t = op.transfer
        if t._dispatch is self.dispatch and t._leave_to_waiter():
            return  # the thread blocked in result() settles it: no completion-thread hop
        t._dispatch.push(t)

    def _batch_done(self, batch: Batch) -> None:
        total = 0
        clean = True
        for _, part in batch._parts:
            if isinstance(part, OperationGroup):
                if part.errors:
                    clean = False
                    break
                total += part.total_bytes
            else:
                clean = False
                break
        if clean:
            error = None
        else:
            _statuses, errors, lengths = batch._index_state()
            error = errors[min(errors)] if errors else None
            total = sum(lengths)
        if any(isinstance(p, OperationGroup) and p.member_handles for _, p in batch._parts):
            # Per-request handles exist (batch.transfers): their callbacks run on the completion thread.
            batch._on_settled = _settle_members
        if not batch._record(error, total):
            return
        with batch._lock:
            if batch._posting or batch.__dict__.get("_handed", False):
                return
            batch._handed = True
        if batch._dispatch is self.dispatch and batch._leave_to_waiter():
            return  # the thread blocked in result() settles it: no completion-thread hop
        batch._dispatch.push(batch)

    def _deliver_inline(self, handle: Transfer, settle: Any) -> None:
        """A handle that finished on the posting thread: settle it here (no hop), or, when it was
        posted with a completion queue, hand it to that queue: its poller settles and reaps it."""
        if handle._dispatch is self.dispatch:
            settle()
        else:
            handle._dispatch.push(handle)

    def _settle_batch_inline(self, batch: Batch) -> None:
        batch._settle()
        _settle_members(batch)
        batch._run_callbacks()

    # -- cancel and close ------------------------------------------------------------------

    def cancel(self, transfer: Transfer) -> None:
        """Non-blocking cancel of ``transfer`` (the handle's ``_Dispatch.cancel``)."""
        group = getattr(transfer, "_group", None)
        if group is not None:
            self._cancel_member(transfer, group, transfer._index)  # type: ignore[attr-defined]
            return
        if isinstance(transfer, Batch):
            units = [p for _, p in transfer._parts]
        else:
            units = [transfer._op]
        for unit in units:
            if unit is None or unit.done:
                continue
            if self._claim(unit, WAITING, FINISHED):
                self._finish(unit, CancelledError(), 0, failed_group=True)
                continue
            t = unit.transport
            if t is not None and t.capabilities.inflight_cancel:
                unit.abort(CancelledError())

    def _cancel_member(self, member: Transfer, group: OperationGroup, i: int) -> None:
        """Cancel request ``i`` of a group not posted yet: it will move nothing (length 0)."""
        with group._lock:
            if group._stage != WAITING or group.status[i] != 0:
                return
            group.lengths[i] = 0
            group.status[i] = 2
            err = CancelledError()
            group.errors[i] = err
            group._left -= 1
            last = group._left == 0
        if last:
            if self._claim(group, WAITING, FINISHED):
                self._finish(group, err, 0)
        if member._record(err, 0):
            member._dispatch.push(member)

    def units(self) -> list[Any]:
        with self._inflight_lock:
            return list(self._inflight)

    def abort_peer(self, address: str, error: BaseException) -> None:
        for unit in self.units():
            if unit.remote.address == address:
                if self._claim(unit, WAITING, FINISHED):
                    self._finish(unit, error, 0, failed_group=True)
                else:
                    unit.abort(error)

    def close(self, timeout: float) -> None:
        """Resolve every handle: waiting units fail at once, posted ones are aborted and waited for."""
        closed = EngineClosedError("the engine was closed while the request was in flight")
        units = self.units()
        for unit in units:
            if self._claim(unit, WAITING, FINISHED):
                self._finish(unit, EngineClosedError("the engine was closed before the request was posted"), 0,
                             failed_group=True)
            else:
                unit.abort(closed)
        deadline = time.monotonic() + timeout
        for unit in units:
            while not unit.done and time.monotonic() < deadline:
                time.sleep(0.002)

    def resolve_leftovers(self) -> list[Any]:
        """After the transports closed: fail what is still unfinished (nothing can land any more)."""
        left = [u for u in self.units() if not u.done]
        for unit in left:
            unit.fail(EngineClosedError("the engine was closed; the transport did not confirm the request "
                                        "stopped before it was shut down"))
        return left


_NONE = object()


class _GroupSpec:
    """One vectorised part of a plan: checked once, made into an OperationGroup per posting."""

    __slots__ = ("kind", "local", "remote", "local_offsets", "remote_offsets", "lengths", "timeout", "ephemeral",
                 "start", "hint")

    def __init__(self, kind: str, local: Region, remote: RemoteRegion, local_offsets: Any, remote_offsets: Any,
                 lengths: Any, timeout: float, ephemeral: bool, start: int) -> None:
        self.kind = kind
        self.local = local
        self.remote = remote
        self.local_offsets = local_offsets
        self.remote_offsets = remote_offsets
        self.lengths = lengths
        self.timeout = timeout
        self.ephemeral = ephemeral
        self.start = start
        self.hint: tuple[str, ...] | None = None


class _Plan:
    """Checked, grouped requests: what submit() posts once and a PreparedBatch posts many times."""

    def __init__(self, requests: Sequence[Request] | None) -> None:
        self.requests = requests
        self.count = len(requests) if requests is not None else 0
        self.groups: list[_GroupSpec] = []
        self.singles: list[tuple[int, Request, Region, int, int, int, float, bool, Any]] = []
        self.locals: dict[int, tuple[Region, bool]] = {}


class PreparedBatch:
    """Requests checked and grouped once, posted as often as needed (``Engine.prepare``).

    The model is NIXL's ``initialize_xfer`` + ``transfer`` or a re-posted
    work-request list: each :meth:`post` returns a new :class:`~mpcomm.Batch`
    and costs one group per (local region, remote region) pair, with no
    per-request Python work. The regions must stay registered; a descriptor
    of a restarted peer fails the posting with StaleRegionError as usual.
    """

    def __init__(self, pipeline: Pipeline, plan: _Plan) -> None:
        self._pipeline = pipeline
        self._plan = plan
        #: Number of requests each posting carries.
        self.count = plan.count

    def __repr__(self) -> str:
        return f"<PreparedBatch x{self.count} in {len(self._plan.groups)} group(s)>"

    def post(self, *, completion_queue: Any = None) -> Batch:
        """Post every request once more; returns the new handle at once."""
        p = self._pipeline
        if p.e._closed:
            raise EngineClosedError("the engine is closed")
        return p._start_plan(self._plan, completion_queue, True)


class _Striped:
    """The ``transport`` of a split request: stands for its stripes' transports
    (an abort reaches every stripe; in-flight cancel only if all of them can)."""

    post_may_block = False

    def __init__(self, pipeline: Pipeline, subs: list[Operation]) -> None:
        from ..transport import Capabilities

        self._p = pipeline
        self._subs = subs
        ts = {s.transport.name: s.transport for s in subs}
        self.name = "+".join(ts)
        self.capabilities = Capabilities(inflight_cancel=all(t.capabilities.inflight_cancel for t in ts.values()))

    def abort(self, op: Operation) -> None:
        exc = op.abort_exc
        for sub in self._subs:
            if self._p._claim(sub, WAITING, FINISHED):  # waiting in a busy transport's backlog
                sub.abort_exc = exc  # not retried
                sub.fail(exc)  # type: ignore[arg-type]
            else:
                sub.abort(exc)  # type: ignore[arg-type]


def _runs(idx: list[int]) -> list[tuple[int, int]]:
    """Positions [start, stop) of ``idx`` where the request indices are consecutive."""
    out = []
    start = 0
    for k in range(1, len(idx)):
        if idx[k] != idx[k - 1] + 1:
            out.append((start, k))
            start = k
    out.append((start, len(idx)))
    return out


def _settle_members(batch: Batch) -> None:
    for _, part in batch._parts:
        if isinstance(part, OperationGroup):
            _resolve_members(part)
