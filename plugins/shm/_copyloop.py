"""The shm copy loop: a small compiled helper, or the same functions in Python.

:func:`get` returns one :class:`CopyLoop` per process. The compiled one is
``_copyloop.c`` (next to this file), built when mpcomm was installed into the
extension module ``mpcomm.plugins.shm._mpcomm_copyloop`` (setup.py; nothing is
compiled at run time). Its copies, batch copies and the fast path's move are
the module's functions (a batch releases the GIL for the whole call, so N
pieces cost one call outside the interpreter; a copy past 64 KiB releases it
too); the posted ring's calls go through ``ctypes.CDLL`` on the same file.

Without the module (the install had no compiler) or with
``MPCOMM_SHM_NATIVE=0`` the Python fallback does the same work with one
ctypes ``memcpy`` per piece; the reason is shown in the transport's
availability text (``mpcomm plugins`` / doctor), and doctor says what it costs.

Return conventions (both implementations): copy functions return 0 or the
next piece index on success and ``-errno`` on failure; the batch copies
(:meth:`CopyLoop.copy_many`, :meth:`CopyLoop.cma_many`) take the size of each
region and check every piece against it at the point of use, with the rule of
``mpcomm.engine.checks.fits``: a piece that does not fit is not moved (the call
stops before it, or returns ``-ERANGE`` when it is the first); ``-ESRCH`` means the
process owning the target memory has exited (its pidfd polled readable:
after a memfd copy, whose pages outlive their owner; before a CMA copy, so a
reused pid is never written — a CMA copy that succeeds found the process's
memory in place).
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import select
import threading
from operator import add
from typing import Any

from mpcomm import native_helper

from . import _native

log = logging.getLogger("mpcomm.transport.shm")

ABI = 6
MODULE = "mpcomm.plugins.shm._mpcomm_copyloop"
_ENV = "MPCOMM_SHM_NATIVE"


def _addr(a: Any) -> int:
    """Address of an int64 array's first element (array('q') or a writable buffer)."""
    try:
        return a.buffer_info()[0]
    except AttributeError:
        return ctypes.addressof(ctypes.c_int64.from_buffer(a))


class CopyLoop:
    """The Python fallback; :class:`NativeLoop` overrides every method with one C call."""

    native = False
    #: ``mover(...)`` -> the shm fast path (ShmTransport.inline_path's move, in C), or None: no fast
    #: path, every request takes the transport's general path.
    mover: Any = None
    #: ``alive_page() -> fd``: this process's alive page (_copyloop.c, "Owner liveness"), or None:
    #: initiators poll this process's pidfd after each copy instead.
    alive_page: Any = None

    @staticmethod
    def watch(pidfd: int, fd: int, pid: int) -> int:
        """File an owner's alive page ``fd`` under its ``pidfd``: 1 filed (copies read its word
        instead of polling), 0 not (they poll)."""
        return 0

    @staticmethod
    def unwatch(pidfd: int) -> int:
        """Unfile ``pidfd`` before it is closed."""
        return 0

    def __init__(self, reason: str) -> None:
        #: Why this implementation is in use (shown in availability text).
        self.reason = reason

    @staticmethod
    def alive(pidfd: int) -> int:
        """0 while the process behind ``pidfd`` runs (or pidfd < 0), -ESRCH once it exited."""
        if pidfd < 0:
            return 0
        try:
            ready, _, _ = select.select([pidfd], [], [], 0)
        except (OSError, ValueError) as exc:
            return -(getattr(exc, "errno", None) or errno.EBADF)
        return -errno.ESRCH if ready else 0

    def copy(self, dst: int, src: int, n: int, pidfd: int) -> int:
        _native.memcpy(dst, src, n)
        return self.alive(pidfd)

    def share(self, min_bytes: int, spin_us: int) -> int:
        """Copies of at least ``min_bytes`` (0: none) are shared with a helper thread, which
        looks for the next one ``spin_us`` before it sleeps; per process. Returns the
        threshold in force: 0 here (one thread copies), or with fewer than two CPUs."""
        return 0

    @staticmethod
    def check(offs: Any, lens: Any, n: int, size: int) -> tuple[int, int]:
        """(-1, total bytes) when every [off, off+len) lies in [0, size); else (first bad index, 0).

        Vectorised: min/max over the arrays and one C-level map, no Python loop
        per index (the loop below runs only to name the bad index).
        """
        if n == 0:
            return -1, 0
        if min(offs) >= 0 and min(lens) >= 0 and max(map(add, offs, lens)) <= size:
            return -1, sum(lens)
        for i in range(n):
            if offs[i] < 0 or lens[i] < 0 or offs[i] + lens[i] > size:
                return i, 0
        return -1, sum(lens)  # pragma: no cover - unreachable

    def check2(self, roffs: Any, loffs: Any, lens: Any, n: int, rsize: int, lsize: int) -> tuple[str, int, int]:
        """Both sides of a batch: ("", -1, total), or ("remote"|"local", first bad index, 0)."""
        bad, total = self.check(roffs, lens, n, rsize)
        if bad >= 0:
            return "remote", bad, 0
        bad, _ = self.check(loffs, lens, n, lsize)
        if bad >= 0:
            return "local", bad, 0
        return "", -1, total

    def copy_many(self, dst: int, dsize: int, doffs: Any, src: int, ssize: int, soffs: Any, lens: Any, start: int,
                  n: int, budget: int, pidfd: int) -> int:
        mc = _native.memcpy
        moved = 0
        i = start
        while i < n:
            d, s, k = doffs[i], soffs[i], lens[i]
            if not (0 <= k <= dsize and k <= ssize and 0 <= d <= dsize - k and 0 <= s <= ssize - k):
                if i == start:
                    return -errno.ERANGE
                break
            mc(dst + d, src + s, k)
            moved += k
            i += 1
            if moved >= budget:
                break
        a = self.alive(pidfd)
        return a if a < 0 else i

    def cma(self, pid: int, write: int, local: int, remote: int, n: int, pidfd: int) -> int:
        a = self.alive(pidfd)
        if a < 0:
            return a
        try:
            _native.cma_one(bool(write), pid, local, remote, n)
        except OSError as exc:
            return -(exc.errno or errno.EIO)
        return 0  # it found the memory in place: the process had not exited

    def cma_many(self, pid: int, write: int, local: int, lsize: int, loffs: Any, remote: int, rsize: int, roffs: Any,
                 lens: Any, start: int, n: int, budget: int, pidfd: int) -> int:
        a = self.alive(pidfd)
        if a < 0:
            return a
        lv: list[tuple[int, int]] = []
        rv: list[tuple[int, int]] = []
        moved = 0
        i = start
        while i < n and moved < budget:
            lo, ro, k = loffs[i], roffs[i], lens[i]
            if not (0 <= k <= lsize and k <= rsize and 0 <= lo <= lsize - k and 0 <= ro <= rsize - k):
                if i == start:
                    return -errno.ERANGE
                break
            if k:
                lv.append((local + lo, k))
                rv.append((remote + ro, k))
            moved += k
            i += 1
        try:
            _native.cma_transfer(bool(write), pid, lv, rv)
        except OSError as exc:
            return -(exc.errno or errno.EIO)
        return i


class NativeLoop(CopyLoop):
    """The compiled helper: the module's functions (the copies, the batch check and the fast path's
    mover; no ctypes argument conversion, about 1 us a call saved), and through ``ctypes`` on the
    same file the few calls that block or are only asked rarely (the posted ring, ``check``).
    The module's ABI was checked at load, so every function named here is there."""

    native = True

    def __init__(self, lib: ctypes.CDLL, path: str, module: Any) -> None:
        super().__init__(f"compiled copy loop ({path})")
        self.path = path
        i64, vp, ci = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int

        def fn(name: str, *args: Any) -> Any:
            f = getattr(lib, name)
            f.argtypes = list(args)
            f.restype = i64 if name != "mp_alive" else ci
            return f

        self.alive = fn("mp_alive", ci)  # type: ignore[method-assign,assignment]
        self._check = fn("mp_check", vp, vp, i64, i64)
        self._share = fn("mp_share_config", i64, i64)
        #: Posted copies (see _posted.py): ctypes calls, so each releases the GIL.
        self.posted_claim = fn("mp_posted_claim", vp, i64)
        self.posted_kick = fn("mp_posted_kick", vp)
        self.posted_take = fn("mp_posted_take", vp, vp, i64, vp, i64)
        self.copy = module.copy  # type: ignore[method-assign]
        self.cma = module.cma  # type: ignore[method-assign]
        # The batch calls hold the arrays' buffers for the call and refuse arrays shorter than n.
        self._check2 = module.check2
        self.copy_many = module.copy_many  # type: ignore[method-assign]
        self.cma_many = module.cma_many  # type: ignore[method-assign]
        self.mover = module.mover
        self.alive_page = module.alive_page
        self.watch = module.watch  # type: ignore[method-assign]
        self.unwatch = module.unwatch  # type: ignore[method-assign]

    def share(self, min_bytes: int, spin_us: int) -> int:  # type: ignore[override]
        return int(self._share(max(int(min_bytes), 0), max(int(spin_us), 0) * 1000))

    def check(self, offs: Any, lens: Any, n: int, size: int) -> tuple[int, int]:  # type: ignore[override]
        r = self._check(_addr(offs), _addr(lens), n, size)
        return (r, 0) if r >= 0 else (-1, -1 - r)

    def check2(self, roffs: Any, loffs: Any, lens: Any, n: int, rsize: int, lsize: int) -> tuple[str, int, int]:
        r = self._check2(roffs, loffs, lens, n, rsize, lsize)
        if r < 0:
            return "", -1, -1 - r
        return ("remote", r, 0) if r < n else ("local", r - n, 0)


_lock = threading.Lock()
_loop: CopyLoop | None = None


def get() -> CopyLoop:
    """The process's copy loop (loads the helper on the first call; never raises)."""
    global _loop
    loop = _loop
    if loop is not None:
        return loop
    with _lock:
        if _loop is None:
            try:
                _loop = _load()
            except Exception as exc:  # noqa: BLE001 - any failure means: use the fallback
                _loop = CopyLoop(f"python fallback: loading the compiled copy loop failed ({exc})")
            if not _loop.native:
                log.debug("shm: %s", _loop.reason)
        return _loop


def fallback(reason: str = "python fallback: disabled by plugins.shm.native") -> CopyLoop:
    return CopyLoop(reason)


def status() -> str:
    """What :func:`get` uses or would use (for availability text)."""
    if _loop is not None:
        return _loop.reason
    if os.environ.get(_ENV, "1") == "0":
        return f"python fallback: disabled by {_ENV}=0"
    return get().reason


def _load() -> CopyLoop:
    if os.environ.get(_ENV, "1") == "0":
        return CopyLoop(f"python fallback: disabled by {_ENV}=0")
    h = native_helper.load(MODULE, ABI, "mp_abi")
    if isinstance(h, str):
        return CopyLoop(f"python fallback: {h}")
    return NativeLoop(h.lib, str(h.path), h.module)
