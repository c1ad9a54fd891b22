"""Endings: a transport's report, the release of what a unit held, and the delivery of its outcome."""

from __future__ import annotations

from typing import Any

from ..errors import EngineClosedError
from ..transfer import Batch, Transfer, resolve_members
from ..transport import Operation, OperationGroup
from .regions import release_view
from .units import FINISHED


def settle_members(batch: Batch) -> None:
    for _, part in batch.parts:
        if isinstance(part, OperationGroup):
            resolve_members(part)


class Endings:
    """The :class:`~mpcomm.engine.requests.Pipeline`'s endings (a mixin: its state lives on the Pipeline)."""

    def _reported(self, op: Operation, error: BaseException | None, nbytes: int) -> None:
        """An Operation's sink: the transport's word that it ended."""
        if self._retried(op, error):
            return
        if error is None and op.notify_after is not None and op.notification is None:
            # (A note the transport carried was delivered with the data: nothing is left to send.)
            try:
                self._queue_notification(op, nbytes)
                return
            except RuntimeError:
                error = EngineClosedError("the engine was closed before the notification was sent")
        self._finish(op, error, nbytes)

    def _group_reported(self, group: OperationGroup) -> None:
        if not self._retried(group, group.errors[min(group.errors)] if group.errors else None):
            self._finish(group, None, 0)

    def _release(self, unit: Any) -> None:
        dl = unit.deadline_entry
        if dl is not None:
            self.timer.cancel(dl)
        if getattr(unit, "probe", None) is not None:  # (most hold no probe slot: no call)
            self._end_probe(unit)
        if unit.tracked:
            self._inflight.discard(unit)
        if not unit.released:
            unit.released = True
            self._unhold(unit)
            if isinstance(unit, Operation) and unit.transfer.operation is unit:
                # Break handle <-> operation (a lone request, or one inside a batch): a finished
                # request's buffer is freed when the engine and the caller drop it, not at the next
                # cyclic GC (8 MiB requests piled up to GiBs between collections). The handle keeps
                # what `request` needs.
                unit.transfer.drop_operation()
            if unit.ephemeral:
                local = unit.local
                if unit.batch is None or all(p.local is not local or p.done for _, p in unit.batch.parts):
                    self.regions.unregister_from(local, self.transports)
                    release_view(local)
        t = unit.transport
        if t is not None and self._backlog.get(t.name):  # (checked here: once per request)
            self._kick_backlog(t.name)

    def _finish(self, unit: Any, error: BaseException | None, nbytes: int, failed_group: bool = False) -> None:
        """Release what the unit held, then publish its outcome."""
        unit.stage = FINISHED
        if failed_group and not unit.done:
            unit.sink = None  # we publish here, not through the sink
            unit.fail(error)  # type: ignore[arg-type]
            if isinstance(unit, Operation) and unit.abort_exc is not None and error is not unit.abort_exc:
                error = unit.abort_exc
        self._release(unit)
        batch = unit.batch
        if batch is None:
            self._publish(unit, error, nbytes)
            return
        if isinstance(unit, Operation):
            unit.transfer.record_outcome(error, nbytes)
            unit.transfer.dispatch.push(unit.transfer)
        if batch.part_ended():
            self._batch_done(batch)

    def _publish(self, op: Operation, error: BaseException | None, nbytes: int) -> None:
        """Record a lone request's outcome (unless one is recorded already) and hand it on: to the
        completion thread, unless the posting thread or a ``result()`` waiter settles it."""
        t = op.transfer
        if t.dispatch is self.dispatch:
            # Recorded, and whether a result() waiter settles it, under one hold of its lock.
            left = t.record_outcome_for_waiter(error, nbytes)
        else:
            left = False if t.record_outcome(error, nbytes) else None  # a completion queue's poller settles it
        if left is None:
            return  # resolved already (an unconfirmed timeout): the resources are free now
        with op.lock:
            if op.posting or op.handed:
                return  # the posting thread settles it when post() returns
            op.handed = True
        if not left:  # (left: the thread blocked in result() settles it: no completion-thread hop)
            t.dispatch.push(t)

    def _batch_done(self, batch: Batch) -> None:
        error, total = None, 0
        for _, part in batch.parts:
            if not isinstance(part, OperationGroup) or part.errors:
                _statuses, errors, lengths = batch.index_state()
                error = errors[min(errors)] if errors else None
                total = sum(lengths)
                break
            total += part.total_bytes
        if any(isinstance(p, OperationGroup) and p.member_handles for _, p in batch.parts):
            # Per-request handles exist (batch.transfers): their callbacks run on the completion thread.
            batch.on_settled = settle_members
        self._hand_batch(batch, error, total)

    def _hand_batch(self, batch: Batch, error: BaseException | None, nbytes: int) -> None:
        """Record ``batch``'s outcome and hand it on, once: to a ``result()`` waiter, else to its dispatch."""
        if batch.record_outcome(error, nbytes) and batch.take_handover():
            if batch.dispatch is self.dispatch and batch.leave_to_waiter():
                return  # the thread blocked in result() settles it: no completion-thread hop
            batch.dispatch.push(batch)

    def _deliver_inline(self, handle: Transfer, settle: Any) -> None:
        """A handle that finished on the posting thread: settle it here (no hop), or, when it was
        posted with a completion queue, hand it to that queue: its poller settles and reaps it."""
        if handle.dispatch is self.dispatch:
            settle()
        else:
            handle.dispatch.push(handle)

    def _settle_batch_inline(self, batch: Batch) -> None:
        batch.settle()
        settle_members(batch)
        batch.run_callbacks()
