"""TLS on tcp data connections (``transport.tls = true``): mutual certificates, then the secret, then data."""

from __future__ import annotations

import datetime
import hashlib
import json
import ipaddress
import os
import socket
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from tcp_support import closed, reply, req

import mpcomm
from mpcomm.plugins.tcp import wire

SECRET = "5d0c1f3a9b7e2d4c6a8e0f1b3d5c7a9e1f2b4d6c8a0e3f5b7d9c1a2e4f6b8d0c"


def pki(tmp: Path) -> dict[str, str]:
    """A throwaway CA and two node certificates it signs (and one a stranger CA signs)."""
    pytest.importorskip("cryptography")
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.timezone.utc)

    def name(cn: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    def build(cn: str, issuer: Any, key: Any, sign_key: Any, ca: bool) -> Any:
        b = (x509.CertificateBuilder().subject_name(name(cn)).issuer_name(issuer).public_key(key.public_key())
             .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
             .not_valid_after(now + datetime.timedelta(days=1))
             .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
        if not ca:
            b = b.add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                                critical=False)
        return b.sign(sign_key, hashes.SHA256())

    out: dict[str, str] = {}

    def save(stem: str, key: Any, cert: Any) -> None:
        (tmp / f"{stem}.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        out[f"{stem}.pem"] = str(tmp / f"{stem}.pem")
        if key is not None:
            (tmp / f"{stem}.key").write_bytes(key.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
            out[f"{stem}.key"] = str(tmp / f"{stem}.key")

    for ca_name in ("ca", "stranger-ca"):
        ca_key = ec.generate_private_key(ec.SECP256R1())
        ca_cert = build(ca_name, name(ca_name), ca_key, ca_key, True)
        save(ca_name, None, ca_cert)
        for node in (("a", "b") if ca_name == "ca" else ("stranger",)):
            k = ec.generate_private_key(ec.SECP256R1())
            save(node, k, build(f"node-{node}", ca_cert.subject, k, ca_key, False))
    return out


def tls_config(files: dict[str, str], node: str, **tcp: Any) -> dict[str, Any]:
    cfg: dict[str, Any] = {"transport": {"tls": True, "secret": SECRET},
                           "tls": {"cert": files[f"{node}.pem"], "key": files[f"{node}.key"], "ca": files["ca.pem"]}}
    if tcp:
        cfg["plugins"] = {"tcp": tcp}
    return cfg


def test_data_moves_over_tls(spawn: Any, make_engine: Any, tmp_path: Path) -> None:
    files = pki(tmp_path)
    target = spawn({"kv": [16 << 20, "allocate"]}, config=tls_config(files, "a"))
    assert target.tcp["tls"] is True
    ini = make_engine(tls_config(files, "b"))
    remote = ini.open(target.address, "kv")
    src = ini.allocate(12 << 20)
    src.view[:] = os.urandom(12 << 20)
    for n, off in ((1, 0), (4096, 7), (300_000, 4096), (12 << 20, 0)):
        ini.write(src, remote, off, n).result(20)
        assert target.cmd(f"sha kv {off} {n}") == hashlib.sha256(src.view[:n]).hexdigest(), n
        dst = ini.allocate(n)
        ini.read(dst, remote, off, n).result(20)
        assert dst.view == src.view[:n], n
    offs = [i * 4096 for i in range(64)]
    ini.write_many(src, remote, offs, offs, [4096] * 64).result(10)
    dst = ini.allocate(64 * 4096)
    ini.read_many(dst, remote, offs, offs, [4096] * 64).result(10)
    assert dst.view == src.view[: 64 * 4096]
    ts = [ini.write(src, remote, i * 4096, 4096, local_offset=i * 4096) for i in range(200)]  # pipelined
    for t in ts:
        t.result(10)
    # A notifying write: server.py takes the note on the TLS data connection's WRITE frame.
    assert target.tcp.get("write_note") is True
    h = ini.write(src, remote, 0, 4096, notify=b"over-tls")
    h.result(10)
    assert h.transport == "tcp"
    assert not [t.name for t in threading.enumerate() if t.name.startswith("mpcomm-notify_")]  # no notify worker
    assert json.loads(target.cmd("notes"))[-1]["data"] == "over-tls"


def test_plain_tcp_and_foreign_certificates_are_refused_on_the_data_port(spawn: Any, make_engine: Any,
                                                                        tmp_path: Path) -> None:
    files = pki(tmp_path)
    target = spawn(config=tls_config(files, "a"))
    remote = make_engine(tls_config(files, "b")).open(target.address, "kv")
    target.cmd("fill kv 3")
    before = target.cmd(f"sha kv 0 {remote.size}")
    # A plain client (with the secret, even) gets nowhere: the port speaks TLS first.
    s = target.raw(hello=False)
    s.sendall(wire.HELLO.pack(wire.HELLO_MAGIC, wire.VERSION, 0, wire.ident("x"), wire.ident(target.epoch))
              + req(wire.OP_WRITE, remote=remote, length=64) + b"\x01" * 64)
    assert closed(s)
    # A TLS client whose certificate our CA did not sign is refused in the handshake.
    import ssl

    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.load_verify_locations(cafile=files["ca.pem"])
    ctx.load_cert_chain(files["stranger.pem"], files["stranger.key"])
    raw = socket.create_connection((target.host, target.port), timeout=5)
    with pytest.raises((ssl.SSLError, OSError)):
        with ctx.wrap_socket(raw) as t:
            t.sendall(b"x" * 64)
            assert t.recv(1) == b""
    assert target.cmd(f"sha kv 0 {remote.size}") == before
    # A node without TLS cannot even open the region (the control channel runs TLS too).
    with pytest.raises(mpcomm.MpcommError):
        make_engine(secret=SECRET).open(target.address, "kv", timeout=3)


def test_tls_stream_timeouts_and_stalled_targets(spawn: Any, make_engine: Any, tmp_path: Path) -> None:
    files = pki(tmp_path)
    target = spawn(config=tls_config(files, "a"))
    ini = make_engine({**tls_config(files, "b"), "runtime": {"abort_grace_ms": 400}})
    remote = ini.open(target.address, "kv")
    ini.write(b"a" * 4096, remote, 0).result(5)
    target.stop()
    try:
        t0 = time.monotonic()
        t = ini.write(b"b" * 4096, remote, 0, timeout=0.5)
        assert time.monotonic() - t0 < 0.2
        with pytest.raises(mpcomm.TransferTimeout):
            t.result(5)
    finally:
        target.cont()
    ini.write(b"c" * 4096, remote, 0).result(5)


def test_a_data_port_tls_mismatch_is_not_routed(spawn: Any, make_engine: Any, tmp_path: Path) -> None:
    files = pki(tmp_path)
    target = spawn(config=tls_config(files, "a"))
    ini = make_engine(tls_config(files, "b", tls="off"))  # TLS on the control channel only
    remote = ini.open(target.address, "kv")
    with pytest.raises(mpcomm.TransportUnavailable, match="TLS"):
        ini.write(b"x" * 64, remote, 0).result(5)
