"""``mpcomm bench``: the seed's benchmark matrix, between two processes.

For every chosen transport the target is a separate ``mpcomm serve``
process (spawned here, so every figure is inter-process); this process is
the initiator. Cases (``--case``, repeatable; default all but ``otel``):

* ``latency``      small messages, one in flight: p50/p99 latency
* ``throughput``   large messages, one in flight, write and read
* ``concurrency``  64 KiB writes at growing numbers in flight
* ``memory``       memory kinds: host is measured by every case above;
                   device is reported as skipped with the reason
* ``modes``        zero-copy vs copy (``transport.mode``) at 64 KiB and 4 MiB
* ``fault``        a stopped peer (SIGSTOP: how many time out, how fast) and a
                   peer killed mid-run (SIGKILL: which errors, how fast)
* ``otel``         small-message latency with observability off, metrics on,
                   traces and metrics on (``--otel-overhead`` adds it)

Each case prints one line in the seed's record format::

    transport=tcp mode=zero-copy memory=host message_size=4MiB concurrency=1 numa_binding=none
    throughput=2.41GB/s p50_latency=1.62ms p99_latency=2.10ms cpu_utilization=131% case=throughput op=write ...

``cpu_utilization`` is the CPU time of both processes (user + system,
from ``getrusage`` and ``/proc/<pid>/stat``) over the wall time, in percent
of one core.
"""

from __future__ import annotations

import json
import logging
import os
import select
import signal
import statistics
import subprocess
import sys
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
from .records import proc_cpu, self_cpu

from ._common import (
    EXIT_USAGE,
    CliError,
    ConfigOption,
    JsonOption,
    State,
    build_config,
    err_console,
    format_rate,
    format_seconds,
    format_size,
    get_state,
    handle_errors,
    print_json,
)

app = typer.Typer()


class Case(str, Enum):
    latency = "latency"
    throughput = "throughput"
    concurrency = "concurrency"
    memory = "memory"
    modes = "modes"
    fault = "fault"
    otel = "otel"


DEFAULT_CASES = [c for c in Case if c is not Case.otel]


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

    @classmethod
    def make(cls, quick: bool) -> Plan:
        if quick:
            return cls([8, 4096], [64 << 10, 1 << 20, 4 << 20], [1, 4, 16], [64 << 10, 4 << 20],
                       0.25, 2000, 8, 3)
        return cls([8, 512, 4096, 64 << 10], [64 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20],
                   [1, 2, 4, 8, 16, 32, 64], [64 << 10, 4 << 20, 64 << 20], 2.0, 100_000, 32, 10)

    @property
    def region_size(self) -> int:
        return max(max(self.throughput_sizes + self.mode_sizes) * 2, (64 << 10) * max(self.concurrency) * 2)


@dataclass
class Record:
    """One case; :meth:`line` renders the seed's record format."""

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
    status: str = "ok"  # ok | skipped | fault
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
            f"cpu_utilization={opt(self.cpu_utilization, lambda c: f'{c * 100:.0f}%')}",
            f"case={self.case}", f"op={self.op or '-'}", f"requests={self.requests}",
        ]
        if self.status != "ok":
            parts.append(f"status={self.status}")
        if self.errors:
            parts.append("errors=" + ",".join(f"{k}:{v}" for k, v in sorted(self.errors.items())))
        for k, v in self.extra.items():
            parts.append(f"{k}={format_seconds(v) if isinstance(v, float) else v}")
        if self.reason:
            parts.append(f"reason={json.dumps(self.reason)}")
        return " ".join(parts)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


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


def measure(engine: mpcomm.Engine, remote: mpcomm.RemoteRegion, op: str, size: int, concurrency: int,
            plan: Plan, tgt: Target | None, local: mpcomm.Region | None = None) -> dict[str, Any]:
    """Keep ``concurrency`` requests of ``size`` bytes in flight for the case's time budget."""
    slots = max(1, min(concurrency, remote.size // size))
    own = local is None
    if local is None:
        local = engine.allocate(size * slots)
    issue = engine.write if op == "write" else engine.read
    timeout = max(engine.config.request_timeout, 5.0)
    for i in range(min(5, slots * 2)):  # warm-up: connections, routes
        issue(local, remote, (i % slots) * size, size, local_offset=(i % slots) * size).result(timeout + 5)
    lat: list[float] = []
    pending: deque[mpcomm.Transfer] = deque()
    cpu0, tcpu0 = self_cpu(), (tgt.cpu() if tgt else 0.0)
    t0 = time.perf_counter()
    end = t0 + plan.seconds
    n = 0
    while True:
        while len(pending) < concurrency and n < plan.max_requests and time.perf_counter() < end:
            s = n % slots
            pending.append(issue(local, remote, s * size, size, local_offset=s * size, timeout=timeout))
            n += 1
        if not pending:
            break
        t = pending.popleft()
        t.result(timeout + 5)
        lat.append(t.elapsed or 0.0)
    wall = time.perf_counter() - t0
    cpu, tcpu = self_cpu() - cpu0, (tgt.cpu() if tgt else 0.0) - tcpu0
    if own:
        engine.unregister(local, timeout=5.0)
    lat.sort()
    return {
        "throughput": size * len(lat) / wall if wall > 0 else None,
        "p50_latency": _percentile(lat, 0.5),
        "p99_latency": _percentile(lat, 0.99),
        "cpu_utilization": (cpu + tcpu) / wall if wall > 0 else None,
        "requests": len(lat),
        "extra": {"cpu_initiator": f"{cpu / wall * 100:.0f}%", "cpu_target": f"{tcpu / wall * 100:.0f}%"},
    }


class Runner:
    def __init__(self, ctx: typer.Context, config: Path | None, plan: Plan, numa: int | None,
                 progress: Progress, task: Any, emit: Any) -> None:
        self.state = get_state(ctx)
        self.ctx, self.config, self.plan = ctx, config, plan
        self.cpus = _cpulist(numa) if numa is not None else None
        self.numa = f"node{numa}" if numa is not None else "none"
        self.progress, self.task, self.emit = progress, task, emit

    def cfg(self, mode: str, **runtime: Any) -> mpcomm.Config:
        return build_config(self.ctx, self.config, transport={"mode": mode}, runtime=runtime)

    def record(self, transport: str, mode: str, size: int, conc: int, case: str, op: str = "", **kw: Any) -> Record:
        rec = Record(transport, mode, "host", size, conc, self.numa, case=case, op=op, **kw)
        self.emit(rec)
        return rec

    def step(self, text: str) -> None:
        self.progress.update(self.task, description=text)

    def done(self) -> None:
        self.progress.advance(self.task)

    def run_mode(self, transport: str, mode: str, cases: list[Case]) -> None:
        p = self.plan
        with target(self.state, transport, mode, p.region_size, self.cpus) as tgt, \
                mpcomm.Engine(self.cfg(mode), transports=[transport]) as eng:
            remote = eng.open(tgt.address, "bench")
            jobs: list[tuple[str, str, int, int]] = []
            if mode == "zero-copy":
                if Case.latency in cases:
                    jobs += [("latency", op, s, 1) for s in p.latency_sizes for op in ("write", "read")]
                if Case.throughput in cases:
                    jobs += [("throughput", op, s, 1) for s in p.throughput_sizes for op in ("write", "read")]
                if Case.concurrency in cases:
                    jobs += [("concurrency", "write", 64 << 10, c) for c in p.concurrency]
            if Case.modes in cases:
                jobs += [("modes", op, s, 1) for s in p.mode_sizes for op in ("write", "read")]
            for case, op, size, conc in jobs:
                self.step(f"{transport} {mode} {case} {op} {format_size(size)} x{conc}")
                try:
                    m = measure(eng, remote, op, size, conc, p, tgt)
                    self.record(transport, mode, size, conc, case, op, **m)
                except MpcommError as exc:
                    self.record(transport, mode, size, conc, case, op, status="failed",
                                errors={exc.code: 1}, reason=str(exc))
                self.done()

    def memory_kinds(self, transport: str, caps: dict[str, Any]) -> None:
        self.step(f"{transport} memory kinds")
        kinds = caps.get("memory_kinds", [])
        if "device" not in kinds:
            reason = f"{transport} does not support device memory (capabilities.memory_kinds={','.join(kinds)})"
        else:
            reason = "mpcomm has no device-memory allocator for benchmarks yet (Engine.allocate is host memory)"
        rec = Record(transport, "zero-copy", "device", 4 << 20, 1, self.numa, case="memory", status="skipped",
                     reason=reason)
        self.emit(rec)
        self.done()

    def fault(self, transport: str) -> None:
        p = self.plan
        size = 64 << 10
        # A stopped peer: every request must time out, within its deadline plus the abort grace.
        self.step(f"{transport} fault: stopped peer")
        with target(self.state, transport, "zero-copy", p.region_size, self.cpus) as tgt, \
                mpcomm.Engine(self.cfg("zero-copy", abort_grace_ms=300), transports=[transport]) as eng:
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
                mpcomm.Engine(self.cfg("zero-copy", abort_grace_ms=300), transports=[transport]) as eng:
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
                    engines[name] = mpcomm.Engine(cfg, transports=[transport])
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
                               "overhead_p50": f"{(p50 / base - 1) * 100:+.1f}%" if base else "-",
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
    """Throughput and p50 latency against message size, one line per transport (and op)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise CliError("--plot needs matplotlib: pip install 'mpcomm[plot]'", EXIT_USAGE) from exc
    fig, (ax_t, ax_l) = plt.subplots(1, 2, figsize=(12, 4.5))
    series: dict[str, list[Record]] = {}
    for r in records:
        if r.status == "ok" and r.case in ("latency", "throughput") and r.concurrency == 1 and r.memory == "host":
            series.setdefault(f"{r.transport} {r.op}", []).append(r)
    for label, rs in sorted(series.items()):
        rs.sort(key=lambda r: r.message_size)
        xs = [r.message_size for r in rs]
        ax_t.plot(xs, [(r.throughput or 0) / 1e9 for r in rs], marker="o", label=label)
        ax_l.plot(xs, [(r.p50_latency or 0) * 1e6 for r in rs], marker="o", label=label)
    for ax, ylabel in ((ax_t, "throughput (GB/s)"), (ax_l, "p50 latency (us)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("message size (bytes)")
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
        if series:
            ax.legend()
    ax_l.set_yscale("log")
    fig.suptitle("mpcomm bench (one request in flight)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# -- the command ------------------------------------------------------------------------


def _transports(ctx: typer.Context, config: Path | None, wanted: list[str] | None) -> dict[str, dict[str, Any]]:
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
        typer.Option("--case", help="Case to run (repeatable); default: all but otel.", show_default=False),
    ] = None,
    quick: Annotated[bool, typer.Option("--quick", help="CI-sized run (fewer sizes, ~0.25 s per case).",
                                        envvar="MPCOMM_BENCH_QUICK")] = False,
    otel_overhead: Annotated[bool, typer.Option("--otel-overhead", help="Add the otel case: small-message latency "
                                                "with observability off / metrics / traces+metrics.")] = False,
    seconds: Annotated[Optional[float], typer.Option(min=0.01, help="Time budget per case (overrides --quick's).",
                                                     show_default=False)] = None,
    numa_node: Annotated[Optional[int], typer.Option(min=0, help="Bind both processes to this NUMA node's CPUs.",
                                                     show_default=False)] = None,
    plot_path: Annotated[Optional[Path], typer.Option("--plot", help="Write throughput and latency against message "
                                                      "size to this PNG (needs the 'plot' extra).", dir_okay=False,
                                                      show_default=False)] = None,
    config: ConfigOption = None,
    json_: JsonOption = False,
) -> None:
    """Run the seed's benchmark matrix against a target in a separate process; one record line per case."""
    cases = list(dict.fromkeys(case or DEFAULT_CASES))
    if otel_overhead and Case.otel not in cases:
        cases.append(Case.otel)
    if plot_path is not None:
        try:
            import matplotlib  # noqa: F401
        except ImportError as exc:
            raise CliError("--plot needs matplotlib: pip install 'mpcomm[plot]'", EXIT_USAGE) from exc
    transports = _transports(ctx, config, transport)
    plan = Plan.make(quick)
    if seconds is not None:
        plan.seconds = seconds
    records: list[Record] = []

    def emit(rec: Record) -> None:
        records.append(rec)
        if not json_:
            sys.stdout.write(rec.line() + "\n")
            sys.stdout.flush()

    total = 0
    for name, info in transports.items():
        modes = info["capabilities"]["modes"]
        p = plan
        zc = (len(p.latency_sizes) * 2 * (Case.latency in cases) + len(p.throughput_sizes) * 2 * (Case.throughput in cases)
              + len(p.concurrency) * (Case.concurrency in cases))
        total += zc + (Case.memory in cases) + 2 * (Case.fault in cases) + (Case.otel in cases)
        if Case.modes in cases:
            total += len(p.mode_sizes) * 2 * len([m for m in ("zero-copy", "copy") if m in modes])
    progress = Progress(TextColumn("{task.description:<48}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                        console=err_console, transient=True,
                        # on a terminal stdout and stderr share the screen: print records above the bar
                        redirect_stdout=sys.stdout.isatty(), redirect_stderr=False)
    with progress:
        task = progress.add_task("starting", total=total)
        runner = Runner(ctx, config, plan, numa_node, progress, task, emit)
        for name, info in transports.items():
            modes = info["capabilities"]["modes"]
            for mode in ("zero-copy", "copy"):
                wants = [c for c in cases if c in (Case.latency, Case.throughput, Case.concurrency, Case.modes)]
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
    if json_:
        print_json({"records": [r.to_dict() for r in records]})
    if plot_path is not None:
        plot(records, plot_path)
        err_console.print(f"plot written to {plot_path}")
