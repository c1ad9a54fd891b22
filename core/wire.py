"""Length-checked, versioned frames shared by the control channel and the tcp transport.

A frame is a fixed 12-byte header followed by ``length`` payload bytes::

    magic (2s) | version (B) | type (B) | flags (H) | reserved (H) | length (I)

Anything that does not parse — wrong magic, a version we do not speak, a
length above the receiver's limit — raises :class:`~mpcomm.ProtocolError`;
the receiver then closes that one connection and logs why. A peer sending
garbage never takes the node down.

Reads can run under a ``deadline`` (``time.monotonic()`` based) that bounds
the whole read, not each ``recv``: a peer trickling one byte at a time is cut
when the deadline passes (builtin :class:`TimeoutError`). JSON payloads are
bounded in size (the caller's ``max_payload``) and nesting depth
(:data:`MAX_JSON_DEPTH`), so no payload can drive the parser or later code
into a ``RecursionError``.
"""

from __future__ import annotations

import json
import socket
import struct
import time
from typing import Any

from .errors import PeerConnectionError, ProtocolError

PROTOCOL_VERSION = 1
CONTROL_MAGIC = b"MC"
HEADER = struct.Struct("!2sBBHHI")
MAX_CONTROL_PAYLOAD = 1 << 20
#: Deepest nesting of arrays/objects a control frame may carry. Real messages
#: nest 4 deep; the JSON parser itself would recurse ~1000 deep.
MAX_JSON_DEPTH = 32


def recv_exact(sock: socket.socket, n: int, deadline: float | None = None) -> bytes:
    buf = bytearray(n)
    recv_into_exact(sock, memoryview(buf), deadline)
    return bytes(buf)


def recv_into_exact(sock: socket.socket, view: memoryview, deadline: float | None = None) -> None:
    """Fill ``view`` from ``sock``; EOF before the end is a PeerConnectionError.

    With ``deadline`` (monotonic seconds) the whole read must finish by then,
    else :class:`TimeoutError`; the socket's timeout is changed on the way.
    """
    got = 0
    n = view.nbytes
    while got < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"deadline passed after {got} of {n} bytes")
            sock.settimeout(left)
        try:
            r = sock.recv_into(view[got:], n - got)
        except socket.timeout:
            raise TimeoutError(f"deadline passed after {got} of {n} bytes") from None
        if r == 0:
            raise PeerConnectionError(f"connection closed by peer after {got} of {n} bytes")
        got += r


#: The flag every send to a socket carries: a peer that went away is EPIPE (an error the caller
#: handles), never SIGPIPE. A C++ host of libmpcomm.so keeps SIGPIPE at its default (the embedded
#: interpreter installs no handlers) and a library may not change a host's signal dispositions.
NOSIGNAL = getattr(socket, "MSG_NOSIGNAL", 0)


def sendall(sock: Any, data: Any) -> None:
    """``sock.sendall(data)`` with :data:`NOSIGNAL` on every socket that takes flags.

    An ``ssl.SSLSocket`` takes none (OpenSSL does the writing, without the
    flag: docs/reliability.md says what that leaves); the tcp plugin's TLS
    stream adds the flag to its own sends.
    """
    if isinstance(sock, socket.socket) and not _is_ssl(sock):
        sock.sendall(data, NOSIGNAL)
    else:
        sock.sendall(data)


def _is_ssl(sock: socket.socket) -> bool:
    import sys

    ssl = sys.modules.get("ssl")  # not imported: no socket can be an SSLSocket
    return ssl is not None and isinstance(sock, ssl.SSLSocket)


def send_all(sock: socket.socket, data: bytes, deadline: float | None = None) -> None:
    """``sendall`` that gives up at ``deadline`` (monotonic seconds) with :class:`TimeoutError`."""
    if deadline is not None:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("deadline passed before sending")
        sock.settimeout(left)
    try:
        sendall(sock, data)
    except socket.timeout:
        raise TimeoutError("deadline passed while sending (the peer does not read)") from None


def pack_frame(magic: bytes, ftype: int, payload: bytes = b"", flags: int = 0) -> bytes:
    return HEADER.pack(magic, PROTOCOL_VERSION, ftype, flags, 0, len(payload)) + payload


def read_frame(sock: socket.socket, magic: bytes, max_payload: int,
               deadline: float | None = None) -> tuple[int, int, bytes]:
    """Read one frame; returns (type, flags, payload)."""
    head = recv_exact(sock, HEADER.size, deadline)
    m, version, ftype, flags, _, length = HEADER.unpack(head)
    if m != magic:
        raise ProtocolError(f"bad frame magic {m!r} (expected {magic!r}): not an mpcomm peer, or garbage")
    if version != PROTOCOL_VERSION:
        raise ProtocolError(f"peer speaks protocol version {version}, this node speaks {PROTOCOL_VERSION}")
    if length > max_payload:
        raise ProtocolError(f"frame of {length} bytes exceeds the limit of {max_payload}")
    return ftype, flags, recv_exact(sock, length, deadline) if length else b""


# Control frames carry one JSON object each.
T_JSON = 1


def encode_json(obj: dict[str, Any]) -> bytes:
    return pack_frame(CONTROL_MAGIC, T_JSON, json.dumps(obj, separators=(",", ":")).encode())


def send_json(sock: socket.socket, obj: dict[str, Any], deadline: float | None = None) -> None:
    send_all(sock, encode_json(obj), deadline)


def read_json(sock: socket.socket, max_payload: int = MAX_CONTROL_PAYLOAD,
              deadline: float | None = None) -> dict[str, Any]:
    ftype, _, payload = read_frame(sock, CONTROL_MAGIC, max_payload, deadline)
    if ftype != T_JSON:
        raise ProtocolError(f"unexpected control frame type {ftype}")
    return parse_json(payload, max_payload)


def parse_json(payload: bytes, max_payload: int = MAX_CONTROL_PAYLOAD) -> dict[str, Any]:
    """A control frame's payload → a typed JSON object, or ProtocolError (never RecursionError)."""
    obj = loads_bounded(payload, what="control frame", max_bytes=max_payload)
    if not isinstance(obj, dict) or not isinstance(obj.get("t"), str):
        raise ProtocolError("control frame is not a typed JSON object")
    return obj


def loads_bounded(data: bytes | str, *, what: str, max_bytes: int = MAX_CONTROL_PAYLOAD,
                  max_depth: int = MAX_JSON_DEPTH) -> Any:
    """Parse untrusted JSON (a peer's frame, an etcd record, a peer's directory).

    The one rule for every such parse: at most ``max_bytes`` long and ``max_depth`` deep, else
    :class:`~mpcomm.ProtocolError` naming ``what``. It never raises RecursionError, ValueError or
    MemoryError from the parser itself, so a caller skips one bad record and keeps going.
    """
    if len(data) > max_bytes:
        raise ProtocolError(f"{what} is {len(data)} bytes, over the limit of {max_bytes}")
    try:
        obj = json.loads(data)
    except RecursionError:
        raise ProtocolError(f"{what} nests deeper than {max_depth} levels") from None
    except ValueError as exc:  # also UnicodeDecodeError and ints over sys.get_int_max_str_digits()
        raise ProtocolError(f"{what} is not JSON: {exc}") from exc
    # Cheap test first: fewer openers than the limit cannot nest past it.
    raw = data.encode("utf-8", "replace") if isinstance(data, str) else data
    if raw.count(b"[") + raw.count(b"{") > max_depth and json_depth(obj, max_depth) > max_depth:
        raise ProtocolError(f"{what} nests deeper than {max_depth} levels")
    return obj


def json_depth(obj: Any, limit: int = MAX_JSON_DEPTH) -> int:
    """Nesting depth of parsed JSON, without recursion (counting stops past ``limit``)."""
    deepest = 0
    stack = [(obj, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children: Any = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        deepest = max(deepest, depth)
        if deepest > limit:
            return deepest
        stack.extend((c, depth + 1) for c in children if isinstance(c, (dict, list)))
    return deepest
