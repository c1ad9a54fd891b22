"""Length-checked, versioned frames shared by the control channel and the tcp transport.

A frame is a fixed 12-byte header followed by ``length`` payload bytes::

    magic (2s) | version (B) | type (B) | flags (H) | reserved (H) | length (I)

Anything that does not parse — wrong magic, a version we do not speak, a
length above the receiver's limit — raises :class:`~mpcomm.ProtocolError`;
the receiver then closes that one connection and logs why. A peer sending
garbage never takes the node down.
"""

from __future__ import annotations

import json
import socket
import struct
from typing import Any

from .errors import PeerConnectionError, ProtocolError

PROTOCOL_VERSION = 1
CONTROL_MAGIC = b"MC"
HEADER = struct.Struct("!2sBBHHI")
MAX_CONTROL_PAYLOAD = 1 << 20


def recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    recv_into_exact(sock, memoryview(buf))
    return bytes(buf)


def recv_into_exact(sock: socket.socket, view: memoryview) -> None:
    """Fill ``view`` from ``sock``; EOF before the end is a PeerConnectionError."""
    got = 0
    n = view.nbytes
    while got < n:
        r = sock.recv_into(view[got:], n - got)
        if r == 0:
            raise PeerConnectionError(f"connection closed by peer after {got} of {n} bytes")
        got += r


def pack_frame(magic: bytes, ftype: int, payload: bytes = b"", flags: int = 0) -> bytes:
    return HEADER.pack(magic, PROTOCOL_VERSION, ftype, flags, 0, len(payload)) + payload


def read_frame(sock: socket.socket, magic: bytes, max_payload: int) -> tuple[int, int, bytes]:
    """Read one frame; returns (type, flags, payload)."""
    head = recv_exact(sock, HEADER.size)
    m, version, ftype, flags, _, length = HEADER.unpack(head)
    if m != magic:
        raise ProtocolError(f"bad frame magic {m!r} (expected {magic!r}): not an mpcomm peer, or garbage")
    if version != PROTOCOL_VERSION:
        raise ProtocolError(f"peer speaks protocol version {version}, this node speaks {PROTOCOL_VERSION}")
    if length > max_payload:
        raise ProtocolError(f"frame of {length} bytes exceeds the limit of {max_payload}")
    return ftype, flags, recv_exact(sock, length) if length else b""


# Control frames carry one JSON object each.
T_JSON = 1


def send_json(sock: socket.socket, obj: dict[str, Any]) -> None:
    sock.sendall(pack_frame(CONTROL_MAGIC, T_JSON, json.dumps(obj, separators=(",", ":")).encode()))


def read_json(sock: socket.socket) -> dict[str, Any]:
    ftype, _, payload = read_frame(sock, CONTROL_MAGIC, MAX_CONTROL_PAYLOAD)
    if ftype != T_JSON:
        raise ProtocolError(f"unexpected control frame type {ftype}")
    try:
        obj = json.loads(payload)
    except ValueError as exc:
        raise ProtocolError(f"control frame is not JSON: {exc}") from exc
    if not isinstance(obj, dict) or not isinstance(obj.get("t"), str):
        raise ProtocolError("control frame is not a typed JSON object")
    return obj
