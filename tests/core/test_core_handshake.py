"""The control handshake: mutual authentication where the client proves first, the
secret never on the wire, one deadline for the whole handshake, identity claims
checked, TLS with mutual certificates, and IPv6.

Hostile peers are raw sockets (tests/core/rawpeer.py) against a target engine in
another process (the conformance kit's target)."""

from __future__ import annotations

import logging
import socket
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from core_support import RecordingProxy, Target
from rawpeer import GOOD_SECRET, RawPeer, fake_info, split_frames

import mpcomm
from mpcomm import auth, wire
from mpcomm.control import CONTROL_CONTEXT, PeerLink
from mpcomm.peer import PeerInfo, parse_endpoint

SECRET = "correct horse battery staple"  # 28 bytes of text: enough under the 128-bit rule


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


def remote_still_serves(target: Target) -> None:
    with mpcomm.Engine(transports=["tcp"], secret=target.secret) as e:
        remote = e.open(target.address, "kv", timeout=5)
        e.write(b"\x5a" * 64, remote).result(5)
    assert target.alive


class SecretTarget(Target):
    def __init__(self, secret: str = "", config: dict[str, Any] | None = None) -> None:
        cfg = dict(config or {})
        if secret:
            cfg.setdefault("transport", {})["secret"] = secret
        self.secret = secret or None
        super().__init__({"kv": [4096, "buffer"]}, config=cfg)


@pytest.fixture
def hostile() -> Any:
    started: list[Target] = []

    def start(secret: str = "", **config: Any) -> SecretTarget:
        t = SecretTarget(secret, config)
        started.append(t)
        return t

    yield start
    for t in started:
        t.close()


# -- shared secret -------------------------------------------------------------------------


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
    assert make_engine(secret=SECRET).open(target.address, "kv").size == 16


@pytest.mark.parametrize("who", ["target", "initiator"])
def test_secret_on_one_side_only_is_a_clear_error(make_engine: Any, who: str) -> None:
    target = make_engine(secret=SECRET if who == "target" else None)
    target.register(bytearray(16), name="kv")
    initiator = make_engine(secret=SECRET if who == "initiator" else None)
    with pytest.raises(mpcomm.AuthenticationError, match="secret"):
        initiator.open(target.address, "kv", timeout=3)


@pytest.mark.parametrize("weak", ["right", "0123456789abcdef", "c2hvcnQgc2VjcmV0", "a" * 15])
def test_weak_secrets_are_refused_with_how_to_make_one(weak: str) -> None:
    with pytest.raises(mpcomm.ConfigError, match="mpcomm secret") as info:
        mpcomm.Engine(secret=weak, transports=["tcp"])
    assert "128 bits" in str(info.value)


def test_secret_strength_counts_decoded_bytes() -> None:
    assert auth.secret_strength("ab" * 16) == 16  # 32 hex digits = 16 bytes
    assert auth.secret_strength("ab" * 15) == 15
    assert auth.secret_strength(GOOD_SECRET) == 32
    assert auth.secret_strength("correct horse battery staple") == 28  # not hex, not base64: raw length
    assert auth.validate_secret("") == ""
    with pytest.raises(mpcomm.ConfigError, match="whitespace"):
        auth.validate_secret(GOOD_SECRET + "\n")


def test_secret_never_travels(make_engine: Any) -> None:
    proxy = RecordingProxy(("127.0.0.1", 1))  # upstream set below, once the target listens
    # A proxy is an address the target must be told it is reachable at (proofs name the address dialled).
    target = make_engine({"transport": {"reachable_at": [proxy.address]}}, secret=SECRET)
    proxy.upstream = parse_endpoint(target.address)
    initiator = make_engine(secret=SECRET)
    try:
        round_trip(target, initiator, address=proxy.address)
        seen = bytes(proxy.seen)
    finally:
        proxy.close()
    assert seen.startswith(b"MA") and b'"t":"hello"' in seen and b'"t":"welcome"' in seen
    for form in (SECRET.encode(), SECRET.encode().hex().encode(), SECRET.encode("utf-16-le")):
        assert form not in seen


def test_client_proves_first_and_a_wrong_proof_learns_nothing(hostile: Any) -> None:
    """Whoever connects gets only a nonce; a wrong proof gets a refusal with no server proof."""
    target = hostile(GOOD_SECRET)
    with RawPeer(target.address) as p:
        p.sock.settimeout(1.0)
        first = p.sock.recv(4096)
        time.sleep(0.3)
        p.sock.setblocking(False)
        try:
            first += p.sock.recv(4096)
        except BlockingIOError:
            pass
        p.sock.setblocking(True)
        [(magic, ftype, flags, challenge)] = split_frames(first)
        assert (magic, ftype, flags, len(challenge)) == (b"MA", auth.T_CHALLENGE, auth.F_SECRET, 64)  # nonce + id
        assert len(first) == wire.HEADER.size + 64  # nothing else before we prove
        dialled = auth.address_bytes(p.sock.getpeername())  # the right address, a wrong proof
        p.sock.sendall(wire.pack_frame(b"MA", auth.T_PROOF, b"\x01" * 32 + dialled + b"\x01" * 32, auth.F_SECRET))
        reply = p.expect_closed()
        [(magic, ftype, status, proof)] = split_frames(reply)
        assert (magic, ftype, status) == (b"MA", auth.T_RESULT, auth.BAD_PROOF)
        assert proof == bytes(32)
    remote_still_serves(target)


def test_wrong_secret_against_a_real_target_process(hostile: Any) -> None:
    target = hostile(GOOD_SECRET)
    with RawPeer(target.address) as p, pytest.raises(mpcomm.AuthenticationError, match="different shared secret"):
        p.authenticate("f" * 64)
    remote_still_serves(target)


# -- auth.py over a socket pair ------------------------------------------------------------


def _pair_run(client_secret: str, server_secret: str, client_ctx: bytes = b"c", server_ctx: bytes = b"c",
              ) -> tuple[BaseException | None, BaseException | None]:
    a, b = socket.socketpair()
    out: list[BaseException | None] = [None, None]

    def server() -> None:
        try:
            auth.server_authenticate(b, server_secret, time.monotonic() + 3, server_ctx)
        except BaseException as exc:  # noqa: BLE001
            out[1] = exc
        finally:
            b.close()

    t = threading.Thread(target=server)
    t.start()
    try:
        auth.client_authenticate(a, client_secret, time.monotonic() + 3, client_ctx)
    except BaseException as exc:  # noqa: BLE001
        out[0] = exc
    t.join(5)
    a.close()
    return out[0], out[1]


def test_auth_functions_both_ways() -> None:
    assert _pair_run(GOOD_SECRET, GOOD_SECRET) == (None, None)
    assert _pair_run("", "") == (None, None)
    c, s = _pair_run(GOOD_SECRET, GOOD_SECRET[::-1])
    assert isinstance(c, mpcomm.AuthenticationError) and isinstance(s, mpcomm.AuthenticationError)
    c, s = _pair_run(GOOD_SECRET, GOOD_SECRET, b"control", b"data")  # a proof for one channel is not for another
    assert isinstance(c, mpcomm.AuthenticationError) and isinstance(s, mpcomm.AuthenticationError)
    c, s = _pair_run("", GOOD_SECRET)
    assert isinstance(c, mpcomm.AuthenticationError) and "requires a secret" in str(c)
    assert isinstance(s, mpcomm.AuthenticationError)
    c, s = _pair_run(GOOD_SECRET, "")
    assert isinstance(c, mpcomm.AuthenticationError) and "server has none" in str(c)


def test_auth_garbage_is_a_protocol_error() -> None:
    a, b = socket.socketpair()
    with a, b:
        b.sendall(b"HTTP/1.1 200 OK\r\n\r\n" + b"x" * 64)
        with pytest.raises(mpcomm.ProtocolError, match="authentication frame"):
            auth.client_authenticate(a, "", time.monotonic() + 2, b"c")


def test_auth_deadline_covers_the_whole_exchange() -> None:
    """A server trickling its challenge one byte every 0.2 s is cut at the deadline, not per read."""
    a, b = socket.socketpair()
    frame = wire.pack_frame(b"MA", auth.T_CHALLENGE, b"\x00" * 64)
    stop = threading.Event()

    def trickle() -> None:
        for byte in frame:
            if stop.wait(0.2):
                return
            try:
                b.send(bytes([byte]))
            except OSError:
                return

    threading.Thread(target=trickle, daemon=True).start()
    start = time.monotonic()
    try:
        with pytest.raises(mpcomm.HandshakeTimeout):
            auth.client_authenticate(a, "", time.monotonic() + 1.0, b"c")
        assert 0.9 <= time.monotonic() - start < 1.6
    finally:
        stop.set()
        a.close()
        b.close()


# -- deadlines ------------------------------------------------------------------------------


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
        assert 0.25 <= time.monotonic() - start < 1.5
    finally:
        silent.close()
        for s in held:
            s.close()


def test_server_handshake_deadline(hostile: Any) -> None:
    """A client that connects and says nothing is dropped after the handshake deadline."""
    target = hostile(transport={"handshake_timeout_ms": 300})
    with RawPeer(target.address) as p:
        start = time.monotonic()
        sent = p.expect_closed(5)
        took = time.monotonic() - start
    assert [f[:2] for f in split_frames(sent)] == [(b"MA", auth.T_CHALLENGE)]
    assert 0.2 <= took < 2.0
    remote_still_serves(target)


def test_trickling_client_is_cut_at_the_handshake_deadline(hostile: Any) -> None:
    """One byte every 0.6 s (each read would succeed on its own): cut when the whole handshake's time is up."""
    target = hostile(transport={"handshake_timeout_ms": 2000})
    proof = wire.pack_frame(b"MA", auth.T_PROOF, b"\x00" * 82)
    with RawPeer(target.address) as p:
        start = time.monotonic()
        closed_after = None
        for byte in proof:
            time.sleep(0.6)
            try:
                p.sock.send(bytes([byte]))
            except OSError:
                closed_after = time.monotonic() - start
                break
            if time.monotonic() - start > 6:
                break
        if closed_after is None:
            p.expect_closed(3)
            closed_after = time.monotonic() - start
    assert closed_after < 4.0, f"handshake held open {closed_after:.1f}s"
    remote_still_serves(target)


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


# -- identity claims ----------------------------------------------------------------------


def test_a_peer_cannot_claim_the_targets_own_identity(hostile: Any) -> None:
    target = hostile()
    with RawPeer(target.address) as p:
        own = PeerInfo.from_dict(p.join()["info"])
    for claim in (fake_info(own.node_id, own.epoch), fake_info(own.node_id), fake_info(epoch=own.epoch)):
        with RawPeer(target.address) as p:
            p.authenticate()
            reply = p.hello(claim)
            assert reply["t"] == "error" and reply["code"] == "auth" and "own identity" in reply["message"]
            p.expect_closed()
        # A forged self-proof does not help either.
        with RawPeer(target.address) as p:
            p.authenticate()
            assert p.hello(claim, self="00" * 32)["t"] == "error"
    remote_still_serves(target)


def test_an_engine_may_dial_itself(make_engine: Any) -> None:
    e = make_engine()
    e.register(bytearray(64), name="kv")
    remote = e.open(e.address, "kv")
    e.write(b"x" * 64, remote).result(5)


def test_a_live_peers_identity_cannot_be_taken_over_without_a_secret(hostile: Any) -> None:
    target = hostile()
    owner = RawPeer(target.address)
    info = fake_info()
    owner.join(info=info)
    try:
        # Its epoch under another node id, or its node id with another epoch: refused while it is connected.
        for claim in (fake_info(epoch=info["epoch"]), fake_info(node_id=info["node_id"])):
            with RawPeer(target.address) as p:
                p.authenticate()
                reply = p.hello(claim)
                assert reply["t"] == "error" and reply["code"] == "auth", reply
        # The owner's connection is untouched and still answered.
        assert owner.request({"t": "ping"})["t"] == "pong"
    finally:
        owner.close()
    # Once the owner is gone, a restarted node (same node id, new epoch) is accepted.
    deadline = time.monotonic() + 5
    while True:
        with RawPeer(target.address) as p:
            p.authenticate()
            if p.hello(fake_info(node_id=info["node_id"]))["t"] == "welcome":
                break
        assert time.monotonic() < deadline, "the owner's departure was never noticed"
        time.sleep(0.05)


def test_with_a_secret_a_restarted_node_replaces_its_old_epoch(hostile: Any) -> None:
    target = hostile(GOOD_SECRET)
    info = fake_info()
    with RawPeer(target.address) as old:
        old.join(GOOD_SECRET, info)
        with RawPeer(target.address) as new:
            assert new.join(GOOD_SECRET, fake_info(node_id=info["node_id"]))["t"] == "welcome"
            with RawPeer(target.address) as thief:  # but an epoch collision across node ids never is
                thief.authenticate(GOOD_SECRET)
                assert thief.hello(fake_info(epoch=info["epoch"]))["t"] == "error"


BAD_INFOS = {
    "transports not an object": fake_info(transports=[1, 2]),
    "host not an object": fake_info(host="not a dict"),
    "missing epoch": {"node_id": "a", "address": "c"},
    "not an object": [1, 2, 3],
    "huge node id": fake_info(node_id="n" * 100_000),
    "non-string epoch": fake_info(epoch=12345),
    "too many transports": fake_info(transports={f"t{i}": {} for i in range(1000)}),
    "huge transport entry": fake_info(transports={"tcp": {"x": "y" * 100_000}}),
    "nested host value": fake_info(host={"k": {"deep": [1, 2]}}),
    "bool protocol": fake_info(protocol=True),
}


def test_malformed_peer_info_is_refused_and_logged(hostile: Any) -> None:
    target = hostile()
    for what, info in BAD_INFOS.items():
        with RawPeer(target.address) as p:
            p.authenticate()
            reply = p.hello(info)
            assert reply["t"] == "error" and "bad peer info" in reply["message"], what
            p.expect_closed()
    remote_still_serves(target)


def test_malformed_peer_info_does_not_kill_the_serving_thread(make_engine: Any, caplog: pytest.LogCaptureFixture,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    crashes: list[Any] = []
    monkeypatch.setattr(threading, "excepthook", crashes.append)
    target = make_engine()
    with caplog.at_level(logging.WARNING, logger="mpcomm.control"):
        for info in BAD_INFOS.values():
            with RawPeer(target.address) as p:
                p.authenticate()
                assert p.hello(info)["t"] == "error"
                p.expect_closed()
    time.sleep(0.1)
    assert crashes == []
    assert sum("bad peer info" in r.getMessage() for r in caplog.records) == len(BAD_INFOS)
    round_trip(target, make_engine())


# -- a hostile server against our PeerLink ------------------------------------------------


class FakeServer:
    """Accepts, authenticates like a real node, welcomes, then answers requests with ``reply(msg)`` bytes."""

    def __init__(self, reply: Any, welcome: dict[str, Any] | None = None) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.sock.getsockname()[1]}"
        self.reply = reply
        self.welcome = welcome or {"t": "welcome", "info": fake_info(), "idle_ms": 600000}
        self.conns: list[socket.socket] = []
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.conns.append(conn)
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            auth.server_authenticate(conn, "", time.monotonic() + 5, CONTROL_CONTEXT)
            wire.read_json(conn)
            wire.send_json(conn, self.welcome)
            while True:
                msg = wire.read_json(conn)
                if msg["t"] == "keepalive":
                    continue
                conn.sendall(self.reply(msg))
        except Exception:  # noqa: BLE001
            pass

    def close(self) -> None:
        self.sock.close()
        for c in self.conns:
            c.close()


def _json(obj: Any) -> bytes:
    import json

    payload = json.dumps(obj).encode()
    return wire.HEADER.pack(b"MC", wire.PROTOCOL_VERSION, wire.T_JSON, 0, 0, len(payload)) + payload


def _raw(payload: bytes) -> bytes:
    return wire.HEADER.pack(b"MC", wire.PROTOCOL_VERSION, wire.T_JSON, 0, 0, len(payload)) + payload


MALICIOUS_REPLIES = {
    "unhashable id": lambda m: _json({"t": "pong", "id": [m["id"]]}),
    "string id": lambda m: _json({"t": "pong", "id": "1"}),
    "bool id": lambda m: _json({"t": "pong", "id": True}),
    "deep nesting": lambda m: _raw(b'{"t":"pong","id":%d,"x":' % m["id"] + b"[" * 50_000 + b"]" * 50_000 + b"}"),
    "bad magic": lambda m: b"XX" + b"\x00" * 30,
    "oversized frame": lambda m: wire.HEADER.pack(b"MC", 1, 1, 0, 0, 0xFFFFFFFF),
    "not json": lambda m: wire.HEADER.pack(b"MC", 1, 1, 0, 0, 4) + b"\xff\xfe\xfd\xfc",
}


@pytest.mark.parametrize("what", sorted(MALICIOUS_REPLIES))
def test_a_malicious_reply_kills_the_link_at_once(what: str) -> None:
    server = FakeServer(MALICIOUS_REPLIES[what])
    lost: list[Any] = []
    link = PeerLink(server.address, local_info=PeerInfo.from_dict(fake_info()), secret="", timeout=5,
                    on_lost=lost.append)
    try:
        start = time.monotonic()
        with pytest.raises(mpcomm.PeerConnectionError):
            link.request({"t": "ping"}, timeout=20)
        assert time.monotonic() - start < 2, "the request waited for its timeout"
        assert not link.alive and lost == [link]
        start = time.monotonic()
        with pytest.raises(mpcomm.PeerConnectionError, match="closed"):
            link.request({"t": "ping"}, timeout=20)
        assert time.monotonic() - start < 0.5
    finally:
        link.close()
        server.close()


def test_open_against_a_garbage_server(make_engine: Any) -> None:
    """A server that answers with junk: a prompt ProtocolError, no hang."""
    junk = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        try:
            conn, _ = junk.accept()
        except OSError:
            return
        with conn:
            try:
                conn.sendall(b"HTTP/1.1 400 Bad Request\r\n\r\n" + b"x" * 64)
                conn.recv(65536)
            except OSError:
                pass

    threading.Thread(target=serve, daemon=True).start()
    try:
        start = time.monotonic()
        with pytest.raises((mpcomm.ProtocolError, mpcomm.PeerConnectionError)):
            make_engine().open(f"127.0.0.1:{junk.getsockname()[1]}", "kv", timeout=10)
        assert time.monotonic() - start < 2
    finally:
        junk.close()


def test_malformed_welcome_is_a_protocol_error(make_engine: Any) -> None:
    server = FakeServer(lambda m: b"", welcome={"t": "welcome", "info": fake_info(transports=["tcp"])})
    try:
        with pytest.raises(mpcomm.ProtocolError, match="malformed handshake"):
            make_engine().open(server.address, "kv", timeout=5)
    finally:
        server.close()


def test_a_server_claiming_our_identity_is_refused(make_engine: Any) -> None:
    e = make_engine()
    server = FakeServer(lambda m: b"", welcome={"t": "welcome", "info": fake_info(e.node_id, e.epoch)})
    try:
        with pytest.raises(mpcomm.AuthenticationError, match="own identity"):
            e.open(server.address, "kv", timeout=5)
    finally:
        server.close()


# -- TLS ------------------------------------------------------------------------------------


def _pki(tmp: Path) -> dict[str, Path]:
    """A throwaway CA, two node certificates it signs, and one signed by a stranger CA."""
    pytest.importorskip("cryptography")
    import datetime

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.timezone.utc)

    def name(cn: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    def ca(cn: str) -> tuple[Any, Any]:
        key = ec.generate_private_key(ec.SECP256R1())
        cert = (x509.CertificateBuilder().subject_name(name(cn)).issuer_name(name(cn))
                .public_key(key.public_key()).serial_number(x509.random_serial_number())
                .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
                .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
                .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                             content_commitment=False, key_encipherment=False,
                                             data_encipherment=False, key_agreement=False,
                                             encipher_only=False, decipher_only=False), critical=True)
                .sign(key, hashes.SHA256()))
        return key, cert

    def leaf(cn: str, ca_key: Any, ca_cert: Any) -> tuple[Any, Any]:
        import ipaddress

        key = ec.generate_private_key(ec.SECP256R1())
        cert = (x509.CertificateBuilder().subject_name(name(cn)).issuer_name(ca_cert.subject)
                .public_key(key.public_key()).serial_number(x509.random_serial_number())
                .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
                .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost"),
                                                            x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                               critical=False)
                .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                      ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
                .sign(ca_key, hashes.SHA256()))
        return key, cert

    def save(stem: str, key: Any, cert: Any) -> None:
        (tmp / f"{stem}.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        if key is not None:
            (tmp / f"{stem}.key").write_bytes(key.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))

    ca_key, ca_cert = ca("mpcomm test CA")
    save("ca", None, ca_cert)
    for node in ("a", "b"):
        save(node, *leaf(f"node-{node}", ca_key, ca_cert))
    other_key, other_cert = ca("stranger CA")
    save("stranger", *leaf("stranger", other_key, other_cert))
    return {p.stem + p.suffix: p for p in tmp.iterdir()}


def _tls_config(files: dict[str, Path], node: str, ca: str = "ca.pem", **extra: Any) -> dict[str, Any]:
    return {"transport": {"tls": True, **extra},
            "tls": {"cert": str(files[f"{node}.pem"]), "key": str(files[f"{node}.key"]), "ca": str(files[ca])}}


def test_tls_mutual_authentication(make_engine: Any, tmp_path: Path) -> None:
    files = _pki(tmp_path)
    target = make_engine(_tls_config(files, "a"))
    initiator = make_engine(_tls_config(files, "b"))
    round_trip(target, initiator)
    # With check_hostname the certificate's SAN (127.0.0.1) must match too; it does.
    cfg = _tls_config(files, "b")
    cfg["tls"]["check_hostname"] = True
    assert make_engine(cfg).open(target.address, "kv").size == 256


def test_tls_with_a_secret_too(make_engine: Any, tmp_path: Path) -> None:
    files = _pki(tmp_path)
    round_trip(make_engine(_tls_config(files, "a"), secret=SECRET), make_engine(_tls_config(files, "b"), secret=SECRET))


def test_tls_refuses_a_client_whose_certificate_the_ca_did_not_sign(make_engine: Any, tmp_path: Path) -> None:
    files = _pki(tmp_path)
    target = make_engine(_tls_config(files, "a"))
    target.register(bytearray(16), name="kv")
    # The stranger trusts our CA (so it accepts the server) but presents a certificate our CA never signed.
    stranger = make_engine({"transport": {"tls": True}, "tls": {
        "cert": str(files["stranger.pem"]), "key": str(files["stranger.key"]), "ca": str(files["ca.pem"])}})
    with pytest.raises((mpcomm.AuthenticationError, mpcomm.PeerConnectionError)):
        stranger.open(target.address, "kv", timeout=3)
    # A client with no certificate at all, and a plain-TCP client, are refused as well.
    import ssl

    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.load_verify_locations(cafile=str(files["ca.pem"]))
    ctx.check_hostname = False
    with socket.create_connection(parse_endpoint(target.address), timeout=3) as raw:
        with pytest.raises((ssl.SSLError, OSError, mpcomm.MpcommError)):
            with ctx.wrap_socket(raw) as s:
                auth.client_authenticate(s, "", time.monotonic() + 3, CONTROL_CONTEXT)
    with pytest.raises((mpcomm.ProtocolError, mpcomm.PeerConnectionError)):
        make_engine().open(target.address, "kv", timeout=3)
    # A client that refuses the server: its CA is the stranger's.
    wary = make_engine(_tls_config(files, "b", ca="stranger.pem"))
    with pytest.raises(mpcomm.AuthenticationError, match="certificate"):
        wary.open(target.address, "kv", timeout=3)
    # And the target still serves a member.
    assert make_engine(_tls_config(files, "b")).open(target.address, "kv").size == 16


def test_tls_config_errors_name_the_key(tmp_path: Path) -> None:
    with pytest.raises(mpcomm.ConfigError, match="tls.cert"):
        mpcomm.Config.from_dict({"transport": {"tls": True}})
    with pytest.raises(mpcomm.ConfigError, match="no such file"):
        mpcomm.Engine({"transport": {"tls": True}, "tls": {"cert": str(tmp_path / "x.pem"), "key": "k", "ca": "c"}},
                      transports=["tcp"])


def test_tls_handshake_has_one_deadline_too(make_engine: Any, tmp_path: Path) -> None:
    """A client that opens TCP to a TLS node and never sends a ClientHello is cut at the handshake deadline."""
    files = _pki(tmp_path)
    cfg = _tls_config(files, "a", handshake_timeout_ms=400)
    target = make_engine(cfg)
    with RawPeer(target.address) as p:
        start = time.monotonic()
        assert p.expect_closed(5) == b""  # TLS first: the server says nothing until the client speaks
        assert 0.3 <= time.monotonic() - start < 2.0
    round_trip(target, make_engine(_tls_config(files, "b")))
