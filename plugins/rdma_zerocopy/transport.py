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
not its CPU, enforces the registration's bounds and rights. A buffer no peer
can name (one passed for a single request) gets no remote right at all.
pyverbs holds the GIL through ``ibv_reg_mr``: register large regions up
front (``Engine.allocate``/``register``, eager mode), not per request.

Data path: requests are split into work requests of at most the smaller
``max_msg_sz`` of the two ports (exchanged at connect; or ``chunk``); what
waits for a QP is posted as one linked list per ``ibv_post_send``, signalling
only a request's last work request (a batch from ``post_many``: only its last
in the list). An RC send queue completes in order, so a completion also
completes every unsignaled work request posted before it on that QP; error
completions are always generated. At most ``sq_depth`` work requests per QP
and ``cq_depth`` per engine are outstanding; the rest wait in the link's
queue. Peers' connect messages are range-checked (:mod:`.checks`) before
any verbs call.

Async events (port down, address change, fatal errors) are read by the
completion thread: a fatal device or CQ error fails every request, a port
going down fails the requests on it and refuses new ones until it is back,
and a LID/GID change reconnects.

Abort: an RC QP cannot cancel a posted work request. ``abort`` moves the QP
to ERROR, so everything outstanding on it completes with
IBV_WC_WR_FLUSH_ERR; the operation fails only when its last work request has
completed (a completion, even a flush, returns the buffer to us: the local
adapter no longer touches it). For a write, bytes already in the fabric could
still be executed by the target's QP, so the transport then asks the peer to
move its QP to ERROR too (``retire``) before failing the operation; when the
target does not confirm, the failure says so (``confirmed = False``, the
fence's error as ``__cause__``): bytes may still land. Flushed
chunks of *other* operations are reposted on a new QP (RDMA WRITE/READ of the
same bytes is idempotent; their buffers stay leased). Any error completion
also puts the QP into ERROR; recovery is the same.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import itertools
import logging
import os
import resource
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from concurrent.futures import CancelledError
from typing import Any, ClassVar

from mpcomm import Availability, Capabilities, Operation, Transport, TransportContext
from mpcomm.errors import (
    EngineClosedError,
    MpcommError,
    PeerConnectionError,
    ProtocolError,
    TransferError,
    TransferTimeout,
    TransportUnavailable,
)
from mpcomm.peer import PeerInfo

from .checks import check_options, check_peer_info, device_cap, wr_bytes
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


def holds_ipc_lock() -> bool:
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
        has_ipc_lock = holds_ipc_lock()
    if has_ipc_lock or soft == resource.RLIM_INFINITY or soft >= MIN_MEMLOCK:
        return ""
    return (f"RLIMIT_MEMLOCK is {_fmt_bytes(soft)}; RDMA registration pins memory: raise it "
            "(ulimit -l unlimited; docker --ulimit memlock=-1; systemd LimitMEMLOCK=infinity)")


def device_memory_availability() -> Availability:
    """Why this transport does not move CUDA memory here (it never does yet; the reason says what is missing).

    GPUDirect RDMA registers device memory with ``ibv_reg_dmabuf_mr`` on a
    dma-buf fd that CUDA exports (``cuMemGetHandleForAddressRange``), or with
    ``ibv_reg_mr`` through the nvidia_peermem module. pyverbs, which this
    transport drives the NIC with, registers only dma-bufs it allocates
    itself (DRM), so neither path is open to it: ``cuda`` is not declared,
    and device memory between hosts goes through ucx (whose InfiniBand memory
    domain registers CUDA memory itself) or tcp's pinned staging.
    """
    if not (os.path.exists("/dev/nvidiactl") or os.path.isdir("/proc/driver/nvidia")):
        return Availability.no("no GPU: the NVIDIA driver is not loaded")
    if not (os.path.isdir("/sys/module/nvidia_peermem") or os.path.isdir("/sys/kernel/mm/memory_peers/nv_mem")
            or _has_dmabuf_mr()):
        return Availability.no("a GPU is present but neither ibv_reg_dmabuf_mr (rdma-core >= 34) nor the "
                               "nvidia_peermem module is available")
    return Availability.no("GPUDirect registration is not implemented: pyverbs cannot register a CUDA dma-buf "
                           "fd (ibv_reg_dmabuf_mr); device memory goes through ucx or tcp")


def _has_dmabuf_mr() -> bool:
    """Does this host's libibverbs export ibv_reg_dmabuf_mr (rdma-core >= 34)?"""
    import ctypes

    try:
        return hasattr(ctypes.CDLL("libibverbs.so.1"), "ibv_reg_dmabuf_mr")
    except OSError:
        return False


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
    state: str = "idle"  # idle → connecting → ready → draining → recovering → idle/connecting ; dead
    qp: Any = None
    conn_id: int = 0
    wr_bytes: int = 1 << 30  # per work request on this connection (both ports' max_msg_sz)
    outstanding: int = 0
    #: wr_ids posted on ``qp`` without a completion yet, in posting order (an RC send queue
    #: completes in order, so a completion also completes every unsignaled request before it).
    inflight: collections.deque[int] = field(default_factory=collections.deque)
    pending: collections.deque[_Chunk] = field(default_factory=collections.deque)
    fence: list[Operation] = field(default_factory=list)
    dead: bool = False


@dataclass(eq=False)
class _OpState:
    link: _Link
    left: int  # bytes not yet completed successfully
    lkey: int
    raddr: int
    rkey: int
    info: dict[str, Any]
    batch: int = 0  # id of the OperationGroup it belongs to (0: a lone request)
    laddr: int = 0  # local address of byte 0 of the request (the caller's buffer or a staging slot)
    staged: int = 0  # the staging slot it uses (0: none)
    posted: int = 0  # chunks on a QP without a completion yet
    ever_posted: bool = False
    last_conn: int = 0  # the QP (conn id) its chunks were last posted on
    error: BaseException | None = None
    finished: bool = False


def _unconfirmed(op: Operation, err: BaseException, fence_error: BaseException) -> MpcommError:
    """``err`` restated for a write whose target did not confirm retiring its QP: bytes may still land."""
    why = (f"the target did not confirm that its queue pair stopped ({fence_error}); "
           "bytes may still land in the destination range")
    peer, region = op.remote.address, op.remote.name
    out: MpcommError
    if isinstance(err, TransferTimeout):
        out = TransferTimeout(f"{err}; {why}", region=region, peer=peer)
    elif isinstance(err, CancelledError):
        out = TransferError(f"{op.kind} to {peer} was cancelled, but {why}", region=region, peer=peer)
    elif isinstance(err, MpcommError):
        try:
            out = type(err)(f"{err}; {why}", retryable=err.retryable, region=region, peer=peer)
        except TypeError:
            out = TransferError(f"{err}; {why}", region=region, peer=peer)
    else:
        out = TransferError(f"{err}; {why}", region=region, peer=peer)
    out.confirmed = False  # type: ignore[attr-defined]
    out.__cause__ = fence_error
    return out


class _Staging:
    """A slab registered once at start (local access only), cut into slots for per-request buffers.

    A buffer passed for one request would otherwise cost an ``ibv_reg_mr`` and
    an ``ibv_dereg_mr`` on the request path, both holding the GIL (pyverbs). A
    write copies the caller's bytes into a slot and posts from it; a read
    lands in a slot and is copied out before it completes. A slot is given
    back only once the request is finished, i.e. once no work request of it
    is left on a QP (the adapter no longer touches the slot).
    """

    def __init__(self, dev: Any, size: int, slot: int) -> None:
        import mmap

        self.slot = slot
        self._map = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self._buf = ctypes.c_char.from_buffer(self._map)
        self.addr = ctypes.addressof(self._buf)
        self.mr = dev.reg_mr(self.addr, size, "rw", remote=False)
        self.lkey = int(self.mr.lkey)
        self._free = [self.addr + i * slot for i in range(size // slot)]
        self._lock = threading.Lock()

    def take(self) -> int | None:
        with self._lock:
            return self._free.pop() if self._free else None

    def give(self, addr: int) -> None:
        with self._lock:
            self._free.append(addr)

    @property
    def free(self) -> int:
        return len(self._free)

    def close(self) -> None:
        try:
            self.mr.close()
        except Exception:  # noqa: BLE001
            pass
        del self._buf
        with contextlib.suppress(BufferError):
            self._map.close()


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
        revocation="key",  # ibv_dereg_mr kills the rkey before unregister returns
        bandwidth_class="high",
    )
    default_options: ClassVar[dict[str, Any]] = {
        "device": "",  # adapter name (ibv_devices); "" = the first with an ACTIVE port
        "port": 0,  # 0 = the first ACTIVE port
        "gid_index": -1,  # -1 = auto (IB: 0; RoCE: a RoCE v2 IPv4-mapped GID)
        "sq_depth": 256,  # outstanding work requests per QP
        "cq_depth": 4096,  # outstanding work requests per engine
        "chunk": 0,  # bytes per work request; 0 = both ports' max_msg_sz (capped at 1 GiB)
        "poll_spin_us": 20,  # poll before sleeping on the completion channel
        "ack_timeout": 14,  # IB local ACK timeout exponent: 4.096 us * 2**n (14 ≈ 67 ms)
        "retry_count": 7,
        "traffic_class": 0,
        "service_level": 0,
        "max_reposts": 3,  # times a flushed chunk of an innocent request is reposted
        "staging_bytes": 4 << 20,  # pre-registered slab for per-request buffers (0 = register each one)
        "staging_slot": 64 << 10,  # per-request buffers up to this size use a slot of the slab
    }
    #: Opens the adapter: ``factory(device=, port=, gid_index=, cq_depth=)``; tests substitute a double.
    device_factory: ClassVar[Callable[..., Any] | None] = None
    #: Seconds between looks at the async-event descriptor while completions keep the reaper busy.
    ASYNC_CHECK_S: ClassVar[float] = 0.1
    #: Most work requests linked into one ``ibv_post_send``.
    MAX_RUN: ClassVar[int] = 64

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
        self._staging: _Staging | None = None
        #: Why the port cannot be used right now (an async event said so), or "".
        self._down = ""
        self._fatal = ""
        #: Async events seen, by name (for tests and ``mpcomm doctor``).
        self.async_events: collections.Counter[str] = collections.Counter()

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
        skipped = f"; {'; '.join(found.skipped)}" if found.skipped else ""
        return Availability.yes(f"{found.device} port {found.port} ({found.link_layer}); "
                                f"device memory: {gpu.reason}{skipped}")

    @classmethod
    def version(cls) -> str:
        """rdma-core's version (from libibverbs' file name and the package database; no pyverbs import)."""
        from .verbs import rdma_core_version

        try:
            return rdma_core_version()
        except Exception:  # noqa: BLE001 - a version string must never break `mpcomm plugins`
            return ""

    @classmethod
    def node_checks(cls) -> list[Any]:
        """The ``rdma`` section of ``mpcomm doctor``: adapters and ports, uverbs nodes, libibverbs (no pyverbs)."""
        from .nodecheck import node_checks

        return node_checks()

    # -- lifecycle --------------------------------------------------------------------

    def start(self) -> dict[str, Any]:
        o = check_options(self.ctx.options, self.name)
        self._opts = o
        factory = self.device_factory
        if factory is None:
            from .verbs import Device

            factory = Device
        self.dev = factory(device=str(self.ctx.options["device"]), port=o["port"], gid_index=o["gid_index"],
                           cq_depth=o["cq_depth"])
        self._sq_depth = device_cap(o["sq_depth"], int(self.dev.max_qp_wr))
        self._cq_free = int(self.dev.cq_depth)
        self._local_wr_bytes = wr_bytes(o["chunk"], int(self.dev.max_msg_sz), 0)
        if o["staging_bytes"] >= o["staging_slot"]:
            try:
                self._staging = _Staging(self.dev, o["staging_bytes"] - o["staging_bytes"] % o["staging_slot"],
                                         o["staging_slot"])
            except Exception as exc:  # noqa: BLE001 - per-request buffers are then registered one by one
                self.log.warning("rdma: cannot register the staging slab (%d bytes): %s", o["staging_bytes"], exc)
        self._qp_opts = {"timeout": o["ack_timeout"], "retry_cnt": o["retry_count"], "rnr_retry": 7,
                         "traffic_class": o["traffic_class"], "service_level": o["service_level"]}
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
                link.inflight.clear()
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
        if self._staging is not None:
            self._staging.close()
        try:
            dev.close()
        except Exception:  # noqa: BLE001
            self.log.exception("rdma: closing the device failed")

    # -- registration -------------------------------------------------------------------

    def _published(self, region: Any) -> bool:
        """Can peers name ``region`` (is it in the engine's region table)?

        A buffer passed for one request is not: it gets no remote access right.
        """
        flag = getattr(region, "published", None)
        if flag is not None:
            return bool(flag)
        by_name = getattr(self.ctx.regions, "by_name", None)
        if by_name is None:
            return not str(region.name).startswith("ephemeral")
        try:
            return by_name(region.name) is region
        except Exception:  # noqa: BLE001 - UnknownRegionError: not published
            return False

    @classmethod
    def memory_kind_availability(cls) -> dict[str, Availability]:
        """``cuda`` is not declared; this says why (``mpcomm plugins``, ``doctor``)."""
        return {"cuda": device_memory_availability()}

    def register(self, region: Any) -> dict[str, Any] | None:
        """``ibv_reg_mr`` (holds the GIL for its whole duration: see docs/rdma.md, "Registration")."""
        if region.kind != "host":
            return None
        remote = self._published(region)
        if not remote and self._staging is not None and region.size <= self._staging.slot:
            return {"local_only": True, "staged": True}  # copied through the staging slab: no ibv_reg_mr
        try:
            mr = self.dev.reg_mr(region.address, region.size, region.access, remote=remote)
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
        if not remote:
            return {"local_only": True}
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
        if self._fatal or self._down:
            return Availability.no(self._fatal or self._down)
        return Availability.yes()

    def _link(self, peer: PeerInfo) -> _Link:
        link = self._links.get(peer.node_id)
        if link is None or link.dead:
            link = self._links[peer.node_id] = _Link(peer, wr_bytes=self._local_wr_bytes)
        return link

    def _prepare(self, op: Operation, batch: int) -> _OpState:
        """Check and describe one request (no lock, no verbs call except a missing registration)."""
        info = op.remote.transports.get(self.name)
        if not info or "rkey" not in info:
            raise TransportUnavailable(f"region {op.remote.name!r} is not registered with rdma_zerocopy on the peer",
                                       peer=op.remote.address, region=op.remote.name)
        mine = op.local.transport_info.get(self.name) or {}
        mr = self._mrs.get(op.local.id)
        if mr is None and mine.get("staged") and self._staging is not None:
            slot = self._staging.take()
            if slot is not None:
                if op.kind == "write":
                    ctypes.memmove(slot, op.local.address + op.local_offset, op.length)
                return _OpState(None, op.length, self._staging.lkey, int(info["addr"]) + op.remote_offset,  # type: ignore[arg-type]
                                int(info["rkey"]), dict(info), batch, laddr=slot, staged=slot)
            # every slot is busy: register this buffer after all
        if mr is None:
            got = self.register(op.local) if not mine.get("staged") else self._register_now(op.local)
            if got is None:
                raise TransportUnavailable(f"local buffer {op.local.name!r} cannot be registered for RDMA",
                                           region=op.local.name)
            op.local.transport_info[self.name] = got
            mr = self._mrs[op.local.id]
        return _OpState(None, op.length, mr.lkey, int(info["addr"]) + op.remote_offset,  # type: ignore[arg-type]
                        int(info["rkey"]), dict(info), batch, laddr=op.local.address + op.local_offset)

    def _register_now(self, region: Any) -> dict[str, Any] | None:
        """``register`` without the staging shortcut (all slots busy)."""
        staging, self._staging = self._staging, None
        try:
            return self.register(region)
        finally:
            self._staging = staging

    def _release(self, op: Operation) -> None:
        """Give back the request's staging slot (it is finished: no work request of it is on a QP)."""
        if isinstance(op.state, _OpState):
            self._release_state(op.state)

    def _release_state(self, st: _OpState) -> None:
        if st.staged and self._staging is not None:
            slot, st.staged = st.staged, 0
            self._staging.give(slot)

    def _fail(self, op: Operation, err: BaseException) -> None:
        self._release(op)
        op.fail(err)

    def _complete(self, op: Operation) -> None:
        st = op.state
        if isinstance(st, _OpState) and st.staged and op.kind == "read":
            ctypes.memmove(op.local.address + op.local_offset, st.staged, op.length)
        self._release(op)
        op.complete(op.length)

    def post(self, op: Operation) -> None:
        if op.length == 0:
            op.complete(0)
            return
        self._post_ops([op], 0)

    def post_many(self, group: Any) -> None:
        """A vectorised batch: its requests go out as linked work-request lists, each signalling its last.

        Every member keeps its own accounting (abort, fence, repost) through
        ``group.members()``, through which the group's abort reaches them
        (the engine's default does the same).
        """
        members = group.members()
        if group.abort_exc is not None:
            for op in members:
                op.fail(group.abort_exc)
            return
        live = []
        for op in members:
            if op.length == 0:
                op.complete(0)
            else:
                live.append(op)
        try:
            self._post_ops(live, id(group))
        except MpcommError as exc:
            for op in live:
                op.fail(exc)

    def _post_ops(self, ops: list[Operation], batch: int) -> None:
        if not ops:
            return
        if self._fatal:
            raise TransportUnavailable(f"rdma_zerocopy: {self._fatal}")
        if self._down:
            raise PeerConnectionError(f"rdma_zerocopy: {self._down}", retryable=True)
        states: list[_OpState] = []
        try:
            for op in ops:
                states.append(self._prepare(op, batch))
        except BaseException:
            for st in states:
                self._release_state(st)
            raise
        connect = False
        aborted = []
        with self._lock:
            if self._closed:
                for st in states:
                    self._release_state(st)
                raise MpcommError("rdma_zerocopy transport is closed")
            link = self._link(ops[0].peer)
            for op, st in zip(ops, states):
                st.link = link
                op.state = st
                if op.aborted:
                    st.finished = True
                    aborted.append(op)
                else:
                    link.pending.append(_Chunk(op, 0, op.length))
            if link.state == "idle" and link.pending:
                link.state = "connecting"
                connect = True
        for op in aborted:
            self._fail(op, op.abort_exc or MpcommError("aborted"))
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
            reply = check_peer_info(self.ctx.control(link.peer, self.name, body, timeout), self.dev.link_layer)
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
                link.wr_bytes = wr_bytes(self._opts["chunk"], int(self.dev.max_msg_sz), reply["max_msg_sz"])
        if stale:
            try:
                qp.close()
            except Exception:  # noqa: BLE001
                pass
            return
        self._pump(link)

    def _pump(self, link: _Link) -> None:
        """Post waiting chunks while the QP and the CQ have room, as linked lists signalling their last."""
        from .verbs import WorkRequest

        done: list[Callable[[], None]] = []
        with self._lock:
            while link.state == "ready" and link.pending:
                room = min(self._sq_depth - link.outstanding, self._cq_free, self.MAX_RUN)
                run: list[_Chunk] = []
                while link.pending and len(run) < room:
                    chunk = link.pending.popleft()
                    op = chunk.op
                    st: _OpState = op.state
                    if st.finished or st.error is not None or op.aborted:
                        continue
                    if chunk.length > link.wr_bytes:  # the peer's max_msg_sz can be smaller than ours
                        link.pending.appendleft(_Chunk(op, chunk.offset + link.wr_bytes,
                                                       chunk.length - link.wr_bytes, chunk.reposts))
                        chunk.length = link.wr_bytes
                    run.append(chunk)
                if not run:
                    break
                wrs = []
                for i, chunk in enumerate(run):
                    op, st = chunk.op, chunk.op.state
                    nxt = run[i + 1] if i + 1 < len(run) else None
                    # Signal a lone request's last chunk and a batch's last request in the run.
                    signaled = nxt is None or (nxt.op is not op and (st.batch == 0 or nxt.op.state.batch != st.batch))
                    wrs.append(WorkRequest(next(self._wr_ids), op.kind, st.laddr + chunk.offset, chunk.length,
                                           st.lkey, st.raddr + chunk.offset, st.rkey, signaled))
                try:
                    posted = self._post_list(link.qp, wrs)
                    failure = None
                except _PartialPost as exc:
                    posted, failure = exc.posted, exc.cause
                for chunk, wr in zip(run[:posted], wrs[:posted]):
                    st = chunk.op.state
                    self._wrs[wr.wr_id] = (chunk, link)
                    link.inflight.append(wr.wr_id)
                    link.outstanding += 1
                    self._cq_free -= 1
                    st.posted += 1
                    st.ever_posted = True
                    st.last_conn = link.conn_id
                if failure is not None:
                    # The QP is unusable: recover like an error completion (what was posted flushes).
                    for op in {c.op for c in run[posted:]}:
                        st = op.state
                        st.error = st.error or TransferError(f"rdma: ibv_post_send failed: {failure}",
                                                             peer=op.remote.address, region=op.remote.name)
                        self._purge(link, op)
                        done += self._check_done(op)
                    done += self._drain(link)
                    break
        self._run(done)  # what still waits is pumped by the next completion

    @staticmethod
    def _post_list(qp: Any, wrs: list[Any]) -> int:
        """Post ``wrs`` as one list where the QP supports it; returns how many were posted."""
        post_list = getattr(qp, "post_list", None)
        try:
            if post_list is not None:
                post_list(wrs)
            else:
                for i, wr in enumerate(wrs):
                    try:
                        qp.post(wr)
                    except Exception as exc:
                        raise _PartialPost(i, exc) from exc
        except _PartialPost:
            raise
        except Exception as exc:  # noqa: BLE001
            raise _PartialPost(int(getattr(exc, "posted", 0)), exc) from exc
        return len(wrs)

    # -- completions -------------------------------------------------------------------------

    def _cq_loop(self) -> None:
        dev = self.dev
        spin = self.ctx.options["poll_spin_us"] / 1e6
        next_async = time.monotonic() + self.ASYNC_CHECK_S
        while not self._closed:
            try:
                wcs = dev.poll(32)
                if not wcs and spin:
                    until = time.monotonic() + spin
                    while not wcs and time.monotonic() < until:
                        wcs = dev.poll(32)
                if not wcs:
                    # Polling fallback: arm() declines (an armed CQ would queue events nobody reads).
                    if dev.arm():
                        wcs = dev.poll(32)  # a completion that raced the arming
                    if not wcs:
                        if dev.wait(1.0):
                            self._on_async(dev.read_async_events())
                        continue
                dev.busy()
                self._on_completions(wcs)
                now = time.monotonic()
                if now >= next_async:  # a busy reaper never sleeps in wait(): look now and then
                    next_async = now + self.ASYNC_CHECK_S
                    events = dev.read_async_events()
                    if events:
                        self._on_async(events)
            except Exception:  # noqa: BLE001 - never let the reaper die
                if self._closed:
                    return
                self.log.exception("rdma: completion loop error")
                time.sleep(0.01)

    def _on_completions(self, wcs: list[tuple[int, int, int]]) -> None:
        done: list[Callable[[], None]] = []
        with self._lock:
            reposts: dict[int, tuple[_Link, list[_Chunk]]] = {}
            touched: dict[int, _Link] = {}
            for wr_id, status, vendor_err in wcs:
                entry = self._wrs.get(wr_id)
                if entry is None:
                    continue
                chunk, link = entry
                touched[id(link)] = link
                if wr_id not in link.inflight:  # cannot happen on RC; count it alone rather than lose it
                    del self._wrs[wr_id]
                    self._completed(chunk, link, status, vendor_err, done, reposts)
                    continue
                # Everything posted on this QP before wr_id completed too (unsignaled, so silently).
                while link.inflight:
                    w = link.inflight.popleft()
                    got = self._wrs.pop(w, None)
                    if got is None:
                        continue
                    last = w == wr_id
                    self._completed(got[0], link, status if last else SUCCESS, vendor_err, done, reposts)
                    if last:
                        break
            for link, chunks in reposts.values():
                link.pending.extendleft(reversed(chunks))  # in their original order, ahead of newer work
            for link in touched.values():
                if link.state == "draining" and link.outstanding == 0:
                    done += self._recover_later(link)
            links = [link for link in self._links.values() if link.state == "ready" and link.pending]
        self._run(done)
        for link in links:
            self._pump(link)

    def _completed(self, chunk: _Chunk, link: _Link, status: int, vendor_err: int,
                   done: list[Callable[[], None]], reposts: dict[int, tuple[_Link, list[_Chunk]]]) -> None:
        """Under the lock: one work request finished with ``status``."""
        op = chunk.op
        st: _OpState = op.state
        link.outstanding -= 1
        self._cq_free += 1
        st.posted -= 1
        if status == SUCCESS:
            st.left -= chunk.length
        elif status == FLUSH:
            if link.state == "ready":
                link.state = "draining"
            if st.error is None and not op.aborted:
                if link.dead or chunk.reposts >= self._opts["max_reposts"]:
                    st.error = wc_error(status, vendor_err, op=op, info=st.info)
                    self._purge(link, op)
                else:
                    chunk.reposts += 1
                    reposts.setdefault(id(link), (link, []))[1].append(chunk)
        else:
            if link.state == "ready":
                link.state = "draining"  # the adapter moved the QP to ERROR
            if st.error is None:
                st.error = wc_error(status, vendor_err, op=op, info=st.info)
                self.log.debug("rdma: %s", st.error)
            self._purge(link, op)
        done += self._check_done(op)

    # -- async events ---------------------------------------------------------------------------

    def _on_async(self, events: list[str]) -> None:
        """Act on the adapter's async events: fail what they doom, reconnect what they stale."""
        if not events:
            return
        self.async_events.update(events)
        kinds = set(events)
        fatal = kinds & {"IBV_EVENT_DEVICE_FATAL", "IBV_EVENT_CQ_ERR"}
        if fatal:
            why = ("the adapter reported a fatal error (IBV_EVENT_DEVICE_FATAL)" if "IBV_EVENT_DEVICE_FATAL" in fatal
                   else "the completion queue overflowed (IBV_EVENT_CQ_ERR)")
            self.log.error("rdma: %s: failing every request; this engine cannot use %s again", why, self.dev.name)
            self._fatal = why
            self._fail_everything(TransferError(f"rdma: {why}", retryable=True), forget_posted=True)
            return
        if "IBV_EVENT_PORT_ERR" in kinds:
            try:
                active = bool(self.dev.port_active())
            except Exception:  # noqa: BLE001
                active = False
            if not active:
                self._down = f"port {self.dev.port} of {self.dev.name} is down (IBV_EVENT_PORT_ERR)"
                self.log.warning("rdma: %s: failing the requests on it", self._down)
                self._fail_everything(PeerConnectionError(f"rdma: {self._down}", retryable=True))
        if "IBV_EVENT_PORT_ACTIVE" in kinds and self._down:
            self.log.info("rdma: port %s of %s is active again", self.dev.port, self.dev.name)
            self._down = ""
        if kinds & {"IBV_EVENT_GID_CHANGE", "IBV_EVENT_LID_CHANGE", "IBV_EVENT_CLIENT_REREGISTER",
                    "IBV_EVENT_SM_CHANGE", "IBV_EVENT_PKEY_CHANGE"}:
            try:
                changed = bool(self.dev.refresh_addresses())
            except Exception as exc:  # noqa: BLE001
                self.log.warning("rdma: cannot re-read the port's addresses: %s", exc)
                changed = True
            if changed:
                # Queue pairs built on the old address are moved to ERROR; their requests are
                # reposted on new ones (RDMA WRITE/READ of the same leased bytes is idempotent).
                self.log.warning("rdma: the port's LID/GID changed (%s): reconnecting", ", ".join(sorted(kinds)))
                with self._lock:
                    done = [a for link in list(self._links.values()) for a in self._drain(link)]
                self._run(done)
        qp_errors = kinds & {"IBV_EVENT_QP_FATAL", "IBV_EVENT_QP_REQ_ERR", "IBV_EVENT_QP_ACCESS_ERR",
                             "IBV_EVENT_PATH_MIG_ERR"}
        if qp_errors:
            # pyverbs does not say which QP: its requests flush through the CQ and are handled there.
            self.log.warning("rdma: queue pair error event(s) %s", ", ".join(sorted(qp_errors)))

    def _fail_everything(self, err: MpcommError, forget_posted: bool = False) -> None:
        """Fail every request on every link.

        Waiting requests fail now. Posted ones fail once their QP has flushed
        (and, for writes, the target retired its QP) — or at once with
        ``forget_posted``: after a fatal device error no completion may ever
        come, and the adapter no longer moves data.
        """
        done: list[Callable[[], None]] = []
        dead_qps = []
        with self._lock:
            for link in list(self._links.values()):
                waiting = {c.op for c in link.pending}
                link.pending.clear()
                posted = {self._wrs[w][0].op for w in link.inflight if w in self._wrs}
                for op in waiting | posted:
                    op.state.error = op.state.error or err
                if not forget_posted:
                    for op in waiting:
                        done += self._check_done(op)
                    done += self._drain(link)
                    continue
                for w in link.inflight:
                    if self._wrs.pop(w, None) is not None:
                        self._cq_free += 1
                link.inflight.clear()
                link.outstanding = 0
                link.dead = True
                if link.qp is not None:
                    dead_qps.append(link.qp)
                    link.qp = None
                for op in waiting | posted | set(link.fence):
                    st: _OpState = op.state
                    st.posted = 0
                    st.finished = True
                    # Its staging slot (if any) is not given back: the dead adapter's DMA state is unknown.
                    done.append(lambda op=op, e=st.error or err: op.fail(e))
                link.fence = []
            if forget_posted:
                self._links.clear()
        for qp in dead_qps:
            for step in (qp.to_error, qp.close):
                try:
                    step()
                except Exception:  # noqa: BLE001
                    pass
        self._run(done)

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
            return [lambda: self._fail(op, err)]
        if st.left > 0 or st.posted:
            return []
        st.finished = True
        if getattr(op, "before_complete", None) is not None:  # first contract: sends a notification
            return [lambda: self.ctx.executor.submit(self._complete, op)]
        return [lambda: self._complete(op)]

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

    def _retire_timeout(self, link: _Link) -> float:
        """How long to wait for the target: the abort grace, but not past the engine's own give-up time."""
        grace = self.ctx.config.runtime.abort_grace_ms / 1000
        now = time.monotonic()
        ends = [op.deadline + grace - now for op in link.fence if op.aborted and op.deadline]
        return max(0.05, min([grace, *[e - 0.05 for e in ends]]))

    def _recover(self, link: _Link, qp: Any, conn_id: int) -> None:
        """Retire the drained QP on both sides, fail fenced writes, reconnect for what waits."""
        fence_error: BaseException | None = None
        if not (self._closed or link.dead):
            try:
                self.ctx.control(link.peer, self.name, {"op": "retire", "conn": conn_id}, self._retire_timeout(link))
            except Exception as exc:  # noqa: BLE001 - reported with the fenced writes
                fence_error = exc
                self.log.warning("rdma: peer %s did not confirm retiring QP %s: %s", link.peer.address, conn_id, exc)
        try:
            qp.close()
        except Exception:  # noqa: BLE001
            pass
        with self._lock:
            fenced, link.fence = link.fence, []
            link.qp = None
            link.inflight.clear()
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
        self._fail_fenced(fenced, fence_error)
        self._run(done)
        if reconnect:
            self._connect(link)

    def _fail_fenced(self, ops: list[Operation], fence_error: BaseException | None = None) -> None:
        """Fail writes held back by the fence; unconfirmed (bytes may land) when the fence failed."""
        for op in ops:
            st: _OpState = op.state
            err = op.abort_exc or st.error or MpcommError("aborted")
            if fence_error is not None:
                err = _unconfirmed(op, err, fence_error)
                if op.abort_exc is not None:
                    op.abort_exc = err  # Operation.fail reports the abort reason: make it this one
            self._fail(op, err)

    @staticmethod
    def _run(actions: list[Callable[[], None]]) -> None:
        for action in actions:
            try:
                action()
            except Exception:  # noqa: BLE001
                logging.getLogger("mpcomm.transport.rdma_zerocopy").exception("rdma: finishing an operation failed")

    def abort(self, op: Any) -> None:
        st = op.state
        if not isinstance(st, _OpState):
            return  # a group before post_many gave it members, or a request not posted here
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
            remote = check_peer_info(body, self.dev.link_layer)  # untrusted: checked before any verbs call
            if "conn" not in remote:
                raise ProtocolError("rdma connect: conn is missing")
            try:
                qp = self.dev.create_qp(1)  # responder only: RDMA WRITE/READ consume no work requests here
                try:
                    qp.connect(remote, **self._qp_opts)
                except BaseException:
                    qp.close()
                    raise
            except MpcommError:
                raise
            except Exception as exc:
                raise TransferError(f"rdma: cannot create the passive queue pair: {exc}") from exc
            with self._lock:
                old = self._passive.pop((who, remote["conn"]), None)
                self._passive[(who, remote["conn"])] = qp
            if old is not None:
                old.close()
            return dict(qp.local_info())
        if kind == "retire":
            conn = body.get("conn", -1)
            with self._lock:
                qp = self._passive.pop((who, conn if isinstance(conn, int) else -1), None)
            if qp is not None:
                qp.to_error()  # from here the adapter drops whatever still arrives for it
                qp.close()
            return {"retired": qp is not None}
        raise ProtocolError(f"unknown rdma_zerocopy control request {kind!r}")


class _PartialPost(Exception):
    """``ibv_post_send`` of a list stopped at index ``posted`` (the ones before it are on the QP)."""

    def __init__(self, posted: int, cause: BaseException) -> None:
        super().__init__(str(cause))
        self.posted = posted
        self.cause = cause
