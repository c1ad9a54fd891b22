"""Mutual shared-secret authentication for every mpcomm connection (control and data).

One challenge-response, run right after ``connect``/``accept`` and before
anything else is read from the peer::

    server → client   challenge: flags(has secret) | server nonce (32 B)
    client → server   proof:     flags(has secret) | client nonce (32 B) |
                                 HMAC-SHA256(secret, "client" | context | server nonce | client nonce)
    server → client   result:    status | HMAC-SHA256(secret, "server" | context | client nonce | server nonce)

The side that connects proves first, and the server answers with its own
proof only after it has checked the client's (``hmac.compare_digest``), so
whoever can merely reach a port learns nothing to test guesses against. A
client that dials an impostor does give that impostor one proof to attack
offline; the 128-bit minimum (:func:`validate_secret`) is what makes that
useless, and TLS with a verified server certificate (``mpcomm.tls``) closes
it. ``context`` names the channel (``b"mpcomm/control/1"``,
``b"mpcomm/tcp-data/1"``) so a proof for one kind of connection cannot be
replayed on another; nonces make every proof single-use.

Every message is an mpcomm frame (:mod:`mpcomm.wire` header, magic ``MA``)
of one fixed size: reads are exact and bounded, and the ``deadline``
(``time.monotonic()`` based) covers the whole exchange, not each read.

An empty secret on both sides means no authentication: the same three
frames travel with zero proofs, so a side that has a secret still refuses a
side that has none, with a message that says so.

The secret never travels; it is the HMAC key (its UTF-8 bytes, as given).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import os
import re
import socket
import time

from . import wire
from .errors import AuthenticationError, ConfigError, HandshakeTimeout, PeerConnectionError, ProtocolError

__all__ = [
    "MIN_SECRET_BYTES",
    "client_authenticate",
    "secret_strength",
    "server_authenticate",
    "validate_secret",
]

AUTH_MAGIC = b"MA"
NONCE = 32
PROOF = 32
#: Fewest bytes of entropy a secret must carry (128 bits).
MIN_SECRET_BYTES = 16

T_CHALLENGE, T_PROOF, T_RESULT = 1, 2, 3
F_SECRET = 1  # flags bit: this side has a secret

# Result statuses (the result frame's flags).
OK, BAD_PROOF, SECRET_REQUIRED, NO_SECRET_HERE = 0, 1, 2, 3
_REFUSALS = {
    BAD_PROOF: "authentication failed: the peer holds a different shared secret",
    SECRET_REQUIRED: "shared-secret mismatch: the server requires a secret and this side has none",
    NO_SECRET_HERE: "shared-secret mismatch: this side has a secret and the server has none",
}

_HEX = re.compile(r"[0-9a-fA-F]+")
_B64 = re.compile(r"[A-Za-z0-9+/_-]+={0,2}")


def secret_strength(secret: str) -> int:
    """Bytes of entropy a secret is credited with.

    A string that reads as hex counts as its decoded bytes (64 hex digits =
    32 bytes); else one that reads as base64 (standard or URL-safe) counts as
    its decoded bytes; else its UTF-8 length. The smallest reading wins, so a
    32-character hex string counts 16 bytes, not 32.
    """
    raw = len(secret.encode())
    counts = [raw]
    if len(secret) % 2 == 0 and _HEX.fullmatch(secret):
        counts.append(len(secret) // 2)
    if _B64.fullmatch(secret):
        padded = secret + "=" * (-len(secret) % 4)
        try:
            counts.append(len(base64.b64decode(padded.replace("-", "+").replace("_", "/"), validate=True)))
        except (binascii.Error, ValueError):
            pass
    return min(counts)


def validate_secret(secret: str) -> str:
    """``secret`` if it is empty (no authentication) or carries ≥ 128 bits; else ConfigError.

    The message says how to make a good one. Returns the secret unchanged.
    """
    if not isinstance(secret, str):
        raise ConfigError(f"the shared secret must be a string, not {type(secret).__name__}")
    if not secret:
        return secret
    if secret != secret.strip():
        raise ConfigError("the shared secret has leading or trailing whitespace (a newline from a file?); strip it")
    strength = secret_strength(secret)
    if strength < MIN_SECRET_BYTES:
        raise ConfigError(
            f"the shared secret is too weak: it carries {strength} bytes, at least {MIN_SECRET_BYTES} "
            f"(128 bits) are required (hex and base64 count decoded). Generate one with `mpcomm secret` "
            f"(or python -c 'import secrets; print(secrets.token_hex(32))')"
        )
    return secret


def _mac(secret: str, role: bytes, context: bytes, first: bytes, second: bytes) -> bytes:
    return hmac.new(secret.encode(), role + b"|" + context + b"|" + first + second, hashlib.sha256).digest()


def _send(sock: socket.socket, ftype: int, flags: int, payload: bytes, deadline: float) -> None:
    wire.send_all(sock, wire.pack_frame(AUTH_MAGIC, ftype, payload, flags), deadline)


def _recv(sock: socket.socket, want: int, size: int, deadline: float) -> tuple[int, bytes]:
    head = wire.recv_exact(sock, wire.HEADER.size, deadline)
    magic, version, ftype, flags, _, length = wire.HEADER.unpack(head)
    if magic != AUTH_MAGIC:
        raise ProtocolError(f"expected an mpcomm authentication frame, got magic {magic!r}: "
                            "not an mpcomm peer, an older mpcomm, or garbage")
    if version != wire.PROTOCOL_VERSION:
        raise ProtocolError(f"peer speaks protocol version {version}, this node speaks {wire.PROTOCOL_VERSION}")
    if ftype != want or length != size:
        raise ProtocolError(f"unexpected authentication frame (type {ftype}, {length} bytes)")
    return flags, wire.recv_exact(sock, size, deadline)


def _run(fn, sock: socket.socket, secret: str, deadline: float, context: bytes, what: str) -> tuple[bytes, bytes]:  # type: ignore[no-untyped-def]
    validate_secret(secret)
    if deadline != deadline:  # NaN
        raise ValueError("deadline is NaN")
    old = sock.gettimeout()
    try:
        return fn(sock, secret, deadline, context)
    except TimeoutError as exc:
        if isinstance(exc, HandshakeTimeout):
            raise
        raise HandshakeTimeout(f"{what} did not finish in time: {exc}") from exc
    except PeerConnectionError:
        raise
    except OSError as exc:
        raise PeerConnectionError(f"{what} failed: {exc}") from exc
    finally:
        try:
            sock.settimeout(old)
        except OSError:
            pass


def _client(sock: socket.socket, secret: str, deadline: float, context: bytes) -> tuple[bytes, bytes]:
    sflags, snonce = _recv(sock, T_CHALLENGE, NONCE, deadline)
    cnonce = os.urandom(NONCE)
    mine = F_SECRET if secret else 0
    proof = _mac(secret, b"client", context, snonce, cnonce) if secret else bytes(PROOF)
    _send(sock, T_PROOF, mine, cnonce + proof, deadline)
    if bool(sflags & F_SECRET) != bool(secret):
        # The server refuses too (it sees our flags); say which side lacks what.
        raise AuthenticationError(_REFUSALS[NO_SECRET_HERE if secret else SECRET_REQUIRED], retryable=False)
    status, sproof = _recv(sock, T_RESULT, PROOF, deadline)
    if status != OK:
        raise AuthenticationError(_REFUSALS.get(status, f"refused by the server (status {status})"),
                                  retryable=False)
    if secret and not hmac.compare_digest(sproof, _mac(secret, b"server", context, cnonce, snonce)):
        raise AuthenticationError("the server failed to prove it knows the shared secret", retryable=False)
    return cnonce, snonce


def _server(sock: socket.socket, secret: str, deadline: float, context: bytes) -> tuple[bytes, bytes]:
    snonce = os.urandom(NONCE)
    _send(sock, T_CHALLENGE, F_SECRET if secret else 0, snonce, deadline)
    cflags, body = _recv(sock, T_PROOF, NONCE + PROOF, deadline)
    cnonce, proof = body[:NONCE], body[NONCE:]
    status = OK
    if bool(cflags & F_SECRET) != bool(secret):
        status = SECRET_REQUIRED if secret else NO_SECRET_HERE
    elif secret and not hmac.compare_digest(proof, _mac(secret, b"client", context, snonce, cnonce)):
        status = BAD_PROOF
    if status != OK:
        try:
            _send(sock, T_RESULT, status, bytes(PROOF), deadline)
        except (OSError, TimeoutError):
            pass  # the client may already have hung up (it saw the mismatch itself)
        reason = {SECRET_REQUIRED: "the peer has no shared secret and this node requires one",
                  NO_SECRET_HERE: "the peer has a shared secret and this node has none",
                  BAD_PROOF: "the peer failed the shared-secret challenge"}[status]
        raise AuthenticationError(reason, retryable=False)
    _send(sock, T_RESULT, OK, _mac(secret, b"server", context, cnonce, snonce) if secret else bytes(PROOF), deadline)
    return cnonce, snonce


def client_authenticate(sock: socket.socket, secret: str, deadline: float, context: bytes) -> None:
    """Authenticate the connecting side of ``sock`` (and the server, mutually).

    ``deadline`` is a ``time.monotonic()`` instant bounding the whole exchange.
    Raises AuthenticationError (wrong or missing secret on either side),
    ProtocolError (not an mpcomm authentication frame), HandshakeTimeout
    (deadline passed) or PeerConnectionError (the connection failed). The
    socket's timeout is restored afterwards.
    """
    client_exchange(sock, secret, deadline, context)


def server_authenticate(sock: socket.socket, secret: str, deadline: float, context: bytes) -> None:
    """Authenticate the peer that connected to ``sock``; the accepting side's half of the exchange.

    Same arguments and errors as :func:`client_authenticate`. The peer's proof
    is checked before this side reveals any proof of its own.
    """
    server_exchange(sock, secret, deadline, context)


def client_exchange(sock: socket.socket, secret: str, deadline: float, context: bytes) -> tuple[bytes, bytes]:
    """:func:`client_authenticate` returning ``(client_nonce, server_nonce)`` to bind later messages to."""
    return _run(_client, sock, secret, deadline, context, "authentication with the server")


def server_exchange(sock: socket.socket, secret: str, deadline: float, context: bytes) -> tuple[bytes, bytes]:
    """:func:`server_authenticate` returning ``(client_nonce, server_nonce)``."""
    return _run(_server, sock, secret, deadline, context, "authentication of the peer")


def deadline_in(seconds: float) -> float:
    """A deadline ``seconds`` from now, for the functions above."""
    return time.monotonic() + seconds
