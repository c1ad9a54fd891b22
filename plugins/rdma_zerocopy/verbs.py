"""Every use of pyverbs lives here, imported lazily (never at plugin import time).

The transport (:mod:`.transport`) sees a small interface — :class:`Device`,
:class:`QueuePair`, :class:`MemoryRegistration`, :class:`WorkRequest` — that a
test double can reproduce without an adapter.

**Finding pyverbs.** Debian and Ubuntu ship pyverbs for the distribution's
``/usr/bin/python3`` only (``python3-pyverbs`` installs into
``/usr/lib/python3/dist-packages``). An interpreter of the same version
installed elsewhere (pyenv, a venv without system site-packages) does not see
it. Putting the whole of ``dist-packages`` on ``sys.path`` is unsafe: it holds
the distribution's copies of cryptography, pip, setuptools/pkg_resources,
yaml, ... that would fill gaps in (or mix versions with) the interpreter's own
packages. :func:`load_pyverbs` therefore loads *only* the ``pyverbs`` package
from those directories, and only when its extension modules carry an ABI tag
this interpreter accepts. ``MPCOMM_PYVERBS_PATH`` (``os.pathsep``-separated
directories) replaces the default search list; set it empty to disable the
fallback.

**The application's logging is left alone.** ``pyverbs.base`` calls
``logging.basicConfig(level=INFO)`` when it is imported; :func:`load_pyverbs`
imports every pyverbs module this file uses at once and restores the root
logger's handlers and level afterwards.

**Work requests are reused.** pyverbs 44 spells the destructor of ``SGE`` and
``SendWR`` ``__dealloc`` (not ``__dealloc__``), so their ``malloc``'d
scatter-gather buffers are never freed: 64 bytes per post when a new pair is
built for every post. Each :class:`QueuePair` posts through one
:class:`_Chain` of :class:`_WrSlot` (one SGE, one SendWR whose ``sg_list``
points at that SGE), updating fields per post; a list of work requests goes
out in one ``ibv_post_send`` through the chain's linked SendWRs. Chains go
back to a process-wide pool when the QP is closed and are never deallocated
(see :class:`_WrSlot` for why that is the only layout that is safe with both
the broken and a fixed destructor).

**Waiting without spinning.** ``CompChannel.get_cq_event`` holds the GIL while
it blocks in ``ibv_get_cq_event``. :class:`Device` waits on the channel's file
descriptor with ``select`` (which releases the GIL) and calls
``get_cq_event`` only once it is readable (the descriptor is non-blocking).
The descriptor is ``CompChannel.fd`` where pyverbs has it (rdma-core 57 and
later); pyverbs 44 does not expose it, and then the one
``anon_inode:[infinibandevent]`` descriptor that appeared while the channel was
created is taken — only if exactly one appeared and none vanished, with every
context and channel this module opens or closes serialised by one lock (the
async-event descriptor ``ibv_open_device`` creates has the same name). When
the descriptor cannot be identified, the device polls with a capped back-off
(≤ 1 ms) and never arms the CQ (an armed CQ queues an event per completion
that nobody would read).

**Async events** (port down, GID change, fatal QP / device / CQ errors) are
read from the context's async descriptor, found the same way, and handed to
the transport by :meth:`Device.read_async_events`.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import glob
import importlib
import importlib.machinery
import importlib.util
import logging
import os
import random
import re
import select
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

__all__ = [
    "Device",
    "DeviceProbe",
    "MemoryRegistration",
    "PyverbsMissing",
    "QueuePair",
    "VerbsError",
    "WorkRequest",
    "judge_device",
    "judge_port",
    "load_pyverbs",
    "probe",
    "rdma_core_version",
]

INSTALL_HINT = "apt install python3-pyverbs"
EVENT_FD_NAME = "anon_inode:[infinibandevent]"
_load_lock = threading.Lock()
#: Held around every Context open/close and CompChannel creation in this module,
#: so the descriptors that appear meanwhile are the ones we created.
ctx_lock = threading.RLock()

#: The modules :func:`load_pyverbs` imports up front (under the logging guard).
_MODULES = ("pyverbs.device", "pyverbs.enums", "pyverbs.cq", "pyverbs.pd", "pyverbs.qp", "pyverbs.mr",
            "pyverbs.wr", "pyverbs.addr")

#: ``enum ibv_event_type`` (libibverbs ABI).
ASYNC_EVENTS: dict[int, str] = {
    0: "IBV_EVENT_CQ_ERR", 1: "IBV_EVENT_QP_FATAL", 2: "IBV_EVENT_QP_REQ_ERR", 3: "IBV_EVENT_QP_ACCESS_ERR",
    4: "IBV_EVENT_COMM_EST", 5: "IBV_EVENT_SQ_DRAINED", 6: "IBV_EVENT_PATH_MIG", 7: "IBV_EVENT_PATH_MIG_ERR",
    8: "IBV_EVENT_DEVICE_FATAL", 9: "IBV_EVENT_PORT_ACTIVE", 10: "IBV_EVENT_PORT_ERR",
    11: "IBV_EVENT_LID_CHANGE", 12: "IBV_EVENT_PKEY_CHANGE", 13: "IBV_EVENT_SM_CHANGE", 14: "IBV_EVENT_SRQ_ERR",
    15: "IBV_EVENT_SRQ_LIMIT_REACHED", 16: "IBV_EVENT_QP_LAST_WQE_REACHED", 17: "IBV_EVENT_CLIENT_REREGISTER",
    18: "IBV_EVENT_GID_CHANGE", 19: "IBV_EVENT_WQ_FATAL",
}

# ibv_transport_type / ibv_node_type / ibv_port_state / ibv_link_layer (libibverbs ABI)
TRANSPORT_IB = 0
_TRANSPORT_WHY = {
    1: "iWARP: it connects through rdma_cm, not manually connected RC queue pairs",
    2: "usNIC: no RC queue pairs",
    3: "usNIC/UDP: no RC queue pairs",
    4: "transport type unspecified (EFA and similar): no RC queue pairs",
    -1: "unknown transport type",
}
LINK_LAYERS = {1: "InfiniBand", 2: "Ethernet"}
PORT_ACTIVE = 4


class PyverbsMissing(Exception):
    """pyverbs (or the libibverbs it links) cannot be imported; ``str()`` says why."""


class VerbsError(Exception):
    """A verbs call failed; ``errno`` is the C error code where pyverbs gave one (else 0)."""

    def __init__(self, message: str, err: int = 0) -> None:
        super().__init__(message)
        self.errno = err


def error_text(what: str, exc: BaseException) -> tuple[str, int]:
    """``(message, errno)`` for a pyverbs exception.

    pyverbs' default error code is -1 ("none given"), not -EPERM: it gets no
    strerror. A real code is already spelled out in pyverbs' own message
    (``... Errno: 22, Invalid argument``); it is added only where it is not.
    Some rdma-core calls return ``-errno``: those are made positive.
    """
    code = getattr(exc, "error_code", None)
    code = code if isinstance(code, int) and not isinstance(code, bool) else 0
    if code < -1:
        code = -code
    elif code < 0:
        code = 0
    text = f"{what}: {exc}"
    if code:
        reason = os.strerror(code)
        if reason not in text:
            text += f" ({reason})"
    return text, code


@contextlib.contextmanager
def _verbs(what: str) -> Iterator[None]:
    """Turn pyverbs' exceptions into VerbsError (keeping the cause)."""
    try:
        yield
    except VerbsError:
        raise
    except Exception as exc:  # PyverbsRDMAError / PyverbsUserError / PyverbsError
        text, code = error_text(what, exc)
        raise VerbsError(text, code) from exc


# -- loading ------------------------------------------------------------------


def _search_dirs() -> list[str]:
    env = os.environ.get("MPCOMM_PYVERBS_PATH")
    if env is not None:
        return [p for p in env.split(os.pathsep) if p]
    ver = f"python{sys.version_info.major}.{sys.version_info.minor}"
    return [
        "/usr/lib/python3/dist-packages",  # Debian, Ubuntu
        f"/usr/lib64/{ver}/site-packages",  # Fedora, RHEL
        f"/usr/lib/{ver}/site-packages",  # Arch, Fedora (noarch)
    ]


def _forget_pyverbs() -> None:
    for name in [n for n in sys.modules if n == "pyverbs" or n.startswith("pyverbs.")]:
        del sys.modules[name]


@contextlib.contextmanager
def keep_root_logging() -> Iterator[None]:
    """Restore the root logger's handlers and level after the block (pyverbs' basicConfig)."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    try:
        yield
    finally:
        for h in list(root.handlers):
            if h not in handlers:
                root.removeHandler(h)
        for h in handlers:
            if h not in root.handlers:
                root.addHandler(h)
        root.setLevel(level)


def _import_all() -> None:
    for name in _MODULES:
        importlib.import_module(name)


def load_pyverbs() -> ModuleType:
    """Import pyverbs (see the module docstring); raises PyverbsMissing with the reason."""
    with _load_lock:
        mod = sys.modules.get("pyverbs")
        if mod is not None and all(m in sys.modules for m in _MODULES):
            return mod
        with keep_root_logging():
            return _load_locked()


def _load_locked() -> ModuleType:
    try:
        import pyverbs  # noqa: F401  (the native copy, if this interpreter has one)

        _import_all()
        return sys.modules["pyverbs"]
    except ImportError as exc:
        _forget_pyverbs()
        first = f"import pyverbs: {exc}"
    tried: list[str] = []
    suffixes = tuple(importlib.machinery.EXTENSION_SUFFIXES)
    for d in _search_dirs():
        pkg = Path(d) / "pyverbs"
        init = pkg / "__init__.py"
        if not init.is_file():
            continue
        exts = [p.name for p in pkg.glob("device*.so")]
        if not any(name == f"device{sfx}" for name in exts for sfx in suffixes if sfx != ".so"):
            tried.append(f"{pkg} is built for another Python ({', '.join(exts) or 'no device module'}; "
                         f"this one loads {suffixes[0]})")
            continue
        spec = importlib.util.spec_from_file_location("pyverbs", init, submodule_search_locations=[str(pkg)])
        if spec is None or spec.loader is None:
            continue
        module = importlib.util.module_from_spec(spec)
        sys.modules["pyverbs"] = module
        try:
            spec.loader.exec_module(module)
            _import_all()
        except (ImportError, OSError) as exc:
            _forget_pyverbs()
            tried.append(f"{pkg}: {exc}")
            continue
        return module
    raise PyverbsMissing("; ".join([first, *tried]))


# -- versions -----------------------------------------------------------------------

_LIB_DIRS = ("/usr/lib/*-linux-gnu", "/usr/lib64", "/usr/lib", "/lib/*-linux-gnu", "/lib64", "/usr/local/lib")
_SONAME = re.compile(r"libibverbs\.so\.1\.(\d+)\.(\d+(?:\.\d+)*)$")


def _dpkg_versions(packages: tuple[str, ...], status: str = "/var/lib/dpkg/status") -> dict[str, str]:
    out: dict[str, str] = {}
    try:
        text = Path(status).read_text(errors="replace")
    except OSError:
        return out
    for stanza in text.split("\n\n"):
        fields = dict(line.split(": ", 1) for line in stanza.splitlines() if ": " in line and not line[0].isspace())
        name = fields.get("Package")
        if name in packages and "installed" in fields.get("Status", "").split() and "Version" in fields:
            out[name] = fields["Version"]
    return out


def rdma_core_version(lib_dirs: tuple[str, ...] = _LIB_DIRS, dpkg_status: str = "/var/lib/dpkg/status") -> str:
    """rdma-core's version as this node has it, read from files (no pyverbs import, no subprocess).

    libibverbs' file name carries it (``libibverbs.so.1.<abi>.<rdma-core version>``,
    e.g. ``libibverbs.so.1.14.44.0`` is rdma-core 44.0); the copy this process
    mapped wins over one found on disk. Debian's package versions and a PyPI
    ``pyverbs`` distribution are added where present. "" when none is found.
    """
    libs: list[str] = []
    with contextlib.suppress(OSError):
        with open("/proc/self/maps") as f:
            libs = sorted({line.split()[-1] for line in f if "libibverbs.so.1." in line})
    if not libs:
        for pattern in lib_dirs:
            libs += sorted(glob.glob(os.path.join(pattern, "libibverbs.so.1.*")))
    version = lib = ""
    for path in libs:
        m = _SONAME.search(os.path.basename(path))
        if m:
            version, lib = m.group(2), os.path.basename(path)
            break
    extra = [lib] if lib else []
    for pkg, ver in sorted(_dpkg_versions(("rdma-core", "libibverbs1", "python3-pyverbs"), dpkg_status).items()):
        extra.append(f"{pkg} {ver}")
        if not version:
            version = ver.split("-")[0].split(":")[-1]
    with contextlib.suppress(Exception):
        from importlib.metadata import version as dist_version

        pypi = dist_version("pyverbs")
        extra.append(f"pyverbs {pypi} (PyPI)")
        version = version or pypi
    if not version:
        return ""
    return f"rdma-core {version}" + (f" ({'; '.join(extra)})" if extra else "")


# -- probing --------------------------------------------------------------------


@dataclass(frozen=True)
class DeviceProbe:
    """Outcome of :func:`probe`: an active port, or why there is none; ``skipped`` says what was passed over."""

    ok: bool
    reason: str
    device: str = ""
    port: int = 0
    link_layer: str = ""
    skipped: tuple[str, ...] = field(default=())


def device_name(dev: Any) -> str:
    """A pyverbs device's name as str (pyverbs gives bytes)."""
    n = dev.name
    return n.decode() if isinstance(n, bytes) else str(n)


def judge_device(transport_type: int) -> str:
    """Why a device cannot carry manually connected RC queue pairs ("" when it can)."""
    t = int(transport_type)
    if t == TRANSPORT_IB:
        return ""
    return _TRANSPORT_WHY.get(t, f"transport type {t} is not InfiniBand/RoCE")


def judge_port(state: int, link_layer: int) -> str:
    """Why a port is not usable ("" when it is): it must be ACTIVE with a known link layer."""
    if int(link_layer) not in LINK_LAYERS:
        return f"link layer {int(link_layer)} is neither InfiniBand nor Ethernet (RoCE)"
    if int(state) != PORT_ACTIVE:
        return "not ACTIVE"
    return ""


def list_devices() -> list[Any]:
    """The RDMA devices libibverbs sees ([] when none or no kernel support)."""
    load_pyverbs()
    from pyverbs.device import get_device_list

    try:
        return list(get_device_list())
    except Exception:  # noqa: BLE001 - pyverbs raises when ibv_get_device_list returns NULL
        return []


def no_device_detail() -> str:
    if not os.path.isdir("/sys/class/infiniband"):
        return ("; the kernel exposes no /sys/class/infiniband (no RDMA driver loaded, or a kernel "
                "built without CONFIG_INFINIBAND)")
    return ""


def nearest_first(names: list[str], numa_of: Callable[[str], int], near: frozenset[int]) -> list[int]:
    """Indices of ``names`` with the adapters on a node in ``near`` first, the list order kept otherwise.

    ``numa_of(name)`` is an adapter's NUMA node (-1 unknown). With ``device``
    unset the engine takes the first usable port in this order: the NIC on the
    socket this process runs on, so DMA and the CPU's copies stay local.
    """
    if not near:
        return list(range(len(names)))
    return sorted(range(len(names)), key=lambda i: numa_of(names[i]) not in near)


def _device_numa_node(name: str, root: str = "/sys/class/infiniband") -> int:
    try:
        with open(os.path.join(root, name, "device", "numa_node")) as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return -1


def _local_nodes() -> frozenset[int]:
    """The NUMA nodes whose CPUs this process may run on (empty on a single-node host)."""
    from mpcomm.topology import discover_numa

    try:
        nodes = discover_numa()
        allowed = os.sched_getaffinity(0)
    except OSError:
        return frozenset()
    if len(nodes) < 2:
        return frozenset()
    return frozenset(n.id for n in nodes if allowed & set(n.cpus))


def probe(device: str = "", port: int = 0) -> DeviceProbe:
    """Find an ACTIVE RC-capable port (on ``device`` if given). Opens and closes contexts; nothing else."""
    load_pyverbs()
    from pyverbs.device import Context

    devs = list_devices()
    if not devs:
        return DeviceProbe(False, "no RDMA device (ibv_get_device_list returned none)" + no_device_detail())
    names = [device_name(d) for d in devs]
    if device and device not in names:
        return DeviceProbe(False, f"no RDMA device named {device!r} (found: {', '.join(names)})")
    skipped: list[str] = []
    order = nearest_first(names, _device_numa_node, _local_nodes())
    for dev, name in [(devs[i], names[i]) for i in order]:
        if device and name != device:
            continue
        why = judge_device(getattr(dev, "transport_type", TRANSPORT_IB))
        if why:
            skipped.append(f"{name} skipped: {why}")
            continue
        try:
            with ctx_lock, _verbs(f"open {name}"):
                ctx = Context(name=name)
        except VerbsError as exc:
            skipped.append(f"{name} skipped: cannot be opened: {exc}")
            continue
        try:
            with _verbs(f"query {name}"):
                nports = int(ctx.query_device().phys_port_cnt)
                ports = [port] if port else list(range(1, nports + 1))
                whys = []
                for p in ports:
                    pa = ctx.query_port(p)
                    why = judge_port(pa.state, pa.link_layer)
                    if not why:
                        return DeviceProbe(True, "", name, p, LINK_LAYERS[int(pa.link_layer)], tuple(skipped))
                    whys.append(f"port {p} {why}")
        except VerbsError as exc:
            skipped.append(f"{name} skipped: {exc}")
            continue
        finally:
            with ctx_lock, contextlib.suppress(Exception):
                ctx.close()
        skipped.append(f"{name} skipped: " + ("; ".join(whys) or "no ports"))
    reason = "no usable RDMA port: " + "; ".join(skipped) if skipped else "no usable RDMA port"
    return DeviceProbe(False, reason, skipped=tuple(skipped))


# -- the data path ------------------------------------------------------------------


@dataclass(frozen=True)
class WorkRequest:
    """One RDMA WRITE or READ of a contiguous range (signaled unless ``signaled`` is False)."""

    wr_id: int
    kind: str  # "write" | "read"
    local_addr: int
    length: int
    lkey: int
    remote_addr: int
    rkey: int
    signaled: bool = True


class MemoryRegistration:
    """An ``ibv_reg_mr`` of caller-owned memory; ``close()`` deregisters it."""

    def __init__(self, mr: Any, addr: int, length: int, access: int = 0) -> None:
        self._mr = mr
        self.addr = addr
        self.length = length
        self.access = access
        self.lkey = int(mr.lkey)
        self.rkey = int(mr.rkey)

    def close(self) -> None:
        mr, self._mr = self._mr, None
        if mr is not None:
            with _verbs("ibv_dereg_mr"):
                mr.close()


def access_flags(access: str, remote: bool = True) -> int:
    """ibv_access_flags for a region's ``access`` ("rw", "r", "w").

    LOCAL_WRITE is left out of read-only regions: pinning a read-only mapping
    for write fails (EFAULT), and an RDMA WRITE source needs no local write.
    ``remote=False`` (a buffer no peer can name, e.g. one passed for a single
    request) grants no remote right at all: only LOCAL_WRITE where an RDMA
    READ must land in it.
    """
    import pyverbs.enums as e

    flags = 0
    if "w" in access:
        flags |= e.IBV_ACCESS_LOCAL_WRITE
        if remote:
            flags |= e.IBV_ACCESS_REMOTE_WRITE
    if "r" in access and remote:
        flags |= e.IBV_ACCESS_REMOTE_READ
    return flags


def _immortal(obj: Any) -> None:
    """Take a reference that is never dropped, so ``obj`` is never deallocated (see :class:`_WrSlot`)."""
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(obj))


class _WrSlot:
    """One SGE and one SendWR, reused for every post of one QP.

    The SendWR's ``sg_list`` is pointed at the SGE's own ``ibv_sge``, so
    updating ``sge.addr/length/lkey`` updates what ``ibv_post_send`` reads
    (the SendWR's constructor copies the SGE into a buffer of its own: 16
    bytes left behind once per slot). That sharing means a fixed destructor
    would free the same buffer twice (once per object), and calling
    ``close()`` on either is a double free or a dangling pointer; the broken
    44 destructor frees nothing. So a slot is never closed nor deallocated:
    it holds a permanent reference to both objects and returns to
    :data:`_SLOTS` when its QP is closed. Memory: one slot per QP alive at
    once, whatever the number of posts.

    ``ibv_post_send`` copies the request into the send queue before it
    returns, so a slot is free again as soon as ``post`` returns.
    """

    def __init__(self) -> None:
        import pyverbs.enums as e
        from pyverbs.wr import SGE, SendWR

        self.sge = SGE(0, 0, 0)
        self.swr = SendWR(wr_id=0, opcode=e.IBV_WR_RDMA_WRITE, num_sge=1, sg=[self.sge],
                          send_flags=e.IBV_SEND_SIGNALED)
        self.swr.sg_list = self.sge
        _immortal(self.sge)
        _immortal(self.swr)
        self._write, self._read = int(e.IBV_WR_RDMA_WRITE), int(e.IBV_WR_RDMA_READ)
        self._signaled = int(e.IBV_SEND_SIGNALED)

    def fill(self, wr: WorkRequest) -> Any:
        sge, swr = self.sge, self.swr
        sge.addr, sge.length, sge.lkey = wr.local_addr, wr.length, wr.lkey
        swr.wr_id = wr.wr_id
        swr.opcode = self._write if wr.kind == "write" else self._read
        swr.send_flags = self._signaled if wr.signaled else 0
        swr.set_wr_rdma(wr.rkey, wr.remote_addr)
        return swr


class _Chain:
    """Slots linked ``slots[0] → slots[1] → … → slots[-1]`` (whose ``next`` stays NULL).

    A list of k work requests is written into the last k slots and posted
    from ``slots[-k]``: one ``ibv_post_send`` for the whole list. The chain
    only grows, at its head (a SendWR's ``next`` cannot be reset to NULL from
    Python), up to :data:`MAX_CHAIN`. ``bad`` receives the failing request
    from ``ibv_post_send`` (a copy: it is as immortal as the slots).
    """

    def __init__(self) -> None:
        import pyverbs.enums as e
        from pyverbs.wr import SGE, SendWR

        self.slots = [_WrSlot()]
        sge = SGE(0, 0, 0)
        self.bad = SendWR(wr_id=0, opcode=e.IBV_WR_RDMA_WRITE, num_sge=1, sg=[sge])
        _immortal(sge)
        _immortal(self.bad)

    def ensure(self, k: int) -> None:
        while len(self.slots) < k:
            head = _WrSlot()
            head.swr.next_wr = self.slots[0].swr
            self.slots.insert(0, head)

    def post(self, qp: Any, wrs: list[WorkRequest]) -> None:
        k = len(wrs)
        self.ensure(k)
        tail = self.slots[-k:]
        for slot, wr in zip(tail, wrs):
            slot.fill(wr)
        self.bad.wr_id = 0
        try:
            qp.post_send(tail[0].swr, self.bad)
        except Exception as exc:
            bad = int(self.bad.wr_id)
            ids = [w.wr_id for w in wrs]
            exc.posted = ids.index(bad) if bad in ids else 0  # type: ignore[attr-defined]
            raise


#: Most work requests one ``ibv_post_send`` carries (the transport posts longer runs in parts).
MAX_CHAIN = 256


class _SlotPool:
    """Chains of QPs that were closed, for the next QP (they are never freed: see :class:`_WrSlot`)."""

    def __init__(self) -> None:
        self._free: list[_Chain] = []
        self._lock = threading.Lock()
        self.created = 0

    def take(self) -> _Chain:
        with self._lock:
            if self._free:
                return self._free.pop()
            self.created += 1
        return _Chain()

    def give(self, chain: _Chain) -> None:
        with self._lock:
            self._free.append(chain)


_SLOTS = _SlotPool()


class QueuePair:
    """An RC queue pair: created in RESET, connected by :meth:`connect`."""

    def __init__(self, dev: Device, sq_depth: int) -> None:
        import pyverbs.enums as e
        from pyverbs.qp import QP, QPCap, QPInitAttr

        self.dev = dev
        self.psn = random.getrandbits(24)
        cap = QPCap(max_send_wr=sq_depth, max_recv_wr=1, max_send_sge=1, max_recv_sge=1, max_inline_data=0)
        init = QPInitAttr(qp_type=e.IBV_QPT_RC, scq=dev.cq, rcq=dev.cq, cap=cap, sq_sig_all=0)
        with _verbs("ibv_create_qp"):
            self._qp = QP(dev.pd, init)
        self.qpn = int(self._qp.qp_num)
        self._chain: _Chain | None = None
        self._post_lock = threading.Lock()

    def local_info(self) -> dict[str, Any]:
        """What the peer needs to connect to this QP (JSON-able)."""
        d = self.dev
        return {"qpn": self.qpn, "psn": self.psn, "lid": d.lid, "gid": d.gid, "mtu": d.active_mtu,
                "link_layer": d.link_layer, "rd_atom": d.max_qp_rd_atom, "init_rd_atom": d.max_qp_init_rd_atom,
                "max_msg_sz": d.max_msg_sz}

    def connect(self, remote: dict[str, Any], *, timeout: int = 14, retry_cnt: int = 7, rnr_retry: int = 7,
                traffic_class: int = 0, service_level: int = 0) -> None:
        """RESET → INIT → RTR → RTS towards ``remote`` (checked by :func:`.checks.check_peer_info`)."""
        import pyverbs.enums as e
        from pyverbs.addr import GID, AHAttr, GlobalRoute
        from pyverbs.qp import QPAttr

        from .checks import rd_atomic

        d = self.dev
        attr = QPAttr()
        attr.qp_access_flags = e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_WRITE | e.IBV_ACCESS_REMOTE_READ
        attr.port_num = d.port
        attr.pkey_index = 0
        attr.path_mtu = min(int(d.active_mtu), int(remote["mtu"]))
        attr.dest_qp_num = int(remote["qpn"])
        attr.rq_psn = int(remote["psn"])
        attr.max_dest_rd_atomic = rd_atomic(d.max_qp_rd_atom, int(remote.get("init_rd_atom", 0)))
        attr.min_rnr_timer = 12
        gid = str(remote.get("gid") or "")
        use_grh = d.link_layer == "Ethernet" or bool(gid and not gid.lower().startswith("fe80:"))
        with _verbs("build address vector"):
            if use_grh:
                gr = GlobalRoute(dgid=GID(gid), sgid_index=d.gid_index, hop_limit=64, traffic_class=traffic_class)
                ah = AHAttr(gr=gr, is_global=1, dlid=int(remote.get("lid", 0)), sl=service_level, port_num=d.port)
            else:
                ah = AHAttr(dlid=int(remote["lid"]), sl=service_level, port_num=d.port, is_global=0)
        attr.ah_attr = ah
        attr.timeout = timeout
        attr.retry_cnt = retry_cnt
        attr.rnr_retry = rnr_retry
        attr.sq_psn = self.psn
        attr.max_rd_atomic = rd_atomic(d.max_qp_init_rd_atom, int(remote.get("rd_atom", 0)))
        with _verbs(f"connect QP {self.qpn} to QP {remote['qpn']}"):
            self._qp.to_rts(attr)

    def post(self, wr: WorkRequest) -> None:
        """``ibv_post_send`` of one RDMA WRITE/READ through this QP's reused SGE/SendWR."""
        self.post_list([wr])

    def post_list(self, wrs: list[WorkRequest]) -> None:
        """One ``ibv_post_send`` of a linked list of RDMA WRITEs/READs (at most :data:`MAX_CHAIN`).

        On failure the VerbsError's ``posted`` says how many of ``wrs`` (the
        first ones) are on the send queue.
        """
        if not 0 < len(wrs) <= MAX_CHAIN:
            raise ValueError(f"a work-request list holds 1 to {MAX_CHAIN} requests, not {len(wrs)}")
        with self._post_lock:
            if self._qp is None:
                raise VerbsError(f"QP {self.qpn} is closed", errno.EBADF)
            if self._chain is None:
                self._chain = _SLOTS.take()
            try:
                with _verbs("ibv_post_send"):
                    self._chain.post(self._qp, wrs)
            except VerbsError as exc:
                cause = exc.__cause__
                exc.posted = int(getattr(cause, "posted", 0))  # type: ignore[attr-defined]
                raise

    def to_error(self) -> None:
        """Move to ERROR: outstanding work requests complete with IBV_WC_WR_FLUSH_ERR."""
        import pyverbs.enums as e
        from pyverbs.qp import QPAttr

        with _verbs(f"move QP {self.qpn} to ERROR"):
            self._qp.modify(QPAttr(qp_state=e.IBV_QPS_ERR), e.IBV_QP_STATE)

    def close(self) -> None:
        with self._post_lock:
            qp, self._qp = self._qp, None
            chain, self._chain = self._chain, None
        if chain is not None:
            _SLOTS.give(chain)
        if qp is not None:
            with _verbs("ibv_destroy_qp"):
                qp.close()


def _event_fds() -> set[int]:
    out = set()
    try:
        entries = os.listdir("/proc/self/fd")
    except OSError:
        return out
    for entry in entries:
        try:
            if os.readlink(f"/proc/self/fd/{entry}") == EVENT_FD_NAME:
                out.add(int(entry))
        except OSError:
            continue
    return out


def one_new_fd(before: set[int], after: set[int]) -> int | None:
    """The descriptor that appeared between two snapshots, if exactly one did and none vanished.

    A vanished descriptor means its number may have been reused meanwhile, so
    nothing can be concluded; then None (the caller polls instead).
    """
    if before - after:
        return None
    new = after - before
    return next(iter(new)) if len(new) == 1 else None


class Device:
    """One opened adapter port: context, PD, completion channel and CQ."""

    def __init__(self, device: str = "", port: int = 0, gid_index: int = -1, cq_depth: int = 4096) -> None:
        load_pyverbs()
        from pyverbs.cq import CQ, CompChannel
        from pyverbs.device import Context
        from pyverbs.pd import PD

        from .checks import device_cap

        found = probe(device, port)
        if not found.ok:
            raise VerbsError(found.reason, errno.ENODEV)
        self.name, self.port, self.link_layer = found.device, found.port, found.link_layer
        self.skipped = found.skipped
        self._closed = False
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self.event_fd: int | None = None
        self.event_fd_source = "none"
        self.async_fd: int | None = None
        self._idle_sleep = 0.0
        try:
            with ctx_lock:
                before = _event_fds()
                with _verbs(f"open {self.name}"):
                    self.ctx = Context(name=self.name)
                self.async_fd = one_new_fd(before, _event_fds())
            with _verbs(f"query {self.name}"):
                dattr = self.ctx.query_device()
                pattr = self.ctx.query_port(self.port)
            self.lid = int(pattr.lid)
            self.active_mtu = int(pattr.active_mtu)
            # 0 = the provider does not report the limit (see checks.device_cap).
            self.max_msg_sz = int(pattr.max_msg_sz)
            self.max_qp_wr = int(dattr.max_qp_wr)
            self.max_cqe = int(dattr.max_cqe)
            self.max_qp_rd_atom = int(dattr.max_qp_rd_atom)
            self.max_qp_init_rd_atom = int(dattr.max_qp_init_rd_atom)
            self.gid_index = gid_index if gid_index >= 0 else self._pick_gid(int(pattr.gid_tbl_len))
            self.gid = self._query_gid()
            if self.link_layer == "Ethernet" and set(self.gid.replace(":", "")) <= {"0"}:
                raise VerbsError(f"{self.name} port {self.port}: GID index {self.gid_index} is empty; "
                                 "RoCE needs an IP address on the netdev (set plugins.rdma_zerocopy.gid_index)")
            with _verbs("ibv_alloc_pd"):
                self.pd = PD(self.ctx)
            with ctx_lock:
                before = _event_fds()
                with _verbs("ibv_create_comp_channel"):
                    self.channel = CompChannel(self.ctx)
                exact = getattr(self.channel, "fd", None)
                if isinstance(exact, int) and exact >= 0:
                    self.event_fd, self.event_fd_source = exact, "CompChannel.fd"
                else:
                    self.event_fd = one_new_fd(before, _event_fds())
                    self.event_fd_source = "new descriptor" if self.event_fd is not None else "none"
            if self.event_fd is not None and self.event_fd == self.async_fd:
                self.async_fd = None  # cannot both be right: trust neither for the async one
            for fd in (self.event_fd, self.async_fd):
                if fd is not None:
                    os.set_blocking(fd, False)
            self.cq_depth = device_cap(cq_depth, self.max_cqe)
            with _verbs("ibv_create_cq"):
                self.cq = CQ(self.ctx, self.cq_depth, None, self.channel, 0)
        except BaseException:
            self.close()
            raise

    @property
    def event_mode(self) -> bool:
        """True when completions wake :meth:`wait`; False in the polling fallback."""
        return self.event_fd is not None

    def _query_gid(self) -> str:
        with _verbs(f"query GID {self.gid_index}"):
            return str(self.ctx.query_gid(self.port, self.gid_index).gid)

    def _pick_gid(self, table_len: int) -> int:
        """IB: index 0. RoCE: a RoCE v2 GID, IPv4-mapped first (routable, what most fabrics use)."""
        if self.link_layer != "Ethernet":
            return 0
        best: tuple[int, int] | None = None
        for i in range(table_len):
            try:
                gid = str(self.ctx.query_gid(self.port, i).gid)
                gtype = int(self.ctx.query_gid_type(self.port, i))
            except Exception:  # noqa: BLE001 - empty or unreadable entries
                continue
            if set(gid.replace(":", "")) <= {"0"}:
                continue
            v2 = gtype == 1  # IBV_GID_TYPE_SYSFS_ROCE_V2
            v4 = gid.startswith("0000:0000:0000:0000:0000:ffff:")
            rank = (2 if v2 else 0) + (1 if v4 else 0)
            if best is None or rank > best[0]:
                best = (rank, i)
        return best[1] if best is not None else 0

    # -- resources ---------------------------------------------------------------

    def reg_mr(self, addr: int, length: int, access: str, remote: bool = True) -> MemoryRegistration:
        """``ibv_reg_mr``. Holds the GIL throughout (pyverbs): call it off the request path."""
        from pyverbs.mr import MR

        flags = access_flags(access, remote)
        with _verbs(f"ibv_reg_mr of {length} bytes at {addr:#x}"):
            mr = MR(self.pd, length, flags, address=addr)
        return MemoryRegistration(mr, addr, length, flags)

    def create_qp(self, sq_depth: int) -> QueuePair:
        from .checks import device_cap

        return QueuePair(self, device_cap(sq_depth, self.max_qp_wr))

    # -- port state (async events) -----------------------------------------------

    def port_active(self) -> bool:
        with _verbs(f"query port {self.port}"):
            return int(self.ctx.query_port(self.port).state) == PORT_ACTIVE

    def refresh_addresses(self) -> bool:
        """Re-read LID and GID after a LID/GID change event; True when they changed."""
        with _verbs(f"query port {self.port}"):
            lid = int(self.ctx.query_port(self.port).lid)
        gid = self._query_gid()
        changed = (lid, gid) != (self.lid, self.gid)
        self.lid, self.gid = lid, gid
        return changed

    def read_async_events(self, limit: int = 64) -> list[str]:
        """Read and acknowledge the async events that are queued (names); never blocks."""
        if self.async_fd is None:
            return []
        out = []
        for _ in range(limit):
            try:
                r, _, _ = select.select([self.async_fd], [], [], 0)
            except (OSError, ValueError) as exc:
                self._lose_async_fd(exc)
                break
            if not r:
                break
            try:
                event = self.ctx.get_async_event()
            except Exception:  # noqa: BLE001 - EAGAIN: someone else read it
                break
            kind = int(event.event_type)
            with contextlib.suppress(Exception):
                event.ack()
            out.append(ASYNC_EVENTS.get(kind, f"ibv_event_type({kind})"))
        return out

    # -- completions ---------------------------------------------------------------

    def poll(self, max_entries: int = 16) -> list[tuple[int, int, int]]:
        """Up to ``max_entries`` completions as ``(wr_id, status, vendor_err)``."""
        with _verbs("ibv_poll_cq"):
            _n, wcs = self.cq.poll(max_entries)
        return [(int(wc.wr_id), int(wc.status), int(wc.vendor_err)) for wc in wcs]

    def arm(self) -> bool:
        """``ibv_req_notify_cq`` so the next completion wakes :meth:`wait`; False (and no arming) when polling."""
        if self.event_fd is None:
            return False
        with _verbs("ibv_req_notify_cq"):
            self.cq.req_notify()
        return True

    def wait(self, timeout: float | None) -> bool:
        """Block until the armed CQ signals, :meth:`wake`, an async event, or ``timeout``.

        Returns True when async events are waiting (:meth:`read_async_events`).
        """
        fds = [self._wake_r]
        if self.async_fd is not None:
            fds.append(self.async_fd)
        if self.event_fd is None:
            # No descriptor to select on: bounded back-off instead of blocking with the GIL held.
            self._idle_sleep = min(0.001, max(self._idle_sleep * 2, 50e-6))
            timeout = min(self._idle_sleep, 1.0 if timeout is None else timeout)
        else:
            fds.append(self.event_fd)
        try:
            r, _, _ = select.select(fds, [], [], timeout)
        except (OSError, ValueError) as exc:  # only the async descriptor can be foreign: stop watching it
            if self.async_fd is None:
                raise
            self._lose_async_fd(exc)
            return False
        if self._wake_r in r:
            self._drain_wake()
        if self.event_fd is not None and self.event_fd in r:
            try:
                self.channel.get_cq_event(self.cq)
                self.cq.ack_events(1)
            except Exception:  # noqa: BLE001 - EAGAIN on a spurious wake-up (the fd is non-blocking)
                pass
        return self.async_fd is not None and self.async_fd in r

    def _lose_async_fd(self, exc: BaseException) -> None:
        logging.getLogger("mpcomm.transport.rdma_zerocopy").warning(
            "rdma: cannot watch the async-event descriptor %s any more (%s); async events are not read", self.async_fd,
            exc)
        self.async_fd = None

    def busy(self) -> None:
        """Reset the back-off after completions arrived."""
        self._idle_sleep = 0.0

    def wake(self) -> None:
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"x")

    def _drain_wake(self) -> None:
        with contextlib.suppress(OSError):
            while os.read(self._wake_r, 4096):
                pass

    def info(self) -> dict[str, Any]:
        return {"device": self.name, "port": self.port, "link_layer": self.link_layer, "lid": self.lid,
                "gid": self.gid, "gid_index": self.gid_index, "mtu": self.active_mtu, "max_msg_sz": self.max_msg_sz,
                "completion_wait": "event" if self.event_mode else "polling",
                "async_events": self.async_fd is not None}

    def close(self) -> None:
        """Destroy CQ, channel, PD and context (QPs and MRs first, by their owners); never raises."""
        if self._closed:
            return
        self._closed = True
        with ctx_lock:
            for name in ("cq", "channel", "pd", "ctx"):
                obj = getattr(self, name, None)
                if obj is not None:
                    try:
                        obj.close()
                    except Exception:  # noqa: BLE001
                        pass
        for fd in (self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)
