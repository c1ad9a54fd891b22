"""A second host in a network namespace: tcp across a veth link, and a partition.

The test makes its own namespace and veth pair (root and iproute2 needed;
skipped with the reason otherwise), runs the conformance kit's target inside
the namespace, and drives it from this host over the link. Only the two
addresses of that private link are ever dialled.
"""

from __future__ import annotations

import time

import pytest

import mpcomm
from mpcomm.testing import ConformanceEnv, netns, run_conformance
from mpcomm.testing.fixtures import two_hosts_fixture
from mpcomm.testing.kit import CHECKS


#: This process's namespace (side a) and a namespace (side b, the other host) on one veth link.
second_host = two_hosts_fixture("mh", "10.231", name="second_host")


def _env(host: netns.TwoHosts) -> ConformanceEnv:
    return ConformanceEnv("tcp", target_host=host.addr_b, target_prefix=host.prefix_b)


def test_conformance_across_hosts(second_host: netns.TwoHosts) -> None:
    """The whole conformance kit over the veth link (the target is on the other 'host')."""
    report = run_conformance("tcp", target_host=second_host.addr_b, target_prefix=second_host.prefix_b)
    assert report.ok, report.summary()
    assert sum(r.outcome == "passed" for r in report.results) >= len(CHECKS) - 1, report.summary()


def test_other_host_is_not_same_host(second_host: netns.TwoHosts) -> None:
    """The peer in another network namespace reports a different net_ns; shm must not map across it."""
    env = _env(second_host)
    try:
        link = env.engine._peer(env.target.address)
        assert link.info.host["net_ns"] != env.engine.host["net_ns"]
        assert link.info.address.startswith(second_host.addr_b)
    finally:
        env.close()


def test_partition_fails_within_deadline(second_host: netns.TwoHosts) -> None:
    """A link that drops every packet: requests end by their deadline, and work again once it heals."""
    env = _env(second_host)
    try:
        remote = env.engine.open(env.target.address, "alloc")
        src = env.engine.allocate(8 << 20)
        env.engine.write(src, remote, 0, 8 << 20).result(30)
        netns.ip(second_host.b, "link", "set", second_host.dev_b, "down")
        try:
            t0 = time.monotonic()
            with pytest.raises((mpcomm.TransferTimeout, mpcomm.PeerConnectionError)):
                env.engine.write(src, remote, 0, 8 << 20, timeout=1.0).result(10)
            elapsed = time.monotonic() - t0
            assert elapsed < 1.0 + env.grace() + 3, f"partitioned request took {elapsed:.1f}s"
        finally:
            netns.ip(second_host.b, "link", "set", second_host.dev_b, "up")
        deadline = time.monotonic() + 20
        while True:
            try:
                env.engine.write(src, remote, 0, 4096, timeout=2).result(10)
                break
            except (mpcomm.TransferTimeout, mpcomm.PeerConnectionError):
                assert time.monotonic() < deadline, "no recovery after the link came back"
                time.sleep(0.2)
    finally:
        env.close()

