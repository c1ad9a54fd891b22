"""The local node's hardware topology, read from sysfs and procfs only.

:func:`discover` returns a :class:`Topology`: CPUs and NUMA nodes (with their
memory), network interfaces (state, speed, NUMA node), RDMA devices and ports
(NUMA node, link layer), GPUs (NUMA node), huge pages, the size of
``/dev/shm`` and the locked-memory limit. Nothing is executed and nothing is
changed: every value comes from reading a file, ``statvfs`` or ``getrlimit``.

A Topology travels in the handshake (``PeerInfo.topology``), so
:meth:`Topology.from_dict` treats its input as hostile: every field is
type-checked, strings and numbers are bounded, and lists longer than the caps
below are refused with a :class:`TopologyError` that names the field. The caps
bound what a peer can make us hold (the control channel already limits a frame
to 1 MiB; a topology stays well under :data:`MAX_ENCODED`). Discovery on a
host with more devices than a cap keeps the most relevant ones (physical NICs
before virtual ones) and says how many it dropped in ``truncated``.

:func:`numa_node_of` tells which NUMA node backs a buffer address
(``move_pages(2)`` in query mode, then ``/proc/self/numa_maps``), or None when
that is unknown.

Public API: :class:`Topology` and its parts, :func:`discover`,
:func:`numa_node_of`, :class:`TopologyError`.
"""

from __future__ import annotations

import ctypes
import glob
import json
import mmap
import os
import platform
import re
import socket
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = [
    "MAX_ENCODED",
    "Gpu",
    "HugePages",
    "NetInterface",
    "NumaNode",
    "RdmaDevice",
    "RdmaPort",
    "Topology",
    "TopologyError",
    "discover",
    "memlock_limits",
    "numa_node_of",
    "parse_cpulist",
    "parse_meminfo",
]

#: Caps on list sizes (what a peer can make us hold, and what discovery keeps).
MAX_NUMA_NODES = 64
MAX_CPUS_PER_NODE = 1024
MAX_INTERFACES = 64
MAX_RDMA_DEVICES = 32
MAX_RDMA_PORTS = 8
MAX_GPUS = 32
MAX_HUGEPAGE_SIZES = 8
MAX_STR = 128
#: A serialized topology larger than this is refused by from_dict.
MAX_ENCODED = 256 << 10
_MAX_INT = 1 << 62  # byte counts and speeds; anything above is garbage

_SYS_NODE = "/sys/devices/system/node"
_SYS_CPU = "/sys/devices/system/cpu"
_SYS_NET = "/sys/class/net"
_SYS_IB = "/sys/class/infiniband"
_SYS_PCI = "/sys/bus/pci/devices"
_SYS_HUGEPAGES = "/sys/kernel/mm/hugepages"

# PCI class codes (upper 16 bits of the 24-bit class) of display controllers:
# VGA (0x0300), 3D controller (0x0302, data-centre GPUs), display other (0x0380).
_GPU_CLASSES = {0x0300, 0x0302, 0x0380}
_GPU_VENDORS = {0x10DE: "nvidia", 0x1002: "amd", 0x8086: "intel", 0x1DB7: "habana"}


class TopologyError(ValueError):
    """A topology (usually from a peer) is malformed; the message names the field.

    A ValueError, so the handshake turns it into a ProtocolError for the
    connection that sent it, and nothing else is affected.
    """


# -- data ---------------------------------------------------------------------


@dataclass(frozen=True)
class NumaNode:
    """One NUMA node: its CPUs and memory (bytes; -1 when not reported)."""

    id: int
    cpus: tuple[int, ...] = ()
    mem_total: int = -1
    mem_free: int = -1


@dataclass(frozen=True)
class NetInterface:
    """A network interface. ``speed_mbps`` is -1 when the driver does not say;
    ``numa_node`` is -1 when unknown (virtual devices, single-node hosts)."""

    name: str
    state: str = "unknown"
    speed_mbps: int = -1
    mtu: int = -1
    numa_node: int = -1
    virtual: bool = True
    loopback: bool = False


@dataclass(frozen=True)
class RdmaPort:
    port: int
    state: str = "?"
    link_layer: str = "?"  # "InfiniBand" or "Ethernet" (RoCE)
    rate: str = ""


@dataclass(frozen=True)
class RdmaDevice:
    name: str
    numa_node: int = -1
    ports: tuple[RdmaPort, ...] = ()

    @property
    def active(self) -> bool:
        return any(p.state.upper() == "ACTIVE" for p in self.ports)


@dataclass(frozen=True)
class Gpu:
    """A GPU found on the PCI bus (address like ``0000:3b:00.0``)."""

    pci: str
    vendor: str = "unknown"
    numa_node: int = -1


@dataclass(frozen=True)
class HugePages:
    size: int  # page size in bytes
    total: int = 0
    free: int = 0


@dataclass(frozen=True)
class Topology:
    """What a node is made of; see the module docstring.

    ``memlock_soft``/``memlock_hard`` are -1 when unlimited; ``shm_size`` and
    ``shm_free`` are -1 when ``/dev/shm`` is missing.
    """

    hostname: str = ""
    arch: str = ""
    cpus: int = 0
    cpus_usable: int = 0
    numa_nodes: tuple[NumaNode, ...] = ()
    interfaces: tuple[NetInterface, ...] = ()
    rdma_devices: tuple[RdmaDevice, ...] = ()
    gpus: tuple[Gpu, ...] = ()
    hugepages: tuple[HugePages, ...] = ()
    shm_size: int = -1
    shm_free: int = -1
    memlock_soft: int = -1
    memlock_hard: int = -1
    truncated: dict[str, int] = field(default_factory=dict)

    @property
    def has_rdma(self) -> bool:
        """At least one RDMA device with an ACTIVE port."""
        return any(d.active for d in self.rdma_devices)

    @property
    def has_gpu(self) -> bool:
        return bool(self.gpus)

    def nearest_node(self) -> int:
        """The NUMA node of the first active RDMA device, else of the first
        physical interface that is up; -1 when none says."""
        for d in self.rdma_devices:
            if d.active and d.numa_node >= 0:
                return d.numa_node
        for i in self.interfaces:
            if not i.virtual and i.state == "up" and i.numa_node >= 0:
                return i.numa_node
        return -1

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form (lists for tuples); :meth:`from_dict` reads it back."""
        return json.loads(json.dumps(asdict(self)))

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), separators=(",", ":"), sort_keys=True)

    @classmethod
    def from_dict(cls, d: Any) -> Topology:
        """Validate and rebuild a topology a peer sent; raises TopologyError."""
        if not isinstance(d, dict):
            raise TopologyError(f"topology must be an object, not {type(d).__name__}")
        try:
            size = len(json.dumps(d, separators=(",", ":")))
        except (TypeError, ValueError, RecursionError) as exc:
            raise TopologyError(f"topology is not JSON-able: {type(exc).__name__}: {exc}") from None
        if size > MAX_ENCODED:
            raise TopologyError(f"topology of {size} bytes exceeds {MAX_ENCODED}")
        v = _Validator(d, "topology")
        v.only({f for f in cls.__dataclass_fields__})
        truncated_raw = d.get("truncated", {})
        if not isinstance(truncated_raw, dict) or len(truncated_raw) > 16:
            raise TopologyError("topology.truncated must be an object of at most 16 counts")
        truncated = {}
        for k, n in truncated_raw.items():
            truncated[_check_str(k, "topology.truncated key")] = _check_int(n, f"topology.truncated.{k}", 0, _MAX_INT)
        return cls(
            hostname=v.str("hostname"),
            arch=v.str("arch"),
            cpus=v.int("cpus", 0, 1 << 20, 0),
            cpus_usable=v.int("cpus_usable", 0, 1 << 20, 0),
            numa_nodes=v.list("numa_nodes", MAX_NUMA_NODES, _numa_from),
            interfaces=v.list("interfaces", MAX_INTERFACES, _iface_from),
            rdma_devices=v.list("rdma_devices", MAX_RDMA_DEVICES, _rdma_from),
            gpus=v.list("gpus", MAX_GPUS, _gpu_from),
            hugepages=v.list("hugepages", MAX_HUGEPAGE_SIZES, _huge_from),
            shm_size=v.int("shm_size", -1, _MAX_INT),
            shm_free=v.int("shm_free", -1, _MAX_INT),
            memlock_soft=v.int("memlock_soft", -1, _MAX_INT),
            memlock_hard=v.int("memlock_hard", -1, _MAX_INT),
            truncated=truncated,
        )


# -- validation of untrusted input ----------------------------------------------


def _check_int(value: Any, where: str, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TopologyError(f"{where} must be an integer, not {type(value).__name__}")
    if not lo <= value <= hi:
        raise TopologyError(f"{where} = {value} is outside [{lo}, {hi}]")
    return value


def _check_str(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise TopologyError(f"{where} must be a string, not {type(value).__name__}")
    if len(value) > MAX_STR:
        raise TopologyError(f"{where} is longer than {MAX_STR} characters")
    return value


class _Validator:
    def __init__(self, d: Any, where: str) -> None:
        if not isinstance(d, dict):
            raise TopologyError(f"{where} must be an object, not {type(d).__name__}")
        self.d = d
        self.where = where

    def only(self, known: set[str]) -> None:
        unknown = sorted(str(k) for k in self.d if k not in known)
        if unknown:
            raise TopologyError(f"{self.where} has unknown field {unknown[0][:MAX_STR]!r}")

    def int(self, key: str, lo: int, hi: int, default: int | None = -1) -> int:
        """``default`` None: the field is required."""
        if key not in self.d:
            if default is None:
                raise TopologyError(f"{self.where}.{key} is missing")
            return default
        return _check_int(self.d[key], f"{self.where}.{key}", lo, hi)

    def str(self, key: str, default: str = "") -> str:
        if key not in self.d:
            return default
        return _check_str(self.d[key], f"{self.where}.{key}")

    def bool(self, key: str, default: bool) -> bool:
        if key not in self.d:
            return default
        value = self.d[key]
        if not isinstance(value, bool):
            raise TopologyError(f"{self.where}.{key} must be true or false")
        return value

    def list(self, key: str, cap: int, build: Any) -> tuple[Any, ...]:
        raw = self.d.get(key, [])
        where = f"{self.where}.{key}"
        if not isinstance(raw, list):
            raise TopologyError(f"{where} must be a list, not {type(raw).__name__}")
        if len(raw) > cap:
            raise TopologyError(f"{where} has {len(raw)} entries; at most {cap} are accepted")
        return tuple(build(item, f"{where}[{i}]") for i, item in enumerate(raw))


def _numa_from(d: Any, where: str) -> NumaNode:
    v = _Validator(d, where)
    v.only({"id", "cpus", "mem_total", "mem_free"})
    cpus = d.get("cpus", [])
    if not isinstance(cpus, list) or len(cpus) > MAX_CPUS_PER_NODE:
        raise TopologyError(f"{where}.cpus must be a list of at most {MAX_CPUS_PER_NODE} CPU numbers")
    return NumaNode(
        id=v.int("id", 0, 4095, None),
        cpus=tuple(_check_int(c, f"{where}.cpus", 0, 1 << 20) for c in cpus),
        mem_total=v.int("mem_total", -1, _MAX_INT),
        mem_free=v.int("mem_free", -1, _MAX_INT),
    )


def _iface_from(d: Any, where: str) -> NetInterface:
    v = _Validator(d, where)
    v.only({"name", "state", "speed_mbps", "mtu", "numa_node", "virtual", "loopback"})
    name = v.str("name")
    if not name:
        raise TopologyError(f"{where}.name must not be empty")
    return NetInterface(
        name=name,
        state=v.str("state", "unknown"),
        speed_mbps=v.int("speed_mbps", -1, 1 << 32),
        mtu=v.int("mtu", -1, 1 << 20),
        numa_node=v.int("numa_node", -1, 4095),
        virtual=v.bool("virtual", True),
        loopback=v.bool("loopback", False),
    )


def _port_from(d: Any, where: str) -> RdmaPort:
    v = _Validator(d, where)
    v.only({"port", "state", "link_layer", "rate"})
    return RdmaPort(port=v.int("port", 0, 255, None), state=v.str("state", "?"),
                    link_layer=v.str("link_layer", "?"), rate=v.str("rate"))


def _rdma_from(d: Any, where: str) -> RdmaDevice:
    v = _Validator(d, where)
    v.only({"name", "numa_node", "ports"})
    name = v.str("name")
    if not name:
        raise TopologyError(f"{where}.name must not be empty")
    return RdmaDevice(name=name, numa_node=v.int("numa_node", -1, 4095),
                      ports=v.list("ports", MAX_RDMA_PORTS, _port_from))


def _gpu_from(d: Any, where: str) -> Gpu:
    v = _Validator(d, where)
    v.only({"pci", "vendor", "numa_node"})
    return Gpu(pci=v.str("pci"), vendor=v.str("vendor", "unknown"), numa_node=v.int("numa_node", -1, 4095))


def _huge_from(d: Any, where: str) -> HugePages:
    v = _Validator(d, where)
    v.only({"size", "total", "free"})
    return HugePages(size=v.int("size", 1, _MAX_INT, None), total=v.int("total", 0, _MAX_INT, 0),
                     free=v.int("free", 0, _MAX_INT, 0))


# -- discovery ------------------------------------------------------------------


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            return fh.read().strip()
    except OSError:
        return None


def _read_int(path: str, default: int = -1) -> int:
    text = _read(path)
    if text is None:
        return default
    try:
        return int(text, 0) if text.startswith("0x") else int(text)
    except ValueError:
        return default


def parse_cpulist(text: str) -> tuple[int, ...]:
    """``"0-3,8,10-11"`` → (0, 1, 2, 3, 8, 10, 11); garbage parts are skipped."""
    out: list[int] = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        lo, sep, hi = part.partition("-")
        try:
            a = int(lo)
            b = int(hi) if sep else a
        except ValueError:
            continue
        if b < a or b - a > MAX_CPUS_PER_NODE:
            continue
        out.extend(range(a, b + 1))
    return tuple(out[:MAX_CPUS_PER_NODE])


def parse_meminfo(text: str) -> dict[str, int]:
    """``/proc/meminfo`` (or a node's meminfo) → bytes for kB fields, counts otherwise."""
    out: dict[str, int] = {}
    for line in text.splitlines():
        line = re.sub(r"^Node\s+\d+\s+", "", line)
        key, sep, rest = line.partition(":")
        parts = rest.split()
        if not sep or not parts:
            continue
        try:
            number = int(parts[0])
        except ValueError:
            continue
        if len(parts) > 1 and parts[1].lower() == "kb":
            number *= 1024
        out[key.strip()] = number
    return out


def _node_id(path: str) -> int:
    m = re.search(r"node(\d+)$", path)
    return int(m.group(1)) if m else -1


def discover_numa(root: str = _SYS_NODE) -> tuple[NumaNode, ...]:
    nodes = []
    for path in sorted(glob.glob(f"{root}/node[0-9]*"), key=_node_id)[:MAX_NUMA_NODES]:
        mem = parse_meminfo(_read(os.path.join(path, "meminfo")) or "")
        nodes.append(NumaNode(
            id=_node_id(path),
            cpus=parse_cpulist(_read(os.path.join(path, "cpulist")) or ""),
            mem_total=mem.get("MemTotal", -1),
            mem_free=mem.get("MemFree", -1),
        ))
    return tuple(nodes)


def _device_numa(dev_dir: str) -> int:
    # "-1" on single-node hosts and for devices whose firmware does not say
    return _read_int(os.path.join(dev_dir, "device", "numa_node"))


def discover_interfaces(root: str = _SYS_NET, limit: int | None = MAX_INTERFACES) -> tuple[tuple[NetInterface, ...], int]:
    """Interfaces, physical first; and how many were dropped past ``limit``
    (None: keep all, for local reports that are never sent to a peer)."""
    found = []
    try:
        names = sorted(os.listdir(root))
    except OSError:
        return (), 0
    for name in names:
        d = os.path.join(root, name)
        flags = _read_int(os.path.join(d, "flags"), 0)
        state = _read(os.path.join(d, "operstate")) or "unknown"
        if state == "unknown" and flags & 0x1:  # IFF_UP: lo and tun report "unknown"
            state = "up"
        speed = _read_int(os.path.join(d, "speed"))  # EINVAL (unreadable) on virtual NICs
        found.append(NetInterface(
            name=name[:MAX_STR],
            state=state[:MAX_STR],
            speed_mbps=speed if 0 < speed < (1 << 32) else -1,
            mtu=_read_int(os.path.join(d, "mtu")),
            numa_node=_device_numa(d),
            virtual=not os.path.exists(os.path.join(d, "device")),
            loopback=bool(flags & 0x8),
        ))
    found.sort(key=lambda i: (i.virtual, i.loopback, i.name))
    if limit is None:
        return tuple(found), 0
    return tuple(found[:limit]), max(0, len(found) - limit)


def discover_rdma(root: str = _SYS_IB) -> tuple[RdmaDevice, ...]:
    try:
        names = sorted(os.listdir(root))
    except OSError:
        return ()
    devices = []
    for name in names[:MAX_RDMA_DEVICES]:
        d = os.path.join(root, name)
        ports = []
        try:
            port_names = sorted(os.listdir(os.path.join(d, "ports")), key=lambda p: int(p) if p.isdigit() else 0)
        except OSError:
            port_names = []
        for p in port_names[:MAX_RDMA_PORTS]:
            if not p.isdigit():
                continue
            pd = os.path.join(d, "ports", p)
            raw_state = _read(os.path.join(pd, "state")) or "?"  # "4: ACTIVE"
            ports.append(RdmaPort(
                port=int(p),
                state=(raw_state.split(":", 1)[-1].strip() or raw_state)[:MAX_STR],
                link_layer=(_read(os.path.join(pd, "link_layer")) or "?")[:MAX_STR],
                rate=(_read(os.path.join(pd, "rate")) or "")[:MAX_STR],
            ))
        devices.append(RdmaDevice(name=name[:MAX_STR], numa_node=_device_numa(d), ports=tuple(ports)))
    return tuple(devices)


def discover_gpus(root: str = _SYS_PCI) -> tuple[Gpu, ...]:
    gpus = []
    for d in sorted(glob.glob(f"{root}/*")):
        cls = _read_int(os.path.join(d, "class"), 0)
        if (cls >> 8) not in _GPU_CLASSES:
            continue
        vendor_id = _read_int(os.path.join(d, "vendor"), 0)
        vendor = _GPU_VENDORS.get(vendor_id)
        if vendor is None:
            continue  # emulated VGA of a VM (QEMU, virtio-gpu) is not a GPU worth routing to
        gpus.append(Gpu(pci=os.path.basename(d)[:MAX_STR], vendor=vendor,
                        numa_node=_read_int(os.path.join(d, "numa_node"))))
    return tuple(gpus[:MAX_GPUS])


def discover_hugepages(root: str = _SYS_HUGEPAGES) -> tuple[HugePages, ...]:
    out = []
    for d in glob.glob(f"{root}/hugepages-*kB"):
        m = re.search(r"hugepages-(\d+)kB$", d)
        if not m:
            continue
        out.append(HugePages(size=int(m.group(1)) * 1024,
                             total=max(0, _read_int(os.path.join(d, "nr_hugepages"), 0)),
                             free=max(0, _read_int(os.path.join(d, "free_hugepages"), 0))))
    out.sort(key=lambda h: h.size)
    return tuple(out[:MAX_HUGEPAGE_SIZES])


def _shm(path: str) -> tuple[int, int]:
    try:
        st = os.statvfs(path)
    except OSError:
        return -1, -1
    return st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize


def memlock_limits() -> tuple[int, int]:
    """RLIMIT_MEMLOCK (soft, hard) in bytes, -1 for unlimited."""
    try:
        import resource
    except ImportError:  # pragma: no cover - not POSIX
        return -1, -1
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    inf = resource.RLIM_INFINITY
    return (-1 if soft == inf else soft), (-1 if hard == inf else hard)


def discover(*, shm_path: str = "/dev/shm") -> Topology:
    """Read the local node's topology (cheap: a few hundred small file reads)."""
    interfaces, dropped = discover_interfaces()
    shm_size, shm_free = _shm(shm_path)
    soft, hard = memlock_limits()
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 0)
    return Topology(
        hostname=socket.gethostname()[:MAX_STR],
        arch=platform.machine()[:MAX_STR],
        cpus=os.cpu_count() or 0,
        cpus_usable=usable,
        numa_nodes=discover_numa(),
        interfaces=interfaces,
        rdma_devices=discover_rdma(),
        gpus=discover_gpus(),
        hugepages=discover_hugepages(),
        shm_size=shm_size,
        shm_free=shm_free,
        memlock_soft=soft,
        memlock_hard=hard,
        truncated={"interfaces": dropped} if dropped else {},
    )


# -- NUMA node of a buffer ------------------------------------------------------------

# move_pages(2) has no glibc wrapper (it lives in libnuma), so call the syscall.
_SYS_MOVE_PAGES = {"x86_64": 279, "aarch64": 239, "riscv64": 239, "ppc64le": 301, "ppc64": 301, "s390x": 310}


def _move_pages_query(address: int) -> int | None:
    nr = _SYS_MOVE_PAGES.get(platform.machine())
    if nr is None:
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        syscall = libc.syscall
    except (OSError, AttributeError):
        return None
    syscall.restype = ctypes.c_long
    page = address & ~(mmap.PAGESIZE - 1)
    pages = (ctypes.c_void_p * 1)(page)
    status = (ctypes.c_int * 1)(-1)
    # nodes=NULL: query only, nothing moves.
    rc = syscall(ctypes.c_long(nr), ctypes.c_int(0), ctypes.c_ulong(1), pages, None, status, ctypes.c_int(0))
    if rc != 0:
        return None
    return status[0] if status[0] >= 0 else None  # -ENOENT: page not faulted in yet


def _numa_maps_query(address: int) -> int | None:
    """The node holding most of the mapping that contains ``address``."""
    start = None
    try:
        with open("/proc/self/maps") as fh:
            for line in fh:
                lo_s, _, hi_s = line.split(" ", 1)[0].partition("-")
                lo, hi = int(lo_s, 16), int(hi_s, 16)
                if lo <= address < hi:
                    start = lo
                    break
        if start is None:
            return None
        with open("/proc/self/numa_maps") as fh:
            for line in fh:
                head, _, rest = line.partition(" ")
                if int(head, 16) != start:
                    continue
                counts = {int(n): int(c) for n, c in re.findall(r"\bN(\d+)=(\d+)", rest)}
                return max(counts, key=counts.__getitem__) if counts else None
    except (OSError, ValueError):
        return None
    return None


def numa_node_of(address: int) -> int | None:
    """The NUMA node of the page at ``address`` in this process, or None (unknown).

    Unknown means: the page is not faulted in yet, the kernel has no NUMA
    support, or neither ``move_pages(2)`` nor ``/proc/self/numa_maps`` answers.
    """
    if address <= 0:
        return None
    node = _move_pages_query(address)
    if node is None:
        node = _numa_maps_query(address)
    return node
