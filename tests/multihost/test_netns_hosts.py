"""A second host in a network namespace: tcp across a veth link, and a partition.

The test makes its own namespace and veth pair (root and iproute2 needed;
skipped with the reason otherwise), runs the conformance kit's target inside
the namespace, and drives it from this host over the link. Only the two
addresses of that private link are ever dialled.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
import uuid
from collections.abc import Iterator

import pytest

import mpcomm
from mpcomm.testing import ConformanceEnv, run_conformance
from mpcomm.testing.kit import CHECKS

NET = "10.231.{n}.{h}"


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=20)


@pytest.fixture(scope="module")
def second_host() -> Iterator[dict[str, str]]:
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root")
    if shutil.which("ip") is None:
        pytest.skip("iproute2 (ip) is not installed")
    tag = uuid.uuid4().hex[:6]
    ns, here, there = f"mpc-{tag}", f"mpa{tag}", f"mpb{tag}"
    n = 1 + int(tag[:2], 16) % 250
    local, remote = NET.format(n=n, h=1), NET.format(n=n, h=2)
    try:
        _ip("netns", "add", ns)
    except subprocess.CalledProcessError as exc:
        pytest.skip(f"cannot create a network namespace: {exc.stderr.strip()}")
    try:
        _ip("link", "add", here, "type", "veth", "peer", "name", there)
        _ip("link", "set", there, "netns", ns)
        _ip("addr", "add", f"{local}/24", "dev", here)
        _ip("link", "set", here, "up")
        _ip("-n", ns, "addr", "add", f"{remote}/24", "dev", there)
        _ip("-n", ns, "link", "set", there, "up")
        _ip("-n", ns, "link", "set", "lo", "up")
        yield {"ns": ns, "dev": here, "local": local, "remote": remote}
    finally:
        _ip("link", "del", here, check=False)
        _ip("netns", "del", ns, check=False)


def _env(host: dict[str, str]) -> ConformanceEnv:
    return ConformanceEnv("tcp", target_host=host["remote"], target_prefix=["ip", "netns", "exec", host["ns"]])


def test_conformance_across_hosts(second_host: dict[str, str]) -> None:
    """The whole conformance kit over the veth link (the target is on the other 'host')."""
    report = run_conformance("tcp", target_host=second_host["remote"],
                             target_prefix=["ip", "netns", "exec", second_host["ns"]])
    assert report.ok, report.summary()
    assert sum(r.outcome == "passed" for r in report.results) >= len(CHECKS) - 1, report.summary()


def test_other_host_is_not_same_host(second_host: dict[str, str]) -> None:
    """The peer in another network namespace reports a different net_ns; shm must not map across it."""
    env = _env(second_host)
    try:
        link = env.engine._peer(env.target.address)
        assert link.info.host["net_ns"] != env.engine.host["net_ns"]
        assert link.info.address.startswith(second_host["remote"])
    finally:
        env.close()


def test_partition_fails_within_deadline(second_host: dict[str, str]) -> None:
    """A link that drops every packet: requests end by their deadline, and work again once it heals."""
    env = _env(second_host)
    try:
        remote = env.engine.open(env.target.address, "alloc")
        src = env.engine.allocate(8 << 20)
        env.engine.write(src, remote, 0, 8 << 20).result(30)
        _ip("-n", second_host["ns"], "link", "set", [d for d in _veth_in_ns(second_host)][0], "down")
        try:
            t0 = time.monotonic()
            with pytest.raises((mpcomm.TransferTimeout, mpcomm.PeerConnectionError)):
                env.engine.write(src, remote, 0, 8 << 20, timeout=1.0).result(10)
            elapsed = time.monotonic() - t0
            assert elapsed < 1.0 + env.grace() + 3, f"partitioned request took {elapsed:.1f}s"
        finally:
            _ip("-n", second_host["ns"], "link", "set", _veth_in_ns(second_host)[0], "up")
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


def _veth_in_ns(host: dict[str, str]) -> list[str]:
    out = _ip("-n", host["ns"], "-o", "link", "show", "type", "veth").stdout
    return [line.split(":")[1].strip().split("@")[0] for line in out.splitlines() if line.strip()]
