"""ucx outside mpcomm's authentication (issue 30, items 2 and 3), pinned with real processes.

UCX's tcp transport opens a listening socket per network device for its own
wire-up and (emulated) RMA; UCX has no option to open none and no
authentication. mpcomm hands the worker address and the rkeys only over the
authenticated control channel, but the listener itself answers anyone, and
neither cma nor tcp checks an rkey's rights (docs/security.md, "ucx").
These tests pin exactly that: strangers' bytes on the listener do no harm,
and a worker address plus a read-only region's rkey are bearer credentials
that UCX itself does not limit to reading.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import pytest

import mpcomm
from mpcomm.control import PeerLink
from mpcomm.peer import PeerInfo, parse_endpoint
from mpcomm.plugins.ucx.transport import UcxTransport

AVAIL = UcxTransport.availability()
pytestmark = pytest.mark.skipif(not AVAIL, reason=f"ucx transport unavailable: {AVAIL.reason}")
HERE = os.path.dirname(os.path.abspath(__file__))
SECRET = "5e0c3a9f1b7d2e4c6a8f0b1d3e5c7a9f"


class Target:
    def __init__(self) -> None:
        cfg = {"transport": {"secret": SECRET}}
        self.proc = subprocess.Popen([sys.executable, os.path.join(HERE, "engine_peer.py"), json.dumps(cfg)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)
        hello = json.loads(self.proc.stdout.readline())
        self.address, self.pid = hello["address"], hello["pid"]

    def cmd(self, line: str) -> dict:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        out = self.proc.stdout.readline()
        assert out, f"the target died (rc={self.proc.poll()})"
        return json.loads(out)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)


@pytest.fixture
def target():
    t = Target()
    yield t
    t.close()


def loopback_listeners(pid: int) -> set[int]:
    """Ports process ``pid`` listens on at 127.0.0.1 (its socket inodes matched against /proc/net/tcp).

    UCX listens per network device; these tests only ever send to loopback.
    """
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    ports = set()
    with open("/proc/net/tcp") as f:
        for line in f.readlines()[1:]:
            cols = line.split()
            addr, port = cols[1].split(":")
            if cols[3] == "0A" and cols[9] in inodes and addr in ("0100007F", "00000000"):  # LISTEN on lo
                ports.add(int(port, 16))
    return ports


def member_link(address: str) -> PeerLink:
    me = PeerInfo(node_id="member-" + os.urandom(4).hex(), epoch=os.urandom(8).hex(), address="127.0.0.1:1",
                  host={}, transports={})
    return PeerLink(address, local_info=me, secret=SECRET, timeout=10, on_lost=lambda link: None)


def test_strangers_on_the_ucx_listener_do_no_harm(target) -> None:
    """Garbage, silence and half-frames from a process that never authenticated: the target serves on."""
    target.cmd("register kv 65536 rw buffer")
    control = parse_endpoint(target.address)[1]
    ucx_ports = loopback_listeners(target.pid) - {control}
    assert ucx_ports, "UCX opened no loopback listener (then this test and docs/security.md need updating)"
    held = []
    for port in ucx_ports:
        for junk in (os.urandom(4096), b"\xff" * 64, b"\x00" * 8 + (2**63).to_bytes(8, "little"), b""):
            s = socket.create_connection(("127.0.0.1", port), timeout=5)
            if junk:
                try:
                    s.sendall(junk)
                except OSError:
                    pass
            held.append(s)  # some stay open and silent
    time.sleep(0.5)
    for s in held[::2]:
        s.close()
    assert target.proc.poll() is None
    with mpcomm.Engine(transports=["ucx"], secret=SECRET) as member:
        remote = member.open(target.address, "kv", timeout=10)
        member.write(b"\x42" * 65536, remote).result(10)
    assert target.cmd("count kv 66")["n"] == 65536
    for s in held[1::2]:
        s.close()
    assert target.proc.poll() is None


@pytest.mark.parametrize("tls", [None, "tcp"], ids=["default-cma", "tcp"])
def test_a_read_only_rkey_is_a_bearer_credential_ucx_does_not_limit(target, tls) -> None:
    """What the docs say UCX does not enforce: a put with a read-only region's rkey lands (cma, tcp).

    A member fetches the worker address and the rkey over the authenticated
    channel; a process that never authenticated then uses them with raw UCP.
    The target mapped the region without PROT_REMOTE_WRITE; only an RDMA NIC
    would refuse the put. mpcomm's own initiators refuse it (test_ucx_security).
    """
    target.cmd("register ro 8192 r buffer")
    with mpcomm.Engine(transports=["ucx"], secret=SECRET) as member:
        remote = member.open(target.address, "ro", timeout=10)
    link = member_link(target.address)
    try:
        worker = link.info.transports["ucx"]["worker"]
        grant = link.request({"t": "transport", "name": "ucx", "body": {
            "op": "attach", "region_id": remote.region_id, "token": remote.token, "epoch": remote.epoch}}, 10)["body"]
    finally:
        link.close()
    assert grant["access"] == "r"
    env = dict(os.environ, **({"UCX_TLS": tls} if tls else {}), UCX_RNDV_THRESH="inf")
    stranger = subprocess.run(
        [sys.executable, os.path.join(HERE, "ucp_peer.py"), "initiator", "--size", "4096", "--offset", "0", "--eh", "1"],
        input=json.dumps({"address": worker, "rkey": grant["rkey"], "base": grant["base"], "size": grant["size"]}) + "\n",
        capture_output=True, text=True, timeout=60, env=env)
    assert stranger.returncode == 0, stranger.stderr[-2000:]
    assert json.loads(stranger.stdout.splitlines()[0])["roundtrip_ok"]
    assert target.cmd("count ro 0")["n"] < 8192  # the put landed: UCX did not refuse it


def test_the_target_hands_no_rkey_to_a_write_claim_on_a_read_only_region(target) -> None:
    """The target's control path refuses an attach that asks to write a read-only region (no rkey leaves)."""
    target.cmd("register ro 8192 r buffer")
    target.cmd("register rw 8192 rw buffer")
    with mpcomm.Engine(transports=["ucx"], secret=SECRET) as member:
        ro, rw = member.open(target.address, "ro", timeout=10), member.open(target.address, "rw", timeout=10)
    link = member_link(target.address)
    try:
        def attach(remote, access):  # type: ignore[no-untyped-def]
            return link.request({"t": "transport", "name": "ucx", "body": {
                "op": "attach", "region_id": remote.region_id, "token": remote.token, "epoch": remote.epoch,
                "access": access}}, 10)["body"]

        for claim in ("w", "rw"):
            with pytest.raises(mpcomm.PermissionDeniedError, match="may not be written"):
                attach(ro, claim)
        assert attach(ro, "r")["access"] == "r"
        assert attach(rw, "rw")["access"] == "rw"
        with pytest.raises(mpcomm.ProtocolError):
            attach(ro, "rwx")
    finally:
        link.close()
