"""``mpcomm bench``: the seed's benchmark matrix, between two processes or two hosts.

Without ``--target``, for every chosen transport the target is a separate
``mpcomm serve`` process (spawned here, so every figure is inter-process);
this process is the initiator. With ``--target ADDRESS REGION`` the target is
a ``mpcomm serve`` started separately, on this host or another one, and only
the initiator runs here (as ``ucx_perftest``, ``nixlbench`` or Mooncake's
``tebench`` do). Cases (``--case``, repeatable; default all but ``otel`` and
``sweep``):

* ``latency``      small messages, one in flight: latency percentiles
* ``throughput``   large messages, one in flight, write and read
* ``concurrency``  64 KiB writes at growing numbers in flight
* ``memory``       memory kinds (``--memory``): host->host, host->cuda,
                   cuda->host, cuda->cuda against a device target on the
                   same GPU (``memory=LOCAL->REMOTE``); each pair a transport
                   cannot move here is skipped with the reason
* ``modes``        zero-copy vs copy (``transport.mode``) at 64 KiB and 4 MiB
* ``fault``        a stopped peer (SIGSTOP: how many time out, how fast) and a
                   peer killed mid-run (SIGKILL: which errors, how fast)
* ``otel``         small-message latency with observability off, metrics on,
                   traces and metrics on (``--otel-overhead`` adds it)
* ``sweep``        sizes from ``--start-size`` doubling to ``--max-size``, for
                   every ``--batch`` and ``--depth``, with ``--threads``
                   initiator threads and ``--op`` write/read/mix; chosen by
                   default when any of those options is given

Each case prints one line in the seed's record format, then extra fields::

    transport=tcp mode=zero-copy memory=host message_size=4MiB concurrency=1 numa_binding=none
    throughput=2.41GB/s p50_latency=1.62ms p99_latency=2.10ms cpu_utilization=131% case=throughput op=write ...

``--json`` prints the same records as JSON Lines (one object per line, as
they are measured) with plain numbers: bytes, bytes/s, seconds, fractions.
``cpu_utilization`` is the CPU time of both processes (user + system, from
``getrusage`` and ``/proc/<pid>/stat``) over the wall time, in percent of one
core; with ``--target`` the target's CPU is not visible and it is the
initiator's alone (``cpu_target`` is absent).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import os
import select
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter, deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from enum import Enum
from pathlib import Path
from typing import Annotated, Any, Optional

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

import mpcomm
from mpcomm.errors import MpcommError
from mpcomm.peer import parse_endpoint
from mpcomm.telemetry import operation_span

from . import bench_device
from ._common import (
    EXIT_USAGE,
    EXIT_VERIFY,
    CliError,
    ConfigOption,
    EndpointOption,
    State,
    build_config,
    client_engine,
    err_console,
    format_rate,
    format_seconds,
    format_size,
    get_state,
    handle_errors,
    parse_size,
)
from .records import numa_binding, proc_cpu, self_cpu

app = typer.Typer()


class Case(str, Enum):
    latency = "latency"
    throughput = "throughput"
    concurrency = "concurrency"
    memory = "memory"
    modes = "modes"
    fault = "fault"
    otel = "otel"
    sweep = "sweep"


class Op(str, Enum):
    write = "write"
    read = "read"
    mix = "mix"


DEFAULT_CASES = [c for c in Case if c not in (Case.otel, Case.sweep)]
#: What a separately started target allows: no restart in copy mode, no signals to it.
REMOTE_CASES = (Case.latency, Case.throughput, Case.concurrency, Case.memory, Case.sweep)
#: Local memory per point at most: slots are reused beyond it.
LOCAL_CAP = 256 << 20


@dataclass
class Load:
    """How one point is driven: op, requests per submit, units in flight per thread, threads."""

    op: str = "write"
    batch: int = 1
    depth: int = 1
    threads: int = 1
    iterations: int | None = None  # measured requests per point (all threads), None: until the time budget
    warmup: int = 5  # units per thread before the clock starts


@dataclass
class Plan:
    latency_sizes: list[int]
    throughput_sizes: list[int]
    concurrency: list[int]
    mode_sizes: list[int]
    seconds: float  # time budget per case
    max_requests: int
    fault_requests: int
    otel_rounds: int
    sweep_sizes: list[int] = field(default_factory=list)
    sweep_batches: list[int] = field(default_factory=lambda: [1])
    sweep_depths: list[int] = field(default_factory=lambda: [1])
    sweep_op: str = "write"
    threads: int = 1
    iterations: int | None = None
    warmup: int = 5
    check_data: bool = False

    @classmethod
    def make(cls, quick: bool) -> Plan:
        if quick:
            return cls([8, 4096], [64 << 10, 1 << 20, 4 << 20], [1, 4, 16], [64 << 10, 4 << 20],
                       0.25, 2000, 8, 3, sweep_sizes=sizes_between(4096, 4 << 20))
        return cls([8, 512, 4096, 64 << 10], [64 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20],
                   [1, 2, 4, 8, 16, 32, 64], [64 << 10, 4 << 20, 64 << 20], 2.0, 100_000, 32, 10,
                   sweep_sizes=sizes_between(8, 64 << 20))

    @property
    def region_size(self) -> int:
        sweep = max(self.sweep_sizes or [0]) * min(4, self.threads * max(self.sweep_depths) * max(self.sweep_batches))
        return max(max(self.throughput_sizes + self.mode_sizes) * 2, (64 << 10) * max(self.concurrency) * 2, sweep)


def sizes_between(start: int, stop: int) -> list[int]:
    """``start``, doubling, up to and including ``stop`` (which ends the list even off the doubling)."""
    out, n = [], start
    while n < stop:
        out.append(n)
        n *= 2
    out.append(stop)
    return out


@dataclass
class Record:
    """One case; :meth:`line` renders the seed's record format, :meth:`to_dict` the JSON one."""

    transport: str
    mode: str
    memory: str
    message_size: int
    concurrency: int
    numa_binding: str
    throughput: float | None = None  # bytes/s
    p50_latency: float | None = None  # seconds
    p99_latency: float | None = None
    cpu_utilization: float | None = None  # fraction of one core, both processes
    case: str = ""
    op: str = ""
    requests: int = 0
    p90_latency: float | None = None
    p999_latency: float | None = None
    batch: int = 1
    threads: int = 1
    status: str = "ok"  # ok | skipped | fault | failed
    reason: str = ""
    errors: dict[str, int] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)

    def line(self) -> str:
        def opt(v: float | None, fmt: Any) -> str:
            return "-" if v is None else fmt(v)

        parts = [
            f"transport={self.transport}", f"mode={self.mode}", f"memory={self.memory}",
            f"message_size={format_size(self.message_size)}", f"concurrency={self.concurrency}",
            f"numa_binding={self.numa_binding}", f"throughput={opt(self.throughput, format_rate)}",
            f"p50_latency={opt(self.p50_latency, format_seconds)}",
            f"p99_latency={opt(self.p99_latency, format_seconds)}",
            f"cpu_utilization={opt(self.cpu_utilization, _percent)}",
            f"case={self.case}", f"op={self.op or '-'}", f"requests={self.requests}",
        ]
        if self.p90_latency is not None:
            parts.append(f"p90_latency={format_seconds(self.p90_latency)}")
        if self.p999_latency is not None:
            parts.append(f"p999_latency={format_seconds(self.p999_latency)}")
        if self.batch != 1 or self.threads != 1:
            parts += [f"batch={self.batch}", f"threads={self.threads}"]
        if self.status != "ok":
            parts.append(f"status={self.status}")
        if self.errors:
            parts.append("errors=" + ",".join(f"{k}:{v}" for k, v in sorted(self.errors.items())))
        for k, v in self.extra.items():
            parts.append(f"{k}={_render_extra(k, v)}")
        if self.reason:
            parts.append(f"reason={json.dumps(self.reason)}")
        return " ".join(parts)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _percent(fraction: float) -> str:
    return f"{fraction * 100:.0f}%"


def _render_extra(key: str, v: Any) -> str:
    """Extra fields are numbers in JSON; in the line, fractions read as percent and times as times."""
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        if key.startswith("cpu_") and key != "cpu_per_request":
            return _percent(v)
        if key.startswith("overhead_"):
            return f"{v * 100:+.1f}%"
        return format_seconds(v)
    return str(v)


# -- the target process -------------------------------------------------------------


def _cpulist(node: int) -> set[int]:
    try:
        text = Path(f"/sys/devices/system/node/node{node}/cpulist").read_text().strip()
    except OSError as exc:
        raise CliError(f"--numa-node {node}: no such NUMA node ({exc.strerror})", EXIT_USAGE) from exc
    cpus: set[int] = set()
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


class Target:
    """A ``mpcomm serve`` child process exposing one ``bench`` region."""

    def __init__(self, state: State, transport: str, mode: str, size: int, cpus: set[int] | None) -> None:
        cmd = [sys.executable, "-m", "mpcomm.cli"]
        if state.config_path is not None:
            cmd += ["--config", str(state.config_path)]
        cmd += ["serve", "--endpoint", "127.0.0.1:0", "--region", f"bench={size}", "--transport", transport,
                "--mode", mode, "--json"]
        env = dict(os.environ, MPCOMM_OTEL="none")
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, env=env,
            preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None,  # noqa: PLW1509
        )
        self.pid = self.proc.pid
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], 30.0)
        line = self.proc.stdout.readline() if ready else b""
        if not line:
            self.stop()
            err = self.proc.stderr.read().decode(errors="replace") if self.proc.stderr else ""
            raise CliError(f"the bench target ({transport}, {mode}) did not start: {err.strip()[-800:]}")
        info = json.loads(line)
        self.address: str = info["address"]

    def cpu(self) -> float:
        return proc_cpu(self.pid)

    def signal(self, sig: int) -> None:
        if self.proc.poll() is None:
            os.kill(self.pid, sig)
        if sig == signal.SIGSTOP:  # delivery is asynchronous: wait until it is stopped
            end = time.monotonic() + 2.0
            while time.monotonic() < end and self._state() not in ("T", "t", ""):
                time.sleep(0.001)

    def _state(self) -> str:
        try:
            with open(f"/proc/{self.pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            return ""

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        for stream in (self.proc.stdout, self.proc.stderr):
            if stream is not None:
                stream.close()


@contextmanager
def target(state: State, transport: str, mode: str, size: int, cpus: set[int] | None) -> Iterator[Target]:
    t = Target(state, transport, mode, size, cpus)
    try:
        yield t
    finally:
        t.stop()


# -- measuring --------------------------------------------------------------------


def _percentile(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return 0.0
    i = min(len(sorted_values) - 1, max(0, round(q * (len(sorted_values) - 1))))
    return sorted_values[i]


def percentiles(lat: list[float]) -> dict[str, float]:
    """p50/p90/p99/p999 of sorted latencies, as Record fields."""
    return {"p50_latency": _percentile(lat, 0.5), "p90_latency": _percentile(lat, 0.9),
            "p99_latency": _percentile(lat, 0.99), "p999_latency": _percentile(lat, 0.999)}


def measure(engine: mpcomm.Engine, remote: mpcomm.RemoteRegion, op: str, size: int, concurrency: int,
            plan: Plan, tgt: Target | None, load: Load | None = None) -> dict[str, Any]:
    """Drive one point: ``load.threads`` threads each keep ``concurrency`` units in flight
    (a unit is one request, or one ``submit`` of ``load.batch`` requests) for the
    time budget or ``load.iterations`` requests, after ``load.warmup`` units each.

    Latencies are per unit (submit to completion). Throughput counts every
    byte of every completed request over the wall time of the measured part.
    """
    load = load or Load(op=op, depth=concurrency, iterations=plan.iterations, warmup=plan.warmup)
    cap = remote.size // size  # request-sized slots in the remote region
    if cap < 1:
        raise CliError(f"message size {format_size(size)} is larger than region {remote.name!r} "
                       f"({format_size(remote.size)})")
    local_slots = max(1, min(load.threads * concurrency * load.batch, cap, LOCAL_CAP // size))
    local = engine.allocate(size * local_slots)
    mem_node = local.numa_node  # allocate() pre-faults: known where the kernel says
    timeout = max(engine.config.request_timeout, 5.0)
    ids = itertools.count()
    max_units = -(-(load.iterations or plan.max_requests) // load.batch)
    budget = itertools.count()

    def unit() -> mpcomm.Transfer:
        i = next(ids)
        kind = op if op != "mix" else ("write" if i % 2 == 0 else "read")
        first = i * load.batch
        if load.batch == 1:
            issue = engine.write if kind == "write" else engine.read
            return issue(local, remote, (first % cap) * size, size, local_offset=(first % local_slots) * size,
                         timeout=timeout)
        return engine.submit([mpcomm.Request(kind, local, remote, ((first + k) % cap) * size, size,
                                             ((first + k) % local_slots) * size, timeout=timeout)
                              for k in range(load.batch)])

    barrier = threading.Barrier(load.threads + 1)
    results: list[list[float]] = [[] for _ in range(load.threads)]
    failures: list[BaseException] = []

    def worker(tid: int) -> None:
        lat = results[tid]
        try:
            for _ in range(load.warmup):  # connections, routes, registrations
                unit().result(timeout + 5)
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            failures.append(exc)
        barrier.wait()
        if failures:
            return
        end = time.perf_counter() + plan.seconds
        pending: deque[mpcomm.Transfer] = deque()
        try:
            while True:
                while len(pending) < concurrency and time.perf_counter() < end and next(budget) < max_units:
                    pending.append(unit())
                if not pending:
                    break
                t = pending.popleft()
                t.result(timeout + 5)
                lat.append(t.elapsed or 0.0)
        except BaseException as exc:  # noqa: BLE001
            failures.append(exc)
            for t in pending:
                t.cancel(timeout=1.0)

    threads = [threading.Thread(target=worker, args=(i,), name=f"bench-{i}", daemon=True)
               for i in range(load.threads)]
    try:
        for th in threads:
            th.start()
        barrier.wait()
        cpu0, tcpu0 = self_cpu(), (tgt.cpu() if tgt else 0.0)
        t0 = time.perf_counter()
        for th in threads:
            th.join()
        wall = time.perf_counter() - t0
        cpu, tcpu = self_cpu() - cpu0, (tgt.cpu() if tgt else 0.0) - tcpu0
    finally:
        engine.unregister(local, timeout=10.0)
    if failures:
        raise failures[0]
    lat = sorted(x for r in results for x in r)
    units = len(lat)
    extra: dict[str, Any] = {"cpu_initiator": cpu / wall if wall > 0 else 0.0}
    if mem_node is not None:
        extra["numa_memory"] = f"node{mem_node}"
    if tgt is not None:
        extra["cpu_target"] = tcpu / wall if wall > 0 else 0.0
    return {
        "throughput": size * load.batch * units / wall if wall > 0 else None,
        **percentiles(lat),
        "cpu_utilization": (cpu + tcpu) / wall if wall > 0 else None,
        "requests": units * load.batch,
        "extra": extra,
    }


def _pattern(seed: str, n: int) -> bytes:
    block = hashlib.sha256(seed.encode()).digest() * 2048  # 64 KiB
    return (block * (n // len(block) + 1))[:n]


def check_data(engine: mpcomm.Engine, remote: mpcomm.RemoteRegion, size: int, slots: int = 4) -> bool:
    """Write a pattern to ``slots`` request-sized slots, read it back into fresh memory, compare."""
    slots = max(1, min(slots, remote.size // size, max(1, LOCAL_CAP // size)))
    n = size * slots
    src, dst = engine.allocate(n), engine.allocate(n)
    try:
        src.view[:] = _pattern(f"mpcomm bench {size} {time.time_ns()}", n)
        timeout = max(engine.config.request_timeout, 5.0)
        for k in range(slots):
            engine.write(src, remote, k * size, size, local_offset=k * size, timeout=timeout).result(timeout + 5)
        for k in range(slots):
            engine.read(dst, remote, k * size, size, local_offset=k * size, timeout=timeout).result(timeout + 5)
        return hashlib.sha256(src.view).digest() == hashlib.sha256(dst.view).digest()
    finally:
        engine.unregister(src, timeout=5.0)
        engine.unregister(dst, timeout=5.0)


class Runner:
    def __init__(self, ctx: typer.Context, config: Path | None, plan: Plan, numa: int | None,
                 progress: Progress, task: Any, emit: Any, *, endpoint: str | None = None,
                 secret: str | None = None) -> None:
        self.state = get_state(ctx)
        self.ctx, self.config, self.plan = ctx, config, plan
        self.cpus = _cpulist(numa) if numa is not None else None
        self.numa_node = numa
        self.numa = numa_binding(numa, None) if numa is not None else "none"
        self.progress, self.task, self.emit = progress, task, emit
        self.endpoint, self.secret = endpoint, secret
        self.mismatches = 0
        #: The memory case's (local, remote) kinds (``--memory``; empty: every pair).
        self.memory_pairs: list[tuple[str, str]] = []

    def cfg(self, mode: str, **runtime: Any) -> mpcomm.Config:
        return build_config(self.ctx, self.config, transport={"mode": mode} if mode else {}, runtime=runtime)

    def engine(self, cfg: mpcomm.Config, transports: list[str] | None) -> mpcomm.Engine:
        return client_engine(cfg, endpoint=self.endpoint, secret=self.secret, transports=transports)

    def record(self, transport: str, mode: str, size: int, conc: int, case: str, op: str = "", **kw: Any) -> Record:
        binding = self.numa
        mem = (kw.get("extra") or {}).get("numa_memory")
        if self.numa_node is not None and mem is not None:
            binding = numa_binding(self.numa_node, int(mem[4:]))  # what was used, not only what was asked
        rec = Record(transport, mode, "host", size, conc, binding, case=case, op=op, **kw)
        self.emit(rec)
        return rec

    def step(self, text: str) -> None:
        self.progress.update(self.task, description=text)

    def done(self) -> None:
        self.progress.advance(self.task)

    def jobs(self, mode: str, cases: list[Case]) -> list[tuple[str, str, int, int, Load | None]]:
        """(case, op, size, in flight, load) for every measured point of ``cases``."""
        p = self.plan
        jobs: list[tuple[str, str, int, int, Load | None]] = []
        if mode == "zero-copy":
            if Case.latency in cases:
                jobs += [("latency", op, s, 1, None) for s in p.latency_sizes for op in ("write", "read")]
            if Case.throughput in cases:
                jobs += [("throughput", op, s, 1, None) for s in p.throughput_sizes for op in ("write", "read")]
            if Case.concurrency in cases:
                jobs += [("concurrency", "write", 64 << 10, c, None) for c in p.concurrency]
            if Case.sweep in cases:
                jobs += [("sweep", p.sweep_op, s, d, Load(p.sweep_op, b, d, p.threads, p.iterations, p.warmup))
                         for b in p.sweep_batches for d in p.sweep_depths for s in p.sweep_sizes]
        if Case.modes in cases:
            jobs += [("modes", op, s, 1, None) for s in p.mode_sizes for op in ("write", "read")]
        return jobs

    def run_mode(self, transport: str, mode: str, cases: list[Case]) -> None:
        p = self.plan
        with target(self.state, transport, mode, p.region_size, self.cpus) as tgt, \
                self.engine(self.cfg(mode), [transport]) as eng:
            remote = eng.open(tgt.address, "bench")
            self.run_jobs(eng, remote, transport, mode, self.jobs(mode, cases), tgt)

    def run_remote(self, address: str, region: str, transports: list[str] | None, cases: list[Case]) -> None:
        """Against a separately started ``mpcomm serve`` (``--target``): the initiator's side only."""
        with self.engine(self.cfg(""), transports) as eng:
            remote = eng.open(address, region)
            probe = eng.allocate(4096)
            first = (eng.read if remote.readable else eng.write)(probe, remote, 0, min(remote.size, 4096))
            first.result(max(eng.config.request_timeout, 5.0) + 5)
            eng.unregister(probe, timeout=5.0)
            transport, mode = first.transport or "?", eng.config.transport.mode
            err_console.print(f"[dim]target {remote.name}@{remote.address}: {format_size(remote.size)}, "
                              f"access={remote.access}, carried by {transport}[/]", highlight=False)
            self.run_jobs(eng, remote, transport, mode, self.jobs("zero-copy", cases), None)
            if Case.memory in cases:
                from . import plugins_cmd

                caps = {t["name"]: t["capabilities"] for t in plugins_cmd.collect()["transports"]}
                self.memory_kinds(transport, caps.get(transport, {}))

    def run_jobs(self, eng: mpcomm.Engine, remote: mpcomm.RemoteRegion, transport: str, mode: str,
                 jobs: list[tuple[str, str, int, int, Load | None]], tgt: Target | None) -> None:
        p = self.plan
        for case, op, size, conc, load in jobs:
            batch, threads = (load.batch, load.threads) if load else (1, 1)
            self.step(f"{transport} {mode} {case} {op} {format_size(size)} x{conc}"
                      + (f" batch {batch}" if batch > 1 else "") + (f" {threads} threads" if threads > 1 else ""))
            try:
                with operation_span("mpcomm.bench.point", {"mpcomm.case": case, "mpcomm.direction": op,
                                                           "mpcomm.size": size, "mpcomm.transport": transport}):
                    m = measure(eng, remote, op, size, conc, p, tgt, load)
                if p.check_data:
                    ok = check_data(eng, remote, size)
                    m["extra"]["verified"] = ok
                    if not ok:
                        self.mismatches += 1
                        m["status"], m["reason"] = "failed", "the bytes read back differ from those written"
                self.record(transport, mode, size, conc, case, op, batch=batch, threads=threads, **m)
            except CliError as exc:
                self.record(transport, mode, size, conc, case, op, batch=batch, threads=threads,
                            status="skipped", reason=str(exc))
            except MpcommError as exc:
                self.record(transport, mode, size, conc, case, op, batch=batch, threads=threads, status="failed",
                            errors={exc.code: 1}, reason=str(exc))
            self.done()

    def memory_kinds(self, transport: str, caps: dict[str, Any]) -> None:
        """The memory matrix (``--memory``): host/cuda on each side, or each pair skipped with the reason."""
        self.step(f"{transport} memory kinds")
        pairs = self.memory_pairs or list(bench_device.PAIRS)
        bench_device.run(transport, pairs, bench_device.emit_with(self.emit, Record, transport, self.numa))
        self.done()

    def fault(self, transport: str) -> None:
        p = self.plan
        size = 64 << 10
        # A stopped peer: every request must time out, within its deadline plus the abort grace.
        self.step(f"{transport} fault: stopped peer")
        with target(self.state, transport, "zero-copy", p.region_size, self.cpus) as tgt, \
                self.engine(self.cfg("zero-copy", abort_grace_ms=300), [transport]) as eng:
            remote = eng.open(tgt.address, "bench")
            local = eng.allocate(size * p.fault_requests)
            eng.write(local, remote, 0, size).result(10)
            quiet = _Quiet(transport)
            tgt.signal(signal.SIGSTOP)
            deadline, grace = 0.3, 0.3
            errors, lat, wall = self._against_stopped(eng, remote, local, size, deadline, deadline + grace + 2.0)
            tgt.signal(signal.SIGCONT)
            quiet.close()
            self.record(transport, "zero-copy", size, p.fault_requests, "fault_peer_stopped", "write",
                        status="fault", errors=dict(errors), requests=p.fault_requests,
                        p50_latency=_percentile(lat, 0.5), p99_latency=_percentile(lat, 0.99), throughput=None,
                        extra={"deadline": deadline, "resolved_after": wall, **quiet.extra()})
        self.done()
        # A peer killed mid-run: in-flight requests fail with a connection error, fast.
        self.step(f"{transport} fault: killed peer")
        size = 1 << 20
        with target(self.state, transport, "zero-copy", p.region_size, self.cpus) as tgt, \
                self.engine(self.cfg("zero-copy", abort_grace_ms=300), [transport]) as eng:
            remote = eng.open(tgt.address, "bench")
            conc = 4
            local = eng.allocate(size * conc)
            quiet = _Quiet(transport)
            timeout = 2.0
            pending: deque[mpcomm.Transfer] = deque()
            errors: Counter[str] = Counter()
            ok = 0
            failed_lat: list[float] = []
            kill_at = time.perf_counter() + min(0.2, p.seconds)
            killed: float | None = None
            first_fail: float | None = None
            stop_at = kill_at + 1.0
            n = 0

            def settle(t: mpcomm.Transfer) -> bool:
                """Wait for ``t``; count it as completed or by its error code."""
                nonlocal ok
                try:
                    t.result(timeout + 5)
                except MpcommError as exc:
                    errors[exc.code] += 1
                    failed_lat.append(t.elapsed or 0.0)
                    return False
                ok += 1
                return True

            while time.perf_counter() < stop_at:
                if killed is None and time.perf_counter() >= kill_at:
                    tgt.signal(signal.SIGKILL)
                    killed = time.perf_counter()
                while len(pending) < conc:
                    s = n % conc
                    n += 1
                    try:
                        pending.append(eng.write(local, remote, s * size, size, local_offset=s * size, timeout=timeout))
                    except MpcommError as exc:  # refused at submit: the peer is gone
                        errors[exc.code] += 1
                        first_fail = first_fail or time.perf_counter()
                        break
                if not pending:
                    if killed is not None and errors:
                        break
                    continue
                if not settle(pending.popleft()):
                    first_fail = first_fail or time.perf_counter()
            for t in pending:
                settle(t)
            failed_lat.sort()
            quiet.close()
            extra: dict[str, Any] = {"completed": ok, **quiet.extra()}
            if killed is not None and first_fail is not None:
                extra["detect"] = max(0.0, first_fail - killed)
            self.record(transport, "zero-copy", size, conc, "fault_peer_killed", "write", status="fault",
                        errors=dict(errors), requests=ok + sum(errors.values()),
                        p50_latency=_percentile(failed_lat, 0.5) if failed_lat else None,
                        p99_latency=_percentile(failed_lat, 0.99) if failed_lat else None, extra=extra)
        self.done()

    def _against_stopped(self, eng: mpcomm.Engine, remote: mpcomm.RemoteRegion, local: mpcomm.Region, size: int,
                         deadline: float, give_up: float) -> tuple[Counter[str], list[float], float]:
        """Issue requests from their own threads (a transport may block the submitting thread):
        each must fail within its deadline; those still unresolved after ``give_up`` count as ``hung``."""
        import concurrent.futures as cf

        def one(i: int) -> tuple[str, float]:
            t0 = time.perf_counter()
            try:
                eng.write(local, remote, i * size, size, local_offset=i * size, timeout=deadline).result(give_up)
                return "ok", time.perf_counter() - t0
            except MpcommError as exc:
                return exc.code, time.perf_counter() - t0
            except TimeoutError:
                return "hung", time.perf_counter() - t0

        n = self.plan.fault_requests
        pool = cf.ThreadPoolExecutor(n, thread_name_prefix="bench-fault")
        t0 = time.perf_counter()
        futs = [pool.submit(one, i) for i in range(n)]
        done, not_done = cf.wait(futs, timeout=give_up)
        wall = time.perf_counter() - t0
        errors: Counter[str] = Counter()
        lat = []
        for f in done:
            code, elapsed = f.result()
            errors[code] += 1
            lat.append(elapsed)
        errors["hung"] += len(not_done)
        if not errors["hung"]:
            del errors["hung"]
        pool.shutdown(wait=False)
        lat.sort()
        return errors, lat, wall

    def otel_overhead(self, transport: str) -> None:
        """Small-message write latency with observability off, metrics on, traces + metrics on (interleaved)."""
        ensure_sdk()
        p = self.plan
        settings = {"off": (False, False), "metrics": (False, True), "traces+metrics": (True, True)}
        size = 8
        samples: dict[str, list[float]] = {k: [] for k in settings}
        cpu: dict[str, float] = {k: 0.0 for k in settings}
        wall: dict[str, float] = {k: 0.0 for k in settings}
        with target(self.state, transport, "zero-copy", p.region_size, self.cpus) as tgt:
            engines = {}
            try:
                for name, (tr, mx) in settings.items():
                    cfg = self.cfg("zero-copy").with_overrides(observability={"trace_transfers": tr, "metrics": mx})
                    engines[name] = self.engine(cfg, [transport])
                remotes = {k: e.open(tgt.address, "bench") for k, e in engines.items()}
                locals_ = {k: e.allocate(4096) for k, e in engines.items()}
                sub = Plan(**{**asdict(p), "seconds": p.seconds / 2})
                for r in range(p.otel_rounds):
                    for name, eng in engines.items():
                        self.step(f"{transport} otel overhead: {name} (round {r + 1}/{p.otel_rounds})")
                        c0, t0 = self_cpu(), time.perf_counter()
                        m = measure_latencies(eng, remotes[name], locals_[name], size, sub)
                        cpu[name] += self_cpu() - c0
                        wall[name] += time.perf_counter() - t0
                        samples[name].extend(m)
            finally:
                for e in engines.values():
                    e.close()
        base = statistics.median(samples["off"]) if samples["off"] else 0.0
        for name, lat in samples.items():
            lat.sort()
            p50 = _percentile(lat, 0.5)
            mean = statistics.fmean(lat) if lat else 0.0
            self.record(transport, "zero-copy", size, 1, "otel_overhead", "write", p50_latency=p50,
                        p99_latency=_percentile(lat, 0.99), requests=len(lat),
                        throughput=size * len(lat) / sum(lat) if lat else None,
                        cpu_utilization=None,
                        extra={"otel": name, "mean_latency": mean,
                               "overhead_p50": (p50 / base - 1) if base else 0.0,
                               "cpu_per_request": cpu[name] / len(lat) if lat else 0.0})
        self.done()


def measure_latencies(eng: mpcomm.Engine, remote: mpcomm.RemoteRegion, local: mpcomm.Region, size: int,
                      plan: Plan) -> list[float]:
    end = time.perf_counter() + plan.seconds
    out = []
    for _ in range(plan.max_requests):
        t = eng.write(local, remote, 0, size)
        t.result(10)
        out.append(t.elapsed or 0.0)
        if time.perf_counter() >= end:
            break
    return out


class _Quiet(logging.Filter):
    """Counts (and hides) the engine's error logs while a fault is injected on purpose."""

    def __init__(self, transport: str) -> None:
        super().__init__()
        self.count = 0
        names = ("mpcomm.engine", "mpcomm.control", "mpcomm.transfer", f"mpcomm.transport.{transport}")
        self._loggers = [logging.getLogger(n) for n in names]
        for lg in self._loggers:
            lg.addFilter(self)

    def filter(self, record: logging.LogRecord) -> bool:
        self.count += 1
        return False

    def close(self) -> None:
        for lg in self._loggers:
            lg.removeFilter(self)

    def extra(self) -> dict[str, Any]:
        return {"engine_errors_logged": self.count} if self.count else {}


class _DropSpans:
    """A span exporter that drops everything: the SDK's cost without an exporter's."""

    def export(self, spans: Any) -> Any:
        from opentelemetry.sdk.trace.export import SpanExportResult

        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        pass

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True


def ensure_sdk() -> None:
    """Install SDK providers (dropping spans, in-memory metrics) unless some are installed already."""
    try:
        from opentelemetry.sdk.metrics import MeterProvider
        from opentelemetry.sdk.metrics.export import InMemoryMetricReader
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError as exc:
        raise CliError("the otel case needs the OpenTelemetry SDK: pip install 'mpcomm[otel]'", EXIT_USAGE) from exc
    from opentelemetry import metrics, trace

    if not isinstance(trace.get_tracer_provider(), TracerProvider):
        tp = TracerProvider()
        tp.add_span_processor(BatchSpanProcessor(_DropSpans()))  # type: ignore[arg-type]
        trace.set_tracer_provider(tp)
    if not isinstance(metrics.get_meter_provider(), MeterProvider):
        metrics.set_meter_provider(MeterProvider(metric_readers=[InMemoryMetricReader()]))


# -- plotting -------------------------------------------------------------------------


def plot(records: list[Record], path: Path) -> None:
    """Throughput (log axis) and p50/p99 latency against message size, one colour per series."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import FuncFormatter, LogLocator
    except ImportError as exc:
        raise CliError("--plot needs matplotlib: pip install 'mpcomm[plot]'", EXIT_USAGE) from exc
    fig, (ax_t, ax_l) = plt.subplots(1, 2, figsize=(13, 4.8))
    series: dict[str, list[Record]] = {}
    for r in records:
        if r.status != "ok" or r.memory != "host" or not r.throughput:
            continue
        if r.case in ("latency", "throughput") and r.concurrency == 1:
            label = f"{r.transport} {r.op}"
        elif r.case == "sweep":
            label = f"{r.transport} {r.op} depth {r.concurrency}" + (f" batch {r.batch}" if r.batch > 1 else "") \
                + (f" x{r.threads} threads" if r.threads > 1 else "")
        else:
            continue
        series.setdefault(label, []).append(r)
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, (label, rs) in enumerate(sorted(series.items())):
        rs.sort(key=lambda r: r.message_size)
        xs = [r.message_size for r in rs]
        c = colours[i % len(colours)]
        ax_t.plot(xs, [(r.throughput or 0) / 1e9 for r in rs], marker="o", color=c, label=label)
        ax_l.plot(xs, [(r.p50_latency or 0) * 1e6 for r in rs], marker="o", color=c, label=f"{label} p50")
        ax_l.plot(xs, [(r.p99_latency or 0) * 1e6 for r in rs], marker="^", linestyle="--", color=c,
                  label=f"{label} p99")
    size_fmt = FuncFormatter(lambda v, _pos: format_size(v) if v >= 1 else "")
    for ax, ylabel in ((ax_t, "throughput (GB/s, log)"), (ax_l, "latency (us, log): p50 solid, p99 dashed")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.xaxis.set_major_locator(LogLocator(base=4))
        ax.xaxis.set_major_formatter(size_fmt)
        ax.set_xlabel("message size")
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
        if series:
            ax.legend(fontsize="small")
    fig.suptitle("mpcomm bench")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# -- the command ------------------------------------------------------------------------


def installed_transports(ctx: typer.Context, config: Path | None, wanted: list[str] | None) -> dict[str, dict[str, Any]]:
    from . import plugins_cmd

    found = {t["name"]: t for t in plugins_cmd.collect()["transports"]}
    cfg = build_config(ctx, config)
    if wanted:
        unknown = [w for w in wanted if w not in found]
        if unknown:
            raise CliError(f"--transport {unknown[0]}: no such transport (found: {', '.join(found) or 'none'})",
                           EXIT_USAGE)
        missing = [w for w in wanted if not found[w]["available"]]
        if missing:
            raise CliError(f"--transport {missing[0]}: unavailable: {found[missing[0]]['reason']}", EXIT_USAGE)
        return {w: found[w] for w in wanted}
    order = [n for n in cfg.transport.order if n in found] + sorted(n for n in found if n not in cfg.transport.order)
    chosen = {n: found[n] for n in order if found[n]["available"]}
    if not chosen:
        raise CliError("no transport is available (see `mpcomm plugins`)", EXIT_USAGE)
    return chosen


def _positive(values: list[int] | None, name: str) -> list[int] | None:
    if values and any(v < 1 for v in values):
        raise CliError(f"{name} must be at least 1", EXIT_USAGE)
    return values


@app.command("bench")
@handle_errors
def bench(
    ctx: typer.Context,
    transport: Annotated[
        Optional[list[str]],
        typer.Option("--transport", "-t", help="Transport to measure (repeatable); default: every available one.",
                     show_default=False),
    ] = None,
    case: Annotated[
        Optional[list[Case]],
        typer.Option("--case", help="Case to run (repeatable); default: all but otel and sweep.",
                     show_default=False),
    ] = None,
    target_: Annotated[
        Optional[tuple[str, str]],
        typer.Option("--target", metavar="ADDRESS REGION", help="Measure against a separately started "
                     "`mpcomm serve` (this or another host) instead of spawning one: its address and a region "
                     "(give it room for --max-size x in-flight requests).", show_default=False),
    ] = None,
    secret: Annotated[Optional[str], typer.Option(help="Shared secret of the --target (HMAC handshake).",
                                                  envvar="MPCOMM_SECRET", show_default=False)] = None,
    endpoint: EndpointOption = None,
    op: Annotated[Optional[Op], typer.Option(help="sweep: write, read, or mix (alternating).",
                                             show_default=False)] = None,
    start_size: Annotated[Optional[str], typer.Option(help="sweep: first message size (default 8B; "
                                                      "--quick: 4KiB).", show_default=False)] = None,
    max_size: Annotated[Optional[str], typer.Option(help="sweep: last message size; sizes double from "
                                                    "--start-size (default 64MiB; --quick: 4MiB).",
                                                    show_default=False)] = None,
    batch: Annotated[Optional[list[int]], typer.Option(help="sweep: requests per submit() (repeatable; "
                                                       "default 1: one write()/read() each).",
                                                       show_default=False)] = None,
    depth: Annotated[Optional[list[int]], typer.Option(help="sweep: units (requests or batches) in flight per "
                                                       "thread (repeatable; default 1).", show_default=False)] = None,
    threads: Annotated[int, typer.Option(min=1, max=64, help="sweep: initiator threads, each with its own "
                                         "--depth in flight.")] = 1,
    iterations: Annotated[Optional[int], typer.Option(min=1, help="Measured requests per point (stops early "
                                                      "when the time budget ends first).", show_default=False)] = None,
    warmup: Annotated[int, typer.Option(min=0, help="Unmeasured units per thread before each point.")] = 5,
    duration: Annotated[Optional[float], typer.Option("--duration", "--seconds", min=0.01,
                                                      help="Time budget per point in seconds (default 2; "
                                                      "--quick: 0.25).", show_default=False)] = None,
    check: Annotated[bool, typer.Option("--check", help="Consistency check after every point: write a "
                                        "pattern, read it back, compare (exit 4 on a mismatch).")] = False,
    quick: Annotated[bool, typer.Option("--quick", help="CI-sized run (fewer sizes, ~0.25 s per case).",
                                        envvar="MPCOMM_BENCH_QUICK")] = False,
    otel_overhead: Annotated[bool, typer.Option("--otel-overhead", help="Add the otel case: small-message latency "
                                                "with observability off / metrics / traces+metrics.")] = False,
    numa_node: Annotated[Optional[int], typer.Option(min=0, help="Bind this process (and a spawned target) to "
                                                     "this NUMA node's CPUs.", show_default=False)] = None,
    plot_path: Annotated[Optional[Path], typer.Option("--plot", help="Write throughput and p50/p99 latency "
                                                      "against message size to this PNG (needs the 'plot' extra).",
                                                      dir_okay=False, show_default=False)] = None,
    config: ConfigOption = None,
    json_: Annotated[bool, typer.Option("--json", help="Print the records as JSON Lines on stdout.")] = False,
    memory: Annotated[Optional[list[str]], typer.Option(
        "--memory", help="memory case: the memory to move, host or cuda on both sides, or LOCAL:REMOTE "
        "(e.g. host:cuda); repeatable; default: host->host, host->cuda, cuda->host, cuda->cuda. Alone it runs "
        "only the memory case; with --case it adds it.", show_default=False)] = None,
) -> None:
    """Benchmark transports: the seed's matrix and size sweeps, against a spawned or a --target peer."""
    sweep_opts = any(v is not None for v in (op, start_size, max_size, batch, depth)) or threads > 1
    defaults = [c for c in DEFAULT_CASES if c in REMOTE_CASES] if target_ is not None else DEFAULT_CASES
    cases = list(dict.fromkeys(case or ([Case.sweep] if sweep_opts else defaults)))
    if memory and not case and not sweep_opts:
        cases = [Case.memory]  # --memory alone: just the matrix
    elif memory and Case.memory not in cases:
        cases.append(Case.memory)
    try:
        memory_pairs = bench_device.parse_pairs(memory)
    except ValueError as exc:
        raise CliError(str(exc), EXIT_USAGE) from exc
    if otel_overhead and Case.otel not in cases:
        cases.append(Case.otel)
    if plot_path is not None:
        try:
            import matplotlib  # noqa: F401
        except ImportError as exc:
            raise CliError("--plot needs matplotlib: pip install 'mpcomm[plot]'", EXIT_USAGE) from exc
    plan = Plan.make(quick)
    if duration is not None:
        plan.seconds = duration
    first, last = parse_size(start_size) if start_size else None, parse_size(max_size) if max_size else None
    if first is not None or last is not None:
        first = first or plan.sweep_sizes[0]
        last = last or max(first, plan.sweep_sizes[-1])
        if first < 1 or last < first:
            raise CliError(f"--start-size {format_size(first)} must be at least 1 byte and at most --max-size "
                           f"{format_size(last)}", EXIT_USAGE)
        plan.sweep_sizes = sizes_between(first, last)
    plan.sweep_batches = _positive(batch, "--batch") or [1]
    plan.sweep_depths = _positive(depth, "--depth") or [1]
    plan.sweep_op, plan.threads = (op.value if op else "write"), threads
    plan.iterations, plan.warmup, plan.check_data = iterations, warmup, check
    if numa_node is not None:
        os.sched_setaffinity(0, _cpulist(numa_node))

    if target_ is not None:
        address, region = target_
        try:
            parse_endpoint(address)
        except ValueError as exc:
            raise CliError(f"--target {address!r}: {exc}", EXIT_USAGE) from exc
        transports: dict[str, dict[str, Any]] = {}
        wanted_transports = transport or None
    else:
        transports = installed_transports(ctx, config, transport)
    records: list[Record] = []

    def emit(rec: Record) -> None:
        records.append(rec)
        # JSON Lines or record lines, as they are measured: a long run can be read while it goes.
        sys.stdout.write((json.dumps(rec.to_dict()) if json_ else rec.line()) + "\n")
        sys.stdout.flush()

    progress = Progress(TextColumn("{task.description:<48}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                        console=err_console, transient=True,
                        # on a terminal stdout and stderr share the screen: print records above the bar
                        redirect_stdout=sys.stdout.isatty(), redirect_stderr=False)
    with progress:
        task = progress.add_task("starting", total=None)
        runner = Runner(ctx, config, plan, numa_node, progress, task, emit, endpoint=endpoint, secret=secret)
        runner.memory_pairs = memory_pairs
        if target_ is not None:
            remote_cases = [c for c in cases if c in REMOTE_CASES]
            progress.update(task, total=len(runner.jobs("zero-copy", remote_cases)) + (Case.memory in cases))
            runner.run_remote(address, region, wanted_transports, remote_cases)
            for c in cases:
                if c not in REMOTE_CASES:
                    emit(Record("-", "-", "host", 0, 1, runner.numa, case=c.value, status="skipped",
                                reason=f"the {c.value} case restarts or signals its target: run it without --target"))
        else:
            total = 0
            for name, info in transports.items():
                modes = info["capabilities"]["modes"]
                total += len(runner.jobs("zero-copy", cases)) + (Case.memory in cases) + 2 * (Case.fault in cases) \
                    + (Case.otel in cases)
                if "copy" in modes:
                    total += len(runner.jobs("copy", cases))
            progress.update(task, total=total)
            for name, info in transports.items():
                modes = info["capabilities"]["modes"]
                for mode in ("zero-copy", "copy"):
                    wants = [c for c in cases if c in (Case.latency, Case.throughput, Case.concurrency, Case.modes,
                                                       Case.sweep)]
                    if mode == "copy":
                        wants = [c for c in wants if c is Case.modes]
                    if wants and mode in modes:
                        runner.run_mode(name, mode, wants)
                if Case.modes in cases and "copy" not in modes:
                    emit(Record(name, "copy", "host", 4 << 20, 1, runner.numa, case="modes", status="skipped",
                                reason=f"{name} has no copy mode (modes={','.join(modes)})"))
                if Case.memory in cases:
                    runner.memory_kinds(name, info["capabilities"])
                if Case.fault in cases:
                    runner.fault(name)
                if Case.otel in cases:
                    runner.otel_overhead(name)
    if plot_path is not None:
        plot(records, plot_path)
        err_console.print(f"plot written to {plot_path}")
    if runner.mismatches:
        raise CliError(f"--check: {runner.mismatches} point(s) read back different bytes", EXIT_VERIFY)
