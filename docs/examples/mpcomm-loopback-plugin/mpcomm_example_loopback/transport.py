"""``example_pipe``: a small but complete mpcomm transport. Copy this to start one.

How the bytes move
------------------
The target's engine runs this transport too, and *serves* requests: the
transport is not one-sided (the target's CPU does the work), which keeps it
simple. Every request opens its own TCP connection to the data port that the
target published in the handshake (:meth:`ExamplePipeTransport.start`)::

    initiator (post → worker thread)            target (one thread per connection)
    connect
    HEADER {op, region_id, token, epoch,   ──▶  deadline passed? → refuse
            offset, length, deadline}           ctx.regions.serve(...): token, epoch,
    [payload, for a write]                 ──▶  access and bounds checked, region leased
                                                write: recv_into the region, chunk by chunk
                                           ◀──  REPLY {"ok": true} | {"code", "message"}
                                           ◀──  [payload, for a read, sent from the region]
    close

HEADER and REPLY are a 4-byte big-endian length followed by a JSON object.
Zero-copy: the payload goes from the caller's buffer straight into the
socket, and from the socket straight into the registered region.

The contract, point by point
----------------------------
* **Validation** happens on the target, through ``ctx.regions.serve``, never
  by trusting the descriptor the initiator holds (it may be forged or stale).
  A refused request touches no memory; its error travels back by ``code``.
* **Completion**: ``op.complete()`` only after the target said every byte is
  in place (writes) or every byte is in our buffer (reads).
* **Deadlines**: every blocking call is bounded by ``op.deadline`` plus a
  fence time; the target also refuses to start, or continue, a request whose
  wall-clock deadline has passed.
* **Abort** (timeout, cancel, peer lost): :meth:`abort` shuts the socket down.
  A read then stops at once (only our thread writes our buffer). A write is
  *fenced*: the target consumes what was already sent and closes the
  connection, and only then do we call ``op.fail()``. If the target never
  answers (stalled), we cannot promise that nothing more lands, so we do not
  fail the operation ourselves: the engine reports ``TransferTimeout`` with
  ``confirmed = False`` after ``runtime.abort_grace_ms``. Be honest here; the
  conformance kit checks it.
* **Notifications, leases, back-pressure, retries of the handshake, peer
  death detection**: the engine does all of that. Not our job.
"""

from __future__ import annotations

import json
import socket
import struct
import threading
import time
from dataclasses import dataclass, field
from typing import Any, ClassVar

from mpcomm import Availability, Capabilities, Operation, Transport, TransportContext
from mpcomm.errors import MpcommError, PeerConnectionError, ProtocolError, TransferTimeout, error_from_code, map_errors
from mpcomm.peer import PeerInfo, parse_endpoint

FRAME = struct.Struct("!I")
MAX_FRAME = 64 << 10  # a header or reply is small; anything bigger is garbage
INT_FIELDS = ("region_id", "token", "offset", "length")


# -- framing: keep the wire format boring, versionable and length-checked ------------


def send_frame(sock: socket.socket, obj: dict[str, Any]) -> None:
    body = json.dumps(obj, separators=(",", ":")).encode()
    sock.sendall(FRAME.pack(len(body)) + body)


def recv_into_exact(sock: socket.socket, view: memoryview) -> None:
    """Fill ``view``; an early EOF is a PeerConnectionError (the peer closed)."""
    got = 0
    while got < view.nbytes:
        n = sock.recv_into(view[got:])
        if n == 0:
            raise PeerConnectionError(f"connection closed after {got} of {view.nbytes} bytes")
        got += n


def recv_frame(sock: socket.socket) -> dict[str, Any]:
    head = bytearray(FRAME.size)
    recv_into_exact(sock, memoryview(head))
    (size,) = FRAME.unpack(head)
    if size > MAX_FRAME:
        raise ProtocolError(f"frame of {size} bytes exceeds the limit of {MAX_FRAME}")
    body = bytearray(size)
    recv_into_exact(sock, memoryview(body))
    try:
        obj = json.loads(body)
    except ValueError as exc:
        raise ProtocolError(f"frame is not JSON: {exc}") from exc
    if not isinstance(obj, dict):
        raise ProtocolError("frame is not a JSON object")
    return obj


class _Unfenced(Exception):
    """An aborted write whose target never confirmed that it stopped."""


@dataclass(eq=False)
class _OpState:
    """What :meth:`ExamplePipeTransport.abort` needs to reach a running request."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    sock: socket.socket | None = None


class ExamplePipeTransport(Transport):
    """One TCP connection per request, served by the target's engine."""

    # The name users put in ``transport.name`` / ``transport.order`` and in
    # ``[plugins.example_pipe]``. It must be unique among installed plugins.
    name: ClassVar[str] = "example_pipe"
    # Declare only what you implement: the engine routes on these, and the
    # conformance kit holds you to them (inflight_cancel in particular).
    # First-contract transport: post() may wait on the network; the engine
    # arms the deadline before posting so an abort can interrupt it.
    post_may_block: ClassVar[bool] = True
    capabilities: ClassVar[Capabilities] = Capabilities(
        memory_kinds=frozenset({"host"}),  # plain host memory; no device memory
        intra_node=True,
        inter_node=True,  # TCP reaches other hosts too
        one_sided=False,  # the target's CPU serves every request
        zero_copy=True,  # no staging buffer on either side
        inflight_cancel=True,  # abort() really stops a posted request (see the module docstring)
        modes=frozenset({"zero-copy"}),  # no "copy" mode: the engine will not start us with mode = "copy"
    )
    # Every key a user may set in ``[plugins.example_pipe]``, with its default.
    # Unknown keys and wrongly typed values are config errors; ctx.options has them merged.
    default_options: ClassVar[dict[str, Any]] = {
        "port": 0,  # data port to listen on; 0 picks a free one
        "chunk": 1 << 20,  # writes are received in chunks this big; the deadline is checked between them
    }

    def __init__(self, ctx: TransportContext) -> None:
        super().__init__(ctx)
        self._server: socket.socket | None = None
        self._serving: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._closed = False

    @classmethod
    def availability(cls) -> Availability:
        # Cheap and side-effect free. A transport over a native library imports
        # it *here* (and in the methods), never at module top:
        #     try:
        #         import pyverbs  # noqa: F401
        #     except ImportError:
        #         return Availability.no("pyverbs is not installed (apt install python3-pyverbs)")
        return Availability.yes("pure Python sockets; always available")

    # -- target side: serve peers' requests ------------------------------------------

    def start(self) -> dict[str, Any]:
        host = self.ctx.bind_host  # listen where the control endpoint listens
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._server = socket.create_server((host, int(self.ctx.options["port"])), family=family,
                                            dualstack_ipv6=family == socket.AF_INET6 and socket.has_dualstack_ipv6())
        port = self._server.getsockname()[1]
        threading.Thread(target=self._accept_loop, name=f"example-pipe-{port}", daemon=True).start()
        return {"port": port}  # peers receive this as peer.transports["example_pipe"]

    def _accept_loop(self) -> None:
        assert self._server is not None
        while True:
            try:
                sock, _ = self._server.accept()
            except OSError:
                return  # close() shut the listener down
            with self._lock:
                if self._closed:
                    sock.close()
                    return
                self._serving.add(sock)
            threading.Thread(target=self._serve, args=(sock,), name="example-pipe-serve", daemon=True).start()

    def _serve(self, sock: socket.socket) -> None:
        """Serve the one request this connection carries. A bad peer never takes us down."""
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            req = recv_frame(sock)
            if req.get("op") not in ("write", "read") or not isinstance(req.get("epoch"), str) \
                    or not isinstance(req.get("deadline"), (int, float)) \
                    or not all(type(req.get(k)) is int for k in INT_FIELDS):
                raise ProtocolError(f"malformed request header {str(req)[:200]}")
            if req["op"] == "write":
                self._serve_write(sock, req)
            else:
                self._serve_read(sock, req)
        except ProtocolError as exc:
            self.ctx.log.warning("example_pipe: dropping a connection: %s", exc)
        except (OSError, MpcommError):
            pass  # the initiator went away (abort, death): nobody to answer
        except Exception:  # noqa: BLE001
            self.ctx.log.exception("example_pipe: unexpected error while serving a request")
        finally:
            with self._lock:
                self._serving.discard(sock)
            sock.close()

    def _check(self, req: dict[str, Any], access: str) -> Any:
        """Refuse late requests, then let the engine check token, epoch, access and bounds.

        ``serve`` returns the region with a lease held: release it when done.
        """
        if time.time() > req["deadline"]:
            raise TransferTimeout("the request arrived after its deadline; nothing was touched")
        return self.ctx.regions.serve(req["region_id"], req["token"], req["epoch"], req["offset"], req["length"], access)

    def _serve_write(self, sock: socket.socket, req: dict[str, Any]) -> None:
        length, chunk = req["length"], int(self.ctx.options["chunk"])
        try:
            region = self._check(req, "w")
        except MpcommError as exc:
            self._refuse(sock, exc, unread=length)
            return
        pos = 0
        try:
            dest = region.slice(req["offset"], length)
            while pos < length and time.time() <= req["deadline"]:
                got = sock.recv_into(dest[pos : pos + chunk])  # zero-copy: straight into the region
                if got == 0:
                    return  # the initiator aborted: stop here; closing the connection tells it so
                pos += got
        finally:
            region.release()
        if pos < length:
            self._refuse(sock, TransferTimeout(f"deadline passed after {pos} of {length} bytes"), unread=length - pos)
        else:
            send_frame(sock, {"ok": True})

    def _serve_read(self, sock: socket.socket, req: dict[str, Any]) -> None:
        try:
            region = self._check(req, "r")
        except MpcommError as exc:
            self._refuse(sock, exc, unread=0)
            return
        try:
            send_frame(sock, {"ok": True})
            sock.sendall(region.slice(req["offset"], req["length"]))  # zero-copy: straight from the region
        finally:
            region.release()

    @staticmethod
    def _refuse(sock: socket.socket, exc: MpcommError, unread: int) -> None:
        """Swallow the payload already on its way (touching no region), then say why."""
        scratch = bytearray(min(unread, 64 << 10))
        while unread:
            got = sock.recv_into(scratch, min(unread, len(scratch)))
            if got == 0:
                return  # the initiator gave up first
            unread -= got
        send_frame(sock, {"code": exc.code, "message": str(exc)})  # error_from_code() rebuilds it

    # -- initiator side: move the bytes of one Operation --------------------------------

    def reach(self, peer: PeerInfo) -> Availability:
        if not isinstance((peer.transports.get(self.name) or {}).get("port"), int):
            return Availability.no("peer published no example_pipe port")
        return Availability.yes()

    def post(self, op: Operation) -> None:
        # post() runs on the caller's thread. A faster transport would finish
        # small requests right here; we always hand the work to the engine's pool.
        if op.length == 0:
            op.complete(0)
            return
        op.state = _OpState()
        self.ctx.executor.submit(self._run, op)

    def _run(self, op: Operation) -> None:
        state: _OpState = op.state
        sock: socket.socket | None = None
        try:
            # map_errors turns OSError / socket timeouts into mpcomm errors (native error as __cause__).
            with map_errors(op.remote.address, f"example_pipe {op.kind}"):
                if op.aborted:
                    raise op.abort_exc  # type: ignore[misc]
                host, _ = parse_endpoint(op.remote.address)  # the host we reached the peer's engine at
                port = op.peer.transports[self.name]["port"]
                sock = socket.create_connection((host, port), timeout=max(op.time_left(), 0.001))
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                # Publish the socket, then look at op.aborted, both under the lock:
                # either abort() sees the socket or we see the abort, never neither.
                with state.lock:
                    state.sock = sock
                    aborted = op.aborted
                if aborted:
                    raise op.abort_exc  # type: ignore[misc]
                # No blocking call below outlives the deadline plus the fence time.
                sock.settimeout(max(op.time_left(), 0.001) + self._fence_time())
                header = {"op": op.kind, "region_id": op.remote.region_id, "token": op.remote.token,
                          "epoch": op.remote.epoch, "offset": op.remote_offset, "length": op.length,
                          "deadline": op.deadline_wall}
                if op.kind == "write":
                    self._write(sock, op, header)
                else:
                    self._read(sock, op, header)
        except _Unfenced:
            # Do NOT call op.fail(): it would claim that nothing more can land.
            self.ctx.log.warning("example_pipe: %s to %s aborted but the target did not confirm it stopped",
                                 op.kind, op.remote.address)
            return
        except BaseException as exc:  # noqa: BLE001 - everything is reported through the operation
            # If an abort was requested, op.fail reports its reason (timeout, cancel) instead.
            op.fail(exc if isinstance(exc, MpcommError) else MpcommError(f"example_pipe {op.kind}: {exc!r}"))
            return
        finally:
            if sock is not None:
                sock.close()
        op.complete(op.length)  # the engine sends the notification, if any, from here

    def _write(self, sock: socket.socket, op: Operation, header: dict[str, Any]) -> None:
        try:
            send_frame(sock, header)
            sock.sendall(op.local_view)  # zero-copy: straight from the caller's registered buffer
        except OSError:
            if not op.aborted:
                raise
            # abort() shut our sending side. Go on reading: the target answers or
            # closes once it has consumed what was already sent. That is the fence.
        try:
            reply = recv_frame(sock)
        except TimeoutError:
            if op.aborted:
                raise _Unfenced() from None
            raise
        self._raise_for(reply, op)

    def _read(self, sock: socket.socket, op: Operation, header: dict[str, Any]) -> None:
        send_frame(sock, header)
        self._raise_for(recv_frame(sock), op)
        recv_into_exact(sock, op.local_view)  # zero-copy: straight into the caller's buffer

    @staticmethod
    def _raise_for(reply: dict[str, Any], op: Operation) -> None:
        if reply.get("ok") is True:
            return
        raise error_from_code(str(reply.get("code")), f"{op.remote.address}: {reply.get('message')}",
                              peer=op.remote.address, region=op.remote.name)

    def abort(self, op: Operation) -> None:
        # Called on the engine's timer thread (timeout), the caller's (cancel) or
        # the link monitor's (peer lost). Must be quick and thread-safe.
        state: _OpState | None = op.state
        if state is None:
            return  # not posted by us yet: _run checks op.aborted before it starts
        with state.lock:
            sock = state.sock
        if sock is None:
            return  # still connecting: _run sees op.aborted right after
        try:
            # A read stops at once. A write only stops sending: see _write's fence.
            sock.shutdown(socket.SHUT_WR if op.kind == "write" else socket.SHUT_RDWR)
        except OSError:
            pass  # already finished and closed

    def _fence_time(self) -> float:
        return self.ctx.config.runtime.abort_grace_ms / 2000

    def peer_changed(self, peer: PeerInfo) -> None:
        # We cache nothing per peer (no pooled connections, no keys), and the
        # engine has already aborted the requests in flight to it.
        pass

    def close(self) -> None:
        with self._lock:
            self._closed = True
            serving = list(self._serving)
        for s in ([self._server] if self._server is not None else []) + serving:
            try:
                s.shutdown(socket.SHUT_RDWR)  # wakes accept() / recv() in the serving threads
            except OSError:
                pass
        if self._server is not None:
            self._server.close()
