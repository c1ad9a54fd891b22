"""Only the owner of a region can act on it (issue 11): a hostile third process
that claims another peer's identity can neither revoke an initiator's access
nor dodge the owner's revocation."""

from __future__ import annotations

import dataclasses
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


def test_garbage_fd_requests_are_answered_and_the_listener_keeps_serving(spawn, initiator: mpcomm.Engine) -> None:
    """Any local process can speak to the fd socket: JSON nested past the limit, a list, wrong types or bytes
    that are not JSON get "malformed request", and the next honest attach works."""
    import socket

    from mpcomm.control import PeerLink
    from mpcomm.peer import PeerInfo, host_identity

    target = spawn({"mem": [1 << 20, "allocate"]})
    me = PeerInfo(node_id="x", epoch="y", address="127.0.0.1:1", host=host_identity(), transports={})
    link = PeerLink(target.address, local_info=me, secret="", timeout=5, on_lost=lambda link: None)
    name = link.info.transports["shm"]["socket"]
    link.close()
    for junk in (b"[" * 1000 + b"]" * 1000, b"[1, 2]", b'{"region_id": [], "token": 1, "nonce": 1}',
                 b"\xff\xfe", b'{"region_id": 1e999, "token": 1, "nonce": "n"}'):
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(10)
            s.connect("\0" + name)
            s.sendall(junk)
            msg, fds, _flags, _addr = socket.recv_fds(s, 4096, 1)
            assert not fds
            assert json.loads(msg) == {"error": "malformed request"}, junk[:40]
    initiator.write(b"g" * 4096, initiator.open(target.address, "mem"), timeout=5).result(10)
    assert target.cmd("sha", "mem", 0, 4096) == hashlib.sha256(b"g" * 4096).hexdigest()


# -- issue 30, item 2: read-only regions are read-only in the kernel -----------------------


def test_a_member_cannot_map_a_read_only_memfd_for_writing(spawn, initiator: mpcomm.Engine) -> None:
    """The memfd of a read-only region is handed out O_RDONLY and sealed F_SEAL_FUTURE_WRITE."""
    target = spawn({"ro": [1 << 20, "allocate-r"], "rw": [1 << 20, "allocate"]})
    target.cmd("fill", "ro", 7)
    before = target.cmd("sha", "ro", 0, 1 << 20)
    remote = initiator.open(target.address, "ro")
    out = _hostile("map_rw", initiator.address, target.address, remote.region_id, remote.token)
    assert out["grant"] == "r" and out["fd_mode"] == "O_RDONLY", out
    assert out["map_shared_write"].startswith("PermissionError") and "errno 13" in out["map_shared_write"], out
    assert out["pwrite"].startswith(("OSError", "PermissionError")), out  # EBADF on O_RDONLY
    assert out["reopen_rw_map_shared_write"].startswith("PermissionError"), out  # the seal: EPERM
    assert out["map_shared_read"] == "ok", out
    assert target.cmd("sha", "ro", 0, 1 << 20) == before
    # A well-behaved member still reads it over shm, and is refused a write before anything moves.
    back = bytearray(4096)
    initiator.read(back, remote).result(10)
    with pytest.raises(mpcomm.PermissionDeniedError):
        initiator.write(b"x" * 4096, remote).result(10)
    assert target.cmd("sha", "ro", 0, 1 << 20) == before
    # A writable region is still handed out writable.
    rw = initiator.open(target.address, "rw")
    out = _hostile("map_rw", initiator.address, target.address, rw.region_id, rw.token)
    assert out["grant"] == "rw" and out["map_shared_write"] == "ok", out


def test_cma_writes_to_a_read_only_buffer_are_refused(spawn, initiator: mpcomm.Engine) -> None:
    """A plain read-only buffer goes over cma: the target grants "r" at attach, and no write moves a byte.

    The kernel cannot tell a process_vm_writev from a process_vm_readv by a
    process allowed to ptrace the target (docs/security.md): on this route
    the refusal is the initiator's mpcomm acting on the target's grant.
    """
    target = spawn({"ro": [1 << 16, "buffer-r"]})
    target.cmd("fill", "ro", 3)
    before = target.cmd("raw", "ro", 0, 1 << 16)
    remote = initiator.open(target.address, "ro")
    back = bytearray(1 << 16)
    initiator.read(back, remote).result(10)
    assert hashlib.sha256(back).hexdigest() == before
    with pytest.raises(mpcomm.PermissionDeniedError):
        initiator.write(b"w" * 16, remote).result(10)  # the descriptor says "r"
    # A descriptor that claims "rw" (forged, or stale) is checked against the target's grant.
    forged = dataclasses.replace(remote, access="rw")
    for size in (16, 4096, 1 << 16):
        with pytest.raises(mpcomm.PermissionDeniedError, match="may not be written"):
            initiator.write(b"w" * size, forged).result(10)
    assert target.cmd("raw", "ro", 0, 1 << 16) == before


@pytest.mark.parametrize("how", ["allocate-r", "buffer-r"])
def test_the_target_refuses_a_write_route_to_a_read_only_region(spawn, initiator: mpcomm.Engine, how: str) -> None:
    """An attach that asks to write a read-only region is refused by the target: no memfd, no cma base."""
    from mpcomm.control import PeerLink
    from mpcomm.peer import PeerInfo

    target = spawn({"ro": [1 << 16, how]})
    remote = initiator.open(target.address, "ro")
    me = PeerInfo(node_id="member-x", epoch="e" * 16, address="127.0.0.1:1", host={}, transports={})
    link = PeerLink(target.address, local_info=me, secret="", timeout=5, on_lost=lambda link: None)
    try:
        for claim in ("w", "rw"):
            with pytest.raises(mpcomm.PermissionDeniedError, match="may not be written"):
                link.request({"t": "transport", "name": "shm", "body": {
                    "op": "attach", "region_id": remote.region_id, "token": remote.token, "epoch": remote.epoch,
                    "access": claim}}, 5)
        ok = link.request({"t": "transport", "name": "shm", "body": {
            "op": "attach", "region_id": remote.region_id, "token": remote.token, "epoch": remote.epoch,
            "access": "r"}}, 5)["body"]
        assert ok["access"] == "r"
    finally:
        link.close()
