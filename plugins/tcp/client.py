"""The initiator side of the tcp data port: pipelined connections that never block a poster.

A :class:`Pool` holds up to ``connections`` :class:`Conn` to one target
instance (host, port, epoch). Each connection has

* a **writer** thread: it dials and authenticates (bounded by
  ``transport.handshake_timeout_ms``), then sends whatever the posting side
  could not send at once, in order;
* a **reader** thread: it reads replies, matches them to requests by id,
  scatters read payloads straight into the local buffer, and reports;
* or, instead of the reader, a **driver**: a thread waiting in ``result()``
  on its request reads the replies itself (:func:`drive`), the
  whole ones already in the socket buffer only, and leaves the rest to the
  reader. Exactly one of them reads at a time (``reading``/``driving``).

``Conn.submit`` never waits on the peer: when the connection is up and
nothing is queued, a request small enough is sent on the poster's thread with
``MSG_DONTWAIT`` (whatever the socket buffer takes); the rest goes to the
writer. Many requests are in flight per connection.

Abort (timeout, cancel, peer lost) of one piece, on the connection that
carried it (the fence is per connection):

* not a byte sent yet: taken out of the queue; nothing can land: confirmed;
* a read whose reply has not started: reported at once, its payload will be
  discarded (only our reader writes our buffer): confirmed;
* anything else (a frame on its way, a write awaiting its reply, a read being
  received) finishes on the wire, because the target answers every request
  (refusing, and draining, what is past its deadline): that answer confirms.
  The connection stays up, so the other requests it carries are not hurt.
  If no answer comes within the fence time (``abort_grace_ms / 2``, on the
  transport's one :class:`~mpcomm.transport_kit.FenceTimer` thread), the
  connection is cut: for a read our reader has then stopped (confirmed); for
  a write whose bytes went out, the target never answered (stopped,
  partitioned): unconfirmed.
"""

from __future__ import annotations

import collections
import fcntl
import itertools
import json
import math
import os
import select
import socket
import struct
import termios
import threading
import time
from array import array
from typing import Any

from mpcomm.auth import client_authenticate
from mpcomm.errors import MpcommError, PeerConnectionError, ProtocolError, error_from_code, map_errors
from mpcomm.peer import format_endpoint
from mpcomm.transport_kit import send_nowait
from mpcomm.wire import NOSIGNAL, sendall

from . import busypoll, wire
from .tls_stream import handshake

#: Request ids: unique per process, so a reply can never match another connection's request.
next_id = itertools.count(1).__next__
_DISCARD = bytearray(256 << 10)  # payloads of aborted reads land here and are thrown away
#: How long the reader leaves a new request to the result() caller expected to drive it, and
#: how long a connection whose replies a driver read stays in that mode without requests.
HANDOFF = 0.001
STICKY_IDLE = 0.01
_DRIVE_SLICE = 0.05  # a driver rechecks its request at least this often (another thread may report it)
_DRIVE_MAX = 256 << 10  # replies larger than this are left to the reader thread
_UNDRIVEN = 4  # replies nobody drove, in a row, after which the reader reads at once again
#: The longest a reader leaves a driven connection unlooked at (await_reply's look_ns): its wake-ups
#: per second while every reply is driven, against what the first reply nobody drives may wait.
LOOK_MAX = 0.02
_REPARK_MS = 5000  # the reader's native wait returns this often to look at its connection (a shut socket wakes it at once)
_PEEK = int(socket.MSG_PEEK | socket.MSG_DONTWAIT)

QUEUED, SENDING, SENT, RECEIVING, DONE = range(5)


class Piece:
    """One request frame on one connection (a stripe of an op, or a batch frame)."""

    __slots__ = ("conn", "req_id", "read", "views", "dests", "state", "aborted", "report", "count", "unconfirmed",
                 "size", "born")

    def __init__(self, req_id: int, read: bool, views: list[memoryview], dests: list[memoryview], report: Any,
                 count: int, size: int) -> None:
        self.conn: Conn | None = None
        self.req_id = req_id
        self.read = read
        self.views = views  # what to send: header [+ descriptors] [+ payload]
        self.dests = dests  # where a read's payload goes, in order
        self.state = QUEUED
        self.aborted = False
        self.unconfirmed = False
        #: report(error | None, status bytes | None, confirmed) -- called exactly once.
        self.report = report
        self.count = count  # descriptors in a batch frame, 0 for a single request
        self.size = size  # payload bytes (for load balancing)
        self.born = 0.0  # when it was submitted to its connection


class Conn:
    def __init__(self, pool: Pool) -> None:
        self.pool = pool
        self.sock: socket.socket | None = None
        self.lock = threading.Lock()
        self.cv = threading.Condition(self.lock)
        self.queue: collections.deque[Piece] = collections.deque()
        self.pending: dict[int, Piece] = {}
        self.ready = False
        self.broken = False
        self.writer_busy = False
        self.load = 0  # payload bytes queued or in flight
        self.hard_closed = False
        self.current: Piece | None = None  # the piece whose reply the reader is receiving
        self.last_used = time.monotonic()
        # Who reads replies: the reader thread, or a result() caller driving its own
        # request (drive()); never both. The reader waits on rcv for its turn.
        self.rcv = threading.Condition(self.lock)
        self.reading = False  # the reader thread is reading (or blocked reading) a reply
        self.driving = False  # a caller is reading replies in drive()
        #: The last replies were read by a driver: the reader leaves new requests to
        #: the driver expected next, and takes them over after HANDOFF.
        #: (It starts set where a caller can drive, not TLS: a reply the first caller would drive
        #: is not snatched by the reader.)
        self.sticky = pool.tls is None
        self.driven = 0  # replies a driver read (diagnostics and tests)
        #: Replies the reader took in a row after leaving them to a driver for HANDOFF.
        self.undriven = 0
        #: The reader's doorbell (an eventfd, -1 until its native wait makes it; the reader closes
        #: it under ``lock``): leave_drive rings it when it hands pending replies to the reader,
        #: which sleeps between its looks at a sticky connection for up to LOOK_MAX.
        self._bell = -1
        #: [driving, sticky] for the reader's native wait (busypoll.await_reply), under ``lock``.
        self._flags = array("i", (0, int(self.sticky)))
        threading.Thread(target=self._writer, name=f"mpcomm-tcp-w-{pool.where}", daemon=True).start()

    # -- the posting side ----------------------------------------------------------------

    def submit(self, piece: Piece, inline: bool) -> bool:
        """Queue ``piece`` (never waits on the peer); False if this connection is closing."""
        with self.lock:
            if self.broken:
                return False
            if (not (self.pending or self.reading or self.driving) and self.ready and self.pool.tls is None
                    and self._idle_poll.poll(0) and not self._alive()):
                return False  # closed by the target while idle (nobody reads an idle connection)
            piece.conn = self
            self.pending[piece.req_id] = piece
            self.load += piece.size
            piece.born = self.last_used = time.monotonic()
            if not self.sticky:
                self.rcv.notify()  # the reader's turn (a no-op unless it waits for one)
            if inline and self.ready and not self.queue and not self.writer_busy:
                try:
                    rest = send_nowait(self.sock, piece.views)  # type: ignore[arg-type]
                except OSError:
                    rest = piece.views  # the writer meets the error and reports it
                if not rest:
                    piece.state = SENT
                    piece.views = []
                    return True
                if rest is not piece.views:
                    piece.state = SENDING  # part of the frame is out: the writer sends the rest first
                piece.views = rest
            self.queue.append(piece)
            self.cv.notify()
        return True

    def _alive(self) -> bool:
        """An idle connection's check before reuse (lock held), once poll says something happened on
        it: False if it ended or carries garbage."""
        try:
            if self.sock is not None and self.sock.recv(1, _PEEK):
                self.pool.log.warning("tcp: %s sent bytes nobody asked for; closing the data connection",
                                      self.pool.where)
            self._shut(socket.SHUT_RDWR)  # the reader meets the end (or reads the garbage) and reports
            return False
        except (BlockingIOError, InterruptedError):
            return True
        except OSError:
            self._shut(socket.SHUT_RDWR)
            return False

    def abort(self, piece: Piece) -> None:
        """Stop ``piece`` where it stands (see the module docstring); never blocks."""
        report = False
        with self.lock:
            if piece.state == DONE or piece.aborted:
                return
            piece.aborted = True
            if piece.state == QUEUED:
                self.queue.remove(piece)
                self.pending.pop(piece.req_id, None)
                self.load -= piece.size
                piece.state = DONE
                report = True
            elif piece.read and piece.state == SENT:
                piece.state = DONE  # the reader will discard its payload
                report = True
            # Anything else (a frame on its way, a write awaiting its reply, a
            # read being received) finishes on the wire: the target answers every
            # request, refusing what is past its deadline, and that answer is the
            # fence. Cutting the connection instead would fail every other
            # request it carries.
        if report:
            piece.report(PeerConnectionError("aborted"), None, True)
            return
        self.pool.fences.schedule(time.monotonic() + self.pool.fence_time, lambda: self._fence_overdue(piece))

    def _fence_overdue(self, piece: Piece) -> None:
        with self.lock:
            if piece.state == DONE:
                return
            if not piece.read:
                piece.unconfirmed = True
            self.hard_closed = True
            self._shut(socket.SHUT_RDWR)  # the reader wakes and reports

    def _shut(self, how: int) -> None:
        self._end_locked()
        if self.sock is not None:
            try:
                self.sock.shutdown(how)
            except OSError:
                pass

    def _end_locked(self) -> None:
        """Mark the connection ended (lock held) and wake every thread parked on it.

        The writer waits on ``cv`` for work for up to ``idle_close``; a reader
        that met the end of a dead peer's connection retires it from the pool,
        so nothing else (not ``Pool.close``) would wake that writer: it would
        outlive the connection by ``idle_close`` (30 s by default).
        """
        self.broken = True
        self.cv.notify_all()  # the writer sees ``broken`` and ends
        self.rcv.notify_all()  # a parked reader goes to meet the end and report

    # -- the writer ------------------------------------------------------------------------

    def _connect(self) -> None:
        pool = self.pool
        deadline = time.monotonic() + pool.handshake_time
        with map_errors(pool.where, "tcp connect"):
            sock = socket.create_connection((pool.host, pool.port), timeout=pool.handshake_time)
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                for opt in ("SO_SNDBUF", "SO_RCVBUF"):
                    if pool.socket_buffer:
                        sock.setsockopt(socket.SOL_SOCKET, getattr(socket, opt), pool.socket_buffer)
                if pool.tls is not None:
                    sock = handshake(sock, pool.tls, server_side=False, deadline=deadline, what=pool.where,
                                     server_hostname=pool.host)  # type: ignore[assignment]
                sendall(sock, wire.HELLO.pack(wire.HELLO_MAGIC, wire.VERSION, 0, pool.node_id, pool.epoch))
                client_authenticate(sock, pool.secret, deadline, wire.context(pool.node_id, pool.epoch))
                sock.settimeout(None)
            except BaseException:
                sock.close()
                raise
        idle_poll = select.poll()  # submit's look at an idle connection: readable, ended or failed
        idle_poll.register(sock.fileno(), select.POLLIN)
        self._idle_poll = idle_poll
        drive_poll = select.poll()  # a driver's wait for its reply (one driver at a time)
        drive_poll.register(sock.fileno(), select.POLLIN)
        self._drive_poll = drive_poll
        head = bytearray(wire.RESP.size)
        self._drive_head = (head, memoryview(head))
        with self.lock:
            self.sock = sock
            if self.broken:  # closed while we dialled
                self._shut(socket.SHUT_RDWR)
                return
            self.ready = True

    def _writer(self) -> None:
        try:
            self._connect()
        except BaseException as exc:  # noqa: BLE001 - reported through every waiting piece
            err = exc if isinstance(exc, MpcommError) else PeerConnectionError(f"{self.pool.where}: {exc!r}")
            self._fail_all(err, reader_started=False)
            return
        threading.Thread(target=self._reader, name=f"mpcomm-tcp-r-{self.pool.where}", daemon=True).start()
        sock = self.sock
        assert sock is not None
        idle = self.pool.idle_close
        while True:
            with self.lock:
                while not self.queue and not self.broken:
                    if not self.cv.wait(idle) and not self.pending and not self.queue \
                            and time.monotonic() - self.last_used >= idle:
                        self.pool.retire(self)  # before the target's idle timeout closes it under us
                        self._shut(socket.SHUT_RDWR)
                        return
                if self.broken:
                    return
                piece = self.queue[0]
                piece.state = SENDING
                self.writer_busy = True
                views = piece.views
            try:
                self._send(sock, views)
            except OSError:
                with self.lock:
                    self.writer_busy = False
                    self._shut(socket.SHUT_WR)  # the reader sees the end and reports what is pending
                return
            with self.lock:
                self.writer_busy = False
                if self.queue and self.queue[0] is piece:
                    self.queue.popleft()
                if piece.state == SENDING:
                    piece.state = SENT
                piece.views = []

    def _send(self, sock: socket.socket, views: list[memoryview]) -> None:
        if self.pool.copy_mode:  # stage every payload byte through one bounce buffer
            bounce = memoryview(bytearray(self.pool.bounce_size))
            for v in views:
                for pos in range(0, v.nbytes, bounce.nbytes):
                    k = min(bounce.nbytes, v.nbytes - pos)
                    bounce[:k] = v[pos : pos + k]
                    sendall(sock, bounce[:k])
            return
        while views:
            sent = sock.sendmsg(views[:512], (), NOSIGNAL)
            while sent:
                n = views[0].nbytes
                if sent >= n:
                    sent -= n
                    views.pop(0)
                else:
                    views[0] = views[0][sent:]
                    sent = 0

    # -- the reader --------------------------------------------------------------------------

    def _reader(self) -> None:
        sock = self.sock
        assert sock is not None
        head = bytearray(wire.RESP.size)
        hv = memoryview(head)
        err: MpcommError | None = None
        try:
            while True:
                self._wait_turn()
                try:
                    if not self._recv_exact(sock, hv, at_boundary=True):
                        err = PeerConnectionError(f"{self.pool.where} closed the data connection")
                        break
                    self._one_reply(sock, head)
                finally:
                    with self.lock:
                        self.reading = False
        except ProtocolError as exc:
            err = exc
            self.pool.log.warning("tcp: closing data connection to %s: %s", self.pool.where, exc)
        except (OSError, MpcommError) as exc:
            err = exc if isinstance(exc, MpcommError) else PeerConnectionError(
                f"data connection to {self.pool.where} failed: {exc}")
        with self.lock:
            bell, self._bell = self._bell, -1
        if bell >= 0:
            os.close(bell)
        self._fail_all(err or PeerConnectionError("connection closed"), reader_started=True)

    def _wait_turn(self) -> None:
        """Reader: wait until replies are due and no driver reads them (or the connection ended)."""
        if busypoll.await_reply is not None and self.pool.tls is None:
            self._await_turn()
            return
        with self.lock:
            while not self.broken:
                if self.driving:
                    # Timed: a driver that ends sticky does not wake this thread.
                    self.rcv.wait(HANDOFF)
                    continue
                if not self.sticky:
                    if self.pending:
                        break
                    self.rcv.wait()
                    continue
                # A driver read the last replies: new requests are left to the next driver
                # for HANDOFF (submit does not wake this thread then), and the connection
                # stops being sticky once no request came for STICKY_IDLE.
                now = time.monotonic()
                if self.pending:
                    oldest = next(iter(self.pending.values())).born
                    if now - oldest >= HANDOFF:
                        self.sticky = False  # nobody drove it: requests nobody waits on are read at once again
                        break
                    self.rcv.wait(oldest + HANDOFF - now)
                    continue
                if now - self.last_used >= STICKY_IDLE:
                    self.sticky = False
                    continue
                self.rcv.wait(HANDOFF)
            self.reading = True

    def _await_turn(self) -> None:
        """Reader, with the compiled wait: asleep outside Python until a reply no driver takes is there.

        Nothing wakes this thread per request (submit's notify finds nobody on ``rcv``): a
        reply read by its ``result()`` caller (``drive``) costs no Python here. A reply is
        taken at once, or, after a driver read the last ones (sticky), once it sat unread
        for HANDOFF; the thread looks at the connection every ``_REPARK`` seconds.
        """
        fd = self.sock.fileno()  # type: ignore[union-attr]
        wait = busypoll.await_reply
        handoff, look = int(HANDOFF * 1e9), int(LOOK_MAX * 1e9)
        if self._bell < 0:
            bell = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
            with self.lock:
                self._bell = bell
        while True:
            r = wait(fd, self._flags, handoff, look, _REPARK_MS, self._bell)
            with self.lock:
                if self.broken or r == busypoll.AWAIT_END:
                    self.reading = True  # it meets the end and reports
                    return
                if r == busypoll.AWAIT_REPLY and not self.driving and self._idle_poll.poll(0):
                    if self.sticky:
                        # Nobody drove it within HANDOFF. A few in a row: nobody waits on this
                        # connection's requests, so they are read at once again. (One alone is a
                        # caller that lost its CPU between its submit and its result().)
                        self.undriven += 1
                        if self.undriven >= _UNDRIVEN:
                            self.sticky = False
                            self._flags[1] = 0
                    self.reading = True  # a driver leaves the connection alone from now on
                    return

    def _one_reply(self, sock: socket.socket, head: bytearray) -> None:
        """Handle the reply whose header is in ``head`` (its body is read from ``sock``)."""
        magic, status, _flags, count, rid, length = wire.RESP.unpack(head)
        if magic != wire.RESP_MAGIC:
            raise ProtocolError(f"bad reply magic from {self.pool.where}")
        with self.lock:
            piece = self.pending.pop(rid, None)
            # SENDING too: the reply can overtake the writer's bookkeeping.
            if piece is None or piece.state not in (SENDING, SENT, DONE):
                raise ProtocolError(f"reply for a request {rid} that is not awaiting one")
            discard = piece.state == DONE
            self.load -= piece.size
            self.last_used = time.monotonic()
            # A write's (or batch write's) OK is the whole reply: no body follows, so it ends the
            # piece under this one hold of the lock. Every other reply has a body (_reply).
            landed = status == wire.ST_OK and not piece.read
            if landed:
                if length or count != piece.count:
                    if not discard:
                        piece.state = RECEIVING
                        self.current = piece  # _fail_all reports it
                    raise ProtocolError(f"reply from {self.pool.where} announces {length} bytes, expected 0")
                piece.state = DONE
            elif not discard:
                piece.state = RECEIVING
                self.current = piece  # _fail_all reports it if the reply breaks off
        if landed:
            if not discard:
                # Aborted meanwhile: it landed in full all the same; op.fail reports the abort (_finish).
                piece.report(PeerConnectionError("aborted; the target answered") if piece.aborted else None, None,
                             True)
            return
        self._reply(sock, piece, status, count, length, discard)
        self.current = None
        self.last_used = time.monotonic()

    # -- a result() caller reading its own reply ----------------------------------------------

    def enter_drive(self, piece: Piece) -> bool:
        """Take this connection's replies for a driver (the reader leaves them alone until
        :meth:`leave_drive`); False when a driver cannot read here now."""
        with self.lock:
            if (self.sock is None or self.broken or not self.ready or self.driving or self.reading
                    or piece.state == DONE or piece.conn is not self or self.pool.tls is not None):
                return False
            self.driving = True
            self._flags[0] = 1
            return True

    def drive_failed(self, exc: OSError | MpcommError) -> None:
        """A driver met a broken stream mid-frame: it can no longer be trusted; end the connection here."""
        if isinstance(exc, ProtocolError):
            self.pool.log.warning("tcp: closing data connection to %s: %s", self.pool.where, exc)
        err = exc if isinstance(exc, MpcommError) else PeerConnectionError(
            f"data connection to {self.pool.where} failed: {exc}")
        with self.lock:
            self._shut(socket.SHUT_RDWR)
        self._fail_all(err, reader_started=True)

    def hand_to_reader(self) -> None:
        """No driver will read the replies pending here (a callback waits for one): the reader reads
        them at once from now on, instead of leaving them to a driver and looking only every
        LOOK_MAX. A driver at work hands them over itself when it leaves (:meth:`leave_drive`),
        and the next driven reply makes the connection sticky again."""
        with self.lock:
            if self.driving or not self.sticky or self.broken:
                return
            self.sticky = False
            self._flags[1] = 0
            self.rcv.notify()
            if self._bell >= 0:
                # Ends the native reader's sleep between looks, with no HANDOFF wait: nobody drives these.
                os.eventfd_write(self._bell, busypoll.BELL_NOW)

    def leave_drive(self) -> None:
        """Hand the replies back: to the next driver (sticky) or, if some are due, to the reader."""
        with self.lock:
            self.driving = False
            self.undriven = 0
            self.sticky = not self.pending and not self.broken
            self._flags[0], self._flags[1] = 0, self.sticky
            if not self.sticky:
                self.rcv.notify()
                if self._bell >= 0:
                    os.eventfd_write(self._bell, 1)  # the native reader: its turn now, not at its next look

    def _drive(self, piece: Piece, until: float) -> None:
        sock = self.sock  # set before ``ready``, which enter_drive checked; never replaced
        fd = sock.fileno()  # type: ignore[union-attr]
        head, hv = self._drive_head  # one driver at a time (``driving``): its header buffer is the connection's
        spin = self.pool.busy_ns
        short = None  # since when a reply has been only partly there
        nxt = busypoll.next_reply or self._next_reply
        while piece.state != DONE:
            now = time.monotonic()
            if now >= until:
                return
            r = nxt(fd, spin, math.ceil(min(until - now, _DRIVE_SLICE) * 1000), _DRIVE_MAX, head)
            if r == busypoll.REPLY_GOT:
                short = None
                self._one_reply(sock, head)
                self.driven += 1
            elif r == busypoll.REPLY_SHORT:
                if until == math.inf and self._take_arriving(sock, hv, head):
                    short = None
                    continue
                short = now if short is None else short
                if now - short > spin / 1e9:
                    return  # still arriving: the reader blocks for the rest, this thread need not
            elif r != busypoll.REPLY_NONE:
                return  # not a reply this thread takes (or the end of the connection): the reader's

    def _next_reply(self, fd: int, spin: int, wait_ms: int, max_len: int, head: bytearray) -> int:
        """busypoll.next_reply's Python twin (no compiled helper, or MPCOMM_TCP_NATIVE_WAITS=0)."""
        if not busypoll.wait_readable(fd, spin) and not self._drive_poll.poll(wait_ms):
            return busypoll.REPLY_NONE
        hv = self._drive_head[1]
        try:
            got = self.sock.recv_into(hv, wire.RESP.size, _PEEK)  # type: ignore[union-attr]
        except BlockingIOError:
            return busypoll.REPLY_NONE
        if got == 0:
            return busypoll.REPLY_LEAVE  # the end of the connection: the reader meets it and reports
        whole = got == wire.RESP.size and self._whole(fd, head, max_len)
        if whole is None:
            return busypoll.REPLY_LEAVE
        if not whole:
            return busypoll.REPLY_SHORT
        self._recv_exact(self.sock, hv)  # type: ignore[arg-type]  # all of it is in the buffer: no block
        return busypoll.REPLY_GOT

    def _take_arriving(self, sock: socket.socket, hv: memoryview, head: bytearray) -> bool:
        """A driver with no time limit (``result()`` without a timeout) reads a reply that is still
        arriving, as the reader thread would, instead of leaving it to that thread: the caller
        waits for it either way, and a reply larger than the socket buffer never sits in it whole.
        True once one reply was read; False (nothing consumed) when its header is not all there
        yet or it is not a reply this thread takes."""
        try:
            got = sock.recv_into(hv, wire.RESP.size, _PEEK | socket.MSG_DONTWAIT)
        except BlockingIOError:
            return False
        magic, status, _flags, _count, _rid, _length = wire.RESP.unpack(head) if got == wire.RESP.size else (
            b"", -1, 0, 0, 0, 0)
        if magic != wire.RESP_MAGIC or status not in (wire.ST_OK, wire.ST_ERR, wire.ST_PARTIAL):
            return False
        self._recv_exact(sock, hv)
        self._one_reply(sock, head)  # blocks for the rest of the body, as the reader would
        self.driven += 1
        return True

    def _whole(self, fd: int, head: bytearray, max_len: int) -> bool | None:
        """Whether the reply whose header is ``head`` sits whole in the socket buffer; None: not for a driver."""
        magic, status, _flags, _count, _rid, length = wire.RESP.unpack(head)
        if magic != wire.RESP_MAGIC or status not in (wire.ST_OK, wire.ST_ERR, wire.ST_PARTIAL) or length > max_len:
            return None
        if length == 0:
            return True
        avail = struct.unpack("i", fcntl.ioctl(fd, termios.FIONREAD, b"\0\0\0\0"))[0]
        return avail >= wire.RESP.size + length

    def _recv_exact(self, sock: socket.socket, view: memoryview, at_boundary: bool = False) -> bool:
        got, n = 0, view.nbytes
        while got < n:
            r = sock.recv_into(view[got:], n - got)
            if r == 0:
                if at_boundary and got == 0:
                    return False
                raise PeerConnectionError(f"{self.pool.where} closed the connection mid-reply ({got} of {n} bytes)")
            got += r
        return True

    def _payload(self, sock: socket.socket, dests: list[memoryview], discard: bool) -> None:
        if discard:
            d = memoryview(_DISCARD)
            for v in dests:
                for pos in range(0, v.nbytes, d.nbytes):
                    self._recv_exact(sock, d[: min(d.nbytes, v.nbytes - pos)])
            return
        if self.pool.copy_mode:
            for v in dests:
                bounce = bytearray(min(self.pool.bounce_size, v.nbytes))
                for pos in range(0, v.nbytes, len(bounce)):
                    k = min(len(bounce), v.nbytes - pos)
                    self._recv_exact(sock, memoryview(bounce)[:k])
                    v[pos : pos + k] = memoryview(bounce)[:k]
            return
        for v in dests:
            self._recv_exact(sock, v)

    def _reply(self, sock: socket.socket, piece: Piece, status: int, count: int, length: int,
               discard: bool) -> None:
        where = self.pool.where
        if status == wire.ST_OK:  # a read's (a write's OK has no body: _one_reply ended it)
            expect = sum(v.nbytes for v in piece.dests)
            if length != expect or count != piece.count:
                raise ProtocolError(f"reply from {where} announces {length} bytes, expected {expect}")
            self._payload(sock, piece.dests, discard)
            self._finish(piece, None, None, discard)
            return
        if status == wire.ST_ERR:
            if length > wire.MAX_ERROR_PAYLOAD:
                raise ProtocolError(f"oversized error reply from {where}")
            buf = bytearray(length)
            self._recv_exact(sock, memoryview(buf))
            self._finish(piece, self._error(buf), None, discard)
            return
        if status == wire.ST_PARTIAL and piece.count and count == piece.count:
            status_bytes = bytearray(count)
            self._recv_exact(sock, memoryview(status_bytes))
            jl = bytearray(wire.JSON_LEN.size)
            self._recv_exact(sock, memoryview(jl))
            (n,) = wire.JSON_LEN.unpack(jl)
            if n > wire.MAX_ERROR_PAYLOAD:
                raise ProtocolError(f"oversized error reply from {where}")
            buf = bytearray(n)
            self._recv_exact(sock, memoryview(buf))
            if piece.read:
                served = [v for v, s in zip(piece.dests, status_bytes) if not s]
                if length != count + wire.JSON_LEN.size + n + sum(v.nbytes for v in served):
                    raise ProtocolError(f"partial reply from {where} has the wrong length")
                self._payload(sock, served, discard)
            self._finish(piece, self._error(buf), bytes(status_bytes), discard)
            return
        raise ProtocolError(f"reply status {status} from {where}")

    def _error(self, body: bytearray) -> MpcommError:
        try:
            obj = json.loads(body)
            code, message = str(obj["code"]), str(obj["message"])
        except (ValueError, KeyError, TypeError) as exc:
            raise ProtocolError(f"malformed error reply from {self.pool.where}") from exc
        return error_from_code(code, f"{self.pool.where}: {message}", peer=self.pool.where)

    def _finish(self, piece: Piece, err: MpcommError | None, status: bytes | None, discard: bool) -> None:
        if discard:
            return  # aborted and reported already; its payload went to the discard buffer
        with self.lock:
            piece.state = DONE
            if piece.aborted and err is None:
                # It landed in full after all, but the request was aborted: report
                # the abort (op.fail substitutes its reason); nothing more can land.
                err = PeerConnectionError("aborted; the target answered")
        piece.report(err, status if err is None or status is not None else None, True)

    def _fail_all(self, err: MpcommError, reader_started: bool) -> None:
        """The connection is gone: every piece still on it ends, from this (the last) thread touching it."""
        self.pool.retire(self)
        with self.lock:
            self._end_locked()
            self.ready = False
            pieces = [(p, p.state) for p in self.pending.values() if p.state != DONE]
            if self.current is not None and self.current.state != DONE:
                pieces.append((self.current, self.current.state))
                self.current = None
            for p, _ in pieces:
                p.state = DONE
            self.pending.clear()
            self.queue.clear()
            self.load = 0
            sock, hard = self.sock, self.hard_closed
        for p, state in pieces:
            # A write whose bytes went out on a connection we cut because the target
            # stayed silent: nobody can say it stopped (they may sit in its buffer).
            sent = state in (SENDING, SENT, RECEIVING)
            p.report(err, None, not (p.unconfirmed or (hard and sent and not p.read)))
        if sock is not None:
            try:
                sock.close()
            except OSError:
                pass

    def close(self) -> None:
        with self.lock:
            self._shut(socket.SHUT_RDWR)  # wakes the writer and the reader


def drive(pieces: list[Piece], until: float) -> None:
    """Read the replies of ``pieces`` (one request's frames) on this thread, the ``result()``
    caller's, until they are reported or ``until`` passes (see the module docstring).

    Every connection that carries one of them is entered first, so no reader takes a reply
    of this request while this thread reads another connection's; then the frames are driven
    one after the other (the others' replies wait in their sockets meanwhile). A frame whose
    connection a driver cannot enter now is left to that connection's reader.
    """
    entered: list[Conn] = []
    try:
        for piece in pieces:
            conn = piece.conn
            if conn is not None and conn not in entered and conn.enter_drive(piece):
                entered.append(conn)
        for piece in pieces:
            conn = piece.conn
            if piece.state != DONE and conn in entered:
                try:
                    conn._drive(piece, until)  # type: ignore[union-attr]
                except (OSError, MpcommError) as exc:
                    conn.drive_failed(exc)  # type: ignore[union-attr]
    finally:
        for conn in entered:
            conn.leave_drive()


def _load(conn: Conn) -> int:
    return conn.load


class Pool:
    """Connections to one target instance; picks the least-loaded, dials more up to ``size``."""

    BUSY = 64 << 10  # a connection carrying this many bytes is busy: prefer dialling another

    def __init__(self, transport: Any, host: str, port: int, epoch: str, idle_ms: int) -> None:
        ctx = transport.ctx
        o = ctx.options
        self.log = ctx.log
        self.host, self.port = host, port
        self.where = format_endpoint(host, port)
        self.size = int(o["connections"])
        self.node_id = wire.ident(ctx.node_id)
        self.epoch = wire.ident(epoch)
        self.secret = ctx.config.transport.secret
        self.handshake_time = ctx.config.transport.handshake_timeout_ms / 1000
        self.fence_time = ctx.config.runtime.abort_grace_ms / 2000
        self.fences = transport.fences
        self.tls = transport.tls_client  # an ssl.SSLContext when data connections run TLS
        self.copy_mode = ctx.mode == "copy"
        self.bounce_size = int(o["bounce_size"])
        self.socket_buffer = int(o["socket_buffer"])
        self.busy_ns = int(o["busy_poll_us"]) * 1000
        # Close our idle connections well before the target's idle timeout would.
        self.idle_close = max(0.05, min(idle_ms, int(o["idle_timeout_ms"])) / 2000)
        self._conns: list[Conn] = []
        self._lock = threading.Lock()
        self.closed = False

    def pick_one(self) -> Conn:
        """The least loaded connection, or a new one when all are busy and ``size`` allows (no
        sort, no list: this runs once per request)."""
        with self._lock:
            if self.closed:
                raise PeerConnectionError(f"connections to {self.where} were closed")
            conns = self._conns
            best = conns[0] if len(conns) == 1 else min(conns, key=_load, default=None)
            if best is not None and (best.load < self.BUSY or len(conns) >= self.size):
                return best
            c = Conn(self)
            conns.append(c)
            return c

    def pick(self, n: int = 1) -> list[Conn]:
        """``n`` distinct connections (fewer if ``size`` is smaller), least loaded first (one: pick_one)."""
        with self._lock:
            if self.closed:
                raise PeerConnectionError(f"connections to {self.where} were closed")
            conns = sorted(self._conns, key=_load)
            want = min(n, self.size)
            while len(conns) < want:
                c = Conn(self)
                self._conns.append(c)
                conns.insert(0, c)
            return conns[:want]

    def retire(self, conn: Conn) -> None:
        """Take ``conn`` out of rotation (the caller marks it broken)."""
        with self._lock:
            try:
                self._conns.remove(conn)
            except ValueError:
                pass

    def close(self) -> None:
        with self._lock:
            self.closed = True
            conns, self._conns = self._conns, []
        for c in conns:
            c.close()
