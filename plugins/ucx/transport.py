"""The ucx transport: one-sided puts and gets through UCX's UCP API.

The native calls live in :mod:`mpcomm.plugins.ucx._ucp` (a ctypes binding to
the libucp that the ``libucx`` wheel ships; ``ucxx``'s Python layer does not
wrap RMA). Nothing here loads UCX before :meth:`UcxTransport.availability` or
:meth:`UcxTransport.start` runs. docs/ucx.md is the user-facing description;
this docstring records why the code is shaped as it is.

Defaults. Peer error handling is on (a dead peer is an error, not a crash)
and ``RNDV_THRESH`` is ``inf`` unless ``UCX_RNDV_THRESH`` is set: UCX asks,
with error handling on and rendezvous enabled, for memory domains that can
invalidate remote access (only InfiniBand can), which drops cma and leaves
tcp with RMA emulated in software. This transport uses no rendezvous (no
tag or AM API), so with the threshold at ``inf`` UCX wires up cma for RMA on
one host (zero-copy, ``process_vm_writev``), tcp for wire-up and keepalive,
and tcp (or verbs where built) between hosts.

Access. The descriptor carries only the base, size and access the target
registered. The packed rkey is handed out only over the authenticated
control channel: the first request to a region *attaches* (a control
request carrying the descriptor's token and epoch, sent from a connector
thread, never from ``post``); the target checks the token against its own
table, refuses an attach whose ``access`` asks for a right the region does
not grant (no rkey leaves for writing a read-only region), records who
attached and answers with the rkey, base, size and access from its own
registration. The initiator refuses a descriptor whose fields do not match
that answer and checks every request against it. On cma and tcp that check
is all there is: the same rkey serves puts and gets and neither transport
checks its rights, and UCX's tcp interface listens for anyone
(docs/security.md, "Read-only regions" and "ucx: UCX's own listener").

Revocation (``Capabilities.revocation = "fence"``). On ``unregister`` the
target marks the region closed (no new attach), then asks every initiator
that attached to revoke it; the initiator stops issuing into the region,
waits until every put/get it issued there completed and was flushed,
destroys the rkey and answers. Only then is the memory handle unmapped and
``unregister`` returns. If an initiator does not answer within
``revoke_timeout`` (hung, but alive), the mapping and the buffer are kept
alive (quarantined), so a late access lands in allocated memory, never in
freed pages. Against a peer that does not cooperate nothing here (nor UCX on
cma, sysv/posix or tcp) can stop it: see docs/ucx.md.

Progress. The worker's progress runs in a native loop (``_ucxloop.c``,
``mpcomm_ucx_loop_run``: a thread parked in one ctypes call, the GIL released):
progress while it does work, then ``ucp_worker_arm`` + ``poll`` on the event
fd. Over tcp UCX emulates RMA with active messages the *target* must
progress; the loop does that however busy the interpreter is. A Python
thread steps this process's own requests (chunks, flushes, fences, the abort
grace, its only timer) and reports them; it sleeps on an eventfd the loop
writes only while there are requests of ours that no ``result()`` waiter
drives (``want``) and it asked (``ask``, set before it checks statuses), so a
pure target never wakes it. ``drive`` lets a ``result()`` waiter step and
report its own request with the GIL released: the first waiter polls the worker
itself while the loop thread parks, the others wait on the loop's event futex.
Without the helper the Python thread progresses the worker itself
(``_progress_loop``: arm + ``select``, ``spin_us`` of polling). Requests up to ``inline_threshold`` bytes are
issued on the posting thread (cma copies are synchronous and need nothing
from the target); what is not done right after issuing is left to the
progress side. Why the revocation answer stays in Python: docs/ucx.md.

Paths (docs/ucx.md, "Paths"). The general path: ``post``/``post_many`` → ``_post`` →
``_start`` → ``_issue`` (chunks of a request; a group's N puts/gets as one unit,
``Endpoint.rma_group``: the compiled piece loop, or Python) → the endpoint flush → ``_step``
or ``drive``. The fast path: one native entry, a bound lane's ``move`` (``_lane``;
``mp_move`` in ``_ucxloop.c``), for one request or a group, reached from the engine's bound
move (``inline_path``) and from ``post``/``post_many`` (``_fast``). On both, a group's
requests are released at once and one endpoint flush reports them all; an index UCX refuses
at once (or outside its region) fails alone, a failed flush fails every index.

Wake-ups. Completions are seen only by whoever calls ``ucp_worker_progress``: a
posting thread that progressed while work was handed off signals the progress
thread, and ``Worker.arm`` reports work its progress call did instead of sleeping.

Abort (timeout, cancel, peer lost, revocation). ``ucp_request_cancel`` does
nothing to RMA requests, so an abort is a fence: stop issuing, wait for what
was issued, flush the endpoint, then fail. A stalled target over tcp cannot
be fenced; after the engine's abort grace the endpoint is force-closed and
the other requests on it start over on a fresh endpoint.
"""

from __future__ import annotations

import logging
import operator
import os
import select
import threading
import time
from collections import OrderedDict
from typing import TYPE_CHECKING, Any, ClassVar

from mpcomm import Availability, Capabilities, Transport, TransportContext
from mpcomm.errors import (
    EngineClosedError,
    MpcommError,
    OutOfBoundsError,
    PeerConnectionError,
    PermissionDeniedError,
    ProtocolError,
    TransferError,
    TransferTimeout,
    TransportUnavailable,
    UnknownRegionError,
)
from mpcomm.peer import PeerInfo

from . import _native

if TYPE_CHECKING:
    from mpcomm import Region

    from . import _ucp

INSTALL_HINT = "pip install 'mpcomm[ucx]'"
MAX_ATTACHED = 1024  # idle attachments (unpacked rkeys) kept per peer endpoint

_PEER_GONE = {-25, -80, -6, -24, -3}  # CONNECTION_RESET, ENDPOINT_TIMEOUT, UNREACHABLE, NOT_CONNECTED, IO_ERROR

#: UCT transports whose put/get is a copy this process makes itself (a system call or a
#: mapping), finished inside progress without any step of the peer's.
_LOCAL_COPY_TLS = frozenset({"cma", "knem", "xpmem"})


def _rma_is_local_copy(lanes: str) -> bool:
    """True when every RMA lane in ``ucp_ep_print_info`` text is a local copy (cma, knem, xpmem).

    Without an RMA lane UCX emulates RMA over active messages (the peer's
    progress answers), so that is False too, as is any text this does not read.
    """
    tls = []
    for line in lanes.splitlines():
        if "lane[" not in line or " rma" not in line:
            continue
        try:
            tl = line.split("]:", 1)[1].split()[0].split(":", 1)[1].split("/", 1)[0]
        except IndexError:
            return False
        tls.append(tl)
    return bool(tls) and all(tl in _LOCAL_COPY_TLS for tl in tls)


def _ucp_module() -> Any:
    from . import _ucp

    return _ucp


def _wanted_access(body: dict[str, Any], granted: str) -> str:
    """The rights an attach asks for (``access``: "r", "w" or "rw"; absent: the region's first right)."""
    want = body.get("access", granted[:1])
    if not isinstance(want, str) or not want or len(want) > 2 or set(want) - {"r", "w"}:
        raise ProtocolError("ucx attach: access must be 'r', 'w' or 'rw'")
    return want


def _error(kind: type[MpcommError], text: str, remote: Any) -> MpcommError:
    return kind(text, peer=getattr(remote, "address", None), region=getattr(remote, "name", None))


def _fresh(exc: BaseException) -> BaseException:
    """A new instance of a shared error (one per request: each gets its own traceback)."""
    if isinstance(exc, MpcommError):
        try:
            return type(exc)(str(exc), region=exc.region, peer=exc.peer)
        except TypeError:
            return exc
    return exc


def map_status(status: int, remote: Any, kind: str, where: str) -> MpcommError:
    """A UCX status of a failed request as an mpcomm error."""
    ucp = _ucp_module()
    text = f"ucx {kind} to {remote.address}: {where}: {ucp.status_string(status)} (ucs_status {status})"
    if status in _PEER_GONE or status == ucp.UCS_ERR_CANCELED:
        return _error(PeerConnectionError, text, remote)
    if status == ucp.UCS_ERR_TIMED_OUT:
        return _error(TransferTimeout, text, remote)
    if status == ucp.UCS_ERR_OUT_OF_RANGE:
        return _error(OutOfBoundsError, text, remote)
    return _error(TransferError, text, remote)


class _Remote:
    """Names a peer in an error raised before any request is involved."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.name = None


class _Peer:
    """The endpoint to one peer worker and this initiator's attachments to its regions."""

    def __init__(self, key: tuple[str, str], address: bytes, name: str) -> None:
        self.key = key
        self.address = address
        self.name = name
        self.ep: _ucp.Endpoint | None = None
        self.generation = 0
        self.failed: int | None = None  # UCX status from the error callback
        self.works: set[_Work] = set()
        self.attached: OrderedDict[tuple[int, str, int], _Attach] = OrderedDict()
        self.connecting: list[_Attach] = []  # attaches queued for the connector thread
        self.connector: threading.Thread | None = None
        #: (generation, whether its RMA lanes are local copies): may reads take the inline lane.
        self.local_rma: tuple[int, bool] = (-1, False)
        #: The current endpoint's gate for bound lanes (_native.gate); shut before it is closed.
        self.gate: Any = None


class _Attach:
    """Initiator side: one remote region as the target described it over the control channel."""

    __slots__ = ("key", "peer", "info", "state", "error", "rkey_hex", "rkey", "generation", "base", "size",
                 "access", "waiting", "works", "ok_remote", "orphans", "gate", "lanes")

    def __init__(self, key: tuple[int, str, int], peer: _Peer, info: PeerInfo) -> None:
        self.key = key  # (region_id, epoch, token)
        self.peer = peer
        self.info = info  # the target's PeerInfo, for the control request
        self.state = "pending"  # -> "ready" | "revoked"
        self.error: MpcommError | None = None
        self.rkey_hex = ""
        self.rkey: Any = None
        self.generation = -1
        self.base = self.size = 0
        self.access = ""
        self.waiting: list[_Work] = []  # posted before the attach finished
        self.works: set[_Work] = set()  # issuing or in flight
        self.ok_remote: Any = None  # the last RemoteRegion object found to match the target's answer
        #: Requests the inline lane issued and left in flight when it declined (the full path redoes
        #: the write; its flush covers these). A revocation waits for them as for ``works``.
        self.orphans: list[Any] = []
        #: The gate of the bound lanes made while it is usable as it is (shut on any change).
        self.gate: Any = None
        #: (write, local region id, local address, size) -> (endpoint gate, attachment gate, lane):
        #: the fast path's bound lanes (bounded), ``lane`` as :meth:`UcxTransport._lane` returns it.
        self.lanes: dict[tuple[bool, int, int, int], tuple[Any, Any, Any]] = {}


class _Work:
    """One Operation or one OperationGroup on its way through UCX."""

    __slots__ = ("op", "group", "kind", "att", "peer", "items", "count", "lengths", "next", "reqs", "inflight",
                 "flush", "flushed", "error", "failed", "fatal", "stop", "abort_at", "fenced", "restart", "memh",
                 "generation", "driven")

    def __init__(self, op: Any, group: bool, att: _Attach, memh: Any) -> None:
        self.op = op
        self.group = group
        self.kind = op.kind
        self.att = att
        self.peer = att.peer
        self.memh = memh
        # items: (local address, remote offset, length, index), issued in order
        self.items: list[tuple[int, int, int, int]] = []
        self.count = 1
        self.next = 0  # next item to issue
        self.reqs: list[tuple[Any, int, int]] = []  # (request, bytes, index)
        self.inflight = 0
        self.flush: Any = None
        self.flushed = False
        self.error: int | None = None  # first failed status (single op)
        self.failed: dict[int, MpcommError] = {}  # group: index -> why
        self.fatal: MpcommError | None = None  # fail with this once drained (peer dead, revoked)
        self.stop = False  # stop issuing (revoked)
        self.abort_at: float | None = None
        self.fenced = False
        self.restart = False
        self.generation = -1
        self.driven = False  # a result() waiter steps it (drive): the Python thread need not be woken for it

    @property
    def outstanding(self) -> bool:
        return bool(self.reqs) or self.flush is not None

    @property
    def issued_all(self) -> bool:
        return self.next >= len(self.items)

    @property
    def remote(self) -> Any:
        return self.op.remote


#: UcxTransport.device_memory(), once known (memory_kind_availability).
_DEVICE_MEMORY: list[Availability] = []


class UcxTransport(Transport):
    """One-sided RMA over UCX (cma and shared memory on one host, tcp or InfiniBand between hosts)."""

    name: ClassVar[str] = "ucx"
    capabilities: ClassVar[Capabilities] = Capabilities(
        memory_kinds=frozenset({"host", "cuda"}),  # cuda: where UCX has cuda_copy/cuda_ipc and a GPU
        intra_node=True,
        inter_node=True,
        one_sided=True,
        zero_copy=True,
        inflight_cancel=True,
        modes=frozenset({"zero-copy"}),
        # Initiators are told over the control channel and confirm before unregister returns; UCX's
        # software transports do not check rkeys, so nothing stronger holds (docs/ucx.md, Revocation).
        revocation="fence",
        bandwidth_class="medium",
    )
    default_options: ClassVar[dict[str, Any]] = {
        "error_handling": True,  # peer error handling: a dead peer is an error (see docs/ucx.md)
        "tls": "",  # UCX_TLS for this engine's context; "" keeps the environment's / UCX's choice
        "chunk": 4 << 20,  # bytes per put/get of a large request (an abort stops between chunks)
        "window": 64 << 20,  # outstanding bytes per request
        "inline_threshold": 4 << 20,  # requests up to this size are issued on the posting thread
        "spin_us": 50,  # without the native loop: the Python progress thread polls this long before sleeping
        # The native progress loop and a result() waiter busy-wait this long after the last event
        # before they sleep (0: at once). On shared or oversubscribed CPUs a busy wait takes the CPU
        # the peer's answer needs (4 KiB over tcp here: 80 us p50 at 0, 360-480 us at 50).
        "native_spin_us": 0,
        # A request handed off in flight is left this long to a result() waiter that claims it (drive)
        # before the native loop wakes the Python thread for its answer: an answer that beats its
        # caller to result() is then reported on the caller's thread. Callback-only users pay at most
        # this per wake-up (0: the Python thread is woken at once). As tcp's HANDOFF.
        "claim_us": 1000,
        # A result() waiter polls the worker itself and the native loop parks meanwhile, and this long
        # after the last waiter left (one wake-up less per request). Meanwhile a peer's request, or one
        # of ours nobody waits for, waits at most this long (0: never parks; waiters wait on the loop).
        "park_us": 250,
        "revoke_timeout": 2.0,  # seconds a target waits for an initiator to confirm a revocation
        "attach_timeout": 10.0,  # upper bound of an attach round trip (the request's deadline is shorter)
    }

    def __init__(self, ctx: TransportContext) -> None:
        super().__init__(ctx)
        o = ctx.options
        self.error_handling = bool(o["error_handling"])
        self._chunk = max(4096, int(o["chunk"]))
        self._window = max(self._chunk, int(o["window"]))
        self._inline_threshold = int(o["inline_threshold"])
        self._spin = int(o["spin_us"]) / 1e6
        self._native_spin = max(0, int(o["native_spin_us"])) / 1e6
        self._claim = max(0, int(o["claim_us"])) / 1e6
        self._park = max(0, int(o["park_us"])) / 1e6
        self._revoke_timeout = float(o["revoke_timeout"])
        self._attach_timeout = float(o["attach_timeout"])
        self._abort_grace = ctx.config.runtime.abort_grace_ms / 1000
        self.log = ctx.log
        self._lock = threading.RLock()
        self._drained = threading.Condition(self._lock)
        self._ucp: Any = None
        self._context: _ucp.Context | None = None
        self._worker: _ucp.Worker | None = None
        # target side: region id -> [region, memh, packed rkey hex, {node_id: PeerInfo}, closed]
        self._served: dict[int, list[Any]] = {}
        self._memh: dict[int, Any] = {}  # local region id -> memh (local side of puts/gets)
        self._quarantine: list[Any] = []  # (memh, view) kept alive after an unconfirmed revocation
        self._gone: set[str] = set()  # node ids reported dead while something was quarantined
        self._peers: dict[tuple[str, str], _Peer] = {}
        self._by_info: dict[int, tuple[PeerInfo, _Peer]] = {}  # id(op.peer) -> (that PeerInfo, its peer)
        self._active: set[_Work] = set()
        self._by_op: dict[int, _Work] = {}  # id(op) -> its _Work while active (drive() finds it; no op -> _Work cycle)
        self._driven = 0  # how many of _active a result() waiter drives
        self._orphaned: set[_Attach] = set()  # attachments with inline-lane requests still in flight
        # Guards att.orphans and _orphaned: bound lanes register what they leave in flight
        # without the transport lock, which a closer may hold while it waits for them.
        self._orphan_lock = threading.Lock()
        self._waits: list[tuple[Any, threading.Event]] = []  # connector threads waiting for a wire-up flush
        self._thread: threading.Thread | None = None
        self._loop: Any = None  # the native progress loop (_native.ProgressLoop), None without the helper
        self._closing = False
        self._closed = False
        self.wakeups = 0  # Python-thread sleeps that ended (observability; tests check it stays event-driven)
        self.waiter_reports = 0  # requests a result() waiter reported itself (drive; observability)
        self.hot_groups = 0  # groups post_many moved on the fast path (one lane call; observability)

    # -- availability ---------------------------------------------------------

    @classmethod
    def availability(cls) -> Availability:
        try:
            ucp = _ucp_module()
            ucp.load()
        except ImportError as exc:
            return Availability.no(f"ucxx/libucx is not installed ({INSTALL_HINT}): {exc}")
        except Exception as exc:  # noqa: BLE001 - UcxUnavailable, OSError: a reason, never a crash
            text = str(exc)
            if "not installed" in text:
                return Availability.no(f"ucxx/libucx is not installed ({INSTALL_HINT})")
            return Availability.no(f"UCX cannot be loaded: {text}")
        maj, mnr, rel = ucp.version()
        return Availability.yes(f"UCX {maj}.{mnr}.{rel}")

    @classmethod
    def version(cls) -> str:
        try:
            return ".".join(map(str, _ucp_module().version()))
        except Exception:  # noqa: BLE001
            return ""

    @classmethod
    def device_memory(cls) -> Availability:
        """Whether CUDA device buffers could go through UCX here (and why not).

        Where it says no, ``cuda`` is dropped from the capabilities the
        router uses (:meth:`memory_kind_availability`).
        """
        try:
            reason = _ucp_module().cuda_unavailable_reason()
        except Exception as exc:  # noqa: BLE001
            reason = str(exc)
        if reason is not None:
            return Availability.no(f"unavailable: {reason}")
        return Availability.yes("UCX has CUDA (cuda_copy, cuda_ipc) and a GPU is visible")

    @classmethod
    def memory_kind_availability(cls) -> dict[str, Availability]:
        # Asked whenever a device region is registered: probe the driver once per process.
        if not _DEVICE_MEMORY:
            _DEVICE_MEMORY.append(cls.device_memory())
        return {"cuda": _DEVICE_MEMORY[0]}

    # -- lifecycle --------------------------------------------------------------

    def context_settings(self) -> dict[str, str]:
        """UCX settings this engine's context gets on top of the environment (see the module docstring)."""
        env: dict[str, str] = {}
        tls = str(self.ctx.options["tls"])
        if tls:
            env["TLS"] = tls
        if "UCX_RNDV_THRESH" not in os.environ:
            env["RNDV_THRESH"] = "inf"
        if "UCX_USE_MT_MUTEX" not in os.environ:
            # The worker's lock is taken by the native progress loop and by every issuing thread.
            # UCX's default spinlock, held by a thread the kernel preempted, makes the others
            # spin out their time slices: 4 KiB over tcp here had p90 3.5 ms, p99 10-16 ms with
            # it, and 113 us / 180 us with a mutex (p50 83 -> 68 us).
            env["USE_MT_MUTEX"] = "y"
        if "UCX_ADAPTIVE_PROGRESS" not in os.environ and _native.load() is not None:
            # UCX polls only "active" interfaces in progress; an inactive one's events go to UCX's
            # async thread, which signals the worker. A target's tcp interface is never activated:
            # it gets no UCP message, only UCT's own put requests, which UCP does not count. So each
            # write to an idle target cost two wake-ups in a row: the async thread, then the native
            # loop (the Python thread, which polls after each event, hid it). With every interface
            # polled, the loop's poll wakes for the write itself.
            env["ADAPTIVE_PROGRESS"] = "n"
        return env

    def start(self) -> dict[str, Any]:
        ucp = self._ucp = _ucp_module()
        self._context = ucp.Context(env=self.context_settings())
        try:
            self._worker = self._context.create_worker(ucp.THREAD_MULTI)
            address = self._worker.address.hex()
            self._worker.fileno()
        except BaseException:
            self._context.close()
            raise
        # The worker's progress runs natively where the helper is built: nobody's GIL is needed for
        # a peer's emulated put/get (tcp) to be served. Python's thread then only steps this
        # process's own requests. Without the helper, the Python thread progresses (as before).
        self._loop = self._worker.progress_loop(self._native_spin, self._claim, self._park)
        if self._loop is not None:
            self._loop.start()
        self._thread = threading.Thread(target=self._progress_loop if self._loop is None else self._bookkeeping_loop,
                                        name="mpcomm-ucx-progress", daemon=True)
        self._thread.start()
        maj, mnr, rel = ucp.version()
        return {"worker": address, "error_handling": self.error_handling, "version": f"{maj}.{mnr}.{rel}"}

    def close(self) -> None:
        if self._closed:
            return
        self._closing = True
        # Wake the progress thread before _closed is set: _signal() does nothing after that
        # (the worker may be gone), and the thread would sleep out its join timeout.
        self._signal()
        self._closed = True
        if self._loop is not None:
            # Drivers were kicked: none may still be checking a request natively when they are freed below.
            end = time.monotonic() + 2.0
            while self._loop.waiting() and time.monotonic() < end:
                time.sleep(0.001)
        with self._lock:
            for p in self._peers.values():
                self._shut_lanes(p)
        if self._thread is not None:
            self._thread.join(5.0)
        if self._loop is not None:
            # Stopped and joined before any endpoint is closed or the worker destroyed; from here
            # on this thread progresses the closes itself.
            if not self._loop.stop(5.0):
                self.log.error("ucx: the native progress loop did not stop")
            self._loop.close()
        with self._lock:
            works = list(self._active)
            self._active.clear()
            self._by_op.clear()
            peers = list(self._peers.values())
            self._peers.clear()
            for p in peers:
                for att in p.attached.values():
                    works.extend(att.waiting)
                    att.waiting = []
                    works.extend(att.works)
            self._drained.notify_all()
        err = EngineClosedError("the ucx transport was closed")
        for w in set(works):
            self._release_requests(w)
        with self._lock, self._orphan_lock:
            for att in self._orphaned:
                for r in att.orphans:
                    r.free()  # UCX reclaims a request freed before it completes
                att.orphans = []
            self._orphaned.clear()
        for peer in peers:
            # The progress thread is gone: progress the closes here, or UCX tears down a worker
            # whose endpoints still have queued operations (an assertion that aborts the process).
            self._force_close(peer, timeout=2.0)
        for w in set(works):
            self._release_requests(w)
            self._report_fail(w, err)
        try:
            if self._context is not None:
                self._context.close()  # workers, their endpoints, then every memory mapping
        except Exception:  # noqa: BLE001 - close must not raise
            self.log.exception("ucx: context cleanup failed")
        self._memh.clear()
        self._served.clear()

    # -- memory (target side and local side) ---------------------------------------

    def register(self, region: Region) -> dict[str, Any] | None:
        if region.kind not in ("host", "cuda") or self._context is None:
            return None
        ucp = self._ucp
        prot = ucp.PROT_LOCAL_READ | ucp.PROT_LOCAL_WRITE | ucp.PROT_REMOTE_READ
        if "w" in region.access:
            prot |= ucp.PROT_REMOTE_WRITE
        try:
            # Exactly the registered range, with the registered rights (enforced by hardware
            # transports; cma/tcp/shm ignore the remote bits: see docs/ucx.md).
            memh = self._context.mem_map(region.address, region.size, prot,
                                         ucp.MEMORY_TYPE_CUDA if region.kind == "cuda" else None)
            rkey = memh.pack_rkey().hex()
        except Exception as exc:  # noqa: BLE001 - the region is simply not served by ucx
            self.log.warning("ucx: cannot map region %s: %s", region.name, exc)
            return None
        with self._lock:
            old = self._served.pop(region.id, None)
            self._served[region.id] = [region, memh, rkey, {}, False]
            self._memh[region.id] = memh
        if old is not None:
            self._retire(old)
        # No rkey here: it travels only over the authenticated control channel (attach).
        return {"base": region.address, "size": region.size, "access": region.access}

    def unregister(self, region: Region) -> None:
        with self._lock:
            served = self._served.pop(region.id, None)
            self._memh.pop(region.id, None)
            # Lanes bound to its memh go too (ids are never reused; this frees what they hold).
            for p in self._peers.values():
                for a in p.attached.values():
                    for k in [k for k in a.lanes if k[1] == region.id]:
                        del a.lanes[k]
        if served is not None:
            self._retire(served)

    def _retire(self, served: list[Any]) -> None:
        """Revoke a served region at every initiator that attached, then unmap it."""
        region, memh = served[0], served[1]
        with self._lock:
            served[4] = True  # no new attach from here on
            peers = list(served[3].values())
            served[3].clear()
        left = [p for p in peers if not self._revoke_at(p, region)]
        if not left:
            self._unmap(memh)
            return
        # A live initiator did not confirm: keep the pages and the mapping, so a late access
        # lands in memory that is still allocated, not in freed pages. A slice shares the
        # exporter's buffer: the engine's release of region.view then cannot free it (a
        # bytearray cannot resize, an mmap cannot close) while this holds it. Keep asking in
        # the background; once every initiator confirmed (or is gone), unmap and let go.
        entry = (memh, region.view[:] if region.view is not None else region.owner)
        with self._lock:
            self._quarantine.append(entry)
        threading.Thread(target=self._keep_revoking, args=(entry, region, left), name="mpcomm-ucx-revoke",
                         daemon=True).start()

    def _keep_revoking(self, entry: tuple[Any, memoryview], region: Region, left: list[PeerInfo]) -> None:
        delay = self._revoke_timeout
        while left and not self._closing:
            time.sleep(delay)  # back-off between retries to a hung initiator; no one waits on this
            delay = min(delay * 2, 30.0)
            with self._lock:
                gone = self._gone
            left = [p for p in left if p.node_id not in gone and not self._revoke_at(p, region)]
        if self._closing:
            return  # close() unmaps everything with the context
        with self._lock:
            try:
                self._quarantine.remove(entry)
            except ValueError:
                return
        self._unmap(entry[0])
        entry[1].release()

    def _revoke_at(self, peer: PeerInfo, region: Region) -> bool:
        try:
            self.ctx.control(peer, self.name, {"op": "revoke", "region_id": region.id}, self._revoke_timeout)
            return True
        except PeerConnectionError as exc:
            if getattr(exc, "retryable", False):  # no answer in time: alive but hung, maybe
                self.log.warning("ucx: %s did not confirm revoking region %r (%s); keeping it mapped",
                                 peer.address, region.name, exc)
                return False
            return True  # refused or reset: its engine is gone (a dead process accesses nothing)
        except (UnknownRegionError, TransportUnavailable):
            return True  # it no longer runs ucx
        except EngineClosedError:
            return False
        except MpcommError as exc:
            self.log.warning("ucx: %s did not confirm revoking region %r (%s); keeping it mapped",
                             peer.address, region.name, exc)
            return False

    def _unmap(self, memh: Any) -> None:
        try:
            memh.unmap()
        except Exception as exc:  # noqa: BLE001
            self.log.warning("ucx: ucp_mem_unmap failed: %s", exc)
        ctx = self._context
        if ctx is not None:
            try:
                ctx.memhs.remove(memh)
            except ValueError:
                pass

    # -- control channel -----------------------------------------------------------

    def handle_control(self, peer: PeerInfo | None, body: dict[str, Any]) -> dict[str, Any]:
        if peer is None:
            raise PermissionDeniedError("ucx control requests need an identified peer")
        op = body.get("op")
        try:
            rid = int(body["region_id"])
        except (KeyError, TypeError, ValueError):
            raise ProtocolError("ucx control request without a region id") from None
        if op == "attach":
            return self._handle_attach(peer, rid, body)
        if op == "revoke":
            return self._handle_revoke(peer, rid)
        raise ProtocolError(f"unknown ucx control request {op!r}")

    def _handle_attach(self, peer: PeerInfo, rid: int, body: dict[str, Any]) -> dict[str, Any]:
        with self._lock:
            served = self._served.get(rid)
        if served is None:
            raise UnknownRegionError(f"no region with id {rid} is registered with ucx here")
        region = served[0]
        try:
            token = int(body["token"])
        except (KeyError, TypeError, ValueError):
            raise ProtocolError("ucx attach without a token") from None
        epoch = body.get("epoch")
        want = _wanted_access(body, region.access)
        # The engine's table decides: token, epoch, that the region is still registered, and that it grants
        # every right the initiator asks for. No rkey for writing leaves for a read-only region -- but the
        # same rkey serves gets and puts, and cma/tcp ignore its rights (docs/security.md, "ucx").
        for right in want:
            self.ctx.regions.serve(rid, token, None if epoch is None else str(epoch), 0, 0, right).release()
        with self._lock:
            if served[4] or self._served.get(rid) is not served:
                raise UnknownRegionError(f"region {region.name!r} was unregistered", region=region.name)
            served[3][peer.node_id] = peer
            return {"rkey": served[2], "base": region.address, "size": region.size, "access": region.access}

    def _handle_revoke(self, peer: PeerInfo, rid: int) -> dict[str, Any]:
        """Initiator side: the target unregisters ``rid``; answer once nothing of ours can reach it."""
        err = UnknownRegionError(f"region {rid} of {peer.address} was unregistered by its owner")
        with self._lock:
            atts = [a for p in self._peers.values() if p.key[0] == peer.node_id
                    for a in p.attached.values() if a.key[0] == rid and a.key[1] == peer.epoch]
            waiting: list[_Work] = []
            for a in atts:
                a.state, a.error = "revoked", err
                self._shut_lane(a, wait=True)  # a lane's put left in flight is an orphan after this
                waiting.extend(a.waiting)
                a.waiting = []
                for w in a.works:
                    w.stop = True
                    w.fatal = w.fatal or err
        for w in waiting:
            self._report_fail(w, err)
        self._signal()
        deadline = time.monotonic() + self._revoke_timeout
        with self._lock:
            while any(a.works or a.orphans for a in atts):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TransferTimeout(f"accesses to region {rid} did not drain in {self._revoke_timeout}s")
                self._drained.wait(left)
            for a in atts:
                self._drop_rkey(a)
                a.peer.attached.pop(a.key, None)
        return {"ok": True}

    # -- peers ----------------------------------------------------------------------

    def reach(self, peer: PeerInfo) -> Availability:
        info = peer.transports.get(self.name) or {}
        worker = info.get("worker")
        if not isinstance(worker, str) or not worker:
            return Availability.no("peer published no ucx worker address")
        try:
            bytes.fromhex(worker)
        except ValueError:
            return Availability.no("peer's ucx worker address is not hex")
        return Availability.yes()

    def _peer_for(self, op: Any) -> _Peer:
        info = op.peer.transports.get(self.name) or {}
        worker = str(info.get("worker", ""))
        key = (op.peer.node_id, worker)
        peer = self._peers.get(key)
        if peer is None:
            peer = self._peers[key] = _Peer(key, bytes.fromhex(worker), op.remote.address)
        if len(self._by_info) > 4 * len(self._peers) + 64:
            self._by_info.clear()
        self._by_info[id(op.peer)] = (op.peer, peer)  # the object is kept: its id cannot be reused
        return peer

    def _endpoint(self, peer: _Peer) -> Any:
        """The peer's endpoint, (re)created on demand (lock held; never on a posting thread).

        ``ucp_ep_create`` from a worker address starts the wire-up and returns; requests
        issued before it finished wait inside UCX."""
        if peer.ep is None:
            assert self._worker is not None
            peer.failed = None
            gate = peer.gate = _native.gate()

            def on_error(_ep: Any, exc: Any, peer: _Peer = peer, gate: Any = gate) -> None:
                # Runs inside ucp_worker_progress (the native loop's, or a Python thread's):
                # bookkeeping only (no lock, no UCX call).
                peer.failed = exc.status
                gate[0] = 0  # no bound lane issues on a failed endpoint
                loop = self._loop
                if loop is not None and not self._closed:
                    loop.nudge()  # the requests on it fail at their next step: let their steppers look

            peer.ep = self._worker.connect(peer.address, error_handling=self.error_handling, on_error=on_error)
            peer.generation += 1
        return peer.ep

    def _rkey(self, att: _Attach) -> Any:
        peer = att.peer
        if att.generation != peer.generation or att.rkey is None:
            self._drop_rkey(att)
            att.rkey = peer.ep.unpack_rkey(bytes.fromhex(att.rkey_hex))  # type: ignore[union-attr]
            att.generation = peer.generation
        return att.rkey

    def _drop_rkey(self, att: _Attach) -> None:
        self._shut_lane(att, wait=True)
        rk, att.rkey = att.rkey, None
        if rk is None:
            return
        ep = att.peer.ep
        if att.generation == att.peer.generation and ep is not None:
            rk.destroy()
            try:
                ep.rkeys.remove(rk)
            except ValueError:
                pass
        # else: the endpoint it was unpacked on is closed, which destroyed it

    def _force_close(self, peer: _Peer, timeout: float = 0.0) -> None:
        """Force-close the peer's endpoint: its outstanding requests fail (CANCELED).

        timeout 0 (the progress thread): the close finishes in later progress calls."""
        with self._lock:
            self._shut_lanes(peer)
            ep, peer.ep = peer.ep, None
            for att in peer.attached.values():
                att.rkey = None  # destroyed with the endpoint
            if ep is None:
                return
            try:
                ep.close(force=True, timeout=timeout)
            except Exception as exc:  # noqa: BLE001
                self.log.debug("ucx: forced close of the endpoint to %s: %s", peer.name, exc)

    def peer_changed(self, peer: PeerInfo) -> None:
        """The peer died or restarted: fail what is in flight to it, drop its endpoint and rkeys."""
        waiting: list[_Work] = []
        with self._lock:
            gone = [p for k, p in self._peers.items() if k[0] == peer.node_id]
            self._by_info = {k: v for k, v in self._by_info.items() if v[1] not in gone}
            for p in gone:
                del self._peers[p.key]
                for att in p.attached.values():
                    self._shut_lane(att)
                    att.state = "revoked"
                    att.error = PeerConnectionError(f"peer {p.name} is gone", peer=p.name)
                    waiting.extend(att.waiting)
                    att.waiting = []
                for w in p.works:
                    w.fatal = w.fatal or PeerConnectionError(f"peer {p.name} is gone", peer=p.name,
                                                             region=w.remote.name)
        for w in waiting:
            self._report_fail(w, PeerConnectionError(f"peer {peer.address} is gone", peer=peer.address))
        for p in gone:
            self._force_close(p)
        with self._lock:
            # Target side: that process (or its old incarnation) holds no rkey of ours any more.
            for served in self._served.values():
                served[3].pop(peer.node_id, None)
            if self._quarantine:
                self._gone.add(peer.node_id)
        self._signal()

    # -- attach (connector threads) -------------------------------------------------------

    def _connector(self, peer: _Peer) -> None:
        """Runs attaches to one peer's regions, one after the other, off every posting thread."""
        while True:
            with self._lock:
                if not peer.connecting or self._closing:
                    peer.connector = None
                    return
                att = peer.connecting.pop(0)
                lefts = [w.op.time_left() for w in att.waiting]
                # The rights the descriptors claim: the target refuses an rkey to a claim beyond its grant.
                want = "".join(c for c in "rw" if any(c in self._claimed_access(w.op.remote) for w in att.waiting))
            timeout = min(self._attach_timeout, max(lefts, default=0.0))
            end = time.monotonic() + timeout
            try:
                if timeout <= 0:
                    raise TransferTimeout("the deadline passed before the ucx attach could be sent")
                with self._lock:
                    if peer.ep is None and self._worker is not None:
                        self._endpoint(peer)  # wire-up runs (progress thread) during the attach round trip
                rid, epoch, token = att.key
                ans = self.ctx.control(att.info, self.name,
                                       {"op": "attach", "region_id": rid, "token": token, "epoch": epoch,
                                        "access": want or "r"}, timeout)
                rkey_hex, base, size = str(ans["rkey"]), int(ans["base"]), int(ans["size"])
                access = str(ans["access"])
                bytes.fromhex(rkey_hex)
                self._wired(peer, end)
            except MpcommError as exc:
                self._attach_failed(att, exc)
                continue
            except (KeyError, TypeError, ValueError) as exc:
                self._attach_failed(att, ProtocolError(f"malformed ucx attach answer ({exc})"))
                continue
            except Exception as exc:  # noqa: BLE001 - never lose the waiting requests
                self._attach_failed(att, TransferError(f"ucx attach failed: {exc}"))
                continue
            refused: list[tuple[_Work, Any]] = []
            with self._lock:
                if att.state != "pending":  # revoked (or the peer went) meanwhile
                    waiting, att.waiting = att.waiting, []
                    refused = [(w, att.error or UnknownRegionError("region revoked")) for w in waiting]
                else:
                    att.rkey_hex, att.base, att.size, att.access = rkey_hex, base, size, access
                    att.state = "ready"
                    waiting, att.waiting = att.waiting, []
                    for w in waiting:
                        if w.op.aborted:
                            refused.append((w, w.op.abort_exc))
                            continue
                        exc = self._start(w)
                        if exc is not None:
                            refused.append((w, exc))
            for w, exc in refused:
                self._report_fail(w, exc)

    def _wired(self, peer: _Peer, end: float) -> None:
        """Wait (connector thread) until the endpoint's wire-up finished: a flush completes then.

        Requests issued before that would queue inside UCX; issued after, a cma copy finishes
        inside the call."""
        with self._lock:
            ep = peer.ep
            if ep is None:
                return
            try:
                req = ep.flush_now()
            except self._ucp.UcxError as exc:
                raise map_status(exc.status, _Remote(peer.name), "attach", "wire-up") from None
            if isinstance(req, int):
                if req < 0:
                    raise map_status(req, _Remote(peer.name), "attach", "wire-up")
                return
            done = threading.Event()
            self._waits.append((req, done))
        self._signal()
        if not done.wait(max(0.0, end - time.monotonic())):
            with self._lock:
                self._waits = [x for x in self._waits if x[0] is not req]
                req.free()
            raise TransferTimeout(f"ucx wire-up with {peer.name} did not finish within the request's deadline",
                                  peer=peer.name)
        st = req.final_status
        if st is not None and st < 0:
            raise map_status(st, _Remote(peer.name), "attach", "wire-up")

    def _attach_failed(self, att: _Attach, exc: MpcommError) -> None:
        with self._lock:
            waiting, att.waiting = att.waiting, []
            if att.state == "pending" and att.peer.attached.get(att.key) is att:
                # Not cached: the next request asks again. Only a pending one: a ready attachment
                # holds an rkey and may have requests in flight that a revocation must still find.
                del att.peer.attached[att.key]
        for w in waiting:
            self._report_fail(w, exc)

    # -- initiator ----------------------------------------------------------------------

    def _claimed_access(self, remote: Any) -> str:
        """The rights ``remote`` claims among "r" and "w" (anything else is the descriptor check's business)."""
        try:
            claimed = self._descriptor(remote)[2]
        except MpcommError:
            return "r"
        return "".join(c for c in "rw" if c in claimed) or "r"

    def _descriptor(self, remote: Any) -> tuple[int, int, str]:
        info = remote.transports.get(self.name) or {}
        try:
            return int(info["base"]), int(info["size"]), str(info["access"])
        except (KeyError, TypeError, ValueError) as exc:
            raise TransportUnavailable(f"region {remote.name!r} carries no usable ucx registration ({exc})",
                                       region=remote.name, peer=remote.address) from None

    def _check(self, w: _Work, att: _Attach) -> MpcommError | None:
        """The target's word (from its attach answer) against the descriptor and the request."""
        r = w.remote
        base, size, access = self._descriptor(r)
        if (base, size, access) != (att.base, att.size, att.access) or r.size != att.size:
            return _error(PermissionDeniedError,
                          f"the descriptor of region {r.name!r} does not match what its owner registered "
                          f"(base/size/access {base:#x}/{size}/{access} vs {att.base:#x}/{att.size}/{att.access})", r)
        need = "w" if w.kind == "write" else "r"
        if need not in att.access:
            return _error(PermissionDeniedError, f"region {r.name!r} was registered with access {att.access!r}", r)
        op = w.op
        if w.group:
            lo = min(op.remote_offsets)
            hi = max(op.remote_offsets) + max(op.lengths)  # an upper bound, cheap; exact only if needed
            if hi > att.size:
                hi = max(map(operator.add, op.remote_offsets, op.lengths))
        else:
            lo, hi = op.remote_offset, op.remote_offset + op.length
        if lo < 0 or hi > att.size:
            return _error(OutOfBoundsError, f"[{lo}, {hi}) is outside the {att.size} bytes registered for region "
                                            f"{r.name!r}", r)
        return None

    def post(self, op: Any) -> None:
        peer = self._by_info.get(id(op.peer))
        if peer is None or peer[0] is not op.peer or not self._fast(peer[1], op, False):
            self._post(op, False)

    def _fast(self, peer: _Peer, unit: Any, group: bool) -> bool:
        """The fast path: ``unit`` (an Operation, or a group) in one call of its bound lane (:meth:`_lane`).

        Only to a region attached for this very descriptor on the peer's live endpoint, at most
        ``min(chunk, inline_threshold)`` bytes in all. The lock is held from issue to hand-off,
        so a revocation cannot slip in between; the unit is reported after it, outside the lock
        (the bytes landed before any revocation could be processed). A flush left in flight is
        handed to the progress side as the general path's work. False: declined, nothing issued
        (the general path carries it). Without the helper's extension module there is no fast
        path: False at once."""
        if _native.module() is None:
            return False
        r = unit.remote
        with self._lock:
            att = peer.attached.get((r.region_id, r.epoch, r.token))
            lane = self._lane(peer, att, r, unit.kind == "write", unit.local) if att is not None else None
            if lane is None:
                return False
            if group:
                got = lane[1](unit.local_offsets, unit.remote_offsets, unit.lengths)
            else:
                got = lane[1](unit.local_offset, unit.remote_offset, unit.length)
            if got is False:
                return False
            peer.attached.move_to_end(att.key)
            if group:
                self.hot_groups += 1
            code, flush, failed = (0, None, {}) if got is True else got
            if flush is not None:  # in flight (a network lane): the progress side finishes it
                w = _Work(unit, group, att, self._memh.get(unit.local.id))
                self._items(w)  # as the general path's: what a restart on a fresh endpoint issues again
                w.next = len(w.items)
                w.flush = flush
                for i, st in failed.items():
                    w.failed[i] = map_status(st, r, unit.kind, "request refused")
                    if not group:
                        w.error = st
                att.works.add(w)
                peer.works.add(w)
                self._activate(w)
                return True
        if code != 0:  # the flush failed: no piece is known to have landed in full
            unit.fail(map_status(code, r, unit.kind, "flush failed" if group else "request failed"))
        elif not group:
            if failed:
                unit.fail(map_status(failed[0], r, unit.kind, "request failed"))
            else:
                unit.complete(unit.length)
        else:
            by_status: dict[int, list[int]] = {}
            for i, st in failed.items():
                by_status.setdefault(st, []).append(i)
            for st, idx in by_status.items():
                unit.fail(map_status(st, r, unit.kind, "request refused"), idx)
            unit.complete()
        return True

    def inline_path(self, kind: str, local: Region, remote: Any) -> Any:
        """The fast path bound to one attachment for the engine (see Transport.inline_path).

        Only where every RMA lane of the endpoint is a local copy (cma, knem, xpmem): there a
        put or get is a copy this process makes inside progress, finished here, never a wait on
        the peer. On a network lane a small write would be left in flight nearly every time and
        then written again by :meth:`post` (two puts per request: 314 µs per 4 KiB write over
        ``UCX_TLS=tcp`` here), and a get left in flight could land in the local buffer after
        the redone read had completed; :meth:`post` carries those (its own :meth:`_fast` leaves
        what is in flight to the progress thread). A put that a local-copy lane still leaves in
        flight is kept (``att.orphans``), covered by the flush of the write :meth:`post` then
        issues, and waited for by a revocation.

        The move is the bound lane's (:meth:`_lane`): one native call that takes no lock;
        whatever would make the request unsafe -- a revocation, a failed, closed or replaced
        endpoint, a dropped rkey, a close -- shuts its gates first (:meth:`_shut_lane`,
        :meth:`_shut_lanes`) and waits for the calls in flight, so a shut lane only declines (the
        engine then binds a new one). Without the helper's extension module: None, at once.
        """
        if self._closed or _native.module() is None:
            return None
        key = (remote.region_id, remote.epoch, remote.token)
        with self._lock:
            found = next(((p, p.attached[key]) for p in self._peers.values()
                          if key in p.attached and p.attached[key].ok_remote is remote), None)
            if found is None or not self._local_rma(found[0]):
                return None
            lane = self._lane(found[0], found[1], remote, kind == "write", local)
        return None if lane is None else lane[0]

    def _lane(self, peer: _Peer, att: _Attach, remote: Any, write: bool, local: Region) -> tuple[Any, Any] | None:
        """The fast path's one native entry for (attachment, direction, local region): ``(move, raw)``
        of :meth:`Endpoint.rma_lane`, made if need be (lock held).

        None where it does not apply: the attachment is not ready for this very descriptor on the
        peer's live endpoint of the same generation with its rkey, a gate is shut, the transport
        is closed, or there is no extension module. ``move`` answers the engine (a bool, through
        :meth:`_lane_pending`); ``raw`` answers :meth:`_fast`.
        """
        ep = peer.ep
        if (att.ok_remote is not remote or att.state != "ready" or ep is None or peer.failed is not None
                or att.rkey is None or att.generation != peer.generation or self._closed
                or peer.gate is None or not peer.gate[0]):
            return None
        if att.gate is None:
            att.gate = _native.gate()
        key = (write, local.id, local.address, local.size)
        c = att.lanes.get(key)
        if c is not None and c[0] is peer.gate and c[1] is att.gate:
            return c[2]
        if len(att.lanes) >= 16:
            att.lanes.clear()  # bounded: the pairs in use bind again
        lane = ep.rma_lane(write, att.rkey, self._memh.get(local.id), (peer.gate, att.gate),
                           (local.address, local.size), (att.base, att.size),
                           min(self._chunk, self._inline_threshold), self._chunk, self._active, self._progressed,
                           lambda code, flush, failed, att=att, write=write:
                           self._lane_pending(att, write, code, flush, failed))
        if lane is not None:
            att.lanes[key] = (peer.gate, att.gate, lane)
        return lane

    def _lane_pending(self, att: _Attach, write: bool, code: int, flush: Any, failed: dict[int, int]) -> bool:
        """The engine's answer of a lane move that did not simply land (any thread, no transport lock).

        A flush left in flight by a write becomes an orphan the progress thread reaps and a
        revocation waits for; the write is declined, and the general path's flush covers it. One
        left by a read on a local-copy lane is finished here: local work, never a wait on the
        peer. A refusal or a failure declines (the general path redoes and reports it)."""
        if flush is not None:
            if write:
                with self._orphan_lock:
                    att.orphans.append(flush)
                    self._orphaned.add(att)
                self._signal()
                return False
            code = self._finish_local(flush)
        return code == 0 and not failed

    def _shut_lane(self, att: _Attach, wait: bool = False) -> None:
        """Shut the attachment's bound lanes (lock held); ``wait``: until none of its endpoint's is in flight.

        Waiting under the lock is safe: a lane call takes no Python lock but the orphan lock."""
        g, att.gate = att.gate, None
        att.lanes.clear()
        if g is not None:
            g[0] = 0
            if wait and att.peer.gate is not None:
                self._quiesce(att.peer.gate)

    def _shut_lanes(self, peer: _Peer) -> None:
        """Shut every bound lane on the peer's endpoint and wait for the calls in flight (lock held)."""
        g = peer.gate
        if g is None:
            return
        g[0] = 0
        for att in peer.attached.values():
            att.lanes.clear()
        self._quiesce(g)

    def _quiesce(self, gate: Any) -> None:
        """Wait until no lane call is in flight on ``gate``'s endpoint: local work, microseconds."""
        spins = 0
        while gate[1]:
            spins += 1
            time.sleep(0 if spins < 1000 else 0.0001)

    def _local_rma(self, peer: _Peer) -> bool:
        """Whether the peer's current endpoint does RMA as a local copy (lock held; cached per generation)."""
        gen, local = peer.local_rma
        if gen != peer.generation:
            ep = peer.ep
            local = ep is not None and _rma_is_local_copy(ep.info())
            peer.local_rma = (peer.generation, local)
        return local

    def _finish_local(self, r: Any) -> int:
        """Progress until ``r`` (a get on a local-copy lane) is done; its status (lock held).

        Never a wait on the peer: a cma/knem/xpmem get is a copy this process
        makes, fragment by fragment, inside progress.
        """
        progress = self._worker.progress  # type: ignore[union-attr]
        while r.status() == 1:
            progress()
        st = r.status()
        r.free()
        return st

    def _reap_orphans(self) -> None:
        """Free the inline lane's requests that finished (progress thread, lock held)."""
        with self._orphan_lock:
            for att in list(self._orphaned):
                left = []
                for r in att.orphans:
                    if r.status() == 1:
                        left.append(r)
                    else:
                        r.free()
                att.orphans = left
                if not left:
                    self._orphaned.discard(att)
                    self._drained.notify_all()

    def post_many(self, group: Any) -> None:
        """N puts or gets and one flush; each index reported (see the module docstring): the fast
        path (:meth:`_fast`, the same lane entry as a single request) where it applies, else the
        general one."""
        peer = self._by_info.get(id(group.peer))
        if (peer is None or peer[0] is not group.peer or group.abort_exc is not None
                or not self._fast(peer[1], group, True)):
            self._post(group, True)

    def _post(self, op: Any, group: bool) -> None:
        r = op.remote
        self._descriptor(r)  # a region that ucx does not serve: refused before anything moved
        if group:
            if op.count == 0:
                op.complete()
                return
        elif op.length == 0:
            op.complete(0)
            return
        with self._lock:
            if self._closed:
                raise TransportUnavailable("the ucx transport is closed")
            peer = self._peer_for(op)
            key = (int(r.region_id), str(r.epoch), int(r.token))
            att = peer.attached.get(key)
            if att is not None and att.state == "revoked":
                raise _fresh(att.error or UnknownRegionError("region revoked", region=r.name))
            # op.state stays unset: this transport finds its _Work through its own tables, and
            # op -> _Work -> op would be a reference cycle per request that keeps the local
            # buffer (op.local) alive until the cyclic gc runs: hundreds of MiB of RSS under load.
            w = _Work(op, group, att or _Attach(key, peer, op.peer), self._memh.get(op.local.id))
            if att is None:
                att = w.att
                peer.attached[key] = att
                self._trim(peer)
                # Queued once, when it is created: a pending attachment that exists is queued or
                # being attached right now, and that attach starts everything waiting on it. Queued
                # again while its round trip runs, the connector took it a second time once it was
                # ready, with nothing waiting (a deadline of 0), failed it and dropped the ready
                # attachment: its rkey was orphaned on the endpoint and its requests in flight were
                # no longer found by a revocation (not fenced). One per re-registration.
                peer.connecting.append(att)
            if att.state == "pending":
                self._items(w)
                att.waiting.append(w)
                if peer.connector is None:
                    peer.connector = threading.Thread(target=self._connector, args=(peer,),
                                                      name="mpcomm-ucx-attach", daemon=True)
                    peer.connector.start()
                return
            peer.attached.move_to_end(key)
            exc = self._start(w)
            if exc is not None:
                raise exc

    def _start(self, w: _Work) -> MpcommError | None:
        """Check ``w`` against the target's word and issue it (lock held); the error refuses it."""
        op, att, peer, r = w.op, w.att, w.peer, w.op.remote
        if not w.group and not 0 <= op.local_offset <= op.local.size - op.length:
            # The local range again where it is issued (a group's pieces are checked by rma_group).
            return _error(OutOfBoundsError, f"[{op.local_offset}, {op.local_offset + op.length}) is outside the "
                                            f"local region {op.local.name!r} of {op.local.size} bytes", r)
        if att.ok_remote is not r:
            exc = self._check(w, att)
            if exc is not None:
                return exc
            if att.ok_remote is not None:
                self._shut_lane(att)  # the lanes were bound to the descriptor checked before
            att.ok_remote = r  # this descriptor matches the target's word; bounds per request below
        elif w.group:
            offs, lens = op.remote_offsets, op.lengths
            if op.count and (min(offs) < 0 or max(map(operator.add, offs, lens)) > att.size):
                return _error(OutOfBoundsError, f"a request of the batch is outside the {att.size} bytes "
                                                f"registered for region {r.name!r}", r)
        elif op.remote_offset < 0 or op.remote_offset + op.length > att.size:
            return _error(OutOfBoundsError, f"[{op.remote_offset}, {op.remote_offset + op.length}) is outside "
                                            f"the {att.size} bytes registered for region {r.name!r}", r)
        self._items(w)
        att.works.add(w)
        peer.works.add(w)
        inline = peer.ep is not None and peer.failed is None and self._total(w) <= self._inline_threshold
        if inline:
            self._issue(w)
            # A cma put/get is copied inside ucp_put_nbx/ucp_get_nbx (large ones fragment by
            # fragment inside progress); UCX marks requests done in progress calls, which are
            # local and never wait on the peer: progress while it makes progress.
            progress = self._worker.progress  # type: ignore[union-attr]
            if w.outstanding:  # (a group's rma_group already progressed)
                while progress():
                    pass
                if self._active:
                    self._progressed()  # those calls may have completed handed-off work: let the thread look
            self._reap(w)
            if w.reqs and w.issued_all and w.kind == "write" and w.error is None:
                # Puts still in flight once local progress stops wait for the peer (over tcp, for
                # its acknowledgement): their flush goes out now, behind them, so one round trip
                # answers both, not two in turn (as on the fast path, mp_move).
                self._issue_flush(w)
            if not w.outstanding and w.issued_all and ((w.kind == "read" and not w.group) or w.flushed
                                                        or w.error is not None or self._issue_flush(w)):
                if self._settled(w):
                    return None
            if w.flush is not None:
                while progress():
                    pass
                self._reap(w)
                if w.flushed or w.error is not None:
                    self._settled(w)
                    return None
        self._activate(w)
        return None

    @staticmethod
    def _total(w: _Work) -> int:
        return sum(w.op.lengths) if w.group else w.op.length

    def _items(self, w: _Work) -> None:
        op = w.op
        base = op.local.address
        if w.group:
            w.count = op.count
            w.items = [(0, 0, 0, 0)]  # issued as one unit (rma_many), then one flush
        else:
            loc, rem, n, c = base + op.local_offset, op.remote_offset, op.length, self._chunk
            w.items = [(loc + o, rem + o, min(c, n - o), 0) for o in range(0, n, c)]

    def _trim(self, peer: _Peer) -> None:
        """Bound the idle attachments (unpacked rkeys) per peer (lock held)."""
        if len(peer.attached) <= MAX_ATTACHED:
            return
        for key in list(peer.attached)[: len(peer.attached) // 2]:
            a = peer.attached[key]
            # A revoked one stays only to refuse its stale descriptor at once (a revocation whose
            # drain timed out leaves it here until the target asks again): idle, it can go too.
            if a.state != "pending" and not a.works and not a.waiting:
                self._drop_rkey(a)
                del peer.attached[key]

    def _issue(self, w: _Work) -> None:
        """Issue more of ``w`` (lock held): items within the window."""
        peer, att = w.peer, w.att
        if w.stop or w.fatal is not None or w.error is not None or w.op.aborted:
            return
        if peer.failed is not None and peer.ep is not None:
            return
        ucp = self._ucp
        try:
            ep = self._endpoint(peer)
            rkey = self._rkey(att)
            if w.group:
                if w.next == 0:
                    op, base = w.op, att.base
                    lbase = op.local.address
                    failed = ep.rma_group(w.kind == "write", lbase, op.local.size, op.local_offsets, base, att.size,
                                          op.remote_offsets, op.lengths, rkey, w.memh, self._chunk)
                    for i, status in failed.items():
                        w.failed[i] = map_status(status, w.remote, w.kind, "request refused")
                    w.next = len(w.items)
                return
            issue = ep.put if w.kind == "write" else ep.get
            items, base, memh = w.items, att.base, w.memh
            while w.next < len(items) and w.inflight < self._window:
                loc, ro, n, i = items[w.next]
                w.next += 1
                try:
                    r = issue(loc, n, base + ro, rkey, memh)
                except ucp.UcxError as exc:
                    if not w.group:
                        raise
                    w.failed[i] = map_status(exc.status, w.remote, w.kind, "request failed")
                    continue
                if r is not None:
                    w.reqs.append((r, n, i))
                    w.inflight += n
        except ucp.UcxError as exc:
            w.error = exc.status

    def _issue_flush(self, w: _Work) -> bool:
        """The write's remote-completion flush (lock held); True when it is already done."""
        if w.flush is not None or w.flushed:
            return w.flushed
        ep = w.peer.ep
        if ep is None:
            return False
        try:
            r = ep.flush()
        except self._ucp.UcxError as exc:
            w.error = exc.status
            return True
        if r is None:
            w.flushed = True
        else:
            w.flush = r
        return w.flushed

    def _reap(self, w: _Work) -> None:
        """Collect finished requests of ``w``."""
        if w.reqs:
            left = []
            for item in w.reqs:
                r = item[0]
                s = r.status()
                if s == 1:
                    left.append(item)
                    continue
                r.free()
                w.inflight -= item[1]
                if s < 0:
                    if w.group:
                        w.failed.setdefault(item[2], map_status(s, w.remote, w.kind, "request failed"))
                    if w.error is None:
                        w.error = s
            w.reqs = left
        if w.flush is not None:
            s = w.flush.status()
            if s != 1:
                w.flush.free()
                w.flush = None
                if s < 0:
                    w.error = w.error if w.error is not None else s
                elif w.issued_all:
                    w.flushed = True

    def _release_requests(self, w: _Work) -> None:
        for r, _n, _i in w.reqs:
            r.free()  # UCX reclaims a request freed before it completes
        w.reqs = []
        w.inflight = 0
        if w.flush is not None:
            w.flush.free()
            w.flush = None

    def _settled(self, w: _Work) -> bool:
        """Everything issued finished: report (lock held). False: more to do."""
        if w.group:
            if w.error is not None:
                # the flush failed (or the endpoint went): no index is known to have landed in full
                exc = map_status(w.error, w.remote, w.kind, "flush failed")
                self._forget(w)
                self._report_fail(w, exc)
                return True
            self._forget(w)
            op = w.op
            by_exc: dict[int, list[int]] = {}
            errs: dict[int, MpcommError] = {}
            for i, exc in w.failed.items():
                by_exc.setdefault(id(exc), []).append(i)
                errs[id(exc)] = exc
            for k, idx in by_exc.items():
                op.fail(errs[k], idx)
            op.complete()
            return True
        if w.error is not None:
            self._forget(w)
            self._report_fail(w, map_status(w.error, w.remote, w.kind, "request failed"))
            return True
        self._forget(w)
        w.op.complete(w.op.length)
        return True

    def _activate(self, w: _Work) -> None:
        """``w`` is handed to the progress side (lock held): stepped until it is reported.

        With the native loop, a request that only waits for what it issued does not wake the
        Python thread: it hears of the request's progress from the loop, unless a result()
        waiter claims the request first (drive). One with more to issue wakes it now."""
        self._active.add(w)
        self._by_op[id(w.op)] = w
        if self._loop is not None and w.issued_all and w.outstanding:
            if not self._closed:
                self._loop.handoff()  # `want` first, then the statuses: no completion goes unheard
                # One the loop made between the issue and this hand-off told nobody: step it here
                # (every caller returns right after this). If it is not over, what the step issued (a
                # flush) is handed off again -- the loop progresses it and its claim window starts
                # anew -- rather than the Python thread kicked: `want` was set before the statuses
                # were read, so the completion of whatever is still outstanding is told as any other.
                if any(r.status() != 1 for r, _n, _i in w.reqs) or (w.flush is not None and w.flush.status() != 1):
                    self._step_safe(w, time.monotonic())
                    if w in self._active:
                        self._loop.handoff()
        else:
            self._signal()

    def _forget(self, w: _Work) -> None:
        """``w`` leaves every table (lock held); a waiting revocation may now answer."""
        self._active.discard(w)
        if self._by_op.get(id(w.op)) is w:
            del self._by_op[id(w.op)]
        if w.driven:
            w.driven = False
            self._driven -= 1
        w.peer.works.discard(w)
        if w in w.att.works:
            w.att.works.discard(w)
            if not w.att.works:
                self._drained.notify_all()

    def _report_fail(self, w: _Work, exc: BaseException) -> None:
        with self._lock:
            self._forget(w)
        w.op.fail(_fresh(exc))

    def _step(self, w: _Work, now: float) -> None:
        """Advance ``w`` on the progress thread (lock held)."""
        op, peer = w.op, w.peer
        self._reap(w)
        aborted = op.aborted
        if aborted and w.abort_at is not None and now - w.abort_at > self._abort_grace and w.outstanding:
            # The target does not answer the fence (stalled): reclaim the endpoint and let the
            # other requests on it start over on a fresh one (re-writing the same bytes is harmless).
            for o in list(peer.works):
                if o is not w and not o.op.aborted and o.fatal is None:
                    o.restart = True
            self._force_close(peer)
            self._reap(w)
            self._release_requests(w)
            self._report_fail(w, op.abort_exc)
            return
        if peer.failed is not None and peer.ep is not None:
            for o in peer.works:
                o.fatal = o.fatal or map_status(peer.failed, o.remote, o.kind, "peer failure")
        if w.fatal is not None and not w.stop:
            # The peer is dead: nothing can land any more; close the endpoint to end what is outstanding.
            if w.outstanding and peer.ep is not None:
                self._force_close(peer)
                self._reap(w)
            if w.outstanding:
                return
            self._report_fail(w, w.fatal)
            return
        if aborted or w.stop:
            if w.abort_at is None:
                w.abort_at = now
            if w.outstanding:
                return
            if (w.kind == "write" or w.group) and not w.fenced and w.next and not w.flushed and w.error is None:
                # The fence: once this flush completes, nothing issued before it can land.
                w.fenced = True
                if not self._issue_flush(w):
                    return
            self._report_fail(w, w.fatal if w.stop else op.abort_exc)
            return
        if w.error is not None or w.restart:
            if w.outstanding:
                return
            if w.error is not None and not w.restart and w.error != self._ucp.UCS_ERR_CANCELED:
                self._settled(w)
                return
            if w.restart or w.error == self._ucp.UCS_ERR_CANCELED:
                # Our own forced close cancelled it: start over on a fresh endpoint.
                w.error, w.restart, w.next, w.flushed, w.fenced = None, False, 0, False, False
                w.failed.clear()
        if not w.outstanding and w.issued_all:
            if (w.kind == "read" and not w.group) or w.flushed or self._issue_flush(w):
                self._settled(w)
            return
        self._issue(w)

    # -- progress ------------------------------------------------------------------------

    def _signal(self) -> None:
        """Wake the Python thread (new work, aborts, revocations), any driver, and the progress."""
        if self._closed:
            return
        try:
            if self._loop is not None:
                self._loop.kick()
            elif self._worker is not None:
                self._worker.signal()
        except Exception:  # noqa: BLE001
            pass

    def _progressed(self) -> None:
        """A Python thread's own progress calls did work: whoever steps the others must look.

        With the native loop, as after the loop's own work: waiters check their requests
        natively (no GIL), and the Python thread is woken only if it has undriven requests and
        asked. Without it, the Python thread is kicked."""
        loop = self._loop
        if loop is None:
            self._signal()
        elif not self._closed:
            loop.worked()

    def _busy(self) -> bool:
        """Whether this thread has requests (or wire-up waits, or lane orphans) to step (lock held).

        Requests a result() waiter drives do not count: the waiter steps them itself."""
        return len(self._active) > self._driven or bool(self._waits or self._orphaned)

    def _tick(self, now: float) -> float | None:
        """Step everything of ours once (lock held): wire-up waits, lane orphans, requests.

        Returns the next abort-grace expiry (the only timer), or None."""
        wake_at = None
        if self._waits:
            keep = []
            for req, ev in self._waits:
                if req.status() == 1:
                    keep.append((req, ev))
                else:
                    req.free()
                    ev.set()
            self._waits = keep
        if self._orphaned:
            self._reap_orphans()
        for st in list(self._active):
            if st.driven:
                continue  # its waiter steps it, and alone frees its requests (it may wait on one natively)
            self._step_safe(st, now)
            if st.abort_at is not None and st in self._active:
                t = st.abort_at + self._abort_grace
                wake_at = t if wake_at is None else min(wake_at, t)
        return wake_at

    def _step_safe(self, w: _Work, now: float) -> None:
        try:
            self._step(w, now)
        except Exception as exc:  # noqa: BLE001 - a bug fails the request, not the thread
            self.log.exception("ucx: progress of a %s failed", w.kind)
            self._release_requests(w)
            self._report_fail(w, MpcommError(f"ucx transport failed: {exc}"))

    def _bookkeeping_loop(self) -> None:
        """With the native progress loop: step this process's own requests, woken only when it asked.

        The native loop progresses the worker; this thread sleeps on the loop's eventfd. It is
        woken by a kick (new work, an abort, a revocation) and, after a progress call that did
        work, only while it has requests of its own that no result() waiter drives (``want``)
        and it asked (``ask``, before it checks any status: no lost wake-up). So a process that
        only serves (a target) never needs this thread, nor its GIL. What this thread issues
        (further chunks, flushes, fences) it progresses locally until progress reports nothing,
        as a posting thread does; the rest (the peer's answers) arrives through the loop."""
        loop, worker = self._loop, self._worker
        assert loop is not None and worker is not None
        nfd = loop.nfd
        try:
            while not self._closing:
                loop.drain()
                # Asked every time, before any status is checked: a request handed off while this
                # thread sleeps raises `want`, and its completion must then wake it. Whether it
                # does is `want`'s: a process with no request of its own is never woken.
                loop.ask()
                with self._lock:
                    wake_at = None
                    stepped = self._busy()
                    if stepped:
                        loop.want(True)
                        wake_at = self._tick(time.monotonic())
                    busy = self._busy()
                    loop.want(busy)
                    driven = self._driven
                # This thread's progress calls (its own below, and those of what its steps issued)
                # may complete a driven request: its waiter sleeps on the loop's event counter,
                # which only the loop's and posting threads' progress moved -- it slept out its
                # 1 s wait step (test_pipelined_waiters_never_sleep_out_their_wait_step).
                if stepped and driven:
                    loop.tell_drivers()
                if busy and worker.progress():
                    while worker.progress():
                        pass
                    loop.tell_drivers()
                    continue  # local work done: look at the requests again before sleeping
                timeout = None if wake_at is None else max(0.0, wake_at - time.monotonic()) + 0.001
                select.select([nfd], [], [], timeout)
                self.wakeups += 1
        except Exception:  # noqa: BLE001
            self.log.exception("ucx: the progress thread died")

    def _progress_loop(self) -> None:
        """Without the helper: this Python thread progresses the worker and steps the requests."""
        w = self._worker
        assert w is not None
        efd = w.fileno()
        last = time.monotonic()
        try:
            while not self._closing:
                n = w.progress()
                now = time.monotonic()
                with self._lock:
                    wake_at = self._tick(now)
                if n:
                    last = now
                    continue
                if now - last < self._spin:
                    os.sched_yield()
                    continue
                if not w.arm():
                    last = time.monotonic()
                    continue
                # Sleep until UCX has an event or someone signals; the only timer is the abort grace.
                timeout = None if wake_at is None else max(0.0, wake_at - time.monotonic()) + 0.001
                select.select([efd], [], [], timeout)
                self.wakeups += 1
                last = time.monotonic()
        except Exception:  # noqa: BLE001
            self.log.exception("ucx: the progress thread died")

    def drive(self, op: Any, until: float) -> None:
        """Report ``op`` on the ``result()`` caller's thread (see Transport.drive).

        With the native progress loop: step the request here, then wait with the GIL released
        until the loop reports progress (``events``, read before the step: no lost wake-up), and
        step again; the completion is reported from this thread. While it drives, the request
        does not count for the Python thread's wake-ups (:meth:`_busy`), so no other Python
        thread is scheduled for it; an abort still kicks this waiter, and its grace is this
        waiter's timer too. Leaving unreported, it hands the request back to the Python thread."""
        loop, worker = self._loop, self._worker
        if loop is None or worker is None:
            return
        key = id(op)
        with self._lock:
            w = self._by_op.get(key)
            if w is None or w.op is not op or w.driven:
                return
            w.driven = True
            self._driven += 1
            loop.want(self._busy())  # its progress wakes this waiter, not the Python thread
        spin = self._native_spin
        try:
            while not self._closing:
                seen = loop.events()
                now = time.monotonic()
                with self._lock:
                    if self._by_op.get(key) is not w:
                        return  # reported (here or elsewhere)
                    ep = w.peer.ep
                    self._step_safe(w, now)
                    if w.peer.ep is not ep:
                        self._signal()  # this step force-closed the endpoint: the others start over
                    if self._by_op.get(key) is not w:
                        self.waiter_reports += 1
                        return
                    end = until if w.abort_at is None else min(until, w.abort_at + self._abort_grace + 0.001)
                    req = w.flush if w.flush is not None else (w.reqs[0][0] if w.reqs else None)
                    addr = req.address if req is not None else 0
                if now >= until:
                    return
                if worker.progress():  # what the step issued (a flush, a chunk): local work
                    while worker.progress():
                        pass
                    if len(self._active) > 1:
                        self._progressed()  # those calls may have completed others' requests
                    continue
                # Woken for this request's completion (or a kick), not for every other's: eight
                # waiters do not all take the GIL for each event.
                loop.wait(seen, min(max(0.0, end - now), 1.0), spin, addr)
        finally:
            with self._lock:
                if w.driven:  # not reported: the Python thread takes it over
                    w.driven = False
                    self._driven -= 1
                    self._signal()

    def abort(self, op: Any) -> None:
        """Never blocks: the progress thread fences and reports."""
        self._signal()


logging.getLogger("mpcomm.transport.ucx").addHandler(logging.NullHandler())
