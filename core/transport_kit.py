"""Machinery that socket-based transports share, so every plugin follows the same rules.

The tcp transport and the example plugin (``docs/examples/mpcomm-loopback-plugin``)
use these; a third-party transport may too (``from mpcomm.transport_kit import ...``).

* :class:`Pieces` -- an operation split into pieces (stripes, connections)
  reports exactly once, when its last piece ends; the first error wins, and an
  abort that could not be confirmed on any piece makes the whole outcome
  unconfirmed.
* :func:`stripes` -- where to cut a large request into page-aligned pieces.
* :class:`AcceptLoop` -- a listener thread that survives running out of file
  descriptors (``EMFILE``/``ENFILE``: bounded exponential back-off, never a
  busy loop, never death) and enforces connection limits, in total and per
  peer host, before a connection costs a thread.
* :class:`FenceTimer` -- one thread that runs "the target did not confirm in
  time" actions for every aborted request of a transport (no thread per abort).
* :func:`send_nowait`, :func:`sendmsg_by`, :func:`recv_into_by` -- socket calls
  that either cannot wait on the peer, or wait at most until a deadline.
"""

from __future__ import annotations

import errno
import heapq
import logging
import select
import socket
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from .errors import PeerConnectionError, TransferTimeout
from .wire import NOSIGNAL

__all__ = [
    "AcceptLoop",
    "FenceTimer",
    "Pieces",
    "recv_into_by",
    "recv_some_by",
    "send_nowait",
    "sendmsg_by",
    "stripes",
]

log = logging.getLogger("mpcomm.transport_kit")

# -- pieces and stripes --------------------------------------------------------------------


def stripes(length: int, count: int, align: int = 4096) -> list[tuple[int, int]]:
    """``(start, length)`` of at most ``count`` pieces covering ``length`` bytes, cut on ``align``."""
    if count <= 1 or length <= align:
        return [(0, length)]
    step = -(-length // count)
    step += (-step) % align
    return [(s, min(step, length - s)) for s in range(0, length, step)]


class Pieces:
    """Completion of one operation carried as ``count`` independent pieces.

    Each piece calls :meth:`done` exactly once (from any thread). The last call
    reports the operation: ``op.complete()`` if no piece failed, otherwise
    ``op.fail()`` with the first error (``op.fail`` substitutes the abort reason
    when the engine aborted the request). If any piece ended without the target
    confirming that it stopped, the failure is reported ``confirmed=False``.
    """

    __slots__ = ("op", "_left", "_error", "_unconfirmed", "_lock")

    def __init__(self, op: Any, count: int) -> None:
        self.op = op
        self._left = count
        self._error: BaseException | None = None
        self._unconfirmed = False
        self._lock = threading.Lock()

    def done(self, error: BaseException | None = None, *, confirmed: bool = True) -> bool:
        """One piece ended; returns True when this was the last one (the op is reported)."""
        if self._left == 1 and self._error is None:  # the common single piece: no lock to take
            self._left = 0
            unconf = not confirmed
        else:
            with self._lock:
                if error is not None and self._error is None:
                    self._error = error
                if not confirmed:
                    self._unconfirmed = True
                self._left -= 1
                if self._left:
                    return False
                error, unconf = self._error, self._unconfirmed
        op, self.op = self.op, None  # reported: let go (op.state usually leads back here, a cycle)
        if error is None:
            op.complete(None)
        else:
            op.fail(error, confirmed=not unconf)
        return True

    @property
    def failed(self) -> bool:
        return self._error is not None


class FenceTimer:
    """Run ``fn()`` at ``when`` (monotonic) on one daemon thread, unless cancelled first.

    For abort fences: after asking a target to stop, a transport waits for its
    confirmation until a fence time, then takes the harder step (cut the
    connection) and reports the outcome as it is. ``schedule`` never blocks;
    ``fn`` must be quick and must not raise (errors are logged).
    """

    def __init__(self, name: str = "mpcomm-fences") -> None:
        self._heap: list[tuple[float, int, Callable[[], None]]] = []
        self._cv = threading.Condition()
        self._seq = 0
        self._name = name
        self._thread: threading.Thread | None = None
        self._closed = False

    def schedule(self, when: float, fn: Callable[[], None]) -> None:
        with self._cv:
            if self._closed:
                return
            self._seq += 1
            heapq.heappush(self._heap, (when, self._seq, fn))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
            self._cv.notify()

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._closed and (not self._heap or self._heap[0][0] > time.monotonic()):
                    self._cv.wait(None if not self._heap else self._heap[0][0] - time.monotonic())
                if self._closed:
                    return
                _, _, fn = heapq.heappop(self._heap)
            try:
                fn()
            except Exception:  # noqa: BLE001 - one fence never stops the others
                log.exception("fence action failed")

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._heap.clear()
            self._cv.notify()


# -- socket calls that do not wait, or wait until a deadline only ---------------------------


def _trim(views: list[memoryview], sent: int) -> list[memoryview]:
    i = 0
    while sent and i < len(views):
        n = views[i].nbytes
        if sent >= n:
            sent -= n
            i += 1
        else:
            views[i] = views[i][sent:]
            sent = 0
    return views[i:]


_NOWAIT = socket.MSG_DONTWAIT | NOSIGNAL  # every send: EPIPE, never SIGPIPE (see mpcomm.wire.NOSIGNAL)


def send_nowait(sock: socket.socket, views: list[memoryview]) -> list[memoryview]:
    """Send what the socket buffer takes right now (``MSG_DONTWAIT``); returns what is left.

    Never waits on the peer, whatever the socket's blocking mode. OSErrors
    other than "would block" propagate.
    """
    try:
        sent = sock.sendmsg(views, (), _NOWAIT)
    except (BlockingIOError, InterruptedError):
        return views
    return _trim(views, sent)


def _wait(sock: socket.socket, events: int, deadline: float) -> bool:
    """Poll ``sock`` for ``events`` until ``deadline``; False when the deadline passed first."""
    left = deadline - time.monotonic()
    if left <= 0:
        return False
    p = select.poll()
    p.register(sock, events)
    return bool(p.poll(left * 1000))


def sendmsg_by(sock: socket.socket, views: list[memoryview], deadline: float, what: str = "send") -> None:
    """Send every byte of ``views`` or raise TransferTimeout at ``deadline`` (monotonic).

    Each attempt is non-blocking (``MSG_DONTWAIT``) and only a full socket
    buffer makes it poll: one system call when the peer keeps up. Keep the
    socket in blocking mode (no ``settimeout``) so Python adds no poll of its own.
    """
    views = [v for v in views if v.nbytes]
    while views:
        try:
            sent = sock.sendmsg(views[:512], (), _NOWAIT)  # IOV_MAX is 1024 on Linux
        except (BlockingIOError, InterruptedError):
            if not _wait(sock, select.POLLOUT, deadline):
                raise TransferTimeout(f"{what}: the peer did not take the data before the deadline") from None
            continue
        views = _trim(views, sent)


def recv_into_by(sock: socket.socket, view: memoryview, deadline: float, what: str = "receive") -> None:
    """Fill ``view`` or raise: TransferTimeout at ``deadline``, PeerConnectionError on EOF.

    Non-blocking attempts and a poll only when nothing is there, like :func:`sendmsg_by`.
    """
    got, n = 0, view.nbytes
    while got < n:
        try:
            r = sock.recv_into(view[got:], n - got, socket.MSG_DONTWAIT)
        except (BlockingIOError, InterruptedError):
            if not _wait(sock, select.POLLIN, deadline):
                raise TransferTimeout(
                    f"{what}: the peer did not send {n} bytes before the deadline ({got} came)") from None
            continue
        if r == 0:
            raise PeerConnectionError(f"{what}: connection closed by the peer after {got} of {n} bytes")
        got += r


def recv_some_by(sock: socket.socket, view: memoryview, deadline: float) -> int:
    """Receive what is there into ``view`` (at least one byte, 0 on EOF), waiting until ``deadline``.

    Returns -1 when the deadline passed with nothing received.
    """
    while True:
        try:
            return sock.recv_into(view, view.nbytes, socket.MSG_DONTWAIT)
        except (BlockingIOError, InterruptedError):
            if not _wait(sock, select.POLLIN, deadline):
                return -1


# -- the accept loop ------------------------------------------------------------------------

_FD_ERRNOS = {errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM}
_TRANSIENT = {errno.ECONNABORTED, errno.EPROTO, errno.EPERM, errno.EINTR, errno.EAGAIN}


class AcceptLoop:
    """Accept connections on ``server`` in a daemon thread and serve each in its own thread.

    ``serve(sock, addr)`` runs per connection; its socket is closed and its
    slot freed when it returns (or raises: errors are logged, the loop goes
    on). Limits are enforced at accept time, before the connection costs a
    thread: over ``max_total`` open connections, or ``max_per_peer`` from one
    peer host, the new connection is closed at once (logged at most once a
    second). When the process is out of file descriptors, ``accept`` is
    retried after a back-off that doubles from 5 ms to ``max_backoff`` seconds
    and resets on the next success: the loop neither dies nor spins.
    """

    def __init__(self, server: socket.socket, serve: Callable[[socket.socket, Any], None], *, name: str,
                 max_total: int, max_per_peer: int, log: logging.Logger | None = None,
                 max_backoff: float = 1.0) -> None:
        self.server = server
        self._serve = serve
        self.max_total, self.max_per_peer = max_total, max_per_peer
        self.log = log or globals()["log"]
        self.max_backoff = max_backoff
        self._lock = threading.Lock()
        self._open: dict[socket.socket, str] = {}
        self._per_peer: dict[str, int] = {}
        self._closed = False
        self.refused = 0  # connections closed for a limit
        self.fd_exhausted = 0  # accept() calls that found no free descriptor
        self._last_warn = 0.0
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> AcceptLoop:
        self._thread.start()
        return self

    @property
    def port(self) -> int:
        return int(self.server.getsockname()[1])

    def connections(self) -> int:
        with self._lock:
            return len(self._open)

    def _warn(self, msg: str, *args: Any) -> None:
        now = time.monotonic()
        if now - self._last_warn >= 1.0:
            self._last_warn = now
            self.log.warning(msg, *args)

    def _run(self) -> None:
        backoff = 0.0
        while not self._closed:
            try:
                sock, addr = self.server.accept()
            except OSError as exc:
                if self._closed:
                    return
                if exc.errno in _FD_ERRNOS:
                    self.fd_exhausted += 1
                    backoff = min(self.max_backoff, backoff * 2 or 0.005)
                    self._warn("out of file descriptors accepting connections (%s); retrying in %.0f ms",
                               exc.strerror, backoff * 1000)
                    time.sleep(backoff)
                    continue
                if exc.errno in _TRANSIENT:
                    continue
                if exc.errno in (errno.EBADF, errno.EINVAL, errno.ENOTSOCK):
                    return  # the listener was closed under us
                self.log.exception("accept failed; retrying in %.0f ms", self.max_backoff * 1000)
                time.sleep(self.max_backoff)
                continue
            backoff = 0.0
            host = str(addr[0]) if isinstance(addr, tuple) and addr else "?"
            with self._lock:
                over = (len(self._open) >= self.max_total and "in total")
                over = over or (self._per_peer.get(host, 0) >= self.max_per_peer and f"from {host}")
                if self._closed:
                    over = "closed"
                if not over:
                    self._open[sock] = host
                    self._per_peer[host] = self._per_peer.get(host, 0) + 1
            if over:
                self.refused += 1
                self._warn("refusing a connection: limit of %s connections %s reached",
                           self.max_total if over == "in total" else self.max_per_peer, over)
                sock.close()
                continue
            try:
                threading.Thread(target=self._one, args=(sock, addr), name=f"{self._thread.name}-conn",
                                 daemon=True).start()
            except RuntimeError:  # can't start new thread: shed this connection, keep accepting
                self._forget(sock)
                sock.close()
                self._warn("cannot start a thread for a new connection; closed it")

    def _forget(self, sock: socket.socket) -> None:
        with self._lock:
            host = self._open.pop(sock, None)
            if host is not None:
                left = self._per_peer[host] - 1
                if left:
                    self._per_peer[host] = left
                else:
                    del self._per_peer[host]

    def _one(self, sock: socket.socket, addr: Any) -> None:
        try:
            self._serve(sock, addr)
        except Exception:  # noqa: BLE001 - one connection's bug never stops the others
            self.log.exception("unexpected error serving %s", addr)
        finally:
            self._forget(sock)
            try:
                sock.close()
            except OSError:
                pass

    def close(self) -> None:
        """Stop accepting and shut down every open connection (their threads then end)."""
        with self._lock:
            self._closed = True
            open_socks = list(self._open)
        for s in [self.server, *open_socks]:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self.server.close()


def views_of(parts: Sequence[Any]) -> list[memoryview]:
    """Non-empty byte views of ``parts`` (bytes, bytearrays, memoryviews), cast to bytes."""
    out = []
    for p in parts:
        v = p if isinstance(p, memoryview) else memoryview(p)
        if v.nbytes:
            out.append(v.cast("B") if v.format != "B" or v.ndim != 1 else v)
    return out
