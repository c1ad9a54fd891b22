"""Planning: many requests checked and grouped once (``submit``, ``prepare``, ``write_many``) into vectorised parts."""

from __future__ import annotations

import time
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..errors import MpcommError, OutOfBoundsError
from ..memory import Region
from ..remote import RemoteRegion
from ..transfer import Batch, Request
from ..transport import int64_array
from . import checks, fastlane
from .notify import MAX_NOTIFY
from .units import BatchOp, Group

if TYPE_CHECKING:
    from .requests import Pipeline


@dataclass(slots=True, eq=False)
class GroupSpec:
    """One vectorised part of a plan: checked once, made into an OperationGroup per posting.

    It has what the group check (:meth:`Admission._check_group`) reads: its arrays (the
    engine's own), regions and count; so no OperationGroup is built only to be checked.
    """

    kind: str
    local: Region
    remote: RemoteRegion
    local_offsets: Any
    remote_offsets: Any
    lengths: Any
    timeout: float
    ephemeral: bool
    start: int
    hint: tuple[str, ...] | None = None


class Plan:
    """Checked, grouped requests: what submit() posts once and a PreparedBatch posts many times."""

    def __init__(self, requests: Sequence[Request] | None) -> None:
        self.requests = requests
        self.count = len(requests) if requests is not None else 0
        self.groups: list[GroupSpec] = []
        self.singles: list[tuple[int, Request, Region, int, int, int, float, bool, Any]] = []


class PreparedBatch:
    """Requests checked and grouped once, posted as often as needed (``Engine.prepare``).

    The model is NIXL's ``initialize_xfer`` + ``transfer`` or a re-posted
    work-request list: each :meth:`post` returns a new :class:`~mpcomm.Batch`
    and costs one group per (local region, remote region) pair, with no
    per-request Python work. The regions must stay registered; a descriptor
    of a restarted peer fails the posting with StaleRegionError as usual.
    """

    def __init__(self, pipeline: Pipeline, plan: Plan) -> None:
        self._pipeline = pipeline
        self._plan = plan
        #: Number of requests each posting carries.
        self.count = plan.count

    def __repr__(self) -> str:
        return f"<PreparedBatch x{self.count} in {len(self._plan.groups)} group(s)>"

    def post(self, *, completion_queue: Any = None) -> Batch:
        """Post every request once more; returns the new handle at once."""
        self._pipeline.check_open()
        return self._pipeline._start_plan(self._plan, completion_queue, True)


_ZERO = array("q", (0,))
#: _fastlane.c's scan: the run of a batch's requests from an index on that is one group.
_scan = fastlane.native("scan")


def _same(r: Any, req: Request) -> bool:
    """``r`` is of ``req``'s group: a Request without notify and with its very op, local, remote,
    timeout and route objects (what the scan compares)."""
    return (isinstance(r, Request) and r.notify is None and r.op is req.op and r.local is req.local
            and r.remote is req.remote and r.timeout is req.timeout and r.route is req.route)


class Planning:
    """The :class:`~mpcomm.engine.requests.Pipeline`'s planning (a mixin: its state lives on the Pipeline)."""

    def vector(self, kind: str, buf: Any, remote: RemoteRegion, local_offsets: Any, remote_offsets: Any,
               lengths: Any, timeout: float | None, cq: Any, post: bool = True, route: Any = None) -> Batch:
        """``write_many``/``read_many``: one group, built at once (no plan: the hottest batch path)."""
        self.check_open()
        hint = self._hint(route)
        local, ephemeral = self._local(buf, "ephemeral-batch")
        self._check_access(kind, local, remote)
        t = checks.timeout_seconds(timeout, self.default_timeout)
        now = time.monotonic()
        group = Group(kind, local, remote, local_offsets, remote_offsets, lengths, now + t, time.time() + t,
                      sink=self._group_reported)
        self._check_group(group)
        batch = Batch(group.count, _dispatch=self._dispatch_for(cq))
        if not group.count:
            return self._launch_batch(batch, [], post)
        self._adopt(group, batch, 0, ephemeral, hint)
        return self._launch_batch(batch, [group], post)

    def _plan(self, requests: Sequence[Request], timeout: float | None, route: Any = None) -> Plan:
        """Check the requests and cut them into groups: the maximal runs of consecutive requests
        with the same op, local buffer, remote descriptor, timeout and route, and no notify.

        Every request is checked before anything is held: access, timeout and route once per
        run, bounds vectorised per run (over the engine's arrays the scan filled).
        """
        plan = Plan(requests)
        n = plan.count
        seq = requests if type(requests) is list or type(requests) is tuple else list(requests)
        lo, ro, ln = _ZERO * n, _ZERO * n, _ZERO * n
        locals_: dict[int, tuple[Region, bool]] = {}
        i = 0
        while i < n:
            j = _scan(seq, i, Request, Request.FIELDS, lo, ro, ln)  # [i, j): one group
            req = seq[i]
            if j == i and not isinstance(req, Request):
                raise MpcommError(f"submit() takes Request objects, not {type(req).__name__} (index {i})")
            if id(req.local) not in locals_:  # one region per buffer object, made once
                locals_[id(req.local)] = self._local(req.local, f"ephemeral-{i}")
            local, ephemeral = locals_[id(req.local)]
            remote = req.remote
            hint = self._hint(route if req.route is None else req.route, req)
            self._check_access(req.op, local, remote, req)
            t = checks.timeout_seconds(timeout if req.timeout is None else req.timeout, self.default_timeout)
            if req.notify is not None:  # planned alone, as one request
                # The offsets are read once: what was checked is what is posted.
                a, c = req.local_offset, req.remote_offset
                k = checks.check_span(local.name, local.size, remote.name, remote.size, remote.address, a, c,
                                      req.length, req)
                if len(req.notify) > MAX_NOTIFY:
                    raise MpcommError(f"notification of {len(req.notify)} bytes exceeds {MAX_NOTIFY}", request=req)
                plan.singles.append((i, req, local, a, c, k, t, ephemeral, hint))
                i += 1
                continue
            if j == i:  # the Python step: a run the scan does not take (numpy integers, a subclass, length None)
                j = i + 1
                while j < n and _same(seq[j], req):
                    j += 1
                for k in range(i, j):
                    r = seq[k]
                    try:
                        a = checks.integer(r.local_offset, "local_offset")
                        length = local.size - a if r.length is None else checks.integer(r.length, "length")
                        lo[k], ro[k], ln[k] = a, checks.integer(r.remote_offset, "remote_offset"), length
                    except (MpcommError, OverflowError) as exc:
                        if k > i:  # a run of its own next: the requests before it are checked first
                            j = k
                            break
                        if isinstance(exc, MpcommError):
                            raise
                        raise OutOfBoundsError(f"request {k} of the batch holds a value outside int64, past the "
                                               "end of any region; nothing was transferred", request=r) from None
            whole = j - i == n  # the usual case: no slice to copy
            spec = GroupSpec(req.op, local, remote, lo if whole else lo[i:j], ro if whole else ro[i:j],
                             ln if whole else ln[i:j], t, ephemeral, i, hint)
            self._check_group(spec, i, seq)  # type: ignore[arg-type]
            plan.groups.append(spec)
            i = j
        return plan

    def submit(self, requests: Sequence[Request], timeout: float | None, cq: Any, post: bool,
               route: Any = None) -> Batch:
        """Group the requests into vectorised parts and post (or stage) them."""
        self.check_open()
        return self._start_plan(self._plan(requests, timeout, route), cq, post)

    def prepare(self, requests: Sequence[Request], timeout: float | None) -> PreparedBatch:
        self.check_open()
        plan = self._plan(requests, timeout)
        if plan.singles or any(g.ephemeral for g in plan.groups):
            raise MpcommError("prepare() takes requests between registered Regions without notify; "
                              "register the buffers first (or use submit())")
        return PreparedBatch(self, plan)

    def prepare_many(self, kind: str, local: Any, remote: RemoteRegion, local_offsets: Any, remote_offsets: Any,
                     lengths: Any, timeout: float | None) -> PreparedBatch:
        self.check_open()
        if not isinstance(local, Region):
            raise MpcommError("prepare_many() needs a registered Region as the local buffer")
        region, _ = self._local(local, "")
        self._check_access(kind, region, remote)
        t = checks.timeout_seconds(timeout, self.default_timeout)
        ln = int64_array(lengths, None, "lengths")
        spec = GroupSpec(kind, region, remote, int64_array(local_offsets, len(ln), "local_offsets"),
                         int64_array(remote_offsets, len(ln), "remote_offsets"), ln, t, False, 0)
        self._check_group(spec)  # type: ignore[arg-type]
        plan = Plan(None)
        plan.groups.append(spec)
        plan.count = len(ln)
        return PreparedBatch(self, plan)

    def _start_plan(self, plan: Plan, cq: Any, post: bool) -> Batch:
        batch = Batch(plan.count, _dispatch=self._dispatch_for(cq))
        batch.requests = plan.requests
        units: list[Any] = []
        now = time.monotonic()
        wall = time.time()
        for spec in plan.groups:
            local, _ = self._local(spec.local, "")  # refused once unregistered
            # The plan's arrays are the engine's own copies, checked once (prepare/submit): no copy per post.
            g = Group(spec.kind, local, spec.remote, spec.local_offsets, spec.remote_offsets, spec.lengths,
                      now + spec.timeout, wall + spec.timeout, sink=self._group_reported, copy=False)
            self._adopt(g, batch, spec.start, spec.ephemeral, spec.hint)
            units.append(g)
        dispatch = batch.dispatch
        for i, req, local, lo, ro, length, t, ephemeral, hint in plan.singles:
            op = self.new_op(req.op, local, lo, req.remote, ro, length, t, dispatch, req, BatchOp)
            op.notify_after = req.notify
            op.ephemeral = ephemeral
            op.route_hint = hint
            op.batch = batch
            batch.parts.append((i, op))
            units.append(op)
        if plan.singles:
            batch.parts.sort(key=lambda p: p[0])
        return self._launch_batch(batch, units, post)

    def _launch_batch(self, batch: Batch, units: list[Any], post: bool) -> Batch:
        """Hold every unit of ``batch`` (or none), then post or stage them; an empty batch is done."""
        batch.posting = False
        batch.left = len(units)
        if not units:  # done at once (and never staged)
            batch.record_outcome(None, 0)
            self._deliver_inline(batch, batch.finish_inline)
            return batch
        batch.staged = not post
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
                self._watch(u)
        return batch

    def post_staged(self, batch: Batch) -> Batch:
        """Post the parts of a ``submit(..., post=False)`` batch that are still waiting."""
        if batch.staged:
            batch.staged = False
            self._post_batch(batch, [part for _, part in batch.parts], staged=True)
        return batch
