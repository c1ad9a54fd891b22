"""ctypes bindings the shm transport needs: memcpy, cross-memory attach, prctl, memfd.

Every function here is a plain ``CDLL`` call, so CPython releases the GIL for
its duration. The data path goes through :mod:`._copyloop` (which uses these
as its Python fallback); the probe and the memfd set-up use them directly.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import mmap
import os
import threading
from typing import Any

__all__ = [
    "IOV_MAX",
    "cma_available",
    "cma_one",
    "cma_probe",
    "cma_transfer",
    "memcpy",
    "memfd_segment",
    "ptrace_policy",
]

_libc = ctypes.CDLL(None, use_errno=True)

memcpy = _libc.memcpy
memcpy.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
memcpy.restype = None


class iovec(ctypes.Structure):  # noqa: N801 - the C name
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


IOV_MAX = 1024

_pv: dict[str, Any] = {}
for _name in ("process_vm_writev", "process_vm_readv"):
    _fn = getattr(_libc, _name, None)
    if _fn is not None:
        _fn.argtypes = [ctypes.c_int, ctypes.POINTER(iovec), ctypes.c_ulong, ctypes.POINTER(iovec),
                        ctypes.c_ulong, ctypes.c_ulong]
        _fn.restype = ctypes.c_ssize_t
        _pv[_name] = _fn
_pvw = _pv.get("process_vm_writev")
_pvr = _pv.get("process_vm_readv")

_prctl = _libc.prctl
_prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
_prctl.restype = ctypes.c_int
PR_SET_PTRACER = 0x59616D61
PR_SET_PTRACER_ANY = ctypes.c_ulong(-1).value

F_SEAL_SEAL = getattr(fcntl, "F_SEAL_SEAL", 0x0001)
F_SEAL_SHRINK = getattr(fcntl, "F_SEAL_SHRINK", 0x0002)
F_SEAL_GROW = getattr(fcntl, "F_SEAL_GROW", 0x0004)
F_ADD_SEALS = getattr(fcntl, "F_ADD_SEALS", 1033)
F_GET_SEALS = getattr(fcntl, "F_GET_SEALS", 1034)
F_SEAL_FUTURE_WRITE = getattr(fcntl, "F_SEAL_FUTURE_WRITE", 0x0010)  # Linux 5.1


def cma_available() -> str:
    """"" when this libc has process_vm_readv/writev, else why not."""
    if len(_pv) != 2:
        return "libc lacks process_vm_readv/process_vm_writev"
    return ""


def cma_transfer(write: bool, pid: int, local: list[tuple[int, int]], remote: list[tuple[int, int]]) -> None:
    """Move every byte of ``local`` ↔ ``remote`` (lists of (address, length) with equal totals).

    Loops over partial transfers and over IOV_MAX; raises OSError with the
    errno (ESRCH: the process is gone, EPERM: ptrace policy, EFAULT: the
    remote range is not mapped any more).
    """
    fn = _pv["process_vm_writev" if write else "process_vm_readv"]
    li, ri = list(local), list(remote)
    while li:
        lseg, rseg = li[:IOV_MAX], ri[:IOV_MAX]
        lv = (iovec * len(lseg))(*lseg)
        rv = (iovec * len(rseg))(*rseg)
        want_l = sum(n for _, n in lseg)
        want_r = sum(n for _, n in rseg)
        want = min(want_l, want_r)
        got = fn(pid, lv, len(lseg), rv, len(rseg), 0)
        if got < 0:
            e = ctypes.get_errno()
            raise OSError(e, os.strerror(e))
        if got == 0 and want:
            raise OSError(errno.EFAULT, "process_vm transfer made no progress")
        li = _advance(li, got)
        ri = _advance(ri, got)


def _advance(segs: list[tuple[int, int]], n: int) -> list[tuple[int, int]]:
    i = 0
    while n and i < len(segs):
        addr, ln = segs[i]
        if n >= ln:
            n -= ln
            i += 1
        else:
            segs = [(addr + n, ln - n)] + segs[i + 1 :]
            return segs
    return segs[i:]


def cma_probe(pid: int, address: int, cookie: int) -> str:
    """Read 8 bytes at ``address`` in ``pid``; "" if they equal ``cookie``, else why not."""
    if cma_available():
        return cma_available()
    buf = ctypes.c_uint64(0)
    try:
        cma_transfer(False, pid, [(ctypes.addressof(buf), 8)], [(address, 8)])
    except OSError as exc:
        if exc.errno in (errno.EPERM, errno.EACCES):
            return f"cross-memory attach to pid {pid} denied by the kernel ({exc.strerror}; ptrace policy)"
        if exc.errno == errno.ESRCH:
            return f"pid {pid} is not visible from here"
        return f"cross-memory attach probe failed: {exc}"
    if buf.value != cookie:
        return f"pid {pid} is not the peer's process (probe cookie mismatch)"
    return ""


def ptrace_policy() -> int:
    """Yama's ``ptrace_scope`` (0 when Yama is absent)."""
    try:
        with open("/proc/sys/kernel/yama/ptrace_scope") as f:
            return int(f.read().strip() or 0)
    except (OSError, ValueError):
        return 0


def allow_any_ptracer() -> bool:
    """Let any same-uid process attach (Yama scope 1 only allows descendants)."""
    return _prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY, 0, 0, 0) == 0


def memfd_segment(total: int, name: str = "mpcomm-shm") -> tuple[int, mmap.mmap]:
    """A sealed (no shrink, no grow), pre-faulted memfd of ``total`` bytes and its shared mapping.

    ``F_SEAL_SEAL`` is left to :func:`seal_access`, once the region's rights are known.
    """
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, total)
        fcntl.fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW)
        mm = mmap.mmap(fd, total, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
    except BaseException:
        os.close(fd)
        raise
    return fd, mm


def seal_access(fd: int, writable: bool) -> None:
    """Fix the rights of a memfd for good, before any other process gets it.

    A read-only region gets ``F_SEAL_FUTURE_WRITE``: from now on the kernel
    refuses every new writable shared mapping (EPERM) and every ``write`` of
    this memfd, through any descriptor, a reopened ``/proc/PID/fd/N``
    included; the owner's own mapping made before stays writable. Then
    ``F_SEAL_SEAL``, so no seal can be added or lifted later. Idempotent.
    """
    seals = fcntl.fcntl(fd, F_GET_SEALS)
    if seals & F_SEAL_SEAL:
        if not writable and not seals & F_SEAL_FUTURE_WRITE:
            raise OSError(errno.EPERM, "this memfd was sealed writable; it cannot serve a read-only region")
        return
    fcntl.fcntl(fd, F_ADD_SEALS, (0 if writable else F_SEAL_FUTURE_WRITE) | F_SEAL_SEAL)


def read_only_fd(fd: int) -> int:
    """A new ``O_RDONLY`` descriptor of the file behind ``fd`` (a mapping of it with PROT_WRITE fails, EACCES).

    Reopening ``/proc/self/fd/N`` gives a new open file description with its
    own mode; a receiver could reopen *its* descriptor read-write the same
    way, which is why read-only memfds also carry ``F_SEAL_FUTURE_WRITE``.
    """
    return os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC)


def map_address(mm: mmap.mmap) -> int:
    """Base address of an mmap without leaving a buffer export behind (so it can be closed)."""
    from mpcomm.memory import buffer_address

    with memoryview(mm) as v:
        return buffer_address(v)


_tls = threading.local()


def cma_one(write: bool, pid: int, local: int, remote: int, n: int) -> None:
    """One contiguous range; the common case, with per-thread iovecs (no allocation)."""
    try:
        lv, rv = _tls.iov
    except AttributeError:
        lv, rv = _tls.iov = (iovec(), iovec())
    lv.iov_base = local
    lv.iov_len = n
    rv.iov_base = remote
    rv.iov_len = n
    got = (_pvw if write else _pvr)(pid, lv, 1, rv, 1, 0)
    if got == n:
        return
    if got < 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))
    cma_transfer(write, pid, [(local + got, n - got)], [(remote + got, n - got)])
