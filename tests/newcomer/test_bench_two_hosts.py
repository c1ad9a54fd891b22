"""``mpcomm bench --target`` across two hosts: two network namespaces joined by a veth pair.

The test creates both namespaces and the link itself (root and iproute2
needed; skipped with the reason otherwise), starts ``mpcomm serve`` in one and
``mpcomm bench --target`` in the other, and dials only the two addresses of
that private link.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from newcomer_support import cli_env, start_serve

from mpcomm.testing import netns
from mpcomm.testing.fixtures import two_hosts_fixture


#: Two namespaces (a: the server's host, b: the bench's) on one veth link.
two_hosts = two_hosts_fixture("nb", "10.232", here=False, name="two_hosts")


def test_bench_target_on_another_host(two_hosts: netns.TwoHosts) -> None:
    srv = start_serve("--region", "bench=16MiB", "--endpoint", f"{two_hosts.addr_a}:0", "-t", "tcp",
                      prefix=two_hosts.prefix_a)
    try:
        assert srv.address.startswith(two_hosts.addr_a + ":")
        cmd = [*two_hosts.prefix_b, sys.executable, "-m", "mpcomm.cli", "bench",
               "--target", srv.address, "bench", "-t", "tcp", "--endpoint", f"{two_hosts.addr_b}:0",
               "--start-size", "4KiB", "--max-size", "1MiB", "--depth", "1", "--depth", "8",
               "--iterations", "200", "--duration", "1", "--check", "--json"]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=cli_env())
        assert proc.returncode == 0, proc.stderr
        records = [json.loads(line) for line in proc.stdout.splitlines()]
        assert [(r["message_size"], r["concurrency"]) for r in records] == [
            (s, d) for d in (1, 8) for s in (4096 << k for k in range(9))]
        for r in records:
            assert r["status"] == "ok" and r["case"] == "sweep" and r["transport"] == "tcp", r
            assert r["extra"]["verified"] is True
            assert r["requests"] > 0 and r["throughput"] > 0
            assert 0 < r["p50_latency"] <= r["p90_latency"] <= r["p99_latency"] <= r["p999_latency"]
            assert isinstance(r["cpu_utilization"], float) and "cpu_target" not in r["extra"]
        # The record lines, for the reader of the test log (run with -s to see them).
        lines = subprocess.run(cmd[:-1] + ["--max-size", "64KiB"], capture_output=True, text=True, timeout=300,
                               env=cli_env())
        assert lines.returncode == 0, lines.stderr
        print(f"\nserve in {two_hosts.a} ({srv.address}), bench in {two_hosts.b}:\n{lines.stdout}")
    finally:
        code, err = srv.stop()
        assert code == 0, err
