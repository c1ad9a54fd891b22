"""Only the owner of a region can act on it (issue 11): a hostile third process
that claims another peer's identity can neither revoke an initiator's access
nor dodge the owner's revocation."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

import mpcomm

HOSTILE = str(Path(__file__).with_name("shm_hostile.py"))


def _hostile(action: str, victim: str, target: str, rid: int, token: int) -> dict[str, str]:
    proc = subprocess.run([sys.executable, HOSTILE, action, victim, target, str(rid), str(token)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("name", ["mem", "buf"])
def test_impostor_cannot_revoke(spawn, initiator: mpcomm.Engine, name: str) -> None:
    target = spawn({"mem": [1 << 20, "allocate"], "buf": [1 << 20, "buffer"]})
    remote = initiator.open(target.address, name)
    initiator.write(b"a" * 4096, remote).result(10)  # mapped / attached
    out = _hostile("revoke", initiator.address, target.address, remote.region_id, remote.token)
    assert out["no_keys"].startswith("error ProtocolError"), out
    assert json.loads(out["guessed"])["revoked"] == 0, out
    assert json.loads(out["own_key"])["revoked"] == 0, out  # a real key, but not the victim's grant
    assert out["garbage"].startswith("error ProtocolError"), out
    # The owner's region still works through the old descriptor and after re-opening.
    initiator.write(b"b" * 4096, remote).result(10)
    again = initiator.open(target.address, name)
    initiator.write(b"c" * 4096, again, 4096).result(10)
    assert target.cmd("sha", name, 0, 8192) == hashlib.sha256(b"b" * 4096 + b"c" * 4096).hexdigest()
    # ...and the owner's own revocation still works.
    assert target.cmd("unregister", name) == "ok"
    with pytest.raises(mpcomm.UnknownRegionError):
        initiator.write(b"d" * 4096, remote).result(10)


@pytest.mark.parametrize("name", ["mem", "buf"])
def test_impostor_attach_does_not_hide_the_victim_from_revocation(spawn, initiator: mpcomm.Engine,
                                                                 name: str) -> None:
    target = spawn({"mem": [1 << 20, "allocate"], "buf": [1 << 20, "buffer"]})
    remote = initiator.open(target.address, name)
    initiator.write(b"a" * 4096, remote).result(10)
    out = _hostile("attach", initiator.address, target.address, remote.region_id, remote.token)
    assert not any(v.startswith("error") for v in out.values()), out  # it holds the token: it may attach
    assert target.cmd("unregister", name) == "ok"
    with pytest.raises(mpcomm.UnknownRegionError):
        initiator.write(b"e" * 4096, remote).result(10)
    if name == "buf":  # nothing landed in the target's buffer after unregister returned
        assert target.cmd("raw", name, 0, 4096) == hashlib.sha256(b"a" * 4096).hexdigest()


def test_revocation_holds_for_plain_buffers(spawn, initiator: mpcomm.Engine) -> None:
    """After the target's unregister returns, no write through an old descriptor lands (``fence``)."""
    target = spawn({"buf": [1 << 20, "buffer"]})
    remote = initiator.open(target.address, "buf")
    initiator.write(b"1" * 8192, remote).result(10)
    assert target.cmd("unregister", "buf") == "ok"
    for size in (16, 4096, 1 << 20):
        with pytest.raises(mpcomm.AccessError):
            initiator.write(b"2" * size, remote).result(10)
    assert target.cmd("raw", "buf", 0, 8192) == hashlib.sha256(b"1" * 8192).hexdigest()
    assert initiator.transports["shm"].capabilities.revocation == "fence"


def test_stalled_fd_clients_do_not_block_attaching(spawn, initiator: mpcomm.Engine) -> None:
    """Any local process can connect to the fd socket; clients that never speak cost a slot, not the listener."""
    import socket
    import time

    from mpcomm.control import PeerLink
    from mpcomm.peer import PeerInfo, host_identity

    target = spawn({"mem": [1 << 20, "allocate"]})
    me = PeerInfo(node_id="x", epoch="y", address="127.0.0.1:1", host=host_identity(), transports={})
    link = PeerLink(target.address, local_info=me, secret="", timeout=5, on_lost=lambda link: None)
    name = link.info.transports["shm"]["socket"]
    link.close()
    stalled = []
    try:
        for _ in range(40):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.connect("\0" + name)
            stalled.append(s)
        t0 = time.monotonic()
        initiator.write(b"q" * 4096, initiator.open(target.address, "mem"), timeout=5).result(10)
        assert time.monotonic() - t0 < 2.5
        assert target.cmd("sha", "mem", 0, 4096) == hashlib.sha256(b"q" * 4096).hexdigest()
    finally:
        for s in stalled:
            s.close()
