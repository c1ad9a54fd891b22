"""Tracing and metrics through the OpenTelemetry API (never the SDK).

The library only asks the global providers for a tracer and a meter; the
application or the CLI decides where spans and metrics go. With
``observability.trace_transfers`` and ``observability.metrics`` off, the
per-request cost is one attribute check.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .config import Config
    from .transfer import Operation

from . import __version__


class Telemetry:
    def __init__(self, config: Config) -> None:
        self.tracing = config.observability.trace_transfers
        self.metrics = config.observability.metrics
        self.enabled = self.tracing or self.metrics
        self._tracer: Any = None
        if self.tracing:
            from opentelemetry import trace

            self._tracer = trace.get_tracer("mpcomm", __version__)
        if self.metrics:
            from opentelemetry import metrics

            meter = metrics.get_meter("mpcomm", __version__)
            self._bytes = meter.create_counter("mpcomm.transfer.bytes", unit="By", description="bytes moved")
            self._ops = meter.create_counter("mpcomm.transfer.operations", unit="{operation}", description="finished requests")
            self._latency = meter.create_histogram("mpcomm.transfer.duration", unit="s", description="request latency")
            self._inflight = meter.create_up_down_counter("mpcomm.transfer.inflight", unit="{request}", description="requests in flight")
            self._failures = meter.create_counter("mpcomm.transfer.failures", unit="{failure}", description="failed requests by kind")
            self._registrations = meter.create_up_down_counter("mpcomm.regions", unit="{region}", description="registered regions")

    def on_post(self, op: Operation, transport: str) -> None:
        if self._tracer is not None:
            span = self._tracer.start_span(f"mpcomm.{op.kind}")
            if span.is_recording():
                span.set_attributes({
                    "mpcomm.transport": transport,
                    "mpcomm.direction": op.kind,
                    "mpcomm.size": op.length,
                    "mpcomm.peer": op.remote.address,
                    "mpcomm.region": op.remote.name,
                    "mpcomm.route": f"{transport}:{op.remote.address}",
                })
            op._span = span  # type: ignore[attr-defined]
        if self.metrics:
            self._inflight.add(1, {"transport": transport, "direction": op.kind})
        op._t0 = time.perf_counter()  # type: ignore[attr-defined]

    def on_finish(self, op: Operation, transport: str, error: BaseException | None) -> None:
        outcome = "ok" if error is None else getattr(error, "code", type(error).__name__)
        if self._tracer is not None:
            span = getattr(op, "_span", None)
            if span is not None:
                from opentelemetry.trace import Status, StatusCode

                span.set_attribute("mpcomm.outcome", outcome)
                if error is not None:
                    span.record_exception(error)
                    span.set_status(Status(StatusCode.ERROR, str(error)))
                span.end()
        if self.metrics:
            attrs = {"transport": transport, "direction": op.kind}
            self._inflight.add(-1, attrs)
            self._ops.add(1, {**attrs, "outcome": outcome})
            if error is None:
                self._bytes.add(op.length, attrs)
                self._latency.record(time.perf_counter() - getattr(op, "_t0", time.perf_counter()), attrs)
            else:
                self._failures.add(1, {**attrs, "kind": outcome})

    def on_register(self, delta: int) -> None:
        if self.metrics:
            self._registrations.add(delta)
