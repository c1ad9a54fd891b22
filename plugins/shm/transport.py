"""The shm transport: one-copy transfers between processes of one host.

Two routes, chosen per region when an initiator first touches it:

* **Mapped (memfd).** ``Engine.allocate`` memory comes from this transport: a
  ``memfd`` sealed against shrinking and growing (``F_SEAL_SHRINK |
  F_SEAL_GROW | F_SEAL_SEAL``) and pre-faulted. An initiator *attaches* to the
  region once (a control-channel request carrying the region's token; the
  target records who attached), then fetches the fd from the target's private
  ``AF_UNIX`` listener (abstract namespace) with ``SCM_RIGHTS``, presenting the
  token and the one-time nonce the attach returned. It checks the seals and
  the size, maps exactly the region's pages, closes the fd, and from then on a
  write or read is one ``memcpy`` by the initiator, no work on the target.
* **Cross-memory attach (CMA).** Any other buffer (a bytearray, a numpy array)
  moves with ``process_vm_writev`` / ``process_vm_readv``: one kernel copy
  straight into the target's address space. It needs the same PID namespace
  and ptrace rights over the target; the initiator probes that once per peer
  (reading a cookie the peer published) and the target advertises CMA only
  when its ptrace policy can allow it.

Every copy is a ``CDLL`` call (libc ``memcpy`` or the syscall), so the GIL is
released while bytes move: transfers of at least ``stripe_threshold`` bytes
are split into up to ``stripes`` pieces on the engine's workers; requests up to
``inline_threshold`` bytes are copied on the caller's thread inside
:meth:`ShmTransport.post` (no thread hop); sizes between run as one piece on a
worker. Pieces copy ``chunk`` bytes at a time and check for an abort between
chunks, so a cancel or timeout stops within one chunk (``inflight_cancel``).

``copy`` mode stages every chunk through a per-thread bounce buffer (source →
bounce → destination: two copies), for the zero-copy vs copy comparison.

**Completion and ordering.** A request completes once the initiator's copy
returned: every byte is in the target's memory. The engine then sends the
request's notification over the control socket; the send and the receive are
system calls on a socket, which order memory on every architecture Linux
supports, so a target that has received the notification (``wait_notification``
or a callback) reads every byte of that request. Nothing is promised about the
order of bytes *within* a request (pieces run in parallel): do not poll a flag
written by the same request; write it with a later request, or use the
notification.

**Lifetimes.** Nothing a target does can crash an initiator: a mapped memfd
cannot shrink (sealed, and the initiator refuses an fd without the seal), so a
mapped page never disappears (no SIGBUS), and the pages live while anyone maps
them, even after the target exits. When the target unregisters a region, its
transport *revokes* it at every initiator that attached: the initiator marks
the region revoked, stops its in-flight copies at the next chunk (they fail
with UnknownRegionError), waits until none runs, unmaps it and answers; only
then does ``Engine.unregister`` return on the target, so the buffer may be
freed. Later requests on that descriptor fail with UnknownRegionError. A peer
that died (its control link dropped) or restarted has its mappings dropped
(:meth:`ShmTransport.peer_changed`); a CMA copy to a process that is gone
fails with PeerConnectionError (``ESRCH``). If a revocation cannot be
delivered within ``revoke_timeout`` (a hung, but live, initiator), the target
logs it and keeps a reference to the buffer, so a late copy lands in memory
that is still allocated.
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
import sys
import threading
from dataclasses import dataclass, field
from typing import Any, ClassVar

from mpcomm import Availability, Capabilities, Operation, Region, Transport, TransportContext
from mpcomm.errors import (
    EngineClosedError,
    MpcommError,
    OutOfBoundsError,
    PeerConnectionError,
    PermissionDeniedError,
    ProtocolError,
    TransferError,
    TransportUnavailable,
    UnknownRegionError,
)
from mpcomm.memory import check_allocatable
from mpcomm.peer import PeerInfo, same_host

from . import _native

PAGE = mmap.PAGESIZE
_MAX_MSG = 4096


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
    """Target side: a region registered with shm and who attached to it."""

    region: Region
    seg: _Segment | None
    lock: threading.Lock = field(default_factory=threading.Lock)
    attached: dict[str, PeerInfo] = field(default_factory=dict)  # node_id -> peer
    nonces: set[str] = field(default_factory=set)
    closed: bool = False


class _Mapping:
    """Initiator side: how to reach one remote region, with an in-flight count for revocation."""

    __slots__ = ("kind", "base", "size", "access", "token", "pid", "mm", "inflight", "error", "_lock", "_idle")

    def __init__(self, kind: str, base: int, size: int, access: str, token: int, pid: int = 0,
                 mm: mmap.mmap | None = None) -> None:
        self.kind = kind  # "map" (our mapping of the memfd) or "cma" (an address in pid)
        self.base = base
        self.size = size
        self.access = access  # what the target says, not what the descriptor claims
        self.token = token  # the token the target accepted at attach time
        self.pid = pid
        self.mm = mm
        self.inflight = 0
        self.error: MpcommError | None = None
        self._lock = threading.Lock()  # raw lock: enter/exit sit on the small-request path
        self._idle = threading.Condition(self._lock)

    def enter(self) -> MpcommError | None:
        lock = self._lock
        lock.acquire()
        if self.error is not None:
            lock.release()
            return self.error
        self.inflight += 1
        lock.release()
        return None

    def exit(self) -> None:
        lock = self._lock
        lock.acquire()
        self.inflight -= 1
        if self.inflight == 0 and self.error is not None:
            self._unmap()
            self._idle.notify_all()
        lock.release()

    def revoke(self, error: MpcommError, wait: float = 0.0) -> bool:
        """Refuse new copies; True once no copy runs (after up to ``wait`` seconds)."""
        with self._idle:
            if self.error is None:
                self.error = error
            if wait > 0:
                self._idle.wait_for(lambda: self.inflight == 0, wait)
            if self.inflight == 0:
                self._unmap()
                return True
            return False

    def _unmap(self) -> None:
        mm, self.mm = self.mm, None
        if mm is not None:
            try:
                mm.close()
            except (BufferError, ValueError, OSError):  # pragma: no cover - we never export it
                pass


@dataclass(eq=False)
class _Pieces:
    left: int
    mapping: _Mapping
    lock: threading.Lock = field(default_factory=threading.Lock)
    error: BaseException | None = None


class ShmTransport(Transport):
    """Same-host transfers through shared memory (memfd) or cross-memory attach."""

    name: ClassVar[str] = "shm"
    # post() copies at most inline_threshold bytes on the caller's thread; the
    # first attach waits on the peer with the request's own deadline.
    post_may_block: ClassVar[bool] = False
    capabilities: ClassVar[Capabilities] = Capabilities(
        memory_kinds=frozenset({"host"}),
        intra_node=True,
        inter_node=False,
        one_sided=True,  # the target's CPU takes no part in a transfer
        zero_copy=True,
        inflight_cancel=True,
        modes=frozenset({"zero-copy", "copy"}),
    )
    default_options: ClassVar[dict[str, Any]] = {
        "cma": True,  # use (initiator) and offer (target) cross-memory attach for non-memfd buffers
        "allow_any_ptracer": True,  # under Yama ptrace_scope=1, let same-uid peers attach (PR_SET_PTRACER_ANY)
        "inline_threshold": 256 << 10,  # copy requests up to this size on the caller's thread
        "stripe_threshold": 1 << 20,  # split requests at least this large over workers
        "stripes": 0,  # pieces per striped request; 0 = min(4, CPUs)
        "caller_stripes": False,  # True: the caller copies the first stripe itself (post blocks for it)
        "chunk": 4 << 20,  # abort-check granularity of a piece
        "bounce_size": 1 << 20,  # copy mode's per-thread staging buffer
        "revoke_timeout": 2.0,  # seconds a target waits for an initiator to drop a region
    }

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
        self._use_cma = bool(o["cma"]) and not _native.cma_available()
        self._serve_cma = False
        self._serve_cma_reason = ""
        self._closed = False
        self._lock = threading.Lock()
        # target side
        self._served: dict[int, _Served] = {}
        self._quarantine: list[Any] = []
        self._listener: socket.socket | None = None
        self._sock_name = ""
        self._cookie = ctypes.c_uint64(secrets.randbits(63))
        # initiator side
        self._maps: dict[tuple[str, int], _Mapping] = {}
        self._revoked: set[tuple[str, int]] = set()
        self._attaching: dict[tuple[str, int], threading.Lock] = {}
        self._reach_cache: dict[tuple[str, str], Availability] = {}
        self._tls = threading.local()

    @classmethod
    def availability(cls) -> Availability:
        if not sys.platform.startswith("linux"):
            return Availability.no("needs Linux (memfd_create, process_vm_writev)")
        if not hasattr(os, "memfd_create"):
            return Availability.no("os.memfd_create is missing")
        return Availability.yes("memfd + SCM_RIGHTS; cross-memory attach for other buffers")

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
        threading.Thread(target=self._fd_loop, name="mpcomm-shm-fds", daemon=True).start()
        return {
            "socket": name,
            "cma": self._serve_cma,
            "cma_reason": self._serve_cma_reason,
            "probe": ctypes.addressof(self._cookie),
            "cookie": self._cookie.value,
        }

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
        if region.kind != "host":
            return None
        seg = region.backing if isinstance(region.backing, _Segment) and region.backing.owner is self else None
        if seg is None and not self._serve_cma:
            return None  # the engine routes this region over the next transport
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
            peers = list(served.attached.values())
            served.attached.clear()
            served.nonces.clear()
            if served.seg is not None and served.seg.fd >= 0:
                os.close(served.seg.fd)
                served.seg.fd = -1
        for peer in peers:
            self._revoke_at(peer, region)

    def _revoke_at(self, peer: PeerInfo, region: Region) -> None:
        timeout = float(self.ctx.options["revoke_timeout"])
        try:
            self.ctx.control(peer, self.name, {"op": "revoke", "region_id": region.id}, timeout)
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
        sock = self._listener
        assert sock is not None
        while not self._closed:
            try:
                conn, _ = sock.accept()
            except OSError:
                return
            try:
                conn.settimeout(2.0)
                self._send_fd(conn)
            except Exception as exc:  # noqa: BLE001 - a bad client must not stop the listener
                self.log.debug("shm: fd request failed: %s", exc)
            finally:
                conn.close()

    def _send_fd(self, conn: socket.socket) -> None:
        try:
            req = json.loads(conn.recv(_MAX_MSG))
            rid, token, nonce = int(req["region_id"]), int(req["token"]), str(req["nonce"])
        except (ValueError, KeyError, TypeError):
            conn.sendall(b'{"error": "malformed request"}')
            return
        with self._lock:
            served = self._served.get(rid)
        if served is None or served.seg is None:
            conn.sendall(b'{"error": "no such shared-memory region"}')
            return
        with served.lock:
            if served.closed or token != served.region.token or nonce not in served.nonces:
                conn.sendall(b'{"error": "refused"}')
                return
            served.nonces.discard(nonce)
            seg = served.seg
            head = json.dumps({"offset": seg.offset, "size": served.region.size, "total": seg.total}).encode()
            socket.send_fds(conn, [head], [seg.fd])

    def handle_control(self, peer: PeerInfo | None, body: dict[str, Any]) -> dict[str, Any]:
        op = body.get("op")
        if peer is None:
            raise PermissionDeniedError("shm control requests need an identified peer")
        if op == "attach":
            return self._handle_attach(peer, body)
        if op == "revoke":
            key = (peer.epoch, int(body["region_id"]))
            self._revoke_local(key, float(self.ctx.options["revoke_timeout"]))
            return {"ok": True}
        raise ProtocolError(f"unknown shm control request {op!r}")

    def _handle_attach(self, peer: PeerInfo, body: dict[str, Any]) -> dict[str, Any]:
        rid = int(body["region_id"])
        with self._lock:
            served = self._served.get(rid)
        if served is None:
            raise UnknownRegionError(f"no region with id {rid} is registered with shm here")
        region = self.ctx.regions.serve(rid, int(body["token"]), body.get("epoch"), 0, 0, served.region.access[0])
        region.release()
        nonce = secrets.token_hex(16)
        with served.lock:
            if served.closed:
                raise UnknownRegionError(f"region {region.name!r} was unregistered", region=region.name)
            served.attached[peer.node_id] = peer
            if served.seg is not None:
                served.nonces.add(nonce)
        return {
            "kind": "memfd" if served.seg is not None else "cma",
            "nonce": nonce,
            "base": region.address,
            "size": region.size,
            "access": region.access,
        }

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

    def _mapping(self, op: Operation) -> _Mapping:
        r = op.remote
        key = (r.epoch, r.region_id)
        m = self._maps.get(key)
        if m is not None:
            return m
        with self._lock:
            lock = self._attaching.setdefault(key, threading.Lock())
        with lock:
            m = self._maps.get(key)
            if m is None:
                m = self._attach(op, key)
        return m

    def _attach(self, op: Operation, key: tuple[str, int]) -> _Mapping:
        r, peer = op.remote, op.peer
        if key in self._revoked:
            raise UnknownRegionError(f"region {r.name!r} was unregistered by its owner", region=r.name, peer=r.address)
        timeout = max(op.time_left(), 0.001)
        reply = self.ctx.control(peer, self.name, {"op": "attach", "region_id": r.region_id, "token": r.token,
                                                   "epoch": r.epoch}, timeout)
        size = int(reply["size"])
        if size != r.size:
            raise OutOfBoundsError(f"region {r.name!r} is {size} bytes, the descriptor says {r.size}",
                                   region=r.name, peer=r.address)
        access = str(reply["access"])
        m: _Mapping | None = None
        why = ""
        if reply["kind"] == "memfd":
            why = self._memfd_reason(peer)
            if not why:
                m = self._map_fd(op, reply, timeout)
        if m is None:
            cma_why = self._cma_reason(peer)
            if cma_why:
                raise TransportUnavailable(f"shm cannot reach region {r.name!r}: {why or cma_why}",
                                           region=r.name, peer=r.address)
            m = _Mapping("cma", int(reply["base"]), size, access, r.token, pid=int(peer.host["pid"]))
        with self._lock:
            if key in self._revoked:
                m.revoke(UnknownRegionError("unregistered"))
                raise UnknownRegionError(f"region {r.name!r} was unregistered by its owner", region=r.name,
                                         peer=r.address)
            self._maps[key] = m
            self._attaching.pop(key, None)
        return m

    def _map_fd(self, op: Operation, reply: dict[str, Any], timeout: float) -> _Mapping:
        r = op.remote
        name = str(op.peer.transports[self.name]["socket"])
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(min(timeout, 5.0))
            try:
                s.connect("\0" + name)
                s.sendall(json.dumps({"region_id": r.region_id, "token": r.token, "nonce": reply["nonce"]}).encode())
                msg, fds, _flags, _addr = socket.recv_fds(s, _MAX_MSG, 1)
            except OSError as exc:
                raise PeerConnectionError(f"shm: fetching the fd of {r.name!r} failed: {exc}", peer=r.address) from exc
        if not fds:
            try:
                why = json.loads(msg).get("error", "no fd")
            except ValueError:
                why = "malformed answer"
            raise PermissionDeniedError(f"shm: {r.address} refused the fd of {r.name!r}: {why}",
                                        region=r.name, peer=r.address)
        fd = fds[0]
        try:
            head = json.loads(msg)
            offset, size, total = int(head["offset"]), int(head["size"]), int(head["total"])
            seals = _fcntl_seals(fd)
            if not seals & _native.F_SEAL_SHRINK:
                raise ProtocolError(f"shm: the fd of {r.name!r} is not sealed against shrinking; refusing to map it")
            st = os.fstat(fd)
            if size != r.size or offset < 0 or offset + size > min(total, st.st_size):
                raise OutOfBoundsError(f"shm: the fd of {r.name!r} does not hold the region", region=r.name)
            start = offset - offset % mmap.ALLOCATIONGRANULARITY
            prot = mmap.PROT_READ | (mmap.PROT_WRITE if "w" in str(reply.get("access", "")) else 0)
            mm = mmap.mmap(fd, offset + size - start, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0),
                           prot=prot, offset=start)
        finally:
            os.close(fd)
        return _Mapping("map", _native.map_address(mm) + (offset - start), size, str(reply["access"]), r.token, mm=mm)

    def _revoke_local(self, key: tuple[str, int], wait: float) -> None:
        with self._lock:
            self._revoked.add(key)
            m = self._maps.pop(key, None)
        if m is not None:
            err = UnknownRegionError("the region was unregistered by its owner")
            if not m.revoke(err, wait):
                self.log.warning("shm: copies into a revoked region did not stop within %.1fs", wait)

    # -- data path ------------------------------------------------------------------

    def post(self, op: Operation) -> None:
        n = op.length
        if n == 0:
            op.complete(0)
            return
        m = self._mapping(op)
        write = op.kind == "write"
        if op.remote.token != m.token:
            # The cached mapping was granted to another token: ask nothing, refuse.
            raise PermissionDeniedError(f"wrong token for region {op.remote.name!r} on {op.remote.address}",
                                        region=op.remote.name, peer=op.remote.address)
        if ("w" if write else "r") not in m.access:
            # The descriptor claimed more than the target granted (it is checked, not trusted).
            raise PermissionDeniedError(f"region {op.remote.name!r} on {op.remote.address} may not be "
                                        f"{'written' if write else 'read'} (target grants {m.access!r})",
                                        region=op.remote.name, peer=op.remote.address)
        if op.remote_offset + n > m.size:
            # The engine checked the descriptor; the mapping knows the size the target registered.
            raise OutOfBoundsError(f"[{op.remote_offset}, {op.remote_offset + n}) is outside region "
                                   f"{op.remote.name!r} of {m.size} bytes on {op.remote.address}",
                                   region=op.remote.name, peer=op.remote.address)
        err = m.enter()
        if err is not None:
            raise type(err)(f"{err}: {op.remote.name!r} on {op.remote.address}", region=op.remote.name,
                            peer=op.remote.address)
        local = op.local.address + op.local_offset
        remote = m.base + op.remote_offset
        if n <= self._inline:
            try:
                self._copy(m, write, local, remote, n)
            except BaseException as exc:  # noqa: BLE001 - reported through the operation
                m.exit()
                op.fail(self._map_error(exc, op, m))
                return
            m.exit()
            op.complete(n)
            return
        pieces = 1
        if n >= self._stripe_threshold and self._stripes > 1:
            pieces = max(1, min(self._stripes, n // (self._stripe_threshold // 2)))
        step = -(-n // pieces)
        step += (-step) % PAGE
        starts = list(range(0, n, step))
        st = _Pieces(left=len(starts), mapping=m)
        op.state = st
        submit = self.ctx.executor.submit
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

    def _piece(self, op: Operation, st: _Pieces, write: bool, local: int, remote: int, length: int) -> None:
        err: BaseException | None = None
        m = st.mapping
        chunk = self._chunk
        try:
            pos = 0
            while pos < length:
                if op.abort_exc is not None:
                    raise op.abort_exc
                if m.error is not None:
                    raise m.error
                k = min(chunk, length - pos)
                self._copy(m, write, local + pos, remote + pos, k)
                pos += k
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

    def _copy(self, m: _Mapping, write: bool, local: int, remote: int, n: int) -> None:
        if not self.copy_mode:
            self._move(m, write, local, remote, n)
            return
        bounce = self._bounce()
        b = self._bounce_size
        for pos in range(0, n, b):
            k = min(b, n - pos)
            if write:
                _native.memcpy(bounce, local + pos, k)
                self._move(m, True, bounce, remote + pos, k)
            else:
                self._move(m, False, bounce, remote + pos, k)
                _native.memcpy(local + pos, bounce, k)

    @staticmethod
    def _move(m: _Mapping, write: bool, local: int, remote: int, n: int) -> None:
        if m.kind == "map":
            if write:
                _native.memcpy(remote, local, n)
            else:
                _native.memcpy(local, remote, n)
        else:
            _native.cma_one(write, m.pid, local, remote, n)

    def _bounce(self) -> int:
        buf = getattr(self._tls, "bounce", None)
        if buf is None:
            buf = self._tls.bounce = ctypes.create_string_buffer(self._bounce_size)
        return ctypes.addressof(buf)

    @staticmethod
    def _map_error(exc: BaseException, op: Operation, m: _Mapping) -> BaseException:
        r = op.remote
        if isinstance(exc, MpcommError) or not isinstance(exc, OSError):
            return exc
        if exc.errno == errno.ESRCH:
            return PeerConnectionError(f"shm: the process of {r.address} (pid {m.pid}) is gone", peer=r.address,
                                       region=r.name)
        if exc.errno in (errno.EPERM, errno.EACCES):
            return PermissionDeniedError(f"shm: cross-memory attach to pid {m.pid} denied: {exc.strerror}",
                                         peer=r.address, region=r.name)
        if exc.errno == errno.EFAULT:
            return TransferError(f"shm: region {r.name!r} is no longer mapped in pid {m.pid}; the range may be "
                                 "partly written", peer=r.address, region=r.name)
        return TransferError(f"shm {op.kind}: {exc}", peer=r.address, region=r.name)

    def abort(self, op: Operation) -> None:
        """Nothing to interrupt: pieces check ``op.aborted`` between chunks."""

    def peer_changed(self, peer: PeerInfo) -> None:
        err = PeerConnectionError(f"peer {peer.address} is gone or restarted", peer=peer.address)
        with self._lock:
            keys = [k for k in self._maps if k[0] == peer.epoch]
            maps = [self._maps.pop(k) for k in keys]
            self._reach_cache.pop((peer.node_id, peer.epoch), None)
            served = list(self._served.values())
        for m in maps:
            m.revoke(err)  # unmapped by the last copy that still runs
        for s in served:
            with s.lock:
                s.attached.pop(peer.node_id, None)

    def close(self) -> None:
        self._closed = True
        if self._listener is not None:
            try:
                self._listener.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self._listener.close()
        with self._lock:
            maps = list(self._maps.values())
            self._maps.clear()
            served = list(self._served.values())
            self._served.clear()
        grace = self.ctx.config.runtime.abort_grace_ms / 1000
        for m in maps:
            m.revoke(EngineClosedError("the engine is closed"), grace)
        for s in served:
            with s.lock:
                s.closed = True
                if s.seg is not None and s.seg.fd >= 0:
                    os.close(s.seg.fd)
                    s.seg.fd = -1


def _fcntl_seals(fd: int) -> int:
    import fcntl

    try:
        return int(fcntl.fcntl(fd, _native.F_GET_SEALS))
    except OSError:
        return 0


logging.getLogger("mpcomm.transport.shm").addHandler(logging.NullHandler())
