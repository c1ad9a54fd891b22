"""Admission: a request's arguments checked, made into a unit, its lease and queue slot taken."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from ..errors import (BackPressureError, EngineClosedError, MpcommError, OutOfBoundsError, PermissionDeniedError,
                      RegionClosedError)
from ..memory import Region, region_of
from ..remote import RemoteRegion
from ..transfer import Batch, Request, Transfer, Dispatch
from ..transport import Operation, OperationGroup
from . import checks
from .completions import CompletionQueue
from .units import Op


class Admission:
    """The :class:`~mpcomm.engine.requests.Pipeline`'s admission (a mixin: its state lives on the Pipeline)."""

    def check_open(self) -> None:
        """EngineClosedError once the engine is closed (every batch entry and posting asks)."""
        if self.closed:
            raise EngineClosedError("the engine is closed")

    def _dispatch_for(self, cq: Any) -> Dispatch:
        if cq is None:
            return self.dispatch
        if not isinstance(cq, CompletionQueue):
            raise MpcommError(f"completion_queue must come from Engine.completion_queue(), not {cq!r}")
        # Kept on the queue itself (one per engine that posts to it): no table here to outlive it.
        per_engine = cq.__dict__.setdefault("dispatch", {})
        d = per_engine.get(id(self))
        if d is None:
            d = per_engine[id(self)] = Dispatch(cq.push, cq.on_thread, self.cancel, undriven=True)  # reaped by poll()
        return d

    def _local(self, buf: Any, name: str) -> tuple[Region, bool]:
        if isinstance(buf, Region):
            if buf.closed:
                raise RegionClosedError(f"region {buf.name!r} is unregistered", region=buf.name)
            return buf, False
        return region_of(buf, name=name), True  # host buffer, DLPack / CUDA array, DeviceBuffer

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
        if kind not in ("write", "read"):
            raise MpcommError(f"request op must be 'write' or 'read', not {kind!r}", request=request)
        if kind == "read" and "w" not in local.access:
            raise PermissionDeniedError(f"local buffer {local.name!r} is read-only; it cannot receive a read",
                                        region=local.name, request=request)
        if ("w" if kind == "write" else "r") not in remote.access:
            what = "is read-only" if kind == "write" else "may not be read"
            raise PermissionDeniedError(f"remote region {remote.name!r} {what}", region=remote.name,
                                        peer=remote.address, request=request)

    def new_op(self, kind: str, local: Region, lo: int, remote: RemoteRegion, ro: int, length: int,
            timeout: float, dispatch: Dispatch, request: Request | None = None, cls: type[Op] = Op) -> Operation:
        now = time.monotonic()
        op = cls(kind, local, lo, remote, ro, length, now + timeout, time.time() + timeout, None, self._reported)
        t = Transfer(request, _dispatch=dispatch)
        t.operation = op
        op.transfer = t
        return op

    def _check_group(self, g: OperationGroup, start: int = 0, requests: Sequence[Request] | None = None) -> None:
        """Bounds of every entry of ``g`` (entry ``i`` is request ``start + i`` of ``requests``)."""
        lo, ro, ln, local, remote = g.local_offsets, g.remote_offsets, g.lengths, g.local, g.remote
        i = checks.first_bad(lo, ro, ln, local.size, remote.size)
        if i < 0:
            return
        try:  # the error path only: name the first bad index
            checks.check_span(local.name, local.size, remote.name, remote.size, remote.address, lo[i], ro[i], ln[i])
        except OutOfBoundsError as exc:
            k = start + i
            raise OutOfBoundsError(f"request {k} of the batch: {exc}; nothing was transferred",
                                   region=exc.region, peer=exc.peer,
                                   request=requests[k] if requests is not None else None) from None

    def _adopt(self, group: OperationGroup, batch: Batch, start: int, ephemeral: bool, hint: Any) -> None:
        group.transfer = group.batch = batch
        group.first_index = start
        group.ephemeral = ephemeral
        group.route_hint = hint
        batch.parts.append((start, group))
        batch.operation = group if not batch.operation else batch.operation

    def _hold(self, unit: Any) -> None:
        """Lease the local region and take a queue_depth slot; raise (holding nothing) if either fails."""
        unit.local.acquire()
        ok = self.slots.try_acquire() if self._raise_on_full else self.slots.acquire(unit.deadline)
        if not ok:
            unit.local.release()
            raise BackPressureError(f"{self.slots.capacity} requests already in flight (runtime.queue_depth)",
                                    request=unit.transfer.request)
        unit.holds_slot = True

    def _unhold(self, unit: Any) -> None:
        if unit.holds_slot:
            unit.holds_slot = False
            self.slots.release()
        unit.local.release()
