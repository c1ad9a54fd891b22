"""``example_pipe``: a small but complete mpcomm transport. Copy this to start one.

How the bytes move
------------------
The target's engine runs this transport too, and *serves* requests: the
transport is not one-sided (the target's CPU does the work), which keeps it
simple. Every request (or every stripe of a large one) opens its own TCP
connection to the data port the target published in the handshake
(:meth:`ExamplePipeTransport.start`)::

    initiator (post → one of our worker threads)   target (one thread per connection)
    connect                                         AcceptLoop: connection limits, survives EMFILE
    mpcomm.auth exchange (we prove first)     ◀──▶  server_authenticate: no secret, no service
    HEADER {op, region_id, token, epoch,      ──▶   deadline passed, NaN? → refuse / drop
            offset, length, deadline}               ctx.regions.serve(...): token, epoch,
    [payload, for a write]                    ──▶   access and bounds checked, region leased
                                                    write: recv_into the region, by the deadline
                                              ◀──   REPLY {"ok": true} | {"code", "message"}
                                              ◀──   [payload, for a read, sent from the region]
    close

HEADER and REPLY are a 4-byte big-endian length followed by a JSON object.
Zero-copy: the payload goes from the caller's buffer straight into the
socket, and from the socket straight into the registered region.

The contract, point by point (``docs/plugin-authors.md`` says it in full)
---------------------------------------------------------------------------
* **post() never waits on the peer.** It hands the request to this
  transport's own worker threads and returns; connecting happens on the
  worker, bounded by the request's deadline. (Full? A transport with a
  fixed-size queue raises ``TransportBusy`` and the engine posts the request
  again later; ours queues, bounded by the engine's ``queue_depth``.)
* **Report exactly once, from any thread.** ``op.complete()`` only after the
  target said every byte is in place (writes) or every byte is in our buffer
  (reads). A large request is striped over connections; ``Pieces`` reports
  once, when the last stripe ends, with the first error.
* **Validation** happens on the target, through ``ctx.regions.serve``, never
  by trusting the descriptor the initiator holds (it may be forged or stale).
  A refused request touches no memory; its error travels back by ``code``.
  Revocation follows: once ``unregister`` returned, ``serve`` refuses the
  region ("target-check").
* **Deadlines**: every blocking call on both sides is bounded
  (``recv_into_by``/``sendmsg_by``); the target also refuses to start, or
  continue, a request whose wall-clock deadline has passed, and never trusts
  a deadline it cannot parse.
* **Abort** (timeout, cancel, peer lost): :meth:`abort` shuts the socket
  down. A read then stops at once (only our thread writes our buffer). A
  write is *fenced*: the target consumes what was already sent and closes,
  and only then does the stripe end. If the target never answers (stalled),
  we cannot promise that nothing more lands: the outcome is
  ``unconfirmed`` (``TransferTimeout.confirmed = False``). Be honest here;
  the conformance kit checks it.
* **post_many** is not overridden: the base class's default splits a group
  into member operations and posts each. Correct; override it when your wire
  can carry a batch in one go (the tcp transport does).
* **Notifications, leases, back-pressure, completion callbacks, peer death
  detection**: the engine does all of that. Not our job.
"""

from __future__ import annotations

import json
import math
import socket
import struct
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, ClassVar

from mpcomm import Availability, Capabilities, Transport, TransportContext
from mpcomm.auth import client_authenticate, server_authenticate
from mpcomm.control import listen
from mpcomm.errors import MpcommError, ProtocolError, TransferTimeout, error_from_code, map_errors
from mpcomm.peer import PeerInfo, parse_endpoint
from mpcomm.transport_kit import AcceptLoop, Pieces, recv_into_by, recv_some_by, sendmsg_by, stripes


FRAME = struct.Struct("!I")
MAX_FRAME = 64 << 10  # a header or reply is small; anything bigger is garbage
INT_FIELDS = ("region_id", "token", "offset", "length")
AUTH_CONTEXT = b"example_pipe/1\0"  # + the target's epoch: a proof is good for one target instance


# -- framing: keep the wire format boring, versionable and length-checked ------------


def send_frame(sock: socket.socket, obj: dict[str, Any], deadline: float) -> None:
    body = json.dumps(obj, separators=(",", ":")).encode()
    sendmsg_by(sock, [memoryview(FRAME.pack(len(body)) + body)], deadline, "example_pipe frame")


def recv_frame(sock: socket.socket, deadline: float) -> dict[str, Any]:
    head = bytearray(FRAME.size)
    recv_into_by(sock, memoryview(head), deadline, "example_pipe frame")
    (size,) = FRAME.unpack(head)
    if size > MAX_FRAME:
        raise ProtocolError(f"frame of {size} bytes exceeds the limit of {MAX_FRAME}")
    body = bytearray(size)
    recv_into_by(sock, memoryview(body), deadline, "example_pipe frame")
    try:
        obj = json.loads(body)
    except ValueError as exc:
        raise ProtocolError(f"frame is not JSON: {exc}") from exc
    if not isinstance(obj, dict):
        raise ProtocolError("frame is not a JSON object")
    return obj


@dataclass(eq=False)
class _OpState:
    """What :meth:`ExamplePipeTransport.abort` needs to reach a running request's sockets."""

    pieces: Pieces
    lock: threading.Lock = field(default_factory=threading.Lock)
    socks: set[socket.socket] = field(default_factory=set)


class ExamplePipeTransport(Transport):
    """One TCP connection per request (per stripe), served by the target's engine."""

    # The name users put in ``transport.name`` / ``transport.order`` and in
    # ``[plugins.example_pipe]``. It must be unique among installed plugins.
    name: ClassVar[str] = "example_pipe"
    # Declare only what you implement: the engine routes on these, and the
    # conformance kit holds you to them (inflight_cancel in particular).
    capabilities: ClassVar[Capabilities] = Capabilities(
        memory_kinds=frozenset({"host"}),  # plain host memory; no device memory
        intra_node=True,
        inter_node=True,  # TCP reaches other hosts too
        one_sided=False,  # the target's CPU serves every request
        zero_copy=True,  # no staging buffer on either side
        inflight_cancel=True,  # abort() really stops a posted request (see the module docstring)
        modes=frozenset({"zero-copy"}),  # no "copy" mode: the engine will not start us with mode = "copy"
        revocation="target-check",  # unregister() takes effect because the target checks every request
    )
    # Every key a user may set in ``[plugins.example_pipe]``, with its default.
    # Unknown keys, wrongly typed values and values outside ``option_ranges``
    # are config errors naming the key; ctx.options has them merged.
    default_options: ClassVar[dict[str, Any]] = {
        "port": 0,  # data port to listen on; 0 picks a free one
        "workers": 8,  # requests (stripes) moving at once; more wait in our queue
        "stripes": 2,  # a request of at least stripe_threshold bytes goes over this many connections
        "stripe_threshold": 8 << 20,
        "max_connections": 256,  # target: data connections open at once, in total
        "max_connections_per_peer": 32,  # target: ... from one peer host
    }
    option_ranges: ClassVar[dict[str, Any]] = {
        "port": (0, 65535), "workers": (1, 1024), "stripes": (1, 64), "stripe_threshold": (4096, 1 << 40),
        "max_connections": (1, 1 << 20), "max_connections_per_peer": (1, 1 << 20),
    }

    def __init__(self, ctx: TransportContext) -> None:
        super().__init__(ctx)
        o = ctx.options
        # Our own threads: post() only queues work for them. The queue needs no
        # bound of its own: the engine lets at most runtime.queue_depth requests
        # in flight. (A transport with a fixed-size native queue -- a send ring,
        # a work-request list -- raises TransportBusy from post() when it is
        # full instead; the engine then holds the request and posts it again.)
        self._workers = ThreadPoolExecutor(int(o["workers"]), thread_name_prefix="example-pipe")
        self._accept: AcceptLoop | None = None
        self._secret = ctx.config.transport.secret  # "" = no secret: the proofs are zeros

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
        o = self.ctx.options
        server = listen(self.ctx.bind_host, int(o["port"]))  # where the control endpoint listens
        # The kit's accept loop: limits before a connection costs a thread, and
        # out of file descriptors it backs off instead of dying or spinning.
        self._accept = AcceptLoop(server, self._serve, name=f"example-pipe-{server.getsockname()[1]}",
                                  max_total=int(o["max_connections"]),
                                  max_per_peer=int(o["max_connections_per_peer"]), log=self.ctx.log).start()
        return {"port": self._accept.port}  # peers receive this as peer.transports["example_pipe"]

    def _serve(self, sock: socket.socket, _addr: Any) -> None:
        """Serve the one request this connection carries. A bad peer never takes us down."""
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        grace = self.ctx.config.runtime.abort_grace_ms / 1000
        try:
            # Nothing is read from a peer that has not proved it holds the secret.
            hello_by = time.monotonic() + self.ctx.config.transport.handshake_timeout_ms / 1000
            server_authenticate(sock, self._secret, hello_by, AUTH_CONTEXT + self.ctx.epoch.encode())
            req = recv_frame(sock, hello_by)
            if req.get("op") not in ("write", "read") or not isinstance(req.get("epoch"), str) \
                    or not isinstance(req.get("deadline"), (int, float)) or not math.isfinite(req["deadline"]) \
                    or not all(type(req.get(k)) is int for k in INT_FIELDS):
                raise ProtocolError(f"malformed request header {str(req)[:200]}")
            # The peer's wall-clock deadline, as our monotonic one; plus a grace to answer.
            end = time.monotonic() + max(0.0, min(req["deadline"] - time.time(), 3600.0))
            if req["op"] == "write":
                self._serve_write(sock, req, end, grace)
            else:
                self._serve_read(sock, req, end, grace)
        except ProtocolError as exc:
            self.ctx.log.warning("example_pipe: dropping a connection: %s", exc)
        except (OSError, MpcommError):
            pass  # wrong secret, a deadline, or the initiator went away: nobody to answer

    def _check(self, req: dict[str, Any], end: float, access: str) -> Any:
        """Refuse late requests, then let the engine check token, epoch, access and bounds.

        ``serve`` returns the region with a lease held: release it when done.
        """
        if time.monotonic() >= end:
            raise TransferTimeout("the request arrived after its deadline; nothing was touched")
        return self.ctx.regions.serve(req["region_id"], req["token"], req["epoch"], req["offset"], req["length"], access)

    def _serve_write(self, sock: socket.socket, req: dict[str, Any], end: float, grace: float) -> None:
        length = req["length"]
        try:
            region = self._check(req, end, "w")
        except MpcommError as exc:
            self._refuse(sock, exc, unread=length, by=end + grace)
            return
        try:
            # Zero-copy, straight into the region; recv_into_by stops at the deadline.
            recv_into_by(sock, region.slice(req["offset"], length), end, "example_pipe payload")
        except TransferTimeout as exc:
            region.release()  # a stalled writer does not keep the lease past the deadline
            self._refuse(sock, TransferTimeout(f"deadline passed mid-payload: {exc}"), unread=0, by=end + grace)
            self._drain(sock, end + grace)
            return
        except BaseException:
            region.release()
            raise
        region.release()
        send_frame(sock, {"ok": True}, end + grace)

    def _serve_read(self, sock: socket.socket, req: dict[str, Any], end: float, grace: float) -> None:
        try:
            region = self._check(req, end, "r")
        except MpcommError as exc:
            self._refuse(sock, exc, unread=0, by=end + grace)
            return
        try:
            send_frame(sock, {"ok": True}, end)
            sendmsg_by(sock, [region.slice(req["offset"], req["length"])], end, "example_pipe read")  # zero-copy
        finally:
            region.release()

    @staticmethod
    def _refuse(sock: socket.socket, exc: MpcommError, unread: int, by: float) -> None:
        """Swallow the payload already on its way (touching no region), then say why."""
        scratch = memoryview(bytearray(min(unread, 64 << 10)))
        while unread:
            k = min(unread, scratch.nbytes)
            recv_into_by(sock, scratch[:k], by, "example_pipe refused payload")
            unread -= k
        send_frame(sock, {"code": exc.code, "message": str(exc)}, by)  # error_from_code() rebuilds it

    @staticmethod
    def _drain(sock: socket.socket, by: float) -> None:
        """Discard what the initiator still sends until it stops (EOF) or ``by``.

        Closing with unread bytes makes the kernel reset the connection, and the
        reset can overtake our reply: the initiator, whose deadline timer may fire
        a moment after ours, would see a lost connection instead of the deadline.
        Its abort shuts its sending side soon after, which ends this.
        """
        scratch = memoryview(bytearray(64 << 10))
        while recv_some_by(sock, scratch, by) > 0:
            pass

    # -- initiator side: move the bytes of one Operation --------------------------------

    def reach(self, peer: PeerInfo) -> Availability:
        if not isinstance((peer.transports.get(self.name) or {}).get("port"), int):
            return Availability.no("peer published no example_pipe port")
        return Availability.yes()

    def post(self, op: Any) -> None:
        # Runs on an engine thread (usually the caller's): start the work and
        # return. Never connect, send or wait for the peer here.
        if op.length == 0:
            op.complete(0)
            return
        o = self.ctx.options
        n = int(o["stripes"]) if op.length >= int(o["stripe_threshold"]) else 1
        ranges = stripes(op.length, n)
        state = op.state = _OpState(Pieces(op, len(ranges)))
        for start, length in ranges:
            self._workers.submit(self._run, op, state, start, length)

    def _run(self, op: Any, state: _OpState, start: int, length: int) -> None:
        sock: socket.socket | None = None
        error: BaseException | None = None
        confirmed = True
        fence = self.ctx.config.runtime.abort_grace_ms / 2000
        try:
            # map_errors turns OSError / socket timeouts into mpcomm errors (native error as __cause__).
            with map_errors(op.remote.address, f"example_pipe {op.kind}"):
                if op.aborted:
                    raise op.abort_exc
                host, _ = parse_endpoint(op.remote.address)  # the host we reached the peer's engine at
                port = op.peer.transports[self.name]["port"]
                sock = socket.create_connection((host, port), timeout=max(op.time_left(), 0.001))
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                # Publish the socket, then look at op.aborted, both under the lock:
                # either abort() sees the socket or we see the abort, never neither.
                with state.lock:
                    state.socks.add(sock)
                    aborted = op.aborted
                if aborted:
                    raise op.abort_exc
                by = op.deadline + fence  # no blocking call below outlives this
                client_authenticate(sock, self._secret, by, AUTH_CONTEXT + op.peer.epoch.encode())
                header = {"op": op.kind, "region_id": op.remote.region_id, "token": op.remote.token,
                          "epoch": op.remote.epoch, "offset": op.remote_offset + start, "length": length,
                          "deadline": op.deadline_wall}
                view = op.local_view[start : start + length]
                if op.kind == "write":
                    confirmed = self._write(sock, op, header, view, by)
                else:
                    self._read(sock, op, header, view, by)
        except BaseException as exc:  # noqa: BLE001 - everything is reported through the operation
            error = exc if isinstance(exc, MpcommError) else MpcommError(f"example_pipe {op.kind}: {exc!r}")
        finally:
            if sock is not None:
                with state.lock:
                    state.socks.discard(sock)
                sock.close()
        # One report per stripe; the op is reported once, by the last one. If an
        # abort was requested, op.fail reports its reason (timeout, cancel).
        state.pieces.done(error, confirmed=confirmed)

    def _write(self, sock: socket.socket, op: Any, header: dict[str, Any], view: memoryview, by: float) -> bool:
        """Send one write; returns False when it was aborted and the target never confirmed it stopped."""
        try:
            send_frame(sock, header, by)
            sendmsg_by(sock, [view], by, "example_pipe payload")  # zero-copy: straight from the caller's buffer
        except OSError:
            if not op.aborted and op.time_left() > 0:
                raise
            # abort() shut our sending side, or the deadline passed and the target
            # (which keeps the same deadline and may see it first) stopped reading.
            # Go on reading: the target answers or closes once it has consumed what
            # was already sent. That is the fence.
        try:
            reply = recv_frame(sock, by)
        except TransferTimeout:
            if op.aborted:
                return False  # silent target: we cannot say nothing more lands
            raise
        except OSError as exc:  # PeerConnectionError too: the target closed, so it stopped
            if op.aborted or op.time_left() > 0:
                raise
            raise TransferTimeout(f"the target stopped the write at its deadline: {exc}") from exc
        # (A PeerConnectionError here after an abort means the target closed: it
        # stopped. That is a confirmed failure; op.fail reports the abort reason.)
        self._raise_for(reply, op)
        return True

    def _read(self, sock: socket.socket, op: Any, header: dict[str, Any], view: memoryview, by: float) -> None:
        send_frame(sock, header, by)
        self._raise_for(recv_frame(sock, by), op)
        recv_into_by(sock, view, by, "example_pipe read")  # zero-copy: straight into the caller's buffer

    @staticmethod
    def _raise_for(reply: dict[str, Any], op: Any) -> None:
        if reply.get("ok") is True:
            return
        raise error_from_code(str(reply.get("code")), f"{op.remote.address}: {reply.get('message')}",
                              peer=op.remote.address, region=op.remote.name)

    def abort(self, op: Any) -> None:
        # Any thread (the engine's deadline timer, a cancelling caller, the link
        # monitor). Must be quick and thread-safe, and never block.
        state: _OpState | None = op.state
        if state is None:
            return  # not started: _run checks op.aborted before it connects
        with state.lock:
            socks = list(state.socks)
        for sock in socks:
            try:
                # A read stops at once. A write only stops sending: see _write's fence.
                sock.shutdown(socket.SHUT_WR if op.kind == "write" else socket.SHUT_RDWR)
            except OSError:
                pass  # already finished and closed

    def peer_changed(self, peer: PeerInfo) -> None:
        # We cache nothing per peer (no pooled connections, no keys), and the
        # engine has already aborted the requests in flight to it.
        pass

    def close(self) -> None:
        if self._accept is not None:
            self._accept.close()  # wakes accept() and every serving thread
        self._workers.shutdown(wait=False, cancel_futures=False)
