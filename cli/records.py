"""The benchmark record format of the design document, and what it is made of.

One line per case::

    transport=tcp mode=zero-copy memory=host message_size=4MiB concurrency=8 numa_binding=none
    throughput=1.48GB/s p50_latency=2.81ms p99_latency=3.75ms cpu_utilization=0.88cores

Shared by ``mpcomm bench`` and the scripts under ``benchmarks/`` so that their
figures read the same way. Standard library only (importable without typer).

Units, everywhere in the command line: sizes in binary units (``B``, ``KiB``,
``MiB``, ``GiB``: powers of 1024), rates in decimal bytes per second
(``MB/s``, ``GB/s``: powers of 1000, as network links are rated), times in
``us``/``ms``/``s``. JSON output carries plain numbers: bytes, bytes per
second, seconds, fractions.
"""

from __future__ import annotations

import os
import resource
from typing import Any

from mpcomm.units import format_size, parse_size

__all__ = ["format_rate", "format_record", "format_seconds", "format_size", "parse_size", "proc_cpu", "self_cpu"]

def format_rate(bytes_per_s: float) -> str:
    """Throughput in decimal units: ``2.71GB/s``."""
    for unit, factor in (("GB/s", 1e9), ("MB/s", 1e6), ("KB/s", 1e3)):
        if bytes_per_s >= factor:
            return f"{bytes_per_s / factor:.2f}{unit}"
    return f"{bytes_per_s:.0f}B/s"


def format_seconds(s: float) -> str:
    if s < 1e-3:
        return f"{s * 1e6:.1f}us"
    if s < 1:
        return f"{s * 1e3:.2f}ms"
    return f"{s:.2f}s"


def numa_binding(cpu_node: int | None, mem_node: int | None) -> str:
    """A bench record's ``numa_binding``: what was used.

    ``none`` without ``--numa-node``; ``nodeN`` when bound to node N and the
    initiator's buffer is on N; ``nodeN(mem=nodeM)`` when the kernel put the
    buffer elsewhere (``mem=?``: the node of the buffer is unknown).
    """
    if cpu_node is None:
        return "none"
    if mem_node == cpu_node:
        return f"node{cpu_node}"
    return f"node{cpu_node}(mem={'?' if mem_node is None else f'node{mem_node}'})"


def format_record(fields: dict[str, Any]) -> str:
    """``key=value`` pairs, in the order given, separated by spaces."""
    return " ".join(f"{k}={v}" for k, v in fields.items())


def proc_cpu(pid: int) -> float:
    """CPU seconds (user + system) of process ``pid``; 0.0 where /proc is unavailable."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return 0.0


def self_cpu() -> float:
    """CPU seconds (user + system) of this process, all threads."""
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime
