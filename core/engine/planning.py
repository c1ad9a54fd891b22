"""Planning: many requests checked and grouped once (``submit``, ``prepare``, ``write_many``) into vectorised parts."""

from __future__ import annotations

import time
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..errors import EngineClosedError, MpcommError, RegionClosedError
from ..memory import Region
from ..remote import RemoteRegion
from ..transfer import Batch, Request
from ..transport import OperationGroup, int64_array
from . import checks, fastlane
from .notify import MAX_NOTIFY
from .units import BatchOp

if TYPE_CHECKING:
    from .requests import Pipeline


_NONE = object()


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

    @property
    def count(self) -> int:
        return len(self.lengths)


class Plan:
    """Checked, grouped requests: what submit() posts once and a PreparedBatch posts many times."""

    def __init__(self, requests: Sequence[Request] | None) -> None:
        self.requests = requests
        self.count = len(requests) if requests is not None else 0
        self.groups: list[GroupSpec] = []
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

    def __init__(self, pipeline: Pipeline, plan: Plan) -> None:
        self._pipeline = pipeline
        self._plan = plan
        #: Number of requests each posting carries.
        self.count = plan.count

    def __repr__(self) -> str:
        return f"<PreparedBatch x{self.count} in {len(self._plan.groups)} group(s)>"

    def post(self, *, completion_queue: Any = None) -> Batch:
        """Post every request once more; returns the new handle at once."""
        p = self._pipeline
        if p.closed:
            raise EngineClosedError("the engine is closed")
        return p._start_plan(self._plan, completion_queue, True)


_ZERO = array("q", (0,))
#: _fastlane.c's scan (None: not tried yet, False: that module is not in use).
_scan: Any = None


def _one_group(requests: Sequence[Request]) -> tuple[Any, Any, Any] | None:
    """The engine's (local offsets, remote offsets, lengths) arrays of a batch that is one
    group, filled by ``_fastlane.c``'s scan in one pass over the requests' slots, or None:
    the loop of :meth:`Planning._plan` plans it (or the module is not in use)."""
    global _scan
    scan = _scan
    if scan is None:
        scan = _scan = fastlane.native("scan")
    n = len(requests)
    if not scan or not n:
        return None
    lo, ro, ln = _ZERO * n, _ZERO * n, _ZERO * n
    if scan(requests, Request, Request.FIELDS, lo, ro, ln) != n:  # type: ignore[attr-defined]
        return None
    return lo, ro, ln


def runs(idx: list[int]) -> list[tuple[int, int]]:
    """Positions [start, stop) of ``idx`` where the request indices are consecutive."""
    if idx[-1] - idx[0] == len(idx) - 1:  # increasing indices: consecutive all through
        return [(0, len(idx))]
    out = []
    start = 0
    for k in range(1, len(idx)):
        if idx[k] != idx[k - 1] + 1:
            out.append((start, k))
            start = k
    out.append((start, len(idx)))
    return out


class Planning:
    """The :class:`~mpcomm.engine.requests.Pipeline`'s planning (a mixin: its state lives on the Pipeline)."""

    def vector(self, kind: str, buf: Any, remote: RemoteRegion, local_offsets: Any, remote_offsets: Any,
               lengths: Any, timeout: float | None, cq: Any, post: bool = True, route: Any = None) -> Batch:
        """``write_many``/``read_many``: one group, built at once (no plan: the hottest batch path)."""
        if self.closed:
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
        if group.count == 0:  # done at once (and never staged)
            batch.record_outcome(None, 0)
            self._deliver_inline(batch, batch.finish_inline)
            return batch
        self._adopt(group, batch, 0, ephemeral)
        group.route_hint = hint
        return self._launch_batch(batch, [group], post)

    def _plan(self, requests: Sequence[Request], timeout: float | None, route: Any = None) -> Plan:
        """Check and group requests (same kind, local buffer, remote descriptor and timeout).

        Every request is checked before anything is held: access once per group,
        bounds vectorised per group.
        """
        cols = _one_group(requests)
        if cols is not None:
            return self._plan_one(requests, timeout, route, cols)
        plan = Plan(requests)
        groups: dict[tuple[Any, ...], tuple[list[int], list[int], list[int], list[int]]] = {}
        locals_ = plan.locals
        # Consecutive requests usually share local buffer and group: remember the last ones.
        last_obj: Any = _NONE
        last_key: Any = _NONE
        last_local: Any = _NONE
        last_remote: Any = _NONE
        local: Region = None  # type: ignore[assignment]
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
            r = req.route
            if r is None:
                r = route
            hint = None if r is None else self._hint(r, req)
            if req.notify is not None:
                self._check_access(req.op, local, req.remote, req)
                # The offsets are read once: what was checked is what is posted.
                lo, ro = req.local_offset, req.remote_offset
                remote = req.remote
                length = checks.check_span(local.name, local.size, remote.name, remote.size, remote.address, lo, ro,
                                           length, req)
                if len(req.notify) > MAX_NOTIFY:
                    raise MpcommError(f"notification of {len(req.notify)} bytes exceeds {MAX_NOTIFY}", request=req)
                plan.singles.append((i, req, local, lo, ro, length,
                                     self._timeout(req.timeout if req.timeout is not None else timeout),
                                     locals_[id(obj)][1], hint))
                last_key = _NONE
                continue
            op, remote, tmo = req.op, req.remote, req.timeout
            # The same objects as the last request's: the same group, without building its key.
            if (last_key is _NONE or op is not last_key[0] or local is not last_local or remote is not last_remote
                    or tmo is not last_key[3] or hint is not last_key[4]):
                key = (op, id(local), id(remote), tmo, hint)
                g = groups.get(key)
                if g is None:
                    # Access is checked once per group, bounds vectorised per group below.
                    self._check_access(op, local, remote, req)
                    g = groups[key] = ([], [], [], [])
                last_key, last_local, last_remote = key, local, remote
                add_i, add_lo, add_ro, add_ln = g[0].append, g[1].append, g[2].append, g[3].append
            add_i(i)
            add_lo(req.local_offset)
            add_ro(req.remote_offset)
            add_ln(length)
        for key, (idx, lo, ro, ln) in groups.items():
            req = requests[idx[0]]
            local, ephemeral = locals_[id(req.local)]
            t = self._timeout(req.timeout if req.timeout is not None else timeout)
            # A group covers consecutive indices only; runs keep the index mapping exact.
            for s0, s1 in runs(idx):
                whole = s1 - s0 == len(idx)  # the usual case: no slice to copy first
                self._add_spec(plan, key[0], local, req.remote,
                               int64_array(lo if whole else lo[s0:s1], None, "local_offsets"),
                               int64_array(ro if whole else ro[s0:s1], None, "remote_offsets"),
                               int64_array(ln if whole else ln[s0:s1], None, "lengths"), t, ephemeral, idx[s0],
                               key[-1], idx[s0:s1])
        return plan

    def _plan_one(self, requests: Sequence[Request], timeout: float | None, route: Any,
                  cols: tuple[Any, Any, Any]) -> Plan:
        """:meth:`_plan` of a batch the scan found to be one group: the checks the loop makes on a
        group, in its order, on the first request (the others are the same objects)."""
        plan = Plan(requests)
        req = requests[0]
        local, ephemeral = plan.locals[id(req.local)] = self._local(req.local, "ephemeral-0")
        r = req.route
        if r is None:
            r = route
        hint = None if r is None else self._hint(r, req)
        self._check_access(req.op, local, req.remote, req)
        t = self._timeout(req.timeout if req.timeout is not None else timeout)
        lo, ro, ln = cols
        self._add_spec(plan, req.op, local, req.remote, lo, ro, ln, t, ephemeral, 0, hint, None)
        return plan

    def _add_spec(self, plan: Plan, kind: str, local: Region, remote: RemoteRegion, lo: Any, ro: Any, ln: Any,
                  t: float, ephemeral: bool, start: int, hint: Any, index: list[int] | None) -> None:
        """One checked group of ``plan`` (its arrays the engine's own); ``index`` maps its entries
        to request indices for the error message (None: entry ``i`` is request ``i``)."""
        spec = GroupSpec(kind, local, remote, lo, ro, ln, t, ephemeral, start, hint)
        self._check_group(spec, index, plan.requests)  # type: ignore[arg-type]
        plan.groups.append(spec)

    def submit(self, requests: Sequence[Request], timeout: float | None, cq: Any, post: bool,
               route: Any = None) -> Batch:
        """Group the requests into vectorised parts and post (or stage) them."""
        if self.closed:
            raise EngineClosedError("the engine is closed")
        return self._start_plan(self._plan(requests, timeout, route), cq, post)

    def prepare(self, requests: Sequence[Request], timeout: float | None) -> PreparedBatch:
        if self.closed:
            raise EngineClosedError("the engine is closed")
        plan = self._plan(requests, timeout)
        if plan.singles or any(g.ephemeral for g in plan.groups):
            raise MpcommError("prepare() takes requests between registered Regions without notify; "
                              "register the buffers first (or use submit())")
        return PreparedBatch(self, plan)

    def prepare_many(self, kind: str, local: Any, remote: RemoteRegion, local_offsets: Any, remote_offsets: Any,
                     lengths: Any, timeout: float | None) -> PreparedBatch:
        if self.closed:
            raise EngineClosedError("the engine is closed")
        if not isinstance(local, Region):
            raise MpcommError("prepare_many() needs a registered Region as the local buffer")
        region, _ = self._local(local, "")
        self._check_access(kind, region, remote)
        t = self._timeout(timeout)
        ln = int64_array(lengths, None, "lengths")
        spec = GroupSpec(kind, region, remote, int64_array(local_offsets, len(ln), "local_offsets"),
                         int64_array(remote_offsets, len(ln), "remote_offsets"), ln, t, False, 0)
        self._check_group(spec)  # type: ignore[arg-type]
        plan = Plan(None)
        plan.groups.append(spec)
        plan.count = spec.count
        return PreparedBatch(self, plan)

    def _start_plan(self, plan: Plan, cq: Any, post: bool) -> Batch:
        batch = Batch(plan.count, _dispatch=self._dispatch_for(cq))
        batch.requests = plan.requests
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
            g.route_hint = spec.hint
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
        batch.staged = not post
        batch.left = len(units)
        if not units:
            batch.record_outcome(None, 0)
            self._deliver_inline(batch, batch.finish_inline)
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
                self._watch(u)
        return batch

    def post_staged(self, batch: Batch) -> Batch:
        """Post the parts of a ``submit(..., post=False)`` batch that are still waiting."""
        if not getattr(batch, "staged", False):
            return batch
        batch.staged = False
        units = [part for _, part in batch.parts]
        self._post_batch(batch, units, staged=True)
        return batch
