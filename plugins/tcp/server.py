"""The serving (target) side of the tcp data port.

Each connection runs in its own thread (started by the kit's
:class:`~mpcomm.transport_kit.AcceptLoop`, which bounds how many there are).
Everything a peer could make this side hold has a limit and a deadline:

* nothing is allocated per connection before a request needs it: refused
  payloads are drained into one discard buffer shared by all connections
  (their bytes are thrown away, so sharing is harmless); copy mode's bounce
  buffer is allocated per request, at most ``bounce_size``;
* HELLO and authentication finish within ``transport.handshake_timeout_ms``;
  a connection with no request for ``idle_timeout_ms`` is closed;
* every socket call of a request is bounded by the request's deadline, which
  this side caps at ``max_request_ms`` from now whatever the header claims;
  the region's lease is released at that deadline, and what is left of the
  frame must then drain within ``runtime.abort_grace_ms`` or the connection is
  closed;
* after answering a request the thread polls for the next one for up to
  ``busy_poll_us`` before it blocks (:mod:`.busypoll`: outside the GIL, a
  bounded number of threads per process), which saves the wake-up of a
  sleeping thread per request of a busy initiator;
* a header that does not parse (magic, version, op, a NaN/inf/negative
  deadline, more than ``max_batch`` descriptors) closes that connection only.

Plain connections (no TLS, zero-copy mode) are served below the interpreter
once authenticated: :mod:`.dataport` runs the same request loop in C with the
GIL released (``native_server``; without a compiler this module serves
them). This module stays the readable version of that loop, serves TLS and
copy mode, and serves every connection of a subclass that overrides a step
of the request path (tests inject faults that way).
"""

from __future__ import annotations

import json
import math
import socket
import struct
import threading
import time
from array import array
from typing import Any

from mpcomm.auth import server_authenticate
from mpcomm.errors import (LimitError, MpcommError, OutOfBoundsError, PeerConnectionError,
                           ProtocolError, TransferTimeout)
from mpcomm.peer import format_endpoint
from mpcomm.transport_kit import recv_into_by, recv_some_by, sendmsg_by
from mpcomm.wire import NOSIGNAL

from . import busypoll, wire
from .tls_stream import handshake

_DISCARD = bytearray(256 << 10)  # shared by every connection: what lands here is thrown away


def _reset(sock: socket.socket) -> None:
    """Close with a reset: what we still had queued for a misbehaving peer is dropped, not trickled out."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:
        pass


_BIG = 256 << 10  # payloads from this size use kernel-bounded blocking calls
_NOWAIT = socket.MSG_DONTWAIT | getattr(socket, "MSG_NOSIGNAL", 0)


def _timeval(seconds: float) -> bytes:
    return struct.pack("ll", int(seconds), int((seconds % 1) * 1_000_000))



def parse_head(head: Any, now: float,
               max_request: float) -> tuple[int, int, int, int, int, int, int, int, float, int]:
    """A request header: (op, count, req_id, region_id, token, epoch, offset, length, seconds left, flags).

    The seconds left are the initiator's wall-clock deadline less ``now``, within
    [0, ``max_request``]. ProtocolError for a bad magic, a deadline that is not a
    finite positive time, a flag other than FLAG_NOTE, FLAG_NOTE on anything but a
    WRITE, or a noting WRITE whose region name (``count``) is over MAX_NOTE_REGION.
    The native loop's ``parse_head`` (_dataport.c) makes the same decisions;
    tests/tcp/test_tcp_native_parser.py and the fuzz run hold them to it.
    """
    magic, op, flags, count, req_id, region_id, token, epoch, offset, length, deadline = wire.REQ.unpack(head)
    if magic != wire.REQ_MAGIC:
        raise ProtocolError(f"bad request magic {bytes(magic)!r}")
    if not math.isfinite(deadline) or deadline <= 0:
        raise ProtocolError(f"request deadline {deadline!r} is not a finite positive time")
    if flags & ~wire.FLAG_NOTE:
        raise ProtocolError(f"unknown request flags {flags:#04x}")
    if flags & wire.FLAG_NOTE:
        if op != wire.OP_WRITE:
            raise ProtocolError(f"a notification rides only on a WRITE frame, not on op {op}")
        if count > wire.MAX_NOTE_REGION:
            raise ProtocolError(f"notification region name of {count} bytes (the limit is {wire.MAX_NOTE_REGION})")
    return (op, count, req_id, region_id, token, epoch, offset, length, min(max(deadline - now, 0.0), max_request),
            flags)

class _Closed(Exception):
    """The initiator closed the connection between requests."""


#: The steps of the Python request path; a subclass overriding one is served in Python.
_REQUEST_PATH = ("_one", "_write", "_write_note", "_note_admit", "_read", "_batch", "_reply", "_refuse", "_drain", "_check", "_recv_region",
                 "_send_region", "_batch_write", "_batch_read")


class Server:
    def __init__(self, transport: Any) -> None:
        self.t = transport
        ctx = transport.ctx
        o = ctx.options
        self.ctx = ctx
        self.log = ctx.log
        self.copy_mode = ctx.mode == "copy"
        self.secret = ctx.config.transport.secret
        self.epoch = wire.ident(ctx.epoch)
        self.handshake_time = ctx.config.transport.handshake_timeout_ms / 1000
        self.grace = ctx.config.runtime.abort_grace_ms / 1000
        self.idle = o["idle_timeout_ms"] / 1000
        self.max_request = o["max_request_ms"] / 1000
        self.max_batch = int(o["max_batch"])
        self.chunk = int(o["chunk"])
        self.bounce_size = int(o["bounce_size"])
        self.tls = transport.tls_server  # an ssl.SSLContext when data connections run TLS
        self.plain = self.tls is None and not self.copy_mode  # plain sockets, payloads straight to the region
        # TLS keeps decrypted bytes of its own that the socket's readiness does not show.
        self.busy_ns = 0 if self.tls is not None else int(o["busy_poll_us"]) * 1000
        # The native loop (dataport.py) where the transport opened one and this class is the stock path.
        native = getattr(transport, "dataport", None)
        stock = all(getattr(type(self), m) is getattr(Server, m) for m in _REQUEST_PATH)
        self.native = native if self.plain and stock else None
        #: Where notifications carried by noting WRITE frames go (the engine's queue), or None.
        self.notes = getattr(ctx, "notifications", None)
        lim = ctx.config.limits
        self.max_note = min(int(lim.max_notify_bytes), wire.MAX_NOTIFY)
        # Each connection runs on its own thread: its sender id (limits.notify_rate is the queue's,
        # one bucket per sender over all its connections).
        self._conn = threading.local()

    # -- one connection --------------------------------------------------------------

    def serve(self, sock: socket.socket, addr: Any) -> None:
        peer = format_endpoint(*addr[:2]) if isinstance(addr, tuple) else str(addr)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self.tls is not None:  # TLS first: nothing else is read from a peer without a certificate we trust
                sock = handshake(sock, self.tls, server_side=True, what=peer,
                                 deadline=time.monotonic() + self.handshake_time)  # type: ignore[assignment]
            who = self._hello(sock)
            self._conn.who = who
            peer = f"{who} at {peer}"
            if self.native is not None:
                self._serve_native(sock, peer, who)
                return
            sock.settimeout(None)  # blocking mode: the kernel bounds blocking calls (SO_*TIMEO)
            # Between requests the kernel bounds the wait (one blocking recv, no
            # poll); within a request every call is bounded by its deadline.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, _timeval(self.idle))
            head = bytearray(wire.REQ.size)
            while not self.t.closed:
                self._one(sock, memoryview(head))
        except _Closed:
            pass
        except ProtocolError as exc:
            self.log.warning("tcp: closing data connection from %s: %s", peer, exc)
            _reset(sock)
        except MpcommError as exc:  # authentication refused, a deadline passed mid-frame
            self.log.info("tcp: closing data connection from %s: %s", peer, exc)
            _reset(sock)
        except OSError:
            pass  # the initiator went away

    def _serve_native(self, sock: socket.socket, peer: str, who: str) -> None:
        """Every request of this connection in C, without the GIL, until it ends (dataport.py).

        ``who``: the initiator's node id as HELLO and authentication proved it; the
        notifications this connection delivers carry it as their sender.
        """
        native = self.native
        assert native is not None
        end, why = native.run(sock.fileno(), who)
        if end == native.END_PROTOCOL:
            self.log.warning("tcp: closing data connection from %s: %s", peer, why)
            _reset(sock)
        elif end == native.END_ERROR:
            self.log.info("tcp: closing data connection from %s: %s", peer, why)
            _reset(sock)

    def _hello(self, sock: socket.socket) -> str:
        deadline = time.monotonic() + self.handshake_time
        buf = bytearray(wire.HELLO.size)
        recv_into_by(sock, memoryview(buf), deadline, "tcp hello")
        magic, version, _flags, initiator, epoch = wire.HELLO.unpack(buf)
        if magic != wire.HELLO_MAGIC:
            raise ProtocolError(f"bad hello magic {bytes(magic)!r}: not an mpcomm tcp peer")
        if version != wire.VERSION:
            raise ProtocolError(f"peer speaks tcp data protocol {version}, this node speaks {wire.VERSION}")
        if epoch != self.epoch:
            raise ProtocolError("hello names another epoch of this node (the peer holds stale descriptors)")
        server_authenticate(sock, self.secret, deadline, wire.context(initiator, epoch))
        return initiator.rstrip(b"\0").decode("ascii", "replace")

    def _one(self, sock: socket.socket, head: memoryview) -> None:
        nxt = busypoll.next_request if self.tls is None else None
        if nxt is not None:  # the poll and the receive below, in one call (busypoll.py)
            got = nxt(sock.fileno(), self.busy_ns, head)  # -errno: EAGAIN when SO_RCVTIMEO ran out
        else:
            if self.busy_ns:  # the next request of a busy initiator comes soon: poll for it before sleeping
                busypoll.wait_readable(sock.fileno(), self.busy_ns)
            try:
                got = sock.recv_into(head, wire.REQ.size)  # blocking, up to SO_RCVTIMEO = idle_timeout_ms
            except (BlockingIOError, TimeoutError):
                got = 0
        if got <= 0:
            raise _Closed()  # closed by the initiator, or idle for idle_timeout_ms (it dials again when needed)
        if got < wire.REQ.size:
            recv_into_by(sock, head[got:], time.monotonic() + self.handshake_time, "tcp request header")
        op, count, req_id, region_id, token, epoch, offset, length, budget, flags = parse_head(
            head, time.time(), self.max_request)
        end = time.monotonic() + budget
        epoch_s = f"{epoch:016x}"
        if op == wire.OP_WRITE and flags & wire.FLAG_NOTE:
            self._write_note(sock, req_id, region_id, token, epoch_s, offset, length, count, end)
        elif op == wire.OP_WRITE:
            self._write(sock, req_id, region_id, token, epoch_s, offset, length, end)
        elif op == wire.OP_READ:
            self._read(sock, req_id, region_id, token, epoch_s, offset, length, end)
        elif op in (wire.OP_WRITEV, wire.OP_READV):
            if not 1 <= count <= self.max_batch:
                raise ProtocolError(f"batch of {count} descriptors (the limit is {self.max_batch})")
            self._batch(sock, op, count, req_id, region_id, token, epoch_s, length, end)
        else:
            raise ProtocolError(f"unknown request op {op}")

    # -- replies ---------------------------------------------------------------------

    def _reply(self, sock: socket.socket, status: int, req_id: int, length: int, *body: Any, count: int = 0,
               end: float) -> None:
        head = wire.RESP.pack(wire.RESP_MAGIC, status, 0, count, req_id, length)
        if self.plain and not body:
            try:  # a bare header: the socket buffer takes it at once unless the initiator stopped reading
                sent = sock.send(head, _NOWAIT)
            except (BlockingIOError, InterruptedError):
                sent = 0
            if sent == len(head):
                return
            head = head[sent:]
        sendmsg_by(sock, [memoryview(head), *map(memoryview, body)], max(end, time.monotonic()) + self.grace,
                   "tcp reply")

    @staticmethod
    def _error_body(exc: MpcommError) -> bytes:
        return json.dumps({"code": exc.code, "message": str(exc)}).encode()[: wire.MAX_ERROR_PAYLOAD]

    def _refuse(self, sock: socket.socket, req_id: int, exc: MpcommError, end: float) -> None:
        body = self._error_body(exc)
        self._reply(sock, wire.ST_ERR, req_id, len(body), body, end=end)

    def _drain(self, sock: socket.socket, n: int, end: float) -> None:
        """Swallow ``n`` payload bytes into the discard buffer (nothing lands anywhere)."""
        view = memoryview(_DISCARD)
        while n:
            k = min(n, view.nbytes)
            recv_into_by(sock, view[:k], end, "tcp payload")
            n -= k

    def _check(self, region_id: int, token: int, epoch: str, offset: int, length: int, end: float,
               access: str) -> Any:
        if time.monotonic() >= end:
            raise TransferTimeout("request arrived after its deadline; nothing was touched")
        return self.ctx.regions.serve(region_id, token, epoch, offset, length, access)

    # -- single requests ---------------------------------------------------------------

    def _write(self, sock: socket.socket, req_id: int, region_id: int, token: int, epoch: str, offset: int,
               length: int, end: float, carried: tuple[int, int, bytearray] | None = None) -> None:
        """A WRITE; ``carried``: the note it carries (note length, name length, name + note), read by
        :meth:`_write_note`. The region, then the note, are admitted before a payload byte lands."""
        held = None
        try:
            region = self._check(region_id, token, epoch, offset, length, end, "w")
            if carried is not None:
                try:
                    held = self._note_admit(carried[0])
                except MpcommError:
                    region.release()
                    raise
        except MpcommError as exc:
            self._drain(sock, length, end + self.grace)
            self._refuse(sock, req_id, exc, end)
            return
        try:
            pos = self._recv_region(sock, region.slice(offset, length), end)
        except BaseException:
            if held is not None:
                self.notes.cancel(held)
            raise
        finally:
            region.release()
        if pos < length:
            # The deadline passed mid-payload: the lease is released; what is
            # left of the frame must drain within the grace, else we close.
            if held is not None:
                self.notes.cancel(held)
            self._drain(sock, length - pos, end + self.grace)
            self._refuse(sock, req_id, TransferTimeout(
                f"deadline passed after {pos} of {length} bytes; the range is partly written"
                + ("" if held is None else " and the notification was not delivered")), end)
            return
        if carried is not None:
            _, name_len, raw = carried
            name = bytes(raw[:name_len]).decode("utf-8", "replace")
            self.notes.commit(held, self._conn.who, name, bytes(raw[name_len:]))
        self._reply(sock, wire.ST_OK, req_id, 0, end=end)

    def _write_note(self, sock: socket.socket, req_id: int, region_id: int, token: int, epoch: str, offset: int,
                    length: int, name_len: int, end: float) -> None:
        """A WRITE that carries its notification (wire.py FLAG_NOTE; _dataport.c do_write_note).

        Both note lengths are checked before anything after them is read. The
        region and the note (:meth:`_note_admit`: room in the queue, held) are
        admitted before a payload byte lands; a refusal drains the payload, so
        the region is untouched and no note is queued. Then the data lands, the
        note is queued after it, and one reply answers both.
        """
        if self.notes is None:
            raise ProtocolError("notification frame, but this port delivers none")
        ext = bytearray(wire.NOTE_LEN.size)
        recv_into_by(sock, memoryview(ext), end + self.grace, "tcp notification")
        (note_len,) = wire.NOTE_LEN.unpack(ext)
        if note_len > wire.MAX_NOTIFY:
            raise ProtocolError(f"notification of {note_len} bytes (the limit is {wire.MAX_NOTIFY})")
        raw = bytearray(name_len + note_len)
        recv_into_by(sock, memoryview(raw), end + self.grace, "tcp notification")
        self._write(sock, req_id, region_id, token, epoch, offset, length, end, (note_len, name_len, raw))

    def _note_admit(self, note_len: int) -> Any:
        """Admit a carried note, in _dataport.c note_admit's order: limits.max_notify_bytes
        (LimitError), then the sender's limits.notify_rate (its bucket in the queue, shared by all
        its connections) and room in the queue (BackPressureError). Returns the queue's reservation
        (the room, held)."""
        if note_len > self.max_note:
            raise LimitError(f"notification of {note_len} bytes exceeds this node's limit of {self.max_note} "
                             "(limits.max_notify_bytes)")
        return self.notes.reserve(note_len, self._conn.who)

    def _recv_region(self, sock: socket.socket, dest: memoryview, end: float) -> int:
        """Receive into ``dest`` until full or ``end``; returns the bytes received."""
        pos, n = 0, dest.nbytes
        if n >= _BIG and not self.copy_mode:
            return self._recv_big(sock, dest, end)
        if self.plain and 0 < n <= self.chunk:
            # A small payload usually came with its header: one call, no poll.
            try:
                pos = sock.recv_into(dest, n, socket.MSG_DONTWAIT)
            except (BlockingIOError, InterruptedError):
                pos = 0
            else:
                if pos == n:
                    return n
                if pos == 0:
                    raise PeerConnectionError(f"connection closed after 0 of {n} payload bytes")
        bounce = bytearray(min(self.bounce_size, n)) if self.copy_mode and n else None
        while pos < n:
            k = min(self.chunk, n - pos)
            if bounce is None:
                got = recv_some_by(sock, dest[pos : pos + k], end)
            else:
                got = recv_some_by(sock, memoryview(bounce)[: min(k, len(bounce))], end)
                if got > 0:
                    dest[pos : pos + got] = memoryview(bounce)[:got]
            if got < 0:
                return pos  # the deadline passed
            if got == 0:
                raise PeerConnectionError(f"connection closed after {pos} of {n} payload bytes")
            pos += got
        return pos

    def _recv_big(self, sock: socket.socket, dest: memoryview, end: float) -> int:
        """Large payloads: blocking receives the kernel bounds (SO_RCVTIMEO), no poll per chunk."""
        pos, n = 0, dest.nbytes
        try:
            while pos < n:
                left = end - time.monotonic()
                if left <= 0:
                    return pos
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, _timeval(left))
                try:
                    got = sock.recv_into(dest[pos : pos + self.chunk], min(self.chunk, n - pos))
                except (BlockingIOError, TimeoutError):
                    continue  # SO_RCVTIMEO ran out: the loop checks the deadline
                if got == 0:
                    raise PeerConnectionError(f"connection closed after {pos} of {n} payload bytes")
                pos += got
            return pos
        finally:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, _timeval(self.idle))

    def _read(self, sock: socket.socket, req_id: int, region_id: int, token: int, epoch: str, offset: int,
              length: int, end: float) -> None:
        try:
            region = self._check(region_id, token, epoch, offset, length, end, "r")
        except MpcommError as exc:
            self._refuse(sock, req_id, exc, end)
            return
        try:
            head = wire.RESP.pack(wire.RESP_MAGIC, wire.ST_OK, 0, 0, req_id, length)
            self._send_region(sock, head, [region.slice(offset, length)], end)
        finally:
            region.release()

    def _send_region(self, sock: socket.socket, head: bytes, parts: list[memoryview], end: float) -> None:
        """Send ``head`` and ``parts`` by ``end``; past it the frame is cut and the connection closed."""
        if not self.copy_mode:
            views = [memoryview(head), *parts]
            if sum(p.nbytes for p in parts) >= _BIG:
                self._send_big(sock, views, end)
            else:
                sendmsg_by(sock, views, end, "tcp read payload")
            return
        sendmsg_by(sock, [memoryview(head)], end, "tcp read payload")
        total = sum(p.nbytes for p in parts)
        bounce = bytearray(min(self.bounce_size, max(total, 1)))
        for p in parts:
            for pos in range(0, p.nbytes, len(bounce)):
                k = min(len(bounce), p.nbytes - pos)
                bounce[:k] = p[pos : pos + k]
                sendmsg_by(sock, [memoryview(bounce)[:k]], end, "tcp read payload")

    @staticmethod
    def _send_big(sock: socket.socket, views: list[memoryview], end: float) -> None:
        """Large payloads: blocking sends the kernel bounds (SO_SNDTIMEO), no poll per chunk.

        Other sends use MSG_DONTWAIT, which ignores SO_SNDTIMEO, so it is left set.
        """
        views = [v for v in views if v.nbytes]
        while views:
            left = end - time.monotonic()
            if left <= 0:
                raise TransferTimeout("tcp read payload: the peer did not take the data before the deadline")
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, _timeval(left))
            try:
                sent = sock.sendmsg(views[:512], (), NOSIGNAL)
            except (BlockingIOError, TimeoutError):
                continue
            while sent:
                k = views[0].nbytes
                if sent >= k:
                    sent -= k
                    views.pop(0)
                else:
                    views[0] = views[0][sent:]
                    sent = 0

    # -- batches ------------------------------------------------------------------------

    def _batch(self, sock: socket.socket, op: int, count: int, req_id: int, region_id: int, token: int,
               epoch: str, total: int, end: float) -> None:
        desc = bytearray(16 * count)
        recv_into_by(sock, memoryview(desc), end + self.grace, "tcp batch descriptors")
        offs = array("q")
        offs.frombytes(desc[: 8 * count])
        lens = array("q")
        lens.frombytes(desc[8 * count :])
        if not wire.LITTLE:
            offs.byteswap()
            lens.byteswap()
        write = op == wire.OP_WRITEV
        access = "w" if write else "r"
        if sum(lens) != total or min(lens) < 0 or min(offs) < 0:
            raise ProtocolError("batch descriptors disagree with the header (negative, or lengths do not add up)")
        # One check for the hull of every range; only if it fails, one per index.
        refused: list[int] = []
        first_err: MpcommError | None = None
        try:
            lo = min(offs)
            hi = max(o + n for o, n in zip(offs, lens))
            region = self._check(region_id, token, epoch, lo, hi - lo, end, access)
            leases = [region]
            ok = [region] * count
        except OutOfBoundsError:
            leases, ok = [], []
            for i in range(count):
                try:
                    r = self._check(region_id, token, epoch, offs[i], lens[i], end, access)
                except MpcommError as exc:
                    first_err = first_err or type(exc)(f"index {i} of {count}: {exc}")
                    refused.append(i)
                    ok.append(None)
                    continue
                leases.append(r)
                ok.append(r)
        except MpcommError as exc:
            # Refused as a whole (token, epoch, access, deadline): nothing is touched.
            if write:
                self._drain(sock, total, end + self.grace)
            self._refuse(sock, req_id, exc, end)
            return
        try:
            if write:
                self._batch_write(sock, req_id, count, offs, lens, ok, refused, first_err, end)
            else:
                self._batch_read(sock, req_id, count, offs, lens, ok, refused, first_err, end)
        finally:
            for r in leases:
                r.release()

    def _status_body(self, count: int, refused: list[int], err: MpcommError) -> list[bytes]:
        status = bytearray(count)
        for i in refused:
            status[i] = 1
        body = self._error_body(err)
        return [bytes(status), wire.JSON_LEN.pack(len(body)), body]

    def _batch_write(self, sock: socket.socket, req_id: int, count: int, offs: array, lens: array, ok: list[Any],
                     refused: list[int], err: MpcommError | None, end: float) -> None:
        for i in range(count):
            n = lens[i]
            region = ok[i]
            if region is None:
                self._drain(sock, n, end + self.grace)
                continue
            pos = self._recv_region(sock, region.slice(offs[i], n), end) if n else 0
            if pos < n:
                left = n - pos + sum(lens[i + 1 :])
                self._drain(sock, left, end + self.grace)
                self._refuse(sock, req_id, TransferTimeout(
                    f"deadline passed in index {i} of {count}; indices from {i} on are partly written or not"), end)
                return
        if not refused:
            self._reply(sock, wire.ST_OK, req_id, 0, count=count, end=end)
            return
        assert err is not None
        body = self._status_body(count, refused, err)
        self._reply(sock, wire.ST_PARTIAL, req_id, sum(map(len, body)), *body, count=count, end=end)

    def _batch_read(self, sock: socket.socket, req_id: int, count: int, offs: array, lens: array, ok: list[Any],
                    refused: list[int], err: MpcommError | None, end: float) -> None:
        parts = [ok[i].slice(offs[i], lens[i]) for i in range(count) if ok[i] is not None and lens[i]]
        payload = sum(p.nbytes for p in parts)
        if not refused:
            head = wire.RESP.pack(wire.RESP_MAGIC, wire.ST_OK, 0, count, req_id, payload)
            self._send_region(sock, head, parts, end)
            return
        assert err is not None
        body = self._status_body(count, refused, err)
        head = wire.RESP.pack(wire.RESP_MAGIC, wire.ST_PARTIAL, 0, count, req_id, sum(map(len, body)) + payload)
        self._send_region(sock, head + b"".join(body), parts, end)
