"""Which threads run Python while a caller waits in ``result()``: the kit's completion check.

The contract (docs/concepts.md, "Completion") promises that a request's
outcome reaches a thread blocked in ``result()`` with the GIL released and
no other Python thread of the initiator scheduled on the way: the transport
reports on the waiting thread (:meth:`~mpcomm.Transport.drive`), or from a
thread that is not Python's, and the engine settles the handle there.
Callbacks still run on the engine's completion thread.

:class:`PythonThreads` proves it for real: a profile function installed
with :func:`threading.setprofile` *before* the
engine starts any thread sees every Python call and return of every Python
thread the process starts afterwards (the GIL is taken for each). Between
the submit and the return of ``result()`` it records which threads other
than the waiter (the thread that installed it) ran Python, and what they
ran. The target runs in another process.

:func:`check_completion_on_waiter` runs single requests, vectored batches
(``write_many``/``read_many``) and ``submit`` of several requests through
it; it is an optional check (a transport without ``drive`` whose reports
come from a Python thread of its own fails it by design), so it is not in
:data:`~mpcomm.testing.CHECKS`, and it needs a process where no thread ran
before it: ``python -m mpcomm.testing.completion NAME REGION [LARGE]
[CONFIG_JSON]`` (exit status 0 when it holds), or call it first thing with a
:class:`~mpcomm.testing.ConformanceEnv` factory.
"""

from __future__ import annotations

import _thread
import resource
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

__all__ = ["PythonThreads", "check_completion_on_waiter", "waiter_only"]


class PythonThreads:
    """Records which threads run Python code inside :meth:`window`; install before any thread starts.

    Threads started earlier (by :mod:`threading` or natively) are not seen:
    :meth:`install` refuses to run when a thread other than the caller's is
    alive, so nothing can hide.
    """

    def __init__(self) -> None:
        self._open = False
        self._waiter = -1
        #: ``{thread ident: [thread name, first functions it ran]}`` of the last window.
        self.others: dict[int, list[Any]] = {}

    def _hook(self, frame: Any, event: str, arg: Any) -> None:
        if not self._open:
            return
        me = _thread.get_ident()
        if me == self._waiter:
            return
        seen = self.others.get(me)
        if seen is None:
            seen = self.others[me] = [threading.current_thread().name, []]
        if len(seen[1]) < 8:
            code = frame.f_code
            what = arg.__qualname__ if event.startswith("c_") and hasattr(arg, "__qualname__") else code.co_name
            seen[1].append(f"{event} {what} ({code.co_filename.rsplit('/', 1)[-1]}:{frame.f_lineno})")

    def install(self) -> None:
        alive = [t.name for t in threading.enumerate() if t is not threading.current_thread()]
        if alive:
            raise RuntimeError(f"install before any other thread starts; running already: {alive}")
        # Every thread started from now on; not this one, the waiter's: the hook would only slow
        # it down (and a slowed caller loses races a real one wins).
        threading.setprofile(self._hook)

    def uninstall(self) -> None:
        threading.setprofile(None)  # type: ignore[arg-type]
        # Threads started meanwhile keep the hook: it does nothing outside a window.

    @contextmanager
    def window(self) -> Iterator[PythonThreads]:
        """Record the other threads that run Python until the block ends (on the waiting thread)."""
        self.others = {}
        self._waiter = _thread.get_ident()
        self._open = True
        try:
            yield self
        finally:
            self._open = False

    def describe(self) -> str:
        return "; ".join(f"{name}: {', '.join(calls)}" for name, calls in self.others.values())


def _preemptions() -> int:
    """Involuntary context switches of the calling thread so far (Linux; 0 where unknown)."""
    try:
        return resource.getrusage(resource.RUSAGE_THREAD).ru_nivcsw
    except (AttributeError, OSError):
        return 0


def waiter_only(threads: PythonThreads, what: str, run: Callable[[], Any], tries: int = 5) -> Any:
    """Run ``run()`` (submit and ``result()``) inside a window; AssertionError if another thread ran Python.

    A thread of the engine that runs for a reason of its own (a heartbeat,
    a timer that came due) can fall into a window by chance: the case is
    run up to ``tries`` times and fails only if *every* run saw another
    thread. A hop the request path makes happens on every run.

    A run in which the scheduler took the CPU from the waiter (an involuntary
    context switch of its thread, ``ru_nivcsw``) does not count either way:
    a caller that is not running cannot claim its request, and a transport
    hands an unclaimed one to its own thread after a short window by design
    (so that callback-only users are served). On a loaded machine such runs
    are retried, up to ``8 * tries`` in all.
    """
    seen = []
    preempted = 0
    for _ in range(8 * tries):
        before = _preemptions()
        with threads.window():
            out = run()
        if not threads.others:
            return out
        if _preemptions() != before:
            preempted += 1
            continue
        seen.append(threads.describe())
        if len(seen) == tries:
            break
    raise AssertionError(f"{what}: other Python threads ran while the caller waited, in each of {len(seen)} runs "
                         f"where the waiter kept its CPU ({preempted} more runs were preempted): " + " | ".join(seen))


def check_completion_on_waiter(make_env: Callable[[], Any], *, remote_name: str = "buf", size: int = 4096,
                               large: int = 0, batch: int = 8, notify: bool = False) -> None:
    """The completion property for one transport and one remote region.

    ``make_env()`` builds the :class:`~mpcomm.testing.ConformanceEnv` (engine
    and target process) *after* the profile is installed, so every thread the
    engine starts is seen. Cases, each a write then a read, checked for data:
    single requests of ``size`` bytes (and of ``large`` bytes, when given:
    e.g. past a transport's inline threshold), ``write_many``/``read_many``
    of ``batch`` pieces, ``submit`` of ``batch`` requests, and ``submit`` of
    requests to two remote regions (two groups in one batch; the target has
    ``alloc`` and ``buf``, as the kit's target does). With ``notify``: also a
    write of ``size`` bytes with a notification (``write(..., notify=...)``), for a
    transport that carries the note with the data (Transport.carries_notification).
    """
    from mpcomm import Request
    from mpcomm.testing.patterns import pattern

    threads = PythonThreads()
    threads.install()
    try:
        env = make_env()
        try:
            eng = env.engine
            remote = env.remote(remote_name)
            biggest = max(size * batch, large)
            src = eng.allocate(biggest)
            dst = eng.allocate(biggest)
            src.view[:] = pattern(11, biggest)
            # Warm up: connection, attach, route caches and lazily started threads are not the wait.
            for n in (size, large) if large else (size,):
                eng.write(src, remote, 0, n).result(timeout=30)
                eng.read(dst, remote, 0, n).result(timeout=30)
            eng.write_many(src, remote, [0], [0], [size]).result(timeout=30)
            eng.submit([Request("write", src, remote, 0, size)]).result(timeout=30)
            sizes = [size] + ([large] if large else [])
            for n in sizes:
                waiter_only(threads, f"write of {n} bytes", lambda n=n: eng.write(src, remote, 0, n).result())
                dst.view[:n] = bytes(n)
                waiter_only(threads, f"read of {n} bytes", lambda n=n: eng.read(dst, remote, 0, n).result())
                assert bytes(dst.view[:n]) == bytes(src.view[:n]), f"read of {n} bytes returned other data"
            if notify:
                eng.write(src, remote, 0, size, notify=b"warm").result(timeout=30)
                waiter_only(threads, f"write of {size} bytes with a notification",
                            lambda: eng.write(src, remote, 0, size, notify=b"note").result())
            offs = [i * size for i in range(batch)]
            lens = [size] * batch
            waiter_only(threads, f"write_many of {batch}x{size}",
                        lambda: eng.write_many(src, remote, offs, offs, lens).result())
            dst.view[:] = bytes(biggest)
            waiter_only(threads, f"read_many of {batch}x{size}",
                        lambda: eng.read_many(dst, remote, offs, offs, lens).result())
            assert bytes(dst.view[:size * batch]) == bytes(src.view[:size * batch]), "read_many returned other data"
            reqs = [Request("write", src, remote, o, size, local_offset=o) for o in offs]
            waiter_only(threads, f"submit of {batch} writes", lambda: eng.submit(reqs).result())
            reqs = [Request("read", dst, remote, o, size, local_offset=o) for o in offs]
            waiter_only(threads, f"submit of {batch} reads", lambda: eng.submit(reqs).result())
            # Two remote regions: two groups in one batch, each driven in turn.
            other = env.remote("alloc" if remote_name != "alloc" else "buf")
            eng.submit([Request("write", src, other, 0, size)]).result()  # warm-up of that region
            reqs = [Request("write", src, r, o, size, local_offset=o) for o in offs for r in (remote, other)]
            waiter_only(threads, f"submit of {2 * batch} writes to two regions",
                        lambda: eng.submit(reqs).result())
        finally:
            threads.uninstall()
            env.close()
    finally:
        threads.uninstall()


def main(argv: list[str] | None = None) -> int:
    """``python -m mpcomm.testing.completion TRANSPORT REGION [LARGE] [CONFIG_JSON] [--notify]``: the
    check in a fresh process (no thread runs before the profile is installed); exit status 1 with the
    report. ``--notify`` adds the notifying write."""
    import json

    from .kit import ConformanceEnv

    args = sys.argv[1:] if argv is None else argv
    notify = "--notify" in args
    args = [a for a in args if a != "--notify"]
    transport, region = args[0], args[1]
    large = int(args[2]) if len(args) > 2 else 0
    config = json.loads(args[3]) if len(args) > 3 else None
    try:
        check_completion_on_waiter(lambda: ConformanceEnv(transport, config=config), remote_name=region, large=large,
                                  notify=notify)
    except AssertionError as exc:
        print(f"FAILED {transport} {region}: {exc}")
        return 1
    print(f"passed {transport} {region}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
