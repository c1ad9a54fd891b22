"""One set of SDK providers for the whole process: an in-memory span exporter and metric reader.

OpenTelemetry's global providers can be set only once per process, so the
tests share them: clear the span exporter per test and compare metric deltas.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from opentelemetry import metrics, trace
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

_EXPORTER = InMemorySpanExporter()
_READER = InMemoryMetricReader()


def _install() -> None:
    tp = trace.get_tracer_provider()
    if not isinstance(tp, TracerProvider):
        tp = TracerProvider()
        trace.set_tracer_provider(tp)
    tp.add_span_processor(SimpleSpanProcessor(_EXPORTER))
    if not isinstance(metrics.get_meter_provider(), MeterProvider):
        metrics.set_meter_provider(MeterProvider(metric_readers=[_READER]))


_install()


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    _EXPORTER.clear()
    yield _EXPORTER
    _EXPORTER.clear()


class MetricView:
    """Points of the reader's current collection, by metric name and attributes."""

    def __init__(self, reader: InMemoryMetricReader) -> None:
        self.points: dict[str, list[Any]] = {}
        data = reader.get_metrics_data()
        for rm in data.resource_metrics if data else []:
            for sm in rm.scope_metrics:
                for m in sm.metrics:
                    self.points.setdefault(m.name, []).extend(m.data.data_points)


@pytest.fixture
def collect() -> Any:
    return lambda: MetricView(_READER)
