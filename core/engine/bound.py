"""Bound pairs: the one request path's cache of routing decisions per (local region, remote region, kind).

A :class:`Binding` is no lane of its own. :meth:`Pipeline.single` checks every
request the same way (closed, bounds, timeout, access) and then looks up the
pair's binding: the link, the transport, its candidates, the rule and route
names the full routing chose for the pair, and -- where that transport offers
the inline lane (:meth:`Transport.inline_path`) -- its bound ``move``. With a
binding the request skips the route decision: it is moved by that ``move`` on
the caller's thread by the binding's C step (:func:`native_step`: lease, move,
release, in ``_fastlane.c``), or handed to ``hand_routed`` as one Operation
with the cached routing (both in :meth:`BoundPairs._cached`). Anything the
binding does not cover (a dead link, a failing path, a full queue, a closing
region, a declined move) goes on to the full routing, which raises what it
raises.

``Engine.write``/``read`` run a kept pair's C step first; a pair's first
request (and a kept pair's stale move, asked for anew) runs it here.
``MPCOMM_FASTLANE=0`` (read at each binding) keeps every binding off the
inline move: those pairs are posted.
"""

from __future__ import annotations

import functools
import logging
import operator
from typing import TYPE_CHECKING, Any

from ..errors import RegionClosedError
from ..memory import LEASE_SLOTS, LEASE_WAKE, Region
from ..remote import RemoteRegion
from ..transfer import Landed, LandedOrigin, Transfer
from ..transport import Operation, Transport
from . import fastlane
from .units import BoundOp

if TYPE_CHECKING:
    from ..control import PeerLink

log = logging.getLogger("mpcomm.engine")

FAST_MAX = 256

#: What the C step reads per request for the peer: PeerLink.alive (public). (Not the engine's state:
#: Engine.close empties the tables of C steps once it is closed, and Pipeline.single checks it.)
LINK_ALIVE = operator.attrgetter("alive")


def move_failed(transport: str, et: type[BaseException], exc: BaseException, tb: Any) -> None:
    log.error("transport %s failed in its inline_path move", transport, exc_info=(et, exc, tb))


def offers_inline(transport: Transport) -> bool:
    """Whether a binding to ``transport`` takes its inline move: its class implements the inline lane
    (``inline_path``, or ``post_inline`` which the default ``inline_path`` binds), and
    ``MPCOMM_FASTLANE`` is not ``0``."""
    cls = type(transport)
    offered = cls.inline_path is not Transport.inline_path or cls.post_inline is not Transport.post_inline
    return offered and fastlane.inline_enabled()


class Binding:
    """The routing decisions the full path made for one (local region, remote region, kind).

    Made once the route is cached and the peer linked at the descriptor's
    epoch; dropped when a region of the pair is unregistered, the peer
    restarts or is lost, the routes or health change, or the table is full.
    ``move`` is the transport's bound inline move (None: the transport
    answers later, and requests are posted with the cached routing).
    ``landed_max``: the longest request landed here through ``move``; a
    declined request no longer than that suggests the move went stale (a
    transport may shut a move for good) and is asked for anew.
    """

    __slots__ = ("kind", "local", "remote", "link", "transport", "cands", "rule", "names", "move", "origin",
                 "key", "landed_max")

    def __init__(self, kind: str, local: Region, remote: RemoteRegion, link: PeerLink, transport: Transport,
                 cands: tuple[Transport, ...], rule: str, names: tuple[str, ...], move: Any, dispatch: Any) -> None:
        self.kind, self.local, self.remote, self.link = kind, local, remote, link
        self.transport, self.cands, self.rule, self.names, self.move = transport, cands, rule, names, move
        self.origin = LandedOrigin(transport.name, names, rule, dispatch)
        self.key = (id(local), id(remote), kind)
        self.landed_max = 0


def native_step(b: Binding, pipe: Any) -> Any:
    """The binding's inline step in C (engine/_fastlane.c): ``run(lo, ro, length, timeout) -> handle | None``.
    It unbinds the pair (``pipe.unbind``) when the local region refuses leases.

    ``_fastlane.c`` reads and sets no attribute by name: what it reads per
    request is handed to it here, as objects. The local region's lease state
    comes as :data:`mpcomm.memory.LEASE_SLOTS` (slot descriptors, read in C) and ``LEASE_WAKE``,
    the link's liveness as :data:`LINK_ALIVE`, and the handle's five attributes
    as ``Landed.FIELDS`` (its slots' descriptors).

    Nothing this returns is kept on the binding, and the C step holds the
    binding's parts, not the binding: a cycle would keep both regions alive,
    after the tables let go of them, until the garbage collector runs.
    """
    paths, peers = pipe.e.health.failure_tables()
    local = b.local
    return fastlane.mod.lane(local, local.lease_list, LEASE_SLOTS, LEASE_WAKE, b.move, b.link, LINK_ALIVE,
                             paths, peers, Landed, Landed.FIELDS, b.origin, b.kind, b.remote,
                             local.size, b.remote.size, functools.partial(pipe.unbind, b.key),
                             functools.partial(move_failed, b.origin.transport))


class BoundPairs:
    """The :class:`~mpcomm.engine.requests.Pipeline`'s binding cache (a mixin: its state lives on the Pipeline)."""

    def policy_ready(self) -> None:
        """The engine's route policy is set: decide once whether a pair may ever be bound."""
        self.split_rules = any(r.split_min is not None for r in self.e.route_policy.rules)
        self._inline_ok = (not self._lazy and not self.e.telemetry.enabled and not self.split_rules
                           and not self.e.route_policy.size_rules)

    def _cached(self, kind: str, local: Region, remote: RemoteRegion, lo: int, ro: int, n: int,
                timeout: float) -> Transfer | None:
        """A checked, plain request through its pair's binding (made from the route cache if need be).

        None: the full routing takes it (and caches the route its next request binds the pair from).
        """
        b = self.bindings.get((id(local), id(remote), kind))
        if b is None:
            b = self._bind_cached(kind, local, remote)  # an inline binding is kept once it lands
            if b is None:
                return None
        elif not b.link.alive or self._failing():
            return None
        if b.move is None:  # one Operation with the cached routing (None: a closing region, no free slot)
            try:
                local.acquire()
            except RegionClosedError:
                return None
            if not self.slots.try_acquire():
                local.release()  # full: the full path waits for a slot or raises, as configured
                return None
            # Born POSTED (nobody else can see it yet: no claim to race), holding its slot, attempt 0.
            op = self.new_op(kind, local, lo, remote, ro, n, timeout, self.dispatch, None, BoundOp)
            self.hand_routed(op, b.link, b.transport, b.cands, b.rule, b.names, True)
            return op.transfer
        if self.bindings.get(b.key) is b:  # a kept pair: Engine.write/read ran its C step, and it declined
            # A request no longer than one it landed: the move may have gone stale, a fresh one may land it.
            move = self._ask_move(b.transport, kind, local, remote) if n <= b.landed_max else None
            if move is None:
                return None
            b.move = move
        run = native_step(b, self)
        landed = run(lo, ro, n, timeout)
        if landed is not None:
            b.landed_max = max(b.landed_max, n)
            self._keep(b, run)
        return landed

    def _bind_cached(self, kind: str, local: Region, remote: RemoteRegion) -> Binding | None:
        """A binding made from the route cache, when the peer is linked at the descriptor's epoch, or None.

        With the inline lane it is kept once its move has landed a request (:meth:`_keep`); without,
        at once (not for a transport whose post() may wait on the peer).
        """
        entry = self._routes.get((remote.address, remote.epoch, remote.region_id, local.kind, None))
        if entry is None or local.closed:
            return None
        link = self.peers.ready(remote.address)
        if link is None or link.info.epoch != remote.epoch or self.e.health.any_failures():
            return None
        cands, rule, names = entry
        transport = cands[0]
        inline = offers_inline(transport)
        move = self._ask_move(transport, kind, local, remote) if inline else None
        if (inline and move is None) or (not inline and transport.post_may_block):
            return None
        b = Binding(kind, local, remote, link, transport, cands, rule, names, move, self.dispatch)
        if move is None:
            self._keep(b, None)
        return b

    def _keep(self, b: Binding, run: Any) -> None:
        """Keep ``b`` (and its C step ``run``, which Engine.write/read try first; None: a posted binding)."""
        if b.key not in self.bindings and len(self.bindings) >= FAST_MAX:
            self.forget_fast()  # bounded; the pairs in use bind again on their next request
        self.bindings[b.key] = b
        if run is not None:
            self.native[b.key] = run
        if self.closed:  # Engine.close sets closed, then empties the tables: one of the two sees the other
            self.unbind(b.key)

    @staticmethod
    def _ask_move(transport: Transport, kind: str, local: Region, remote: RemoteRegion) -> Any:
        try:
            return transport.inline_path(kind, local, remote)
        except Exception:  # noqa: BLE001 - a plugin bug: the full path still works
            log.exception("transport %s failed in inline_path", transport.name)
            return None

    def unbind(self, key: tuple[int, int, str]) -> None:
        """Drop one pair's binding and C step (its local region refuses leases)."""
        self.bindings.pop(key, None)
        self.native.pop(key, None)

    def forget_fast(self) -> None:
        """Drop every binding and C step (routes, health or regions changed): the next request rebinds."""
        self.bindings.clear()
        self.native.clear()
