"""The tcp transport: one-sided reads and writes over TCP, served by the target.

Layout: :mod:`.wire` (the frames), :mod:`.server` (the target side; plain
connections' requests are served by :mod:`.dataport`, the same loop in C
without the GIL),
:mod:`.client` (pipelined connections of the initiator), this module (the
:class:`~mpcomm.Transport` that ties them to the engine).

* ``post`` / ``post_many`` never wait on the peer: a request goes to a
  connection of the peer's pool (dialled by that connection's own thread with
  ``transport.handshake_timeout_ms``); a small one is sent at once with
  ``MSG_DONTWAIT`` when the connection is idle, anything else by the
  connection's writer. Replies are read and reported by the connection's
  reader thread, or by the ``result()`` caller itself (:meth:`drive`: one
  thread wake-up less per request waited on). Many requests are in flight
  per connection.
* Both sides poll briefly for a frame due soon before they sleep
  (``busy_poll_us``, :mod:`.busypoll`).
* ``post_many``: one frame per connection carrying the descriptor list and
  the gathered payload (``sendmsg`` of the local slices); one reply per frame
  with per-index status; reads scatter with ``recv_into`` straight into the
  local slices. The target checks every index against its own region table.
* Large requests (``stripe_threshold``) are striped over up to
  ``connections`` connections (:func:`mpcomm.transport_kit.stripes`).
* Every data connection runs :mod:`mpcomm.auth`'s exchange (with
  ``transport.secret``: a real proof) before the target reads a request from
  it; with ``transport.tls`` it runs TLS first (:mod:`.tls_stream`).
* Abort is fenced per connection that carried the request (see
  :mod:`.client`): a timed-out request on a live target is confirmed.
* Notifications: a write with one that goes as one frame carries it on that
  WRITE frame (``FLAG_NOTE``, :meth:`TcpTransport.carries_notification`): the
  target admits the region and holds room in its queue before a byte lands,
  queues the note after the data and answers once. Other notifications (bare
  ones, striped or staged writes', other transports'): where the peer's data
  port is native (it advertises ``notify``), :meth:`TcpTransport.notify` sends
  a NOTIFY frame on a data connection, which the target queues without its
  GIL (``_dataport.c``); the engine calls it after the request completed.
  Elsewhere (TLS, copy mode, no compiler) the control channel carries them.

Zero-copy mode moves payloads straight between sockets and registered
memory; copy mode stages them through bounce buffers on both sides, for the
zero-copy vs copy comparison.
"""

from __future__ import annotations

import logging
import math
import operator
import threading
import time
from typing import Any, ClassVar

from mpcomm import Availability, Capabilities, Transport, TransportContext
from mpcomm.control import listen
from mpcomm.errors import MpcommError, OutOfBoundsError, TransferTimeout
from mpcomm.peer import PeerInfo, parse_endpoint
from mpcomm.transport_kit import AcceptLoop, FenceTimer, Pieces, stripes

from . import dataport, wire
from .client import Piece, Pool, drive, next_id
from .server import Server
from .staging import Staged
from .staging import state_of as staging_state

KiB, MiB = 1 << 10, 1 << 20
#: A peer epoch's hex text -> its integer, as the request header carries it (parsed once, not per request).
_EPOCHS: dict[str, int] = {}

#: Inclusive ranges of every numeric option; a value outside is a ConfigError naming it.
OPTION_RANGES: dict[str, tuple[float, float]] = {
    "port": (0, 65535),
    "connections": (1, 64),
    "stripe_threshold": (64 * KiB, 1 << 40),
    "inline_threshold": (0, 64 * MiB),
    "chunk": (4 * KiB, 1 << 30),
    "bounce_size": (4 * KiB, 1 << 30),
    "staging_chunk": (64 * KiB, 1 << 30),
    "staging_limit": (64 * KiB, 1 << 40),
    "socket_buffer": (0, 1 << 30),
    "max_connections": (1, 1 << 20),
    "max_connections_per_peer": (1, 1 << 20),
    "idle_timeout_ms": (100, 7 * 24 * 3600 * 1000),
    "max_request_ms": (1, 7 * 24 * 3600 * 1000),
    "max_batch": (1, 1 << 16),
    "busy_poll_us": (0, 100_000),
    "tls": ["auto", "off"],
}


class TcpTransport(Transport):
    """Always-available fallback between hosts, and the template for plugin authors."""

    name: ClassVar[str] = "tcp"
    capabilities: ClassVar[Capabilities] = Capabilities(
        memory_kinds=frozenset({"host", "cuda"}),  # cuda: staged through pinned bounce buffers (staging.py)
        remote_memory_kinds=frozenset({"host"}),  # the target serves host memory only
        intra_node=True,
        inter_node=True,
        one_sided=False,  # the target's CPU serves each request
        zero_copy=True,
        inflight_cancel=True,
        modes=frozenset({"zero-copy", "copy"}),
        revocation="target-check",  # the target checks every request against its region table
        bandwidth_class="low",  # kernel sockets
    )
    #: Checked by the core when the engine starts (a ConfigError names the option).
    option_ranges: ClassVar[dict[str, Any]] = OPTION_RANGES
    default_options: ClassVar[dict[str, Any]] = {
        "port": 0,  # data port; 0 picks a free one
        "connections": 4,  # per peer; also the stripe count for large transfers
        "stripe_threshold": 8 * MiB,  # split transfers at least this large over connections
        "inline_threshold": 256 * KiB,  # try sending requests up to this size on the poster's thread (MSG_DONTWAIT)
        "chunk": 1 * MiB,  # target: receive granularity; the deadline is checked between chunks
        "bounce_size": 1 * MiB,  # copy mode's staging buffers
        "socket_buffer": 0,  # SO_SNDBUF/SO_RCVBUF; 0 keeps the kernel's auto-tuning
        "max_connections": 1024,  # target: open data connections in total
        "max_connections_per_peer": 64,  # target: open data connections from one peer host
        "idle_timeout_ms": 60_000,  # target: close a data connection idle this long
        "max_request_ms": 600_000,  # target: serve one request at most this long, whatever its deadline says
        "max_batch": 4096,  # descriptors per batch frame
        "busy_poll_us": 100,  # poll this long for a frame due soon before sleeping (0: never; see busypoll.py)
        "tls": "auto",  # "auto": data connections run TLS whenever transport.tls does; "off": never
        "native_server": True,  # target: serve plain connections' requests in C without the GIL (dataport.py)
        "staging_chunk": 8 * MiB,  # local CUDA memory: pinned bounce buffer size (one chunk in flight per request)
        "staging_limit": 64 * MiB,  # local CUDA memory: pinned bounce buffers in all
    }

    def __init__(self, ctx: TransportContext) -> None:
        super().__init__(ctx)
        o = ctx.options
        self.copy_mode = ctx.mode == "copy"
        self.closed = False
        self._pools: dict[tuple[str, str], Pool] = {}  # (peer address, peer epoch) -> its connections
        self._pools_lock = threading.Lock()
        self._accept: AcceptLoop | None = None
        self.fences = FenceTimer("mpcomm-tcp-fences")  # abort fences of every connection
        self._conns = int(o["connections"])
        self._stripe_threshold = int(o["stripe_threshold"])
        self._inline = -1 if self.copy_mode else int(o["inline_threshold"])
        self._max_batch = int(o["max_batch"])
        self.tls_server = self.tls_client = None
        if getattr(ctx.config.transport, "tls", False) and o["tls"] == "auto":
            from mpcomm.tls import client_context, server_context

            # The control channel's certificates; mutual authentication as configured there.
            self.tls_server, self.tls_client = server_context(ctx.config), client_context(ctx.config)
        self.log = ctx.log
        #: The native request loop and region table (dataport.py), or None: the Python server serves.
        self.dataport = dataport.open_port(self)

    @classmethod
    def memory_kind_availability(cls) -> dict[str, Availability]:
        from mpcomm import cuda_runtime

        why = cuda_runtime.unavailable_reason()
        return {"cuda": Availability.no(why) if why else Availability.yes("pinned bounce buffers")}

    def _stage(self, op: Any) -> None:
        """Local CUDA memory: chunk by chunk through a pinned bounce buffer (staging.py)."""
        from mpcomm import cuda_runtime

        with self._pools_lock:
            pool = getattr(self, "_pinned", None)
            if pool is None:
                o = self.ctx.options
                pool = self._pinned = cuda_runtime.PinnedPool(int(o["staging_chunk"]), int(o["staging_limit"]))
        st = op.state = Staged(op, pool, self._post_chunk)
        st.start()

    def _post_chunk(self, sub: Any) -> None:
        """A staged chunk (staging.py): staging's own callback waits for it, never a driver."""
        self.post(sub)
        self.undriven(sub)

    @classmethod
    def availability(cls) -> Availability:
        from . import busypoll

        busypoll.load()
        dataport.load()
        return Availability.yes(f"always available (busy-polling: {busypoll.reason}; "
                                f"native data port: {dataport.reason})")

    # -- target side -------------------------------------------------------------

    #: The target side of one data connection; a subclass may serve differently
    #: (tests inject faults this way).
    server_class: ClassVar[type[Server]] = Server

    def start(self) -> dict[str, Any]:
        o = self.ctx.options
        server = listen(self.ctx.bind_host, int(o["port"]), backlog=512)
        port = server.getsockname()[1]
        serving = self.server_class(self)
        self._accept = AcceptLoop(server, serving.serve, name=f"mpcomm-tcp-{port}",
                                  max_total=int(o["max_connections"]),
                                  max_per_peer=int(o["max_connections_per_peer"]), log=self.log).start()
        info = {"port": port, "idle_timeout_ms": int(o["idle_timeout_ms"]), "max_batch": int(o["max_batch"]),
                "proto": wire.VERSION, "tls": self.tls_server is not None}
        # Every connection is served by the native loop: it takes NOTIFY frames into the queue
        # the engine adopts (notification_queue); peers then send notifications here that way.
        self._notes = self.dataport.notes if self.dataport is not None and serving.native is not None else None
        if self._notes is not None:
            info["notify"] = True
        # Both servers take a WRITE that carries its notification (wire.py FLAG_NOTE): the native
        # loop into the queue above, server.py into the engine's queue (ctx.notifications).
        if self._notes is not None or self.ctx.notifications is not None:
            info["write_note"] = True
        return info

    def notification_queue(self) -> Any:
        """The native data port's notification queue (dataport.py), when it serves every connection."""
        return getattr(self, "_notes", None)

    def register(self, region: Any) -> dict[str, Any] | None:
        """Publish ``region`` in the native table (only host regions peers can name are there:
        the target serves host memory only, ``remote_memory_kinds``)."""
        if self.dataport is not None and region.published and region.kind == "host":
            self.dataport.publish(region)
        return {}

    def unregister(self, region: Any) -> None:
        """When this returns, no native request moves a byte of ``region`` (NativePort.revoke)."""
        if self.dataport is not None:
            self.dataport.revoke(region)

    # -- initiator side ------------------------------------------------------------

    def reach(self, peer: PeerInfo) -> Availability:
        info = peer.transports.get(self.name) or {}
        if not isinstance(info.get("port"), int):
            return Availability.no("peer published no tcp port")
        if info.get("proto", 1) != wire.VERSION:
            return Availability.no(f"peer speaks tcp data protocol {info.get('proto', 1)}, we speak {wire.VERSION}")
        if bool(info.get("tls")) != (self.tls_client is not None):
            return Availability.no("peer's tcp data connections " + ("use TLS and ours do not" if info.get("tls")
                                                                      else "do not use TLS and ours do"))
        return Availability.yes()

    def _pool(self, peer: PeerInfo, address: str) -> Pool:
        key = (address, peer.epoch)
        pool = self._pools.get(key)
        if pool is None:
            info = peer.transports[self.name]
            host, _ = parse_endpoint(address)
            with self._pools_lock:
                pool = self._pools.get(key)
                if pool is None:
                    idle = info.get("idle_timeout_ms")
                    pool = self._pools[key] = Pool(self, host, int(info["port"]), peer.epoch,
                                                   int(idle) if isinstance(idle, int) and idle > 0 else 60_000)
        return pool

    def _send(self, unit: Any, pool: Pool, pieces: list[Piece]) -> None:
        """Every frame of ``unit`` (a request, a group or a notification) to its connection: the one
        way a request's bytes leave (see "Paths" in docs/tcp.md). A frame up to ``inline_threshold``
        (a read's always: it carries no payload) is tried on this thread first (Conn.submit)."""
        unit.state = pieces
        n = len(pieces)
        try:
            conns = pool.pick(n) if n > 1 else (pool.pick_one(),)
        except MpcommError as exc:
            for piece in pieces:
                piece.report(exc, None, True)
            return
        if len(conns) < n:  # more frames than connections (a batch over max_batch): round robin
            conns = [conns[k % len(conns)] for k in range(n)]
        inline = self._inline
        for piece, conn in zip(pieces, conns):
            try:
                while not conn.submit(piece, piece.read or piece.size <= inline):
                    conn = pool.pick_one()  # that one was closing (idle, broken): dial another
            except MpcommError as exc:
                piece.report(exc, None, True)
        if unit.aborted:  # aborted while we posted: reach the pieces abort() could not see yet
            self.abort(unit)

    def post(self, op: Any) -> None:
        """One frame for the request (:func:`_frame`), or one per stripe from ``stripe_threshold`` bytes.

        A one-frame request's piece reports ``op`` itself (no
        :class:`~mpcomm.transport_kit.Pieces` between them); a write carrying its notification
        (``op.notification``, only ever a one-frame write: :meth:`carries_notification`) has it
        between header and data."""
        length = op.length
        if length == 0:
            op.complete(0)
            return
        if not 0 <= op.local_offset <= op.local.size - length:
            raise _outside(op.local, op.local_offset, length)
        if op.local.kind != "host":
            self._stage(op)
            return
        pool = self._pool(op.peer, op.remote.address)
        if length < self._stripe_threshold or self._conns == 1:
            self._send(op, pool, [_frame(op, 0, length, op.notification, _Reporter(op))])
        else:
            ranges = stripes(length, min(self._conns, math.ceil(length / (self._stripe_threshold // 2))))
            pieces = Pieces(op, len(ranges))

            def report(err: BaseException | None, _status: Any, confirmed: bool) -> None:
                pieces.done(err, confirmed=confirmed)

            self._send(op, pool, [_frame(op, start, ln, None, report) for start, ln in ranges])
        if op.undriven:  # a completion queue, callback or poller waits: no driver will come
            self.undriven(op)

    def carries_notification(self, op: Any) -> bool:
        """A write the target's server takes as one WRITE frame carrying its note (wire.py FLAG_NOTE):
        the peer advertises ``write_note`` and the request goes as one frame (not staged, not
        striped, not empty). The target queues the note after the data, before its one reply."""
        info = op.peer.transports.get(self.name) if op.peer is not None else None
        return (bool(info and info.get("write_note")) and not self.closed and 0 < op.length
                and (op.length < self._stripe_threshold or self._conns == 1) and op.local.kind == "host")

    def post_many(self, group: Any) -> None:
        """One frame per connection for the whole group (see the module docstring)."""
        count = group.count
        if count == 0:
            group.complete()
            return
        if group.local.kind != "host":
            for m in group.members():  # staged one by one: the group's abort reaches each
                self.post(m)
            return
        pool = self._pool(group.peer, group.remote.address)
        lens, loffs, roffs = group.lengths, group.local_offsets, group.remote_offsets
        # The ranges again, where the payload views are cut (memoryview slicing would clip or
        # wrap a bad local one, not refuse it) and the frame is built (the target refuses a bad
        # remote one by dropping the connection): both against the sizes held here.
        lsize, rsize = group.local.size, group.remote.size
        if (min(lens) < 0 or min(loffs) < 0 or min(roffs) < 0 or max(map(operator.add, loffs, lens)) > lsize
                or max(map(operator.add, roffs, lens)) > rsize):
            for i in range(count):
                if not (0 <= lens[i] <= lsize and 0 <= loffs[i] <= lsize - lens[i]):
                    raise _outside(group.local, loffs[i], lens[i], i)
                if not (lens[i] <= rsize and 0 <= roffs[i] <= rsize - lens[i]):
                    raise _outside(group.remote, roffs[i], lens[i], i, "remote")
        total = sum(lens)
        runs = self._runs(lens, total, pool)
        read = group.kind == "read"
        code = wire.OP_READV if read else wire.OP_WRITEV
        local = group.local.view
        remote = group.remote
        epoch = _epoch(remote)
        plist: list[Piece] = []
        for a, b in runs:
            rid = next_id()
            size = sum(lens[a:b])
            head = memoryview(wire.request(code, 0, b - a, rid, remote.region_id, remote.token, epoch, 0, size,
                                           group.deadline_wall))
            ro, ln = roffs[a:b], lens[a:b]
            if not wire.LITTLE:
                ro.byteswap()
                ln.byteswap()
            parts = [local[loffs[i] : loffs[i] + lens[i]] for i in range(a, b)]
            views = [head, memoryview(ro).cast("B"), memoryview(ln).cast("B")]
            if not read:
                views += [p for p in parts if p.nbytes]
            plist.append(Piece(rid, read, views, parts if read else [], _GroupReporter(group, a, b), b - a,
                               size))
        self._send(group, pool, plist)
        if group.undriven:  # as in post
            self.undriven(group)

    def _runs(self, lens: Any, total: int, pool: Pool) -> list[tuple[int, int]]:
        """Contiguous index runs: one per connection for a large group, none over the peer's max_batch."""
        count = len(lens)
        n = 1
        if total >= self._stripe_threshold and self._conns > 1:
            n = min(self._conns, count, math.ceil(total / (self._stripe_threshold // 2)))
        per = max(1, min(self._max_batch, -(-count // n)))
        if n == 1 and count <= per:
            return [(0, count)]
        runs: list[tuple[int, int]] = []
        a = 0
        target = total / n
        acc = 0
        for i in range(count):
            acc += lens[i]
            if i + 1 - a >= per or (acc >= target and len(runs) < n - 1):
                runs.append((a, i + 1))
                a, acc = i + 1, 0
        if a < count:
            runs.append((a, count))
        return runs

    def notify(self, peer: PeerInfo, remote: Any, data: bytes, deadline: float) -> bool:
        """A NOTIFY frame on a data connection, where the peer's native data port takes them.

        The target queues it and answers without its interpreter; a refusal
        (queue full, over its limits) raises as the control channel's would.
        """
        info = peer.transports.get(self.name) or {}
        if self.closed or not info.get("notify") or not self.reach(peer):
            return False
        pool = self._pool(peer, remote.address)
        name = str(remote.name).encode("utf-8", "replace")[: wire.MAX_NOTE_REGION]
        rid = next_id()
        left = max(deadline - time.monotonic(), 0.0)
        head = memoryview(wire.request(wire.OP_NOTIFY, 0, len(name), rid, 0, 0, 0, 0, len(data), time.time() + left))
        done = threading.Event()
        outcome: list[BaseException | None] = []

        def report(err: BaseException | None, _status: Any, _confirmed: bool) -> None:
            outcome.append(err)
            done.set()

        views = [v for v in (head, memoryview(name), memoryview(data)) if v.nbytes]
        piece = Piece(rid, False, views, [], report, 0, len(data))
        self._send(_Note(), pool, [piece])
        drive([piece], deadline)  # read the reply on this thread when it is there
        conn = piece.conn
        if not done.wait(max(deadline - time.monotonic(), 0.0)):
            if conn is not None:
                conn.abort(piece)
            raise TransferTimeout(f"{pool.where}: the target did not take the notification within its deadline")
        if outcome[0] is not None:
            raise outcome[0]
        return True

    def drive(self, op: Any, until: float) -> None:
        """Read the replies of ``op``'s frames on the ``result()`` caller's thread (client.drive)."""
        plist = op.state
        if type(plist) is list and plist:  # else not posted yet, or staged (a Staged stands there)
            drive(plist, until)

    def undriven(self, op: Any) -> None:
        """No ``result()`` caller will drive ``op`` (a callback or a ``done()`` poller waits for it; or,
        called from post, ``op.undriven``: a completion queue reaps it): its connections' readers
        read its replies at once (client.Conn.hand_to_reader), not at their next look."""
        plist = op.state
        if type(plist) is list:
            for piece in plist:
                conn = piece.conn
                if conn is not None:
                    conn.hand_to_reader()

    def abort(self, op: Any) -> None:
        staged = staging_state(op)
        if staged is not None:
            staged.abort()
            return
        for piece in list(op.state or ()):
            conn = piece.conn
            if conn is not None:
                conn.abort(piece)

    def peer_changed(self, peer: PeerInfo) -> None:
        info = peer.transports.get(self.name) or {}
        try:
            host, _ = parse_endpoint(peer.address)
        except ValueError:
            return
        port = info.get("port", -1)
        with self._pools_lock:
            gone = [k for k, p in self._pools.items() if k[0] == peer.address or (p.host == host and p.port == port)]
            pools = [self._pools.pop(k) for k in gone]
        for p in pools:
            p.close()

    def close(self) -> None:
        self.closed = True
        if self._accept is not None:
            self._accept.close()
        if self.dataport is not None:
            self.dataport.close()
        with self._pools_lock:
            pools = list(self._pools.values())
            self._pools.clear()
        for p in pools:
            p.close()
        self.fences.close()
        pinned = getattr(self, "_pinned", None)
        if pinned is not None:
            pinned.close()


logging.getLogger("mpcomm.transport.tcp").addHandler(logging.NullHandler())


def _epoch(remote: Any) -> int:
    """``remote``'s epoch as the request header carries it (parsed once per epoch, not per request)."""
    epoch = _EPOCHS.get(remote.epoch)
    if epoch is None:
        epoch = _EPOCHS[remote.epoch] = int(remote.epoch, 16)
        if len(_EPOCHS) > 1024:
            _EPOCHS.clear()  # bounded; the epochs in use come back on their next request
            _EPOCHS[remote.epoch] = epoch
    return epoch


def _frame(op: Any, start: int, ln: int, note: bytes | None, report: Any) -> Piece:
    """The frame of ``op``'s bytes [start, start + ln): the one READ/WRITE frame rule."""
    read = op.kind == "read"
    remote = op.remote
    epoch = _EPOCHS.get(remote.epoch)
    if epoch is None:
        epoch = _epoch(remote)
    rid = next_id()
    lo = op.local_offset + start
    part = op.local.view[lo : lo + ln]
    name = b"" if note is None else str(remote.name).encode("utf-8", "replace")[: wire.MAX_NOTE_REGION]
    head = memoryview(wire.request(wire.OP_READ if read else wire.OP_WRITE, 0 if note is None else wire.FLAG_NOTE,
                                   len(name), rid, remote.region_id, remote.token, epoch,
                                   op.remote_offset + start, ln, op.deadline_wall))
    views = [head] if read else [head, part]
    if note is not None:
        views[1:1] = [v for v in (memoryview(wire.NOTE_LEN.pack(len(note))), memoryview(name),
                                  memoryview(note)) if v.nbytes]
    return Piece(rid, read, views, [part] if read else [], report, 0, ln)


class _Reporter:
    """A one-piece request's report: the piece ends the request (Pieces.done for a count of 1),
    then lets go of it (``op.state`` leads back here: no cycle left for the collector)."""

    __slots__ = ("op",)

    def __init__(self, op: Any) -> None:
        self.op = op

    def __call__(self, err: BaseException | None, _status: Any, confirmed: bool) -> None:
        op, self.op = self.op, None
        if err is None:
            op.complete(None)
        else:
            op.fail(err, confirmed=confirmed)


class _GroupReporter:
    """A group run's report (indices ``a``..``b``): like :class:`_Reporter`, it lets go of the group
    once it reported, since ``group.state`` holds the pieces that hold this."""

    __slots__ = ("group", "a", "b")

    def __init__(self, group: Any, a: int, b: int) -> None:
        self.group, self.a, self.b = group, a, b

    def __call__(self, err: BaseException | None, status: bytes | None, confirmed: bool) -> None:
        group, self.group = self.group, None
        a, b = self.a, self.b
        if err is None:
            group.complete(indices=range(a, b))
            return
        if status is None:
            group.fail(err, indices=range(a, b), confirmed=confirmed)
            return
        ok = [a + i for i, s in enumerate(status) if not s]
        bad = [a + i for i, s in enumerate(status) if s]
        if ok:
            group.complete(indices=ok)
        group.fail(err, indices=bad, confirmed=confirmed)


class _Note:
    """A notification's unit for :meth:`TcpTransport._send` (notify() waits for its piece itself)."""

    __slots__ = ("state",)
    aborted = False


def _outside(region: Any, off: int, n: int, index: int | None = None, side: str = "local") -> OutOfBoundsError:
    which = "" if index is None else f"request {index} of the batch: "
    return OutOfBoundsError(f"{which}[{off}, {off + n}) is outside the {side} region {region.name!r} of "
                            f"{region.size} bytes; nothing was sent", region=region.name)
