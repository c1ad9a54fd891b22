"""``faulty``: the tcp transport under its own name, port and options, failing on purpose.

Initiator side (``[plugins.faulty]``):

* ``fail_every = N``: every N-th request posted to it (1: all of them) moves
  ``partial`` of its range — a write sends it *corrupted* (every byte
  inverted), a read leaves the local range corrupted — then fails with a
  retryable :class:`~mpcomm.errors.PeerConnectionError`. Only a retry that
  moves the whole range again leaves the right bytes.
* ``refuse = "bounds" | "permission" | "stale" | ""``: every request fails at
  once with that non-retryable error (the engine must not retry it).

Target side:

* ``serve_fail = true``: this node's faulty server reads the first part of
  each request and then drops the connection — a peer that fails on purpose;
  initiators see a retryable connection error.

Counters (``FaultyTransport.counters``, per process): requests posted,
failures injected, requests the server dropped.
"""

from __future__ import annotations

import socket
import threading
from typing import Any, ClassVar

from mpcomm import Operation
from mpcomm.errors import OutOfBoundsError, PeerConnectionError, PermissionDeniedError, StaleRegionError, map_errors
from mpcomm.plugins.tcp.transport import OP_WRITE, REQ, REQ_MAGIC, TcpTransport, _Conn, _OpState
from mpcomm.wire import PROTOCOL_VERSION

_lock = threading.Lock()
counters = {"posted": 0, "injected": 0, "served_dropped": 0}


def _bump(key: str) -> int:
    with _lock:
        counters[key] += 1
        return counters[key]


class FaultyTransport(TcpTransport):
    name: ClassVar[str] = "faulty"
    default_options: ClassVar[dict[str, Any]] = {
        **TcpTransport.default_options,
        "fail_every": 0,
        "partial": 0.5,
        "refuse": "",
        "serve_fail": False,
    }
    option_ranges: ClassVar[dict[str, Any]] = {"fail_every": (0, 1 << 30), "partial": (0.0, 1.0)}

    # -- initiator side ----------------------------------------------------------------

    def post(self, op: Operation) -> None:
        o = self.ctx.options
        n = _bump("posted")
        refuse = o["refuse"]
        if refuse:
            _bump("injected")
            kw = {"peer": op.remote.address, "region": op.remote.name}
            if refuse == "bounds":
                raise OutOfBoundsError("faulty: injected out-of-bounds refusal", **kw)
            if refuse == "permission":
                raise PermissionDeniedError("faulty: injected permission refusal", **kw)
            if refuse == "stale":
                raise StaleRegionError("faulty: injected stale-region refusal", **kw)
            raise ValueError(f"faulty: unknown refuse mode {refuse!r}")
        every = int(o["fail_every"])
        if every and n % every == 0 and op.length:
            _bump("injected")
            op.state = _OpState(pieces=1)
            self.ctx.executor.submit(self._fail_after_part, op)
            return
        super().post(op)

    def _fail_after_part(self, op: Operation) -> None:
        part = int(op.length * float(self.ctx.options["partial"]))
        pool = self._pool(op)
        conn: _Conn | None = None
        try:
            if part:
                conn = pool.acquire(op.deadline)
                with map_errors(op.remote.address, "faulty partial"):
                    if op.kind == "write":
                        self._send_corrupt(op, conn, part)
                    else:
                        self._exchange(op, conn, 0, part)
                        view = op.local_view
                        view[:part] = bytes(b ^ 0xFF for b in view[:part])
        except BaseException as exc:  # noqa: BLE001 - reported through the operation
            if conn is not None:
                conn.broken = True
            op.fail(exc)
            return
        finally:
            if conn is not None:
                pool.release(conn)
        op.fail(PeerConnectionError(
            f"faulty: injected failure after {part} of {op.length} bytes of a {op.kind}",
            peer=op.remote.address, region=op.remote.name, retryable=True))

    def _send_corrupt(self, op: Operation, conn: _Conn, part: int) -> None:
        r = op.remote
        req = REQ.pack(REQ_MAGIC, PROTOCOL_VERSION, OP_WRITE, 0, next(self._req_ids), r.region_id, r.token,
                       int(r.epoch, 16), op.remote_offset, part, op.deadline_wall)
        bad = bytes(b ^ 0xFF for b in op.local_view[:part])
        conn.sock.sendall(req + bad)
        self._read_response(conn.sock, op, 0)

    # -- target side --------------------------------------------------------------------

    def _serve_write(self, sock: socket.socket, req_id: int, region_id: int, token: int, epoch: int, offset: int,
                     length: int, deadline: float, scratch: bytearray, bounce: bytearray | None) -> bool:
        if self.ctx.options["serve_fail"]:
            return self._drop(sock, length)
        return super()._serve_write(sock, req_id, region_id, token, epoch, offset, length, deadline, scratch, bounce)

    def _serve_read(self, sock: socket.socket, req_id: int, region_id: int, token: int, epoch: int, offset: int,
                    length: int, deadline: float, bounce: bytearray | None) -> None:
        if self.ctx.options["serve_fail"]:
            self._drop(sock, 0)
            raise OSError("faulty: dropped on purpose")
        super()._serve_read(sock, req_id, region_id, token, epoch, offset, length, deadline, bounce)

    @staticmethod
    def _drop(sock: socket.socket, length: int) -> bool:
        """Swallow part of the payload, then reset the connection (no answer)."""
        _bump("served_dropped")
        try:
            sock.recv(min(length, 4096))
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        except OSError:
            pass
        return False
