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
  each request and then resets the connection — a peer that fails on purpose;
  initiators see a retryable connection error.

Built only from tcp's public pieces (``TcpTransport.post`` with an Operation
of our own, ``TcpTransport.server_class``), so it follows tcp's wire format.

Counters (``counters``, per process): requests posted, failures injected,
requests the server dropped.
"""

from __future__ import annotations

import socket
import threading
from typing import Any, ClassVar

from mpcomm import Operation, Region
from mpcomm.errors import OutOfBoundsError, PeerConnectionError, PermissionDeniedError, StaleRegionError
from mpcomm.plugins.tcp.server import Server
from mpcomm.plugins.tcp.transport import TcpTransport

_lock = threading.Lock()
counters = {"posted": 0, "injected": 0, "served_dropped": 0}


def _bump(key: str) -> int:
    with _lock:
        counters[key] += 1
        return counters[key]


class _DroppingServer(Server):
    """Reads the start of each request, then resets the connection (no answer)."""

    def _one(self, sock: socket.socket, head: memoryview) -> None:
        got = sock.recv_into(head)
        if got <= 0:
            raise OSError("closed")
        _bump("served_dropped")
        try:
            sock.recv(4096)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        except OSError:
            pass
        raise OSError("faulty: dropped on purpose")


class FaultyTransport(TcpTransport):
    name: ClassVar[str] = "faulty"
    default_options: ClassVar[dict[str, Any]] = {
        **TcpTransport.default_options,
        "fail_every": 0,
        "partial": 0.5,
        "refuse": "",
        "serve_fail": False,
    }
    option_ranges: ClassVar[dict[str, Any]] = {**TcpTransport.option_ranges, "fail_every": (0, 1 << 30),
                                               "partial": (0.0, 1.0)}

    def start(self) -> dict[str, Any]:
        if self.ctx.options["serve_fail"]:
            self.server_class = _DroppingServer  # type: ignore[misc]
        return super().start()

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
            self._fail_after_part(op)
            return
        super().post(op)

    def _fail_after_part(self, op: Operation) -> None:
        part = max(1, int(op.length * float(self.ctx.options["partial"])))
        if op.kind == "write":  # the first part, every byte inverted, really lands on the target
            bad = bytearray(b ^ 0xFF for b in op.local_view[:part])
            local = Region(memoryview(bad), name="faulty-corrupt", access="rw", owner=bad)
            lo = 0
        else:
            local, lo = op.local, op.local_offset

        def then_fail(sub: Operation, error: BaseException | None, _n: int) -> None:
            if op.kind == "read" and error is None:
                view = op.local_view
                view[:part] = bytes(b ^ 0xFF for b in view[:part])
            op.fail(error or PeerConnectionError(
                f"faulty: injected failure after {part} of {op.length} bytes of a {op.kind}",
                peer=op.remote.address, region=op.remote.name, retryable=True))

        sub = Operation(op.kind, local, lo, op.remote, op.remote_offset, part, op.deadline, op.deadline_wall,
                        op.peer, sink=then_fail)
        sub.transport = self
        try:
            super().post(sub)
        except Exception as exc:  # noqa: BLE001 - reported through the operation
            op.fail(exc)
