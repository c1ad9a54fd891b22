"""Configuring the OpenTelemetry SDK for the command line (``--otel``).

The library only uses the API; this is the one place mpcomm touches the SDK.
``console`` prints spans and metrics on stderr (stdout stays data);
``otlp`` exports with the standard ``OTEL_EXPORTER_OTLP_*`` variables
(``OTEL_EXPORTER_OTLP_ENDPOINT``, ``…_PROTOCOL`` = ``grpc`` or
``http/protobuf``, ``…_HEADERS``, ``OTEL_SERVICE_NAME``, …).
Both need the SDK (``pip install 'mpcomm[otel]'``); otlp also needs the
exporter (``pip install 'mpcomm[otlp]'``). Imports are lazy: without
``--otel`` nothing of the SDK is loaded.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any

from ._common import EXIT_USAGE, CliError

MODES = ("none", "console", "otlp")


def _require(module: str, extra: str) -> Any:
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise CliError(
            f"--otel needs {module} ({exc.name} is missing); install it with: pip install 'mpcomm[{extra}]'",
            EXIT_USAGE,
        ) from exc


def _otlp_exporters() -> tuple[Any, Any]:
    proto = (os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
             or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL") or "grpc").strip().lower()
    if proto.startswith("http"):
        tr = _require("opentelemetry.exporter.otlp.proto.http.trace_exporter", "otlp")
        mx = _require("opentelemetry.exporter.otlp.proto.http.metric_exporter", "otlp")
    elif proto == "grpc":
        tr = _require("opentelemetry.exporter.otlp.proto.grpc.trace_exporter", "otlp")
        mx = _require("opentelemetry.exporter.otlp.proto.grpc.metric_exporter", "otlp")
    else:
        raise CliError(f"OTEL_EXPORTER_OTLP_PROTOCOL={proto!r}: expected grpc or http/protobuf", EXIT_USAGE)
    return tr.OTLPSpanExporter(), mx.OTLPMetricExporter()


def setup(mode: str, *, service_name: str = "mpcomm") -> Callable[[], None]:
    """Install SDK tracer and meter providers for ``mode``; returns the shutdown (flush) function.

    If the process already has SDK providers (an embedding application, a
    test), they are kept and a span processor is added to the tracer provider;
    metrics then go wherever that application sends them.
    """
    if mode == "none":
        return lambda: None
    if mode not in MODES:
        raise CliError(f"--otel must be one of {', '.join(MODES)}, not {mode!r}", EXIT_USAGE)
    sdk_trace = _require("opentelemetry.sdk.trace", "otel")
    sdk_export = _require("opentelemetry.sdk.trace.export", "otel")
    sdk_metrics = _require("opentelemetry.sdk.metrics", "otel")
    sdk_mexport = _require("opentelemetry.sdk.metrics.export", "otel")
    sdk_resources = _require("opentelemetry.sdk.resources", "otel")
    from opentelemetry import metrics, trace

    if mode == "console":
        span_exporter: Any = sdk_export.ConsoleSpanExporter(out=sys.stderr)
        metric_exporter: Any = sdk_mexport.ConsoleMetricExporter(out=sys.stderr)
    else:
        span_exporter, metric_exporter = _otlp_exporters()

    attrs = {} if os.environ.get("OTEL_SERVICE_NAME") else {"service.name": service_name}
    resource = sdk_resources.Resource.create(attrs)
    processor = sdk_export.BatchSpanProcessor(span_exporter)
    current = trace.get_tracer_provider()
    if isinstance(current, sdk_trace.TracerProvider):
        current.add_span_processor(processor)
        tracer_provider = None
    else:
        tracer_provider = sdk_trace.TracerProvider(resource=resource)
        tracer_provider.add_span_processor(processor)
        trace.set_tracer_provider(tracer_provider)

    meter_provider = None
    if not isinstance(metrics.get_meter_provider(), sdk_metrics.MeterProvider):
        interval = float(os.environ.get("OTEL_METRIC_EXPORT_INTERVAL", "60000"))
        reader = sdk_mexport.PeriodicExportingMetricReader(metric_exporter, export_interval_millis=interval)
        meter_provider = sdk_metrics.MeterProvider(resource=resource, metric_readers=[reader])
        metrics.set_meter_provider(meter_provider)

    def shutdown() -> None:
        try:
            processor.force_flush()
            if tracer_provider is not None:
                tracer_provider.shutdown()
            else:
                processor.shutdown()
            if meter_provider is not None:
                meter_provider.shutdown()  # collects and exports once more
        except Exception:  # noqa: BLE001 - flushing must not change the exit code
            pass

    return shutdown
