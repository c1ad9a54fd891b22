"""The control channel: handshake, region look-ups, notifications, plugin messages.

Every engine listens on ``transport.endpoint``. A peer that wants to talk
connects, and the two exchange::

    hello     → protocol version, node id, epoch, client nonce, client info
    challenge ← server nonce, server proof = HMAC(secret, "server"|cn|sn)
    auth      → client proof = HMAC(secret, "client"|sn|cn)
    welcome   ← server info (transports it runs, host identity)

The secret itself never travels. Without a secret both proofs are empty and
a side that has one refuses a side that has none. The whole handshake runs
under ``transport.handshake_timeout_ms``. After it, the connection carries
JSON requests with an ``id`` and their replies, in both directions served by
one thread per connection. This peer-to-peer look-up is the embedded default:
no metadata server is involved.
"""

from __future__ import annotations

import hashlib
import hmac
import itertools
import logging
import secrets
import socket
import threading
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

from . import wire
from .errors import (
    AuthenticationError,
    MpcommError,
    PeerConnectionError,
    ProtocolError,
    TransferTimeout,
    error_from_code,
)
from .peer import PeerInfo, format_endpoint, parse_endpoint

log = logging.getLogger("mpcomm.control")


def _proof(secret: str, role: bytes, a: str, b: str) -> str:
    if not secret:
        return ""
    return hmac.new(secret.encode(), role + bytes.fromhex(a) + bytes.fromhex(b), hashlib.sha256).hexdigest()


def _tune(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for opt, val in (("TCP_KEEPIDLE", 5), ("TCP_KEEPINTVL", 2), ("TCP_KEEPCNT", 3)):
        if hasattr(socket, opt):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, opt), val)


def listen(host: str, port: int, backlog: int = 128) -> socket.socket:
    """A listening TCP socket on ``host`` (IPv4, IPv6 or a name)."""
    infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    last: OSError | None = None
    for family, stype, proto, _, addr in infos:
        s = socket.socket(family, stype, proto)
        try:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
            s.bind(addr)
            s.listen(backlog)
            return s
        except OSError as exc:
            s.close()
            last = exc
    raise last or OSError(f"cannot listen on {host}:{port}")


Handler = Callable[[PeerInfo, dict[str, Any]], dict[str, Any]]


class ControlServer:
    """Accepts peers, authenticates them, and answers their requests."""

    def __init__(
        self,
        host: str,
        port: int,
        *,
        local_info: Callable[[], PeerInfo],
        secret: str,
        handshake_timeout: float,
        handler: Handler,
    ) -> None:
        self._sock = listen(host, port)
        self.host = host
        self.port = self._sock.getsockname()[1]
        self._local_info = local_info
        self._secret = secret
        self._handshake_timeout = handshake_timeout
        self._handler = handler
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._closed = False
        self._thread = threading.Thread(target=self._accept_loop, name=f"mpcomm-ctl-{self.port}", daemon=True)
        self._thread.start()

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                if self._closed:
                    return
                continue
            with self._lock:
                if self._closed:
                    conn.close()
                    return
                self._conns.add(conn)
            threading.Thread(target=self._serve, args=(conn,), name="mpcomm-ctl-conn", daemon=True).start()

    def _handshake(self, conn: socket.socket) -> PeerInfo:
        conn.settimeout(self._handshake_timeout)
        hello = wire.read_json(conn)
        if hello.get("t") != "hello":
            raise ProtocolError(f"expected hello, got {hello.get('t')!r}")
        if hello.get("proto") != wire.PROTOCOL_VERSION:
            wire.send_json(conn, {"t": "error", "code": "protocol",
                                  "message": f"protocol {hello.get('proto')} not supported (this node speaks {wire.PROTOCOL_VERSION})"})
            raise ProtocolError(f"peer speaks protocol {hello.get('proto')}")
        cnonce = str(hello.get("nonce", ""))
        try:
            bytes.fromhex(cnonce)
        except ValueError:
            raise ProtocolError("bad nonce in hello") from None
        if bool(hello.get("auth")) != bool(self._secret):
            wire.send_json(conn, {"t": "error", "code": "auth",
                                  "message": "shared-secret mismatch: one side has a secret, the other has none"})
            raise AuthenticationError("peer and node disagree on whether a secret is required")
        snonce = secrets.token_hex(16)
        wire.send_json(conn, {"t": "challenge", "nonce": snonce, "proof": _proof(self._secret, b"server", cnonce, snonce)})
        auth = wire.read_json(conn)
        expected = _proof(self._secret, b"client", snonce, cnonce)
        if auth.get("t") != "auth" or not hmac.compare_digest(str(auth.get("proof", "")), expected):
            wire.send_json(conn, {"t": "error", "code": "auth", "message": "authentication failed"})
            raise AuthenticationError("peer failed the shared-secret challenge")
        try:
            peer = PeerInfo.from_dict(auth.get("info") or hello.get("info") or {})
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ProtocolError(f"bad peer info: {exc}") from exc
        wire.send_json(conn, {"t": "welcome", "info": self._local_info().to_dict()})
        conn.settimeout(None)
        return peer

    def _serve(self, conn: socket.socket) -> None:
        peer_name = "?"
        try:
            _tune(conn)
            peer_name = format_endpoint(*conn.getpeername()[:2])
            peer = self._handshake(conn)
            while not self._closed:
                msg = wire.read_json(conn)
                rid = msg.get("id")
                try:
                    reply = self._handler(peer, msg)
                except MpcommError as exc:
                    reply = {"t": "error", "code": exc.code, "message": str(exc)}
                except Exception as exc:  # a bug in a handler must not kill the connection silently
                    log.exception("control handler failed for %s", msg.get("t"))
                    reply = {"t": "error", "code": "error", "message": f"internal error: {exc}"}
                reply["id"] = rid
                wire.send_json(conn, reply)
        except (ProtocolError, AuthenticationError) as exc:
            log.warning("control connection from %s closed: %s", peer_name, exc)
        except (OSError, PeerConnectionError, TimeoutError):
            pass  # peer went away
        finally:
            with self._lock:
                self._conns.discard(conn)
            conn.close()

    def close(self) -> None:
        self._closed = True
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
        with self._lock:
            conns = list(self._conns)
        for c in conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


class PeerLink:
    """Our connection to one peer's control endpoint."""

    def __init__(
        self,
        address: str,
        *,
        local_info: PeerInfo,
        secret: str,
        timeout: float,
        on_lost: Callable[[PeerLink], None],
    ) -> None:
        self.address = address
        self._on_lost = on_lost
        self._pending: dict[int, Future[dict[str, Any]]] = {}
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._send_lock = threading.Lock()
        self.alive = False
        host, port = parse_endpoint(address)
        try:
            self._sock = socket.create_connection((host, port), timeout=timeout)
        except TimeoutError as exc:
            raise PeerConnectionError(f"connecting to {address} timed out after {timeout}s", peer=address) from exc
        except OSError as exc:
            raise PeerConnectionError(f"cannot connect to {address}: {exc.strerror or exc}", peer=address) from exc
        try:
            _tune(self._sock)
            self.info = self._handshake(local_info, secret, timeout)
        except BaseException:
            self._sock.close()
            raise
        self.alive = True
        self._reader = threading.Thread(target=self._read_loop, name=f"mpcomm-peer-{address}", daemon=True)
        self._reader.start()

    def _handshake(self, local: PeerInfo, secret: str, timeout: float) -> PeerInfo:
        s = self._sock
        s.settimeout(timeout)
        cnonce = secrets.token_hex(16)
        try:
            wire.send_json(s, {"t": "hello", "proto": wire.PROTOCOL_VERSION, "node_id": local.node_id,
                               "epoch": local.epoch, "nonce": cnonce, "auth": bool(secret)})
            ch = wire.read_json(s)
            self._raise_if_error(ch)
            snonce = str(ch.get("nonce", ""))
            if ch.get("t") != "challenge":
                raise ProtocolError(f"expected challenge, got {ch.get('t')!r}")
            if not hmac.compare_digest(str(ch.get("proof", "")), _proof(secret, b"server", cnonce, snonce)):
                raise AuthenticationError(f"{self.address} failed to prove it knows the shared secret", peer=self.address)
            wire.send_json(s, {"t": "auth", "proof": _proof(secret, b"client", snonce, cnonce), "info": local.to_dict()})
            welcome = wire.read_json(s)
            self._raise_if_error(welcome)
            if welcome.get("t") != "welcome":
                raise ProtocolError(f"expected welcome, got {welcome.get('t')!r}")
            info = PeerInfo.from_dict(welcome["info"])
        except TimeoutError as exc:
            raise PeerConnectionError(f"handshake with {self.address} timed out after {timeout}s", peer=self.address) from exc
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ProtocolError(f"malformed handshake from {self.address}: {exc}", peer=self.address) from exc
        except PeerConnectionError as exc:
            raise PeerConnectionError(f"handshake with {self.address} failed: {exc}", peer=self.address) from exc
        except OSError as exc:
            raise PeerConnectionError(f"handshake with {self.address} failed: {exc}", peer=self.address) from exc
        s.settimeout(None)
        return info

    def _raise_if_error(self, msg: dict[str, Any]) -> None:
        if msg.get("t") == "error":
            raise error_from_code(str(msg.get("code")), f"{self.address}: {msg.get('message')}", peer=self.address)

    def _read_loop(self) -> None:
        reason: BaseException = PeerConnectionError(f"connection to {self.address} lost", peer=self.address)
        try:
            while True:
                msg = wire.read_json(self._sock)
                with self._lock:
                    fut = self._pending.pop(msg.get("id"), None)  # type: ignore[arg-type]
                if fut is not None:
                    fut.set_result(msg)
        except ProtocolError as exc:
            log.warning("closing control connection to %s: %s", self.address, exc)
            reason = exc
        except (OSError, PeerConnectionError):
            pass
        self._die(reason)

    def _die(self, reason: BaseException) -> None:
        with self._lock:
            was_alive, self.alive = self.alive, False
            pending, self._pending = self._pending, {}
        try:
            self._sock.close()
        except OSError:
            pass
        for fut in pending.values():
            if not fut.done():
                fut.set_exception(PeerConnectionError(f"{self.address}: {reason}", peer=self.address))
        if was_alive:
            self._on_lost(self)

    def request(self, msg: dict[str, Any], timeout: float) -> dict[str, Any]:
        """Send ``msg`` and wait for its reply; peer errors are raised as mpcomm errors."""
        fut: Future[dict[str, Any]] = Future()
        with self._lock:
            if not self.alive:
                raise PeerConnectionError(f"connection to {self.address} is closed", peer=self.address)
            rid = next(self._ids)
            self._pending[rid] = fut
        try:
            with self._send_lock:
                wire.send_json(self._sock, {**msg, "id": rid})
        except OSError as exc:
            self._die(exc)
            raise PeerConnectionError(f"sending to {self.address} failed: {exc}", peer=self.address) from exc
        try:
            reply = fut.result(timeout)
        except FutureTimeout:
            with self._lock:
                self._pending.pop(rid, None)
            raise TransferTimeout(f"{self.address} did not answer {msg.get('t')!r} within {timeout:.3g}s", peer=self.address) from None
        self._raise_if_error(reply)
        return reply

    def close(self) -> None:
        with self._lock:
            self.alive = False
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
