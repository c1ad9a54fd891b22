"""The control handshake: shared-secret authentication, the secret never on the wire,
handshake deadlines on both sides, and IPv6."""

from __future__ import annotations

import logging
import socket
import threading
import time
from typing import Any

import pytest
from core_support import RecordingProxy

import mpcomm
from mpcomm.peer import parse_endpoint

SECRET = "correct horse battery staple"


def round_trip(target: mpcomm.Engine, initiator: mpcomm.Engine, address: str | None = None) -> None:
    buf = bytearray(256)
    target.register(buf, name="kv")
    remote = initiator.open(address or target.address, "kv")
    payload = bytes(range(256))
    assert initiator.write(payload, remote).result(5) == 256
    assert bytes(buf) == payload
    back = bytearray(256)
    initiator.read(back, remote).result(5)
    assert bytes(back) == payload


def test_secret_on_both_sides(make_engine: Any) -> None:
    round_trip(make_engine(secret=SECRET), make_engine(secret=SECRET))


def test_secret_from_environment(make_engine: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MPCOMM_SECRET", SECRET)
    target = make_engine()
    assert target.config.transport.secret == SECRET
    round_trip(target, make_engine(secret=SECRET))


def test_mismatched_secret_is_refused(make_engine: Any) -> None:
    target = make_engine(secret=SECRET)
    target.register(bytearray(16), name="kv")
    initiator = make_engine(secret="wrong " + SECRET)
    with pytest.raises(mpcomm.AuthenticationError) as info:
        initiator.open(target.address, "kv", timeout=3)
    assert info.value.retryable is False
    # The target is unharmed: a peer with the right secret still gets in.
    round_trip_ok = make_engine(secret=SECRET)
    assert round_trip_ok.open(target.address, "kv").size == 16


@pytest.mark.parametrize("who", ["target", "initiator"])
def test_secret_on_one_side_only_is_a_clear_error(make_engine: Any, who: str) -> None:
    target = make_engine(secret=SECRET if who == "target" else None)
    target.register(bytearray(16), name="kv")
    initiator = make_engine(secret=SECRET if who == "initiator" else None)
    with pytest.raises(mpcomm.AuthenticationError, match="secret"):
        initiator.open(target.address, "kv", timeout=3)


def test_secret_never_travels(make_engine: Any) -> None:
    target = make_engine(secret=SECRET)
    initiator = make_engine(secret=SECRET)
    proxy = RecordingProxy(parse_endpoint(target.address))
    try:
        round_trip(target, initiator, address=proxy.address)
        seen = bytes(proxy.seen)
    finally:
        proxy.close()
    assert b'"t":"hello"' in seen and b'"t":"welcome"' in seen  # we did capture the handshake
    assert b'"t":"challenge"' in seen and b'"proof":"' in seen
    for form in (SECRET.encode(), SECRET.encode().hex().encode(), SECRET.encode("utf-16-le")):
        assert form not in seen


def test_client_handshake_deadline(make_engine: Any) -> None:
    """A server that accepts and never answers: open() gives up within the handshake deadline."""
    silent = socket.create_server(("127.0.0.1", 0))
    held: list[socket.socket] = []

    def accept() -> None:
        while True:
            try:
                held.append(silent.accept()[0])
            except OSError:
                return

    threading.Thread(target=accept, daemon=True).start()
    try:
        initiator = make_engine({"transport": {"handshake_timeout_ms": 300}})
        start = time.monotonic()
        with pytest.raises(mpcomm.PeerConnectionError, match="timed out"):
            initiator.open(f"127.0.0.1:{silent.getsockname()[1]}", "kv", timeout=30)
        took = time.monotonic() - start
        assert 0.25 <= took < 1.5
    finally:
        silent.close()
        for s in held:
            s.close()


def test_server_handshake_deadline(make_engine: Any) -> None:
    """A client that connects and says nothing is dropped after the handshake deadline."""
    target = make_engine({"transport": {"handshake_timeout_ms": 300}})
    with socket.create_connection(parse_endpoint(target.address)) as s:
        s.settimeout(5)
        start = time.monotonic()
        assert s.recv(1) == b""
        took = time.monotonic() - start
    assert 0.2 <= took < 2.0
    # And the node still serves others.
    round_trip(target, make_engine())


def test_connection_refused_is_a_peer_connection_error(make_engine: Any) -> None:
    s = socket.create_server(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    start = time.monotonic()
    with pytest.raises(mpcomm.PeerConnectionError):
        make_engine().open(f"127.0.0.1:{port}", "kv")
    assert time.monotonic() - start < 1.0


def _ipv6_loopback_usable() -> bool:
    if not socket.has_ipv6:
        return False
    try:
        with socket.create_server(("::1", 0), family=socket.AF_INET6) as s:
            with socket.create_connection(("::1", s.getsockname()[1]), timeout=1):
                return True
    except OSError:
        return False


@pytest.mark.skipif(not _ipv6_loopback_usable(), reason="::1 is not usable on this machine")
def test_ipv6_end_to_end(make_engine: Any) -> None:
    target = make_engine(endpoint="[::1]:0", secret=SECRET)
    initiator = make_engine(endpoint="[::1]:0", secret=SECRET)
    assert target.address.startswith("[::1]:")
    round_trip(target, initiator)


def test_unknown_region_name(make_engine: Any) -> None:
    target = make_engine()
    with pytest.raises(mpcomm.UnknownRegionError, match="nope"):
        make_engine().open(target.address, "nope")


def test_open_against_a_garbage_server(make_engine: Any) -> None:
    """A server that answers the hello with junk: a prompt ProtocolError, no hang."""
    junk = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        try:
            conn, _ = junk.accept()
        except OSError:
            return
        with conn:
            conn.recv(65536)
            conn.sendall(b"HTTP/1.1 400 Bad Request\r\n\r\n" + b"x" * 64)

    threading.Thread(target=serve, daemon=True).start()
    try:
        start = time.monotonic()
        with pytest.raises((mpcomm.ProtocolError, mpcomm.PeerConnectionError)):
            make_engine().open(f"127.0.0.1:{junk.getsockname()[1]}", "kv", timeout=10)
        assert time.monotonic() - start < 2
    finally:
        junk.close()


def test_malformed_peer_info_is_logged_and_closed(make_engine: Any, caplog: pytest.LogCaptureFixture,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """A peer that passes the challenge but describes itself badly is dropped with a logged
    reason, and the serving thread does not die with an unhandled exception."""
    from mpcomm import wire

    crashes: list[Any] = []
    monkeypatch.setattr(threading, "excepthook", crashes.append)
    target = make_engine()
    bad_infos = [
        {"node_id": "a", "epoch": "b", "address": "c", "transports": [1, 2]},
        {"node_id": "a", "epoch": "b", "address": "c", "host": "not a dict"},
        {"node_id": "a"},
        [1, 2, 3],
    ]
    with caplog.at_level(logging.WARNING, logger="mpcomm.control"):
        for info in bad_infos:
            with socket.create_connection(parse_endpoint(target.address), timeout=5) as s:
                wire.send_json(s, {"t": "hello", "proto": wire.PROTOCOL_VERSION, "node_id": "x", "epoch": "y",
                                   "nonce": "00" * 16, "auth": False})
                assert wire.read_json(s)["t"] == "challenge"
                wire.send_json(s, {"t": "auth", "proof": "", "info": info})
                with pytest.raises(mpcomm.PeerConnectionError):
                    wire.read_json(s)  # closed without a welcome
    time.sleep(0.1)
    assert crashes == []
    assert sum("bad peer info" in r.getMessage() for r in caplog.records) == len(bad_infos)
    round_trip(target, make_engine())


def test_malformed_welcome_is_a_protocol_error(make_engine: Any) -> None:
    """A server that completes the challenge but sends a malformed welcome."""
    from mpcomm import wire

    fake = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        try:
            conn, _ = fake.accept()
        except OSError:
            return
        with conn:
            wire.read_json(conn)
            wire.send_json(conn, {"t": "challenge", "nonce": "00" * 16, "proof": ""})
            wire.read_json(conn)
            wire.send_json(conn, {"t": "welcome", "info": {"node_id": "n", "epoch": "e", "address": "a",
                                                            "transports": ["tcp"]}})
            conn.recv(1)

    threading.Thread(target=serve, daemon=True).start()
    try:
        with pytest.raises(mpcomm.ProtocolError, match="malformed handshake"):
            make_engine().open(f"127.0.0.1:{fake.getsockname()[1]}", "kv", timeout=5)
    finally:
        fake.close()
