"""Stripes: a request split (a rule's ``split_min``) into parallel stripe Operations, one per transport."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..routing import Route
from ..transport import Capabilities, Operation, Transport
from .units import FINISHED, POSTED, WAITING

if TYPE_CHECKING:
    from ..control import PeerLink
    from .requests import Pipeline


class Striped:
    """The ``transport`` of a split request: stands for its stripes' transports (its post() posts
    each stripe on its own transport; an abort reaches every stripe; in-flight cancel only if all
    of them can)."""

    #: Its stripes' transports may wait on the peer in post(): the split request is tracked (so its
    #: release lets go of it) and its deadline armed before they are posted.
    post_may_block = True

    def __init__(self, pipeline: Pipeline, subs: list[Operation]) -> None:
        self._p = pipeline
        self._subs = subs
        ts = {s.transport.name: s.transport for s in subs}
        self.name = "+".join(ts)
        self.capabilities = Capabilities(inflight_cancel=all(t.capabilities.inflight_cancel for t in ts.values()))

    @staticmethod
    def carries_notification(op: Operation) -> bool:
        return False  # a split write's note is sent once every stripe landed

    def post(self, op: Operation) -> None:
        for sub in self._subs:
            if op.abort_exc is not None:  # aborted before it was posted
                sub.abort_exc = op.abort_exc  # not retried
                sub.fail(op.abort_exc)
                continue
            self._p.repost(sub, sub.transport)

    def abort(self, op: Operation) -> None:
        exc = op.abort_exc
        for sub in self._subs:
            if self._p.claim(sub, WAITING, FINISHED):  # waiting in a busy transport's backlog
                sub.abort_exc = exc  # not retried
                sub.fail(exc)  # type: ignore[arg-type]
            else:
                sub.abort(exc)  # type: ignore[arg-type]


class Stripes:
    """The :class:`~mpcomm.engine.requests.Pipeline`'s stripes (a mixin: its state lives on the Pipeline)."""

    def _post_split(self, op: Operation, link: PeerLink, cands: tuple[Transport, ...], rule: str,
                    names: tuple[str, ...], inline: bool) -> bool:
        """Post ``op`` as stripes when a rule's ``split_min`` splits it (False: it is not split)."""
        q = self._query(link, op)
        plan = None if q.hint else self.e.route_policy.split(q, Route(tuple(t.name for t in cands), rule))
        if plan is None:
            return False
        self._end_probe(op)  # the stripes carry it: each is admitted (and probes) on its own
        subs: list[Operation] = []
        try:
            for s in plan.stripes:
                first = next((t for t in cands if t.name == s.transport), cands[0])
                own = (first, *(t for t in cands if t is not first))
                sub = Operation(op.kind, op.local, op.local_offset + s.offset, op.remote, op.remote_offset + s.offset,
                                s.length, op.deadline, op.deadline_wall, link.info, sink=self._stripe_reported)
                sub.parent = op
                sub.stage = POSTED
                sub.ephemeral = op.ephemeral
                sub.candidates = own
                sub.transfer = op.transfer
                sub.transport = self._admit(sub, own, 0)
                if self._lazy or op.ephemeral:
                    self.regions.ensure_registered(op.local, sub.transport)
                subs.append(sub)
        except BaseException as exc:  # noqa: BLE001 - nothing posted yet
            self._fail_unposted(op, exc, inline)
            return True
        op.stripe_ops = subs
        op.stripes_left = len(subs)
        op.stripe_error = None
        self.hand_routed(op, link, Striped(self, subs), (), rule, names, inline)
        return True

    def _stripe_reported(self, sub: Operation, error: BaseException | None, nbytes: int) -> None:
        if self._retried(sub, error):
            return
        self._end_probe(sub)  # a stripe is never released: its own ending frees its probe
        self._kick_backlog(sub.transport.name)  # a stripe holds no slot: release() would not drain for it
        op = sub.parent
        with op.lock:  # (never held while a stripe reports)
            if error is not None and op.stripe_error is None:
                op.stripe_error = error
            op.stripes_left -= 1
            last = op.stripes_left == 0
        if not last:
            return
        op.transfer.stripes = tuple((s.local_offset - op.local_offset, s.length, s.transport.name)
                                    for s in op.stripe_ops)
        op.transfer.transport = "+".join(dict.fromkeys(s.transport.name for s in op.stripe_ops))
        if op.stripe_error is None:
            op.complete(op.length)
        else:
            op.fail(op.stripe_error)
