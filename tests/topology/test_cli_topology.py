"""``mpcomm topology`` and ``mpcomm regions`` as a user runs them (a real process each)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from etcd_support import EtcdServer, etcd_binary

ISSUE_EXAMPLE = """
[[route]]
name = "same-host"
same_host = true
transports = ["shm", "ucx", "tcp"]

[[route]]
name = "rdma-both-sides"
same_host = false
requires = ["rdma_zerocopy"]
transports = ["rdma_zerocopy", "ucx", "tcp"]
split_min = "64MiB"

[[route]]
name = "other-hosts"
transports = ["ucx", "tcp"]
"""


def mpcomm(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("MPCOMM_CONFIG", "MPCOMM_METADATA")}
    return subprocess.run([sys.executable, "-m", "mpcomm.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


def test_topology_json_matches_discovery() -> None:
    from mpcomm import topology

    p = mpcomm("topology", "--json")
    assert p.returncode == 0, p.stderr
    data = json.loads(p.stdout)
    assert data["topology"]["cpus"] == os.cpu_count()
    assert {i["name"] for i in data["topology"]["interfaces"]} == {i.name for i in topology.discover().interfaces}
    topology.Topology.from_dict(data["topology"])  # what we print is what a peer would accept
    cases = {r["case"]: r for r in data["routes"]}
    running = {t["name"] for t in data["transports"] if t["available"]}
    same = cases["same host"]
    assert same["rule"] == "default" and set(same["transports"]) <= running
    if "shm" in running:
        assert same["transports"][0] == "shm"
        assert "shm" not in cases["other host"]["transports"]  # intra-node only


def test_topology_text_with_the_issue_example(tmp_path: Path) -> None:
    cfg = tmp_path / "routes.toml"
    cfg.write_text(ISSUE_EXAMPLE)
    p = mpcomm("--config", str(cfg), "topology")
    assert p.returncode == 0, p.stderr
    out = p.stdout
    for header in ("== node ==", "== numa ==", "== network ==", "== rdma ==", "== gpus ==", "== memory ==",
                   "== transports ==", "== routes =="):
        assert header in out
    assert "(rule: same-host)" in out and "(rule: other-hosts)" in out
    assert "rdma_zerocopy, ucx, tcp   (rule: rdma-both-sides), split into 2 stripes" in out
    assert "/dev/shm:" in out and "memlock:" in out


def test_topology_rejects_a_rule_naming_a_missing_transport(tmp_path: Path) -> None:
    cfg = tmp_path / "bad.toml"
    cfg.write_text('[[route]]\nname = "x"\ntransports = ["verbs9"]\n')
    p = mpcomm("--config", str(cfg), "topology")
    assert p.returncode == 2
    assert "route 'x' names transport 'verbs9', which is not installed" in " ".join(p.stderr.split())


def test_regions_without_a_metadata_service_is_a_usage_error() -> None:
    p = mpcomm("regions")
    assert p.returncode == 2 and "no metadata service" in p.stderr


@pytest.mark.skipif(etcd_binary() is None, reason="etcd is not installed (Debian: etcd-server)")
def test_regions_lists_what_is_published(tmp_path: Path) -> None:
    pytest.importorskip("etcd3gw", reason="the etcd3gw client is not installed")
    import mpcomm as mp

    server = EtcdServer(tmp_path)
    server.start()
    try:
        with mp.Engine({"cluster": {"metadata": server.url}}) as e:
            e.register(bytearray(1 << 20), "kv-cache")
            p = mpcomm("regions", "--metadata", server.url, "--json")
            assert p.returncode == 0, p.stderr
            data = json.loads(p.stdout)
            assert [(r["name"], r["size"], r["address"]) for r in data["regions"]] == [("kv-cache", 1 << 20, e.address)]
            assert [n["node_id"] for n in data["nodes"]] == [e.node_id]
            text = mpcomm("regions", "--metadata", server.url)
            assert text.returncode == 0 and "kv-cache" in text.stdout and "1MiB" in text.stdout
    finally:
        server.kill()
