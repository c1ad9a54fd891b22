"""Garbage from a peer closes that one connection and never takes the node down.

The target runs in its own process (the conformance kit's target); raw sockets
send it junk on its control endpoint and on its tcp data port, then a normal
open + write must still work and the process must still be alive.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import struct
import time
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import mpcomm
from rawpeer import RawPeer, split_frames

from mpcomm import auth, wire
from mpcomm.control import PeerLink
from mpcomm.peer import PeerInfo, parse_endpoint
from mpcomm.testing.patterns import pattern

from mpcomm.auth import client_authenticate
from mpcomm.plugins.tcp import wire as tcp_wire

REQ = tcp_wire.REQ  # the tcp transport's request header
RESP = tcp_wire.RESP


def expect_closed(sock: socket.socket, timeout: float = 5.0) -> bytes:
    """Read until the peer closes; returns what it sent before closing."""
    sock.settimeout(timeout)
    got = bytearray()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            return bytes(got)
        if not chunk:
            return bytes(got)
        got += chunk
    raise AssertionError("the node kept a garbage connection open")


def header(magic: bytes = b"MC", version: int = wire.PROTOCOL_VERSION, ftype: int = wire.T_JSON,
           length: int = 0) -> bytes:
    return wire.HEADER.pack(magic, version, ftype, 0, 0, length)


def json_frame(obj: Any) -> bytes:
    payload = json.dumps(obj).encode()
    return header(length=len(payload)) + payload


PRE_AUTH_GARBAGE = {  # sent as the very first bytes, where the auth proof belongs
    "random": os.urandom(4096),
    "http": b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",
    "an old client's hello": json_frame({"t": "hello", "proto": 1, "nonce": "00" * 16, "auth": False}),
    "wrong magic": wire.HEADER.pack(b"XX", 1, 2, 0, 0, 64) + bytes(64),
    "wrong version": wire.HEADER.pack(b"MA", 99, 2, 0, 0, 64) + bytes(64),
    "wrong auth frame type": wire.HEADER.pack(b"MA", 1, 3, 0, 0, 64) + bytes(64),
    "auth frame too long": wire.HEADER.pack(b"MA", 1, 2, 0, 0, 0xFFFFFFFF),
    "auth frame too short": wire.HEADER.pack(b"MA", 1, 2, 0, 0, 8) + bytes(8),
    "truncated header": b"MA\x01",
    "truncated proof": wire.HEADER.pack(b"MA", 1, 2, 0, 0, 64) + bytes(10),
}

HELLO_GARBAGE = {  # sent after a correct authentication, where the hello belongs
    "oversized length": header(length=0xFFFFFFFF),
    "just over the limit": header(length=wire.MAX_CONTROL_PAYLOAD + 1),
    "wrong frame type": header(ftype=77, length=2) + b"{}",
    "not json": header(length=5) + b"\xff\xfe{[}",
    "json array": json_frame([1, 2, 3]),
    "untyped object": json_frame({"x": 1}),
    "not a hello": json_frame({"t": "lookup", "name": "kv"}),
    "future protocol": json_frame({"t": "hello", "proto": 99, "info": {}}),
    "no info": json_frame({"t": "hello", "proto": 1}),
    "deeply nested": header(length=200_011) + b'{"t":"hello","x":' + b"[" * 100_000 + b"]" * 100_000 + b"}",
    "huge integer": header(length=100_012) + b'{"t":"hello","proto":' + b"9" * 99_990 + b"}",
    "truncated payload": header(length=100) + b"{",
}

REQUEST_GARBAGE = {  # sent after a welcome, where requests belong
    "deeply nested": header(length=200_011) + b'{"t":"lookup","x":' + b"[" * 100_000 + b"]" * 99_999 + b"}",
    "nested within the parser's limit": json_frame({"t": "lookup", "name": "kv", "x": eval("[" * 200 + "]" * 200)}),
    "string id": json_frame({"t": "ping", "id": "1"}),
    "list id": json_frame({"t": "ping", "id": [1]}),
    "negative id": json_frame({"t": "ping", "id": -5}),
    "oversized length": header(length=0xFFFFFFFF),
    "random": os.urandom(512),
}


@pytest.fixture(scope="module")
def target() -> Any:
    from core_support import Target

    t = Target({"kv": [1 << 16, "buffer"]})
    yield t
    t.close()


def data_port(address: str) -> tuple[str, int]:
    """The target's tcp data port, from its handshake (what an engine's info() publishes)."""
    return data_port_and_epoch(address)[0]


def data_port_and_epoch(address: str) -> tuple[tuple[str, int], str]:
    probe = PeerInfo(node_id="probe" + os.urandom(4).hex(), epoch=os.urandom(8).hex(), address="127.0.0.1:1")
    link = PeerLink(address, local_info=probe, secret="", timeout=5, on_lost=lambda _l: None)
    try:
        port, epoch = link.info.transports["tcp"]["port"], link.info.epoch
    finally:
        link.close()
    return (parse_endpoint(address)[0], int(port)), epoch


def data_connection(address: str) -> socket.socket:
    """A tcp data connection past HELLO and the (secret-less) authentication, ready for requests."""
    where, epoch = data_port_and_epoch(address)
    s = socket.create_connection(where, timeout=5)
    me, them = tcp_wire.ident("garbage-test"), tcp_wire.ident(epoch)
    s.sendall(tcp_wire.HELLO.pack(tcp_wire.HELLO_MAGIC, tcp_wire.VERSION, 0, me, them))
    client_authenticate(s, "", time.monotonic() + 5, tcp_wire.context(me, them))
    s.settimeout(5)
    return s


def assert_still_serves(target: Any, seed: int) -> None:
    with mpcomm.Engine(transports=["tcp"]) as initiator:
        remote = initiator.open(target.address, "kv", timeout=5)
        data = pattern(seed, 4096)
        initiator.write(data, remote, remote_offset=123).result(5)
        assert target.cmd("sha", "kv", 123, 4096) == hashlib.sha256(data).hexdigest()
    assert target.alive


def check_reply(reply: bytes) -> None:
    """Whatever the node sent back is well-formed: its auth challenge, then at most a refusal."""
    frames = split_frames(reply)
    assert frames and frames[0][:2] == (b"MA", auth.T_CHALLENGE), reply[:64]
    for magic, ftype, _flags, payload in frames[1:]:
        if magic == b"MA":
            assert ftype == auth.T_RESULT
        else:
            assert magic == wire.CONTROL_MAGIC and json.loads(payload)["t"] in ("error", "welcome")


def send_then_expect_closed(p: RawPeer, data: bytes, half_close: bool) -> bytes:
    try:
        p.sock.sendall(data)
        if half_close:
            p.sock.shutdown(socket.SHUT_WR)
    except OSError:
        pass  # it may close on us mid-send: that is the point
    return p.expect_closed()


@pytest.mark.parametrize("what", sorted(PRE_AUTH_GARBAGE))
def test_control_endpoint_survives_garbage_instead_of_a_proof(target: Any, what: str) -> None:
    with RawPeer(target.address) as p:
        reply = send_then_expect_closed(p, PRE_AUTH_GARBAGE[what], what.startswith("truncated"))
    check_reply(reply)
    assert target.alive


@pytest.mark.parametrize("what", sorted(HELLO_GARBAGE))
def test_control_endpoint_survives_garbage_instead_of_a_hello(target: Any, what: str) -> None:
    with RawPeer(target.address) as p:
        p.authenticate()
        reply = send_then_expect_closed(p, HELLO_GARBAGE[what], what.startswith("truncated"))
    for magic, _t, _f, payload in split_frames(reply):  # a refusal, if anything
        assert magic == wire.CONTROL_MAGIC and json.loads(payload)["t"] == "error"
    assert target.alive


@pytest.mark.parametrize("what", sorted(REQUEST_GARBAGE))
def test_control_endpoint_survives_garbage_requests(target: Any, what: str) -> None:
    with RawPeer(target.address) as p:
        p.join()
        try:
            p.sock.sendall(REQUEST_GARBAGE[what])
        except OSError:
            pass
        if what == "nested within the parser's limit":  # deeper than MAX_JSON_DEPTH, shallower than json's own
            assert_closed_or_error(p)
        else:
            p.expect_closed()
    assert target.alive
    assert_still_serves(target, seed=len(what))


def assert_closed_or_error(p: RawPeer) -> None:
    try:
        reply = wire.read_json(p.sock)
    except (mpcomm.PeerConnectionError, ConnectionResetError):
        return
    assert reply["t"] == "error"


def test_control_endpoint_after_a_flood_of_garbage(target: Any) -> None:
    socks = []
    for what in [*PRE_AUTH_GARBAGE.values(), *PRE_AUTH_GARBAGE.values()]:  # many at once, all open together
        s = socket.create_connection(parse_endpoint(target.address), timeout=5)
        try:
            s.sendall(what)
        except OSError:
            pass
        socks.append(s)
    assert_still_serves(target, seed=1)
    for s in socks:
        s.close()
    assert_still_serves(target, seed=2)


def test_parse_json_never_raises_recursion_error() -> None:
    for depth in (wire.MAX_JSON_DEPTH + 1, 2000, 200_000):
        payload = b'{"t":"x","a":' + b"[" * depth + b"]" * depth + b"}"
        with pytest.raises(mpcomm.ProtocolError, match="nests deeper"):
            wire.parse_json(payload)
    ok = b'{"t":"x","a":' + b"[" * (wire.MAX_JSON_DEPTH - 1) + b"]" * (wire.MAX_JSON_DEPTH - 1) + b"}"
    assert wire.parse_json(ok)["t"] == "x"


def req(magic: bytes = b"MQ", op: int = 2, region_id: int = 0, token: int = 0, epoch: int = 0, offset: int = 0,
        length: int = 0, deadline: float | None = None) -> bytes:
    return REQ.pack(magic, op, 0, 0, 1, region_id, token, epoch, offset, length,
                    time.time() + 10 if deadline is None else deadline)


DATA_GARBAGE = {
    "random": os.urandom(REQ.size * 3),
    "wrong magic": req(magic=b"ZZ"),
    "unknown op": req(op=9),
    "truncated header": req()[:17],
    "nan deadline": req(deadline=float("nan")),
}


@pytest.mark.parametrize("what", sorted(DATA_GARBAGE))
@pytest.mark.parametrize("where", ["before hello", "after authentication"])
def test_data_port_survives(target: Any, what: str, where: str) -> None:
    opened = data_connection(target.address) if where != "before hello" else \
        socket.create_connection(data_port(target.address), timeout=5)
    with opened as s:
        try:
            s.sendall(DATA_GARBAGE[what])
            if what == "truncated header":
                s.shutdown(socket.SHUT_WR)
        except OSError:
            pass
        assert expect_closed(s) == b""  # no reply to garbage: the connection is dropped
    assert target.alive


def test_data_port_refuses_bad_requests_without_touching_memory(target: Any) -> None:
    with mpcomm.Engine(transports=["tcp"]) as initiator:
        remote = initiator.open(target.address, "kv")
    target.cmd("fill", "kv", 7)
    before = target.cmd("sha", "kv", 0, remote.size)
    epoch = int(remote.epoch, 16)
    cases = {
        "unknown region": req(region_id=999_999, token=remote.token, epoch=epoch, length=8),
        "wrong token": req(region_id=remote.region_id, token=remote.token ^ 1, epoch=epoch, length=8),
        "stale epoch": req(region_id=remote.region_id, token=remote.token, epoch=epoch ^ 1, length=8),
        "oversized read": req(region_id=remote.region_id, token=remote.token, epoch=epoch, length=1 << 60),
        "past the end": req(region_id=remote.region_id, token=remote.token, epoch=epoch,
                            offset=remote.size - 4, length=8),
        "expired": req(region_id=remote.region_id, token=remote.token, epoch=epoch, length=8, deadline=1.0),
        "refused write": req(op=1, region_id=remote.region_id, token=remote.token, epoch=epoch,
                             offset=remote.size - 4, length=8) + b"\xAA" * 8,
    }
    with data_connection(target.address) as s:
        for what, frame in cases.items():  # one connection: each refusal leaves it usable
            s.sendall(frame)
            head = b""
            while len(head) < RESP.size:
                chunk = s.recv(RESP.size - len(head))
                assert chunk, f"connection closed after {what}"
                head += chunk
            magic, status, _f, _count, _rid, length = RESP.unpack(head)
            assert (magic, status) == (b"MR", 1), what
            body = b""
            while len(body) < length:
                body += s.recv(length - len(body))
            assert json.loads(body)["code"] in (
                "unknown_region", "permission_denied", "stale_region", "out_of_bounds", "timeout"), what
    assert target.cmd("sha", "kv", 0, remote.size) == before
    assert_still_serves(target, seed=3)


def test_data_port_oversized_write_then_hang_up(target: Any) -> None:
    """A write announcing 2**60 bytes to a bad region, then the peer vanishes."""
    with data_connection(target.address) as s:
        s.sendall(req(op=1, region_id=12345, length=1 << 60) + os.urandom(1 << 16))
    assert_still_serves(target, seed=4)


# -- read_frame over arbitrary bytes ----------------------------------------------------


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.one_of(
    st.binary(max_size=64),
    st.builds(lambda h, rest: h + rest,
              st.builds(lambda v, t, n: wire.HEADER.pack(b"MC", v, t, 0, 0, n),
                        st.integers(0, 3), st.integers(0, 3), st.integers(0, 80)),
              st.binary(max_size=80)),
))
def test_read_frame_fuzz(data: bytes) -> None:
    a, b = socket.socketpair()
    try:
        a.sendall(data)
        a.shutdown(socket.SHUT_WR)
        b.settimeout(2)
        try:
            ftype, _flags, payload = wire.read_frame(b, wire.CONTROL_MAGIC, 64)
        except (mpcomm.ProtocolError, mpcomm.PeerConnectionError):
            return
        # It parsed: then it really was a well-formed frame within the limit.
        m, version, _t, _f, _r, length = wire.HEADER.unpack(data[: wire.HEADER.size])
        assert (m, version) == (wire.CONTROL_MAGIC, wire.PROTOCOL_VERSION)
        assert length <= 64 and payload == data[wire.HEADER.size : wire.HEADER.size + length]
        assert ftype == data[3]
        c, d = socket.socketpair()
        try:
            c.sendall(data)
            c.close()
            d.settimeout(2)
            try:
                obj = wire.read_json(d)
            except (mpcomm.ProtocolError, mpcomm.PeerConnectionError):
                return
            assert isinstance(obj, dict) and isinstance(obj["t"], str)
        finally:
            d.close()
    finally:
        a.close()
        b.close()
