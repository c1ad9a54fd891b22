"""Helpers for the ucx tests: the fast path's native entry over stand-in UCX functions, and a
target process that a test stops while it posts a request.

``StandInLane`` builds one bound lane (struct mp_lane of plugins/ucx/_ucxloop.c) whose UCX
function pointers are ctypes callbacks that record what they were asked, so a test sees what
the one fast-path entry issued, freed, flushed and reported. ``StoppableTarget`` is a target
engine over ``UCX_TLS=tcp,self`` in a child process: over tcp a put or get needs the target's
progress, so a target stopped (SIGSTOP) while a write is posted makes that write wait for it.
"""

from __future__ import annotations

import ctypes as C
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Callable, TypeVar

import pytest

from mpcomm.plugins.ucx import _native

T = TypeVar("T")

RMA = C.CFUNCTYPE(C.c_void_p, C.c_void_p, C.c_void_p, C.c_size_t, C.c_uint64, C.c_void_p, C.c_void_p)
CHECK_BYTE = C.CFUNCTYPE(C.c_uint8, C.c_void_p)  # ucs_status_t is one byte; -3 travels as 0xfd
FREE = C.CFUNCTYPE(None, C.c_void_p)
PROGRESS = C.CFUNCTYPE(C.c_uint, C.c_void_p)
FLUSH = C.CFUNCTYPE(C.c_void_p, C.c_void_p, C.c_void_p)
ERR_IO = -3  # a small negative ucs_status_t: UCS_PTR_IS_ERR
MASK = 0xFFFFFFFFFFFFFFFF
PARAM, MPARAM = 0x111, 0x222  # stand-in request parameters: which one a put was issued with


class StandInLane:
    """A bound lane over stand-in UCX functions: ``move`` (answers through ``on_pending``, as the
    engine's) and ``raw`` (no on_pending: the tuple itself) share it.

    ``request`` is what each put/get returns (0: done at once), ``status`` what
    ``ucp_request_check_status`` says of the flush (1: still in flight), ``flush_request`` what
    the flush returns, ``refuse_at`` the index of an operation UCX refuses (UCS_ERR_IO_ERROR).
    ``log`` records every call in order; ``issued`` each put as (local address, length, remote
    address, parameters); ``in_flight_seen`` the endpoint gate's count during each put."""

    LBASE, RBASE = 0x10000, 0x80000

    def __init__(self, *, write: bool = True, lsize: int = 8192, rsize: int = 4096, limit: int = 1 << 16,
                 merge: int = 1 << 20, request: int = 0, status: int = 0, flush_request: int = 0,
                 refuse_at: int | None = None) -> None:
        mod = _native.module()
        if mod is None:
            pytest.skip(f"no extension module for the ucx helper: {_native.reason}")
        self.mod = mod
        self.log: list[str] = []
        self.issued: list[tuple[int, int, int, int]] = []
        self.in_flight_seen: list[int] = []
        self.pending: list[tuple[int, int, Any]] = []
        self.signals = 0
        self.active: set[Any] = set()
        self.ep_gate, self.att_gate = _native.gate(), _native.gate()

        def rma(ep: int, laddr: int, n: int, raddr: int, rkey: int, param: int) -> int:
            self.log.append("put")
            self.issued.append((laddr, n, raddr, param))
            self.in_flight_seen.append(self.ep_gate[1])
            if refuse_at is not None and len(self.issued) - 1 == refuse_at:
                return ERR_IO & MASK
            return request

        def check(r: int) -> int:
            self.log.append(f"check {r:#x}")
            return status & 0xFF

        def flush(ep: int, p: int) -> int:
            self.log.append("flush")
            return flush_request

        def free(r: int) -> None:
            self.log.append(f"free {r:#x}")

        def progress(w: int) -> int:
            self.log.append("progress")
            return 0

        self.keep = (RMA(rma), CHECK_BYTE(check), FREE(free), PROGRESS(progress), FLUSH(flush))
        lane = self.lane = _native.Lane()
        c = lane.call
        c.fn, c.check, c.rfree, c.progress, c.flush = (C.cast(k, C.c_void_p).value for k in self.keep)
        c.write, c.param = int(write), PARAM
        lane.ep_gate, lane.att_gate = C.addressof(self.ep_gate), C.addressof(self.att_gate)
        lane.laddr, lane.lsize, lane.rbase, lane.rsize = self.LBASE, lsize, self.RBASE, rsize
        lane.limit, lane.merge, lane.mparam = limit, merge, MPARAM

        def signal_() -> None:
            self.signals += 1

        def on_pending(code: int, ptr: int, statuses: Any) -> bool:
            self.pending.append((code, ptr, statuses))
            return False

        at = C.addressof(lane)
        self.move = mod.lane(at, self.active, signal_, on_pending, (lane, self.keep))
        self.raw = mod.lane(at, self.active, signal_, None, (lane, self.keep))

    @property
    def flushes(self) -> int:
        return self.log.count("flush")

    def puts(self) -> list[tuple[int, int, int]]:
        """What was issued, as (local offset, length, remote offset)."""
        return [(la - self.LBASE, n, ra - self.RBASE) for la, n, ra, _p in self.issued]


_TARGET = textwrap.dedent("""
    import sys, time, mpcomm
    e = mpcomm.Engine({"plugins": {"ucx": {"tls": "tcp,self"}}}, transports=["ucx"])
    e.register(bytearray(1 << 20), name="kv")
    print(e.address, flush=True)
    time.sleep(600)
""")


class StoppableTarget:
    """A target engine over ``UCX_TLS=tcp,self`` in a child process (one 1 MiB region "kv")."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", _TARGET], stdout=subprocess.PIPE, text=True)
        self.address: str = self.proc.stdout.readline().strip()  # type: ignore[union-attr]

    def __enter__(self) -> StoppableTarget:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.proc.kill()
        self.proc.wait()

    def paused(self, resume_after: float, post: Callable[[], T]) -> T:
        """``post()`` while the target is stopped, resumed ``resume_after`` s later by a timer: what
        ``post`` issues over tcp waits for the target meanwhile. Returns what ``post`` returns."""
        pid = self.proc.pid
        os.kill(pid, signal.SIGSTOP)
        end = time.monotonic() + 5
        while time.monotonic() < end:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "T":
                    break
            time.sleep(0.0005)
        threading.Timer(resume_after, os.kill, (pid, signal.SIGCONT)).start()
        try:
            return post()
        except BaseException:
            os.kill(pid, signal.SIGCONT)
            raise


@contextmanager
def ucx_pair(size: int = 1 << 20) -> Iterator[tuple[Any, Any, Any, Any, Any]]:
    """Two in-process engines over real UCX (the test skips, saying why, when ucx is unavailable):
    ``(target, initiator, kv, remote, src)`` with a ``size``-byte target region "kv", the
    initiator's handle on it and a ``size``-byte source region; both engines closed afterwards."""
    import mpcomm
    from mpcomm.plugins.ucx.transport import UcxTransport

    avail = UcxTransport.availability()
    if not avail:
        pytest.skip(f"ucx transport unavailable: {avail.reason}")
    target = mpcomm.Engine(transports=["ucx"])
    ini = mpcomm.Engine(transports=["ucx"])
    try:
        kv = target.allocate(size, name="kv")
        remote = ini.open(target.address, "kv")
        yield target, ini, kv, remote, ini.allocate(size, name="src")
    finally:
        ini.close(timeout=5)
        target.close(timeout=5)
