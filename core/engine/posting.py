"""Posting: a held unit linked to its peer, routed, admitted on a healthy path and handed to its transport."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from ..errors import MemoryKindUnsupported, MpcommError, PeerConnectionError, StaleRegionError, TransportUnavailable
from ..peer import same_host
from ..routing import RouteQuery
from ..transfer import Batch, TransferStatus
from ..transport import Operation, Transport, TransportBusy
from .units import FINISHED, POSTED, WAITING

if TYPE_CHECKING:
    from ..control import PeerLink

log = logging.getLogger("mpcomm.engine")


class Posting:
    """The :class:`~mpcomm.engine.requests.Pipeline`'s posting (a mixin: its state lives on the Pipeline)."""

    def _post_batch(self, batch: Batch, units: list[Any], staged: bool = False) -> None:
        batch.posting = True
        try:
            for u in units:
                if staged and not self.claim(u, WAITING, WAITING):  # still waiting: _launch claims it
                    continue
                self._launch(u, inline=False)
        finally:
            # Exactly one of this thread and _batch_done hands the batch on.
            if batch.end_posting():
                self._deliver_inline(batch, lambda: self._settle_batch_inline(batch))

    def _launch(self, unit: Any, inline: bool) -> None:
        """Route and post ``unit`` now if its peer is connected, else queue it on that peer.

        ``inline``: the caller is in ``write()``/``read()`` and ``unit`` is its lone request (an
        Operation in no batch), which it may settle, or fail by raising, on its own thread."""
        remote = unit.remote
        link = self.peers.ready(remote.address)
        if link is None:
            self._watch(unit)
            try:
                self.peers.when_ready(remote.address, unit.deadline, lambda lk, err, u=unit: self._connected(u, lk, err))
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

    def claim(self, unit: Any, expect: int, to: int = POSTED) -> bool:
        with unit.lock:
            if unit.stage != expect:
                return False
            unit.stage = to
            return True

    def _post(self, unit: Any, link: PeerLink, inline: bool) -> None:
        if not self.claim(unit, WAITING):
            return  # cancelled, timed out or closed while it waited
        remote = unit.remote
        try:
            if link.info.epoch != remote.epoch:
                raise StaleRegionError(
                    f"{remote.address} restarted since {remote.name!r} was opened; open it again",
                    region=remote.name, peer=remote.address)
            cands, rule, names = self._route(link, unit)
            transport = self._admit(unit, cands, 0)
            if self._lazy or unit.ephemeral:
                self.regions.ensure_registered(unit.local, transport)
        except BaseException as exc:  # noqa: BLE001 - the unit fails with it, nothing moved
            self._fail_unposted(unit, exc, inline)
            return
        if isinstance(unit, Operation) and self.split_rules and self._post_split(unit, link, cands, rule, names, inline):
            return
        self.hand_routed(unit, link, transport, cands, rule, names, inline)

    def hand_routed(self, unit: Any, link: PeerLink, transport: Transport, cands: tuple[Transport, ...], rule: str,
                names: tuple[str, ...], inline: bool) -> None:
        """Hand a routed, claimed unit to ``transport``; settle it here if it finished inside post()."""
        unit.peer = link.info
        unit.transport = transport
        unit.candidates = cands
        unit.posting = inline
        transfer = unit.transfer
        transfer.transport = transport.name
        transfer.route, transfer.route_rule = names, rule
        transfer.status = TransferStatus.POSTED
        if unit.batch is not None:
            unit.batch.status = TransferStatus.POSTED
        if self.e.telemetry.enabled and isinstance(unit, Operation):
            self.e.telemetry.on_post(unit, transport.name)
        if transport.post_may_block:
            # A transport written for the first contract may wait on the peer
            # inside post(): its deadline and close() must be able to interrupt it.
            self._watch(unit)
        for waiting in self._hand_to(transport, unit):
            self._to_backlog(transport, waiting)
        if inline:
            with unit.lock:
                unit.posting = False
                # Exactly one of this thread and _publish hands the handle on.
                mine = transfer.outcome is not None and not unit.handed
                if mine:
                    unit.handed = True
            if mine:
                self._deliver_inline(transfer, transfer.finish_inline)
                return
        if not unit.done:
            # Tracked (for close() and peer loss) only when it outlives post():
            # requests finished inline never touch the table or the timer.
            self._watch(unit)

    def _watch(self, unit: Any) -> None:
        """Track ``unit`` (for close() and peer loss) and arm its deadline, once it may outlive the
        call that made it: waiting for its peer, staged, or pending after post()."""
        if not unit.tracked:
            self._inflight.add(unit)
            unit.tracked = True
        if unit.deadline_entry is None:
            unit.deadline_entry = self.timer.schedule(unit.deadline, lambda u=unit: self._on_deadline(u))
        if unit.done:  # finished meanwhile: _release may have run before either step above
            self.timer.cancel(unit.deadline_entry)
            if unit.released:
                self._inflight.discard(unit)

    def _fail_unposted(self, unit: Any, exc: BaseException, inline: bool) -> None:
        unit.stage = FINISHED
        err = exc if isinstance(exc, MpcommError) else MpcommError(str(exc))
        if inline:
            # The caller is still in write(): raise, holding nothing.
            self._release(unit)
            raise err
        self._finish(unit, err, 0, failed_group=True)

    def _abandon(self, unit: Any, exc: BaseException) -> bool:
        """Finish ``unit`` with ``exc`` if it is still waiting, never posted (connection failed, cancelled,
        closed, deadline): claimed here, so nothing moved. False: someone else moved it on (posted, in flight)."""
        if not self.claim(unit, WAITING, FINISHED):
            return False
        self._finish(unit, exc, 0, failed_group=True)
        return True

    def _route(self, link: PeerLink, unit: Any) -> tuple[tuple[Transport, ...], str, tuple[str, ...]]:
        """The transports that may carry ``unit``, in the route policy's order, and the rule's name.

        Cached per peer epoch, region and memory kind (and per chosen list when
        the rules look at sizes, so the cache stays bounded by the rules).
        """
        remote = unit.remote
        policy = self.e.route_policy
        key: tuple[Any, ...] = (remote.address, remote.epoch, remote.region_id, unit.local.kind, unit.route_hint)
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
        cands, reasons = [], []
        for t in filter(None, map(self.transports.get, route.transports)):
            avail = t.reach(link.info)
            if avail:
                cands.append(t)
            else:
                reasons.append(f"{t.name}: {avail.reason}")
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
            hint=unit.route_hint)

    def _admit(self, unit: Any, cands: tuple[Transport, ...], start: int) -> Transport:
        """The first of ``cands[start:]`` whose path to the peer is not cooling down."""
        health = self.e.health
        if not health.any_failures():
            if start < len(cands):
                unit.attempt = start
                return cands[start]
        else:
            peer = unit.remote.address
            for i in range(start, len(cands)):
                admitted = health.admit(peer, cands[i].name)
                if admitted != "paused":
                    unit.attempt = i
                    # The probe slot this unit holds until it reports (see _end_probe).
                    unit.probe = cands[i].name if admitted == "probe" else None
                    return cands[i]
        state = "quarantined" if self.e.health.quarantined(unit.remote.address) else "cooling down after failures"
        raise PeerConnectionError(f"every path to {unit.remote.address} is {state}; try again later",
                                  peer=unit.remote.address, region=unit.remote.name, retryable=True)

    def _hand_to(self, t: Transport, unit: Any) -> tuple[Any, ...]:
        """Post ``unit`` on ``t``; what a full transport handed back (to queue), else ().

        A refusal (MpcommError) or a plugin bug (anything else, logged) fails
        the unit here: the request fails, never the thread that posted it.
        """
        try:
            if isinstance(unit, Operation):
                if getattr(unit, "notify_after", None) is not None:
                    self._carry_notification(unit, t)
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

    def forget_routes(self, address: str) -> None:
        self.forget_fast()
        for key in [k for k in list(self._routes) if k[0] == address]:
            self._routes.pop(key, None)
