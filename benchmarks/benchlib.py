"""What the benchmark scripts share: a throwaway PKI for TLS runs, and the timing fields of a record.

The scripts run as ``python benchmarks/bench_x.py``, so this folder is on
``sys.path`` and they ``import benchlib``. The record format itself (and its
units) is :mod:`mpcomm.cli.records`, shared with ``mpcomm bench``.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

from mpcomm.cli.records import format_seconds

__all__ = ["make_pki", "timing_fields", "tls_section"]


def make_pki(d: Path) -> None:
    """ca.pem, and node.pem/node.key signed by it (SAN 127.0.0.1), with the openssl CLI, in ``d``."""
    def sh(*argv: str) -> None:
        subprocess.run(argv, check=True, capture_output=True, cwd=d)

    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes"]
    sh("openssl", "req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.pem", "-subj", "/CN=bench-ca", "-days", "1",
       "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign")
    (d / "ext.cnf").write_text("subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth,clientAuth\n")
    sh("openssl", "req", *ec, "-keyout", "node.key", "-out", "node.csr", "-subj", "/CN=bench-node")
    sh("openssl", "x509", "-req", "-in", "node.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
       "-out", "node.pem", "-days", "1", "-extfile", "ext.cnf")


def tls_section(d: Path) -> dict[str, str]:
    """The ``[tls]`` config section for the PKI :func:`make_pki` made in ``d`` (every node uses one cert)."""
    return {"cert": str(d / "node.pem"), "key": str(d / "node.key"), "ca": str(d / "ca.pem")}


def timing_fields(p50: float, p99: float, cpu: float) -> dict[str, str]:
    """A record's ``p50_latency``, ``p99_latency`` (seconds) and ``cpu_utilization`` (cores busy)."""
    return {"p50_latency": format_seconds(p50), "p99_latency": format_seconds(p99),
            "cpu_utilization": f"{cpu:.2f}cores"}
