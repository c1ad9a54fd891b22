"""Local memory: registered regions, their leases, and engine-allocated buffers.

A :class:`Region` is a contiguous piece of this process's memory that peers may
read or write once it is registered. The rules every transport relies on:

* **Ownership.** The caller keeps the buffer alive and unmoved while it is
  registered; mpcomm holds a reference to the exporting object (so a
  ``bytearray`` cannot be resized while registered: Python refuses it).
* **Leases.** From submit until its :class:`~mpcomm.Transfer` is done, a request
  leases every local region it touches; the target side leases a region while a
  peer's request is being served. ``Engine.unregister`` refuses a leased region
  with :class:`~mpcomm.RegionBusyError`, or waits for the leases to end when
  given a timeout.
* **While leased** the caller must not modify a source region's bytes (the
  transport may read them at any time until completion) nor read a destination
  region's bytes (they may be partly written). After completion both are safe.
"""

from __future__ import annotations

import ctypes
import itertools
import mmap
import os
import resource
import secrets
import threading
import time
from collections.abc import Callable
from typing import Any

from .errors import AlignmentError, AllocationError, RegionBusyError, RegionClosedError, RegionError
from .memory_kinds import HOST, DeviceBuffer, MemoryLocation, cuda_array_interface, dlpack_location, dlpack_tensor

__all__ = ["Region", "allocate_host", "buffer_address", "check_allocatable", "region_of"]

_region_ids = itertools.count(1)


class _PyBuffer(ctypes.Structure):
    _fields_ = [
        ("buf", ctypes.c_void_p),
        ("obj", ctypes.c_void_p),
        ("len", ctypes.c_ssize_t),
        ("itemsize", ctypes.c_ssize_t),
        ("readonly", ctypes.c_int),
        ("ndim", ctypes.c_int),
        ("format", ctypes.c_char_p),
        ("shape", ctypes.c_void_p),
        ("strides", ctypes.c_void_p),
        ("suboffsets", ctypes.c_void_p),
        ("internal", ctypes.c_void_p),
    ]


_get_buffer = ctypes.pythonapi.PyObject_GetBuffer
_get_buffer.argtypes = [ctypes.py_object, ctypes.POINTER(_PyBuffer), ctypes.c_int]
_get_buffer.restype = ctypes.c_int
_release_buffer = ctypes.pythonapi.PyBuffer_Release
_release_buffer.argtypes = [ctypes.POINTER(_PyBuffer)]
_release_buffer.restype = None


def buffer_address(view: memoryview) -> int:
    """Address of the first byte of a contiguous buffer, read-only ones included.

    ``ctypes.from_buffer`` refuses read-only buffers, so ask the buffer protocol
    directly; the caller keeps ``view`` alive, which keeps the address valid.
    """
    pb = _PyBuffer()
    _get_buffer(view, ctypes.byref(pb), 0)
    try:
        return int(pb.buf or 0)
    finally:
        _release_buffer(ctypes.byref(pb))


def as_byte_view(obj: Any) -> memoryview:
    """A flat, C-contiguous ``B``-format view of any PEP 688 buffer."""
    try:
        view = memoryview(obj)
    except TypeError as exc:
        raise RegionError(f"cannot register {type(obj).__name__}: not a buffer ({exc})") from exc
    if not view.c_contiguous:
        raise RegionError("cannot register a non-contiguous buffer; copy it into a contiguous one first")
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")
    return view


def _fmt(n: int) -> str:
    for unit, factor in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= factor:
            return f"{n / factor:.1f}{unit}"
    return f"{n}B"


def _meminfo() -> dict[str, int]:
    out = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                key, _, rest = line.partition(":")
                parts = rest.split()
                if parts and parts[0].isdigit():
                    out[key] = int(parts[0]) * (1024 if parts[1:] == ["kB"] else 1)
    except OSError:
        pass
    return out


def _cgroup_room() -> int | None:
    """Bytes this process's cgroup (v2) may still charge, or None without a limit."""
    try:
        with open("/proc/self/cgroup") as f:
            rel = next((ln.split(":", 2)[2].strip() for ln in f if ln.startswith("0::")), None)
        if rel is None:
            return None
        base = os.path.join("/sys/fs/cgroup", rel.lstrip("/"))
        with open(os.path.join(base, "memory.max")) as f:
            limit = f.read().strip()
        if limit == "max":
            return None
        with open(os.path.join(base, "memory.current")) as f:
            return max(0, int(limit) - int(f.read().strip()))
    except (OSError, ValueError):
        return None


def check_allocatable(size: int, *, shm: bool = False, locked: bool = False) -> None:
    """Refuse, before anything is allocated, a size this host cannot hold.

    Pre-faulted memory (``MAP_POPULATE``) larger than what the kernel can give
    does not fail cleanly: the OOM killer takes down this or another process.
    So ``size`` is compared with ``MemAvailable`` (``MemTotal`` where the
    kernel has no estimate) and the cgroup's remaining ``memory.max``; with
    ``shm`` also with the free space of ``/dev/shm``; with ``locked`` (memory
    that will be pinned) also with ``RLIMIT_MEMLOCK``.

    Raises AllocationError naming the size and the limit it exceeds.
    """
    if size <= 0:
        raise AllocationError(f"size must be positive, not {size}")
    info = _meminfo()
    avail = info.get("MemAvailable", info.get("MemTotal"))
    if avail is not None and size > avail:
        what = "MemAvailable" if "MemAvailable" in info else "MemTotal"
        raise AllocationError(
            f"cannot allocate {_fmt(size)} ({size} bytes): only {_fmt(avail)} of memory is available "
            f"({what} in /proc/meminfo; MemTotal {_fmt(info.get('MemTotal', 0))}); nothing was allocated")
    room = _cgroup_room()
    if room is not None and size > room:
        raise AllocationError(
            f"cannot allocate {_fmt(size)} ({size} bytes): this cgroup may use only {_fmt(room)} more "
            "(memory.max - memory.current); nothing was allocated")
    if shm:
        try:
            st = os.statvfs("/dev/shm")
        except OSError:
            st = None
        if st is not None:
            free = st.f_bavail * st.f_frsize
            if size > free:
                raise AllocationError(
                    f"cannot allocate {_fmt(size)} ({size} bytes) of shared memory: /dev/shm has only "
                    f"{_fmt(free)} free (docker: --shm-size); nothing was allocated")
    soft_as, _hard_as = resource.getrlimit(resource.RLIMIT_AS)
    if soft_as != resource.RLIM_INFINITY:
        used = _vm_size()
        if size > soft_as - used:
            raise AllocationError(
                f"cannot allocate {_fmt(size)} ({size} bytes): the address-space limit RLIMIT_AS is "
                f"{_fmt(soft_as)} and {_fmt(used)} are mapped already (ulimit -v); nothing was allocated")
    if locked:
        soft, _hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
        if soft != resource.RLIM_INFINITY and size > soft:
            raise AllocationError(
                f"cannot lock {_fmt(size)} ({size} bytes): RLIMIT_MEMLOCK is {_fmt(soft)} "
                "(ulimit -l; systemd LimitMEMLOCK=, docker --ulimit memlock=-1); nothing was allocated")


def _vm_size() -> int:
    """Bytes of address space this process maps now (VmSize)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmSize:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return 0


def allocate_host(size: int, alignment: int) -> tuple[memoryview, Any]:
    """Page-aligned anonymous memory, pre-faulted, aligned to ``alignment``.

    Returns the view and the object that owns the mapping. Raises
    AllocationError (see :func:`check_allocatable`) before mapping anything
    when the host cannot hold ``size`` bytes.
    """
    check_allocatable(size)
    extra = alignment if alignment > mmap.PAGESIZE else 0
    try:
        mm = mmap.mmap(-1, size + extra,
                       flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0))
    except OSError as exc:  # ENOMEM under a limit the checks above cannot see (overcommit, cgroups)
        raise AllocationError(f"cannot allocate {_fmt(size)} ({size} bytes): {exc.strerror or exc}; "
                              "nothing was allocated") from exc
    view = memoryview(mm)
    if extra:
        addr = buffer_address(view)
        skip = (-addr) % alignment
        view = view[skip : skip + size]
    else:
        view = view[:size]
    return view, mm


class Region:
    """A registered piece of local memory (see the module docstring for the rules).

    Attributes:
        name: the name peers open it by (unique per engine).
        id: the engine-local numeric id that travels in requests.
        size: its length in bytes.
        address: base address in this process (RemoteRegion carries it for
            callers that address remote memory by raw address).
        access: ``"rw"`` or ``"r"`` (read-only buffers can only be sources).
        kind: memory kind, ``"host"`` or ``"cuda"`` (:mod:`mpcomm.memory_kinds`).
        location: a :class:`~mpcomm.memory_kinds.MemoryLocation` (kind and device ordinal).
        view: a memoryview of host memory; None for device memory, which
            transports reach through ``address`` with the device's API.
        token: random capability that every remote access must present.
    """

    # The lease state (see __init__) sits in slots: the engine's C inline lane reads ``_refusing``
    # and ``_closers`` straight from them (LEASE_SLOTS), with no Python call and no attribute name.
    __slots__ = ("_held", "_refusing", "_closers", "__dict__", "__weakref__")

    def __init__(
        self,
        view: memoryview | None,
        *,
        name: str,
        access: str,
        kind: str = "host",
        owner: Any = None,
        engine_allocated: bool = False,
        backing: Any = None,
        location: MemoryLocation | None = None,
        address: int = 0,
        size: int = 0,
        readonly: bool = False,
    ) -> None:
        # Device memory has no memoryview: it comes as (address, size, location).
        if location is None:
            location = HOST if kind == "host" else MemoryLocation(kind, 0)
        if view is None and location.is_host:
            raise RegionError("host memory is registered through a buffer", region=name)
        nbytes = view.nbytes if view is not None else size
        if nbytes <= 0:
            raise RegionError("cannot register an empty buffer", region=name)
        if access not in ("rw", "r", "w"):
            raise RegionError(f"access must be 'rw', 'r' or 'w', not {access!r}", region=name)
        if (view.readonly if view is not None else readonly) and "w" in access:
            access = "r"
        self.view = view
        self.name = name
        self.id = next(_region_ids)
        self.size = nbytes
        self.address = buffer_address(view) if view is not None else address
        self.access = access
        #: Where the bytes live; ``kind`` is its kind (``"host"``, ``"cuda"``) for routing.
        self.location = location
        self.kind = location.kind
        self.token = secrets.randbits(63)
        self.engine_allocated = engine_allocated
        #: Transport-specific backing (a shm segment, say); the allocator's business.
        self.backing = backing
        #: True for regions peers may name (Engine.register/allocate); False for a
        #: buffer registered for one request only, which no peer addresses.
        self.published = False
        #: Per-transport registration info, sent to peers inside RemoteRegion.
        self.transport_info: dict[str, dict[str, Any]] = {}
        self._owner = owner
        # One entry per lease. list.append/pop are atomic under the GIL, so a lease takes
        # no lock: acquire appends, then looks at _refusing; close sets _refusing, then
        # looks at the list (so one of the two always sees the other). Refusing first is
        # what lets close() finish while other threads keep taking leases. The Condition
        # is only waited on by close(). The engine's C inline lane (engine/_fastlane.c) takes
        # and releases leases by this same protocol (LEASE_SLOTS, LEASE_WAKE), and only ever stores
        # a bool in _refusing and an int in _closers.
        self._held: list[None] = []
        self._refusing = False
        self._closed = False
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._closers = 0
        self._finalizers: list[Callable[[], None]] = []
        self._numa: int | None = None

    def __repr__(self) -> str:
        where = "" if self.location.is_host else f" memory={self.location}"
        return f"<Region {self.name!r} id={self.id} size={self.size} access={self.access}{where}>"

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def numa_node(self) -> int | None:
        """The NUMA node holding the region's first page, or None (unknown).

        Looked up on first use (:func:`mpcomm.topology.numa_node_of`) and kept
        once known; None for device memory, on kernels without NUMA, or while
        the page is not faulted in (asked again next time). Transports that
        have a choice (a NIC, copy threads) use it to pick the nearest.
        """
        n = self._numa
        if n is None and self.kind == "host" and not self._closed:
            from .topology import numa_node_of

            n = self._numa = numa_node_of(self.address)
        return n

    @property
    def leases(self) -> int:
        """Number of requests currently holding this region."""
        return len(self._held)

    @property
    def lease_list(self) -> list[None]:
        """The lease list itself (one entry per lease, the protocol above): for the engine's C
        inline lane, which takes and releases leases without a Python call."""
        return self._held

    def check_alignment(self, alignment: int) -> None:
        if alignment > 1 and self.address % alignment:
            raise AlignmentError(
                f"region {self.name!r} starts at {self.address:#x}, not aligned to {alignment} "
                "(memory.alignment); allocate it with Engine.allocate() or lower memory.alignment",
                region=self.name,
            )

    def acquire(self) -> None:
        """Take a lease; raises RegionClosedError if the region is gone."""
        held = self._held
        held.append(None)
        if self._refusing:
            held.pop()
            self._wake_closers()
            state = "is unregistered" if self._closed else "is being unregistered"
            raise RegionClosedError(f"region {self.name!r} {state}", region=self.name)

    def release(self) -> None:
        held = self._held
        held.pop()
        if not held and self._closers:
            self._wake_closers()

    def _wake_closers(self) -> None:
        with self._cond:
            self._cond.notify_all()

    def close(self, timeout: float | None = None) -> None:
        """Mark unregistered once no lease is held (see Engine.unregister)."""
        with self._cond:
            if self._closed:
                return
            held = self._held
            if held and timeout is None:
                raise RegionBusyError(
                    f"region {self.name!r} has {len(held)} transfer(s) in flight; wait for them "
                    "or pass a timeout to unregister()",
                    region=self.name,
                )
            deadline = time.monotonic() + (timeout or 0)
            self._closers += 1
            self._refusing = True  # from here on no new lease; a timed-out close lifts it again
            try:
                while held:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        if self._closers == 1:  # another close still waiting keeps refusing
                            self._refusing = False
                        waited = f" after {timeout}s" if timeout else ""
                        raise RegionBusyError(
                            f"region {self.name!r} still has {len(held)} transfer(s) in flight{waited}",
                            region=self.name,
                        )
                    # Timed slices: a release that popped the last lease just before we
                    # waited notifies nobody, so we look again rather than trust a wake-up.
                    self._cond.wait(min(left, 0.05))
            finally:
                self._closers -= 1
            self._closed = True
        for fin in reversed(self._finalizers):
            fin()
        self._finalizers.clear()
        # Dropping our references is enough: the exporter (or its mmap) is freed
        # once no transport slice refers to it any more. Device memory has no
        # slice to hold it: its owner stays until release_owner(), after the
        # transports' unregister.
        if self.view is not None:
            self._owner = None

    @property
    def owner(self) -> Any:
        """The object that keeps the memory alive (a transport that must keep it after unregister holds it)."""
        return self._owner

    def release_owner(self) -> None:
        """Drop the reference to the owner (the engine does, once the transports let go)."""
        self._owner = None

    def add_finalizer(self, fn: Callable[[], None]) -> None:
        self._finalizers.append(fn)

    @property
    def device(self) -> int:
        """The device ordinal of device memory; -1 for host memory."""
        return self.location.device

    def slice(self, offset: int, length: int) -> memoryview:
        if self.view is None:
            raise RegionError(f"region {self.name!r} is {self.location} memory: the CPU cannot slice it",
                              region=self.name)
        return self.view[offset : offset + length]



#: A region's lease state as the engine's C lane (engine/_fastlane.c) reads it: the slots holding
#: whether it refuses new leases and how many close() calls wait, and the function that wakes them
#: (called with the region). The lane takes and releases leases by the protocol of
#: :meth:`Region.acquire`/:meth:`Region.release` without calling them; it gets these when a pair is
#: bound (engine/bound.py), so no C code names an attribute, and they sit here, beside the protocol.
LEASE_SLOTS = (Region._refusing, Region._closers)
LEASE_WAKE = Region._wake_closers


def region_of(obj: Any, *, name: str, access: str | None = None) -> Region:
    """A :class:`Region` for anything :meth:`Engine.register <mpcomm.Engine.register>` accepts.

    See :mod:`mpcomm.memory_kinds` for the order the kinds of object are tried
    in. The region keeps ``obj`` (and, for DLPack, the capsule that pins the
    producer's tensor) alive until it is unregistered.
    """
    if isinstance(obj, DeviceBuffer):
        loc = obj.location
        if loc.is_host:
            raise RegionError("a DeviceBuffer names device memory; register host memory as a buffer", region=name)
        return _device_region(obj.ptr, obj.size, loc, name, access, obj.readonly, (obj, obj.owner))
    try:
        memoryview(obj).release()
        is_buffer = True
    except TypeError:
        is_buffer = False
    if is_buffer:
        view = as_byte_view(obj)
        return Region(view, name=name, access=access or ("r" if view.readonly else "rw"), owner=obj)
    loc = dlpack_location(obj)
    if hasattr(obj, "__cuda_array_interface__") and (loc is None or not loc.is_host):
        ptr, nbytes, readonly = cuda_array_interface(obj)
        if loc is None:
            from .memory_kinds import location_of

            loc = location_of(obj)
        return _device_region(ptr, nbytes, loc, name, access, readonly, obj)
    if loc is not None and hasattr(obj, "__dlpack__"):
        capsule = obj.__dlpack__()
        info = dlpack_tensor(capsule, type(obj).__name__)
        if info.location.is_host:
            # A CPU tensor that is not a PEP 688 buffer (torch): view its bytes.
            raw = (ctypes.c_char * info.nbytes).from_address(info.ptr) if info.nbytes else b""
            view = memoryview(raw).cast("B")
            return Region(view, name=name, access=access or "rw", owner=(obj, capsule, raw))
        return _device_region(info.ptr, info.nbytes, info.location, name, access, False, (obj, capsule))
    raise RegionError(f"cannot register {type(obj).__name__}: not a buffer, and it exposes neither "
                      "__dlpack__ nor __cuda_array_interface__", region=name)


def _device_region(ptr: int, size: int, loc: MemoryLocation, name: str, access: str | None, readonly: bool,
                   owner: Any) -> Region:
    if not isinstance(ptr, int) or ptr <= 0:
        raise RegionError(f"device pointer must be a positive integer, not {ptr!r}", region=name)
    if not isinstance(size, int) or size <= 0:
        raise RegionError(f"cannot register an empty buffer (size {size!r})", region=name)
    return Region(None, name=name, access=access or ("r" if readonly else "rw"), owner=owner, location=loc,
                  address=ptr, size=size, readonly=readonly)
