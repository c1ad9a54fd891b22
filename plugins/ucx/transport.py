"""The ucx transport: one-sided puts and gets through UCX's UCP API.

The native calls live in :mod:`mpcomm.plugins.ucx._ucp` (a ctypes binding to
the libucp that the ``libucx-cu12`` wheel ships; ``ucxx``'s Python layer does
not wrap RMA). Nothing here loads UCX before :meth:`UcxTransport.availability`
or :meth:`UcxTransport.start` runs.

Layout. One UCP context and one worker per engine. ``start()`` publishes the
worker address (hex) to peers; ``register(region)`` maps the region
(``ucp_mem_map``) and puts the packed rkey, base address and size into the
region's descriptor. An endpoint per peer worker is created on first use and
caches the unpacked rkeys of that peer's regions.

Progress. One progress thread per engine. Idle, it sleeps on the worker's event
fd (``ucp_worker_arm`` + ``select``; ``ucp_worker_signal`` wakes it): no CPU
without traffic. While anything is outstanding, or for ``spin_us`` after the
last event, it polls ``ucp_worker_progress`` and yields the CPU between polls
(``sched_yield``), so the caller's thread keeps its core on a 2-core machine.
The same thread serves peers: with peer error handling, RMA to this worker is
emulated with active messages over tcp and needs this worker to progress.
Requests up to ``inline_threshold`` bytes are issued and, for up to
``inline_spin_us``, progressed on the caller's thread (no thread hop); what
is not done by then is handed to the progress thread. Measured here: inline
wins on shared memory (error handling off), the thread wins over tcp, so the
default (-1) inlines up to 64 KiB only with error handling off.

Large transfers are split into ``chunk``-byte puts/gets with at most
``window`` bytes outstanding per request; a write ends with one endpoint flush
(remote completion). A read is complete when its gets are.

Abort (timeout, cancel, peer lost). ``ucp_request_cancel`` does nothing to RMA
requests, and a forced endpoint close does not stop bytes already handed to
the kernel on the tcp path (they land when the target next progresses —
measured), so abort is a *fence*: stop issuing, flush the endpoint, and call
``op.fail`` once every outstanding request and the flush completed — then no
more byte of the request can land. A peer UCX reports as failed (peer error
handling) or the engine reports lost (``peer_changed``) ends the wait at once:
the endpoint is force-closed and the request fails with PeerConnectionError.
A live but stalled target cannot be fenced: the request is left to the
engine's abort grace (``runtime.abort_grace_ms``), which fails it saying bytes
may still land; only then is the endpoint force-closed (and other requests on
it re-issued on a fresh endpoint: re-writing the same bytes is harmless).

Error handling (``[plugins.ucx] error_handling``, default true). On, UCX
detects dead peers (the contract's peer-death guarantee holds) but excludes
its shared-memory and cma transports: everything goes over tcp with RMA
emulated in software. Off, UCX uses sysv/posix/cma on one host (several times
faster), but a dead peer is not detected: cma aborts the whole process
(SIGABRT inside UCX) and tcp hangs until the deadline, and a forced close does
not fail outstanding requests, so timeouts end in the engine's abort grace.

Bounds. UCX does not refuse accesses outside a mapping (measured on tcp,
sysv/posix and cma: a put past the mapped range lands). The engine checks
requests against the descriptor; this transport checks them again against the
size it published next to the rkey. Both come from the descriptor, so the
descriptor (with its rkey) is the capability: whoever holds a forged one can
reach any memory of the target that UCX can reach.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import select
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from mpcomm import Availability, Capabilities, Operation, Transport, TransportContext
from mpcomm.errors import (
    MpcommError,
    OutOfBoundsError,
    PeerConnectionError,
    PermissionDeniedError,
    TransferError,
    TransferTimeout,
    TransportUnavailable,
)
from mpcomm.peer import PeerInfo

if TYPE_CHECKING:
    from mpcomm import Region

    from . import _ucp

INSTALL_HINT = "pip install 'mpcomm[ucx]'"
MAX_RKEYS = 1024  # unpacked rkeys cached per peer endpoint

_PEER_GONE = {-25, -80, -6, -24, -3}  # CONNECTION_RESET, ENDPOINT_TIMEOUT, UNREACHABLE, NOT_CONNECTED, IO_ERROR


def _ucp_module() -> Any:
    from . import _ucp

    return _ucp


def map_status(status: int, op: Operation, where: str) -> MpcommError:
    """A UCX status of a failed request as an mpcomm error."""
    ucp = _ucp_module()
    text = f"ucx {op.kind} to {op.remote.address}: {where}: {ucp.status_string(status)} (ucs_status {status})"
    if status in _PEER_GONE or status == ucp.UCS_ERR_CANCELED:
        return PeerConnectionError(text, peer=op.remote.address, region=op.remote.name)
    if status == ucp.UCS_ERR_TIMED_OUT:
        return TransferTimeout(text, peer=op.remote.address, region=op.remote.name)
    return TransferError(text, peer=op.remote.address, region=op.remote.name)


class _Peer:
    """The endpoint to one peer worker, and the rkeys unpacked on it."""

    def __init__(self, key: tuple[str, str], address: bytes, name: str) -> None:
        self.key = key
        self.address = address
        self.name = name
        self.ep: _ucp.Endpoint | None = None
        self.rkeys: OrderedDict[str, _ucp.RemoteKey] = OrderedDict()
        self.generation = 0
        self.failed: int | None = None  # UCX status from the error callback
        self.ops: set[_OpState] = set()


@dataclass(eq=False)
class _OpState:
    op: Operation
    peer: _Peer
    local_addr: int
    remote_addr: int
    rkey_hex: str
    memh: Any
    generation: int = -1
    rkey: Any = None
    next: int = 0  # next byte to issue
    reqs: list[tuple[Any, int]] = field(default_factory=list)  # (request, bytes)
    inflight: int = 0
    flush: Any = None  # the outstanding flush request
    flushed: bool = False  # a flush issued after the last put completed OK
    error: int | None = None  # first failed status
    fatal: MpcommError | None = None  # fail with this once drained (peer dead)
    abort_at: float | None = None
    abort_flushed: bool = False
    restart: bool = False  # re-issue everything on a fresh endpoint once drained

    @property
    def outstanding(self) -> bool:
        return bool(self.reqs) or self.flush is not None


class UcxTransport(Transport):
    """One-sided RMA over UCX (tcp, shared memory, cma, InfiniBand, ... as UCX picks)."""

    name: ClassVar[str] = "ucx"
    capabilities: ClassVar[Capabilities] = Capabilities(
        memory_kinds=frozenset({"host"}),
        intra_node=True,
        inter_node=True,
        one_sided=True,
        zero_copy=True,
        inflight_cancel=True,
        modes=frozenset({"zero-copy"}),
        bandwidth_class="medium",
    )
    default_options: ClassVar[dict[str, Any]] = {
        "error_handling": True,  # peer error handling: dead peers detected, but no shm/cma (see docs/ucx.md)
        "tls": "",  # UCX_TLS for this engine's context; "" keeps the environment's / UCX's choice
        "chunk": 8 << 20,  # bytes per put/get of a large request
        "window": 64 << 20,  # outstanding bytes per request
        # Issue and progress requests up to this size on the caller's thread; -1: 64 KiB with error
        # handling off (shm/cma: 4 KiB p50 120 us inline vs 200 us via the thread), 0 with it on
        # (tcp round trips outlast the spin: 270 us via the thread vs 490 us inline). Measured here.
        "inline_threshold": -1,
        "inline_spin_us": 200,  # how long the caller's thread progresses before handing off
        "spin_us": 100,  # the progress thread polls this long after the last event before sleeping
    }

    def __init__(self, ctx: TransportContext) -> None:
        super().__init__(ctx)
        o = ctx.options
        self.error_handling = bool(o["error_handling"])
        self._chunk = max(4096, int(o["chunk"]))
        self._window = max(self._chunk, int(o["window"]))
        thr = int(o["inline_threshold"])
        self._inline_threshold = thr if thr >= 0 else (0 if self.error_handling else 64 << 10)
        self._inline_spin = int(o["inline_spin_us"]) / 1e6
        self._spin = int(o["spin_us"]) / 1e6
        self._abort_grace = ctx.config.runtime.abort_grace_ms / 1000
        self.log = ctx.log
        self._lock = threading.RLock()
        self._ucp: Any = None
        self._context: _ucp.Context | None = None
        self._worker: _ucp.Worker | None = None
        self._memh: dict[int, _ucp.MemHandle] = {}
        self._peers: dict[tuple[str, str], _Peer] = {}
        self._active: set[_OpState] = set()
        self._thread: threading.Thread | None = None
        self._closing = False
        self._closed = False

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

        Even where this says yes, the engine registers only host buffers today
        (``Region.kind`` is always ``"host"``), so ``memory_kinds`` stays host.
        """
        try:
            reason = _ucp_module().cuda_unavailable_reason()
        except Exception as exc:  # noqa: BLE001
            reason = str(exc)
        if reason is not None:
            return Availability.no(f"unavailable: {reason}")
        return Availability.yes("UCX has CUDA and a GPU is visible (the engine does not register device buffers yet)")

    # -- lifecycle --------------------------------------------------------------

    def start(self) -> dict[str, Any]:
        ucp = self._ucp = _ucp_module()
        tls = str(self.ctx.options["tls"])
        self._context = ucp.Context(env={"TLS": tls} if tls else None)
        try:
            self._worker = self._context.create_worker(ucp.THREAD_MULTI)
            address = self._worker.address.hex()
            self._worker.fileno()
        except BaseException:
            self._context.close()
            raise
        self._thread = threading.Thread(target=self._progress_loop, name="mpcomm-ucx-progress", daemon=True)
        self._thread.start()
        maj, mnr, rel = ucp.version()
        return {"worker": address, "error_handling": self.error_handling, "version": f"{maj}.{mnr}.{rel}"}

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._closing = True
        if self._worker is not None:
            try:
                self._worker.signal()
            except Exception:  # noqa: BLE001
                pass
        if self._thread is not None:
            self._thread.join(5.0)
        with self._lock:
            states = list(self._active)
            self._active.clear()
            peers = list(self._peers.values())
            self._peers.clear()
        for peer in peers:
            self._force_close(peer)
        for st in states:
            self._release_requests(st)
            st.op.fail(PeerConnectionError("the ucx transport was closed", peer=st.op.remote.address))
        try:
            if self._context is not None:
                self._context.close()  # workers, their endpoints, then every memory mapping
        except Exception:  # noqa: BLE001 - close must not raise
            self.log.exception("ucx: context cleanup failed")
        self._memh.clear()

    # -- memory -------------------------------------------------------------------

    def register(self, region: Region) -> dict[str, Any] | None:
        if region.kind != "host" or self._context is None:
            return None
        ucp = self._ucp
        prot = ucp.PROT_LOCAL_READ | ucp.PROT_LOCAL_WRITE | ucp.PROT_REMOTE_READ
        if "w" in region.access:
            prot |= ucp.PROT_REMOTE_WRITE
        try:
            memh = self._context.mem_map(region.address, region.size, prot)
            rkey = memh.pack_rkey()
        except Exception as exc:  # noqa: BLE001 - the region is simply not served by ucx
            self.log.warning("ucx: cannot map region %s: %s", region.name, exc)
            return None
        with self._lock:
            old = self._memh.pop(region.id, None)
            self._memh[region.id] = memh
        if old is not None:
            self._unmap(old)
        info = {"rkey": rkey.hex(), "base": region.address, "size": region.size, "access": region.access}
        info["tag"] = self._tag(info, region.token, region.id, self.ctx.epoch)
        return info

    def _tag(self, info: dict[str, Any], token: int, region_id: int, epoch: str) -> str:
        """Binds the rkey to the descriptor's token, id, epoch, access and bounds.

        Keyed with ``transport.secret`` when one is set (then only engines
        holding the secret can make a descriptor this transport accepts);
        otherwise a plain hash that catches inconsistent (edited) descriptors.
        """
        msg = f"{info['rkey']}|{info['base']}|{info['size']}|{info['access']}|{token}|{region_id}|{epoch}".encode()
        key = (self.ctx.config.transport.secret or "").encode()
        return hmac.new(key, msg, hashlib.sha256).hexdigest()[:32]

    def unregister(self, region: Region) -> None:
        with self._lock:
            memh = self._memh.pop(region.id, None)
        if memh is not None:
            self._unmap(memh)

    def _unmap(self, memh: Any) -> None:
        try:
            memh.unmap()
        except Exception as exc:  # noqa: BLE001
            self.log.warning("ucx: ucp_mem_unmap failed: %s", exc)
        ctx = self._context
        if ctx is not None:
            try:
                ctx._memhs.remove(memh)
            except ValueError:
                pass

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

    def _peer_for(self, op: Operation) -> _Peer:
        info = op.peer.transports.get(self.name) or {}
        worker = str(info.get("worker", ""))
        key = (op.peer.node_id, worker)
        peer = self._peers.get(key)
        if peer is None:
            peer = self._peers[key] = _Peer(key, bytes.fromhex(worker), op.remote.address)
        return peer

    def _endpoint(self, peer: _Peer) -> Any:
        """The peer's endpoint, (re)created on demand; call with the lock held."""
        if peer.ep is None:
            assert self._worker is not None
            peer.failed = None

            def on_error(_ep: Any, exc: Any, peer: _Peer = peer) -> None:
                # Runs inside ucp_worker_progress: bookkeeping only.
                peer.failed = exc.status

            peer.ep = self._worker.connect(peer.address, error_handling=self.error_handling, on_error=on_error)
            peer.generation += 1
            peer.rkeys.clear()
        return peer.ep

    def _rkey(self, peer: _Peer, rkey_hex: str) -> Any:
        rk = peer.rkeys.get(rkey_hex)
        if rk is not None:
            peer.rkeys.move_to_end(rkey_hex)
            return rk
        if len(peer.rkeys) >= MAX_RKEYS:
            in_use = {st.rkey_hex for st in peer.ops}
            for key in [k for k in peer.rkeys if k not in in_use][: len(peer.rkeys) // 2]:
                old = peer.rkeys.pop(key)
                old.destroy()
                try:
                    peer.ep._rkeys.remove(old)  # type: ignore[union-attr]
                except ValueError:
                    pass
        rk = peer.ep.unpack_rkey(bytes.fromhex(rkey_hex))  # type: ignore[union-attr]
        peer.rkeys[rkey_hex] = rk
        return rk

    def _force_close(self, peer: _Peer) -> None:
        """Force-close the peer's endpoint: its outstanding requests fail (CANCELED)."""
        with self._lock:
            ep, peer.ep = peer.ep, None
            peer.rkeys.clear()
            if ep is None:
                return
            try:
                ep.close(force=True, timeout=2.0)
            except Exception as exc:  # noqa: BLE001
                self.log.debug("ucx: forced close of the endpoint to %s: %s", peer.name, exc)

    def peer_changed(self, peer: PeerInfo) -> None:
        """The peer died or restarted: fail what is in flight to it, drop its endpoint and rkeys."""
        with self._lock:
            gone = [p for k, p in self._peers.items() if k[0] == peer.node_id]
            for p in gone:
                del self._peers[p.key]
            for p in gone:
                for st in p.ops:
                    st.fatal = st.fatal or PeerConnectionError(
                        f"peer {p.name} is gone", peer=p.name, region=st.op.remote.name)
        for p in gone:
            self._force_close(p)
        self._wake()

    def handle_control(self, peer: PeerInfo | None, body: dict[str, Any]) -> dict[str, Any]:
        return {}

    # -- initiator ----------------------------------------------------------------------

    def post(self, op: Operation) -> None:
        info = op.remote.transports.get(self.name) or {}
        try:
            rkey_hex, base, size = str(info["rkey"]), int(info["base"]), int(info["size"])
            access, tag = str(info["access"]), str(info["tag"])
        except (KeyError, TypeError, ValueError) as exc:
            raise TransportUnavailable(f"region {op.remote.name!r} carries no usable ucx registration ({exc})",
                                       region=op.remote.name, peer=op.remote.address) from None
        r = op.remote
        if not hmac.compare_digest(tag, self._tag(info, r.token, r.region_id, r.epoch)):
            raise PermissionDeniedError(
                f"the descriptor of region {r.name!r} does not match its ucx registration "
                "(token, access, bounds or rkey were changed)", region=r.name, peer=r.address)
        if (op.kind == "write" and "w" not in access) or (op.kind == "read" and "r" not in access):
            raise PermissionDeniedError(f"region {r.name!r} was registered with access {access!r}",
                                        region=r.name, peer=r.address)
        if op.remote_offset < 0 or op.remote_offset + op.length > size:
            raise OutOfBoundsError(
                f"[{op.remote_offset}, {op.remote_offset + op.length}) is outside the {size} bytes mapped "
                f"for region {op.remote.name!r}", region=op.remote.name, peer=op.remote.address)
        if op.length == 0:
            op.complete(0)
            return
        with self._lock:
            if self._closed:
                raise TransportUnavailable("the ucx transport is closed")
            peer = self._peer_for(op)
            st = _OpState(op, peer, op.local.address + op.local_offset, base + op.remote_offset, rkey_hex,
                          self._memh.get(op.local.id))
            op.state = st
            peer.ops.add(st)
            self._issue(st)
        if op.length <= self._inline_threshold and st.error is None:
            end = time.monotonic() + self._inline_spin
            worker = self._worker
            assert worker is not None
            while True:
                worker.progress()
                self._reap(st)
                if not st.outstanding and st.error is None and st.next >= op.length:
                    if op.kind == "read" or st.flushed:
                        self._finish(st, None)
                        return
                    with self._lock:
                        self._issue(st)  # the flush after the last put
                    continue
                if st.error is not None or op.aborted or time.monotonic() > end:
                    break
        with self._lock:
            self._active.add(st)
        self._wake()

    def _issue(self, st: _OpState) -> None:
        """Issue more of ``st`` (lock held): chunks within the window, then the flush."""
        op, peer = st.op, st.peer
        if (peer.failed is not None and peer.ep is not None) or st.error is not None or st.fatal is not None:
            return
        ucp = self._ucp
        try:
            ep = self._endpoint(peer)
            if st.generation != peer.generation:
                st.rkey = self._rkey(peer, st.rkey_hex)
                st.generation = peer.generation
            issue = ep.put if op.kind == "write" else ep.get
            while st.next < op.length and st.inflight < self._window and not op.aborted:
                n = min(self._chunk, op.length - st.next)
                r = issue(st.local_addr + st.next, n, st.remote_addr + st.next, st.rkey, st.memh)
                st.next += n
                if r is not None:
                    st.reqs.append((r, n))
                    st.inflight += n
            if (op.kind == "write" and st.next >= op.length and not st.reqs and st.flush is None
                    and not st.flushed and not op.aborted):
                r = ep.flush()
                if r is None:
                    st.flushed = True
                else:
                    st.flush = r
        except ucp.UcxError as exc:
            st.error = exc.status

    def _reap(self, st: _OpState) -> None:
        """Collect finished requests of ``st``."""
        if st.reqs:
            left = []
            for r, n in st.reqs:
                s = r.status()
                if s == 1:
                    left.append((r, n))
                    continue
                r.free()
                st.inflight -= n
                if s < 0 and st.error is None:
                    st.error = s
            st.reqs = left
        if st.flush is not None:
            s = st.flush.status()
            if s != 1:
                st.flush.free()
                st.flush = None
                if s < 0:
                    st.error = st.error if st.error is not None else s
                elif st.next >= st.op.length and st.error is None:
                    st.flushed = True

    def _release_requests(self, st: _OpState) -> None:
        for r, _n in st.reqs:
            r.free()  # UCX reclaims a request freed before it completes
        st.reqs = []
        st.inflight = 0
        if st.flush is not None:
            st.flush.free()
            st.flush = None

    def _finish(self, st: _OpState, exc: MpcommError | None) -> None:
        with self._lock:
            self._active.discard(st)
            st.peer.ops.discard(st)
        op = st.op
        if exc is None:
            if op.before_complete is not None:
                # The notification goes over the control channel: not on the progress thread.
                self.ctx.executor.submit(op.complete, op.length)
            else:
                op.complete(op.length)
        else:
            op.fail(exc)

    def _step(self, st: _OpState, now: float) -> None:
        """Advance ``st`` on the progress thread."""
        op, peer = st.op, st.peer
        self._reap(st)
        if op.done and st.abort_at is not None and now - st.abort_at > self._abort_grace:
            # The engine gave up on a stalled target (abort grace): reclaim the endpoint,
            # and let the other requests on it start over on a fresh one.
            with self._lock:
                for o in peer.ops:
                    if o is not st:
                        o.restart = True
            if st.outstanding:
                self._force_close(peer)
                self._reap(st)
            self._release_requests(st)
            self._finish(st, TransferError("abandoned after the abort grace"))
            return
        if peer.failed is not None and peer.ep is not None:
            with self._lock:
                for o in peer.ops:
                    o.fatal = o.fatal or map_status(peer.failed, o.op, "peer failure")
        if st.fatal is not None:
            if st.outstanding and peer.ep is not None:
                self._force_close(peer)  # fails what is outstanding
                self._reap(st)
            if st.outstanding:
                return
            self._finish(st, st.fatal)
            return
        if op.aborted:
            if st.abort_at is None:
                st.abort_at = now
            if st.outstanding:
                return
            if st.error is None and op.kind == "write" and not st.abort_flushed and st.next and not st.flushed:
                # The fence: once this flush completes, nothing issued before it can land.
                st.abort_flushed = True
                with self._lock:
                    ep = peer.ep
                    try:
                        st.flush = ep.flush() if ep is not None else None
                    except self._ucp.UcxError as exc:
                        st.error = exc.status
                if st.flush is not None:
                    return
            if st.error is not None and st.error != self._ucp.UCS_ERR_CANCELED and peer.failed is None:
                self.log.debug("ucx: aborted %s ended with status %s", op.kind, st.error)
            self._finish(st, op.abort_exc)  # type: ignore[arg-type]
            return
        if st.error is not None or st.restart:
            if st.outstanding:
                return
            if st.error is not None and not st.restart and st.error != self._ucp.UCS_ERR_CANCELED:
                self._finish(st, map_status(st.error, op, "request failed"))
                return
            # Our own forced close cancelled it: start over on a fresh endpoint.
            st.error, st.restart, st.next, st.flushed, st.generation = None, False, 0, False, -1
        if not st.outstanding and st.next >= op.length and (op.kind == "read" or st.flushed):
            self._finish(st, None)
            return
        with self._lock:
            self._issue(st)

    # -- progress thread ----------------------------------------------------------------

    def _wake(self) -> None:
        w = self._worker
        if w is not None and not self._closed:
            try:
                w.signal()
            except Exception:  # noqa: BLE001
                pass

    def _progress_loop(self) -> None:
        w = self._worker
        assert w is not None
        efd = w.fileno()
        last = time.monotonic()
        try:
            while not self._closing:
                n = w.progress()
                with self._lock:
                    states = list(self._active)
                now = time.monotonic()
                for st in states:
                    try:
                        self._step(st, now)
                    except Exception as exc:  # noqa: BLE001 - a bug fails the request, not the thread
                        self.log.exception("ucx: progress of a %s failed", st.op.kind)
                        self._release_requests(st)
                        self._finish(st, MpcommError(f"ucx transport failed: {exc}"))
                if n:
                    last = now
                    continue
                if now - last < self._spin:
                    os.sched_yield()
                    continue
                if not w.arm():
                    last = time.monotonic()
                    continue
                # Sleep on the event fd; with requests outstanding wake up now and then anyway.
                select.select([efd], [], [], 0.001 if states else 1.0)
                last = time.monotonic()
        except Exception:  # noqa: BLE001
            self.log.exception("ucx: the progress thread died")

    def abort(self, op: Operation) -> None:
        self._wake()


logging.getLogger("mpcomm.transport.ucx").addHandler(logging.NullHandler())
