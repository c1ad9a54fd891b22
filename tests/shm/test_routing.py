"""Same-host detection and falling back to tcp where shm cannot go."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap

import pytest
from shm_support import is_root, make_engine

import mpcomm
from mpcomm.peer import PeerInfo


def _peer_like(engine: mpcomm.Engine, **host_changes: object) -> PeerInfo:
    info = engine.info()
    info.host = {**info.host, **host_changes}
    return info


@pytest.fixture
def pair():
    with make_engine() as a, make_engine() as b:
        yield a, b


def test_reach_refuses_another_kernel(pair) -> None:
    a, b = pair
    shm = a.transports["shm"]
    ok = shm.reach(b.info())
    assert ok, ok.reason
    # Same hostname, different boot id: two containers on two hosts.
    other = _peer_like(b, boot_id="0f0f0f0f-0000-0000-0000-000000000000")
    other.epoch = "other-kernel"
    avail = shm.reach(other)
    assert not avail and "boot id" in avail.reason
    missing = _peer_like(b, boot_id="")
    missing.epoch = "no-boot-id"
    assert not shm.reach(missing)


def test_reach_checks_namespaces(pair) -> None:
    a, b = pair
    shm = a.transports["shm"]
    pid_ns = _peer_like(b, pid_ns="pid:[1]")
    pid_ns.epoch = "pidns"
    avail = shm.reach(pid_ns)  # b offers CMA for plain buffers, which needs our PID namespace
    assert not avail and "PID namespace" in avail.reason
    # A peer that offers no CMA is reachable through memfd alone...
    no_cma = _peer_like(b, pid_ns="pid:[1]")
    no_cma.epoch = "nocma"
    no_cma.transports = {**no_cma.transports, "shm": {**no_cma.transports["shm"], "cma": False}}
    assert shm.reach(no_cma)
    # ...unless the fd socket (abstract, per network namespace) is out of reach too.
    both = _peer_like(b, pid_ns="pid:[1]", net_ns="net:[1]")
    both.epoch = "both"
    both.transports = no_cma.transports
    assert not shm.reach(both)


def test_pid_reuse_is_caught_by_the_probe(pair) -> None:
    a, b = pair
    fake = _peer_like(b, pid=1)  # same namespaces, wrong process
    fake.epoch = "fake"
    avail = a.transports["shm"].reach(fake)
    assert not avail and "cross-memory attach" in avail.reason


def test_target_without_cma_routes_plain_buffers_over_tcp(spawn, initiator: mpcomm.Engine) -> None:
    target = spawn({"mem": [1 << 20, "allocate"], "buf": [1 << 20, "buffer"]},
                   config={"plugins": {"shm": {"cma": False}}})
    mem, buf = initiator.open(target.address, "mem"), initiator.open(target.address, "buf")
    assert "shm" not in buf.transports
    assert initiator.write(b"m" * 5000, mem).result(10) and initiator.write(b"m", mem).result(10)
    t_mem = initiator.write(b"m" * 5000, mem)
    t_buf = initiator.write(b"b" * 5000, buf)
    t_mem.result(10), t_buf.result(10)
    assert (t_mem.transport, t_buf.transport) == ("shm", "tcp")


def test_initiator_without_cma_falls_back_to_tcp(spawn) -> None:
    target = spawn({"buf": [1 << 20, "buffer"]})
    with make_engine({"plugins": {"shm": {"cma": False}}}) as e:
        t = e.write(b"x" * 100, e.open(target.address, "buf"))
        t.result(10)
        assert t.transport == "tcp"


@pytest.mark.skipif(not is_root() or not shutil.which("unshare"), reason="needs root and unshare(1)")
def test_target_in_another_pid_namespace_uses_tcp(spawn, initiator: mpcomm.Engine) -> None:
    """A real denial: the target's pid is meaningless here, CMA cannot address it."""
    try:
        target = spawn({"mem": [1 << 20, "allocate"], "buf": [1 << 20, "buffer"]},
                       prefix=["unshare", "--pid", "--fork", "--kill-child"])
    except (EOFError, TimeoutError) as exc:
        pytest.skip(f"unshare --pid failed here: {exc}")
    assert target.pid == 1
    for name in ("buf", "mem"):
        t = initiator.write(b"y" * 4096, initiator.open(target.address, name))
        t.result(10)
        assert t.transport == "tcp"
    info = initiator._peer(target.address).info
    assert "PID namespace" in initiator.transports["shm"].reach(info).reason


INITIATOR = textwrap.dedent("""
    import json, os, sys
    import mpcomm
    e = mpcomm.Engine(transports=["shm", "tcp"])
    os.setgroups([]); os.setresgid(65534, 65534, 65534); os.setresuid(65534, 65534, 65534)
    out = {}
    for name in ("buf", "mem"):
        r = e.open(sys.argv[1], name)
        t = e.write(b"z" * 4096, r); t.result(10)
        out[name] = t.transport
    out["reason"] = e.transports["shm"].reach(e._peer(sys.argv[1]).info).reason
    print(json.dumps(out)); e.close()
""")


@pytest.mark.skipif(not is_root(), reason="needs root to drop to another uid")
def test_ptrace_denied_falls_back_to_tcp(spawn) -> None:
    """A real EPERM: an unprivileged initiator may not attach to a root-owned target."""
    target = spawn({"mem": [1 << 20, "allocate"], "buf": [1 << 20, "buffer"]})
    proc = subprocess.run([sys.executable, "-c", INITIATOR, target.address], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert (out["buf"], out["mem"]) == ("tcp", "tcp")
    assert "denied" in out["reason"]
