"""TLS for mpcomm connections: ``ssl`` contexts from ``[tls]`` and handshakes under a deadline.

With ``transport.tls = true`` every control connection runs TLS 1.2+ first;
each node presents ``tls.cert``/``tls.key`` and accepts only peers whose
certificate ``tls.ca`` signed (``require_client_cert = true``, the default:
mutual authentication). The shared secret, if any, is still proved inside
the TLS channel. ``check_hostname = true`` also matches the dialled host
against the server's certificate (SAN); by default any certificate the CA
signed is accepted, which is the same trust model as one shared secret:
every node the CA signed is a member.

The ``ssl`` module is in the standard library; nothing here is imported by
the core unless TLS is configured.
"""

from __future__ import annotations

import os
import select
import socket
import ssl
import time
from typing import Any

from .errors import AuthenticationError, ConfigError, HandshakeTimeout, PeerConnectionError

__all__ = ["client_context", "server_context", "tls_client", "tls_server"]


def _files(tls: Any) -> tuple[str, str, str]:
    for key in ("cert", "key", "ca"):
        path = getattr(tls, key)
        if not path:
            raise ConfigError(f"tls.{key} is not set (transport.tls = true needs cert, key and ca)")
        if not os.path.isfile(path):
            raise ConfigError(f"tls.{key}: {path}: no such file")
    return tls.cert, tls.key, tls.ca


def _load(ctx: ssl.SSLContext, tls: Any) -> ssl.SSLContext:
    cert, key, ca = _files(tls)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        ctx.load_cert_chain(cert, key)
    except (ssl.SSLError, OSError) as exc:
        raise ConfigError(f"tls.cert/tls.key ({cert}, {key}): cannot load: {exc}") from exc
    try:
        ctx.load_verify_locations(cafile=ca)
    except (ssl.SSLError, OSError) as exc:
        raise ConfigError(f"tls.ca ({ca}): cannot load: {exc}") from exc
    return ctx


def server_context(config: Any) -> ssl.SSLContext:
    """The accepting side's context for ``config`` (a :class:`~mpcomm.Config`); ConfigError if unusable."""
    ctx = _load(ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER), config.tls)
    ctx.verify_mode = ssl.CERT_REQUIRED if config.tls.require_client_cert else ssl.CERT_NONE
    return ctx


def client_context(config: Any) -> ssl.SSLContext:
    """The connecting side's context: presents this node's certificate, verifies the server's against ``tls.ca``."""
    ctx = _load(ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT), config.tls)
    ctx.check_hostname = bool(config.tls.check_hostname)
    ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


def _handshake(tsock: ssl.SSLSocket, deadline: float, what: str) -> ssl.SSLSocket:
    """Drive ``do_handshake`` non-blocking so ``deadline`` bounds the whole handshake."""
    old = tsock.gettimeout()
    tsock.setblocking(False)
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise HandshakeTimeout(f"TLS handshake with {what} did not finish in time")
            try:
                tsock.do_handshake()
                return tsock
            except ssl.SSLWantReadError:
                select.select([tsock], [], [], left)
            except ssl.SSLWantWriteError:
                select.select([], [tsock], [], left)
            except ssl.SSLCertVerificationError as exc:
                raise AuthenticationError(f"TLS: {what} presented a certificate we do not trust: "
                                          f"{exc.verify_message}", retryable=False) from exc
            except ssl.SSLError as exc:
                # A refused client certificate shows up on both sides as an alert or a reset.
                raise AuthenticationError(f"TLS handshake with {what} failed: {exc.reason or exc}",
                                          retryable=False) from exc
            except (ConnectionError, OSError) as exc:
                raise PeerConnectionError(f"TLS handshake with {what} failed: {exc}") from exc
    finally:
        try:
            tsock.settimeout(old)
        except OSError:
            pass


def tls_server(sock: socket.socket, ctx: ssl.SSLContext, deadline: float, peer: str = "the peer") -> ssl.SSLSocket:
    """Wrap an accepted socket and run the TLS handshake by ``deadline`` (monotonic).

    ``sock`` is consumed: on success use the returned socket; on failure the
    connection is closed.
    """
    tsock = ctx.wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
    return _closing_on_error(tsock, deadline, peer)


def tls_client(sock: socket.socket, ctx: ssl.SSLContext, host: str, deadline: float) -> ssl.SSLSocket:
    """Wrap a connected socket to ``host`` and run the TLS handshake by ``deadline`` (monotonic)."""
    tsock = ctx.wrap_socket(sock, server_side=False, do_handshake_on_connect=False,
                            server_hostname=host if ctx.check_hostname else None)
    return _closing_on_error(tsock, deadline, host)


def _closing_on_error(tsock: ssl.SSLSocket, deadline: float, what: str) -> ssl.SSLSocket:
    # wrap_socket took the descriptor over from the plain socket: closing that one no
    # longer closes the connection, so a failed handshake must close the TLS socket itself.
    try:
        return _handshake(tsock, deadline, what)
    except BaseException:
        tsock.close()
        raise
