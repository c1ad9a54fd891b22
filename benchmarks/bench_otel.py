"""OpenTelemetry overhead on the small-message benchmark.

Runs ``mpcomm bench --case otel`` (target in its own process): 8-byte writes,
one in flight, with observability off, metrics on, and traces + metrics on,
interleaved in rounds so drift affects all three alike. The SDK is installed
with a span exporter that drops spans and an in-memory metric reader, so the
figures are the library's and the SDK's cost, not an exporter's.

    python benchmarks/bench_otel.py [-t shm] [--seconds 2] [--json]
"""

from __future__ import annotations

import sys

from mpcomm.cli.app import app

if __name__ == "__main__":
    args = sys.argv[1:]
    if not any(a in ("-t", "--transport") for a in args):
        args = ["-t", "tcp", *args]
    app(["bench", "--case", "otel", *args])
