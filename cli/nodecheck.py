"""Read-only node acceptance checks for hosts that run mpcomm.

This module is a Python port of the seed design's node-check shell script::

    echo '== CPU and NUMA =='          lscpu / numactl --hardware
    echo '== Network interfaces =='    ip -br link / ibv_devinfo
    echo '== Large memory pages =='    grep HugePages /proc/meminfo

extended with what matters to a memory-transfer library: the locked-memory
limit (RDMA and UCX pin registered memory), the size of ``/dev/shm`` (the shm
transport's backing store), and whether cross-memory attach
(``process_vm_readv``) works between processes of the same user.

What only one transport cares about comes from that transport: each
transport class may answer ``node_checks()`` (see docs/plugin-authors.md), and
:func:`run_checks` gathers them from every installed transport; rdma_zerocopy
contributes the ``rdma`` section (adapters, ports, uverbs, libibverbs).

Discovery (NUMA nodes, interfaces, memlock, /dev/shm) comes from
:mod:`mpcomm.topology`, the same data a node sends peers in its handshake;
this module judges it.  It reads ``/proc``, ``/sys``, ``resource`` limits and ``os.statvfs`` and never
modifies the system: no sysctl, no module loading, no limit raising.  The only
side effect is the cross-memory-attach probe, which forks a short-lived child
process that is always killed and reaped before the probe returns.

Every check is a small function.  An exception inside one check is turned into
a ``WARN`` :class:`Check` carrying the error text; :func:`run_checks` never
raises because one probe failed.

Public API:

* :class:`Status`, :class:`Check`
* :func:`run_checks` -- all sections: the core's (:data:`SECTIONS`) and the transports'
* :func:`transport_checks` -- only what the transports contribute
* :func:`guarded`, :func:`read_text` -- for transports writing their own checks
* :func:`manifest` -- component versions for reproducible deployment lists
* :func:`worst_status`, :func:`format_report` -- small helpers for callers
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import glob
import importlib
import importlib.metadata
import os
import platform
import re
import select
import shutil
import signal
import subprocess
import sys
import warnings
from dataclasses import dataclass
from enum import Enum
from typing import Callable, Iterable, Optional

from mpcomm import topology

__all__ = [
    "SECTIONS",
    "Check",
    "Status",
    "format_report",
    "guarded",
    "manifest",
    "read_text",
    "run_checks",
    "transport_checks",
    "worst_status",
]

#: The core's sections, in report order; the transports' own (``rdma`` from rdma_zerocopy) come after ``network``.
SECTIONS: tuple[str, ...] = ("cpu", "network", "hugepages", "memory", "cma")

_PROC_CPUINFO = "/proc/cpuinfo"
_PROC_MEMINFO = "/proc/meminfo"
_SYS_CPU = "/sys/devices/system/cpu"
_SYS_NODE = "/sys/devices/system/node"
_SYS_NET = "/sys/class/net"
_SYS_THP = "/sys/kernel/mm/transparent_hugepage/enabled"
_YAMA_PTRACE_SCOPE = "/proc/sys/kernel/yama/ptrace_scope"

_RDMA_MTU = 4200  # smallest Ethernet MTU that carries a 4096-byte RoCE MTU

_NUMA_HINT = "pin transfer threads to the NIC's NUMA node (numactl --cpunodebind)"
_MTU_HINT = "for RDMA/RoCE use jumbo frames (MTU 9000) end to end"
_HUGEPAGES_HINT = (
    "for pinned pools reserve huge pages: echo N > /proc/sys/vm/nr_hugepages"
)
_MEMLOCK_HINT = (
    "ulimit -l unlimited / LimitMEMLOCK=infinity — RDMA and UCX pin registered memory"
)
_SHM_HINT = "enlarge /dev/shm (mount -o remount,size=... or docker --shm-size)"
_PTRACE_HINT = (
    "only descendants; shm transport falls back to mapping engine-allocated "
    "regions, or run with CAP_SYS_PTRACE / prctl(PR_SET_PTRACER)"
)


class Status(str, Enum):
    """Outcome of one check, ordered PASS/INFO < WARN < FAIL by severity."""

    PASS = "pass"
    WARN = "warn"
    FAIL = "fail"
    INFO = "info"


_SEVERITY: dict[Status, int] = {
    Status.PASS: 0,
    Status.INFO: 0,
    Status.WARN: 1,
    Status.FAIL: 2,
}


@dataclass(frozen=True)
class Check:
    """One observation about the node."""

    section: str
    name: str
    status: Status
    value: str
    hint: str = ""

    def to_dict(self) -> dict[str, str]:
        """Return a JSON-serialisable mapping (status as its string value)."""
        return {
            "section": self.section,
            "name": self.name,
            "status": Status(self.status).value,
            "value": self.value,
            "hint": self.hint,
        }


# --------------------------------------------------------------------------
# small readers


def read_text(path: str) -> Optional[str]:
    """Return the stripped contents of *path*, or None when it cannot be read."""
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            return fh.read().strip()
    except OSError:
        return None


_parse_meminfo = topology.parse_meminfo


def _meminfo() -> dict[str, int]:
    text = read_text(_PROC_MEMINFO)
    if text is None:
        raise OSError(f"cannot read {_PROC_MEMINFO}")
    return _parse_meminfo(text)


def _human_bytes(n: int) -> str:
    """Format a byte count with binary units (``1.5 GiB``)."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            if unit == "B":
                return f"{int(value)} B"
            return f"{value:.1f} {unit}"
        value /= 1024
    return f"{n} B"  # pragma: no cover - loop always returns


def _cpuinfo_blocks() -> list[dict[str, str]]:
    text = read_text(_PROC_CPUINFO) or ""
    blocks: list[dict[str, str]] = []
    current: dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip():
            if current:
                blocks.append(current)
                current = {}
            continue
        key, sep, value = line.partition(":")
        if sep:
            current[key.strip()] = value.strip()
    if current:
        blocks.append(current)
    return blocks


def guarded(section: str, name: str, fn: Callable[[], list[Check]]) -> list[Check]:
    """Run one check function; convert any exception into a WARN Check (for transports' checks too)."""
    try:
        return list(fn())
    except Exception as exc:  # noqa: BLE001 - a check must never raise
        return [
            Check(
                section,
                name,
                Status.WARN,
                f"check failed: {type(exc).__name__}: {exc}",
            )
        ]


# --------------------------------------------------------------------------
# cpu


def _check_cpu_model() -> list[Check]:
    model = ""
    for block in _cpuinfo_blocks():
        for key in ("model name", "Model Name", "cpu model", "Processor", "cpu"):
            if block.get(key):
                model = block[key]
                break
        if model:
            break
    if not model:
        model = platform.processor() or platform.machine() or "unknown"
    return [Check("cpu", "model", Status.INFO, model)]


def _check_cpu_count() -> list[Check]:
    total = os.cpu_count()
    usable: Optional[int] = None
    if hasattr(os, "sched_getaffinity"):
        usable = len(os.sched_getaffinity(0))
    if total is None and usable is None:
        return [Check("cpu", "logical_cpus", Status.WARN, "unknown")]
    if usable is not None and total is not None and usable != total:
        return [
            Check(
                "cpu",
                "logical_cpus",
                Status.INFO,
                f"{usable} usable of {total}",
                "this process is restricted by CPU affinity / cpuset",
            )
        ]
    return [Check("cpu", "logical_cpus", Status.PASS, str(usable or total))]


def _check_sockets() -> list[Check]:
    ids = {b["physical id"] for b in _cpuinfo_blocks() if "physical id" in b}
    source = "/proc/cpuinfo"
    if not ids:
        for path in glob.glob(f"{_SYS_CPU}/cpu[0-9]*/topology/physical_package_id"):
            value = read_text(path)
            if value is not None:
                ids.add(value)
        source = "sysfs topology"
    if not ids:
        return [Check("cpu", "sockets", Status.INFO, "unknown (not exposed)")]
    return [Check("cpu", "sockets", Status.INFO, f"{len(ids)} (from {source})")]


def _check_numa() -> list[Check]:
    nodes = topology.discover_numa(_SYS_NODE)
    if not nodes:
        return [
            Check(
                "cpu",
                "numa_nodes",
                Status.INFO,
                "NUMA topology not exposed (no /sys/devices/system/node)",
            )
        ]
    checks: list[Check] = []
    if len(nodes) > 1:
        checks.append(Check("cpu", "numa_nodes", Status.WARN, str(len(nodes)), _NUMA_HINT))
    else:
        checks.append(Check("cpu", "numa_nodes", Status.PASS, "1"))
    for node in nodes:
        cpulist = _format_cpus(node.cpus)
        mem_s = _human_bytes(node.mem_total) if node.mem_total >= 0 else "?"
        checks.append(
            Check("cpu", f"numa.node{node.id}", Status.INFO, f"cpus {cpulist or '-'}, MemTotal {mem_s}")
        )
    return checks


def _format_cpus(cpus: tuple[int, ...]) -> str:
    """(0, 1, 2, 3, 8) → ``0-3,8`` (the kernel's cpulist form)."""
    parts: list[str] = []
    start = prev = None
    for c in sorted(cpus):
        if prev is not None and c == prev + 1:
            prev = c
            continue
        if start is not None:
            parts.append(f"{start}-{prev}" if prev != start else str(start))
        start = prev = c
    if start is not None:
        parts.append(f"{start}-{prev}" if prev != start else str(start))
    return ",".join(parts)


# --------------------------------------------------------------------------
# network


def _check_network() -> list[Check]:
    if not os.path.isdir(_SYS_NET):
        return [Check("network", "interfaces", Status.WARN, f"{_SYS_NET} not readable")]
    checks: list[Check] = []
    up_non_lo = 0
    ifaces, _dropped = topology.discover_interfaces(_SYS_NET, limit=None)
    for iface in sorted(ifaces, key=lambda i: i.name):
        name = iface.name
        address = read_text(os.path.join(_SYS_NET, name, "address")) or "-"
        parts = [iface.state, f"mtu {iface.mtu if iface.mtu >= 0 else '?'}", address]
        if iface.speed_mbps > 0:
            parts.append(f"{iface.speed_mbps} Mb/s")
        if iface.numa_node >= 0:
            parts.append(f"numa node {iface.numa_node}")
        if iface.virtual:
            parts.append("virtual")
        value = ", ".join(parts)
        if iface.loopback or name == "lo":
            checks.append(Check("network", f"iface.{name}", Status.INFO, value))
            continue
        if iface.state != "up":
            checks.append(
                Check("network", f"iface.{name}", Status.WARN, value, "interface is down")
            )
            continue
        up_non_lo += 1
        if 0 <= iface.mtu < _RDMA_MTU:
            checks.append(Check("network", f"iface.{name}", Status.INFO, value, _MTU_HINT))
        else:
            checks.append(Check("network", f"iface.{name}", Status.PASS, value))
    if up_non_lo:
        checks.insert(
            0, Check("network", "interfaces_up", Status.PASS, f"{up_non_lo} non-loopback up")
        )
    else:
        checks.insert(
            0,
            Check(
                "network",
                "interfaces_up",
                Status.WARN,
                "no non-loopback interface is up",
                "only same-host transports (shm, tcp over lo) can work; "
                "containers may have only lo",
            ),
        )
    return checks


# --------------------------------------------------------------------------
# hugepages


def _check_hugepages() -> list[Check]:
    info = _meminfo()
    total = info.get("HugePages_Total")
    free = info.get("HugePages_Free")
    size = info.get("Hugepagesize")
    if total is None:
        return [Check("hugepages", "hugepages", Status.INFO, "not reported by /proc/meminfo")]
    size_s = _human_bytes(size) if size is not None else "?"
    value = f"{total} total, {free if free is not None else '?'} free, size {size_s}"
    if total == 0:
        return [Check("hugepages", "hugepages", Status.INFO, value, _HUGEPAGES_HINT)]
    return [Check("hugepages", "hugepages", Status.PASS, value)]


def _check_thp() -> list[Check]:
    raw = read_text(_SYS_THP)
    if raw is None:
        return [Check("hugepages", "transparent_hugepage", Status.INFO, "not available")]
    match = re.search(r"\[(\w+)\]", raw)
    mode = match.group(1) if match else raw
    return [Check("hugepages", "transparent_hugepage", Status.INFO, mode)]


# --------------------------------------------------------------------------
# memory


def _check_memlock(min_memlock_bytes: int) -> list[Check]:
    soft, hard = topology.memlock_limits()  # -1: unlimited

    def fmt(v: int) -> str:
        return "unlimited" if v < 0 else _human_bytes(v)

    value = f"soft {fmt(soft)}, hard {fmt(hard)}"
    if soft >= 0 and soft < min_memlock_bytes:
        return [
            Check(
                "memory",
                "memlock",
                Status.WARN,
                f"{value} (< {_human_bytes(min_memlock_bytes)})",
                _MEMLOCK_HINT,
            )
        ]
    return [Check("memory", "memlock", Status.PASS, value)]


def _check_shm(shm_path: str, min_shm_bytes: int) -> list[Check]:
    if not os.path.exists(shm_path):
        return [
            Check(
                "memory",
                "shm",
                Status.FAIL,
                f"{shm_path} is missing",
                "mount a tmpfs on /dev/shm; the shm transport needs it",
            )
        ]
    if not os.path.isdir(shm_path):
        return [Check("memory", "shm", Status.FAIL, f"{shm_path} is not a directory")]
    st = os.statvfs(shm_path)
    size = st.f_blocks * st.f_frsize
    free = st.f_bavail * st.f_frsize
    value = f"{shm_path}: size {_human_bytes(size)}, free {_human_bytes(free)}"
    if not os.access(shm_path, os.W_OK | os.X_OK):
        return [Check("memory", "shm", Status.FAIL, f"{value}, not writable by this user")]
    if free < min_shm_bytes:
        return [
            Check(
                "memory",
                "shm",
                Status.WARN,
                f"{value} (< {_human_bytes(min_shm_bytes)} free)",
                _SHM_HINT,
            )
        ]
    return [Check("memory", "shm", Status.PASS, value)]


def _check_system_memory() -> list[Check]:
    total: Optional[int]
    avail: Optional[int]
    try:
        info = _meminfo()
        total, avail = info.get("MemTotal"), info.get("MemAvailable")
    except OSError:
        total = avail = None
    if total is None:
        try:
            import psutil  # type: ignore[import-not-found]

            vm = psutil.virtual_memory()
            total, avail = int(vm.total), int(vm.available)
        except Exception:  # noqa: BLE001 - optional dependency
            pass
    if total is None:
        return [Check("memory", "total", Status.WARN, "unknown")]
    checks = [Check("memory", "total", Status.INFO, _human_bytes(total))]
    if avail is not None:
        checks.append(Check("memory", "available", Status.INFO, _human_bytes(avail)))
    return checks


# --------------------------------------------------------------------------
# cma (cross-memory attach)


def _check_ptrace_scope() -> list[Check]:
    raw = read_text(_YAMA_PTRACE_SCOPE)
    if raw is None:
        return [
            Check(
                "cma",
                "ptrace_scope",
                Status.PASS,
                "yama not enabled: same-user process_vm_readv allowed",
            )
        ]
    if raw == "0":
        return [Check("cma", "ptrace_scope", Status.PASS, "0 (classic: same-user allowed)")]
    if raw == "1":
        return [Check("cma", "ptrace_scope", Status.WARN, "1 (restricted)", _PTRACE_HINT)]
    if raw == "2":
        return [
            Check(
                "cma",
                "ptrace_scope",
                Status.WARN,
                "2 (admin-only: CAP_SYS_PTRACE required)",
                "shm transport cannot use process_vm_readv without CAP_SYS_PTRACE; "
                "it falls back to mapping engine-allocated regions",
            )
        ]
    if raw == "3":
        return [
            Check(
                "cma",
                "ptrace_scope",
                Status.WARN,
                "3 (no attach: process_vm_readv disabled until reboot)",
                "shm transport falls back to mapping engine-allocated regions",
            )
        ]
    return [Check("cma", "ptrace_scope", Status.WARN, f"unexpected value {raw!r}")]


class _IoVec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


def _probe_process_vm_readv(timeout_s: float = 5.0) -> tuple[bool, str]:
    """Fork a child, then read a buffer from it with ``process_vm_readv``.

    The buffer is allocated before the fork, so it sits at the same virtual
    address in the child; the child overwrites it (copy-on-write) with its own
    marker, which the parent must see.  The child waits on a pipe with a
    timeout and is always SIGKILLed and reaped before this returns.
    """
    libc_name = ctypes.util.find_library("c") or "libc.so.6"
    libc = ctypes.CDLL(libc_name, use_errno=True)
    readv = libc.process_vm_readv  # AttributeError on libcs without it
    readv.restype = ctypes.c_ssize_t
    readv.argtypes = [
        ctypes.c_int,
        ctypes.POINTER(_IoVec),
        ctypes.c_ulong,
        ctypes.POINTER(_IoVec),
        ctypes.c_ulong,
        ctypes.c_ulong,
    ]

    parent_marker = b"mpcomm-cma-probe-parent\0"
    child_marker = b"mpcomm-cma-probe-child!\0"
    size = len(child_marker)
    shared = ctypes.create_string_buffer(parent_marker, size)
    remote_addr = ctypes.addressof(shared)

    ready_r, ready_w = os.pipe()
    hold_r, hold_w = os.pipe()
    with warnings.catch_warnings():
        # Python >= 3.12 warns about fork() in multi-threaded processes; the
        # child only touches its own buffer and pipes before os._exit().
        warnings.simplefilter("ignore", DeprecationWarning)
        pid = os.fork()
    if pid == 0:  # child
        try:
            os.close(ready_r)
            os.close(hold_w)
            ctypes.memmove(remote_addr, child_marker, size)
            os.write(ready_w, b"1")
            select.select([hold_r], [], [], timeout_s + 5.0)
        finally:
            os._exit(0)

    # parent
    try:
        os.close(ready_w)
        os.close(hold_r)
        ready, _, _ = select.select([ready_r], [], [], timeout_s)
        if not ready or os.read(ready_r, 1) != b"1":
            return False, f"probe child did not start within {timeout_s:.0f}s"
        out = ctypes.create_string_buffer(size)
        local_iov = _IoVec(ctypes.cast(out, ctypes.c_void_p), size)
        remote_iov = _IoVec(ctypes.c_void_p(remote_addr), size)
        ctypes.set_errno(0)
        n = readv(pid, ctypes.byref(local_iov), 1, ctypes.byref(remote_iov), 1, 0)
        if n < 0:
            err = ctypes.get_errno()
            name = errno.errorcode.get(err, str(err))
            return False, f"process_vm_readv failed: {name} ({os.strerror(err)})"
        if out.raw[:size] != child_marker:
            return False, f"process_vm_readv read {n} bytes but not the child's data"
        return True, f"read {n} bytes from a forked child (pid {pid})"
    finally:
        for fd in (ready_r, hold_w):
            try:
                os.close(fd)
            except OSError:
                pass
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            os.waitpid(pid, 0)
        except ChildProcessError:
            pass


def _check_cma_probe() -> list[Check]:
    if not sys.platform.startswith("linux") or not hasattr(os, "fork"):
        return [Check("cma", "process_vm_readv", Status.INFO, f"not Linux ({sys.platform})")]
    ok, detail = _probe_process_vm_readv()
    if ok:
        return [Check("cma", "process_vm_readv", Status.PASS, detail)]
    hint = (
        "shm transport falls back to mapping engine-allocated regions; check "
        "ptrace_scope, CAP_SYS_PTRACE and the container's seccomp profile"
    )
    if "ENOSYS" in detail:
        hint = "kernel lacks CONFIG_CROSS_MEMORY_ATTACH or seccomp blocks it; " + hint
    return [Check("cma", "process_vm_readv", Status.WARN, detail, hint)]


# --------------------------------------------------------------------------
# public API


def transport_checks(transports: Optional[Iterable[type]] = None) -> list[Check]:
    """The checks every transport contributes through its ``node_checks()`` hook, transport by transport.

    ``transports`` defaults to every transport the installed plugins provide
    (the ``mpcomm.transports`` entry points, as ``MPCOMM_PLUGINS`` and
    ``MPCOMM_DISABLE_PLUGIN_AUTOLOAD`` allow), in name order. A hook that raises,
    or returns something other than :class:`Check` objects, becomes one ``WARN``
    in a section named after the transport.
    """
    if transports is None:
        from mpcomm.registry import load_plugins

        transports = [entry.cls for _, entry in sorted(load_plugins().transports.items())]
    checks: list[Check] = []
    for cls in transports:
        name = getattr(cls, "name", "") or cls.__name__

        def contributed(cls: type = cls, name: str = name) -> list[Check]:
            got = list(cls.node_checks())  # type: ignore[attr-defined]  # Transport.node_checks
            wrong = [c for c in got if not isinstance(c, Check)]
            if wrong:
                raise TypeError(f"{name}.node_checks() returned {type(wrong[0]).__name__}, not Check")
            return got

        checks.extend(guarded(name, "node_checks", contributed))
    return checks


def run_checks(
    *,
    shm_path: str = "/dev/shm",
    min_shm_bytes: int = 1 << 30,
    min_memlock_bytes: int = 64 << 20,
    transports: Optional[Iterable[type]] = None,
) -> list[Check]:
    """Run every read-only node check and return the results in section order.

    The core's sections are those of :data:`SECTIONS`; what the transports
    contribute (:func:`transport_checks`, ``transports`` as there: by default
    every installed one) comes after ``network``, where the adapters they
    drive were just listed. No check raises: a failing probe becomes a
    ``WARN`` Check whose value carries the error text.
    """
    plan: list[tuple[str, str, Callable[[], list[Check]]]] = [
        ("cpu", "model", _check_cpu_model),
        ("cpu", "logical_cpus", _check_cpu_count),
        ("cpu", "sockets", _check_sockets),
        ("cpu", "numa_nodes", _check_numa),
        ("network", "interfaces", _check_network),
        # Each transport's hook is guarded on its own; this guards finding the transports.
        ("plugins", "node_checks", lambda: transport_checks(transports)),
        ("hugepages", "hugepages", _check_hugepages),
        ("hugepages", "transparent_hugepage", _check_thp),
        ("memory", "memlock", lambda: _check_memlock(min_memlock_bytes)),
        ("memory", "shm", lambda: _check_shm(shm_path, min_shm_bytes)),
        ("memory", "system", _check_system_memory),
        ("cma", "ptrace_scope", _check_ptrace_scope),
        ("cma", "process_vm_readv", _check_cma_probe),
    ]
    checks: list[Check] = []
    for section, name, fn in plan:
        checks.extend(guarded(section, name, fn))
    return checks


def worst_status(checks: Iterable[Check]) -> Status:
    """Return the most severe status (FAIL > WARN > PASS); PASS when empty."""
    worst = Status.PASS
    for check in checks:
        if _SEVERITY[Status(check.status)] > _SEVERITY[worst]:
            worst = Status(check.status)
    return worst


def format_report(checks: Iterable[Check]) -> str:
    """Render checks as plain text grouped by section (``== cpu ==`` headers)."""
    lines: list[str] = []
    section: Optional[str] = None
    for check in checks:
        if check.section != section:
            section = check.section
            lines.append(f"== {section} ==")
        status = Status(check.status).value.upper()
        lines.append(f"[{status:<4}] {check.name}: {check.value}")
        if check.hint:
            lines.append(f"       hint: {check.hint}")
    return "\n".join(lines)


def _dist_version(*names: str) -> Optional[str]:
    """Return ``version`` of the first installed distribution among *names*."""
    for name in names:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
        except Exception:  # noqa: BLE001 - broken metadata must not break manifest
            continue
    return None


def _dist_version_labelled(*names: str) -> str:
    for name in names:
        version = _dist_version(name)
        if version is not None:
            return version if len(names) == 1 else f"{version} ({name})"
    return "not installed"


def _rdma_core_version() -> str:
    commands: list[list[str]] = []
    if shutil.which("dpkg-query"):
        commands.append(["dpkg-query", "-W", "-f=${Version}", "rdma-core"])
    if shutil.which("rpm"):
        commands.append(["rpm", "-q", "--qf", "%{VERSION}-%{RELEASE}", "rdma-core"])
    if not commands:
        return "unknown"
    for cmd in commands:
        try:
            proc = subprocess.run(
                cmd,
                capture_output=True,
                text=True,
                timeout=2,
                check=False,
                stdin=subprocess.DEVNULL,
            )
        except (OSError, subprocess.SubprocessError):
            continue
        out = proc.stdout.strip()
        if proc.returncode == 0 and out:
            return out
    return "not installed"


def _pyverbs_version() -> str:
    version = _dist_version("pyverbs")
    if version is not None:
        return version
    try:
        module = importlib.import_module("pyverbs")
    except BaseException:  # noqa: BLE001 - import may fail in arbitrary ways
        return "not installed"
    try:
        return str(getattr(module, "__version__", "installed (version unknown)"))
    except Exception:  # noqa: BLE001
        return "installed (version unknown)"


def manifest(extra: Optional[dict[str, str]] = None) -> dict[str, str]:
    """Return component versions for reproducible deployment lists.

    Keys: python, implementation, platform, kernel, arch, glibc, mpcomm,
    pluggy, opentelemetry-api, typer, numpy, ucxx, libucx, rdma-core, pyverbs.
    Missing packages read ``"not installed"``.  *extra* (for example plugin
    versions added by the caller) is merged in last and wins on conflicts.
    """
    uname = os.uname() if hasattr(os, "uname") else None
    libc_name, libc_version = platform.libc_ver()
    out: dict[str, str] = {
        "python": platform.python_version(),
        "implementation": platform.python_implementation(),
        "platform": platform.platform(),
        "kernel": f"{uname.sysname} {uname.release}" if uname else platform.release(),
        "arch": uname.machine if uname else platform.machine(),
        "glibc": libc_version if libc_name == "glibc" and libc_version else (
            f"{libc_name} {libc_version}".strip() or "unknown"
        ),
        "mpcomm": _dist_version_labelled("mpcomm"),
        "pluggy": _dist_version_labelled("pluggy"),
        "opentelemetry-api": _dist_version_labelled("opentelemetry-api"),
        "typer": _dist_version_labelled("typer"),
        "numpy": _dist_version_labelled("numpy"),
        "ucxx": _dist_version_labelled("ucxx-cu12", "ucxx-cu11", "ucxx"),
        "libucx": _dist_version_labelled("libucx-cu12", "libucx-cu11", "libucx"),
        "rdma-core": _rdma_core_version(),
        "pyverbs": _pyverbs_version(),
    }
    if extra:
        out.update({str(k): str(v) for k, v in extra.items()})
    return out
