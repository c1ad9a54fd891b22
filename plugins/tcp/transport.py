"""The tcp transport: pure-Python one-sided reads and writes over TCP.

The target's engine serves requests: each connection carries one request at
a time, as a 64-byte header (then the payload, for a write); the target
answers with a 24-byte response (then the payload, for a read). The target
checks every request against the region's token, epoch, access and bounds
before touching memory; a refused write's payload is drained into scratch
memory, so nothing lands.

Zero-copy mode: the payload is received straight into the registered region
(``recv_into`` a slice) and sent straight from it (``sendall`` of a slice):
no staging copy on either side. Copy mode stages through a bounce buffer on
both sides, for the zero-copy vs copy comparison.

Abort (timeout, cancel, peer lost): the initiator shuts its socket down. For
a write it then waits (``abort_grace_ms / 2``) for the target to close or
answer — the target stops at the end of the stream — so no byte lands
afterwards. A target that stays silent (stalled, partitioned) cannot confirm:
the timeout then says ``confirmed=False`` (a cancel fails with TransferError
instead of reporting CANCELLED). The target also refuses to start, or
continue, a request whose wall-clock deadline (carried in the header) has
passed, which bounds what a resumed target can still write to the receive
chunk (``chunk`` bytes) it was in when it stalled.
"""

from __future__ import annotations

import json
import logging
import math
import socket
import struct
import threading
import time
from dataclasses import dataclass, field
from typing import Any, ClassVar

from mpcomm import Availability, Capabilities, Operation, Transport, TransportContext
from mpcomm.control import listen
from mpcomm.errors import (
    MpcommError,
    PeerConnectionError,
    ProtocolError,
    TransferError,
    TransferTimeout,
    error_from_code,
    map_errors,
)
from mpcomm.peer import PeerInfo, format_endpoint, parse_endpoint
from mpcomm.wire import PROTOCOL_VERSION, recv_exact, recv_into_exact

REQ = struct.Struct("!2sBBIQQQQQQd")  # magic ver op flags req_id region_id token epoch offset length deadline
RESP = struct.Struct("!2sBBIQQ")  # magic ver status flags req_id length
REQ_MAGIC, RESP_MAGIC = b"MD", b"MR"
OP_WRITE, OP_READ = 1, 2
ST_OK, ST_ERR = 0, 1
MAX_ERROR_PAYLOAD = 64 << 10


def _sendmsg_all(sock: socket.socket, parts: list[memoryview | bytes]) -> None:
    """sendmsg until every part is out (sendmsg may send only a prefix)."""
    views = [memoryview(p) for p in parts if len(p)]
    while views:
        sent = sock.sendmsg(views)
        while sent:
            if sent >= views[0].nbytes:
                sent -= views[0].nbytes
                views.pop(0)
            else:
                views[0] = views[0][sent:]
                sent = 0


@dataclass(eq=False)
class _Conn:
    sock: socket.socket
    broken: bool = False
    hard_closed: bool = False


class _Pool:
    """Up to ``size`` connections to one peer's tcp port, each used by one request at a time."""

    def __init__(self, host: str, port: int, size: int, sockopts: dict[str, int]) -> None:
        self.host, self.port, self.size = host, port, size
        self._idle: list[_Conn] = []
        self._total = 0
        self._cond = threading.Condition()
        self._closed = False
        self._sockopts = sockopts

    def try_acquire(self) -> _Conn | None:
        with self._cond:
            if self._idle:
                return self._idle.pop()
            if self._total >= self.size or self._closed:
                return None
            self._total += 1
        return self._connect_counted(5.0)

    def acquire(self, deadline: float) -> _Conn:
        with self._cond:
            while True:
                if self._closed:
                    raise PeerConnectionError(f"connections to {format_endpoint(self.host, self.port)} were closed")
                if self._idle:
                    return self._idle.pop()
                if self._total < self.size:
                    self._total += 1
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TransferTimeout(f"no free connection to {format_endpoint(self.host, self.port)} before the deadline")
                self._cond.wait(left)
        return self._connect_counted(max(0.05, deadline - time.monotonic()))

    def _connect_counted(self, timeout: float) -> _Conn:
        try:
            with map_errors(format_endpoint(self.host, self.port), "tcp connect"):
                sock = socket.create_connection((self.host, self.port), timeout=timeout)
            sock.settimeout(None)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            for opt, val in self._sockopts.items():
                if val:
                    sock.setsockopt(socket.SOL_SOCKET, getattr(socket, opt), val)
            return _Conn(sock)
        except BaseException:
            with self._cond:
                self._total -= 1
                self._cond.notify()
            raise

    def release(self, conn: _Conn) -> None:
        with self._cond:
            if conn.broken or self._closed:
                self._total -= 1
                self._cond.notify()
                conn.sock.close()
                return
            self._idle.append(conn)
            self._cond.notify()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            idle, self._idle = self._idle, []
            self._cond.notify_all()
        for c in idle:
            c.sock.close()


@dataclass(eq=False)
class _OpState:
    pieces: int
    lock: threading.Lock = field(default_factory=threading.Lock)
    conns: set[_Conn] = field(default_factory=set)
    error: BaseException | None = None
    unconfirmed: bool = False


class TcpTransport(Transport):
    """Always-available fallback between hosts, and the template for plugin authors."""

    name: ClassVar[str] = "tcp"
    # First-contract transport: post() may wait on the network; the engine
    # arms the deadline before posting so an abort can interrupt it.
    post_may_block: ClassVar[bool] = True
    capabilities: ClassVar[Capabilities] = Capabilities(
        memory_kinds=frozenset({"host"}),
        intra_node=True,
        inter_node=True,
        one_sided=False,  # the target's CPU serves each request
        zero_copy=True,
        inflight_cancel=True,
        modes=frozenset({"zero-copy", "copy"}),
    )
    default_options: ClassVar[dict[str, Any]] = {
        "port": 0,  # data port; 0 picks a free one
        "connections": 4,  # per peer; also the stripe count for large transfers
        "stripe_threshold": 8 << 20,  # split transfers at least this large over connections
        "inline_threshold": 256 << 10,  # run requests up to this size on the caller's thread
        "chunk": 1 << 20,  # receive granularity; deadline checked between chunks
        "bounce_size": 1 << 20,  # copy mode's staging buffer
        "socket_buffer": 0,  # SO_SNDBUF/SO_RCVBUF; 0 keeps the kernel's auto-tuning
    }

    def __init__(self, ctx: TransportContext) -> None:
        super().__init__(ctx)
        o = ctx.options
        self.copy_mode = ctx.mode == "copy"
        self._pools: dict[tuple[str, int], _Pool] = {}
        self._pools_lock = threading.Lock()
        self._server: socket.socket | None = None
        self._serving: set[socket.socket] = set()
        self._serve_lock = threading.Lock()
        self._closed = False
        self._req_ids = iter(range(1, 1 << 62))
        self._sockopts = {"SO_SNDBUF": o["socket_buffer"], "SO_RCVBUF": o["socket_buffer"]}
        self.log = ctx.log

    @classmethod
    def availability(cls) -> Availability:
        return Availability.yes("pure Python; always available")

    # -- target side -------------------------------------------------------------

    def start(self) -> dict[str, Any]:
        self._server = listen(self.ctx.bind_host, int(self.ctx.options["port"]))
        port = self._server.getsockname()[1]
        threading.Thread(target=self._accept_loop, name=f"mpcomm-tcp-{port}", daemon=True).start()
        return {"port": port}

    def _accept_loop(self) -> None:
        assert self._server is not None
        while not self._closed:
            try:
                conn, addr = self._server.accept()
            except OSError:
                return
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._serve_lock:
                if self._closed:
                    conn.close()
                    return
                self._serving.add(conn)
            threading.Thread(target=self._serve, args=(conn, addr), name="mpcomm-tcp-serve", daemon=True).start()

    def _serve(self, sock: socket.socket, addr: Any) -> None:
        peer = format_endpoint(*addr[:2])
        scratch = bytearray(min(int(self.ctx.options["chunk"]), 1 << 20))
        bounce = bytearray(int(self.ctx.options["bounce_size"])) if self.copy_mode else None
        try:
            while not self._closed:
                try:
                    head = sock.recv(REQ.size, socket.MSG_WAITALL)
                except OSError:
                    return
                if not head:
                    return  # clean close between requests
                if len(head) < REQ.size:
                    raise ProtocolError(f"truncated request header ({len(head)} bytes)")
                magic, ver, op, _flags, req_id, region_id, token, epoch, offset, length, deadline = REQ.unpack(head)
                if magic != REQ_MAGIC:
                    raise ProtocolError(f"bad request magic {magic!r}")
                if ver != PROTOCOL_VERSION:
                    raise ProtocolError(f"request protocol version {ver}, this node speaks {PROTOCOL_VERSION}")
                if op == OP_WRITE:
                    if not self._serve_write(sock, req_id, region_id, token, epoch, offset, length, deadline, scratch, bounce):
                        return
                elif op == OP_READ:
                    self._serve_read(sock, req_id, region_id, token, epoch, offset, length, deadline, bounce)
                else:
                    raise ProtocolError(f"unknown request op {op}")
        except ProtocolError as exc:
            self.log.warning("tcp: closing connection from %s: %s", peer, exc)
        except (OSError, PeerConnectionError):
            pass
        except Exception:  # noqa: BLE001 - never let a peer take the node down
            self.log.exception("tcp: unexpected error serving %s", peer)
        finally:
            with self._serve_lock:
                self._serving.discard(sock)
            sock.close()

    def _check(self, region_id: int, token: int, epoch: int, offset: int, length: int, deadline: float, access: str) -> Any:
        if time.time() > deadline:
            raise TransferTimeout("request arrived after its deadline; nothing was touched")
        return self.ctx.regions.serve(region_id, token, f"{epoch:016x}", offset, length, access)

    def _reply_error(self, sock: socket.socket, req_id: int, exc: MpcommError) -> None:
        body = json.dumps({"code": exc.code, "message": str(exc)}).encode()[:MAX_ERROR_PAYLOAD]
        _sendmsg_all(sock, [RESP.pack(RESP_MAGIC, PROTOCOL_VERSION, ST_ERR, 0, req_id, len(body)), body])

    def _serve_write(self, sock: socket.socket, req_id: int, region_id: int, token: int, epoch: int, offset: int,
                     length: int, deadline: float, scratch: bytearray, bounce: bytearray | None) -> bool:
        try:
            region = self._check(region_id, token, epoch, offset, length, deadline, "w")
        except MpcommError as exc:
            if not self._drain(sock, length, memoryview(scratch)):
                return False
            self._reply_error(sock, req_id, exc)
            return True
        try:
            dest = region.slice(offset, length)
            chunk = int(self.ctx.options["chunk"])
            pos = 0
            while pos < length:
                if time.time() > deadline:
                    # The initiator has given up (or is about to): stop writing,
                    # swallow the rest, and say so.
                    if not self._drain(sock, length - pos, memoryview(scratch)):
                        return False
                    self._reply_error(sock, req_id, TransferTimeout(
                        f"deadline passed after {pos} of {length} bytes; the range is partly written"))
                    return True
                n = min(chunk, length - pos)
                if bounce is None:
                    got = sock.recv_into(dest[pos : pos + n], n)
                else:
                    got = sock.recv_into(bounce, min(n, len(bounce)))
                    dest[pos : pos + got] = bounce[:got]
                if got == 0:
                    return False  # the initiator aborted mid-payload: stop here
                pos += got
        finally:
            region.release()
        sock.sendall(RESP.pack(RESP_MAGIC, PROTOCOL_VERSION, ST_OK, 0, req_id, 0))
        return True

    def _serve_read(self, sock: socket.socket, req_id: int, region_id: int, token: int, epoch: int, offset: int,
                    length: int, deadline: float, bounce: bytearray | None) -> None:
        try:
            region = self._check(region_id, token, epoch, offset, length, deadline, "r")
        except MpcommError as exc:
            self._reply_error(sock, req_id, exc)
            return
        try:
            src = region.slice(offset, length)
            head = RESP.pack(RESP_MAGIC, PROTOCOL_VERSION, ST_OK, 0, req_id, length)
            if bounce is None:
                _sendmsg_all(sock, [head, src])
            else:
                sock.sendall(head)
                for pos in range(0, length, len(bounce)):
                    n = min(len(bounce), length - pos)
                    bounce[:n] = src[pos : pos + n]
                    sock.sendall(memoryview(bounce)[:n])
        finally:
            region.release()

    @staticmethod
    def _drain(sock: socket.socket, n: int, scratch: memoryview) -> bool:
        while n:
            got = sock.recv_into(scratch, min(n, scratch.nbytes))
            if got == 0:
                return False
            n -= got
        return True

    # -- initiator side ------------------------------------------------------------

    def reach(self, peer: PeerInfo) -> Availability:
        info = peer.transports.get(self.name) or {}
        if not isinstance(info.get("port"), int):
            return Availability.no("peer published no tcp port")
        return Availability.yes()

    def _pool(self, op: Operation) -> _Pool:
        host, _ = parse_endpoint(op.remote.address)
        port = int(op.peer.transports[self.name]["port"])
        key = (host, port)
        with self._pools_lock:
            pool = self._pools.get(key)
            if pool is None:
                pool = self._pools[key] = _Pool(host, port, int(self.ctx.options["connections"]), self._sockopts)
            return pool

    def post(self, op: Operation) -> None:
        if op.length == 0:
            op.complete(0)
            return
        o = self.ctx.options
        pool = self._pool(op)
        n = 1
        if op.length >= o["stripe_threshold"] and o["connections"] > 1:
            n = min(int(o["connections"]), math.ceil(op.length / (o["stripe_threshold"] // 2)))
        state = _OpState(pieces=n)
        op.state = state
        if n == 1:
            if op.length <= o["inline_threshold"]:
                conn = pool.try_acquire()
                if conn is not None:
                    self._piece(op, pool, 0, op.length, conn)
                    return
            self.ctx.executor.submit(self._piece, op, pool, 0, op.length, None)
            return
        step = -(-op.length // n)
        step += (-step) % 4096  # page-aligned stripes
        starts = list(range(0, op.length, step))
        state.pieces = len(starts)
        for start in starts:
            self.ctx.executor.submit(self._piece, op, pool, start, min(step, op.length - start), None)

    def _piece(self, op: Operation, pool: _Pool, start: int, length: int, conn: _Conn | None) -> None:
        state: _OpState = op.state
        err: BaseException | None = None
        try:
            if op.aborted:
                raise op.abort_exc  # type: ignore[misc]
            if conn is None:
                conn = pool.acquire(op.deadline)
            with state.lock:
                state.conns.add(conn)
                aborted = op.aborted
            if aborted:
                conn.broken = True
                raise op.abort_exc  # type: ignore[misc]
            with map_errors(op.remote.address, f"tcp {op.kind}"):
                self._exchange(op, conn, start, length)
        except BaseException as exc:  # noqa: BLE001 - reported through the operation
            err = exc
            if conn is not None:
                conn.broken = True
                if op.aborted and op.kind == "write" and not self._fence(conn):
                    state.unconfirmed = True
        finally:
            if conn is not None:
                with state.lock:
                    state.conns.discard(conn)
                pool.release(conn)
        with state.lock:
            if err is not None and state.error is None:
                state.error = err
            state.pieces -= 1
            last = state.pieces == 0
            first_err = state.error
        if last:
            if first_err is None:
                op.complete(op.length)
            elif state.unconfirmed and op.abort_exc is not None:
                op.fail(self._unconfirmed(op))
            else:
                op.fail(first_err)

    @staticmethod
    def _unconfirmed(op: Operation) -> BaseException:
        """The abort reason, marked as not confirmed by the target."""
        exc = op.abort_exc
        if isinstance(exc, TransferTimeout):
            exc.confirmed = False
            return exc
        err = TransferError(
            f"{op.kind} to {op.remote.address} was aborted ({type(exc).__name__}) but the target did not confirm "
            "that it stopped; part of the range may still be written if it resumes",
            peer=op.remote.address, region=op.remote.name,
        )
        op.abort_exc = err
        return err

    def _exchange(self, op: Operation, conn: _Conn, start: int, length: int) -> None:
        sock = conn.sock
        r = op.remote
        req = REQ.pack(REQ_MAGIC, PROTOCOL_VERSION, OP_WRITE if op.kind == "write" else OP_READ, 0,
                       next(self._req_ids), r.region_id, r.token, int(r.epoch, 16), op.remote_offset + start,
                       length, op.deadline_wall)
        view = op.local_view[start : start + length]
        if op.kind == "write":
            if not self.copy_mode:
                _sendmsg_all(sock, [req, view])
            else:
                sock.sendall(req)
                bounce = bytearray(min(int(self.ctx.options["bounce_size"]), length))
                for pos in range(0, length, len(bounce)):
                    n = min(len(bounce), length - pos)
                    bounce[:n] = view[pos : pos + n]
                    sock.sendall(memoryview(bounce)[:n])
            self._read_response(sock, op, 0)
        else:
            sock.sendall(req)
            self._read_response(sock, op, length)
            if not self.copy_mode:
                recv_into_exact(sock, view)
            else:
                bounce = bytearray(min(int(self.ctx.options["bounce_size"]), length))
                for pos in range(0, length, len(bounce)):
                    n = min(len(bounce), length - pos)
                    recv_into_exact(sock, memoryview(bounce)[:n])
                    view[pos : pos + n] = bounce[:n]

    @staticmethod
    def _read_response(sock: socket.socket, op: Operation, expect: int) -> None:
        head = recv_exact(sock, RESP.size)
        magic, ver, status, _flags, _rid, length = RESP.unpack(head)
        if magic != RESP_MAGIC or ver != PROTOCOL_VERSION:
            raise ProtocolError(f"bad response from {op.remote.address}")
        if status == ST_OK:
            if length != expect:
                raise ProtocolError(f"response announces {length} bytes, expected {expect}")
            return
        if length > MAX_ERROR_PAYLOAD:
            raise ProtocolError("oversized error response")
        try:
            body = json.loads(recv_exact(sock, length))
            code, message = str(body["code"]), str(body["message"])
        except (ValueError, KeyError, TypeError) as exc:
            raise ProtocolError(f"malformed error response from {op.remote.address}") from exc
        raise error_from_code(code, f"{op.remote.address}: {message}", peer=op.remote.address, region=op.remote.name)

    def _fence(self, conn: _Conn) -> bool:
        """After aborting a write, wait until the target has stopped with it.

        True when the target answered or closed; False when it stayed silent
        (stalled or unreachable): then only its wall-clock deadline check
        stands between a resumed target and the region.
        """
        sock = conn.sock
        sock.settimeout(self._fence_time())
        try:
            while sock.recv(65536):
                pass
        except OSError:
            return False
        return not conn.hard_closed

    def abort(self, op: Operation) -> None:
        state: _OpState | None = op.state
        if state is None:
            return
        with state.lock:
            conns = list(state.conns)
        how = socket.SHUT_WR if op.kind == "write" else socket.SHUT_RDWR
        for c in conns:
            c.broken = True
            try:
                c.sock.shutdown(how)
            except OSError:
                pass
            if how == socket.SHUT_WR:
                # A stalled target never answers the half-close; wake the
                # executing thread after the fence time. From then on the
                # target's own deadline check refuses what it has not started.
                timer = threading.Timer(self._fence_time(), self._hard_close, args=(c,))
                timer.daemon = True
                timer.start()

    def _fence_time(self) -> float:
        return self.ctx.config.runtime.abort_grace_ms / 2000

    @staticmethod
    def _hard_close(conn: _Conn) -> None:
        conn.hard_closed = True
        try:
            conn.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def peer_changed(self, peer: PeerInfo) -> None:
        info = peer.transports.get(self.name) or {}
        try:
            host, _ = parse_endpoint(peer.address)
        except ValueError:
            return
        with self._pools_lock:
            pool = self._pools.pop((host, int(info.get("port", -1))), None)
        if pool is not None:
            pool.close()

    def close(self) -> None:
        self._closed = True
        if self._server is not None:
            try:
                self._server.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self._server.close()
        with self._serve_lock:
            serving = list(self._serving)
        for s in serving:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        with self._pools_lock:
            pools = list(self._pools.values())
            self._pools.clear()
        for p in pools:
            p.close()


logging.getLogger("mpcomm.transport.tcp").addHandler(logging.NullHandler())
