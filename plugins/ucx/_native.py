"""Optional compiled helper for the ucx binding: puts/gets in one call outside the interpreter.

A batch of N small puts costs two ctypes calls per put from Python (issue, and the
progress call that completes it) -- about 3 µs each here, against 0.7 µs in C. The
helper (``_ucxloop.c``, beside this file) is built when mpcomm is installed into the
extension module ``mpcomm.plugins.ucx._mpcomm_ucxloop`` (setup.py; never at run time);
it calls UCX through the function pointers the ctypes binding already resolved, so it
needs neither UCX headers nor linking. The general path's group loop and the progress
loop are called through ctypes on the module's file; the fast path (a bound lane's
``move``, one entry for one request or a group) calls the module itself
(:func:`module`): no ctypes argument conversion per request. Where the install built no
helper, or ``MPCOMM_UCX_NATIVE=0``, :func:`load` returns None: there is no fast path
then, and the general path runs its loops in Python.
"""

from __future__ import annotations

import ctypes as C
import logging
import os
import threading
from types import ModuleType

from mpcomm import native_helper

log = logging.getLogger("mpcomm.transport.ucx")

ABI = 10
MODULE = "mpcomm.plugins.ucx._mpcomm_ucxloop"

_lock = threading.Lock()
_lib: C.CDLL | None = None
_module: ModuleType | None = None
_tried = False
#: Why the helper is or is not in use (shown by tests and diagnostics).
reason = "not loaded yet"


def load() -> C.CDLL | None:
    """The compiled helper, or None (not built at install, disabled, or it failed: the Python loop is used)."""
    global _lib, _module, _tried, reason
    with _lock:
        if _tried:
            return _lib
        _tried = True
        if os.environ.get("MPCOMM_UCX_NATIVE", "1") == "0":
            reason = "disabled by MPCOMM_UCX_NATIVE=0"
            return None
        try:
            _lib, _module, reason = _load()
        except Exception as exc:  # noqa: BLE001 - optional: any failure means the Python fallback
            _lib, _module, reason = None, None, f"loading the helper failed ({exc})"
        if _lib is None:
            log.debug("ucx: native helper not used: %s", reason)
        return _lib


def module() -> ModuleType | None:
    """The helper's extension module (the single-request call), or None; loads the helper first."""
    load()
    return _module


def _load() -> tuple[C.CDLL | None, ModuleType | None, str]:
    h = native_helper.load(MODULE, ABI, "mpcomm_ucx_abi")
    if isinstance(h, str):
        return None, None, h
    lib = h.lib
    f = lib.mpcomm_ucx_rma_many
    f.restype = C.c_int64
    f.argtypes = [C.c_void_p] * 5 + [C.c_void_p, C.c_int64, C.c_int64, C.c_void_p, C.c_int64, C.c_int64,
                                     C.c_void_p, C.c_int64, C.c_void_p, C.c_void_p, C.c_void_p, C.c_int64]
    for name, res, args in (("mpcomm_ucx_loop_run", C.c_int64, [C.c_void_p]),
                            ("mpcomm_ucx_loop_want", None, [C.c_void_p, C.c_int64]),
                            ("mpcomm_ucx_loop_ask", None, [C.c_void_p]),
                            ("mpcomm_ucx_loop_handoff", C.c_int64, [C.c_void_p]),
                            ("mpcomm_ucx_loop_kick", C.c_int64, [C.c_void_p]),
                            ("mpcomm_ucx_loop_bump", None, [C.c_void_p]),
                            ("mpcomm_ucx_loop_events", None, [C.c_void_p]),
                            ("mpcomm_ucx_loop_worked", None, [C.c_void_p]),
                            ("mpcomm_ucx_loop_stop", None, [C.c_void_p]),
                            ("mpcomm_ucx_loop_wait", C.c_int64,
                             [C.c_void_p, C.c_int64, C.c_int64, C.c_void_p, C.c_int64, C.c_int64])):
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = res, args
    mod: ModuleType | None = h.module
    if mod is not None and (mod.CALL_SIZE != C.sizeof(RmaCall) or mod.LANE_SIZE != C.sizeof(Lane)
                            or mod.LOOP_SIZE != C.sizeof(LoopState)):
        mod = None
    return lib, mod, f"compiled helper ({h.path}{', extension module' if mod is not None else ''})"


class RmaCall(C.Structure):
    """struct mp_rma_call of _ucxloop.c: one (endpoint, rkey, memh, direction), packed once into a Lane."""

    _fields_ = [("fn", C.c_void_p), ("check", C.c_void_p), ("rfree", C.c_void_p), ("progress", C.c_void_p),
                ("flush", C.c_void_p), ("ep", C.c_void_p), ("worker", C.c_void_p), ("rkey", C.c_void_p),
                ("param", C.c_void_p), ("fparam", C.c_void_p), ("write", C.c_int64), ("pending", C.c_void_p)]


class Lane(C.Structure):
    """struct mp_lane of _ucxloop.c: a bound lane, the fast path's one entry (see there)."""

    _fields_ = [("call", RmaCall), ("ep_gate", C.c_void_p), ("att_gate", C.c_void_p), ("laddr", C.c_int64),
                ("lsize", C.c_int64), ("rbase", C.c_int64), ("rsize", C.c_int64), ("limit", C.c_int64),
                ("merge", C.c_int64), ("mparam", C.c_void_p)]


def gate() -> C.Array:
    """A new open gate: int64 [open, in flight] (see struct mp_lane)."""
    g = (C.c_int64 * 2)()
    g[0] = 1
    return g


class LoopState(C.Structure):
    """struct mp_loop of _ucxloop.c: the native progress loop's shared words (see there)."""

    _fields_ = [("progress", C.c_void_p), ("arm", C.c_void_p), ("signal", C.c_void_p), ("worker", C.c_void_p),
                ("efd", C.c_int64), ("nfd", C.c_int64), ("spin_ns", C.c_int64), ("stop", C.c_int32),
                ("want", C.c_int32), ("events", C.c_uint32), ("drivers", C.c_int32), ("asked", C.c_int32),
                ("kicks", C.c_uint32), ("check", C.c_void_p), ("sleeps", C.c_int64),
                ("notified", C.c_int64), ("claim_ns", C.c_int64), ("handoff_at", C.c_int64),
                ("held_until", C.c_int64), ("held", C.c_int64), ("poller", C.c_int32), ("polling", C.c_int32),
                ("park", C.c_uint32), ("parked", C.c_int32), ("poller_left", C.c_int64), ("parks", C.c_int64),
                ("polls", C.c_int64), ("linger_ns", C.c_int64)]


class ProgressLoop:
    """The worker's progress in a native loop that never takes the GIL (``mpcomm_ucx_loop_run``).

    A daemon thread parks in one ctypes call (which releases the GIL) until :meth:`stop`. Python
    threads talk to it through shared words: the transport keeps :meth:`want` (it has requests
    no result() waiter drives); its bookkeeping thread calls :meth:`ask` before it checks them
    and then sleeps on :attr:`nfd` (an eventfd the loop writes after a progress call that did
    work, once per ask, while wanted); a result() waiter reads :meth:`events`, checks its
    request and calls :meth:`wait`; the first such waiter polls the worker itself while the loop
    thread parks (``linger_ns``: how long it stays parked after the last one left). Made by
    ``_ucp.Worker.progress_loop``, which owns the worker handle.
    """

    def __init__(self, lib: C.CDLL, progress: int, arm: int, signal: int, check: int, worker: int, efd: int,
                 spin_ns: int, claim_ns: int = 0, linger_ns: int = 0) -> None:
        self.nfd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._state = LoopState(progress=progress, arm=arm, signal=signal, worker=worker, efd=efd, nfd=self.nfd,
                                spin_ns=max(0, spin_ns), check=check, claim_ns=max(0, claim_ns),
                                linger_ns=max(0, linger_ns))
        self._at = at = C.addressof(self._state)
        self._lib = lib
        self._want, self._ask = lib.mpcomm_ucx_loop_want, lib.mpcomm_ucx_loop_ask
        self._handoff = lib.mpcomm_ucx_loop_handoff
        self._kick, self._bump, self._worked = lib.mpcomm_ucx_loop_kick, lib.mpcomm_ucx_loop_bump, \
            lib.mpcomm_ucx_loop_worked
        self._wait_fn = lib.mpcomm_ucx_loop_wait
        self._events = lib.mpcomm_ucx_loop_events
        self._thread = threading.Thread(target=lib.mpcomm_ucx_loop_run, args=(at,), name="mpcomm-ucx-native",
                                        daemon=True)
        self._stopped = False

    def start(self) -> None:
        self._thread.start()

    def want(self, want: bool) -> None:
        """Whether the bookkeeping thread has requests that no result() waiter drives."""
        self._want(self._at, int(want))

    def ask(self) -> None:
        """The bookkeeping thread is about to check: one wake-up on :attr:`nfd` after the next work."""
        self._ask(self._at)

    def handoff(self) -> None:
        """A request was handed off in flight: wanted from now on, and the loop progresses. For
        ``claim_ns`` from now, work that would wake the bookkeeping thread holds that wake-up until
        the window ends (a result() waiter may claim the request meanwhile; see _ucxloop.c)."""
        self._handoff(self._at)

    def kick(self) -> None:
        """Wake the bookkeeping thread, every waiter and the loop (new work, an abort, a revocation)."""
        self._kick(self._at)

    def worked(self) -> None:
        """A Python thread's progress call did work: as after the loop's own (waiters check their
        requests natively; the bookkeeping thread is woken if it wants and asked)."""
        self._worked(self._at)

    def nudge(self) -> None:
        """Wake the bookkeeping thread and every waiter without calling UCX (safe inside a UCX callback)."""
        try:
            os.eventfd_write(self.nfd, 1)
        except OSError:
            pass
        self._bump(self._at)

    def tell_drivers(self) -> None:
        """The bookkeeping thread's own progress did work: every :meth:`wait` checks its request
        (the thread itself looks at its requests again; it is not woken)."""
        self._events(self._at)

    def bump(self) -> None:
        """Wake every :meth:`wait` (requests were reported)."""
        self._bump(self._at)

    def events(self) -> tuple[int, int]:
        """(events, kicks); read them before checking a request, then :meth:`wait` on them."""
        st = self._state
        return st.kicks, st.events

    def wait(self, seen: tuple[int, int], timeout: float, spin: float, request: int = 0) -> bool:
        """Wait (GIL released) until Python kicks, or the loop did work and ``request`` (a UCX
        request's address the caller alone frees; 0: any work) is no longer in progress.
        False after ``timeout`` s."""
        return bool(self._wait_fn(self._at, seen[1], seen[0], request or None, int(max(0.0, timeout) * 1e9),
                                  int(spin * 1e9)))

    def waiting(self) -> int:
        """How many threads are inside :meth:`wait` (close() waits for 0 before it frees requests)."""
        return self._state.drivers

    def drain(self) -> None:
        """Consume the wake-ups written to :attr:`nfd`."""
        try:
            os.eventfd_read(self.nfd)
        except BlockingIOError:
            pass

    @property
    def sleeps(self) -> int:
        """How many times the loop slept on the worker's event fd and woke."""
        return self._state.sleeps

    @property
    def parks(self) -> int:
        """How many times the loop thread parked while result() waiters polled the worker."""
        return self._state.parks

    @property
    def polls(self) -> int:
        """How many polls of the event fd result() waiters made themselves."""
        return self._state.polls

    @property
    def held(self) -> int:
        """How many wake-ups of the bookkeeping thread were held for a claim window."""
        return self._state.held

    @property
    def notified(self) -> int:
        """How many times the loop woke the bookkeeping thread."""
        return self._state.notified

    def alive(self) -> bool:
        return self._thread.is_alive()

    def stop(self, timeout: float = 5.0) -> bool:
        """Stop the loop and join its thread; True when it ended (the worker may then be destroyed)."""
        if not self._stopped:
            self._stopped = True
            if self._thread.is_alive() or self._thread.ident is not None:
                self._lib.mpcomm_ucx_loop_stop(self._at)
        if self._thread.ident is not None:
            self._thread.join(timeout)
        return not self._thread.is_alive()

    def close(self) -> None:
        """Close the eventfd (after :meth:`stop` and after the bookkeeping thread ended)."""
        if self.nfd >= 0 and not self._thread.is_alive():
            os.close(self.nfd)
            self.nfd = -1
