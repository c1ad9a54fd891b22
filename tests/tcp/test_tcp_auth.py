"""Data-port authentication: with a secret, nothing is read or written before the peer proved it knows it."""

from __future__ import annotations

import hashlib
import os
import time
from typing import Any

import pytest
from tcp_support import closed, reply, req

import mpcomm
from mpcomm.auth import client_authenticate, server_authenticate
from mpcomm.plugins.tcp import wire

SECRET = "7f3c9a1e5b2d4c6e8a0b1c2d3e4f5a6b7c8d9e0f1a2b3c4d5e6f708192a3b4c5"


def test_engines_with_the_secret_move_data(spawn: Any, make_engine: Any) -> None:
    target = spawn(secret=SECRET)
    ini = make_engine(secret=SECRET)
    remote = ini.open(target.address, "kv")
    data = os.urandom(8192)
    ini.write(data, remote, 100).result(5)
    assert target.cmd("sha kv 100 8192") == hashlib.sha256(data).hexdigest()
    back = bytearray(8192)
    ini.read(back, remote, 100).result(5)
    assert bytes(back) == data


@pytest.mark.parametrize("how", ["no secret", "wrong secret", "request instead of proof"])
def test_without_the_secret_nothing_is_read_or_written(spawn: Any, make_engine: Any, how: str) -> None:
    target = spawn(secret=SECRET)
    remote = make_engine(secret=SECRET).open(target.address, "kv")  # a leaked descriptor
    target.cmd("fill kv 5")
    before = target.cmd(f"sha kv 0 {remote.size}")
    write = req(wire.OP_WRITE, remote=remote, length=4096) + b"\xcc" * 4096
    read = req(remote=remote, length=4096)
    s = target.raw(hello=False)
    s.sendall(wire.HELLO.pack(wire.HELLO_MAGIC, wire.VERSION, 0, wire.ident("thief"), wire.ident(target.epoch)))
    if how == "request instead of proof":
        s.recv(32)  # the server's nonce
        s.sendall(write + read)
    else:
        with pytest.raises((mpcomm.AuthenticationError, mpcomm.ProtocolError, mpcomm.PeerConnectionError)):
            client_authenticate(s, "" if how == "no secret" else "x" * 32, time.monotonic() + 5,
                                wire.context(wire.ident("thief"), wire.ident(target.epoch)))
        try:
            s.sendall(write + read)
        except OSError:
            pass
    assert closed(s)
    assert target.cmd(f"sha kv 0 {remote.size}") == before


def test_a_side_with_a_secret_and_a_side_without_refuse_each_other() -> None:
    """The exchange itself, over a socketpair: a server without a secret refuses a client with one."""
    import socket
    import threading

    a, b = socket.socketpair()
    errors: list[BaseException] = []

    def serve() -> None:
        try:
            server_authenticate(b, "", time.monotonic() + 5, b"ctx")
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)
        finally:
            b.close()

    th = threading.Thread(target=serve)
    th.start()
    with pytest.raises((mpcomm.AuthenticationError, mpcomm.PeerConnectionError)):
        client_authenticate(a, SECRET, time.monotonic() + 5, b"ctx")
    a.close()
    th.join(5)
    # The server without a secret refused the client's real proof before revealing anything.
    assert errors and isinstance(errors[0], mpcomm.AuthenticationError)


def test_the_proof_is_bound_to_the_target_instance(spawn: Any) -> None:
    target = spawn(secret=SECRET)
    s = target.raw(hello=False)
    s.sendall(wire.HELLO.pack(wire.HELLO_MAGIC, wire.VERSION, 0, wire.ident("x"), wire.ident("0" * 16)))
    assert closed(s)  # another epoch: refused before any exchange


def test_authentication_has_a_deadline(spawn: Any) -> None:
    target = spawn(secret=SECRET, config={"transport": {"handshake_timeout_ms": 500}})
    s = target.raw(hello=False)
    s.sendall(wire.HELLO_MAGIC)  # then one byte at a time, too slowly
    t0 = time.monotonic()
    for b in wire.HELLO.pack(wire.HELLO_MAGIC, wire.VERSION, 0, wire.ident("x"), wire.ident(target.epoch))[2:]:
        try:
            s.send(bytes([b]))
        except OSError:
            break
        time.sleep(0.1)
        if time.monotonic() - t0 > 3:
            break
    assert closed(s, timeout=2)
    assert time.monotonic() - t0 < 3


def test_authenticated_raw_client_is_served(spawn: Any, make_engine: Any) -> None:
    target = spawn(secret=SECRET)
    remote = make_engine(secret=SECRET).open(target.address, "kv")
    s = target.raw()  # with the target's secret
    s.sendall(req(remote=remote, length=64))
    status, _rid, _n, body = reply(s)
    assert status == wire.ST_OK and len(body) == 64
