"""Soak: mixed sizes and operations under random faults, with every byte accounted for.

    python benchmarks/soak.py --seconds 600 [--transports tcp,shm] [--threads 2] [--json]

For each transport, two target engines in their own processes
(tests/faults/host.py): **A** takes SIGSTOP/SIGCONT (sometimes past the
deadline), region unregister + re-register, and a slow consumer (a raw tcp
client that asks for 8 MiB and does not read); **B** is SIGKILLed and
restarted on its endpoint (a new epoch). Initiator threads (``--threads`` per
target) own disjoint slots of 64 B – 8 MiB (guard gaps between them) and run
write / read / write_many on them, re-opening the region when it is refused
as stale, unknown or unreachable.

Accounting: each thread keeps what each slot must hold (the seed of its last
write reported complete, the region's fill after a re-registration or
restart, or unknown after a failed write). A read reported complete of a
known slot must match it; at the end every known slot and every guard gap is
checked on the target (sha256). ``bytes_lost`` counts bytes of requests
reported complete that are not there (must be 0), ``stray_bytes`` guard bytes
that changed (must be 0). It reports requests run, failures by error class,
bytes verified, p50/p99 latency under faults, late requests (past deadline +
abort grace + 3 s) and hangs, and the drift of VmRSS / threads / fds of the
initiator and of each target A from after warm-up to the end.

The machine this runs on matters (a loaded 2-core box stretches latencies);
the figures are for comparison within a run, not targets.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import random
import socket
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "faults"))

import mpcomm  # noqa: E402
from mpcomm.testing.patterns import pattern  # noqa: E402
from support import OP_READ, HostProcess, data_request, resources, sha  # noqa: E402

MiB = 1 << 20
SLOT_SIZES = (64, 4096, 65537, MiB, 8 * MiB)
GAP = 4096
FILL = 1111
DEADLINE = 3.0
GRACE = 1.0
SLACK = 3.0
CONFIG = {"runtime": {"abort_grace_ms": int(GRACE * 1000), "request_timeout_ms": int(DEADLINE * 1000)}}
REFRESH = (mpcomm.StaleRegionError, mpcomm.UnknownRegionError, mpcomm.PeerConnectionError, mpcomm.PermissionDeniedError,
           mpcomm.TransportUnavailable)


def layout(threads: int) -> tuple[int, list[list[tuple[int, int]]]]:
    """Region size and, per thread, its slots (offset, length) with a guard gap before each."""
    pos, per = 0, []
    for _ in range(threads):
        mine = []
        for size in SLOT_SIZES:
            pos += GAP
            mine.append((pos, size))
            pos += size
        per.append(mine)
    return pos + GAP, per


@dataclass
class Stats:
    lock: threading.Lock = field(default_factory=threading.Lock)
    requests: int = 0
    ok: int = 0
    failures: Counter = field(default_factory=Counter)
    latencies: list[float] = field(default_factory=list)
    bytes_verified: int = 0
    bytes_lost: int = 0
    stray_bytes: int = 0
    late: int = 0
    hangs: int = 0
    faults: Counter = field(default_factory=Counter)
    lost_detail: list[str] = field(default_factory=list)

    def record(self, took: float, err: BaseException | None) -> None:
        with self.lock:
            self.requests += 1
            self.latencies.append(took)
            if err is None:
                self.ok += 1
            else:
                self.failures[type(err).__name__] += 1
            if took > DEADLINE + GRACE + SLACK:
                self.late += 1

    def lost(self, n: int, what: str) -> None:
        with self.lock:
            self.bytes_lost += n
            self.lost_detail.append(what)


class Target:
    """A target process that can be replaced (restart) while threads use its address."""

    def __init__(self, transport: str, size: int, role: str) -> None:
        self.transport, self.size, self.role = transport, size, role
        self.proc = HostProcess(transport, {"kv": [size, "buffer", FILL]})
        self.address = self.proc.address
        self.lock = threading.Lock()  # one command at a time on the pipe
        self.generation = 0  # bumps on restart / re-registration

    def cmd(self, line: str, timeout: float = 60) -> str:
        with self.lock:
            return self.proc.reply(line, timeout)


class Worker(threading.Thread):
    def __init__(self, engine: mpcomm.Engine, target: Target, slots: list[tuple[int, int]], seed: int,
                 stats: Stats, stop: threading.Event) -> None:
        super().__init__(daemon=True)
        self.engine, self.target, self.slots, self.stats, self.stop = engine, target, slots, stats, stop
        self.rng = random.Random(seed)
        # What each slot must hold: ("seed", s), ("fill",), or None (unknown after a failed write).
        self.shadow: list[Any] = [("fill",)] * len(slots)
        self.remote: mpcomm.RemoteRegion | None = None
        self.region_ident: tuple[str, int] | None = None
        self.n = 0
        # The last operations on each slot, for the report of a slot that differs.
        self.history: list[list[str]] = [[] for _ in slots]

    def reopen(self) -> bool:
        try:
            r = self.engine.open(self.target.address, "kv", timeout=DEADLINE)
        except mpcomm.MpcommError as exc:
            with self.stats.lock:
                self.stats.failures[f"open:{type(exc).__name__}"] += 1
            self.remote = None
            return False
        ident = (r.epoch, r.region_id)
        if self.region_ident is not None and ident != self.region_ident:
            # A new region (re-registered or restarted target): it holds the fill everywhere,
            # since only this thread writes these slots and its old descriptor could not reach it.
            self.shadow = [("fill",)] * len(self.slots)
            for h in self.history:
                h.append(f"reopen {ident}")
        self.remote, self.region_ident = r, ident
        return True

    def expected(self, i: int) -> bytes | None:
        s = self.shadow[i]
        off, ln = self.slots[i]
        if s is None:
            return None
        if s[0] == "fill":
            return pattern(FILL, ln, start=off)
        return pattern(s[1], ln)

    def run(self) -> None:
        bufs = {ln: bytearray(ln) for _, ln in self.slots}
        while not self.stop.is_set():
            if self.remote is None and not self.reopen():
                time.sleep(0.1)
                continue
            i = self.rng.randrange(len(self.slots))
            off, ln = self.slots[i]
            kind = self.rng.choice(("write", "write", "read", "write_many"))
            self.n += 1
            seed = self.n % 250 + 1
            t0 = time.monotonic()
            err: BaseException | None = None
            try:
                if kind == "write":
                    fut: Any = self.engine.write(pattern(seed, ln), self.remote, off, timeout=DEADLINE)
                elif kind == "read":
                    fut = self.engine.read(bufs[ln], self.remote, off, timeout=DEADLINE)
                else:
                    src = pattern(seed, ln)
                    cuts = sorted({0, ln, *(self.rng.randrange(ln) for _ in range(min(7, ln - 1)))})
                    starts, lengths = cuts[:-1], [b - a for a, b in zip(cuts, cuts[1:])]
                    fut = self.engine.write_many(src, self.remote, starts, [off + s for s in starts], lengths,
                                                 timeout=DEADLINE)
                try:
                    fut.result(DEADLINE + GRACE + SLACK + 30)
                except TimeoutError as exc:
                    if not isinstance(exc, mpcomm.MpcommError):  # the wait itself gave up: a hang
                        with self.stats.lock:
                            self.stats.hangs += 1
                    raise
            except BaseException as exc:  # noqa: BLE001 - counted
                err = exc
            self.stats.record(time.monotonic() - t0, err)
            hist = self.history[i]
            hist.append(f"{kind} seed={seed} {self.region_ident} t={t0:.3f}+{time.monotonic() - t0:.3f} -> "
                        + ("ok" if err is None else f"{type(err).__name__}"
                           f"{'' if getattr(err, 'confirmed', True) else ' (unconfirmed)'}: {err}"))
            del hist[:-6]
            if kind != "read":
                self.shadow[i] = ("seed", seed) if err is None else None
            elif err is None:
                want = self.expected(i)
                if want is not None:
                    if bytes(bufs[ln]) == want:
                        with self.stats.lock:
                            self.stats.bytes_verified += ln
                    else:
                        bad = sum(a != b for a, b in zip(bufs[ln], want))
                        self.stats.lost(bad, f"read of slot {off}+{ln} on {self.target.role}: {bad} bytes differ; "
                                        f"{self.describe(i, bufs[ln])}")
            if isinstance(err, REFRESH):
                self.remote = None
            if err is not None:
                time.sleep(0.02)

    def describe(self, i: int, got: bytes | bytearray) -> str:
        """Which seed the bytes read hold (start and end), and the slot's recent history."""
        off, ln = self.slots[i]
        head = bytes(got[:16])
        seeds = [s for s in range(1, 251) if pattern(s, min(ln, 16)) == head]
        fill = pattern(FILL, min(ln, 16), start=off) == head
        return f"head matches seed {seeds or '-'}{' / fill' if fill else ''}; history: {self.history[i]}"

    def verify(self) -> None:
        """At the end, on the target: every known slot, and the guard gap before each.

        The region is looked up again first: a fault may have replaced it (a
        restart, a re-registration) after this thread's last request, and the
        new one holds the fill, not what the thread last wrote into the old one.
        """
        for _ in range(3):
            if self.reopen():
                break
            time.sleep(0.5)
        else:
            self.stats.lost_detail.append(f"{self.target.role}: the region could not be opened for the final check")
            self.stats.hangs += 1
            return
        for i, (off, ln) in enumerate(self.slots):
            want = self.expected(i)
            got = self.target.cmd(f"sha kv {off} {ln}")
            if want is not None:
                if got == sha(want):
                    self.stats.bytes_verified += ln
                else:
                    self.stats.lost(ln, f"slot {off}+{ln} on {self.target.role} ({self.shadow[i]}) differs; "
                                    f"history: {self.history[i]}")
            gap = self.target.cmd(f"sha kv {off - GAP} {GAP}")
            if gap != sha(pattern(FILL, GAP, start=off - GAP)):
                self.stats.stray_bytes += GAP
                self.stats.lost_detail.append(f"guard before {off} on {self.target.role} changed")


FAULTS = ("stop", "kill", "unregister", "slow")  # slow: tcp only (a raw data-port client)


class Faults(threading.Thread):
    def __init__(self, a: Target, b: Target, engine: mpcomm.Engine, stats: Stats, stop: threading.Event,
                 seed: int, skip: set[str] = frozenset()) -> None:  # type: ignore[assignment]
        super().__init__(daemon=True)
        self.a, self.b, self.engine, self.stats, self.stop = a, b, engine, stats, stop
        self.rng = random.Random(seed)
        self.kinds = [k for k in FAULTS if k not in skip and (k != "slow" or a.transport == "tcp")]

    def run(self) -> None:
        if not self.kinds:
            return
        order: list[str] = []
        while not self.stop.wait(self.rng.uniform(1.0, 2.5)):
            if not order:  # every kind once per round, in a random order: a short run sees each
                order = self.rng.sample(self.kinds, len(self.kinds))
            kind = order.pop()
            try:
                getattr(self, f"fault_{kind}")()
                self.stats.faults[kind] += 1
            except Exception as exc:  # noqa: BLE001 - a fault that could not be applied is reported
                self.stats.faults[f"{kind} failed: {type(exc).__name__}"] += 1

    def fault_stop(self) -> None:
        self.a.proc.stop()
        try:
            self.stop.wait(self.rng.choice((0.3, 1.0, DEADLINE + 0.5)))
        finally:
            self.a.proc.cont()

    def fault_kill(self) -> None:
        with self.b.lock:
            self.b.proc = self.b.proc.restart()
            self.b.generation += 1

    def fault_unregister(self) -> None:
        reply = self.a.cmd("unregister kv 5")
        if not reply.startswith("ok"):
            raise RuntimeError(reply)
        reply = self.a.cmd(f"register kv {self.a.size} buffer {FILL}")
        if reply != "ok":
            raise RuntimeError(reply)
        self.a.generation += 1

    def fault_slow(self) -> None:
        """A raw client asks for 8 MiB over the tcp data port and reads nothing for 1.5 s."""
        from mpcomm.peer import parse_endpoint

        r = self.engine.open(self.a.address, "kv", timeout=DEADLINE)
        host, _ = parse_endpoint(self.a.address)
        head = data_request(r, OP_READ, 0, 8 * MiB, time.time() + DEADLINE)
        with socket.create_connection((host, int(self.a.proc.transport_info["tcp"]["port"])), timeout=5) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            s.sendall(head)
            self.stop.wait(1.5)


def percentile(xs: list[float], q: float) -> float:
    if not xs:
        return 0.0
    ys = sorted(xs)
    return ys[min(len(ys) - 1, int(q * len(ys)))]


def drift(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {k: after[k] - before[k] for k in before}


def trim_heap() -> None:
    """Hand freed heap pages back to the kernel (glibc), so VmRSS shows what is live.

    The soak allocates and frees up to 8 MiB per request on many threads; glibc
    keeps such memory in per-thread arenas, which reads as growth that no
    leak explains (and differs with what ran before in the same process).
    """
    gc.collect()
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: RSS includes the allocator's cache
        pass


def settle(pid: int, base: dict[str, int], within: float = 2.0) -> dict[str, int]:
    """Resources once transient threads and connections have gone (or ``within`` passed)."""
    end = time.monotonic() + within
    while True:
        if pid == os.getpid():
            trim_heap()
        else:
            gc.collect()
        now = resources(pid)
        if (now["threads"] <= base["threads"] and now["fds"] <= base["fds"]) or time.monotonic() > end:
            return now
        time.sleep(0.25)


def run_soak(seconds: float, transports: list[str], threads: int = 2, seed: int = 1,
             skip_faults: dict[str, set[str]] | None = None) -> dict[str, Any]:
    """Run the soak; ``skip_faults`` leaves fault kinds out per transport (a known gap tested elsewhere)."""
    size, per = layout(threads)
    stats = Stats()
    stop = threading.Event()
    setups = []
    try:
        for name in transports:
            engine = mpcomm.Engine(CONFIG, transports=[name])
            a, b = Target(name, size, f"{name}/A"), Target(name, size, f"{name}/B")
            workers = [Worker(engine, t, per[k], seed * 100 + 10 * j + k, stats, stop)
                       for j, t in enumerate((a, b)) for k in range(threads)]
            skip = (skip_faults or {}).get(name, set())
            setups.append((name, engine, a, b, workers, Faults(a, b, engine, stats, stop, seed + len(setups), skip)))
        # Warm-up without faults, then the baselines.
        for *_, workers, _f in setups:
            for w in workers:
                w.start()
        time.sleep(min(2.0, seconds / 5))
        trim_heap()
        base_self = resources(os.getpid())
        own_threads = sum(w.is_alive() for *_, workers, _f in setups for w in workers)
        base_a = {name: resources(a.proc.pid) for name, _e, a, *_ in setups}
        t_start = time.monotonic()
        for *_, faults in setups:
            faults.start()
        trace: list[int] = []  # the initiator's VmRSS every 5 s: a plateau or a slope
        end = time.monotonic() + seconds
        while not stop.wait(min(5.0, max(0.0, end - time.monotonic()))):
            trace.append(resources(os.getpid())["rss"] >> 20)
            if time.monotonic() >= end:
                break
        stop.set()
        for *_, workers, faults in setups:
            faults.join(DEADLINE + 30)
            for w in workers:
                w.join(DEADLINE + GRACE + SLACK + 40)
                if w.is_alive():
                    stats.hangs += 1
        elapsed = time.monotonic() - t_start
        for *_, workers, _f in setups:
            for w in workers:
                if not w.is_alive():
                    w.verify()
        targets_drift = {name: drift(base_a[name], settle(a.proc.pid, base_a[name])) for name, _e, a, *_ in setups}
        # The soak's own worker threads were running at the baseline and have ended: count them back.
        base_self["threads"] -= own_threads - sum(w.is_alive() for *_, workers, _f in setups for w in workers)
        initiator_drift = drift(base_self, settle(os.getpid(), base_self))
    finally:
        stop.set()
        for _name, engine, a, b, _w, _f in setups:
            engine.close()
            a.proc.close()
            b.proc.close()
    return {
        "seconds": round(elapsed, 1),
        "transports": transports,
        "faults_skipped": {k: sorted(v) for k, v in (skip_faults or {}).items()},
        "threads_per_target": threads,
        "requests": stats.requests,
        "completed": stats.ok,
        "failures": dict(stats.failures.most_common()),
        "faults": dict(stats.faults),
        "bytes_verified": stats.bytes_verified,
        "bytes_lost": stats.bytes_lost,
        "stray_bytes": stats.stray_bytes,
        "lost_detail": stats.lost_detail[:20],
        "late": stats.late,
        "hangs": stats.hangs,
        "p50_ms": round(percentile(stats.latencies, 0.50) * 1000, 2),
        "p99_ms": round(percentile(stats.latencies, 0.99) * 1000, 2),
        "max_ms": round(max(stats.latencies, default=0) * 1000, 2),
        "initiator_rss_mib_every_5s": trace,
        "drift": {"initiator": initiator_drift, **{f"target {n}/A": d for n, d in targets_drift.items()}},
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seconds", type=float, default=float(os.environ.get("MPCOMM_SOAK_SECONDS", "300")))
    p.add_argument("--transports", default="tcp,shm")
    p.add_argument("--threads", type=int, default=2, help="initiator threads per target")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--skip", action="append", default=[], metavar="TRANSPORT:FAULT",
                   help=f"leave a fault out for one transport (faults: {', '.join(FAULTS)}), e.g. ucx:unregister")
    p.add_argument("--json", action="store_true", help="one JSON object instead of the summary")
    a = p.parse_args(argv)
    skip: dict[str, set[str]] = {}
    for item in a.skip:
        name, _, fault = item.partition(":")
        skip.setdefault(name, set()).add(fault)
    report = run_soak(a.seconds, [t for t in a.transports.split(",") if t], a.threads, a.seed, skip)
    if a.json:
        print(json.dumps(report))
    else:
        for k, v in report.items():
            print(f"{k:>20}: {v}")
    return 0 if report["bytes_lost"] == 0 and report["stray_bytes"] == 0 and report["hangs"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
