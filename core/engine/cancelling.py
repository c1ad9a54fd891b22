"""Cancelling and closing: a handle's cancel, a lost peer's units aborted, the engine's close."""

from __future__ import annotations

import time
from concurrent.futures import CancelledError
from typing import Any

from ..errors import EngineClosedError
from ..transfer import Batch, Transfer
from ..transport import OperationGroup
from .units import FINISHED, WAITING


class Cancelling:
    """The :class:`~mpcomm.engine.requests.Pipeline`'s cancelling (a mixin: its state lives on the Pipeline)."""

    def cancel(self, transfer: Transfer) -> None:
        """Non-blocking cancel of ``transfer`` (the handle's ``Dispatch.cancel``)."""
        group = getattr(transfer, "group", None)
        if group is not None:
            self._cancel_member(transfer, group, transfer.index)  # type: ignore[attr-defined]
            return
        units = [p for _, p in transfer.parts] if isinstance(transfer, Batch) else [transfer.operation]
        for unit in units:
            if unit is None or unit.done or self._abandon(unit, CancelledError()):
                continue
            t = unit.transport
            if t is not None and t.capabilities.inflight_cancel:
                unit.abort(CancelledError())

    def _cancel_member(self, member: Transfer, group: OperationGroup, i: int) -> None:
        """Cancel request ``i`` of a group not posted yet: it will move nothing (length 0)."""
        with group.lock:
            if group.stage != WAITING or group.status[i] != 0:
                return
            group.drop(i)
            group.status[i] = 2
            err = CancelledError()
            group.errors[i] = err
            group.left -= 1
            last = group.left == 0
        if last and self.claim(group, WAITING, FINISHED):
            self._finish(group, err, 0)
        if member.record_outcome(err, 0):
            member.dispatch.push(member)

    def abort_peer(self, address: str, error: BaseException) -> None:
        for unit in list(self._inflight):  # one C call: a snapshot (see Pipeline._inflight)
            if unit.remote.address == address and not self._abandon(unit, error):
                unit.abort(error)

    def close(self, timeout: float) -> None:
        """Resolve every handle: waiting units fail at once, posted ones are aborted and waited for."""
        closed = EngineClosedError("the engine was closed while the request was in flight")
        units = list(self._inflight)
        for unit in units:
            if not self._abandon(unit, EngineClosedError("the engine was closed before the request was posted")):
                unit.abort(closed)
        deadline = time.monotonic() + timeout
        for unit in units:
            while not unit.done and time.monotonic() < deadline:
                time.sleep(0.002)

    def resolve_leftovers(self) -> list[Any]:
        """After the transports closed: fail what is still unfinished (nothing can land any more)."""
        left = [u for u in list(self._inflight) if not u.done]
        for unit in left:
            unit.fail(EngineClosedError("the engine was closed; the transport did not confirm the request "
                                        "stopped before it was shut down"))
        return left
