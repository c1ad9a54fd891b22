"""Timeouts: a unit's deadline armed on the engine's timer, its abort, and the grace after which it is resolved."""

from __future__ import annotations

import logging
import time
from typing import Any

from ..errors import TransferTimeout
from ..transport import Operation, timeout_error

log = logging.getLogger("mpcomm.engine")


class Timeouts:
    """The :class:`~mpcomm.engine.requests.Pipeline`'s timeouts (a mixin: its state lives on the Pipeline)."""

    def _on_deadline(self, unit: Any) -> None:
        if unit.done:
            return
        err = timeout_error(unit)
        if self._abandon(unit, err):  # never posted: nothing moved
            return
        unit.abort(err)
        self.timer.schedule(time.monotonic() + self._grace, lambda: self._on_abort_overdue(unit))

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
        self._end_probe(unit)  # resolved by its deadline: the transport's late report says nothing
        if isinstance(unit, Operation):
            self._publish(unit, err, 0)
        else:
            # As for an Operation: the handle fails now with the unconfirmed error, while
            # the group keeps its lease and slot until the transport reports (failing the
            # group here released them with bytes still able to land, and replaced the
            # error with the abort's confirmed-looking timeout).
            self._hand_batch(unit.batch, err, 0)
