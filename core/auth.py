"""Mutual shared-secret authentication of one connection (nonce + HMAC-SHA256).

The server sends a 32-byte nonce ``sn``; the client answers with its own
32-byte nonce ``cn`` and ``HMAC-SHA256(secret, b"client" + context + sn + cn)``:
the side that connects proves first, so a stranger who connects learns
nothing it could test guesses against. Only after checking that proof
(``hmac.compare_digest``) does the server send
``HMAC-SHA256(secret, b"server" + context + cn + sn)``, which the client
checks. With an empty secret on both sides, 32 zero bytes stand in for each
proof; a side with a secret refuses a side without.

``deadline`` (``time.monotonic()``) covers the whole exchange, not each recv.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import socket
import time

from .errors import AuthenticationError, PeerConnectionError, TransferTimeout

__all__ = ["client_authenticate", "server_authenticate"]

_NONCE = 32
_PROOF = 32


def _proof(secret: str, role: bytes, context: bytes, a: bytes, b: bytes) -> bytes:
    if not secret:
        return bytes(_PROOF)
    return hmac.new(secret.encode(), role + context + a + b, hashlib.sha256).digest()


def _send(sock: socket.socket, data: bytes, deadline: float) -> None:
    view = memoryview(data)
    while view:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TransferTimeout("authentication did not finish before its deadline")
        sock.settimeout(left)
        try:
            n = sock.send(view)
        except TimeoutError:
            raise TransferTimeout("authentication did not finish before its deadline") from None
        except OSError as exc:
            raise PeerConnectionError(f"connection lost during authentication: {exc}") from exc
        view = view[n:]


def _recv(sock: socket.socket, n: int, deadline: float) -> bytes:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TransferTimeout("authentication did not finish before its deadline")
        sock.settimeout(left)
        try:
            r = sock.recv_into(view[got:], n - got)
        except TimeoutError:
            raise TransferTimeout("authentication did not finish before its deadline") from None
        except OSError as exc:
            raise PeerConnectionError(f"connection lost during authentication: {exc}") from exc
        if r == 0:
            raise PeerConnectionError(f"connection closed during authentication after {got} of {n} bytes")
        got += r
    return bytes(buf)


def client_authenticate(sock: socket.socket, secret: str, deadline: float, context: bytes) -> None:
    """Prove knowledge of ``secret`` to the server first, then check the server's proof."""
    old = sock.gettimeout()
    try:
        sn = _recv(sock, _NONCE, deadline)
        cn = os.urandom(_NONCE)
        _send(sock, cn + _proof(secret, b"client", context, sn, cn), deadline)
        theirs = _recv(sock, _PROOF, deadline)
        if not hmac.compare_digest(theirs, _proof(secret, b"server", context, cn, sn)):
            raise AuthenticationError("the server did not prove knowledge of the shared secret "
                                      "(different secret, or one side has none)")
    finally:
        sock.settimeout(old)


def server_authenticate(sock: socket.socket, secret: str, deadline: float, context: bytes) -> None:
    """Check the client's proof before revealing anything derived from ``secret``."""
    old = sock.gettimeout()
    try:
        sn = os.urandom(_NONCE)
        _send(sock, sn, deadline)
        reply = _recv(sock, _NONCE + _PROOF, deadline)
        cn, theirs = reply[:_NONCE], reply[_NONCE:]
        if not hmac.compare_digest(theirs, _proof(secret, b"client", context, sn, cn)):
            raise AuthenticationError("the client did not prove knowledge of the shared secret "
                                      "(different secret, or one side has none)")
        _send(sock, _proof(secret, b"server", context, cn, sn), deadline)
    finally:
        sock.settimeout(old)
