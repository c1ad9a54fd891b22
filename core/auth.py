"""Mutual shared-secret authentication for every mpcomm connection (control and data).

One challenge-response, run right after ``connect``/``accept`` and before
anything else is read from the peer::

    server → client   challenge: flags(has secret) | server nonce (32 B) | server id (32 B)
    client → server   proof:     flags(has secret) | client nonce (32 B) | dialled address (18 B) |
                                 HMAC-SHA256(secret, "mpcomm-auth/2 client|" transcript)
    server → client   result:    status | HMAC-SHA256(secret, "mpcomm-auth/2 server|" transcript)

    transcript = context | server nonce | server id | client nonce | dialled address  ("|"-joined)

Both proofs cover the whole transcript:

* ``context`` names the channel (``b"mpcomm/control/1"``, the tcp data
  plane's own) so a proof for one kind of connection is not one for another;
* both nonces make every proof single-use;
* ``server id`` is SHA-256 of the server's identity (its node id and epoch
  on the control channel, see :func:`identity_digest`), so the client's
  proof names the instance it meant to reach and the server's proof vouches
  for the identity the server then announces (the control channel checks
  the welcome against it);
* ``dialled address`` is the IP and port the client's kernel connected to
  (``getpeername``, IPv4 mapped into IPv6, 16 + 2 bytes). The server refuses
  a proof for an address that is not its own: the local address the
  connection reached (``getsockname``) or one it was told it is reachable
  at (``reachable_at``: an advertised address, a NAT or proxy in front).
  This is what defeats a relay: a member that dials an impostor proves "I
  dialled the impostor", and the real target, which is not the impostor,
  refuses that proof. Without TLS nothing stops an attacker *on the path*
  to the real address (it sees the real address dialled); only TLS with
  verified certificates (``mpcomm.tls``) covers that;
* the role (``client``/``server``) is the direction, so neither proof can
  be reflected as the other.

The side that connects proves first, and the server answers with its own
proof only after it has checked the client's (``hmac.compare_digest``), so
whoever can merely reach a port learns nothing to test guesses against.
The client checks the server's proof before anything else is exchanged, so
the authentication is mutual.

Every message is an mpcomm frame (:mod:`mpcomm.wire` header, magic ``MA``)
of one fixed size: reads are exact and bounded, and the ``deadline``
(``time.monotonic()`` based) covers the whole exchange, not each read.

An empty secret on both sides means no authentication: the same three
frames travel with zero proofs (and no address check), so a side that has a
secret still refuses a side that has none, with a message that says so.

The secret never travels; it is the HMAC key (its UTF-8 bytes, as given).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import ipaddress
import os
import re
import socket
import time
from collections.abc import Iterable
from typing import NamedTuple

from . import wire
from .errors import (
    AuthenticationError,
    ConfigError,
    HandshakeTimeout,
    MpcommError,
    PeerConnectionError,
    ProtocolError,
)

__all__ = [
    "MIN_SECRET_BYTES",
    "Transcript",
    "address_bytes",
    "client_authenticate",
    "identity_digest",
    "resolve_addresses",
    "secret_strength",
    "server_authenticate",
    "validate_secret",
]

AUTH_MAGIC = b"MA"
NONCE = 32
PROOF = 32
ID = 32  # the server id: identity_digest(...)
ADDRESS = 18  # the dialled address: address_bytes(...)
#: Fewest bytes of entropy a secret must carry (128 bits).
MIN_SECRET_BYTES = 16

T_CHALLENGE, T_PROOF, T_RESULT = 1, 2, 3
F_SECRET = 1  # flags bit: this side has a secret

# Result statuses (the result frame's flags).
OK, BAD_PROOF, SECRET_REQUIRED, NO_SECRET_HERE, WRONG_ADDRESS = 0, 1, 2, 3, 4
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


def identity_digest(*parts: str) -> bytes:
    """The 32-byte server id the proofs bind: SHA-256 over ``parts`` (e.g. node id, epoch), NUL-separated."""
    return hashlib.sha256(b"mpcomm-id\0" + b"\0".join(p.encode() for p in parts)).digest()


def address_bytes(sockaddr: object) -> bytes:
    """A socket address as the 18 bytes the proofs bind: IPv6 (IPv4 mapped) + port; zeros if not IP."""
    if not isinstance(sockaddr, tuple) or len(sockaddr) < 2:
        return bytes(ADDRESS)  # AF_UNIX and friends: nothing to bind (no relay through another address)
    host, port = str(sockaddr[0]).split("%", 1)[0], int(sockaddr[1])
    try:
        packed = socket.inet_pton(socket.AF_INET6, host)
    except OSError:
        packed = b"\0" * 10 + b"\xff\xff" + socket.inet_pton(socket.AF_INET, host)
    return packed + port.to_bytes(2, "big")


def resolve_addresses(endpoints: Iterable[str]) -> frozenset[bytes]:
    """Every address ``host:port`` endpoints resolve to, as :func:`address_bytes` (unresolvable ones skipped)."""
    from .peer import parse_endpoint

    out: set[bytes] = set()
    for ep in endpoints:
        try:
            host, port = parse_endpoint(ep)
            for *_, sa in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM):
                out.add(address_bytes(sa))
        except (OSError, ValueError, MpcommError):
            continue
    return frozenset(out)


def _describe(addr: bytes) -> str:
    if addr == bytes(ADDRESS):
        return "a non-IP address"
    ip = ipaddress.IPv6Address(addr[:16])
    host = str(ip.ipv4_mapped) if ip.ipv4_mapped else f"[{ip}]"
    return f"{host}:{int.from_bytes(addr[16:], 'big')}"


def _peer_address(sock: socket.socket) -> object:
    # A socket, or a stream wrapping one (the tcp plugin's TlsStream exposes it as ``raw``).
    for obj in (sock, getattr(sock, "raw", None)):
        fn = getattr(obj, "getpeername", None)
        if fn is not None:
            return fn()
    return None


class Transcript(NamedTuple):
    """What one exchange agreed on; later messages may be bound to it."""

    client_nonce: bytes
    server_nonce: bytes
    server_id: bytes
    dialled: bytes


def _transcript(context: bytes, snonce: bytes, sid: bytes, cnonce: bytes, dialled: bytes) -> bytes:
    return b"|".join((context, snonce, sid, cnonce, dialled))


def _mac(secret: str, role: bytes, transcript: bytes) -> bytes:
    return hmac.new(secret.encode(), b"mpcomm-auth/2 " + role + b"|" + transcript, hashlib.sha256).digest()


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
        raise ProtocolError(f"unexpected authentication frame (type {ftype}, {length} bytes; expected type "
                            f"{want}, {size} bytes: an mpcomm from before transcript-bound proofs?)")
    return flags, wire.recv_exact(sock, size, deadline)


def _run(fn, sock: socket.socket, secret: str, deadline: float, what: str, *args) -> Transcript:  # type: ignore[no-untyped-def]
    validate_secret(secret)
    if deadline != deadline:  # NaN
        raise ValueError("deadline is NaN")
    old = sock.gettimeout()
    try:
        return fn(sock, secret, deadline, *args)
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


def _client(sock: socket.socket, secret: str, deadline: float, context: bytes) -> Transcript:
    sflags, challenge = _recv(sock, T_CHALLENGE, NONCE + ID, deadline)
    snonce, sid = challenge[:NONCE], challenge[NONCE:]
    cnonce = os.urandom(NONCE)
    dialled = address_bytes(_peer_address(sock))  # where our kernel connected, not what anyone told us
    transcript = _transcript(context, snonce, sid, cnonce, dialled)
    mine = F_SECRET if secret else 0
    proof = _mac(secret, b"client", transcript) if secret else bytes(PROOF)
    _send(sock, T_PROOF, mine, cnonce + dialled + proof, deadline)
    if bool(sflags & F_SECRET) != bool(secret):
        # The server refuses too (it sees our flags); say which side lacks what.
        raise AuthenticationError(_REFUSALS[NO_SECRET_HERE if secret else SECRET_REQUIRED], retryable=False)
    status, sproof = _recv(sock, T_RESULT, PROOF, deadline)
    if status == WRONG_ADDRESS:
        raise AuthenticationError(f"refused: the server is not at {_describe(dialled)}, the address this side "
                                  "dialled (the connection was relayed through another address, or that "
                                  "address is a NAT/proxy the server was not told about: transport.reachable_at)",
                                  retryable=False)
    if status != OK:
        raise AuthenticationError(_REFUSALS.get(status, f"refused by the server (status {status})"),
                                  retryable=False)
    if secret and not hmac.compare_digest(sproof, _mac(secret, b"server", transcript)):
        raise AuthenticationError("the server failed to prove it knows the shared secret", retryable=False)
    return Transcript(cnonce, snonce, sid, dialled)


def _server(sock: socket.socket, secret: str, deadline: float, context: bytes, sid: bytes,
            reachable_at: frozenset[bytes]) -> Transcript:
    snonce = os.urandom(NONCE)
    _send(sock, T_CHALLENGE, F_SECRET if secret else 0, snonce + sid, deadline)
    cflags, body = _recv(sock, T_PROOF, NONCE + ADDRESS + PROOF, deadline)
    cnonce, dialled, proof = body[:NONCE], body[NONCE:NONCE + ADDRESS], body[NONCE + ADDRESS:]
    transcript = _transcript(context, snonce, sid, cnonce, dialled)
    status = OK
    if bool(cflags & F_SECRET) != bool(secret):
        status = SECRET_REQUIRED if secret else NO_SECRET_HERE
    elif secret and dialled != address_bytes(sock.getsockname()) and dialled not in reachable_at:
        status = WRONG_ADDRESS
    elif secret and not hmac.compare_digest(proof, _mac(secret, b"client", transcript)):
        status = BAD_PROOF
    if status != OK:
        try:
            _send(sock, T_RESULT, status, bytes(PROOF), deadline)
        except (OSError, TimeoutError):
            pass  # the client may already have hung up (it saw the mismatch itself)
        reason = {SECRET_REQUIRED: "the peer has no shared secret and this node requires one",
                  NO_SECRET_HERE: "the peer has a shared secret and this node has none",
                  WRONG_ADDRESS: f"the peer's proof is for {_describe(dialled)}, which is not this node "
                                 "(a relayed proof, or a NAT/proxy address missing from transport.reachable_at)",
                  BAD_PROOF: "the peer failed the shared-secret challenge"}[status]
        raise AuthenticationError(reason, retryable=False)
    _send(sock, T_RESULT, OK, _mac(secret, b"server", transcript) if secret else bytes(PROOF), deadline)
    return Transcript(cnonce, snonce, sid, dialled)


def client_authenticate(sock: socket.socket, secret: str, deadline: float, context: bytes) -> None:
    """Authenticate the connecting side of ``sock`` (and the server, mutually).

    ``deadline`` is a ``time.monotonic()`` instant bounding the whole exchange.
    Raises AuthenticationError (wrong or missing secret on either side, or a
    server that is not at the address dialled), ProtocolError (not an mpcomm
    authentication frame), HandshakeTimeout (deadline passed) or
    PeerConnectionError (the connection failed). The socket's timeout is
    restored afterwards.
    """
    client_exchange(sock, secret, deadline, context)


def server_authenticate(sock: socket.socket, secret: str, deadline: float, context: bytes, *,
                        identity: bytes = bytes(32), reachable_at: frozenset[bytes] = frozenset()) -> None:
    """Authenticate the peer that connected to ``sock``; the accepting side's half of the exchange.

    Same arguments and errors as :func:`client_authenticate`, plus the
    server's ``identity`` (:func:`identity_digest`, bound into both proofs)
    and the extra addresses it accepts as dialled (:func:`resolve_addresses`;
    the address the connection reached always counts). The peer's proof is
    checked before this side reveals any proof of its own.
    """
    server_exchange(sock, secret, deadline, context, identity=identity, reachable_at=reachable_at)


def client_exchange(sock: socket.socket, secret: str, deadline: float, context: bytes) -> Transcript:
    """:func:`client_authenticate` returning the :class:`Transcript` to bind later messages to."""
    return _run(_client, sock, secret, deadline, "authentication with the server", context)


def server_exchange(sock: socket.socket, secret: str, deadline: float, context: bytes, *,
                    identity: bytes = bytes(32), reachable_at: frozenset[bytes] = frozenset()) -> Transcript:
    """:func:`server_authenticate` returning the :class:`Transcript`."""
    if len(identity) != ID:
        raise ValueError(f"identity must be {ID} bytes (auth.identity_digest)")
    return _run(_server, sock, secret, deadline, "authentication of the peer", context, identity, reachable_at)


def deadline_in(seconds: float) -> float:
    """A deadline ``seconds`` from now, for the functions above."""
    return time.monotonic() + seconds
