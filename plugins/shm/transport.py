"""The shm transport: one-copy transfers between processes of one host.

Two routes, chosen per region when an initiator first touches it:

* **Mapped (memfd).** ``Engine.allocate`` memory comes from this transport: a
  ``memfd`` sealed against shrinking and growing (``F_SEAL_SHRINK |
  F_SEAL_GROW | F_SEAL_SEAL``) and pre-faulted. An initiator *attaches* to the
  region once (a control-channel request carrying the region's token; the
  target records the attachment under a fresh random *revoke key* it returns),
  then fetches the fd from the target's private ``AF_UNIX`` listener (abstract
  namespace) with ``SCM_RIGHTS``, presenting the token and the one-time nonce
  the attach returned. It checks the seals and the size, maps exactly the
  region's pages, closes the fd, and from then on a write or read is one
  ``memcpy`` by the initiator, no work on the target. A read-only region's
  memfd is sealed ``F_SEAL_FUTURE_WRITE`` at registration and handed out as
  an ``O_RDONLY`` descriptor: the *kernel* refuses a member's writable shared
  mapping (EACCES; EPERM through a reopened descriptor) and ``write``.
* **Cross-memory attach (CMA).** Any other buffer (a bytearray, a numpy array)
  moves with ``process_vm_writev`` / ``process_vm_readv``: one kernel copy
  straight into the target's address space, a whole batch in one system call
  per ``IOV_MAX`` pieces. It needs the same PID namespace and ptrace rights
  over the target; the initiator probes that once per peer (reading a cookie
  the peer published) and the target advertises CMA only when its ptrace
  policy can allow it. The kernel's only check is ptrace access to the whole
  process, the same for reading and writing: a read-only region's rights
  on this route are enforced by the initiator's mpcomm, not by the kernel
  (docs/security.md says what to do where members are not trusted).

**Copies** go through the copy loop (:mod:`._copyloop`): a small C module built
at install (GIL released while bytes move), or the same functions in Python when
none was built. A request takes one of two paths (docs/shm.md, "Paths"): the
*fast path*, a bound pair's move in C (:meth:`ShmTransport.inline_path`, the
copy loop's ``mover``; none without the C module), or the *general path*,
:meth:`ShmTransport.post` / :meth:`ShmTransport.post_many`: checked against
the mapping, then copied now on the calling thread (up to ``inline_threshold``
bytes: a thread hop costs more than it saves) or handed over (the posted ring
a ``result()`` caller claims, else worker threads; ``stripes`` pieces from
``stripe_threshold`` on). Long copies go ``chunk`` bytes at a time and check
for abort, deadline and revocation between chunks (``inflight_cancel``). A
batch (:class:`~mpcomm.transport.OperationGroup`) is checked against the
mapping in one vectorised pass and copied with one native call per ``chunk``
bytes.

On a host with more than one NUMA node, copies handed to threads run on
threads pinned to the CPUs of the node that holds the destination memory
(the target reports its region's node at attach; a read's destination is
the local region), one small pool per node; elsewhere, the engine's workers.

``copy`` mode stages every chunk through a per-thread bounce buffer (source →
bounce → destination: two copies), for the zero-copy vs copy comparison.

**Completion is true.** A request completes once the initiator's copy returned
*and* the process owning the target memory was still alive afterwards: the
initiator holds a pidfd of that process (its pid comes from the kernel —
``SO_PEERCRED`` on the fd socket for memfd, the verified probe for CMA) and
polls it after every copy. A write into a dead peer's memfd lands in pages
nobody will read, so it fails with PeerConnectionError, as does every later
request on that mapping. The engine then sends the request's notification over
the control socket; the send and the receive are system calls on a socket,
which order memory on every architecture Linux supports, so a target that has
received the notification reads every byte of that request. Nothing is
promised about the order of bytes *within* a request.

**Revocation (``fence``).** When the target unregisters a region, its
transport revokes every attachment: a control request to each initiator
carrying the revoke keys it issued. The initiator acts only on keys it holds,
for mappings whose owner (node id and epoch recorded at attach time) is the
authenticated peer of that control connection — a third process cannot revoke
another peer's region by claiming its identity. The initiator refuses new
copies, stops in-flight ones at the next chunk (UnknownRegionError), waits until
none runs, unmaps and answers; only then does ``Engine.unregister`` return on
the target. If a revocation is not confirmed within ``revoke_timeout`` (a hung
initiator) the target logs it and keeps a reference to the buffer, so a late
copy lands in memory that is still allocated.

**Lifetimes.** Nothing a target does can crash an initiator: a mapped memfd
cannot shrink (sealed, and the initiator refuses an fd without the seal), so a
mapped page never disappears (no SIGBUS). A peer whose control link dropped or
that restarted has its mappings dropped (:meth:`ShmTransport.peer_changed`).
"""

from __future__ import annotations

import ctypes
import errno
import json
import logging
import mmap
import os
import secrets
import socket
import struct
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from mpcomm import Availability, Capabilities, Region, Transport, TransportContext
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
from mpcomm import cuda_runtime
from mpcomm.memory import check_allocatable
from mpcomm.peer import PeerInfo, same_host
from mpcomm.wire import NOSIGNAL, loads_bounded, sendall

from . import _copyloop, _native, _posted

if TYPE_CHECKING:
    from mpcomm import Operation
    from mpcomm.transport import OperationGroup

PAGE = mmap.PAGESIZE
_MAX_MSG = 4096
_MAX_ATTACH = 4096  # attachments one served region records (each costs a dict entry until unregister)
_MAX_KEYS = 4096  # revoke keys accepted in one revoke request
_MAX_REVOKED = 4096  # revoked (epoch, region id) pairs remembered for a clear error without a round trip
_FD_CLIENTS = 64  # fd-socket clients served at once
_FD_TIMEOUT = 1.0  # seconds an fd-socket client gets per step (one recv, one send: an initiator sends at once)
_SMALL = 64 << 10  # the fast path copies up to this size under the mapping's lock (one lock, no counter)
_CLAIM_WINDOW = 50e-6  # seconds a posted copy waits for its result() caller before a worker takes it


@dataclass(eq=False)
class _Segment:
    """Target side: the memfd behind an ``Engine.allocate`` region."""

    fd: int
    mm: mmap.mmap
    offset: int  # where the region starts inside the memfd
    total: int  # the memfd's size
    owner: Any  # the transport that made it


@dataclass(eq=False)
class _Served:
    """Target side: a region registered with shm and the attachments it granted."""

    region: Region
    seg: _Segment | None
    lock: threading.Lock = field(default_factory=threading.Lock)
    attached: dict[str, PeerInfo] = field(default_factory=dict)  # revoke key -> the peer that attached
    nonces: set[str] = field(default_factory=set)
    closed: bool = False
    #: CUDA regions: (IPC handle, offset of the region in the handle's allocation).
    ipc: tuple[bytes, int] | None = None


class _Mapping:
    """Initiator side: how to reach one remote region, with an in-flight count for revocation.

    ``lock`` guards ``error`` and ``inflight``; small copies run while holding
    it (so a revocation waits for them), long ones count themselves in
    ``inflight``. The memory and the pidfd are released only when ``error`` is
    set and nothing runs.
    """

    __slots__ = ("kind", "base", "size", "access", "can_read", "can_write", "token", "pid", "pidfd", "mm", "owner",
                 "rkey", "numa", "inflight", "error", "lock", "_idle", "device", "ipc_base", "unwatch")

    def __init__(self, kind: str, base: int, size: int, access: str, token: int, *, pid: int = 0, pidfd: int = -1,
                 mm: mmap.mmap | None = None, owner: tuple[str, str] = ("", ""), rkey: str = "",
                 numa: int = -1) -> None:
        self.kind = kind  # "map" (our mapping of the memfd) or "cma" (an address in pid)
        self.base = base
        self.size = size
        self.access = access  # what the target says, not what the descriptor claims
        self.can_read = "r" in access
        self.can_write = "w" in access
        self.token = token  # the token the target accepted at attach time
        self.pid = pid
        self.pidfd = pidfd  # the owner process (-1: liveness unknown)
        #: Set when the owner's alive page is filed under pidfd (the copy loop's unwatch): called
        #: before pidfd is closed, so a later descriptor of that number is never read by it.
        self.unwatch: Any = None
        self.mm = mm
        self.owner = owner  # (node_id, epoch) of the peer that granted the mapping
        self.rkey = rkey  # the revoke key the owner issued for this attachment
        self.numa = numa  # the NUMA node of the target memory, as its owner reported it (-1: unknown)
        self.device = -1  # "cuda_ipc": the CUDA device the memory is on
        self.ipc_base = 0  # "cuda_ipc": what cudaIpcOpenMemHandle mapped (closed on release)
        self.inflight = 0
        self.error: MpcommError | None = None
        self.lock = threading.Lock()  # raw lock: it sits on the small-request path
        self._idle = threading.Condition(self.lock)

    def enter(self) -> MpcommError | None:
        lock = self.lock
        lock.acquire()
        if self.error is not None:
            lock.release()
            return self.error
        self.inflight += 1
        lock.release()
        return None

    def exit(self) -> None:
        with self.lock:
            self.inflight -= 1
            if self.inflight == 0 and self.error is not None:
                self._release()
                self._idle.notify_all()

    def revoke(self, error: MpcommError, wait: float = 0.0) -> bool:
        """Refuse new copies; True once no copy runs (after up to ``wait`` seconds)."""
        with self._idle:
            if self.error is None:
                self.error = error
            if wait > 0:
                self._idle.wait_for(lambda: self.inflight == 0, wait)
            if self.inflight == 0:
                self._release()
                return True
            return False

    def wait_idle(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds until no copy runs through this mapping; True once none does."""
        with self._idle:
            return self._idle.wait_for(lambda: self.inflight == 0, timeout)

    def _release(self) -> None:
        base, self.ipc_base = self.ipc_base, 0
        if base:
            try:
                cuda_runtime.ipc_close(base)
            except Exception:  # noqa: BLE001 - the owner's process may be gone; nothing else to release
                pass
        mm, self.mm = self.mm, None
        if mm is not None:
            try:
                mm.close()
            except (BufferError, ValueError, OSError):  # pragma: no cover - we never export it
                pass
        fd, self.pidfd = self.pidfd, -1
        unwatch, self.unwatch = self.unwatch, None
        if unwatch is not None:
            unwatch(fd)
        if fd >= 0:
            try:
                os.close(fd)
            except OSError:  # pragma: no cover
                pass


#: _Mapping.error's slot descriptor: the C move reads the slot under the mapping's lock (no name in C).
_MAPPING_ERROR = _Mapping.error


@dataclass(eq=False)
class _Pieces:
    left: int
    mapping: _Mapping
    lock: threading.Lock = field(default_factory=threading.Lock)
    error: BaseException | None = None
    #: Pieces waiting for a result() caller to claim them (_posted.py).
    jobs: list[Any] = field(default_factory=list)


class ShmTransport(Transport):
    """Same-host transfers through shared memory (memfd) or cross-memory attach."""

    name: ClassVar[str] = "shm"
    capabilities: ClassVar[Capabilities] = Capabilities(
        memory_kinds=frozenset({"host", "cuda"}),  # cuda: CUDA IPC, where cuda-python and a GPU are here
        intra_node=True,
        inter_node=False,
        one_sided=True,  # the target's CPU takes no part in a transfer
        zero_copy=True,
        inflight_cancel=True,
        modes=frozenset({"zero-copy", "copy"}),
        revocation="fence",  # unregister returns once every attached initiator dropped its mapping
        bandwidth_class="memory",
    )
    default_options: ClassVar[dict[str, Any]] = {
        "cma": True,  # use (initiator) and offer (target) cross-memory attach for non-memfd buffers
        "allow_any_ptracer": True,  # under Yama ptrace_scope=1, let same-uid peers attach (PR_SET_PTRACER_ANY)
        "native": True,  # use the compiled copy loop when it builds (False: the Python fallback)
        "inline_threshold": 16 << 20,  # copy requests (and batches) up to this size on the caller's thread
        "stripe_threshold": 32 << 20,  # split larger requests into stripes on the workers
        "stripes": 0,  # pieces per striped request; 0 = min(4, CPUs)
        "caller_stripes": False,  # True: the caller copies the first stripe itself (post blocks for it)
        "chunk": 4 << 20,  # abort-check granularity of a long copy (and of a batch)
        "bounce_size": 1 << 20,  # copy mode's per-thread staging buffer
        "revoke_timeout": 2.0,  # seconds a target waits for an initiator to drop a region
        # Contiguous copies of at least this many bytes are shared with a helper thread of the
        # compiled copy loop (0: one thread copies); it looks for the next one this long first.
        "copy_helper_min": 1 << 20,
        "copy_helper_spin_us": 50,
    }
    option_ranges: ClassVar[dict[str, Any]] = {"copy_helper_min": (0, None), "copy_helper_spin_us": (0, 10_000)}

    def __init__(self, ctx: TransportContext) -> None:
        super().__init__(ctx)
        o = ctx.options
        self.log = ctx.log
        self.copy_mode = ctx.mode == "copy"
        self._inline = int(o["inline_threshold"])
        self._stripe_threshold = max(int(o["stripe_threshold"]), 2 * PAGE)
        self._stripes = int(o["stripes"]) or min(4, os.cpu_count() or 1)
        self._chunk = max(int(o["chunk"]), PAGE)
        self._caller_stripes = bool(o["caller_stripes"])
        self._bounce_size = max(int(o["bounce_size"]), PAGE)
        # The general path copies up to this many bytes now in one native call (copy mode: never).
        self._one_call = -1 if self.copy_mode else self._chunk
        self._use_cma = bool(o["cma"]) and not _native.cma_available()
        self._loop = _copyloop.get() if o["native"] else _copyloop.fallback()
        # Per process (the helper thread is the copy loop's): the last transport started sets it.
        self._helper_min = self._loop.share(int(o["copy_helper_min"]), int(o["copy_helper_spin_us"]))
        self._serve_cma = False
        self._serve_cma_reason = ""
        self._alive_fd = -1  # this process's alive page (_copyloop.c, "Owner liveness"), sent with each memfd
        self._closed = False
        self._lock = threading.Lock()
        # target side
        self._served: dict[int, _Served] = {}
        self._quarantine: list[Any] = []
        self._listener: socket.socket | None = None
        self._fd_slots = threading.BoundedSemaphore(_FD_CLIENTS)
        self._sock_name = ""
        self._cookie = ctypes.c_uint64(secrets.randbits(63))
        # initiator side
        self._maps: dict[tuple[str, int], _Mapping] = {}
        self._by_rkey: dict[str, tuple[str, int]] = {}
        self._revoked: dict[tuple[str, int], None] = {}
        self._attaching: dict[tuple[str, int], list[Any]] = {}  # key -> [lock, users]
        self._early: dict[tuple[str, int], set[str]] = {}  # revoke keys that arrived before the attach answer
        self._reach_cache: dict[tuple[str, str], Availability] = {}
        self._tls = threading.local()
        # Copy threads near the destination memory, per NUMA node (only on multi-node hosts).
        self._node_cpus = {n.id: n.cpus for n in _numa_nodes() if n.cpus}
        if len(self._node_cpus) < 2:
            self._node_cpus = {}
        self._near: dict[int, ThreadPoolExecutor] = {}
        # Copies past inline_threshold wait for the result() caller to claim them (drive), with
        # the compiled loop on a one-node host (NUMA hosts copy on threads pinned near the memory).
        self._posted = _posted.PostedCopies(self._loop, self._stripes, _CLAIM_WINDOW, self.log) \
            if self._loop.native and not self._node_cpus else None

    @classmethod
    def availability(cls) -> Availability:
        if not sys.platform.startswith("linux"):
            return Availability.no("needs Linux (memfd_create, process_vm_writev)")
        if not hasattr(os, "memfd_create"):
            return Availability.no("os.memfd_create is missing")
        live = "pidfd liveness checks" if hasattr(os, "pidfd_open") else "no pidfd (liveness from the control link only)"
        return Availability.yes(f"memfd + SCM_RIGHTS; cross-memory attach for other buffers; {live}; "
                                f"{_copyloop.status()}")

    @classmethod
    def memory_kind_availability(cls) -> dict[str, Availability]:
        why = cuda_runtime.unavailable_reason()
        return {"cuda": Availability.no(why) if why else Availability.yes("CUDA IPC")}

    # -- start / target side ----------------------------------------------------------

    def start(self) -> dict[str, Any]:
        if not self.ctx.options["cma"]:
            self._serve_cma_reason = "disabled by plugins.shm.cma"
        elif _native.cma_available():
            self._serve_cma_reason = _native.cma_available()
        else:
            scope = _native.ptrace_policy()
            if scope == 1 and self.ctx.options["allow_any_ptracer"] and _native.allow_any_ptracer():
                self._serve_cma = True
            elif scope == 1:
                self._serve_cma_reason = "Yama ptrace_scope=1 and plugins.shm.allow_any_ptracer is off"
            elif scope >= 2:
                self._serve_cma_reason = f"Yama ptrace_scope={scope} forbids attaching to this process"
            else:
                self._serve_cma = True
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        name = f"mpcomm-shm-{self.ctx.node_id}-{secrets.token_hex(4)}"
        try:
            sock.bind("\0" + name)
            sock.listen(64)
        except BaseException:
            sock.close()
            raise
        self._listener, self._sock_name = sock, name
        self._alive_fd = self._alive_page()
        threading.Thread(target=self._fd_loop, name="mpcomm-shm-fds", daemon=True).start()
        return {
            "socket": name,
            "cma": self._serve_cma,
            "cma_reason": self._serve_cma_reason,
            "probe": ctypes.addressof(self._cookie),
            "cookie": self._cookie.value,
            "copy_loop": "native" if self._loop.native else "python",
        }

    def _alive_page(self) -> int:
        """This process's alive page, handed with every memfd (-1: none; initiators poll our pidfd)."""
        make = self._loop.alive_page
        if make is None:
            return -1
        try:
            return int(make())
        except OSError as exc:
            self.log.debug("shm: no alive page (initiators poll this process's pidfd): %s", exc)
            return -1

    def allocate(self, size: int, alignment: int) -> tuple[memoryview, Any] | None:
        extra = alignment if alignment > PAGE else 0
        total = -(-(size + extra) // PAGE) * PAGE
        check_allocatable(total, shm=True)  # before MAP_POPULATE: an oversized memfd summons the OOM killer
        fd, mm = _native.memfd_segment(total, f"mpcomm-{size}")
        base = _native.map_address(mm)
        skip = (-base) % alignment if extra else 0
        seg = _Segment(fd=fd, mm=mm, offset=skip, total=total, owner=self)
        return memoryview(mm)[skip : skip + size], seg

    def register(self, region: Region) -> dict[str, Any] | None:
        if region.kind == "cuda":
            if not region.published:
                return None  # a buffer for one request: only this process copies from/to it, by address
            # Exported once; each attach hands the handle to that initiator, which maps it.
            handle, offset = cuda_runtime.ipc_export(region.address, region.device)
            with self._lock:
                self._served[region.id] = _Served(region, None, ipc=(handle, offset))
            return {"kind": "cuda_ipc"}
        if region.kind != "host":
            return None
        seg = region.backing if isinstance(region.backing, _Segment) and region.backing.owner is self else None
        if seg is None and not self._serve_cma:
            return None  # the engine routes this region over the next transport
        if seg is not None:
            # The region's rights go into the memfd itself: the kernel enforces them on every member.
            _native.seal_access(seg.fd, "w" in region.access)
        with self._lock:
            self._served[region.id] = _Served(region, seg)
        return {"kind": "memfd" if seg is not None else "cma"}

    def unregister(self, region: Region) -> None:
        with self._lock:
            served = self._served.pop(region.id, None)
        if served is None:
            return
        with served.lock:
            served.closed = True
            grants = list(served.attached.items())
            served.attached.clear()
            served.nonces.clear()
            if served.seg is not None and served.seg.fd >= 0:
                os.close(served.seg.fd)
                served.seg.fd = -1
        by_peer: dict[str, tuple[PeerInfo, list[str]]] = {}
        for key, peer in grants:
            by_peer.setdefault(peer.address, (peer, []))[1].append(key)
        for peer, keys in by_peer.values():
            self._revoke_at(peer, region, keys)

    def _revoke_at(self, peer: PeerInfo, region: Region, keys: list[str]) -> None:
        timeout = float(self.ctx.options["revoke_timeout"])
        try:
            for i in range(0, len(keys), _MAX_KEYS):
                self.ctx.control(peer, self.name, {"op": "revoke", "region_id": region.id,
                                                   "keys": keys[i : i + _MAX_KEYS]}, timeout)
        except (PeerConnectionError, UnknownRegionError, TransportUnavailable):
            pass  # its engine is gone (or never mapped it): nobody can write any more
        except EngineClosedError:
            # This engine is closing: peers drop their mappings when its control
            # endpoint goes away. Keep the buffer alive for a late CMA copy.
            self._quarantine.append(region.view)
        except MpcommError as exc:
            self.log.warning("shm: %s did not confirm dropping region %r (%s); keeping the buffer alive",
                             peer.address, region.name, exc)
            self._quarantine.append(region.view)

    def _fd_loop(self) -> None:
        """Hand out memfds; any local process can connect, so each client gets a thread and a deadline.

        At most ``_FD_CLIENTS`` are served at once (more are closed at once: a
        flood, not initiators, which connect once per attach); out of file
        descriptors the loop backs off and goes on instead of dying.
        """
        sock = self._listener
        assert sock is not None
        backoff = 0.01
        while not self._closed:
            try:
                conn, _ = sock.accept()
            except OSError as exc:
                if self._closed or exc.errno in (errno.EBADF, errno.EINVAL):
                    return
                if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    self.log.warning("shm: fd listener: %s; retrying in %.2fs", exc.strerror, backoff)
                    time.sleep(backoff)
                    backoff = min(backoff * 2, 1.0)
                continue
            backoff = 0.01
            if not self._fd_slots.acquire(blocking=False):
                conn.close()
                continue
            try:
                threading.Thread(target=self._serve_fd, args=(conn,), name="mpcomm-shm-fd", daemon=True).start()
            except RuntimeError:
                self._fd_slots.release()
                conn.close()

    def _serve_fd(self, conn: socket.socket) -> None:
        try:
            conn.settimeout(_FD_TIMEOUT)
            self._send_fd(conn)
        except Exception as exc:  # noqa: BLE001 - a bad client must not stop the listener
            self.log.debug("shm: fd request failed: %s", exc)
        finally:
            conn.close()
            self._fd_slots.release()

    def _send_fd(self, conn: socket.socket) -> None:
        try:
            req = loads_bounded(conn.recv(_MAX_MSG), what="shm fd request", max_bytes=_MAX_MSG)
            rid, token, nonce = int(req["region_id"]), int(req["token"]), str(req["nonce"])
        except (ProtocolError, ValueError, OverflowError, KeyError, TypeError):
            sendall(conn, b'{"error": "malformed request"}')
            return
        with self._lock:
            served = self._served.get(rid)
        if served is None or served.seg is None:
            sendall(conn, b'{"error": "no such shared-memory region"}')
            return
        with served.lock:
            if served.closed or token != served.region.token or nonce not in served.nonces:
                sendall(conn, b'{"error": "refused"}')
                return
            served.nonces.discard(nonce)
            seg = served.seg
            head = json.dumps({"offset": seg.offset, "size": served.region.size, "total": seg.total}).encode()
            alive = [self._alive_fd] if self._alive_fd >= 0 else []
            if "w" in served.region.access:
                socket.send_fds(conn, [head], [seg.fd] + alive, NOSIGNAL)
                return
            # A read-only region: an O_RDONLY descriptor (a writable shared mapping fails, EACCES) of a
            # memfd sealed F_SEAL_FUTURE_WRITE (and reopening it read-write gains nothing, EPERM).
            try:
                ro = _native.read_only_fd(seg.fd)
            except OSError:  # no /proc: the seal alone still refuses writable mappings (EPERM)
                ro = os.dup(seg.fd)
        try:
            socket.send_fds(conn, [head], [ro] + alive, NOSIGNAL)
        finally:
            os.close(ro)

    def handle_control(self, peer: PeerInfo | None, body: dict[str, Any]) -> dict[str, Any]:
        op = body.get("op")
        if peer is None:
            raise PermissionDeniedError("shm control requests need an identified peer")
        if op == "attach":
            return self._handle_attach(peer, body)
        if op == "revoke":
            return self._handle_revoke(peer, body)
        raise ProtocolError(f"unknown shm control request {op!r}")

    def _handle_attach(self, peer: PeerInfo, body: dict[str, Any]) -> dict[str, Any]:
        try:
            rid, token = int(body["region_id"]), int(body["token"])
        except (KeyError, TypeError, ValueError):
            raise ProtocolError("malformed shm attach request") from None
        with self._lock:
            served = self._served.get(rid)
        if served is None:
            raise UnknownRegionError(f"no region with id {rid} is registered with shm here")
        want = body.get("access", served.region.access[:1])
        if not isinstance(want, str) or not want or len(want) > 2 or set(want) - {"r", "w"}:
            raise ProtocolError("shm attach: access must be 'r', 'w' or 'rw'")
        # Every right the initiator asks for must be granted here: a write route (a writable memfd, a cma
        # base to write to) is never handed out for a read-only region. What each route's kernel enforces
        # is another matter: see the module docstring and docs/security.md.
        for right in want:
            region = self.ctx.regions.serve(rid, token, body.get("epoch"), 0, 0, right)
            region.release()
        nonce = secrets.token_hex(16)
        rkey = secrets.token_hex(16)
        with served.lock:
            if served.closed:
                raise UnknownRegionError(f"region {region.name!r} was unregistered", region=region.name)
            if len(served.attached) >= _MAX_ATTACH:
                raise PermissionDeniedError(f"region {region.name!r} has {_MAX_ATTACH} shm attachments already",
                                            region=region.name)
            served.attached[rkey] = peer
            if served.seg is not None:
                if len(served.nonces) >= _MAX_ATTACH:
                    served.nonces.pop()
                served.nonces.add(nonce)
        if served.ipc is not None:
            return {"kind": "cuda_ipc", "ipc_handle": served.ipc[0].hex(), "ipc_offset": served.ipc[1],
                    "device": served.region.device, "revoke_key": rkey, "numa_node": -1, "base": region.address,
                    "size": region.size, "access": region.access}
        node = served.region.numa_node
        return {
            "kind": "memfd" if served.seg is not None else "cma",
            "nonce": nonce,
            "revoke_key": rkey,
            "numa_node": -1 if node is None else node,
            "base": region.address,
            "size": region.size,
            "access": region.access,
        }

    def _handle_revoke(self, peer: PeerInfo, body: dict[str, Any]) -> dict[str, Any]:
        """The owner of a region unregistered it: drop the attachments named by their revoke keys.

        Only keys we hold count, and only for a mapping whose owner (recorded
        at attach time) is the peer of this control connection: what the body
        claims (ids, epochs) is never enough.
        """
        try:
            rid = int(body["region_id"])
            keys = body.get("keys")
            if not isinstance(keys, list) or len(keys) > _MAX_KEYS or not all(isinstance(k, str) for k in keys):
                raise TypeError("keys")
        except (KeyError, TypeError, ValueError):
            raise ProtocolError("malformed shm revoke request") from None
        owner = (peer.node_id, peer.epoch)
        dropped: list[_Mapping] = []
        with self._lock:
            for k in keys:
                key = self._by_rkey.get(k)
                if key is None:
                    pending = (peer.epoch, rid)
                    if pending in self._attaching:  # its answer may still be on the way
                        early = self._early.setdefault(pending, set())
                        if len(early) < 64:
                            early.add(k)
                    continue
                m = self._maps.get(key)
                if m is None or m.owner != owner or key[1] != rid or m.rkey != k:
                    continue  # not the owner's grant: ignore
                del self._maps[key]
                del self._by_rkey[k]
                self._remember_revoked(key)
                dropped.append(m)
        wait = float(self.ctx.options["revoke_timeout"])
        for m in dropped:
            if not m.revoke(UnknownRegionError("the region was unregistered by its owner"), wait):
                self.log.warning("shm: copies into a revoked region did not stop within %.1fs", wait)
        return {"ok": True, "revoked": len(dropped)}

    def _remember_revoked(self, key: tuple[str, int]) -> None:
        self._revoked[key] = None
        if len(self._revoked) > _MAX_REVOKED:
            del self._revoked[next(iter(self._revoked))]

    # -- initiator side -------------------------------------------------------------

    def reach(self, peer: PeerInfo) -> Availability:
        key = (peer.node_id, peer.epoch)
        got = self._reach_cache.get(key)
        if got is None:
            got = self._reach_cache[key] = self._compute_reach(peer)
        return got

    def _compute_reach(self, peer: PeerInfo) -> Availability:
        info = peer.transports.get(self.name) or {}
        if not info.get("socket"):
            return Availability.no("peer published no shm endpoint")
        if not same_host(self.ctx.host, peer.host, need=()):
            return Availability.no("peer runs on another kernel (boot id differs)")
        memfd_ok = self._memfd_reason(peer) == ""
        cma_why = self._cma_reason(peer)
        if info.get("cma") and cma_why:
            # The peer offers CMA for its plain buffers; the engine routes per
            # peer, so refuse the peer rather than fail those requests later.
            return Availability.no(f"cross-memory attach unavailable: {cma_why}")
        if not memfd_ok and cma_why:
            return Availability.no(f"{self._memfd_reason(peer)}; and {cma_why}")
        return Availability.yes()

    def _memfd_reason(self, peer: PeerInfo) -> str:
        if not same_host(self.ctx.host, peer.host, need=("net_ns",)):
            return "different network namespace (the fd socket is abstract)"
        return ""

    def _cma_reason(self, peer: PeerInfo) -> str:
        if not self._use_cma:
            return "disabled by plugins.shm.cma" if not self.ctx.options["cma"] else _native.cma_available()
        if not same_host(self.ctx.host, peer.host, need=("pid_ns",)):
            return "peer is in another PID namespace"
        info = peer.transports.get(self.name) or {}
        try:
            pid, probe, cookie = int(peer.host["pid"]), int(info["probe"]), int(info["cookie"])
        except (KeyError, TypeError, ValueError):
            return "peer published no CMA probe"
        return _native.cma_probe(pid, probe, cookie)

    def _mapping(self, remote: Any, peer: PeerInfo, deadline: float) -> _Mapping:
        """The mapping of ``remote``, attaching first if needed (blocks: never on the posting thread)."""
        key = (remote.epoch, remote.region_id)
        m = self._maps.get(key)
        if m is not None:
            return m
        with self._lock:
            slot = self._attaching.get(key)
            if slot is None:
                slot = self._attaching[key] = [threading.Lock(), 0]
            slot[1] += 1  # attaches waiting on or holding this key's lock
        lock = slot[0]
        try:
            if not lock.acquire(timeout=max(deadline - time.monotonic(), 0.001)):
                raise TransferTimeout(f"attaching to region {remote.name!r} on {remote.address} took too long",
                                      region=remote.name, peer=remote.address)
            try:
                m = self._maps.get(key)
                if m is None:
                    m = self._attach(remote, peer, key, deadline)
            finally:
                lock.release()
        finally:
            with self._lock:
                slot[1] -= 1
                if slot[1] == 0:
                    del self._attaching[key]
                    self._early.pop(key, None)
        return m

    def _attach(self, r: Any, peer: PeerInfo, key: tuple[str, int], deadline: float) -> _Mapping:
        if key in self._revoked:
            raise UnknownRegionError(f"region {r.name!r} was unregistered by its owner", region=r.name, peer=r.address)
        timeout = max(deadline - time.monotonic(), 0.001)
        reply = self.ctx.control(peer, self.name, {"op": "attach", "region_id": r.region_id, "token": r.token,
                                                   "epoch": r.epoch, "access": _claimed_access(r)}, timeout)
        try:
            size, access, kind = int(reply["size"]), str(reply["access"]), str(reply["kind"])
            rkey = str(reply.get("revoke_key", ""))
        except (KeyError, TypeError, ValueError):
            raise ProtocolError(f"malformed shm attach answer from {r.address}", peer=r.address) from None
        if size != r.size:
            raise OutOfBoundsError(f"region {r.name!r} is {size} bytes, the descriptor says {r.size}",
                                   region=r.name, peer=r.address)
        owner = (peer.node_id, peer.epoch)
        m: _Mapping | None = None
        why = ""
        if kind == "cuda_ipc":
            m = self._map_ipc(r, reply, size, access, owner, rkey)
        elif kind == "memfd":
            why = self._memfd_reason(peer)
            if not why:
                m = self._map_fd(r, peer, reply, timeout, owner, rkey)
        if m is None:
            cma_why = self._cma_reason(peer)
            if cma_why:
                raise TransportUnavailable(f"shm cannot reach region {r.name!r}: {why or cma_why}",
                                           region=r.name, peer=r.address)
            pid = int(peer.host["pid"])
            m = _Mapping("cma", int(reply["base"]), size, access, r.token, pid=pid, pidfd=self._pidfd_cma(peer, pid),
                         owner=owner, rkey=rkey)
        numa = reply.get("numa_node", -1)
        # The peer's word only picks which of our copy threads run the copy: checked, never trusted further.
        m.numa = numa if isinstance(numa, int) and not isinstance(numa, bool) and 0 <= numa < 4096 else -1
        with self._lock:
            early = self._early.get(key, ())
            if key in self._revoked or rkey in early:
                m.revoke(UnknownRegionError("unregistered"))
                raise UnknownRegionError(f"region {r.name!r} was unregistered by its owner", region=r.name,
                                         peer=r.address)
            self._maps[key] = m
            if rkey:
                self._by_rkey[rkey] = key
        return m

    def _map_ipc(self, r: Any, reply: dict[str, Any], size: int, access: str, owner: tuple[str, str],
                 rkey: str) -> _Mapping:
        """Map a peer's CUDA region (cudaIpcOpenMemHandle); released by revocation (cudaIpcCloseMemHandle)."""
        try:
            handle, offset, device = bytes.fromhex(str(reply["ipc_handle"])), int(reply["ipc_offset"]), \
                int(reply["device"])
        except (KeyError, TypeError, ValueError):
            raise ProtocolError(f"malformed shm cuda_ipc answer from {r.address}", peer=r.address) from None
        why = cuda_runtime.unavailable_reason()
        if why:
            raise TransportUnavailable(f"shm cannot map CUDA region {r.name!r}: {why}", region=r.name, peer=r.address)
        base = cuda_runtime.ipc_open(handle, device)
        m = _Mapping("cuda_ipc", base + offset, size, access, r.token, owner=owner, rkey=rkey)
        m.device, m.ipc_base = device, base
        return m

    def _device_move(self, m: _Mapping, write: bool, local: Region, lo: int, ro: int, n: int, r: Any,
                     deadline: float) -> None:
        """Copy ``n`` bytes between ``local`` (host or CUDA) and the mapping, CUDA on one side at least.

        A mapped CUDA region or a memfd mapping is addressable here: one
        cudaMemcpyAsync on this thread's stream, waited for. A peer's host
        buffer reached by cross-memory attach is not: it goes through a
        pinned bounce buffer (pool bounded by ``bounce_size`` x stripes).
        """
        la = local.address + lo
        ra = m.base + ro
        device = local.device if local.kind == "cuda" else m.device
        if m.kind != "cma":
            dst, src = (ra, la) if write else (la, ra)
            cuda_runtime.stream_copy(dst, src, n, max(device, 0))
            return
        pool = self._pinned_pool()
        bounce = pool.take(timeout=max(deadline - time.monotonic(), 0.001))
        try:
            for pos in range(0, n, pool.size):
                k = min(pool.size, n - pos)
                if write:
                    cuda_runtime.stream_copy(bounce, la + pos, k, device)
                    rc = self._move(m, True, bounce, ra + pos, k)
                else:
                    rc = self._move(m, False, bounce, ra + pos, k)
                    if not rc:
                        cuda_runtime.stream_copy(la + pos, bounce, k, device)
                if rc:
                    raise self._rc_error(rc, "write" if write else "read", r, m)
        finally:
            pool.give(bounce)

    def _pinned_pool(self) -> cuda_runtime.PinnedPool:
        with self._lock:
            pool = getattr(self, "_pinned", None)
            if pool is None:
                pool = self._pinned = cuda_runtime.PinnedPool(self._bounce_size, self._bounce_size * self._stripes)
            return pool

    def _pidfd_cma(self, peer: PeerInfo, pid: int) -> int:
        """A pidfd of the CMA target, bound to the right process by re-running the probe after opening it."""
        fd = _pidfd_open(pid)
        if fd < 0:
            return -1
        info = peer.transports.get(self.name) or {}
        try:
            why = _native.cma_probe(pid, int(info["probe"]), int(info["cookie"]))
        except (KeyError, TypeError, ValueError):
            why = "no probe"
        if why:
            os.close(fd)
            raise TransportUnavailable(f"shm: cross-memory attach to {peer.address} failed: {why}", peer=peer.address)
        return fd

    def _map_fd(self, r: Any, peer: PeerInfo, reply: dict[str, Any], timeout: float, owner: tuple[str, str],
                rkey: str) -> _Mapping:
        name = str(peer.transports[self.name]["socket"])
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(min(timeout, 5.0))
            try:
                s.connect("\0" + name)
                # The kernel's word on who listens there: the owner whose liveness we check.
                pid = struct.unpack("3i", s.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))[0]
                sendall(s, json.dumps({"region_id": r.region_id, "token": r.token, "nonce": reply["nonce"]}).encode())
                msg, fds, _flags, _addr = socket.recv_fds(s, _MAX_MSG, 2)  # the memfd, the owner's alive page
            except OSError as exc:
                raise PeerConnectionError(f"shm: fetching the fd of {r.name!r} failed: {exc}", peer=r.address) from exc
        if not fds:
            try:
                answer = loads_bounded(msg, what="shm fd answer", max_bytes=_MAX_MSG)
                why = str(answer.get("error", "no fd")) if isinstance(answer, dict) else "malformed answer"
            except ProtocolError:
                why = "malformed answer"
            raise PermissionDeniedError(f"shm: {r.address} refused the fd of {r.name!r}: {why}",
                                        region=r.name, peer=r.address)
        fd = fds[0]
        alive = fds[1] if len(fds) > 1 else -1
        for extra in fds[2:]:
            os.close(extra)
        pidfd = -1
        watched = False
        try:
            try:
                head = loads_bounded(msg, what="shm fd answer", max_bytes=_MAX_MSG)
                offset, size, total = int(head["offset"]), int(head["size"]), int(head["total"])
            except (ValueError, OverflowError, KeyError, TypeError) as exc:
                raise ProtocolError(f"shm: malformed answer with the fd of {r.name!r}: {exc}") from None
            seals = _fcntl_seals(fd)
            if not seals & _native.F_SEAL_SHRINK:
                raise ProtocolError(f"shm: the fd of {r.name!r} is not sealed against shrinking; refusing to map it")
            st = os.fstat(fd)
            if size != r.size or offset < 0 or offset + size > min(total, st.st_size):
                raise OutOfBoundsError(f"shm: the fd of {r.name!r} does not hold the region", region=r.name)
            start = offset - offset % mmap.ALLOCATIONGRANULARITY
            access = str(reply.get("access", ""))
            prot = mmap.PROT_READ | (mmap.PROT_WRITE if "w" in access else 0)
            pidfd = _pidfd_open(pid) if pid > 0 else -1
            mm = mmap.mmap(fd, offset + size - start, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0),
                           prot=prot, offset=start)
            # Liveness from the owner's alive page instead of a poll per copy, where it is one of
            # the pid's own (checked in C); anything else leaves the pidfd polled.
            watched = pidfd >= 0 and alive >= 0 and self._loop.watch(pidfd, alive, pid) == 1
        except BaseException:
            if watched:
                self._loop.unwatch(pidfd)
            if pidfd >= 0:
                os.close(pidfd)
            raise
        finally:
            os.close(fd)
            if alive >= 0:
                os.close(alive)
        m = _Mapping("map", _native.map_address(mm) + (offset - start), size, access, r.token, pid=pid,
                     pidfd=pidfd, mm=mm, owner=owner, rkey=rkey)
        if watched:
            m.unwatch = self._loop.unwatch
        return m

    # -- data path ------------------------------------------------------------------
    #
    # One general path: post() / post_many() check the request against the mapping, then
    # _launch() / _launch_many() either copy now, on the calling thread, or hand the copy
    # over (_hand_over: the posted ring a result() caller may claim, else worker threads).
    # Beside it one fast path: inline_path()'s bound move, _copyloop.c's mover (none
    # without the compiled module: then every request takes the general path).

    def post(self, op: Operation) -> None:
        r = op.remote
        m = self._maps.get((r.epoch, r.region_id))
        if m is None or op.local.kind != "host" or r.kind != "host" or m.kind == "cuda_ipc":
            if m is None and op.length == 0 and op.local.kind == "host" and r.kind == "host":
                op.complete(0)
                return
            # Attaching is a control round trip and CUDA copies wait on a stream: post() never
            # waits on either, a worker does (then the same _launch).
            self._off_thread(self._attach_then, op)
            return
        self._launch(op, m, op.kind == "write", True)

    def inline_path(self, kind: str, local: Region, remote: Any) -> Any:
        """The fast path: one pair's move with the mapping resolved once (see Transport.inline_path).

        ``_copyloop.c``'s mover: it checks both ranges (``mp_fits``) against the
        sizes held here, copies up to 64 KiB under the mapping's lock (a
        revocation sets ``m.error`` under it), longer ones up to a chunk
        counted in ``inflight`` (which the revocation waits for), then the
        owner's liveness. None without the compiled module, in copy mode, or
        before the region is attached: the general path serves those.
        """
        mover = self._loop.mover
        if mover is None or self.copy_mode or local.kind != "host" or remote.kind != "host":
            return None
        m = self._maps.get((remote.epoch, remote.region_id))
        write = kind == "write"
        if m is None or m.kind == "cuda_ipc" or remote.token != m.token or not (m.can_write if write else m.can_read):
            return None
        lock = m.lock
        return mover(lock.acquire, lock.release, _MAPPING_ERROR, m.enter, m.exit, m, m.size, m.base, local.address,
                     local.size, m.pidfd, min(self._inline, self._chunk), _SMALL, write, m.kind != "map", m.pid)

    def _workers(self, node: int | None) -> Any:
        """The threads to copy into memory on NUMA node ``node``: pinned to that node's CPUs.

        On a single-node host, or when the node is unknown, the engine's
        workers. A copy's bandwidth is bound by the memory it writes; a copy
        thread on the far socket pays the interconnect on every line.
        """
        cpus = self._node_cpus.get(node) if node is not None and node >= 0 else None
        if cpus is None:
            return self.ctx.executor
        pool = self._near.get(node)  # type: ignore[arg-type]
        if pool is None:
            with self._lock:
                if self._closed:
                    raise EngineClosedError("the shm transport is closed")
                pool = self._near.get(node)  # type: ignore[arg-type]
                if pool is None:
                    pool = self._near[node] = ThreadPoolExecutor(  # type: ignore[index]
                        max(self._stripes, 1), thread_name_prefix=f"mpcomm-shm-n{node}", initializer=_pin,
                        initargs=(cpus, self.log))
        return pool

    def _off_thread(self, fn: Any, *args: Any) -> None:
        try:
            self.ctx.executor.submit(fn, *args)
        except RuntimeError as exc:  # the executor is shut down
            raise EngineClosedError(f"cannot schedule the shm request: {exc}") from exc

    def _attach_then(self, op: Operation) -> None:
        """Worker: attach (a control round trip, within the op's deadline), then the general path."""
        try:
            if op.abort_exc is not None:
                raise op.abort_exc
            m = self._mapping(op.remote, op.peer, op.deadline)
            self._launch(op, m, op.kind == "write", False)
        except BaseException as exc:  # noqa: BLE001 - reported through the operation
            op.fail(exc)

    @staticmethod
    def _refusal(op: Operation, m: _Mapping, write: bool) -> MpcommError:
        r = op.remote
        if r.token != m.token:
            # The cached mapping was granted to another token: ask nothing, refuse.
            return PermissionDeniedError(f"wrong token for region {r.name!r} on {r.address}", region=r.name,
                                         peer=r.address)
        if not (m.can_write if write else m.can_read):
            # The descriptor claimed more than the target granted (it is checked, not trusted).
            return PermissionDeniedError(f"region {r.name!r} on {r.address} may not be "
                                         f"{'written' if write else 'read'} (target grants {m.access!r})",
                                         region=r.name, peer=r.address)
        if not 0 <= op.remote_offset <= m.size - op.length:
            # The engine checked the descriptor; the mapping knows the size the target registered.
            return OutOfBoundsError(f"[{op.remote_offset}, {op.remote_offset + op.length}) is outside region "
                                    f"{r.name!r} of {m.size} bytes on {r.address}", region=r.name, peer=r.address)
        return OutOfBoundsError(f"[{op.local_offset}, {op.local_offset + op.length}) is outside the local region "
                                f"{op.local.name!r} of {op.local.size} bytes", region=op.local.name)

    def _launch(self, op: Operation, m: _Mapping, write: bool, posting: bool) -> None:
        """Copy ``op`` now on this thread, or hand it over (``posting``: this thread is the poster's).

        First the one check of a request against its mapping (a refusal raises). Now: up to
        ``inline_threshold`` on the poster (a hop costs more than it
        saves), and below ``stripe_threshold`` on a worker that attached; CUDA
        memory is never on the poster (post() sent it to a worker). Up to one
        chunk of host memory is one native call, held as the fast path holds it:
        up to 64 KiB under the mapping's lock (a revocation sets ``m.error``
        under it), longer counted in ``inflight`` (the revocation waits for it).
        Else handed over in pieces, ``stripes`` of them from ``stripe_threshold`` on.
        """
        n = op.length
        # What the target granted at attach (token, access, its size), and the local region the
        # copy takes its addresses from (the engine checked the descriptor, not the mapping).
        if op.remote.token != m.token or not (m.can_write if write else m.can_read) or \
                not 0 <= op.remote_offset <= m.size - n or not 0 <= op.local_offset <= op.local.size - n:
            raise self._refusal(op, m, write)
        host = op.local.kind == "host" and m.kind != "cuda_ipc"
        if n <= self._one_call and host and (n <= self._inline or not posting):
            # One native call, few frames: after a large copy the caches are cold and every
            # Python step costs a miss.
            la, ra = op.local.address + op.local_offset, m.base + op.remote_offset
            rc = 0
            if n <= _SMALL:
                lock = m.lock
                lock.acquire()
                try:
                    err = m.error
                    if err is None:
                        rc = self._move(m, write, la, ra, n)
                finally:
                    lock.release()
            else:
                err = m.enter()
                if err is None:
                    try:
                        rc = self._move(m, write, la, ra, n)
                    finally:
                        m.exit()
            if err is not None:
                e = _again(err, op.remote)
                if posting:
                    raise e
                op.fail(e)
            elif rc:
                op.fail(self._rc_error(rc, op.kind, op.remote, m))
            else:
                op.complete(n)
            return
        err = m.enter()
        if err is not None:
            e = _again(err, op.remote)
            if posting:
                raise e
            op.fail(e)
            return
        if n <= self._inline or not posting and (n < self._stripe_threshold or not host):
            try:
                if host:
                    self._chunks(op, m, write, op.local.address + op.local_offset, m.base + op.remote_offset, n)
                else:
                    self._device_move(m, write, op.local, op.local_offset, op.remote_offset, n, op.remote,
                                      op.deadline)
            except BaseException as exc:  # noqa: BLE001 - reported through the operation
                m.exit()
                op.fail(self._map_error(exc, op, m))
                return
            m.exit()
            op.complete(n)
            return
        local = op.local.address + op.local_offset
        remote = m.base + op.remote_offset
        pieces = 1
        if n >= self._stripe_threshold and self._stripes > 1:
            pieces = max(1, min(self._stripes, n // (self._stripe_threshold // 2)))
        step = -(-n // pieces)
        step += (-step) % PAGE
        starts = list(range(0, n, step))
        st = _Pieces(left=len(starts), mapping=m)
        op.state = st
        submit = self._hand_over(m.numa if write else op.local.numa_node, st.jobs if posting else None)
        # Striped: the workers take all pieces but the first, which the caller
        # copies itself (one thread hop less; the caller's core is not idle).
        inline_first = len(starts) > 1 and self._caller_stripes
        for i, s in enumerate(starts[1:] if inline_first else starts):
            try:
                submit(self._piece, op, st, write, local + s, remote + s, min(step, n - s))
            except RuntimeError as exc:  # the executor is shut down
                for _ in range(len(starts) - i):
                    self._piece_done(op, st, EngineClosedError(f"cannot schedule the copy: {exc}"))
                return
        if inline_first:
            self._piece(op, st, write, local, remote, min(step, n))

    def _hand_over(self, node: int | None, jobs: list[Any] | None) -> Any:
        """How a copy leaves this thread: ``submit(fn, *args)``. With ``jobs`` (the poster's) and the
        ring, each copy waits for its result() caller to claim it (``drive``), else a ring worker
        takes it after the claim window; otherwise (ring full, no ring: the Python copy loop or a
        NUMA host) the threads of :meth:`_workers`."""
        submit = self._workers(node).submit
        posted = self._posted
        if jobs is None or posted is None:
            return submit

        def claimable(fn: Any, *args: Any) -> None:
            job = posted.post(fn, *args)
            if job is None:
                submit(fn, *args)  # no free slot: the workers
            else:
                jobs.append(job)
        return claimable

    # -- vectorised batches ------------------------------------------------------------

    def post_many(self, group: OperationGroup) -> None:
        """N requests against one remote region: one bounds pass and one native call per ``chunk`` bytes."""
        r = group.remote
        m = self._maps.get((r.epoch, r.region_id))
        if m is None:
            self._off_thread(self._attach_then_many, group)
            return
        self._launch_many(group, m, True)

    def _attach_then_many(self, g: OperationGroup) -> None:
        try:
            if g.abort_exc is not None:
                raise g.abort_exc
            self._launch_many(g, self._mapping(g.remote, g.peer, g.deadline), False)
        except BaseException as exc:  # noqa: BLE001 - reported through the group
            g.fail(exc)

    def _launch_many(self, g: OperationGroup, m: _Mapping, posting: bool) -> None:
        """_launch for a batch: checked in one pass, then copied now (up to ``inline_threshold`` bytes of
        host memory on the poster; everything on a worker that attached) or handed over whole."""
        r = g.remote
        n = g.count
        write = g.kind == "write"
        if r.token != m.token or not (m.can_write if write else m.can_read):
            raise PermissionDeniedError(f"region {r.name!r} on {r.address} may not be "
                                        f"{'written' if write else 'read'} with this descriptor (target grants "
                                        f"{m.access!r})", region=r.name, peer=r.address)
        ro, lo, ln = g.remote_offsets, g.local_offsets, g.lengths
        # The target's size, not the descriptor's: one pass over the arrays, no Python loop per index.
        side, bad, total = self._loop.check2(ro, lo, ln, n, m.size, g.local.size)
        if side == "remote":
            raise OutOfBoundsError(f"request {bad} of the batch, [{ro[bad]}, {ro[bad] + ln[bad]}), is outside "
                                   f"region {r.name!r} of {m.size} bytes on {r.address}", region=r.name,
                                   peer=r.address)
        if side == "local":
            raise OutOfBoundsError(f"request {bad} of the batch, [{lo[bad]}, {lo[bad] + ln[bad]}), is outside the "
                                   f"local region {g.local.name!r} of {g.local.size} bytes", region=g.local.name)
        g.total = total  # summed by the check: the engine need not sum the lengths again
        err = m.enter()
        if err is not None:
            raise _again(err, r)
        if total <= self._inline and g.local.kind == "host" and m.kind != "cuda_ipc" or not posting:
            self._run_many(g, m, write)
            return
        try:
            g.state = []  # the posted copy, for drive()
            self._hand_over(m.numa if write else g.local.numa_node, g.state)(self._run_many, g, m, write)
        except RuntimeError as exc:  # the executor is shut down
            m.exit()
            raise EngineClosedError(f"cannot schedule the shm batch: {exc}") from exc

    def drive(self, op: Any, until: float) -> None:
        """The result() caller runs the posted copies of ``op`` nobody started yet, one at a time, on
        its own thread (GIL released in the copy loop); a piece a worker took meanwhile is left to it
        (a striped copy keeps its parallel pieces). See _posted.py."""
        st = op.state
        jobs = st.jobs if isinstance(st, _Pieces) else st if isinstance(st, list) else None
        posted = self._posted
        if not jobs or posted is None:
            return
        for job in list(jobs):
            if time.monotonic() >= until:
                return
            if posted.claim(job):
                job.run()

    def _run_many(self, g: OperationGroup, m: _Mapping, write: bool) -> None:
        """Copy the group ``chunk`` bytes per native call; indices done before a failure complete."""
        n = g.count
        ro, lo, ln = g.remote_offsets, g.local_offsets, g.lengths
        la, lsize = g.local.address, g.local.size
        loop, chunk = self._loop, self._chunk
        device = g.local.kind != "host" or m.kind == "cuda_ipc"  # CUDA memory on either side
        one_by_one = device or self.copy_mode  # else one native call moves many pieces
        i = 0
        err: BaseException | None = None
        try:
            while i < n:
                if g.abort_exc is not None:
                    err = g.abort_exc
                    break
                if m.error is not None:
                    err = m.error
                    break
                if i and time.monotonic() > g.deadline:
                    err = _deadline_passed(g, f"shm batch of {n} passed its deadline after {i} requests")
                    break
                if one_by_one:
                    a, b, k = lo[i], ro[i], ln[i]
                    if not (0 <= k <= lsize and k <= m.size and 0 <= a <= lsize - k and 0 <= b <= m.size - k):
                        nxt = -errno.ERANGE  # checked again at the point of use, as the copy loops do
                    elif device:
                        self._device_move(m, write, g.local, int(a), int(b), int(k), g.remote, g.deadline)
                        nxt = i + 1
                    else:
                        rc = self._copy(m, write, la + a, m.base + b, k)
                        nxt = rc if rc else i + 1
                elif m.kind == "map":
                    nxt = loop.copy_many(m.base, m.size, ro, la, lsize, lo, ln, i, n, chunk, m.pidfd) if write else \
                        loop.copy_many(la, lsize, lo, m.base, m.size, ro, ln, i, n, chunk, m.pidfd)
                else:
                    nxt = loop.cma_many(m.pid, write, la, lsize, lo, m.base, m.size, ro, ln, i, n, chunk, m.pidfd)
                if nxt < 0:
                    err = self._rc_error(nxt, g.kind, g.remote, m)
                    break
                i = nxt
        except BaseException as exc:  # noqa: BLE001 - reported through the group
            err = self._map_error(exc, g, m)
        m.exit()
        if err is None:
            g.complete()
            return
        if i:
            g.complete(range(i))
        g.fail(err)

    def _chunks(self, op: Operation, m: _Mapping, write: bool, local: int, remote: int, length: int) -> None:
        """Copy ``length`` bytes a chunk at a time, stopping for abort, deadline or revocation."""
        chunk = self._chunk
        copy = self._copy if self.copy_mode else self._move
        pos = 0
        while True:
            if op.abort_exc is not None:
                raise op.abort_exc
            if m.error is not None:
                raise m.error
            k = min(chunk, length - pos)
            rc = copy(m, write, local + pos, remote + pos, k)
            if rc:
                raise self._rc_error(rc, op.kind, op.remote, m)
            pos += k
            if pos >= length:
                return
            if time.monotonic() > op.deadline:
                raise _deadline_passed(op, f"shm {op.kind} of {length} bytes passed its deadline after {pos} bytes")

    def _piece(self, op: Operation, st: _Pieces, write: bool, local: int, remote: int, length: int) -> None:
        err: BaseException | None = None
        try:
            self._chunks(op, st.mapping, write, local, remote, length)
        except BaseException as exc:  # noqa: BLE001
            err = exc
        self._piece_done(op, st, err)

    def _piece_done(self, op: Operation, st: _Pieces, err: BaseException | None) -> None:
        with st.lock:
            if err is not None and st.error is None:
                st.error = err
            st.left -= 1
            last = st.left == 0
        if not last:
            return
        st.mapping.exit()
        if st.error is None:
            op.complete(op.length)
        else:
            op.fail(self._map_error(st.error, op, st.mapping))

    def _copy(self, m: _Mapping, write: bool, local: int, remote: int, n: int) -> int:
        """One contiguous move (0 or -errno), through the bounce buffer in copy mode."""
        if not self.copy_mode:
            return self._move(m, write, local, remote, n)
        bounce = self._bounce()
        b = self._bounce_size
        for pos in range(0, n, b):
            k = min(b, n - pos)
            if write:
                _native.memcpy(bounce, local + pos, k)
                rc = self._move(m, True, bounce, remote + pos, k)
            else:
                rc = self._move(m, False, bounce, remote + pos, k)
                _native.memcpy(local + pos, bounce, k)
            if rc:
                return rc
        return 0

    def _move(self, m: _Mapping, write: bool, local: int, remote: int, n: int) -> int:
        if m.kind == "map":
            if write:
                return self._loop.copy(remote, local, n, m.pidfd)
            return self._loop.copy(local, remote, n, m.pidfd)
        return self._loop.cma(m.pid, write, local, remote, n, m.pidfd)

    def _bounce(self) -> int:
        buf = getattr(self._tls, "bounce", None)
        if buf is None:
            buf = self._tls.bounce = ctypes.create_string_buffer(self._bounce_size)
        return ctypes.addressof(buf)

    def _rc_error(self, rc: int, kind: str, r: Any, m: _Mapping) -> MpcommError:
        """A copy-loop error code as an mpcomm error; a dead owner also ends the mapping."""
        code = -rc
        if code == errno.ESRCH:
            # Not retryable: no transport reaches a process that exited (a
            # restarted peer has a new epoch, and the descriptor is stale).
            err = PeerConnectionError(f"shm: the process owning region {r.name!r} on {r.address} (pid {m.pid}) has "
                                      "exited; nobody will read these bytes", peer=r.address, region=r.name,
                                      retryable=False)
            m.revoke(err)  # later requests fail at once; unmapped when no copy runs
            return err
        if code in (errno.EPERM, errno.EACCES):
            return PermissionDeniedError(f"shm: cross-memory attach to pid {m.pid} denied: {os.strerror(code)}",
                                         peer=r.address, region=r.name)
        if code == errno.ERANGE:
            return OutOfBoundsError(f"shm {kind}: a range of the batch is outside region {r.name!r} ({m.size} bytes) "
                                    "or the local region; it was refused at the copy, nothing of it moved",
                                    peer=r.address, region=r.name)
        if code == errno.EFAULT:
            return TransferError(f"shm: region {r.name!r} is no longer mapped in pid {m.pid}; the range may be "
                                 "partly written", peer=r.address, region=r.name)
        return TransferError(f"shm {kind}: {os.strerror(code)}", peer=r.address, region=r.name)

    @staticmethod
    def _map_error(exc: BaseException, op: Any, m: _Mapping) -> BaseException:
        if isinstance(exc, MpcommError) or not isinstance(exc, OSError):
            return exc
        r = op.remote
        return TransferError(f"shm {op.kind}: {exc}", peer=r.address, region=r.name)

    def abort(self, op: Any) -> None:
        """Nothing to interrupt: copies check ``abort_exc`` between chunks."""

    def peer_changed(self, peer: PeerInfo) -> None:
        err = PeerConnectionError(f"peer {peer.address} is gone or restarted", peer=peer.address)
        with self._lock:
            keys = [k for k in self._maps if k[0] == peer.epoch]
            maps = [self._maps.pop(k) for k in keys]
            for m in maps:
                self._by_rkey.pop(m.rkey, None)
            self._reach_cache.pop((peer.node_id, peer.epoch), None)
        for m in maps:
            m.revoke(err)  # unmapped by the last copy that still runs
        # Attachments it holds on our regions stay recorded: a lost link is not
        # a dead initiator, and unregister must still revoke a live one.

    def close(self) -> None:
        self._closed = True
        if self._posted is not None:
            self._posted.close()  # its workers still run the copies that wait (they see the abort)
        if self._listener is not None:
            try:
                self._listener.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self._listener.close()
        with self._lock:
            maps = list(self._maps.values())
            self._maps.clear()
            self._by_rkey.clear()
            served = list(self._served.values())
            self._served.clear()
        grace = self.ctx.config.runtime.abort_grace_ms / 1000
        busy = [m for m in maps if not m.revoke(EngineClosedError("the engine is closed"), grace)]
        # A copy still running writes into (or reads from) a caller's buffer, which the engine
        # hands back once close() returns: wait until it is over. It is bounded: every copy was
        # aborted, stops at its next chunk (one native call of at most `chunk` bytes, and a
        # memcpy or process_vm_* call terminates), and a worker job not started yet sees the
        # abort first. No deadline shorter than that copy can be right, so there is none; a
        # WARNING says why close() takes long.
        waited = 0.0
        while busy:
            busy = [m for m in busy if not m.wait_idle(1.0)]
            waited += 1.0
            if busy:
                self.log.warning("closing: %d shm copies still run into local buffers after %.0f s; close() "
                                 "waits for them (the buffers are handed back only after)", len(busy), waited)
        with self._lock:
            near, self._near = list(self._near.values()), {}
        for pool in near:
            pool.shutdown(wait=False, cancel_futures=False)
        pinned = getattr(self, "_pinned", None)
        if pinned is not None:
            pinned.close()
        for s in served:
            with s.lock:
                s.closed = True
                if s.seg is not None and s.seg.fd >= 0:
                    os.close(s.seg.fd)
                    s.seg.fd = -1


def _claimed_access(remote: Any) -> str:
    """The rights a descriptor claims, as an attach asks for them ("r", "w" or "rw")."""
    access = "".join(c for c in "rw" if c in str(getattr(remote, "access", "r")))
    return access or "r"


def _numa_nodes() -> tuple[Any, ...]:
    """This host's NUMA nodes with their CPUs (sysfs), for the near copy threads."""
    from mpcomm.topology import discover_numa

    try:
        return discover_numa()
    except OSError:
        return ()


def _pin(cpus: tuple[int, ...], log: logging.Logger) -> None:
    """Thread initializer: run this copy thread on ``cpus`` only (Linux: 0 is the calling thread)."""
    try:
        os.sched_setaffinity(0, cpus)
    except (OSError, ValueError) as exc:  # a cpuset that excludes them: copy from wherever we are
        log.debug("shm: could not pin a copy thread to CPUs %s: %s", cpus, exc)


def _deadline_passed(op: Any, why: str) -> BaseException:
    """The copy loop saw ``op``'s deadline pass: stop it as the engine's timer would.

    The timeout is recorded as the request's abort (first reason wins, so a
    timer or cancel that came first stays the reason), which tells the engine
    it is the caller's deadline and no failure of the path: it must not cool
    down a healthy peer because a caller allowed 1 ms for 64 MiB.
    """
    err = TransferTimeout(why, region=op.remote.name, peer=op.remote.address)
    op.abort(err)
    return op.abort_exc or err


def _again(err: MpcommError, r: Any) -> MpcommError:
    """A mapping's stored error, raised anew for one request (same class and retryability)."""
    return type(err)(f"{err}: {r.name!r} on {r.address}", region=r.name, peer=r.address, retryable=err.retryable)


def _pidfd_open(pid: int) -> int:
    """A pidfd for ``pid`` (-1 when the kernel or Python lacks them, or the pid is gone)."""
    fn = getattr(os, "pidfd_open", None)
    if fn is None or pid <= 0:
        return -1
    try:
        return int(fn(pid))
    except OSError as exc:
        logging.getLogger("mpcomm.transport.shm").debug("shm: pidfd_open(%d) failed: %s", pid, exc)
        return -1


def _fcntl_seals(fd: int) -> int:
    import fcntl

    try:
        return int(fcntl.fcntl(fd, _native.F_GET_SEALS))
    except OSError:
        return 0


logging.getLogger("mpcomm.transport.shm").addHandler(logging.NullHandler())
