"""The control channel: handshake, region look-ups, notifications, plugin messages.

Every engine listens on ``transport.endpoint``. A peer that wants to talk
connects, and the two run, all under one deadline
(``transport.handshake_timeout_ms``, for the whole exchange, not per read)::

    TLS handshake            (only with transport.tls = true; mutual certificates)
    mpcomm.auth exchange     server nonce + id → client nonce + dialled address + proof → server proof
                             (both proofs bound to the whole transcript; the server's id is
                             SHA-256 of its node id and epoch, checked against the welcome)
    hello    →  protocol version, the client's PeerInfo (checked, see below)
    welcome  ←  the server's PeerInfo and its idle timeout

The client proves it knows the secret before the server reveals anything
derived from it (:mod:`mpcomm.auth`). The hello's identity claims are
checked against this node and its live connections (:meth:`ControlServer`
docs; the rule is written down in docs/security.md). After the welcome the
connection carries JSON requests with an integer ``id`` and their replies,
served by one thread per connection, each request and reply bounded in size
(``limits.max_frame_bytes``) and in time (``limits.frame_timeout_ms``); a
connection that carries nothing for ``limits.idle_timeout_ms`` is closed
(links ping at a third of the server's idle timeout, so live ones never are).

This peer-to-peer look-up is the embedded default: no metadata server is
involved.
"""

from __future__ import annotations

import errno
import hashlib
import hmac
import itertools
import logging
import os
import select
import socket
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

from . import auth, wire
from .config import Config, LimitsSection
from .errors import (
    AuthenticationError,
    BackPressureError,
    HandshakeTimeout,
    LimitError,
    MpcommError,
    PeerConnectionError,
    ProtocolError,
    TransferTimeout,
    error_from_code,
)
from .peer import PeerInfo, format_endpoint, parse_endpoint

__all__ = ["CONTROL_CONTEXT", "ControlServer", "NotificationQueue", "PeerLink", "listen"]

log = logging.getLogger("mpcomm.control")

#: Names the control channel in every authentication proof (see mpcomm.auth).
CONTROL_CONTEXT = b"mpcomm/control/1"

_ACCEPT_ERRNOS_OUT_OF_RESOURCES = {errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM}
_ACCEPT_BACKOFF_MAX = 1.0

# -- proof that a connection comes from this very engine ------------------------------
#
# An engine may dial itself (open(engine.address, ...)). Its hello then claims this
# node's own identity, which a stranger must never be allowed to do. The dialling side
# proves it is the same engine with a key that never leaves the process.

_SELF_KEYS: dict[tuple[str, str], bytes] = {}
_SELF_LOCK = threading.Lock()


def _self_key(node_id: str, epoch: str) -> bytes:
    with _SELF_LOCK:
        return _SELF_KEYS.setdefault((node_id, epoch), os.urandom(32))


def _self_proof(info: PeerInfo, role: bytes, cnonce: bytes, snonce: bytes) -> str:
    return hmac.new(_self_key(info.node_id, info.epoch), role + cnonce + snonce, hashlib.sha256).hexdigest()


def _tune(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for opt, val in (("TCP_KEEPIDLE", 5), ("TCP_KEEPINTVL", 2), ("TCP_KEEPCNT", 3)):
        if hasattr(socket, opt):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, opt), val)


def _readable(sock: socket.socket, timeout: float) -> bool:
    """Whether a frame has started arriving within ``timeout`` (TLS-buffered bytes count)."""
    pending = getattr(sock, "pending", None)
    if pending is not None and pending() > 0:
        return True
    r, _, _ = select.select([sock], [], [], max(timeout, 0))
    return bool(r)


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


class _RateLimitedLog:
    """At most ``per_s`` warnings a second, so a flood of bad peers cannot flood the log."""

    def __init__(self, per_s: int = 20) -> None:
        self.per_s = per_s
        self.window = 0.0
        self.count = 0
        self.suppressed = 0

    def warning(self, msg: str, *args: Any) -> None:
        now = time.monotonic()
        if now - self.window >= 1.0:
            if self.suppressed:
                log.warning("(%d similar control-connection warnings suppressed)", self.suppressed)
            self.window, self.count, self.suppressed = now, 0, 0
        self.count += 1
        if self.count <= self.per_s:
            log.warning(msg, *args)
        else:
            self.suppressed += 1


class NotificationQueue:
    """Received notifications held for ``wait_notification``, bounded in count and bytes.

    Policy (docs/security.md): when full, :meth:`put` refuses with a retryable
    :class:`~mpcomm.BackPressureError`; the control server sends that back to
    the peer as its request's error, so the sender learns its notification was
    not taken. Nothing queued is ever dropped.
    """

    def __init__(self, max_count: int, max_bytes: int) -> None:
        self.max_count = max_count
        self.max_bytes = max_bytes
        self._items: deque[tuple[Any, int]] = deque()
        self._bytes = 0  # of the items queued and the room held for reserved ones
        self._held = 0  # items reserved, not yet put
        self._cond = threading.Condition()

    def put(self, item: Any, size: int) -> None:
        with self._cond:
            self._hold(size)
            self._append(item, size)

    def reserve(self, size: int) -> None:
        """Hold room for one item of ``size`` bytes (BackPressureError when full), for an item whose
        data must land first: then :meth:`put_reserved` or :meth:`cancel`. Held room counts
        against the limits as a queued item does."""
        with self._cond:
            self._hold(size)
            self._held += 1

    def put_reserved(self, item: Any, size: int) -> None:
        with self._cond:
            self._held -= 1
            self._append(item, size)

    def cancel(self, size: int) -> None:
        with self._cond:
            self._held -= 1
            self._bytes -= size

    def _hold(self, size: int) -> None:
        count = len(self._items) + self._held
        if count >= self.max_count or self._bytes + size > self.max_bytes:
            raise BackPressureError(
                f"notification queue full ({count} notifications, {self._bytes} bytes; "
                f"limits.max_queued_notifications={self.max_count}, "
                f"limits.max_queued_notify_bytes={self.max_bytes}): nobody is consuming them")
        self._bytes += size

    def _append(self, item: Any, size: int) -> None:
        self._items.append((item, size))
        self._cond.notify()

    def get(self, timeout: float | None = None) -> Any:
        """Next item; TimeoutError after ``timeout`` seconds."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._items, timeout):
                raise TimeoutError(f"no notification within {timeout}s")
            item, size = self._items.popleft()
            self._bytes -= size
            return item

    def __len__(self) -> int:
        return len(self._items)

    @property
    def nbytes(self) -> int:
        return self._bytes


Handler = Callable[[PeerInfo, dict[str, Any]], dict[str, Any]]


class _Conn:
    """One accepted control connection's bookkeeping."""

    __slots__ = ("sock", "ip", "peer")

    def __init__(self, sock: socket.socket, ip: str) -> None:
        self.sock = sock
        self.ip = ip
        self.peer: PeerInfo | None = None


class ControlServer:
    """Accepts peers, authenticates them, checks who they claim to be, and answers their requests.

    Identity rule (docs/security.md): a hello may claim this node's own
    node_id or epoch only with a proof that it comes from this very engine; an
    epoch held by a live connection of another node_id is refused; a node_id
    held by a live connection with another epoch is refused unless the new
    connection proved the shared secret (or a CA-signed client certificate);
    without either, a second connection claiming a live (node_id, epoch) must
    come from the same source address. Claims never change after the hello.
    """

    def __init__(
        self,
        host: str,
        port: int,
        *,
        local_info: Callable[[], PeerInfo],
        secret: str,
        handshake_timeout: float,
        handler: Handler,
        config: Config | None = None,
    ) -> None:
        cfg = config or Config()
        self._limits: LimitsSection = cfg.limits
        self._tls = None
        self._verified_certs = False
        if cfg.transport.tls:
            from . import tls

            self._tls = tls.server_context(cfg)
            self._verified_certs = cfg.tls.require_client_cert
        self._secret = auth.validate_secret(secret)
        self._sock = listen(host, port)
        self.host = host
        self.port = self._sock.getsockname()[1]
        self._local_info = local_info
        self._handshake_timeout = handshake_timeout
        self._handler = handler
        self._conns: dict[socket.socket, _Conn] = {}
        self._per_ip: dict[str, int] = {}
        self._lock = threading.Lock()
        self._closed = False
        self._stop = threading.Event()
        self._warn = _RateLimitedLog()
        self._own: tuple[str, str] | None = None
        self._advertise = cfg.transport.advertise
        self._reachable_eps = cfg.transport.reachable_at
        self._reachable: frozenset[bytes] | None = None
        #: Times the accept loop backed off for lack of descriptors (for tests and metrics).
        self.accept_backoffs = 0
        self.refused_connections = 0
        self._thread = threading.Thread(target=self._accept_loop, name=f"mpcomm-ctl-{self.port}", daemon=True)
        self._thread.start()

    # -- accepting ---------------------------------------------------------------

    def _accept_loop(self) -> None:
        backoff = 0.0
        while not self._closed:
            try:
                conn, addr = self._sock.accept()
            except OSError as exc:
                if self._closed:
                    return
                if exc.errno in _ACCEPT_ERRNOS_OUT_OF_RESOURCES:
                    # The connection stays in the backlog; retry once descriptors free up.
                    # Back off (bounded) instead of spinning on an accept that fails at once.
                    backoff = min(max(backoff * 2, 0.005), _ACCEPT_BACKOFF_MAX)
                    self.accept_backoffs += 1
                    self._warn.warning("control endpoint :%d cannot accept: %s; retrying in %.3fs",
                                       self.port, os.strerror(exc.errno or 0), backoff)
                    self._stop.wait(backoff)
                    continue
                if exc.errno in (errno.ECONNABORTED, errno.EPROTO, errno.EINTR, errno.EAGAIN):
                    continue
                self._warn.warning("control endpoint :%d: accept failed: %s", self.port, exc)
                self._stop.wait(0.05)  # unknown failure: never spin
                continue
            backoff = 0.0
            self._admit(conn, str(addr[0]))

    def _admit(self, conn: socket.socket, ip: str) -> None:
        lim = self._limits
        with self._lock:
            if self._closed:
                conn.close()
                return
            if len(self._conns) >= lim.max_connections or self._per_ip.get(ip, 0) >= lim.max_connections_per_peer:
                full = len(self._conns) >= lim.max_connections
                self.refused_connections += 1
                conn.close()
                self._warn.warning("control endpoint :%d refused a connection from %s: %s", self.port, ip,
                                   f"limits.max_connections={lim.max_connections} reached" if full else
                                   f"limits.max_connections_per_peer={lim.max_connections_per_peer} reached")
                return
            c = _Conn(conn, ip)
            self._conns[conn] = c
            self._per_ip[ip] = self._per_ip.get(ip, 0) + 1
        try:
            threading.Thread(target=self._serve, args=(c,), name="mpcomm-ctl-conn", daemon=True).start()
        except RuntimeError as exc:  # can't start new thread: refuse this one, keep accepting
            self._warn.warning("control endpoint :%d: cannot serve %s: %s", self.port, ip, exc)
            self._forget(c)
            conn.close()

    def _forget(self, c: _Conn) -> None:
        with self._lock:
            if self._conns.pop(c.sock, None) is not None:
                n = self._per_ip.get(c.ip, 1) - 1
                if n:
                    self._per_ip[c.ip] = n
                else:
                    self._per_ip.pop(c.ip, None)

    # -- handshake ---------------------------------------------------------------------

    def _refuse(self, sock: socket.socket, exc: MpcommError, deadline: float) -> MpcommError:
        try:
            wire.send_json(sock, {"t": "error", "code": exc.code, "message": str(exc)}, deadline)
        except (OSError, TimeoutError):
            pass
        return exc

    def _handshake(self, c: _Conn) -> PeerInfo:
        deadline = time.monotonic() + self._handshake_timeout
        sock = c.sock
        if self._tls is not None:
            from . import tls

            tsock = tls.tls_server(sock, self._tls, deadline, c.ip)
            with self._lock:  # close() must shut the TLS socket down, not the raw one
                self._conns.pop(sock, None)
                self._conns[tsock] = c
            c.sock = sock = tsock
        local = self._local_info()
        t = auth.server_exchange(sock, self._secret, deadline, CONTROL_CONTEXT,
                                 identity=auth.identity_digest(local.node_id, local.epoch),
                                 reachable_at=self._reachable_at())
        cnonce, snonce = t.client_nonce, t.server_nonce
        hello = wire.read_json(sock, self._limits.max_frame_bytes, deadline)
        if hello.get("t") != "hello":
            raise ProtocolError(f"expected hello, got {str(hello.get('t'))[:40]!r}")
        if hello.get("proto") != wire.PROTOCOL_VERSION:
            raise self._refuse(sock, ProtocolError(
                f"protocol {str(hello.get('proto'))[:20]} not supported (this node speaks {wire.PROTOCOL_VERSION})"),
                deadline)
        try:
            peer = PeerInfo.from_dict(hello.get("info"))  # type: ignore[arg-type]
        except (TypeError, ValueError) as exc:
            raise self._refuse(sock, ProtocolError(f"bad peer info: {exc}"), deadline) from None
        peer.authenticated = bool(self._secret) or self._verified_certs
        self._own = (local.node_id, local.epoch)
        is_self = peer.node_id == local.node_id and peer.epoch == local.epoch
        if peer.node_id == local.node_id or peer.epoch == local.epoch:
            proof = hello.get("self")
            if not (is_self and isinstance(proof, str) and
                    hmac.compare_digest(proof, _self_proof(local, b"client-self", cnonce, snonce))):
                raise self._refuse(sock, AuthenticationError(
                    "the peer claims this node's own identity (node_id or epoch) without proving it is this node",
                    retryable=False), deadline)
        with self._lock:
            conflict = None if is_self else self._identity_conflict(peer, c.ip)
            if conflict is None:
                c.peer = peer
        if conflict is not None:
            raise self._refuse(sock, AuthenticationError(conflict, retryable=False), deadline)
        welcome: dict[str, Any] = {"t": "welcome", "info": local.to_dict(), "idle_ms": self._limits.idle_timeout_ms}
        if is_self:
            welcome["self"] = _self_proof(local, b"server-self", cnonce, snonce)
        wire.send_json(sock, welcome, deadline)
        return peer

    def _reachable_at(self) -> frozenset[bytes]:
        """Addresses besides a connection's own local one that a peer may have dialled to reach us.

        The advertised endpoint and ``transport.reachable_at``, resolved once
        (the first handshake that needs them); names that do not resolve here
        are skipped (docs/security.md).
        """
        reachable = self._reachable
        if reachable is None:  # resolved outside any lock (a slow resolver must not stall accepts)
            eps = list(self._reachable_eps)
            if self._advertise:
                eps.append(format_endpoint(self._advertise, self.port))
            reachable = self._reachable = auth.resolve_addresses(eps)
        return reachable

    def _identity_conflict(self, peer: PeerInfo, ip: str) -> str | None:
        """Why ``peer``'s claim clashes with a live connection, or None (call under the lock)."""
        for other in self._conns.values():
            p = other.peer
            if p is None:
                continue
            if p.epoch == peer.epoch and p.node_id != peer.node_id:
                return f"epoch {peer.epoch[:16]} is held by another connected node"
            if p.node_id == peer.node_id and p.epoch != peer.epoch and not peer.authenticated:
                return (f"node {peer.node_id[:32]} is connected with another epoch; without a shared secret "
                        "a restarted node is accepted once its old connection is gone")
            if p.node_id == peer.node_id and p.epoch == peer.epoch and other.ip != ip and not peer.authenticated:
                return f"node {peer.node_id[:32]} is connected from another address"
        return None

    # -- serving -----------------------------------------------------------------------

    def _serve(self, c: _Conn) -> None:
        lim = self._limits
        try:
            _tune(c.sock)
            peer = self._handshake(c)
            sock = c.sock
            sock.settimeout(lim.frame_timeout_ms / 1000)
            idle = lim.idle_timeout_ms / 1000
            while not self._closed:
                if not _readable(sock, idle):
                    log.debug("closing idle control connection from %s", c.ip)
                    return
                msg = wire.read_json(sock, lim.max_frame_bytes, time.monotonic() + lim.frame_timeout_ms / 1000)
                rid = msg.get("id")
                if rid is not None and (type(rid) is not int or not 0 <= rid < 1 << 63):
                    raise ProtocolError(f"request id must be a non-negative integer, not {str(rid)[:40]}")
                reply = self._answer(peer, msg)
                reply["id"] = rid
                wire.send_json(sock, reply, time.monotonic() + lim.frame_timeout_ms / 1000)
        except (ProtocolError, AuthenticationError) as exc:
            self._warn.warning("control connection from %s closed: %s", c.ip, exc)
        except TimeoutError as exc:  # HandshakeTimeout, or a frame/reply that did not move in time
            self._warn.warning("control connection from %s closed: %s", c.ip,
                               exc if isinstance(exc, HandshakeTimeout) else f"timed out: {exc}")
        except (OSError, PeerConnectionError):
            pass  # peer went away
        except Exception:  # noqa: BLE001 - never let one connection's bug kill the thread silently
            log.exception("control connection from %s failed", c.ip)
        finally:
            self._forget(c)
            try:
                c.sock.close()
            except OSError:
                pass

    def _answer(self, peer: PeerInfo, msg: dict[str, Any]) -> dict[str, Any]:
        kind = msg.get("t")
        if kind == "keepalive":
            return {"t": "keepalive"}
        try:
            if kind == "notify":
                self._check_notify(msg)
            return self._handler(peer, msg)
        except MpcommError as exc:
            return {"t": "error", "code": exc.code, "message": str(exc)}
        except Exception as exc:  # a bug in a handler must not kill the connection silently
            log.exception("control handler failed for %s", str(kind)[:40])
            return {"t": "error", "code": "error", "message": f"internal error: {exc}"}

    def _check_notify(self, msg: dict[str, Any]) -> None:
        """The size limit; limits.notify_rate is the notification queue's, per sender node id over
        all its connections and paths (core/engine/senders.py), checked as the handler queues it."""
        lim = self._limits
        data = msg.get("data", "")
        if not isinstance(data, str):
            raise ProtocolError("notification data must be a hex string")
        if len(data) > 2 * lim.max_notify_bytes:
            raise LimitError(f"notification of {len(data) // 2} bytes exceeds this node's limit of "
                             f"{lim.max_notify_bytes} (limits.max_notify_bytes)")

    @property
    def connections(self) -> int:
        """Control connections open now (in handshake or served)."""
        with self._lock:
            return len(self._conns)

    def close(self) -> None:
        self._closed = True
        self._stop.set()
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
        with self._lock:
            conns = list(self._conns)
        for s in conns:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except (OSError, ValueError):
                pass
        if self._own is not None:
            with _SELF_LOCK:
                _SELF_KEYS.pop(self._own, None)


class PeerLink:
    """Our connection to one peer's control endpoint.

    A reply the reader cannot make sense of (bad frame, bad id, anything that
    raises) marks the link dead at once: pending requests fail with
    PeerConnectionError, and so does every later :meth:`request`.
    """

    def __init__(
        self,
        address: str,
        *,
        local_info: PeerInfo,
        secret: str,
        timeout: float,
        on_lost: Callable[[PeerLink], None],
        config: Config | None = None,
    ) -> None:
        cfg = config or Config()
        self.address = address
        self._limits = cfg.limits
        self._on_lost = on_lost
        self._pending: dict[int, Future[dict[str, Any]]] = {}
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._send_lock = threading.Lock()
        self.alive = False
        self.dead_reason: BaseException | None = None
        self._ping_interval = 60.0
        deadline = time.monotonic() + timeout
        host, port = parse_endpoint(address)
        try:
            sock = socket.create_connection((host, port), timeout=timeout)
        except TimeoutError as exc:
            raise PeerConnectionError(f"connecting to {address} timed out after {timeout}s", peer=address) from exc
        except OSError as exc:
            raise PeerConnectionError(f"cannot connect to {address}: {exc.strerror or exc}", peer=address) from exc
        self._sock = sock
        self._tls = False
        try:
            _tune(sock)
            if cfg.transport.tls:
                from . import tls

                self._sock = tls.tls_client(sock, tls.client_context(cfg), host, deadline)
                self._tls = True
            self.info = self._handshake(local_info, secret, deadline, timeout)
        except BaseException:
            self._sock.close()
            raise
        self._sock.settimeout(self._limits.frame_timeout_ms / 1000)
        self.alive = True
        self._reader = threading.Thread(target=self._read_loop, name=f"mpcomm-peer-{address}", daemon=True)
        self._reader.start()

    def _handshake(self, local: PeerInfo, secret: str, deadline: float, timeout: float) -> PeerInfo:
        s = self._sock
        try:
            t = auth.client_exchange(s, secret, deadline, CONTROL_CONTEXT)
            cnonce, snonce = t.client_nonce, t.server_nonce
            wire.send_json(s, {"t": "hello", "proto": wire.PROTOCOL_VERSION, "info": local.to_dict(),
                               "self": _self_proof(local, b"client-self", cnonce, snonce)}, deadline)
            welcome = wire.read_json(s, self._limits.max_frame_bytes, deadline)
            self._raise_if_error(welcome)
            if welcome.get("t") != "welcome":
                raise ProtocolError(f"expected welcome, got {str(welcome.get('t'))[:40]!r}")
            info = PeerInfo.from_dict(welcome["info"])
            if secret and not hmac.compare_digest(auth.identity_digest(info.node_id, info.epoch), t.server_id):
                # The server's proof vouched for the identity in its challenge; the welcome must be that one.
                raise AuthenticationError(f"{self.address} announced node {info.node_id[:32]} epoch "
                                          f"{info.epoch[:16]}, not the identity its proof was bound to",
                                          peer=self.address, retryable=False)
            if info.node_id == local.node_id or info.epoch == local.epoch:
                proof = welcome.get("self")
                if not (info.node_id == local.node_id and info.epoch == local.epoch and isinstance(proof, str)
                        and hmac.compare_digest(proof, _self_proof(local, b"server-self", cnonce, snonce))):
                    raise AuthenticationError(f"{self.address} claims this node's own identity", peer=self.address,
                                              retryable=False)
            idle = welcome.get("idle_ms")
            if isinstance(idle, int) and not isinstance(idle, bool) and idle > 0:
                self._ping_interval = min(max(idle / 3000, 0.05), 3600.0)
        except TimeoutError as exc:  # HandshakeTimeout included: to the engine this peer is unreachable
            raise PeerConnectionError(f"handshake with {self.address} timed out after {timeout:.3g}s: {exc}",
                                      peer=self.address) from exc
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ProtocolError(f"malformed handshake from {self.address}: {exc}", peer=self.address) from exc
        except AuthenticationError as exc:
            raise AuthenticationError(f"{self.address}: {exc}", peer=self.address, retryable=False) from exc
        except ProtocolError as exc:
            raise ProtocolError(f"handshake with {self.address}: {exc}", peer=self.address) from exc
        except PeerConnectionError as exc:
            raise PeerConnectionError(f"handshake with {self.address} failed: {exc}", peer=self.address) from exc
        except OSError as exc:  # ssl.SSLError too: a TLS 1.3 server refuses our certificate after the handshake
            import ssl

            if isinstance(exc, ssl.SSLError):
                raise AuthenticationError(f"{self.address} refused the TLS session: {exc}", peer=self.address,
                                          retryable=False) from exc
            raise PeerConnectionError(f"handshake with {self.address} failed: {exc}", peer=self.address) from exc
        return info

    def _raise_if_error(self, msg: dict[str, Any]) -> None:
        if msg.get("t") == "error":
            exc = error_from_code(str(msg.get("code"))[:40], f"{self.address}: {str(msg.get('message'))[:2000]}",
                                  peer=self.address)
            if isinstance(exc, AuthenticationError):
                exc.retryable = False
            raise exc

    def _read_loop(self) -> None:
        reason: BaseException = PeerConnectionError(f"connection to {self.address} lost", peer=self.address)
        try:
            while True:
                if not _readable(self._sock, self._ping_interval):
                    self._send({"t": "keepalive", "id": 0})
                    continue
                if self._tls:  # one SSL object must not be read and written from two threads at once
                    with self._send_lock:
                        msg = wire.read_json(self._sock, self._limits.max_frame_bytes)
                else:
                    msg = wire.read_json(self._sock, self._limits.max_frame_bytes)
                rid = msg.get("id")
                if type(rid) is not int:
                    raise ProtocolError(f"reply without an integer id ({str(rid)[:40]})")
                with self._lock:
                    fut = self._pending.pop(rid, None)
                if fut is not None and not fut.done():
                    fut.set_result(msg)
        except ProtocolError as exc:
            log.warning("closing control connection to %s: %s", self.address, exc)
            reason = exc
        except (OSError, PeerConnectionError, TimeoutError) as exc:
            if self.alive:
                reason = PeerConnectionError(f"connection to {self.address} lost: {exc}", peer=self.address)
        except BaseException as exc:  # noqa: BLE001 - whatever breaks the reader, the link is dead, not silent
            if not self.alive:  # close() pulled the socket from under select(): not the peer's doing
                self._die(reason)
                return
            log.warning("closing control connection to %s: unexpected reply broke the reader: %r", self.address, exc)
            reason = ProtocolError(f"{self.address} sent a reply this node cannot handle: {exc!r}", peer=self.address)
        self._die(reason)

    def _send(self, msg: dict[str, Any]) -> None:
        data = wire.encode_json(msg)
        with self._send_lock:
            wire.sendall(self._sock, data)  # bounded by the socket timeout (limits.frame_timeout_ms)

    def _die(self, reason: BaseException) -> None:
        with self._lock:
            was_alive, self.alive = self.alive, False
            if self.dead_reason is None:
                self.dead_reason = reason
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
                why = f" ({self.dead_reason})" if self.dead_reason is not None else ""
                raise PeerConnectionError(f"connection to {self.address} is closed{why}", peer=self.address)
            rid = next(self._ids)
            self._pending[rid] = fut
        try:
            self._send({**msg, "id": rid})
        except (OSError, ValueError) as exc:
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
        except (OSError, ValueError):
            pass
        self._sock.close()
