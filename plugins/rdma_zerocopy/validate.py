"""Hardware validation of rdma_zerocopy: ``mpcomm doctor --rdma`` or
``python -m mpcomm.plugins.rdma_zerocopy.validate [--step NAME ...] [--posts N] [--register-size SIZE]``.

On a node with an RDMA NIC or Soft-RoCE (see docs/rdma.md) it runs, in order,
and prints one verdict line per step (PASS / WARN / FAIL / SKIP):

1. ``device``: the adapter opens with its completion channel and async-event
   descriptors identified (else the reaper polls: WARN);
2. ``conformance``: the conformance kit between two processes, once per link
   layer present (InfiniBand, RoCE);
3. ``rss``: RSS growth over ``--posts`` (default 1M) posted requests;
4. ``stale_rkey``: a write through a descriptor whose region was unregistered
   fails with a remote access error;
5. ``killed_peer``: a write to a killed target process fails with
   retry-exceeded within its deadline;
6. ``cancel``: cancelling a 1 GiB write in flight flushes, retires, recovers,
   and no byte lands after ``cancel()`` returned;
7. ``idle``: CPU use of an idle engine, and completion wake-up latency after
   idling against back-to-back;
8. ``register``: time to register 1 GiB against an ``mmap`` + touch baseline,
   and how long another Python thread is stalled meanwhile (pyverbs holds the
   GIL in ``ibv_reg_mr``);
9. ``bench``: ``mpcomm bench -t rdma_zerocopy --quick``, in the record format.

Without a usable port every step is SKIP with availability()'s reason. A
step that fails does not stop the later ones; exit status 1 when one FAILed.
Traffic goes to loopback only (the two engines share the node).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import hashlib
import mmap
import os
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["STEPS", "StepResult", "Validation", "main", "run_steps"]

PASS, WARN, FAIL, SKIP = "PASS", "WARN", "FAIL", "SKIP"
GiB = 1 << 30


@dataclass
class StepResult:
    index: int
    name: str
    verdict: str
    detail: str
    seconds: float = 0.0
    records: list[str] = field(default_factory=list)

    def line(self) -> str:
        return f"{self.verdict:<4} {self.index}. {self.name}: {self.detail}"


class _Skip(Exception):
    pass


@dataclass
class Validation:
    """What the steps run against; the defaults are the real transport and the issue's sizes."""

    transport: str = "rdma_zerocopy"
    plugins: Sequence[Any] = ()  # plugin objects/modules (tests pass a simulated adapter)
    autoload: bool | None = None
    #: The simulated adapter lives in one process: steps needing a second process skip.
    in_process_only: bool = False
    options: dict[str, Any] = field(default_factory=dict)  # [plugins.<transport>] overrides
    posts: int = 1_000_000
    register_size: int = GiB
    cancel_size: int = GiB
    idle_seconds: float = 2.0
    reason: str = ""

    # -- engines ---------------------------------------------------------------------

    def config(self, **plugin_opts: Any) -> dict[str, Any]:
        opts = {**self.options, **plugin_opts}
        return {"transport": {"name": self.transport}, "memory": {"alignment": 4096},
                "plugins": {self.transport: opts} if opts else {}}

    def engine(self, **plugin_opts: Any) -> Any:
        import mpcomm

        return mpcomm.Engine(self.config(**plugin_opts), transports=[self.transport], plugins=list(self.plugins),
                             autoload=self.autoload)

    @contextlib.contextmanager
    def pair(self, **plugin_opts: Any) -> Iterator[tuple[Any, Any]]:
        target = self.engine(**plugin_opts)
        try:
            init = self.engine(**plugin_opts)
            try:
                yield target, init
            finally:
                init.close()
        finally:
            target.close()

    def gate(self) -> str:
        """Why nothing can run here ("" when the transport starts)."""
        import mpcomm

        if self.transport == "rdma_zerocopy":
            from .transport import RdmaZeroCopyTransport

            avail = RdmaZeroCopyTransport.availability()
            if not avail:
                return avail.reason
        try:
            e = self.engine()
        except mpcomm.TransportUnavailable as exc:
            return str(exc)
        try:
            if self.transport not in e.transports:
                status = {s.name: s.availability.reason for s in e.transport_status()}
                return status.get(self.transport, f"{self.transport} is not installed")
            return ""
        finally:
            e.close()


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _digest(region: Any) -> bytes:
    return hashlib.blake2b(region.view).digest()


def _fmt(seconds: float) -> str:
    from mpcomm.cli.records import format_seconds

    return format_seconds(seconds)


# -- the steps ------------------------------------------------------------------------------


def step_device(v: Validation) -> tuple[str, str]:
    e = v.engine()
    try:
        t = e.transports[v.transport]
        info = t.dev.info()
        skipped = getattr(t.dev, "skipped", ())
        where = (f"{info['device']} port {info['port']} ({info['link_layer']}, mtu enum {info['mtu']}, "
                 f"max_msg_sz {info['max_msg_sz']})")
        extra = f"; {'; '.join(skipped)}" if skipped else ""
        if info.get("completion_wait") != "event":
            return WARN, (f"{where}: the completion channel's descriptor was not identified "
                          f"({getattr(t.dev, 'event_fd_source', '?')}): the reaper polls with a 1 ms back-off{extra}")
        if not info.get("async_events"):
            return WARN, f"{where}: completion channel OK, but async events cannot be read (descriptor unknown){extra}"
        return PASS, f"{where}: completion channel ({t.dev.event_fd_source}) and async events{extra}"
    finally:
        e.close()


def _ports(v: Validation) -> list[tuple[str, int, str]]:
    """One active port per link layer present."""
    if v.transport != "rdma_zerocopy":
        e = v.engine()
        try:
            d = e.transports[v.transport].dev
            return [(d.name, d.port, d.link_layer)]
        finally:
            e.close()
    from . import verbs

    verbs.load_pyverbs()
    from pyverbs.device import Context

    seen: dict[str, tuple[str, int, str]] = {}
    for dev in verbs.list_devices():
        name = verbs.device_name(dev)
        if verbs.judge_device(getattr(dev, "transport_type", 0)):
            continue
        with verbs.ctx_lock:
            try:
                ctx = Context(name=name)
            except Exception:  # noqa: BLE001
                continue
        try:
            for p in range(1, int(ctx.query_device().phys_port_cnt) + 1):
                pa = ctx.query_port(p)
                if not verbs.judge_port(pa.state, pa.link_layer):
                    seen.setdefault(verbs.LINK_LAYERS[int(pa.link_layer)], (name, p, verbs.LINK_LAYERS[int(pa.link_layer)]))
        finally:
            with verbs.ctx_lock, contextlib.suppress(Exception):
                ctx.close()
    return list(seen.values())


def step_conformance(v: Validation) -> tuple[str, str]:
    if v.in_process_only:
        raise _Skip("the simulated adapter cannot span two processes")
    from mpcomm.testing.kit import run_conformance

    parts, worst = [], PASS
    for device, port, layer in _ports(v):
        cfg = {"plugins": {v.transport: {**v.options, "device": device, "port": port}}}
        report = run_conformance(v.transport, config=cfg, autoload=v.autoload)
        failed = [r for r in report.results if r.outcome == "failed"]
        counts = {k: sum(r.outcome == k for r in report.results) for k in ("passed", "failed", "skipped")}
        parts.append(f"{layer} ({device} port {port}): {counts['passed']} passed, {counts['failed']} failed, "
                     f"{counts['skipped']} skipped" + (f" [{'; '.join(f'{r.name}: {r.detail}' for r in failed)}]"
                                                        if failed else ""))
        if failed:
            worst = FAIL
    if not parts:
        raise _Skip("no active port")
    return worst, "; ".join(parts)


def step_rss(v: Validation) -> tuple[str, str]:
    window, size = 128, 64
    with v.pair() as (target, init):
        target.allocate(1 << 20, "kv")
        remote = init.open(target.address, "kv")
        src = init.allocate(1 << 20)

        def run(n: int) -> None:
            inflight: list[Any] = []
            for i in range(n):
                inflight.append(init.write(src, remote, (i % 1024) * size, size, local_offset=(i % 1024) * size))
                if len(inflight) >= window:
                    for t in inflight:
                        t.result(30)
                    inflight.clear()
            for t in inflight:
                t.result(30)

        # Warm-up: caches, pools, the allocator's arenas. Twice: the first pass
        # over a fresh engine still grows arenas for the handles' peak count.
        run(min(20_000, v.posts))
        run(min(20_000, v.posts))
        before = _rss()
        t0 = time.monotonic()
        run(v.posts)
        elapsed = time.monotonic() - t0
        grown = _rss() - before
    per = grown / v.posts
    detail = (f"{v.posts} posts of {size} B in {elapsed:.1f} s: RSS grew {grown / 1024:.0f} KiB "
              f"({per:.3f} B/post)")
    # Bounded, not leaking: under 1 B per post (the pyverbs 44 leak was 64), or under 2 MiB in all.
    return (PASS if per < 1.0 or grown < 2 << 20 else FAIL), detail


def step_stale_rkey(v: Validation) -> tuple[str, str]:
    from mpcomm.errors import PermissionDeniedError

    with v.pair() as (target, init):
        region = target.allocate(1 << 16, "kv")
        remote = init.open(target.address, "kv")
        assert init.write(b"x" * 64, remote).result(10) == 64
        target.unregister(region)
        t0 = time.monotonic()
        try:
            init.write(b"y" * 64, remote).result(10)
        except PermissionDeniedError as exc:
            ok = "REM_ACCESS_ERR" in str(exc)
            return (PASS if ok else WARN), f"refused in {_fmt(time.monotonic() - t0)}: {exc}"
        except Exception as exc:  # noqa: BLE001
            return FAIL, f"expected a remote access error, got {type(exc).__name__}: {exc}"
        return FAIL, "a write through an unregistered region's rkey succeeded"


def step_killed_peer(v: Validation) -> tuple[str, str]:
    if v.in_process_only:
        raise _Skip("the simulated adapter cannot span two processes")
    from mpcomm.errors import PeerConnectionError, TransferTimeout
    from mpcomm.testing.kit import TargetProcess

    deadline = 10.0
    e = v.engine()
    target = TargetProcess(v.transport, config=v.config(), regions={"big": [64 << 20, "allocate"]},
                           autoload=v.autoload)
    try:
        remote = e.open(target.address, "big")
        src = e.allocate(64 << 20)
        assert e.write(src, remote).result(30) == 64 << 20
        grace = e.config.runtime.abort_grace_ms / 1000
        box: list[Any] = []

        def pump() -> None:
            while True:
                t0 = time.monotonic()
                try:
                    e.write(src, remote, timeout=deadline).result(deadline + grace + 10)
                except BaseException as exc:  # noqa: BLE001
                    box.append((exc, time.monotonic() - t0))
                    return

        th = threading.Thread(target=pump, daemon=True)
        th.start()
        time.sleep(0.2)
        target.kill()
        th.join(deadline + grace + 15)
        if not box:
            return FAIL, "a write to a killed peer did not end"
        exc, took = box[0]
        if isinstance(exc, PeerConnectionError) and "RETRY_EXC" in str(exc) and took <= deadline + grace:
            return PASS, f"retry-exceeded after {took:.2f} s (deadline {deadline:.0f} s): {exc}"
        if isinstance(exc, (PeerConnectionError, TransferTimeout)) and took <= deadline + grace:
            return WARN, (f"{type(exc).__name__} after {took:.2f} s, not retry-exceeded "
                          f"(ack_timeout/retry_count too long for the deadline?): {exc}")
        return FAIL, f"{type(exc).__name__} after {took:.2f} s (deadline {deadline:.0f} s): {exc}"
    finally:
        target.kill()
        e.close()


def step_cancel(v: Validation) -> tuple[str, str]:
    size = v.cancel_size
    why = _pin_limit(2 * size) if v.transport == "rdma_zerocopy" else ""
    if why:
        raise _Skip(why)
    with v.pair() as (target, init):
        region = target.allocate(size, "big")
        remote = init.open(target.address, "big")
        src = init.allocate(size)
        ctypes.memset(src.address, 0xA5, size)
        t = init.write(src, remote)
        time.sleep(0.002)
        t0 = time.monotonic()
        ok = t.cancel(timeout=10)
        took = time.monotonic() - t0
        if not ok:
            if t.done() and t.exception(0) is None:
                return WARN, f"the write finished before it could be cancelled ({size} bytes is too small here)"
            return FAIL, f"cancel() returned False after {took:.3f} s: {t.exception(0) if t.done() else 'not done'}"
        snap = _digest(region)
        time.sleep(0.5)
        if _digest(region) != snap:
            return FAIL, "bytes landed after cancel() returned"
        landed = sum(1 for off in range(0, size, 1 << 20) if region.view[off] == 0xA5)
        assert init.write(b"after", remote).result(10) == 5
        if bytes(region.view[:5]) != b"after":
            return FAIL, "the link did not recover: the next write did not land"
        return PASS, (f"cancelled in {_fmt(took)} with {landed} of {size >> 20} MiB started; "
                      "no late bytes; the next write landed")


def step_idle(v: Validation) -> tuple[str, str]:
    from mpcomm.cli.records import self_cpu

    with v.pair() as (target, init):
        target.allocate(1 << 16, "kv")
        remote = init.open(target.address, "kv")
        init.write(b"w", remote).result(10)
        time.sleep(0.2)
        c0, t0 = self_cpu(), time.monotonic()
        time.sleep(v.idle_seconds)
        cores = (self_cpu() - c0) / (time.monotonic() - t0)  # both engines' threads, idle

        def lat(pause: float, n: int) -> float:
            out = []
            for _ in range(n):
                if pause:
                    time.sleep(pause)
                s = time.perf_counter()
                init.write(b"x" * 64, remote).result(10)
                out.append(time.perf_counter() - s)
            return statistics.median(out)

        hot = lat(0.0, 500)
        cold = lat(0.01, 100)
    verdict = PASS if cores < 0.02 else WARN
    detail = (f"idle CPU {cores:.4f} cores (two engines); 64 B write p50 {_fmt(hot)} back-to-back, "
              f"{_fmt(cold)} after 10 ms idle")
    if cold > hot + 0.001:
        verdict, detail = WARN, detail + " (a wake-up costs over 1 ms: polling fallback?)"
    return verdict, detail


def _pin_limit(size: int) -> str:
    """Why ``size`` bytes cannot be pinned here ("" when they can)."""
    import resource

    from .transport import holds_ipc_lock

    soft = resource.getrlimit(resource.RLIMIT_MEMLOCK)[0]
    if soft == resource.RLIM_INFINITY or soft >= size or holds_ipc_lock():
        return ""
    return f"RLIMIT_MEMLOCK is {soft} bytes, below the {size} to register (ulimit -l unlimited)"


def step_register(v: Validation) -> tuple[str, str]:
    size = v.register_size
    page = mmap.PAGESIZE
    why = _pin_limit(size) if v.transport == "rdma_zerocopy" else ""
    if why:
        raise _Skip(why)
    e = v.engine()
    try:
        dev = e.transports[v.transport].dev
        t0 = time.perf_counter()
        base = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        for off in range(0, size, page):
            base[off] = 1
        baseline = time.perf_counter() - t0
        buf = ctypes.c_char.from_buffer(base)
        addr = ctypes.addressof(buf)
        gaps: list[float] = []
        stop = threading.Event()

        def tick() -> None:  # another Python thread: how long is it kept from running?
            last = time.perf_counter()
            while not stop.is_set():
                time.sleep(0.0005)
                now = time.perf_counter()
                gaps.append(now - last)
                last = now

        th = threading.Thread(target=tick, daemon=True)
        th.start()
        time.sleep(0.02)
        t0 = time.perf_counter()
        mr = dev.reg_mr(addr, size, "rw")
        reg = time.perf_counter() - t0
        time.sleep(0.02)
        stop.set()
        th.join(2)
        t0 = time.perf_counter()
        mr.close()
        dereg = time.perf_counter() - t0
        del buf
        base.close()
    finally:
        e.close()
    from mpcomm.cli.records import format_size

    stall = max(gaps) if gaps else 0.0
    ratio = reg / baseline if baseline else float("inf")
    return PASS, (f"ibv_reg_mr of {format_size(size)} {_fmt(reg)} ({size / reg / 1e9:.2f} GB/s), dereg {_fmt(dereg)}; "
                  f"mmap+touch baseline {_fmt(baseline)}; ratio {ratio:.2f}x; another thread stalled up to "
                  f"{_fmt(stall)} (the GIL is held in ibv_reg_mr)")


def step_bench(v: Validation) -> tuple[str, str]:
    if v.in_process_only:
        raise _Skip("mpcomm bench runs its peer in a second process; the simulated adapter cannot")
    out = subprocess.run([sys.executable, "-m", "mpcomm.cli", "bench", "-t", v.transport, "--quick"],
                         capture_output=True, text=True, timeout=900)
    records = [line for line in out.stdout.splitlines() if line.startswith(f"transport={v.transport} ")]
    if out.returncode != 0 or not records:
        return FAIL, f"mpcomm bench exited {out.returncode}: {(out.stderr or out.stdout).strip()[-400:]}"
    return PASS, f"{len(records)} records; " + " | ".join(records[:3])


STEPS: list[tuple[str, str, Callable[[Validation], tuple[str, str]]]] = [
    ("device", "device open with its completion channel", step_device),
    ("conformance", "conformance kit between two processes, per link layer", step_conformance),
    ("rss", "RSS over many posts", step_rss),
    ("stale_rkey", "stale rkey gives a remote access error", step_stale_rkey),
    ("killed_peer", "killed peer gives retry-exceeded within the deadline", step_killed_peer),
    ("cancel", "cancel in flight: flush, retire, recover, no late bytes", step_cancel),
    ("idle", "idle CPU and completion wake-up latency", step_idle),
    ("register", "time to register against mmap+touch", step_register),
    ("bench", "bench matrix in the record format", step_bench),
]


def run_steps(v: Validation | None = None, only: Sequence[str] = ()) -> Iterator[StepResult]:
    """Run the steps in order (``only``: their names), yielding each result as it is known."""
    v = v or Validation()
    unknown = set(only) - {name for name, _, _ in STEPS}
    if unknown:
        raise ValueError(f"unknown step(s) {', '.join(sorted(unknown))}; steps: {', '.join(n for n, _, _ in STEPS)}")
    why = v.reason or v.gate()
    for i, (name, title, fn) in enumerate(STEPS, 1):
        if only and name not in only:
            continue
        if why:
            yield StepResult(i, name, SKIP, why)
            continue
        t0 = time.monotonic()
        try:
            verdict, detail = fn(v)
        except _Skip as exc:
            verdict, detail = SKIP, str(exc)
        except Exception as exc:  # noqa: BLE001 - a step's failure is its verdict
            verdict, detail = FAIL, f"{type(exc).__name__}: {exc}"
        yield StepResult(i, name, verdict, f"{title}: {detail}", time.monotonic() - t0)


def main(argv: Sequence[str] | None = None, echo: Callable[[str], None] = print) -> int:
    from mpcomm.cli.records import parse_size

    p = argparse.ArgumentParser(prog="python -m mpcomm.plugins.rdma_zerocopy.validate",
                                description="Hardware validation of the rdma_zerocopy transport.")
    p.add_argument("--step", action="append", default=[], help="run only these steps (repeatable)")
    p.add_argument("--posts", type=int, default=int(os.environ.get("MPCOMM_RDMA_VALIDATE_POSTS", 1_000_000)))
    p.add_argument("--register-size", default=os.environ.get("MPCOMM_RDMA_VALIDATE_REGISTER", "1GiB"))
    p.add_argument("--device", default="", help="plugins.rdma_zerocopy.device")
    args = p.parse_args(list(argv) if argv is not None else None)
    v = Validation(posts=args.posts, register_size=parse_size(args.register_size),
                   options={"device": args.device} if args.device else {})
    failed = False
    for res in run_steps(v, args.step):
        echo(res.line())
        failed |= res.verdict == FAIL
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
