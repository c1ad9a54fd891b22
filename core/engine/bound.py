"""Bound pairs: a (local region, remote region, kind) whose routing was decided once, and the per-request checks left."""

from __future__ import annotations

import functools
import logging
import operator
import time
from typing import TYPE_CHECKING, Any

from ..errors import RegionClosedError
from ..memory import Region
from ..remote import RemoteRegion
from ..transfer import LandedOrigin, Transfer, Landed
from ..transport import Operation, Transport
from . import checks, fastlane
from .units import POSTED

if TYPE_CHECKING:
    from ..control import PeerLink
    from .requests import Pipeline

log = logging.getLogger("mpcomm.engine")

FAST_MAX = 256


def leased_call(local: Region, transport: str, fn: Any, *args: Any) -> bool:
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


#: What the C lane reads per request for the engine's state: the pipeline's ``closed``, the flag
#: :func:`plain` reads (set by Engine.close with the engine's own).
PIPELINE_CLOSED = operator.attrgetter("closed")


def move_failed(transport: str, exc: BaseException) -> None:
    log.error("transport %s failed in its inline_path move", transport, exc_info=exc)


def plain(path: Any, lo: int, ro: int, length: int | None, timeout: float | None) -> int | None:
    """What a bound pair (``FastPath``, ``PostPath``) rechecks per request: the length it
    moves, or None for anything unusual (the full path then takes the request and raises
    what it raises). Exact ints in bounds and a timeout the bound lanes take (both by the
    one rule in :mod:`.checks`), a live link, an open engine with no failing path."""
    if type(lo) is not int or type(ro) is not int or (length is not None and type(length) is not int):
        return None
    length = checks.span(lo, ro, length, path.lsize, path.rsize)
    if (length is None or not checks.timeout_ok(timeout)
            or not path.link.alive or path.pipe.closed or path.failing()):
        return None
    return length


class FastPath(LandedOrigin):
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

    __slots__ = ("kind", "local", "remote", "move", "link", "lsize", "rsize", "engine", "pipe", "failing", "table")

    def __init__(self, kind: str, local: Region, remote: RemoteRegion, move: Any, link: PeerLink,
                 transport: str, route: tuple[str, ...], rule: str, pipe: Pipeline) -> None:
        super().__init__(transport, route, rule, pipe.dispatch)
        self.kind, self.local, self.remote, self.move, self.link = kind, local, remote, move, link
        self.lsize, self.rsize = local.size, remote.size
        self.engine, self.pipe, self.failing, self.table = pipe.e, pipe, pipe.e.health.any_failures, pipe.bound

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
        return fastlane.lane(self.local, self.local.lease_list, self.move, self.link, self.pipe, paths, peers, Landed,
                             LandedOrigin(self.transport, self.route, self.rule, self.dispatch), self.kind,
                             self.remote, self.lsize, self.rsize, functools.partial(self.table.pop, key, None),
                             functools.partial(move_failed, self.transport), closed=PIPELINE_CLOSED) or self._run

    def _run(self, lo: int, ro: int, length: int | None, timeout: float | None) -> Transfer | None:
        length = plain(self, lo, ro, length, timeout)
        if length is None:
            return None
        local = self.local
        t0 = time.monotonic()
        try:
            local.acquire()
        except RegionClosedError:
            self.table.pop((id(local), id(self.remote), self.kind), None)
            return None
        try:  # leased_call, inlined
            if not self.move(lo, ro, length):
                return None
        except Exception as exc:  # noqa: BLE001 - a plugin bug declines; the full path reports what post() says
            move_failed(self.transport, exc)
            return None
        finally:
            local.release()
        return Landed(length, self, (self.kind, local, self.remote, ro, length, lo), t0)


class PostPath:
    """One (local region, remote region, kind) whose requests a transport answers later (tcp, rdma).

    The full path's decisions that hold for every request of the pair -- the
    access check, the route and its transport, the peer link -- are made
    once, by the request that bound it (:meth:`BoundPairs._bind_posted`). Per
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
        length = plain(self, lo, ro, length, timeout)
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
        op = pipe.new_op(self.kind, local, lo, self.remote, ro, length,
                      pipe.default_timeout if timeout is None else timeout, pipe.dispatch)
        op.holds_slot = True
        op.stage = POSTED  # nobody else can see it yet: no claim to race
        op.attempt = 0
        pipe.hand_routed(op, self.link, self.transport, self.cands, self.rule, self.names, True)
        return op.transfer


class BoundPairs:
    """The :class:`~mpcomm.engine.requests.Pipeline`'s bound pairs (a mixin: its state lives on the Pipeline)."""

    def policy_ready(self) -> None:
        """The engine's route policy is set: decide once whether the inline lane can ever apply."""
        self._inline_ok = not self._lazy and not self.e.telemetry.enabled and not self._splits()
        if self._inline_ok:
            fastlane.module()  # imported here, not inside the first bound request

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
        link = self.peers.ready(remote.address)
        if link is None or link.info.epoch != remote.epoch or self.e.health.any_failures():
            return None
        try:
            local.acquire()  # released by leased_call
        except RegionClosedError:
            return None
        t0 = time.monotonic()
        if not leased_call(local, transport.name, transport.post_inline, kind, local, lo, remote, ro, length):
            return None
        fast = None
        if declined or (id(local), id(remote), kind) not in self.bound:
            fast = self._bind_fast(kind, local, remote, transport, link, entry)
        origin = fast if fast is not None else LandedOrigin(transport.name, entry[2], entry[1], self.dispatch)
        return Landed(length, origin, (kind, local, remote, ro, length, lo), t0)

    def _bind_fast(self, kind: str, local: Region, remote: RemoteRegion, transport: Transport, link: PeerLink,
                   entry: tuple[tuple[Transport, ...], str, tuple[str, ...]]) -> FastPath | None:
        """After a request of this pair landed inline: keep the transport's bound move for the next ones."""
        try:
            move = transport.inline_path(kind, local, remote)
        except Exception:  # noqa: BLE001 - a plugin bug: the slower lanes still work
            log.exception("transport %s failed in inline_path", transport.name)
            return None
        if move is None:
            return None
        if len(self.bound) >= FAST_MAX:
            self.bound.clear()  # bounded; the pairs in use bind again on their next request
        fast = FastPath(kind, local, remote, move, link, transport.name, entry[2], entry[1], self)
        self.bound[(id(local), id(remote), kind)] = fast.runner()
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
        if (op.route_hint is not None or op.notify_after is not None or op.ephemeral
                or op.transfer.dispatch is not self.dispatch or self.e.route_policy.size_rules
                or type(transport).post_inline is not Transport.post_inline
                or transport.post_may_block or self.e.health.any_failures()):
            return
        key = (id(op.local), id(op.remote), op.kind)
        if key in self.bound:
            return
        if len(self.bound) >= FAST_MAX:
            self.bound.clear()  # bounded; the pairs in use bind again on their next request
        self.bound[key] = PostPath(op.kind, op.local, op.remote, link, transport, cands, rule, names, self).run

    def forget_fast(self) -> None:
        """Drop every bound inline move (routes, health or regions changed): the next request rebinds."""
        self.bound.clear()
