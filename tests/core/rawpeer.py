"""A hand-driven control-channel client for attacking a real engine.

It speaks the real protocol over a real socket (``mpcomm.auth`` then JSON
frames) but sends whatever hello, identity and requests the test chooses,
so tests can play a hostile or broken peer against an engine in another
process.
"""

from __future__ import annotations

import secrets
import socket
import time
from typing import Any

from mpcomm import auth, wire
from mpcomm.control import CONTROL_CONTEXT
from mpcomm.peer import parse_endpoint

GOOD_SECRET = "9f2c4e1a7b3d5f60" * 4  # 32 bytes of hex: passes the 128-bit check


def fake_info(node_id: str | None = None, epoch: str | None = None, **extra: Any) -> dict[str, Any]:
    return {"node_id": node_id or secrets.token_hex(8), "epoch": epoch or secrets.token_hex(8),
            "address": "127.0.0.1:1", "host": {}, "transports": {}, "protocol": 1, **extra}


class RawPeer:
    """One control connection, driven step by step."""

    def __init__(self, address: str, timeout: float = 5.0) -> None:
        self.address = address
        self.sock = socket.create_connection(parse_endpoint(address), timeout=timeout)
        self.timeout = timeout

    def authenticate(self, secret: str = "") -> None:
        auth.client_authenticate(self.sock, secret, time.monotonic() + self.timeout, CONTROL_CONTEXT)

    def hello(self_, info: Any = None, **extra: Any) -> dict[str, Any]:  # noqa: N805 - "self" is a hello field
        """Send a hello and return the server's answer (welcome or error)."""
        wire.send_json(self_.sock, {"t": "hello", "proto": wire.PROTOCOL_VERSION,
                                    "info": fake_info() if info is None else info, **extra})
        return wire.read_json(self_.sock)

    def join(self, secret: str = "", info: Any = None) -> dict[str, Any]:
        self.authenticate(secret)
        welcome = self.hello(info)
        assert welcome["t"] == "welcome", welcome
        return welcome

    def request(self, msg: dict[str, Any], rid: int = 1) -> dict[str, Any]:
        wire.send_json(self.sock, {**msg, "id": rid})
        return wire.read_json(self.sock)

    def expect_closed(self, timeout: float = 5.0) -> bytes:
        """Read until the server closes; returns what it sent. Fails if it stays open."""
        self.sock.settimeout(timeout)
        got = bytearray()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                chunk = self.sock.recv(65536)
            except ConnectionResetError:
                return bytes(got)
            except TimeoutError:
                break
            if not chunk:
                return bytes(got)
            got += chunk
        raise AssertionError("the node kept the connection open")

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> RawPeer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def split_frames(data: bytes) -> list[tuple[bytes, int, int, bytes]]:
    """(magic, type, flags, payload) of each whole frame in ``data``."""
    out = []
    while len(data) >= wire.HEADER.size:
        magic, _v, ftype, flags, _r, length = wire.HEADER.unpack(data[: wire.HEADER.size])
        payload = data[wire.HEADER.size : wire.HEADER.size + length]
        out.append((magic, ftype, flags, payload))
        data = data[wire.HEADER.size + length :]
    return out
