"""A region knows its NUMA node; bench records say which binding was used."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

import mpcomm
from mpcomm.cli.records import numa_binding
from mpcomm.topology import numa_node_of


def _node_known() -> bool:
    buf = bytearray(4096)
    view = memoryview(buf)
    view[0] = 1  # faulted in
    from mpcomm.memory import buffer_address

    return numa_node_of(buffer_address(view)) is not None


needs_numa = pytest.mark.skipif(not _node_known(), reason="this kernel reports no NUMA node for a page "
                                "(no move_pages(2) and no /proc/self/numa_maps answer)")


@needs_numa
def test_a_region_knows_its_numa_node() -> None:
    from mpcomm.memory import Region

    buf = bytearray(1 << 16)
    buf[0] = 1
    r = Region(memoryview(buf), name="plain", access="rw")
    assert r._numa is None  # nothing asked yet: the look-up is lazy
    node = r.numa_node
    assert isinstance(node, int) and node >= 0 and node == numa_node_of(r.address)
    assert r._numa == node  # kept once known
    with mpcomm.Engine() as e:
        kv = e.allocate(1 << 20, "kv")  # pre-faulted by the engine
        assert isinstance(kv.numa_node, int)
        assert e._region_record(kv).numa_node == kv.numa_node  # what metadata publishes


def test_device_memory_has_no_numa_node() -> None:
    from mpcomm.memory import Region

    r = Region(memoryview(bytearray(4096)), name="dev", access="rw", kind="device")
    assert r.numa_node is None


def test_numa_binding_says_what_was_used() -> None:
    assert numa_binding(None, 0) == "none"
    assert numa_binding(None, None) == "none"
    assert numa_binding(1, 1) == "node1"
    assert numa_binding(0, 1) == "node0(mem=node1)"
    assert numa_binding(0, None) == "node0(mem=?)"


@needs_numa
def test_bench_record_reports_the_binding_and_the_memory_node() -> None:
    proc = subprocess.run([sys.executable, "-m", "mpcomm.cli", "bench", "--quick", "-t", "tcp", "--case", "latency",
                           "--seconds", "0.03", "--numa-node", "0", "--json"],
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    measured = [r for r in records if r.get("status") == "ok"]
    assert measured, proc.stdout
    for r in measured:
        assert r.get("extra", r).get("numa_memory") == "node0", r
        assert r["numa_binding"] == "node0", r
