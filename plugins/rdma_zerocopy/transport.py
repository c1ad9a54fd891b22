"""The rdma_zerocopy transport: one-sided RDMA WRITE / READ over RC queue pairs.

Per engine: one adapter port (option ``device``/``port``, default the first
ACTIVE one), one protection domain, one completion queue with a completion
channel, and a thread that reaps completions — a short poll phase
(``poll_spin_us``), then ``ibv_req_notify_cq`` and a blocking wait on the
channel, so an idle engine uses no CPU.

Connections: the first request to a peer creates an RC QP and exchanges QP
number, PSN, LID, GID and MTU with the peer's instance of this transport over
the engine's control channel (``connect``); the peer creates a passive QP
towards it. Each direction has its own QP pair: the side that posts owns the
"active" QP; the target's QP only answers, with no CPU involved per request.

Registration: ``register`` is ``ibv_reg_mr`` with LOCAL_WRITE|REMOTE_WRITE|
REMOTE_READ as the region's ``access`` allows; peers receive
``{"rkey", "addr", "length"}`` in the RemoteRegion. The target's adapter,
not its CPU, enforces the registration's bounds and rights.

Data path: ``post`` splits the request into chunks of at most the port's
``max_msg_sz`` (or ``chunk``), each one signaled ``ibv_post_send``; a
completion maps ``wr_id`` → chunk → Operation. At most ``sq_depth`` work
requests per QP and ``cq_depth`` per engine are outstanding; the rest wait in
the link's queue.

Abort: an RC QP cannot cancel a posted work request. ``abort`` moves the QP
to ERROR, so everything outstanding on it completes with
IBV_WC_WR_FLUSH_ERR; the operation fails only when its last work request has
completed (a completion, even a flush, returns the buffer to us: the local
adapter no longer touches it). For a write, bytes already in the fabric could
still be executed by the target's QP, so the transport then asks the peer to
move its QP to ERROR too (``retire``) before failing the operation. Flushed
chunks of *other* operations are reposted on a new QP (RDMA WRITE/READ of the
same bytes is idempotent; their buffers stay leased). Any error completion
also puts the QP into ERROR; recovery is the same.
"""

from __future__ import annotations

import collections
import itertools
import logging
import os
import resource
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

from mpcomm import Availability, Capabilities, Operation, Transport, TransportContext
from mpcomm.errors import (
    EngineClosedError,
    MpcommError,
    PeerConnectionError,
    ProtocolError,
    TransferError,
    TransportUnavailable,
)
from mpcomm.peer import PeerInfo

from .status import FLUSH, SUCCESS, wc_error

__all__ = ["RdmaZeroCopyTransport", "device_memory_availability", "memlock_reason"]

INSTALL_HINT = "apt install python3-pyverbs"
#: Below this RLIMIT_MEMLOCK (without CAP_IPC_LOCK) registration of real buffers fails.
MIN_MEMLOCK = 64 << 20
CAP_IPC_LOCK = 14


def _fmt_bytes(n: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift} {unit}"
    return f"{n} bytes"


def _has_ipc_lock() -> bool:
    """CAP_IPC_LOCK in the initial user namespace (where the kernel checks it for pinning)."""
    try:
        with open("/proc/self/status") as f:
            caps = next((line.split()[1] for line in f if line.startswith("CapEff:")), "0")
        with open("/proc/self/uid_map") as f:
            init_ns = f.read().split() == ["0", "0", "4294967295"]
    except OSError:
        return False
    return init_ns and bool(int(caps, 16) >> CAP_IPC_LOCK & 1)


def memlock_reason(soft: int | None = None, has_ipc_lock: bool | None = None) -> str:
    """Why RLIMIT_MEMLOCK stops RDMA registration here, or "" when it does not."""
    if soft is None:
        soft = resource.getrlimit(resource.RLIMIT_MEMLOCK)[0]
    if has_ipc_lock is None:
        has_ipc_lock = _has_ipc_lock()
    if has_ipc_lock or soft == resource.RLIM_INFINITY or soft >= MIN_MEMLOCK:
        return ""
    return (f"RLIMIT_MEMLOCK is {_fmt_bytes(soft)}; RDMA registration pins memory: raise it "
            "(ulimit -l unlimited; docker --ulimit memlock=-1; systemd LimitMEMLOCK=infinity)")


def device_memory_availability() -> Availability:
    """GPU memory over RDMA needs a GPU and peer-memory (nvidia_peermem) or dma-buf support."""
    if not (os.path.exists("/dev/nvidiactl") or os.path.isdir("/proc/driver/nvidia")):
        return Availability.no("no GPU: the NVIDIA driver is not loaded")
    if not (os.path.isdir("/sys/module/nvidia_peermem") or os.path.isdir("/sys/kernel/mm/memory_peers/nv_mem")):
        return Availability.no("a GPU is present but no peer-memory module (nvidia_peermem) is loaded")
    return Availability.no("GPU memory registration is not implemented yet: host memory only")


@dataclass(eq=False)
class _Chunk:
    op: Operation
    offset: int
    length: int
    reposts: int = 0


@dataclass(eq=False)
class _Link:
    """The active QP towards one peer (by node id) and the chunks waiting for it."""

    peer: PeerInfo
    state: str = "idle"  # idle → connecting → ready → draining → idle (recovered) ; dead
    qp: Any = None
    conn_id: int = 0
    outstanding: int = 0
    pending: collections.deque[_Chunk] = field(default_factory=collections.deque)
    fence: list[Operation] = field(default_factory=list)
    dead: bool = False


@dataclass(eq=False)
class _OpState:
    link: _Link
    left: int  # chunks not yet completed successfully
    lkey: int
    raddr: int
    rkey: int
    info: dict[str, Any]
    posted: int = 0  # chunks on a QP without a completion yet
    ever_posted: bool = False
    last_conn: int = 0  # the QP (conn id) its chunks were last posted on
    error: BaseException | None = None
    finished: bool = False


class RdmaZeroCopyTransport(Transport):
    """RDMA WRITE/READ between registered memory, the target CPU untouched."""

    name: ClassVar[str] = "rdma_zerocopy"
    capabilities: ClassVar[Capabilities] = Capabilities(
        memory_kinds=frozenset({"host"}),  # device memory: see device_memory_availability()
        intra_node=True,
        inter_node=True,
        one_sided=True,
        zero_copy=True,
        inflight_cancel=True,  # QP → ERROR flushes what is posted
        modes=frozenset({"zero-copy"}),
        bandwidth_class="high",
    )
    default_options: ClassVar[dict[str, Any]] = {
        "device": "",  # adapter name (ibv_devices); "" = the first with an ACTIVE port
        "port": 0,  # 0 = the first ACTIVE port
        "gid_index": -1,  # -1 = auto (IB: 0; RoCE: a RoCE v2 IPv4-mapped GID)
        "sq_depth": 256,  # outstanding work requests per QP
        "cq_depth": 4096,  # outstanding work requests per engine
        "chunk": 0,  # bytes per work request; 0 = the port's max_msg_sz (capped at 1 GiB)
        "poll_spin_us": 20,  # poll before sleeping on the completion channel
        "ack_timeout": 14,  # IB local ACK timeout exponent: 4.096 us * 2**n (14 ≈ 67 ms)
        "retry_count": 7,
        "traffic_class": 0,
        "service_level": 0,
        "max_reposts": 3,  # times a flushed chunk of an innocent request is reposted
    }
    #: Opens the adapter: ``factory(device=, port=, gid_index=, cq_depth=)``; tests substitute a double.
    device_factory: ClassVar[Callable[..., Any] | None] = None

    def __init__(self, ctx: TransportContext) -> None:
        super().__init__(ctx)
        self.log = ctx.log
        self.dev: Any = None
        self._lock = threading.Lock()
        self._closed = False
        self._links: dict[str, _Link] = {}
        self._passive: dict[tuple[str, int], Any] = {}
        self._mrs: dict[int, Any] = {}
        self._wrs: dict[int, tuple[_Chunk, _Link]] = {}
        self._wr_ids = itertools.count(1)
        self._conn_ids = itertools.count(1)
        self._cq_free = 0
        self._thread: threading.Thread | None = None

    # -- availability --------------------------------------------------------------

    @classmethod
    def availability(cls) -> Availability:
        from . import verbs

        try:
            verbs.load_pyverbs()
        except verbs.PyverbsMissing as exc:
            return Availability.no(f"pyverbs is not installed ({INSTALL_HINT}); {exc}")
        found = verbs.probe()
        if not found.ok:
            return Availability.no(found.reason)
        why = memlock_reason()
        if why:
            return Availability.no(why)
        gpu = device_memory_availability()
        return Availability.yes(f"{found.device} port {found.port} ({found.link_layer}); device memory: {gpu.reason}")

    @classmethod
    def version(cls) -> str:
        try:
            from importlib.metadata import version

            return f"rdma-core pyverbs {version('pyverbs')}"
        except Exception:  # noqa: BLE001 - the Debian package has no dist-info
            return ""

    # -- lifecycle --------------------------------------------------------------------

    def start(self) -> dict[str, Any]:
        o = self.ctx.options
        factory = self.device_factory
        if factory is None:
            from .verbs import Device

            factory = Device
        self.dev = factory(device=o["device"], port=int(o["port"]), gid_index=int(o["gid_index"]),
                           cq_depth=int(o["cq_depth"]))
        self._sq_depth = max(1, min(int(o["sq_depth"]), int(self.dev.max_qp_wr)))
        self._cq_free = int(self.dev.cq_depth)
        limit = min(int(self.dev.max_msg_sz), 1 << 30)
        self._chunk = min(int(o["chunk"]) or limit, limit)
        self._qp_opts = {"timeout": int(o["ack_timeout"]), "retry_cnt": int(o["retry_count"]), "rnr_retry": 7,
                         "traffic_class": int(o["traffic_class"]), "service_level": int(o["service_level"])}
        self._thread = threading.Thread(target=self._cq_loop, name=f"mpcomm-rdma-cq-{self.dev.name}", daemon=True)
        self._thread.start()
        return dict(self.dev.info())

    def close(self) -> None:
        self._closed = True
        dev = self.dev
        if dev is None:
            return
        try:
            dev.wake()
        except Exception:  # noqa: BLE001
            pass
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(2.0)
        with self._lock:
            links = list(self._links.values())
            self._links.clear()
            passives = list(self._passive.values())
            self._passive.clear()
            ops = {c.op for c, _ in self._wrs.values()}
            self._wrs.clear()
            for link in links:
                ops.update(c.op for c in link.pending)
                ops.update(link.fence)
                link.pending.clear()
                link.dead = True
            mrs = list(self._mrs.values())
            self._mrs.clear()
        # Destroying a QP stops its work requests: after this no byte of any operation moves.
        for qp in [link.qp for link in links if link.qp is not None] + passives:
            for step in (qp.to_error, qp.close):
                try:
                    step()
                except Exception:  # noqa: BLE001
                    pass
        for op in ops:
            op.fail(EngineClosedError("the engine was closed while the request was in flight"))
        for mr in mrs:
            try:
                mr.close()
            except Exception:  # noqa: BLE001
                pass
        try:
            dev.close()
        except Exception:  # noqa: BLE001
            self.log.exception("rdma: closing the device failed")

    # -- registration -------------------------------------------------------------------

    def register(self, region: Any) -> dict[str, Any] | None:
        if region.kind != "host":
            return None
        try:
            mr = self.dev.reg_mr(region.address, region.size, region.access)
        except Exception as exc:  # noqa: BLE001 - the region stays usable through other transports
            hint = memlock_reason()
            self.log.warning("rdma: cannot register %s (%d bytes): %s%s", region.name, region.size, exc,
                             f" ({hint})" if hint else "")
            return None
        with self._lock:
            old = self._mrs.pop(region.id, None)
            self._mrs[region.id] = mr
        if old is not None:
            old.close()
        return {"rkey": mr.rkey, "addr": region.address, "length": region.size}

    def unregister(self, region: Any) -> None:
        with self._lock:
            mr = self._mrs.pop(region.id, None)
        if mr is not None:
            mr.close()

    # -- initiator side ---------------------------------------------------------------------

    def reach(self, peer: PeerInfo) -> Availability:
        info = peer.transports.get(self.name) or {}
        if "gid" not in info or "link_layer" not in info:
            return Availability.no("peer published no rdma_zerocopy port")
        if info["link_layer"] != self.dev.link_layer:
            return Availability.no(f"link layers differ ({self.dev.link_layer} here, {info['link_layer']} on the peer)")
        if info["link_layer"] == "InfiniBand" and not info.get("lid") and str(info["gid"]).startswith("fe80:"):
            return Availability.no("the peer's InfiniBand port has no LID (is a subnet manager running?)")
        return Availability.yes()

    def _link(self, peer: PeerInfo) -> _Link:
        link = self._links.get(peer.node_id)
        if link is None or link.dead:
            link = self._links[peer.node_id] = _Link(peer)
        return link

    def post(self, op: Operation) -> None:
        if op.length == 0:
            op.complete(0)
            return
        info = op.remote.transports.get(self.name)
        if not info:
            raise TransportUnavailable(f"region {op.remote.name!r} is not registered with rdma_zerocopy on the peer",
                                       peer=op.remote.address, region=op.remote.name)
        mr = self._mrs.get(op.local.id)
        if mr is None:
            got = self.register(op.local)
            if got is None:
                raise TransportUnavailable(f"local buffer {op.local.name!r} cannot be registered for RDMA",
                                           region=op.local.name)
            op.local.transport_info[self.name] = got
            mr = self._mrs[op.local.id]
        chunks = [_Chunk(op, off, min(self._chunk, op.length - off)) for off in range(0, op.length, self._chunk)]
        connect = False
        with self._lock:
            if self._closed:
                raise MpcommError("rdma_zerocopy transport is closed")
            link = self._link(op.peer)
            op.state = _OpState(link, len(chunks), mr.lkey, int(info["addr"]) + op.remote_offset, int(info["rkey"]),
                                dict(info))
            if op.aborted:
                op.state.finished = True
                aborted = True
            else:
                aborted = False
                link.pending.extend(chunks)
                if link.state == "idle":
                    link.state = "connecting"
                    connect = True
        if aborted:
            op.fail(op.abort_exc or MpcommError("aborted"))
            return
        if connect:
            self.ctx.executor.submit(self._connect, link)
        else:
            self._pump(link)

    def _connect(self, link: _Link) -> None:
        qp = None
        try:
            qp = self.dev.create_qp(self._sq_depth)
            conn_id = next(self._conn_ids)
            body = {"op": "connect", "conn": conn_id, **qp.local_info()}
            timeout = self.ctx.config.transport.handshake_timeout_ms / 1000
            reply = self.ctx.control(link.peer, self.name, body, timeout)
            qp.connect(reply, **self._qp_opts)
        except Exception as exc:  # noqa: BLE001 - reported through the waiting operations
            if qp is not None:
                try:
                    qp.close()
                except Exception:  # noqa: BLE001
                    pass
            err = exc if isinstance(exc, MpcommError) else PeerConnectionError(
                f"rdma: cannot connect a queue pair to {link.peer.address}: {exc}", peer=link.peer.address)
            with self._lock:
                link.state = "idle"
                victims = {c.op for c in link.pending}
                link.pending.clear()
                done = []
                for op in victims:
                    st: _OpState = op.state
                    st.error = st.error or err
                    done += self._check_done(op)
            self._run(done)
            return
        with self._lock:
            if self._closed or link.dead:
                stale = True
            else:
                stale = False
                link.qp, link.conn_id, link.state = qp, conn_id, "ready"
        if stale:
            try:
                qp.close()
            except Exception:  # noqa: BLE001
                pass
            return
        self._pump(link)

    def _pump(self, link: _Link) -> None:
        """Post waiting chunks while the QP and the CQ have room."""
        from .verbs import WorkRequest

        done: list[Callable[[], None]] = []
        with self._lock:
            while (link.state == "ready" and link.pending and link.outstanding < self._sq_depth
                   and self._cq_free > 0):
                chunk = link.pending.popleft()
                op = chunk.op
                st: _OpState = op.state
                if st.finished or st.error is not None or op.aborted:
                    continue
                wr_id = next(self._wr_ids)
                wr = WorkRequest(wr_id, op.kind, op.local.address + op.local_offset + chunk.offset, chunk.length,
                                 st.lkey, st.raddr + chunk.offset, st.rkey)
                try:
                    link.qp.post(wr)
                except Exception as exc:  # noqa: BLE001 - the QP is unusable: recover like an error completion
                    st.error = TransferError(f"rdma: ibv_post_send failed: {exc}", peer=op.remote.address,
                                             region=op.remote.name)
                    self._purge(link, op)
                    done += self._drain(link)
                    done += self._check_done(op)
                    break
                self._wrs[wr_id] = (chunk, link)
                link.outstanding += 1
                self._cq_free -= 1
                st.posted += 1
                st.ever_posted = True
                st.last_conn = link.conn_id
        self._run(done)

    # -- completions -------------------------------------------------------------------------

    def _cq_loop(self) -> None:
        dev = self.dev
        spin = self.ctx.options["poll_spin_us"] / 1e6
        while not self._closed:
            try:
                wcs = dev.poll(32)
                if not wcs and spin:
                    until = time.monotonic() + spin
                    while not wcs and time.monotonic() < until:
                        wcs = dev.poll(32)
                if not wcs:
                    dev.arm()
                    wcs = dev.poll(32)  # a completion that raced the arming
                    if not wcs:
                        dev.wait(1.0)
                        continue
                dev.busy()
                self._on_completions(wcs)
            except Exception:  # noqa: BLE001 - never let the reaper die
                if self._closed:
                    return
                self.log.exception("rdma: completion loop error")
                time.sleep(0.01)

    def _on_completions(self, wcs: list[tuple[int, int, int]]) -> None:
        done: list[Callable[[], None]] = []
        touched: set[int] = set()
        with self._lock:
            for wr_id, status, vendor_err in wcs:
                entry = self._wrs.pop(wr_id, None)
                if entry is None:
                    continue
                chunk, link = entry
                op = chunk.op
                st: _OpState = op.state
                link.outstanding -= 1
                self._cq_free += 1
                st.posted -= 1
                touched.add(id(link))
                if status == SUCCESS:
                    st.left -= 1
                elif status == FLUSH:
                    if link.state == "ready":
                        link.state = "draining"
                    if st.error is None and not op.aborted:
                        if link.dead or chunk.reposts >= int(self.ctx.options["max_reposts"]):
                            st.error = wc_error(status, vendor_err, op=op, info=st.info)
                            self._purge(link, op)
                        else:
                            chunk.reposts += 1
                            link.pending.appendleft(chunk)
                else:
                    if link.state == "ready":
                        link.state = "draining"  # the adapter moved the QP to ERROR
                    if st.error is None:
                        st.error = wc_error(status, vendor_err, op=op, info=st.info)
                        self.log.debug("rdma: %s", st.error)
                    self._purge(link, op)
                done += self._check_done(op)
                if link.state == "draining" and link.outstanding == 0:
                    done += self._recover_later(link)
            links = [link for link in self._links.values() if link.state == "ready" and link.pending]
        self._run(done)
        for link in links:
            self._pump(link)

    # -- finishing, abort and recovery (helpers with "_locked" semantics return actions) ----------

    def _purge(self, link: _Link, op: Operation) -> None:
        if any(c.op is op for c in link.pending):
            link.pending = collections.deque(c for c in link.pending if c.op is not op)

    def _check_done(self, op: Operation) -> list[Callable[[], None]]:
        """Under the lock: the action that finishes ``op`` if it is finished."""
        st: _OpState = op.state
        if st.finished:
            return []
        failing = st.error is not None or op.aborted
        if failing:
            if st.posted:
                return []
            link = st.link
            if (op.kind == "write" and st.ever_posted and not link.dead and link.qp is not None
                    and st.last_conn == link.conn_id):
                # Bytes already in the fabric could still be executed by the target's QP:
                # fail only once the peer has moved its QP to ERROR (see _recover).
                st.finished = True
                link.fence.append(op)
                return self._drain(link)
            st.finished = True
            err = st.error or op.abort_exc or MpcommError("aborted")
            return [lambda: op.fail(err)]
        if st.left or st.posted:
            return []
        st.finished = True
        if op.before_complete is not None:  # sends a notification: not on the completion thread
            return [lambda: self.ctx.executor.submit(op.complete, op.length)]
        return [lambda: op.complete(op.length)]

    def _drain(self, link: _Link) -> list[Callable[[], None]]:
        """Under the lock: put the link's QP into ERROR (once); recover when nothing is outstanding."""
        if link.state == "ready":
            link.state = "draining"
            try:
                link.qp.to_error()
            except Exception as exc:  # noqa: BLE001 - the work requests still complete on their own
                self.log.warning("rdma: could not move QP to ERROR: %s", exc)
        if link.state == "draining" and link.outstanding == 0:
            return self._recover_later(link)
        if link.state in ("idle", "connecting") and link.fence:
            # Nothing is connected any more: the previous QP was already retired.
            fenced, link.fence = link.fence, []
            return [lambda: self._fail_fenced(fenced)]
        return []

    def _recover_later(self, link: _Link) -> list[Callable[[], None]]:
        link.state = "recovering"
        qp, conn_id = link.qp, link.conn_id
        return [lambda: self.ctx.executor.submit(self._recover, link, qp, conn_id)]

    def _recover(self, link: _Link, qp: Any, conn_id: int) -> None:
        """Retire the drained QP on both sides, fail fenced writes, reconnect for what waits."""
        try:
            self.ctx.control(link.peer, self.name, {"op": "retire", "conn": conn_id},
                             self.ctx.config.runtime.abort_grace_ms / 1000)
        except Exception as exc:  # noqa: BLE001 - a dead peer has no QP left to write with
            self.log.debug("rdma: peer %s did not confirm retiring QP %s: %s", link.peer.address, conn_id, exc)
        try:
            qp.close()
        except Exception:  # noqa: BLE001
            pass
        with self._lock:
            fenced, link.fence = link.fence, []
            link.qp = None
            if self._closed or link.dead:
                link.state = "idle"
                reconnect = False
                victims = {c.op for c in link.pending}
                link.pending.clear()
            else:
                reconnect = bool(link.pending)
                link.state = "connecting" if reconnect else "idle"
                victims = set()
            done = []
            for op in victims:
                st: _OpState = op.state
                st.error = st.error or PeerConnectionError(f"peer {link.peer.address} is gone",
                                                           peer=link.peer.address)
                done += self._check_done(op)
        self._fail_fenced(fenced)
        self._run(done)
        if reconnect:
            self._connect(link)

    @staticmethod
    def _fail_fenced(ops: list[Operation]) -> None:
        for op in ops:
            st: _OpState = op.state
            op.fail(st.error or op.abort_exc or MpcommError("aborted"))

    @staticmethod
    def _run(actions: list[Callable[[], None]]) -> None:
        for action in actions:
            try:
                action()
            except Exception:  # noqa: BLE001
                logging.getLogger("mpcomm.transport.rdma_zerocopy").exception("rdma: finishing an operation failed")

    def abort(self, op: Operation) -> None:
        st = op.state
        if not isinstance(st, _OpState):
            return
        with self._lock:
            if st.finished:
                return
            self._purge(st.link, op)
            done = self._check_done(op)
            if not st.finished and st.posted:
                done += self._drain(st.link)
        self._run(done)

    def peer_changed(self, peer: PeerInfo) -> None:
        with self._lock:
            link = self._links.pop(peer.node_id, None)
            passives = [k for k in self._passive if k[0] == peer.node_id]
            qps = [self._passive.pop(k) for k in passives]
            done: list[Callable[[], None]] = []
            if link is not None:
                link.dead = True
                err = PeerConnectionError(f"peer {peer.address} is gone", peer=peer.address)
                for op in {c.op for c in link.pending}:
                    op.state.error = op.state.error or err
                    self._purge(link, op)
                    done += self._check_done(op)
                done += self._drain(link)
        for qp in qps:
            for step in (qp.to_error, qp.close):
                try:
                    step()
                except Exception:  # noqa: BLE001
                    pass
        self._run(done)

    # -- target side --------------------------------------------------------------------------

    def handle_control(self, peer: PeerInfo | None, body: dict[str, Any]) -> dict[str, Any]:
        kind = body.get("op")
        who = peer.node_id if peer is not None else "?"
        if kind == "connect":
            try:
                qp = self.dev.create_qp(1)  # responder only: RDMA WRITE/READ consume no work requests here
                try:
                    qp.connect(body, **self._qp_opts)
                except BaseException:
                    qp.close()
                    raise
            except MpcommError:
                raise
            except Exception as exc:
                raise TransferError(f"rdma: cannot create the passive queue pair: {exc}") from exc
            with self._lock:
                old = self._passive.pop((who, int(body["conn"])), None)
                self._passive[(who, int(body["conn"]))] = qp
            if old is not None:
                old.close()
            return dict(qp.local_info())
        if kind == "retire":
            with self._lock:
                qp = self._passive.pop((who, int(body.get("conn", -1))), None)
            if qp is not None:
                qp.to_error()  # from here the adapter drops whatever still arrives for it
                qp.close()
            return {"retired": qp is not None}
        raise ProtocolError(f"unknown rdma_zerocopy control request {kind!r}")
