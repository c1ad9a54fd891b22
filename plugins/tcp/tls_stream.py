"""TLS for data connections, as a socket-like stream over ``ssl.SSLObject`` and two memory BIOs.

Why not ``ssl.SSLSocket``: a data connection is read by one thread and written
by another, and one SSL object must not run ``SSL_read`` and ``SSL_write`` at the
same time; nor does an SSLSocket take ``MSG_DONTWAIT`` or ``sendmsg``. Here the
TLS state is touched only under a short lock that is never held across socket
I/O; the raw socket is read and written outside it, so the reader and the writer
block independently, as on a plain connection.

:class:`TlsStream` offers the part of the socket API the tcp transport uses
(``recv_into``, ``sendmsg``, ``setsockopt``, ``fileno``, ``shutdown``, ``close``)
with the same semantics, ``MSG_DONTWAIT`` included: a non-blocking send accepts
plaintext only as far as its ciphertext left, so nothing is ever stranded in
our buffer after the caller believes it was sent.
"""

from __future__ import annotations

import collections
import select
import socket
import ssl
import threading
import time
from typing import Any

from mpcomm.errors import AuthenticationError, HandshakeTimeout, PeerConnectionError
from mpcomm.wire import NOSIGNAL

_RAW = 256 << 10  # bytes per raw recv
_CHUNK = 256 << 10  # plaintext per SSLObject.write (OpenSSL cuts it into 16 KiB records)


class TlsStream:
    def __init__(self, raw: socket.socket, obj: ssl.SSLObject, incoming: ssl.MemoryBIO,
                 outgoing: ssl.MemoryBIO) -> None:
        self.raw = raw
        self._obj, self._in, self._out = obj, incoming, outgoing
        self._lock = threading.Lock()  # the SSL object and both BIOs
        self._send_lock = threading.Lock()  # the order of ciphertext on the raw socket
        self._pending: collections.deque[memoryview] = collections.deque()  # ciphertext not yet sent (under _lock)
        self._unreported = 0  # plaintext encrypted but not yet reported as sent (under _send_lock)
        self._eof = False

    # -- the socket API the transport uses ---------------------------------------------

    def fileno(self) -> int:
        return self.raw.fileno()

    def setsockopt(self, *args: Any) -> None:
        self.raw.setsockopt(*args)

    def settimeout(self, t: float | None) -> None:
        self.raw.settimeout(t)

    def gettimeout(self) -> float | None:
        return self.raw.gettimeout()

    def getsockname(self) -> Any:
        return self.raw.getsockname()

    def shutdown(self, how: int) -> None:
        self.raw.shutdown(how)

    def close(self) -> None:
        self.raw.close()

    def recv_into(self, view: Any, nbytes: int = 0, flags: int = 0) -> int:
        """Plaintext into ``view``; 0 at the end of the stream. ``MSG_DONTWAIT`` is honoured."""
        view = memoryview(view).cast("B")
        n = nbytes or view.nbytes
        if n == 0:
            return 0
        while True:
            with self._lock:
                try:
                    got = self._obj.read(n, view)
                except ssl.SSLWantReadError:
                    got = -1
                except ssl.SSLZeroReturnError:
                    return 0
                except ssl.SSLError as exc:
                    raise PeerConnectionError(f"TLS: {exc.reason or exc}") from exc
                if self._out.pending:
                    self._pending.append(memoryview(self._out.read()))
            if self._pending:
                self._flush_if_free()
            if got >= 0:
                return got
            if self._eof:
                return 0
            data = self.raw.recv(_RAW, flags)  # BlockingIOError (MSG_DONTWAIT, SO_RCVTIMEO) propagates
            if not data:
                self._eof = True
                with self._lock:
                    self._in.write_eof()
                continue
            with self._lock:
                self._in.write(data)

    def sendmsg(self, views: list[Any], _anc: Any = (), flags: int = 0) -> int:
        """Encrypt and send; returns the plaintext bytes whose ciphertext is on the socket.

        With ``MSG_DONTWAIT`` a full socket buffer raises BlockingIOError when
        nothing could go, and otherwise returns what went; without it, it blocks
        (or ends with SO_SNDTIMEO) like a plain ``sendmsg``.
        """
        with self._send_lock:
            if not self._send_pending(flags):
                raise BlockingIOError("socket buffer full")
            if self._unreported:
                k, self._unreported = self._unreported, 0
                return k  # sent by now; the caller passes those bytes again as the head of views
            sent = 0
            for v in views:
                v = memoryview(v).cast("B")
                for pos in range(0, v.nbytes, _CHUNK):
                    part = v[pos : pos + _CHUNK]
                    with self._lock:
                        self._obj.write(part)
                        self._pending.append(memoryview(self._out.read()))
                    if not self._send_pending(flags):
                        self._unreported = part.nbytes  # encrypted, on its way: reported next call
                        return sent
                    sent += part.nbytes
            return sent

    def sendall(self, data: Any) -> None:
        view = memoryview(data).cast("B")
        while view:
            n = self.sendmsg([view])
            view = view[n:]

    # -- raw sending ---------------------------------------------------------------------

    def _send_pending(self, flags: int) -> bool:
        """Send the pending ciphertext (caller holds _send_lock); False when some is left."""
        while True:
            with self._lock:
                if not self._pending:
                    return True
                chunk = self._pending[0]
            try:
                n = self.raw.send(chunk, flags | NOSIGNAL)  # only this thread (it holds _send_lock) takes from the head
            except (BlockingIOError, InterruptedError):
                return False
            with self._lock:
                if n >= chunk.nbytes:
                    self._pending.popleft()
                else:
                    self._pending[0] = chunk[n:]
            if n < chunk.nbytes and flags & socket.MSG_DONTWAIT:
                return False

    def _flush_if_free(self) -> None:
        """The reader produced ciphertext (a TLS post-handshake message): send it unless the writer is."""
        while self._send_lock.acquire(blocking=False):
            try:
                self._send_pending(socket.MSG_DONTWAIT)  # never block the reader; the next send flushes the rest
            finally:
                self._send_lock.release()
            with self._lock:
                if not self._pending:
                    return


def _wait(sock: socket.socket, events: int, deadline: float, what: str) -> None:
    left = deadline - time.monotonic()
    if left <= 0:
        raise HandshakeTimeout(f"TLS handshake with {what} did not finish in time")
    p = select.poll()
    p.register(sock, events)
    if not p.poll(left * 1000):
        raise HandshakeTimeout(f"TLS handshake with {what} did not finish in time")


def handshake(raw: socket.socket, ctx: ssl.SSLContext, *, server_side: bool, deadline: float, what: str,
              server_hostname: str | None = None) -> TlsStream:
    """Run the TLS handshake on ``raw`` by ``deadline`` (monotonic); the whole handshake, not each step."""
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    obj = ctx.wrap_bio(incoming, outgoing, server_side=server_side,
                       server_hostname=server_hostname if ctx.check_hostname else None)
    raw.setblocking(False)
    try:
        while True:
            try:
                obj.do_handshake()
                done = True
            except ssl.SSLWantReadError:
                done = False
            except ssl.SSLCertVerificationError as exc:
                _send_all(raw, outgoing.read(), deadline, what)  # the alert, so the peer learns why
                raise AuthenticationError(f"TLS: {what} presented a certificate we do not trust: "
                                          f"{exc.verify_message}") from exc
            except ssl.SSLError as exc:
                raise AuthenticationError(f"TLS handshake with {what} failed: {exc.reason or exc}") from exc
            _send_all(raw, outgoing.read(), deadline, what)
            if done:
                break
            _wait(raw, select.POLLIN, deadline, what)
            try:
                data = raw.recv(_RAW)
            except (BlockingIOError, InterruptedError):
                continue
            except OSError as exc:
                raise PeerConnectionError(f"TLS handshake with {what} failed: {exc}") from exc
            if not data:
                raise PeerConnectionError(f"{what} closed the connection during the TLS handshake")
            incoming.write(data)
    finally:
        raw.setblocking(True)
    return TlsStream(raw, obj, incoming, outgoing)


def _send_all(raw: socket.socket, data: bytes, deadline: float, what: str) -> None:
    view = memoryview(data)
    while view:
        try:
            n = raw.send(view, NOSIGNAL)
        except (BlockingIOError, InterruptedError):
            _wait(raw, select.POLLOUT, deadline, what)
            continue
        except OSError as exc:
            raise PeerConnectionError(f"TLS handshake with {what} failed: {exc}") from exc
        view = view[n:]
