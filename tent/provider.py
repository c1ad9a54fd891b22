"""Raw-address semantics of an MPComm provider on top of one mpcomm Engine.

TENT's MPCOMM transport, UCL-MPComm's own API and Mooncake's Python
``TransferEngine`` all address memory by raw virtual addresses on both sides
and name peers by a host id. The core addresses regions by descriptor and
offset. This module is the translation, and the place where it is enforced:

* **Local memory** is usable as a source or destination only inside a range
  given to :meth:`Provider.register_memory`; **remote memory** only inside a
  range the peer published and this side fetched with :meth:`Provider.query`.
  An address outside every such range is refused before anything moves. The
  target's own engine checks the region id, token and bounds again.
* **Publishing.** A published range is a Region registered under an
  unguessable name. Its name is listed in a small read-only *directory*
  region (:data:`DIRECTORY`) that peers read through the normal request path;
  unpublishing drops the listing and re-registers the range under a new name
  and token, so a peer that had the old descriptor can no longer reach it.
* **Hosts** are named by host id; :meth:`connect` binds a host id to the
  peer engine's control endpoint. A second ``connect`` replaces the record
  (and its keys) without leaking anything.
* **A restarted peer** (new epoch) is noticed when an issue fails with
  StaleRegionError/PeerConnectionError, or a transfer fails with a connection
  error: its keys are re-fetched once and the request is retried, so it works
  again as soon as the peer is back, as long as the address is published there.
"""

from __future__ import annotations

import bisect
import ctypes
import itertools
import json
import logging
import os
import secrets
import threading
import time
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from mpcomm import Batch, Engine, Region, RemoteRegion, Request, Transfer
from mpcomm.errors import AccessError, MpcommError, PeerConnectionError, StaleRegionError
from mpcomm.wire import loads_bounded

from . import codes
from .codes import ProviderError

__all__ = ["DIRECTORY", "Provider", "PublishedBuffer", "raw_view"]

log = logging.getLogger("mpcomm.tent")

#: Name of the region that lists a node's published buffers.
DIRECTORY = "mpcomm.tent.directory"
DIRECTORY_SIZE = 256 << 10
_HEADER = 16  # generation (8) + payload length (4) + crc32 (4)
_MAX_PAYLOAD = DIRECTORY_SIZE - _HEADER - 8  # the trailing copy of the generation


def raw_view(addr: int, length: int) -> memoryview:
    """A writable byte view of ``length`` bytes at ``addr`` in this process.

    The range must be mapped now (:func:`check_mapped`); the caller vouches
    that it stays mapped while the view is used (as with ``registerMemory`` in C++).
    """
    check_mapped(addr, length)
    return memoryview((ctypes.c_char * length).from_address(addr)).cast("B")


#: Above every user-space address on Linux (x86-64 with 5-level paging: 2**56; arm64: 2**52).
_USER_TOP = 1 << 57
_MINCORE_CHUNK = 1 << 30  # bytes per mincore() call: a 256 KiB vector with 4 KiB pages
_libc: Any = None


def check_mapped(addr: int, length: int) -> None:
    """Refuse ``[addr, addr+length)`` unless every page of it is mapped in this process.

    ``mincore`` fails with ENOMEM for a range holding any unmapped page, so one
    call per GiB checks a range without touching (or faulting in) its pages.
    The bounds are checked first in Python integers, so no length wraps around.
    """
    if not isinstance(addr, int) or not isinstance(length, int) or addr <= 0 or length <= 0:
        raise ProviderError(codes.ERR_INVALID_ARGUMENT, f"bad range {addr!r}+{length!r}")
    if addr + length > _USER_TOP:
        raise ProviderError(codes.ERR_INVALID_ARGUMENT,
                            f"[{addr:#x}, {addr + length:#x}) runs past the end of the address space")
    global _libc
    if _libc is None:
        lib = ctypes.CDLL(None, use_errno=True)
        lib.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        lib.mincore.restype = ctypes.c_int
        _libc = lib
    page = os.sysconf("SC_PAGE_SIZE")
    start, end = addr - addr % page, -(-(addr + length) // page) * page
    vec = ctypes.create_string_buffer(min(end - start, _MINCORE_CHUNK) // page)
    for lo in range(start, end, _MINCORE_CHUNK):
        n = min(end - lo, _MINCORE_CHUNK)
        if _libc.mincore(lo, n, vec) != 0:
            err = ctypes.get_errno()
            raise ProviderError(codes.ERR_INVALID_ARGUMENT,
                                f"[{addr:#x}, {addr + length:#x}) is not mapped in this process "
                                f"({os.strerror(err)} at or after {lo:#x})")


@dataclass
class PublishedBuffer:
    """One remote range as fetched by :meth:`Provider.query`."""

    addr: int
    length: int
    numa_node: int
    remote: RemoteRegion | None = None

    def as_tuple(self) -> tuple[int, int, int]:
        return (self.addr, self.length, self.numa_node)


class _Ranges:
    """Non-overlapping [start, end) ranges with a payload; lookups by address.

    Copy-on-write: lookups (the issue path, any thread, no lock) read one
    consistent snapshot; changes (under the provider's lock) swap in a new one.
    """

    def __init__(self) -> None:
        self._snap: tuple[list[int], list[tuple[int, int, Any]]] = ([], [])

    def add(self, start: int, length: int, item: Any) -> None:
        starts, items = self._snap
        end = start + length
        i = bisect.bisect_right(starts, start)
        if i and items[i - 1][1] > start or i < len(items) and items[i][0] < end:
            raise ProviderError(codes.ERR_INVALID_ARGUMENT,
                                f"[{start:#x}, {end:#x}) overlaps a range that is already registered")
        self._snap = (starts[:i] + [start] + starts[i:], items[:i] + [(start, end, item)] + items[i:])

    def remove(self, start: int) -> Any:
        starts, items = self._snap
        i = bisect.bisect_left(starts, start)
        if i == len(starts) or starts[i] != start:
            return None
        self._snap = (starts[:i] + starts[i + 1:], items[:i] + items[i + 1:])
        return items[i][2]

    def find(self, addr: int, length: int) -> tuple[Any, int] | None:
        """(item, offset) of the range that holds all of [addr, addr+length), else None."""
        starts, items = self._snap
        i = bisect.bisect_right(starts, addr) - 1
        if i < 0:
            return None
        start, end, item = items[i]
        if addr + length > end:
            return None
        return item, addr - start

    def get(self, start: int) -> Any:
        starts, items = self._snap
        i = bisect.bisect_left(starts, start)
        if i < len(starts) and starts[i] == start:
            return items[i][2]
        return None

    def items(self) -> list[tuple[int, int, Any]]:
        return list(self._snap[1])

    def __len__(self) -> int:
        return len(self._snap[1])


@dataclass
class _Local:
    addr: int
    length: int
    region: Region
    published: bool = False
    numa_node: int = -1


class _Bound:
    """The (local range, remote range) pair a host's last request went through, as resolved then.

    :meth:`Provider.issue_bound` takes a request whose two ranges lie inside
    these, without looking either up again. It is valid while the provider's
    version is the one it was resolved under: every change that could make a
    look-up answer differently for a range it already answered for (a local
    range unregistered or unpublished, a host connected again, its keys
    fetched again or marked stale, shutdown) moves the version on. A new
    registration cannot: registered ranges never overlap.
    """

    __slots__ = ("version", "lstart", "lend", "local", "rstart", "rend", "remote", "write", "read")

    def __init__(self, version: int, entry: _Local, buf: PublishedBuffer, eng: Engine) -> None:
        self.version = version
        self.lstart, self.lend, self.local = entry.addr, entry.addr + entry.length, entry.region
        self.rstart, self.rend, self.remote = buf.addr, buf.addr + buf.length, buf.remote
        self.write, self.read = eng.write, eng.read


@dataclass
class _Host:
    host_id: str
    address: str  # the peer engine's control endpoint ("" until found by name)
    dir_name: str = DIRECTORY
    by_name: bool = False  # the owner is looked up in the cluster metadata (etcd)
    directory: RemoteRegion | None = None
    ranges: _Ranges = field(default_factory=_Ranges)
    queried: bool = False
    stale: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)


class Provider:
    """The raw-address layer over one Engine (see the module docstring).

    Thread-safe: many threads may issue at once. Methods raise
    :class:`~mpcomm.tent.codes.ProviderError` (or an MpcommError) on refusal;
    the C++ library and :class:`mpcomm.tent.MPComm` turn those into codes.
    """

    def __init__(self) -> None:
        self.engine: Engine | None = None
        self.host_id = ""
        self._local = _Ranges()
        self._hosts: dict[str, _Host] = {}
        self._lock = threading.RLock()
        self._directory: Region | None = None
        self._dir_buf: Any = None
        self._generation = 0
        #: Moved on (after the change is made) by every change a cached _Bound may not outlive.
        self._version = 0
        self._versions = itertools.count(1)
        self._bound: dict[str, _Bound] = {}
        #: Name of this node's directory region: DIRECTORY, or a per-host-id name
        #: when peers find it in the cluster metadata (see directory_name_for).
        self.directory_name = DIRECTORY

    # -- lifecycle -------------------------------------------------------------

    def init(self, host_id: str, device_names: str = "", tcp_port: int = 0, *,
             bind: str | None = None, engine: Engine | None = None, **engine_kwargs: Any) -> None:
        """Start the engine whose control endpoint is the handshake port.

        ``bind`` defaults to ``MPCOMM_TENT_BIND``, else the IPv4 literal in
        ``host_id`` (``"10.0.0.2:12346"`` binds 10.0.0.2), else ``0.0.0.0`` as
        MPComm does. ``device_names`` is accepted for the API's sake: the
        engine picks its transports itself (``MPCOMM_TRANSPORTS`` narrows them).
        """
        with self._lock:
            if self.engine is not None:
                raise ProviderError(codes.ERR_ALREADY_INITIALIZED, "already initialised")
            if not isinstance(host_id, str) or not host_id:
                raise ProviderError(codes.ERR_INVALID_ARGUMENT, "host_id must be a non-empty string")
            if not 0 <= int(tcp_port) <= 65535:
                raise ProviderError(codes.ERR_INVALID_ARGUMENT, f"tcp_port {tcp_port} out of range")
            if engine is None:
                host = bind or os.environ.get("MPCOMM_TENT_BIND") or _ipv4_in(host_id) or "0.0.0.0"
                kwargs = dict(engine_kwargs)
                kwargs.setdefault("config", os.environ.get("MPCOMM_CONFIG") or None)
                names = os.environ.get("MPCOMM_TRANSPORTS")
                if names and "transports" not in kwargs:
                    kwargs["transports"] = [n.strip() for n in names.split(",") if n.strip()]
                engine = Engine(endpoint=f"{host}:{int(tcp_port)}", **kwargs)
            self.engine = engine
            self.host_id = host_id

    @property
    def tcp_port(self) -> int:
        if self.engine is None:
            return 0
        return int(self.engine.address.rsplit(":", 1)[1])

    def start_accept(self) -> None:
        """Let peers fetch this node's published buffers (the directory appears)."""
        with self._lock:
            eng = self._engine()
            if self._directory is not None:
                return
            self._dir_buf = bytearray(DIRECTORY_SIZE)
            self._directory = eng.register(self._dir_buf, name=self.directory_name, access="r")
            self._write_directory()

    def stop_accept(self) -> None:
        with self._lock:
            if self._directory is None or self.engine is None:
                return
            region, self._directory = self._directory, None
            try:
                self.engine.unregister(region, timeout=1.0)
            except MpcommError:
                log.warning("directory still in use at stop_accept; it goes with the engine")

    def shutdown(self) -> None:
        """Abort what is in flight (it fails with ERR_SHUTDOWN) and close the engine."""
        with self._lock:
            eng, self.engine = self.engine, None
            self._directory = None
            self._local = _Ranges()
            self._hosts.clear()
            self._bound.clear()
            self._changed()
        if eng is not None:
            eng.close()

    def _changed(self) -> None:
        """A look-up may now answer differently: no cached _Bound taken before this is used again.

        Called after the change. ``next`` on a count is atomic, so two changes
        at once leave a version that no _Bound was resolved under.
        """
        self._version = next(self._versions)

    def _engine(self) -> Engine:
        eng = self.engine
        if eng is None:
            raise ProviderError(codes.ERR_NOT_INITIALIZED, "init() was not called (or shutdown() was)")
        return eng

    # -- local memory ----------------------------------------------------------------

    def register_memory(self, addr: int, length: int) -> None:
        with self._lock:
            eng = self._engine()
            view = raw_view(addr, length)
            if self._local.find(addr, 1) is not None or self._local.find(addr + length - 1, 1) is not None:
                raise ProviderError(codes.ERR_INVALID_ARGUMENT, f"{addr:#x}+{length} overlaps a registered range")
            region = eng.register(view, name=_secret_name())
            try:
                self._local.add(addr, length, _Local(addr, length, region))
            except BaseException:
                eng.unregister(region)
                raise

    def unregister_memory(self, addr: int, timeout: float = 0.0) -> None:
        with self._lock:
            eng = self._engine()
            entry: _Local | None = self._local.get(addr)
            if entry is None:
                raise ProviderError(codes.ERR_OUT_OF_RANGE, f"{addr:#x} is not the start of a registered range")
            eng.unregister(entry.region, timeout=timeout or None)  # RegionBusyError while leased
            self._local.remove(addr)
            self._changed()
            self._bound.clear()  # nothing keeps the region alive through a cached pair
            if entry.published:
                self._write_directory()

    def publish(self, addr: int, length: int, numa_node: int = -1) -> None:
        """List [addr, addr+length) (registered earlier, or registered now) for peers."""
        with self._lock:
            self._engine()
            entry: _Local | None = self._local.get(addr)
            if entry is None:
                self.register_memory(addr, length)
                entry = self._local.get(addr)
            elif entry.length != length:
                raise ProviderError(codes.ERR_INVALID_ARGUMENT,
                                    f"publish {addr:#x}+{length} does not match the registered {entry.length} bytes")
            entry.published = True
            entry.numa_node = int(numa_node)
            self._write_directory()

    def unpublish(self, addr: int) -> None:
        """Withdraw a range: peers' descriptors of it stop working (new name and token)."""
        with self._lock:
            eng = self._engine()
            entry: _Local | None = self._local.get(addr)
            if entry is None or not entry.published:
                raise ProviderError(codes.ERR_OUT_OF_RANGE, f"{addr:#x} is not a published range")
            entry.published = False
            self._write_directory()
            eng.unregister(entry.region, timeout=5.0)
            self._changed()  # the old region is gone whatever happens next
            self._bound.clear()
            entry.region = eng.register(raw_view(entry.addr, entry.length), name=_secret_name())
            self._changed()

    def local_region(self, addr: int, length: int) -> tuple[Region, int]:
        entry, off = self._local_entry(addr, length)
        return entry.region, off

    def _local_entry(self, addr: int, length: int) -> tuple[_Local, int]:
        if not isinstance(length, int) or length <= 0:
            raise ProviderError(codes.ERR_INVALID_ARGUMENT, f"length must be a positive integer, not {length!r}")
        found = self._local.find(addr, length)
        if found is None:
            raise ProviderError(codes.ERR_OUT_OF_RANGE,
                                f"local [{addr:#x}, {addr + length:#x}) is outside every registered range")
        return found  # type: ignore[return-value]

    def published(self) -> list[tuple[int, int, int]]:
        return [(e.addr, e.length, e.numa_node) for _s, _e, e in self._local.items() if e.published]

    def _write_directory(self) -> None:
        """Rewrite the listing; readers detect a torn copy by generation and CRC."""
        if self._directory is None:
            return
        entries = [[e.addr, e.length, e.numa_node, e.region.name]
                   for _s, _e, e in self._local.items() if e.published]
        payload = json.dumps({"host_id": self.host_id, "buffers": entries}, separators=(",", ":")).encode()
        if len(payload) > _MAX_PAYLOAD:
            raise ProviderError(codes.ERR_BUSY, f"too many published buffers ({len(entries)}) for the directory")
        buf = self._dir_buf
        g = self._generation
        odd, even = (g + 1).to_bytes(8, "little"), (g + 2).to_bytes(8, "little")
        buf[0:8] = odd  # a reader that sees an odd or mismatched generation retries
        buf[DIRECTORY_SIZE - 8:] = odd
        buf[_HEADER:_HEADER + len(payload)] = payload
        buf[8:12] = len(payload).to_bytes(4, "little")
        buf[12:16] = zlib.crc32(payload).to_bytes(4, "little")
        buf[DIRECTORY_SIZE - 8:] = even
        buf[0:8] = even
        self._generation = g + 2

    # -- peers ---------------------------------------------------------------------

    def connect(self, host_id: str, tcp_addr: str, tcp_port: int) -> None:
        """Bind ``host_id`` to the peer at ``tcp_addr:tcp_port`` and check it answers."""
        eng = self._engine()
        if not host_id or not tcp_addr or not 0 < int(tcp_port) <= 65535:
            raise ProviderError(codes.ERR_INVALID_ARGUMENT, f"bad peer {host_id!r} at {tcp_addr}:{tcp_port}")
        address = f"[{tcp_addr}]:{int(tcp_port)}" if ":" in tcp_addr else f"{tcp_addr}:{int(tcp_port)}"
        host = _Host(host_id, address)
        try:
            host.directory = eng.open(address, DIRECTORY)
        except MpcommError as exc:
            raise _as_connection(exc, address) from exc
        with self._lock:
            self._hosts[host_id] = host
            self._changed()

    def has_host(self, host_id: str) -> bool:
        """Whether the session ``host_id`` is connected already (its buffers fetched)."""
        return host_id in self._hosts

    def connect_named(self, host_id: str) -> None:
        """Bind ``host_id`` to whichever node publishes its directory in the cluster metadata."""
        self._engine()
        host = _Host(host_id, "", dir_name=directory_name_for(host_id), by_name=True)
        try:
            host.directory = self._open_directory(host)
        except MpcommError as exc:
            raise _as_connection(exc, host_id) from exc
        with self._lock:
            self._hosts[host_id] = host
            self._changed()

    def _open_directory(self, host: _Host) -> RemoteRegion:
        eng = self._engine()
        if not host.by_name:
            return eng.open(host.address, host.dir_name)
        # After a restart the old record lives until its lease ends: newest first, first that answers.
        records = sorted(eng.metadata.lookup(host.dir_name), key=lambda r: -r.published_at)
        if not records:
            raise ProviderError(codes.ERR_UNKNOWN_HOST, f"no node publishes segment {host.host_id!r} "
                                f"in {eng.metadata.url or 'the cluster metadata'}")
        last: MpcommError | None = None
        for rec in records:
            try:
                d = eng.open(rec.address, host.dir_name, timeout=2.0)
            except MpcommError as exc:
                last = exc
                continue
            if (d.node_id, d.epoch) != (rec.node_id, rec.epoch):
                # As Engine.open(name): an address is only where the record's node was; a stale or
                # forged record must not send this segment's reads and writes to another engine.
                last = AccessError(f"the record of segment {host.host_id!r} names node {rec.node_id} (epoch "
                                   f"{rec.epoch}) at {rec.address}, but the node there is {d.node_id} (epoch "
                                   f"{d.epoch}): a stale or forged record; not used", peer=rec.address)
                log.warning("tent: %s", last)
                continue
            host.address = rec.address
            return d
        assert last is not None
        raise last

    def query(self, host_id: str, tcp_addr: str | None = None, tcp_port: int = 0) -> list[PublishedBuffer]:
        """Fetch the peer's published buffers (its "keys"); replaces what was cached."""
        self._engine()
        host = self._hosts.get(host_id)
        if host is None:
            if not tcp_addr:
                raise ProviderError(codes.ERR_UNKNOWN_HOST, f"host {host_id!r} is not connected")
            self.connect(host_id, tcp_addr, tcp_port)
            host = self._hosts[host_id]
        with host.lock:
            return self._refresh(host)

    def _refresh(self, host: _Host) -> list[PublishedBuffer]:
        eng = self._engine()
        try:
            if host.directory is None or host.stale:
                host.directory = self._open_directory(host)
            listing = self._read_directory(host)
            if listing is None:  # the peer restarted between open and read
                host.directory = self._open_directory(host)
                listing = self._read_directory(host)
            if listing is None:
                raise ProviderError(codes.ERR_STALE, f"{host.address} keeps restarting")
            ranges = _Ranges()
            out = []
            for addr, length, numa, name in listing:
                remote = eng.open(host.address, name)
                buf = PublishedBuffer(int(addr), int(length), int(numa), remote)
                ranges.add(buf.addr, buf.length, buf)
                out.append(buf)
        except MpcommError as exc:
            raise _as_connection(exc, host.address) from exc
        host.ranges = ranges
        host.queried = True
        host.stale = False
        self._changed()
        return out

    def _read_directory(self, host: _Host) -> list[list[Any]] | None:
        assert host.directory is not None
        eng = self._engine()
        buf = bytearray(DIRECTORY_SIZE)
        for _ in range(50):
            try:
                eng.read(buf, host.directory, 0, DIRECTORY_SIZE).result()
            except StaleRegionError:
                return None
            head, tail = bytes(buf[0:8]), bytes(buf[DIRECTORY_SIZE - 8:])
            n = int.from_bytes(buf[8:12], "little")
            if head != tail or int.from_bytes(head, "little") % 2 or n > _MAX_PAYLOAD:
                time.sleep(0.001)
                continue
            payload = bytes(buf[_HEADER:_HEADER + n])
            if zlib.crc32(payload) != int.from_bytes(buf[12:16], "little"):
                time.sleep(0.001)
                continue
            try:  # a peer's bytes: the one bounded parse (size and depth) for all JSON from peers
                doc = loads_bounded(payload, what=f"the directory of {host.address}", max_bytes=_MAX_PAYLOAD)
                entries = doc["buffers"]
                if not isinstance(entries, list) or not all(_good_entry(e) for e in entries):
                    raise ValueError("an entry is not [addr, length, numa_node, name]")
            except (MpcommError, ValueError, KeyError, TypeError) as exc:
                raise ProviderError(codes.ERR_GENERIC, f"{host.address} sent a malformed directory: {exc}") from None
            return entries
        raise ProviderError(codes.ERR_BUSY, f"the directory of {host.address} kept changing while read")

    def host_buffers(self, host_id: str) -> list[PublishedBuffer]:
        host = self._hosts.get(host_id)
        return [] if host is None else [item for _s, _e, item in host.ranges.items()]

    def mark_stale(self, host_id: str) -> None:
        host = self._hosts.get(host_id)
        if host is not None:
            self._stale(host)

    def _stale(self, host: _Host) -> None:
        """The next issue to ``host`` fetches its keys again first (it restarted, or its link broke)."""
        host.stale = True
        self._changed()

    # -- transfers -------------------------------------------------------------------------

    def _remote(self, host: _Host, addr: int, length: int) -> tuple[RemoteRegion, int]:
        buf, off = self._remote_buffer(host, addr, length)
        return buf.remote, off  # type: ignore[return-value]

    @staticmethod
    def _remote_buffer(host: _Host, addr: int, length: int) -> tuple[PublishedBuffer, int]:
        found = host.ranges.find(addr, length)
        if found is None:
            raise ProviderError(codes.ERR_OUT_OF_RANGE,
                                f"remote [{addr:#x}, {addr + length:#x}) is outside every range {host.host_id!r} "
                                "published (as of the last queryRemoteBuffer)")
        return found  # type: ignore[return-value]

    def _host(self, host_id: str) -> _Host:
        host = self._hosts.get(host_id)
        if host is None:
            raise ProviderError(codes.ERR_UNKNOWN_HOST, f"host {host_id!r} is not connected")
        if host.stale or not host.queried:
            with host.lock:
                if host.stale or not host.queried:
                    self._refresh(host)
        return host

    def issue(self, kind: str, local_addr: int, host_id: str, remote_addr: int, length: int,
              timeout: float | None = None, completion_queue: Any = None, *, watch: bool = True) -> Transfer:
        """Post one write ("put") or read ("get"); refusals raise before anything moves.

        A failure that says the peer restarted or its link broke marks the peer for a fresh look-up
        of its keys. With ``watch`` (the default) a done-callback sees to that, on the engine's
        completion thread; a caller that waits for the transfer itself passes ``watch=False`` and
        calls :meth:`settled` after its wait, which saves that thread a wake-up per request.
        """
        eng = self._engine()
        if length <= 0:
            raise ProviderError(codes.ERR_INVALID_ARGUMENT, f"length must be positive, not {length}")
        self._local_entry(local_addr, length)  # refused first, before the host is looked at
        host = self._host(host_id)  # may fetch the keys again, which moves the version on
        version = self._version  # read before the look-ups kept below: a change during them retires them
        entry, loff = self._local_entry(local_addr, length)
        local = entry.region
        fn = eng.write if kind == "write" else eng.read
        for attempt in (0, 1):
            try:
                buf, roff = self._remote_buffer(host, remote_addr, length)
                remote = buf.remote
            except ProviderError:
                if attempt or not self._restarted(host):
                    raise
                with host.lock:  # a restarted peer publishes new ranges: fetch them, then decide
                    self._refresh(host)
                continue  # the refresh moved the version on: what this finds is not kept
            try:
                t = fn(local, remote, roff, length, local_offset=loff, timeout=timeout,
                       completion_queue=completion_queue)
            except (StaleRegionError, PeerConnectionError):
                if attempt:
                    raise
                with host.lock:  # the peer restarted (or its link broke): fetch its keys again
                    self._refresh(host)
                continue  # the refresh moved the version on: what this finds is not kept
            if watch:
                t.add_done_callback(lambda tr, h=host: self._watch(h, tr))
            self._bound[host_id] = _Bound(version, entry, buf, eng)
            return t
        raise AssertionError("unreachable")

    def issue_bound(self, kind: str, local_addr: Any, host_id: str, remote_addr: Any, length: Any,
                    timeout: float | None) -> Transfer | None:
        """:meth:`issue` (``watch=False``) for a request between the two ranges the host's last
        :meth:`issue` went through, or None: then :meth:`issue` takes it, and raises what it raises.

        The look-ups and their checks are what :meth:`issue` does, made against the ranges it
        found last (kept while nothing changed since, see :class:`_Bound`): exact ints, a positive
        length, the local range inside one registered range, the remote one inside one the peer
        published. The engine checks bounds, rights and deadline again, as for every request.
        """
        b = self._bound.get(host_id)
        if (b is None or b.version != self._version or type(local_addr) is not int or type(remote_addr) is not int
                or type(length) is not int or length <= 0 or local_addr < b.lstart or local_addr + length > b.lend
                or remote_addr < b.rstart or remote_addr + length > b.rend):
            return None
        try:
            return (b.write if kind == "write" else b.read)(b.local, b.remote, remote_addr - b.rstart, length,
                                                           local_offset=local_addr - b.lstart, timeout=timeout)
        except MpcommError:  # refused before anything moved (a restarted peer, a closed engine): issue() decides
            return None

    def issue_many(self, kind: str, local_addr: int, host_ids: Sequence[str], remote_addrs: Sequence[int],
                   lengths: Sequence[int], local_offsets: Sequence[int], timeout: float | None = None,
                   completion_queue: Any = None) -> Transfer:
        """One handle for requests to several hosts; every request is checked before any is posted.

        One :meth:`Engine.submit` batch: the engine moves the requests that share
        a local region and a remote region as one vectorised group.
        """
        eng = self._engine()
        n = len(host_ids)
        if not n or len(remote_addrs) != n or len(lengths) != n or len(local_offsets) != n:
            raise ProviderError(codes.ERR_INVALID_ARGUMENT, "hosts, addresses and lengths must be non-empty and match")
        reqs = []
        hosts: dict[str, _Host] = {}
        for hid, raddr, ln, loff in zip(host_ids, remote_addrs, lengths, local_offsets):
            if ln <= 0:
                raise ProviderError(codes.ERR_INVALID_ARGUMENT, f"length must be positive, not {ln}")
            local, off = self.local_region(local_addr + loff, ln)
            host = hosts.get(hid) or self._host(hid)
            hosts[hid] = host
            remote, roff = self._remote(host, raddr, ln)
            reqs.append(Request(kind, local, remote, roff, ln, off))
        batch = eng.submit(reqs, timeout=timeout, completion_queue=completion_queue)
        self._watch_batch(batch, [hosts[h] for h in host_ids])
        return batch

    def issue_vector(self, kind: str, host_id: str, local_addrs: Sequence[int], remote_addrs: Sequence[int],
                     lengths: Sequence[int], timeout: float | None = None, *, watch: bool = True) -> Transfer:
        """N requests to one host as one handle (Mooncake's batch calls).

        When every piece lies in one local and one remote range this is one
        ``Engine.write_many``/``read_many`` (one lease, one slot, one posting);
        otherwise one ``Engine.submit``. Every piece is checked before any is posted.
        ``watch`` as for :meth:`issue`: a caller that waits passes False and calls :meth:`settled`.
        """
        eng = self._engine()
        n = len(local_addrs)
        if not n or len(remote_addrs) != n or len(lengths) != n:
            raise ProviderError(codes.ERR_INVALID_ARGUMENT, "buffers, peer addresses and lengths differ in size")
        host = self._host(host_id)
        for attempt in (0, 1):
            locs, rems = [], []
            for la, ra, ln in zip(local_addrs, remote_addrs, lengths):
                if ln <= 0:
                    raise ProviderError(codes.ERR_INVALID_ARGUMENT, f"length must be positive, not {ln}")
                locs.append(self.local_region(la, ln))
                rems.append(self._remote(host, ra, ln))
            region, remote = locs[0][0], rems[0][0]
            try:
                if all(lr is region for lr, _ in locs) and all(rr is remote for rr, _ in rems):
                    fn = eng.write_many if kind == "write" else eng.read_many
                    batch = fn(region, remote, [o for _, o in locs], [o for _, o in rems], list(lengths),
                               timeout=timeout)
                else:
                    batch = eng.submit([Request(kind, lr, rr, ro, ln, lo)
                                        for (lr, lo), (rr, ro), ln in zip(locs, rems, lengths)], timeout=timeout)
            except (StaleRegionError, PeerConnectionError):
                if attempt:
                    raise
                with host.lock:
                    self._refresh(host)
                continue
            if watch:
                self._watch_batch(batch, [host])
            return batch
        raise AssertionError("unreachable")

    def _watch_batch(self, batch: Transfer, hosts: Sequence[_Host]) -> None:
        batch.add_done_callback(lambda b: self._batch_outcome(hosts, b))

    def _batch_outcome(self, hosts: Sequence[_Host], b: Any) -> None:
        if b.cancelled() or b.exception() is None:
            return
        errors = getattr(b, "errors", {}) or {}
        for i, e in errors.items():
            if isinstance(e, (PeerConnectionError, StaleRegionError)):
                # the next issue to that peer re-fetches its keys first
                self._stale(hosts[i if len(hosts) > 1 else 0])

    def _restarted(self, host: _Host) -> bool:
        """Whether the peer runs a new epoch (checked only on a refusal, one round trip)."""
        eng = self._engine()
        try:
            current = self._open_directory(host) if host.by_name else eng.open(host.address, host.dir_name, timeout=2.0)
        except MpcommError:
            return False
        return host.directory is None or current.epoch != host.directory.epoch

    def settled(self, host_id: str, t: Transfer) -> None:
        """``t`` (from ``issue``/``issue_vector(..., watch=False)``) is done: what its done-callback
        would have done."""
        host = self._hosts.get(host_id)
        if host is None:
            return
        if isinstance(t, Batch):
            self._batch_outcome([host], t)
        else:
            self._watch(host, t)

    def _watch(self, host: _Host, t: Transfer) -> None:
        if not t.cancelled() and isinstance(t.exception(), (PeerConnectionError, StaleRegionError)):
            self._stale(host)  # the next issue re-fetches the peer's keys first


def _good_entry(e: Any) -> bool:
    """One directory entry as :meth:`Provider._write_directory` writes it."""
    return (isinstance(e, list) and len(e) == 4 and all(type(x) is int for x in e[:3])
            and e[0] > 0 and e[1] > 0 and isinstance(e[3], str))


def directory_name_for(host_id: str) -> str:
    """The directory's region name when peers look it up by host id in the cluster metadata."""
    return f"{DIRECTORY}@{host_id}"


def _secret_name() -> str:
    return "mpcomm.tent." + secrets.token_hex(12)


def _ipv4_in(host_id: str) -> str | None:
    import ipaddress

    host = host_id.rsplit(":", 1)[0] if host_id.count(":") == 1 else host_id
    try:
        return str(ipaddress.IPv4Address(host))
    except ValueError:
        return None


def _as_connection(exc: MpcommError, address: str) -> MpcommError:
    if isinstance(exc, (PeerConnectionError, StaleRegionError, ProviderError)):
        return exc
    from mpcomm.errors import UnknownRegionError

    if isinstance(exc, UnknownRegionError):
        return ProviderError(codes.ERR_CONNECTION,
                             f"{address} runs mpcomm but does not accept MPComm peers (startAcceptThread not called)")
    if isinstance(exc, (OSError, TimeoutError)) or "connect" in str(exc).lower():
        return ProviderError(codes.ERR_CONNECTION, f"cannot reach {address}: {exc}")
    return exc
