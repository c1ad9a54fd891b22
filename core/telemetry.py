"""Tracing and metrics through the OpenTelemetry API (never the SDK).

The library only asks the global providers for a tracer and a meter; the
application or the CLI (``mpcomm --otel console|otlp``) decides where spans
and metrics go. Without an SDK installed every call below is a no-op of the
API. With ``observability.trace_transfers`` and ``observability.metrics``
both off (the default) the engine's per-request cost is one attribute check
(``Telemetry.enabled``): nothing of this module runs.

Spans: one per public operation and per batch, so a console trace stays
readable; what happens to each request is in the metrics.

* ``mpcomm.submit`` (kind CLIENT): one per :meth:`~mpcomm.Engine.submit`
  batch, from its first post to the batch's resolution. Attributes
  ``mpcomm.requests``, ``mpcomm.size`` (bytes requested, all requests),
  ``mpcomm.direction`` (``write``, ``read`` or ``mixed``), ``mpcomm.peer``,
  ``mpcomm.region`` (of the first request), then ``mpcomm.outcome``,
  ``mpcomm.failed`` (requests that did not complete) and ``mpcomm.bytes_moved``.
* :meth:`Telemetry.operation` wraps other public operations (``mpcomm.open``,
  ``mpcomm.connect``...; the engine names them) and the CLI's commands
  (``mpcomm demo``...), with status ERROR and an exception event on failure.

These are emitted whenever the engine's telemetry is on (either switch).
``observability.trace_transfers`` adds a span per *request* for
investigations: ``mpcomm.write`` / ``mpcomm.read``, kind CLIENT, a child of the
batch's span or of the caller's current span, started when the request is
posted and ended when its :class:`~mpcomm.Transfer` is resolved. Attributes:

=========================  ===============================================
``mpcomm.transport``       transport that carried it (``tcp``, ``shm``...)
``mpcomm.route``           ``<transport>-><peer address>``
``mpcomm.direction``       ``write`` or ``read``
``mpcomm.size``            bytes requested
``mpcomm.peer``            peer address; ``mpcomm.peer.node_id`` its id
``mpcomm.region``          remote region name
``mpcomm.outcome``         ``ok``, ``cancelled`` or the error's ``code``
``mpcomm.retries``         retries recorded for the request (see below)
``mpcomm.bytes_moved``     bytes the transport reported
``error.type``             error class, on failures (status ERROR + exception event)
=========================  ===============================================

A retry is an event ``mpcomm.retry`` on the span (``error.type``, attempt).

Metrics (``observability.metrics``), attributes ``mpcomm.transport`` and
``mpcomm.direction`` on every transfer instrument:

==================================  =========  ===================================
``mpcomm.transfer.bytes``           counter    bytes moved by finished requests
``mpcomm.transfer.operations``      counter    finished requests (+ ``mpcomm.outcome``)
``mpcomm.transfer.duration``        histogram  seconds from post to resolution (+ outcome)
``mpcomm.transfer.inflight``        up-down    requests posted and not yet resolved
``mpcomm.transfer.failures``        counter    failed requests by ``error.type`` (the code)
``mpcomm.transfer.retries``         counter    retries by ``error.type``
``mpcomm.regions``                  up-down    regions registered now
``mpcomm.region.registrations``     counter    register/unregister calls (``mpcomm.event``)
==================================  =========  ===================================

Peer health (``observability.metrics``), fed from each engine's
:class:`~mpcomm.health.HealthMetrics` when the SDK collects; attributes
``mpcomm.node_id`` (the engine) and ``mpcomm.peer`` (the peer's address):

==================================  =========  ===================================
``mpcomm.peer.retries``             counter    requests retried on the next transport
``mpcomm.peer.failovers``           counter    retries that moved to another transport
``mpcomm.peer.quarantines``         counter    times the peer was quarantined
``mpcomm.peer.connect_failures``    counter    connection attempts to the peer that failed
``mpcomm.peer.connect_backoffs``    counter    requests failed at once by the connect back-off
``mpcomm.peer.connections``         gauge      live control connections to the peer
``mpcomm.queue.backlog``            gauge      requests waiting for a slot or a busy transport
                                               (``mpcomm.node_id`` only)
==================================  =========  ===================================

An engine's series end when it closes (its counters start again from 0 in a
new engine).

Cost: OpenTelemetry SDK calls cost microseconds each, a lot next to a ~30 us
shared-memory write. So the counters and up-down counters are *observable*
instruments fed from plain per-process tallies (a dict update under a lock),
read only when the SDK collects; a request pays one synchronous SDK call, the
latency histogram. Totals are per process (every engine adds to them).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent.futures import CancelledError
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .config import Config
    from .transfer import Operation, Transfer

from . import __version__

__all__ = ["DURATION_BUCKETS", "Telemetry", "operation_span", "outcome_of"]

#: Histogram boundaries in seconds: 10 us .. 30 s (the SDK's defaults suit milliseconds).
DURATION_BUCKETS = (
    1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2,
    0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
)


def outcome_of(error: BaseException | None) -> str:
    """``ok``, ``cancelled``, or the error's stable code (``timeout``, ``connection``...)."""
    if error is None:
        return "ok"
    if isinstance(error, CancelledError):
        return "cancelled"
    code = getattr(error, "code", None)
    return code if isinstance(code, str) else type(error).__name__


class _Tallies:
    """Process-wide counts behind the observable instruments (created once per process)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.bytes: dict[tuple[str, str], int] = {}
        self.ops: dict[tuple[str, str, str], int] = {}
        self.failures: dict[tuple[str, str, str], int] = {}
        self.retries: dict[tuple[str, str, str], int] = {}
        self.inflight: dict[tuple[str, str], int] = {}
        self.regions = 0
        self.registrations = {"register": 0, "unregister": 0}
        self.instruments: dict[str, Any] = {}
        self.meter: Any = None
        #: node_id -> the engine's health snapshot function (HealthMetrics.snapshot's shape).
        self.health: dict[str, Any] = {}

    def bump(self, table: dict[Any, int], key: Any, n: int = 1) -> None:
        with self.lock:
            table[key] = table.get(key, 0) + n

    def _obs(self, table: dict[Any, int], keys: tuple[str, ...]) -> Iterator[Any]:
        from opentelemetry.metrics import Observation

        with self.lock:
            items = list(table.items())
        for key, value in items:
            yield Observation(value, dict(zip(keys, key)))

    def _health_obs(self, what: str) -> Iterator[Any]:
        """Observations of one health series across the engines watched (never raises)."""
        from opentelemetry.metrics import Observation

        with self.lock:
            sources = list(self.health.items())
        for node_id, snapshot in sources:
            try:
                snap = snapshot()
            except Exception:  # noqa: BLE001 - a closing engine must not break collection
                continue
            if what == "queue_backlog":
                yield Observation(snap["queue_backlog"], {"mpcomm.node_id": node_id})
                continue
            per = snap["connections"] if what == "connections" else snap[what]["by_peer"]
            for peer, n in per.items():
                yield Observation(n, {"mpcomm.node_id": node_id, "mpcomm.peer": peer})

    def setup(self) -> Any:
        """Create the instruments once; returns the latency histogram."""
        with self.lock:
            if self.meter is not None:
                return self.instruments["duration"]
            from opentelemetry import metrics

            meter = self.meter = metrics.get_meter("mpcomm", __version__)
        td = ("mpcomm.transport", "mpcomm.direction")
        meter.create_observable_counter(
            "mpcomm.transfer.bytes", [lambda _o: self._obs(self.bytes, td)], unit="By", description="bytes moved")
        meter.create_observable_counter(
            "mpcomm.transfer.operations", [lambda _o: self._obs(self.ops, (*td, "mpcomm.outcome"))],
            unit="{operation}", description="finished requests by outcome")
        meter.create_observable_up_down_counter(
            "mpcomm.transfer.inflight", [lambda _o: self._obs(self.inflight, td)],
            unit="{request}", description="requests in flight")
        meter.create_observable_counter(
            "mpcomm.transfer.failures", [lambda _o: self._obs(self.failures, (*td, "error.type"))],
            unit="{failure}", description="failed requests by kind")
        meter.create_observable_counter(
            "mpcomm.transfer.retries", [lambda _o: self._obs(self.retries, (*td, "error.type"))],
            unit="{retry}", description="retries by kind")
        meter.create_observable_up_down_counter(
            "mpcomm.regions", [lambda _o: self._obs({(): self.regions}, ())],
            unit="{region}", description="registered regions")
        meter.create_observable_counter(
            "mpcomm.region.registrations",
            [lambda _o: self._obs({(k,): v for k, v in self.registrations.items()}, ("mpcomm.event",))],
            unit="{event}", description="register and unregister calls")
        for what, unit, desc in (("retries", "{retry}", "requests retried on the next transport of their route"),
                                 ("failovers", "{failover}", "retries that moved to another transport"),
                                 ("quarantines", "{quarantine}", "times a peer was quarantined"),
                                 ("connect_failures", "{attempt}", "connection attempts to a peer that failed"),
                                 ("connect_backoffs", "{request}",
                                  "requests failed at once by the connect back-off, without dialling")):
            meter.create_observable_counter(f"mpcomm.peer.{what}", [lambda _o, w=what: self._health_obs(w)],
                                            unit=unit, description=desc)
        meter.create_observable_gauge("mpcomm.peer.connections", [lambda _o: self._health_obs("connections")],
                                      unit="{connection}", description="live control connections per peer")
        meter.create_observable_gauge("mpcomm.queue.backlog", [lambda _o: self._health_obs("queue_backlog")],
                                      unit="{request}",
                                      description="requests waiting for a queue slot or a busy transport")
        try:
            hist = meter.create_histogram(
                "mpcomm.transfer.duration", unit="s", description="request latency, post to resolution",
                explicit_bucket_boundaries_advisory=list(DURATION_BUCKETS))
        except TypeError:  # opentelemetry-api < 1.23
            hist = meter.create_histogram(
                "mpcomm.transfer.duration", unit="s", description="request latency, post to resolution")
        self.instruments["duration"] = hist
        return hist


_tallies = _Tallies()


@contextmanager
def operation_span(name: str, attributes: dict[str, Any] | None = None, *, kind: str = "internal") -> Iterator[Any]:
    """A span around one public operation, current while it runs (a no-op without an SDK).

    An exception leaving the block sets status ERROR, ``error.type`` and an
    exception event, and propagates.
    """
    from opentelemetry import trace

    tracer = trace.get_tracer("mpcomm", __version__)
    span_kind = trace.SpanKind.CLIENT if kind == "client" else trace.SpanKind.INTERNAL
    with tracer.start_as_current_span(name, kind=span_kind, record_exception=False,
                                      set_status_on_exception=False) as span:
        if attributes and span.is_recording():
            span.set_attributes({k: v for k, v in attributes.items() if v is not None})
        try:
            yield span
        except BaseException as exc:
            if span.is_recording():
                from opentelemetry.trace import Status, StatusCode

                span.set_attribute("error.type", type(exc).__name__)
                span.record_exception(exc)
                span.set_status(Status(StatusCode.ERROR, str(exc) or type(exc).__name__))
            raise


def _batch_of(transfer: Transfer) -> Any:
    """The Batch a transfer belongs to, found through the done-callback the Batch put on it.

    A bridge until the engine calls :meth:`Telemetry.on_submit` itself.
    """
    from .transfer import Batch

    for cb in getattr(transfer, "_done_callbacks", ()):
        owner = getattr(cb, "__self__", None)
        if isinstance(owner, Batch):
            return owner
    return None


class Telemetry:
    """The engine's link to OpenTelemetry; one per :class:`~mpcomm.Engine`.

    The engine calls :meth:`on_post` (only when :attr:`enabled`) for every
    posted request, :meth:`on_finish` when a transport finishes one,
    :meth:`on_register` for every (un)registration, :meth:`on_submit` for a
    batch (optional: on_post finds the batch otherwise), may call
    :meth:`on_retry` when it retries part of a request, and wraps other
    public operations in :meth:`operation`.
    """

    def __init__(self, config: Config) -> None:
        self.tracing = bool(config.observability.trace_transfers)
        self.metrics = bool(config.observability.metrics)
        self.enabled = self.tracing or self.metrics
        self._tracer: Any = None
        self._ops_tracer: Any = None
        self._hist_attrs: dict[tuple[str, str, str], dict[str, str]] = {}
        if self.enabled:
            from opentelemetry import trace

            self._ops_tracer = trace.get_tracer("mpcomm", __version__)
            self._span_kind = trace.SpanKind.CLIENT
            if self.tracing:
                self._tracer = self._ops_tracer
        if self.metrics:
            self._latency = _tallies.setup()

    # -- spans for operations ------------------------------------------------------------

    @contextmanager
    def operation(self, name: str, **attributes: Any) -> Iterator[Any]:
        """Span ``name`` (e.g. ``mpcomm.open``) around a public operation; nothing when telemetry is off."""
        if not self.enabled:
            yield None
            return
        with operation_span(name, attributes, kind="client") as span:
            yield span

    def on_submit(self, batch: Any, ops: list[Operation] | None = None) -> Any:
        """Open the batch's ``mpcomm.submit`` span (once) and end it when the batch resolves."""
        span = getattr(batch, "otel_span", None)
        if span is not None or self._ops_tracer is None:
            return span
        span = self._ops_tracer.start_span("mpcomm.submit", kind=self._span_kind)
        batch.otel_span = span  # telemetry's own field on the handle: the batch's span
        if span.is_recording():
            ops = ops if ops is not None else []
            kinds = {o.kind for o in ops}
            attrs: dict[str, Any] = {
                "mpcomm.requests": len(batch.transfers),
                "mpcomm.size": sum(o.length for o in ops),
                "mpcomm.direction": kinds.pop() if len(kinds) == 1 else "mixed",
            }
            if ops:
                attrs["mpcomm.peer"] = ops[0].remote.address
                attrs["mpcomm.region"] = ops[0].remote.name
            span.set_attributes(attrs)
        batch.add_done_callback(lambda b: self._batch_resolved(b, span))
        return span

    def _batch_resolved(self, batch: Any, span: Any) -> None:
        if span.is_recording():
            members = batch.transfers
            failed = [t for t in members if t.cancelled() or t.exception() is not None]
            error = None if batch.cancelled() else batch.exception()
            outcome = "cancelled" if batch.cancelled() else outcome_of(error)
            span.set_attributes({"mpcomm.outcome": outcome, "mpcomm.failed": len(failed),
                                 "mpcomm.bytes_moved": sum(t.bytes_moved for t in members)})
            if error is not None:
                from opentelemetry.trace import Status, StatusCode

                span.set_attribute("error.type", type(error).__name__)
                span.set_status(Status(StatusCode.ERROR, str(error) or outcome))
        span.end()

    # -- hooks the engine calls -------------------------------------------------------

    def on_post(self, op: Operation, transport: str) -> None:
        """``op`` was handed to ``transport``: count it in flight (and open its span when tracing)."""
        parent = None
        batch = _batch_of(op.transfer)
        if batch is not None:
            parent = self.on_submit(batch)
        span = None
        if self._tracer is not None:
            context = None
            if parent is not None:
                from opentelemetry import trace

                context = trace.set_span_in_context(parent)
            span = self._tracer.start_span(f"mpcomm.{op.kind}", context=context, kind=self._span_kind)
            if span.is_recording():
                peer = op.remote.address
                span.set_attributes({
                    "mpcomm.transport": transport,
                    "mpcomm.route": f"{transport}->{peer}",
                    "mpcomm.direction": op.kind,
                    "mpcomm.size": op.length,
                    "mpcomm.peer": peer,
                    "mpcomm.peer.node_id": op.remote.node_id,
                    "mpcomm.region": op.remote.name,
                    # issue 10: the route policy's choice and the rule that made it
                    "mpcomm.route.transports": ",".join(getattr(op.transfer, "route", ()) or ()),
                    "mpcomm.route.rule": getattr(op.transfer, "route_rule", None) or "",
                })
            op.otel_span = span  # type: ignore[attr-defined]  # telemetry's own field on the request
        if self.metrics:
            _tallies.bump(_tallies.inflight, (transport, op.kind))
        t0 = time.perf_counter()
        # The engine's finish hook runs before the Transfer is resolved (it cannot
        # see the error yet), so record the outcome when the handle resolves.
        op.transfer.add_done_callback(lambda t: self._resolved(op, transport, t, span, t0))

    def on_finish(self, op: Operation, transport: str, error: BaseException | None) -> None:
        """Kept for the engine; outcomes are recorded when the Transfer resolves (see on_post)."""

    def _resolved(self, op: Operation, transport: str, transfer: Transfer, span: Any, t0: float) -> None:
        elapsed = time.perf_counter() - t0
        error: BaseException | None
        if transfer.cancelled():
            error = CancelledError()
        else:
            error = transfer.exception()
        outcome = outcome_of(error)
        retries = getattr(op, "otel_retries", 0)
        if span is not None:
            if span.is_recording():
                span.set_attribute("mpcomm.outcome", outcome)
                span.set_attribute("mpcomm.retries", retries)
                span.set_attribute("mpcomm.bytes_moved", transfer.bytes_moved)
                if error is not None:
                    from opentelemetry.trace import Status, StatusCode

                    span.set_attribute("error.type", type(error).__name__)
                    if not isinstance(error, CancelledError):
                        span.record_exception(error)
                    span.set_status(Status(StatusCode.ERROR, str(error) or outcome))
            span.end()
        if self.metrics:
            kind = op.kind
            t = _tallies
            with t.lock:
                key = (transport, kind)
                t.inflight[key] = t.inflight.get(key, 0) - 1
                okey = (transport, kind, outcome)
                t.ops[okey] = t.ops.get(okey, 0) + 1
                if error is None:
                    t.bytes[key] = t.bytes.get(key, 0) + transfer.bytes_moved
                else:
                    t.failures[okey] = t.failures.get(okey, 0) + 1
            attrs = self._hist_attrs.get((transport, kind, outcome))
            if attrs is None:
                attrs = self._hist_attrs[(transport, kind, outcome)] = {
                    "mpcomm.transport": transport, "mpcomm.direction": kind, "mpcomm.outcome": outcome}
            self._latency.record(elapsed, attrs)

    def on_retry(self, op: Operation, error: BaseException | None = None) -> None:
        """The engine retries ``op`` on the next transport of its route after ``error``: an event and a count."""
        retries = getattr(op, "otel_retries", 0) + 1
        op.otel_retries = retries  # type: ignore[attr-defined]  # telemetry's own count on the request
        kind = outcome_of(error) if error is not None else "unknown"
        span = getattr(op, "otel_span", None)
        if span is not None and span.is_recording():
            span.add_event("mpcomm.retry", {"error.type": kind, "mpcomm.attempt": retries + 1})
        if self.metrics:
            transport = op.transport.name if op.transport is not None else "?"
            _tallies.bump(_tallies.retries, (transport, op.kind, kind))

    def watch_health(self, node_id: str, snapshot: Any) -> None:
        """Feed the ``mpcomm.peer.*`` / ``mpcomm.queue.backlog`` instruments from ``snapshot()``
        (an engine's health snapshot) until :meth:`unwatch_health`; nothing when metrics are off."""
        if self.metrics:
            with _tallies.lock:
                _tallies.health[node_id] = snapshot

    def unwatch_health(self, node_id: str) -> None:
        with _tallies.lock:
            _tallies.health.pop(node_id, None)

    def on_register(self, delta: int) -> None:
        """A region was registered (+1) or unregistered (-1)."""
        if self.metrics:
            with _tallies.lock:
                _tallies.regions += delta
                _tallies.registrations["register" if delta > 0 else "unregister"] += 1
