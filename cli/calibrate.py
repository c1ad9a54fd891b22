"""``mpcomm topology --calibrate``: measure each running transport's bandwidth class on this node.

For every available transport (or those given with ``--transport``) a
``mpcomm serve`` target is spawned as a child process, exactly as ``mpcomm
bench`` does (:class:`~mpcomm.cli.bench.Target`), and this process writes to
it through that transport alone:

* ``--rounds`` rounds of 4 MiB writes, one in flight, for a share of the
  ``--seconds`` budget each (:func:`mpcomm.cli.bench.measure`); the median
  round's GB/s gives the class (:func:`mpcomm.calibration.classify`);
* 4 KiB writes, one at a time, for the rest of the budget: their p50 latency
  as the caller sees it (submit to result, so a request the transport
  finished on the caller's thread counts what it cost).

The result is this node's entry of the calibration file
(:func:`mpcomm.calibration.save`), which engines read at start to rank
their default route (see :mod:`mpcomm.calibration`). The measured routes are
same-host ones: the target runs on this node.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

import typer

import mpcomm
from mpcomm import calibration
from mpcomm.errors import MpcommError

from ._common import CliError, build_config, client_engine, err_console, format_rate, get_state
from .bench import Plan, installed_transports, measure, target

#: What one round writes, and what the latency probe writes.
MESSAGE_SIZE = 4 << 20
LATENCY_SIZE = 4096
#: Share of the per-transport budget the throughput rounds get (the rest: latency).
THROUGHPUT_SHARE = 0.75


def _p50_latency(eng: mpcomm.Engine, remote: mpcomm.RemoteRegion, seconds: float, max_requests: int) -> float:
    """Median caller-observed latency (s) of one-at-a-time small writes."""
    local = eng.allocate(LATENCY_SIZE)
    timeout = max(eng.config.request_timeout, 5.0)
    try:
        for _ in range(5):  # connection and route set up before the clock runs
            eng.write(local, remote, 0, LATENCY_SIZE, timeout=timeout).result(timeout + 5)
        lat: list[float] = []
        end = time.perf_counter() + seconds
        while len(lat) < max_requests:
            t0 = time.perf_counter()
            eng.write(local, remote, 0, LATENCY_SIZE, timeout=timeout).result(timeout + 5)
            t1 = time.perf_counter()
            lat.append(t1 - t0)
            if t1 >= end:
                break
    finally:
        eng.unregister(local, timeout=5.0)
    return statistics.median(lat)


def measure_transport(ctx: typer.Context, config: Path | None, name: str, info: dict[str, Any], version: str,
                      native: str, *, seconds: float, rounds: int) -> calibration.Measurement:
    """Measure ``name`` between this process and a spawned target (see the module docstring)."""
    cfg = build_config(ctx, config)
    mode = cfg.transport.mode
    plan = Plan.make(quick=True)
    plan.seconds = seconds * THROUGHPUT_SHARE / rounds
    plan.warmup = 2
    plan.max_requests = 1_000_000  # the time budget ends a round, not a request count
    with target(get_state(ctx), name, mode, 2 * MESSAGE_SIZE, None) as tgt, \
            client_engine(cfg, transports=[name]) as eng:
        remote = eng.open(tgt.address, "bench")
        per_round = []
        for i in range(rounds):
            m = measure(eng, remote, "write", MESSAGE_SIZE, 1, plan, tgt)
            if not m["throughput"]:
                raise CliError(f"{name}: round {i + 1} completed no request")
            per_round.append(m["throughput"] / 1e9)
            plan.warmup = 0  # the first round warmed the path up
        p50 = _p50_latency(eng, remote, seconds * (1 - THROUGHPUT_SHARE), plan.max_requests)
    gbps = statistics.median(per_round)
    return calibration.Measurement(
        transport=name, same_host=True, gbps=round(gbps, 4), rounds_gbps=tuple(round(r, 4) for r in per_round),
        p50_us=round(p50 * 1e6, 2), bandwidth_class=calibration.classify(gbps),
        declared_class=info["capabilities"]["bandwidth_class"], version=version, native_version=native,
        message_size=MESSAGE_SIZE, latency_size=LATENCY_SIZE, measured_at=time.time(), mode=mode)


def run(ctx: typer.Context, config: Path | None, wanted: list[str] | None, *, seconds: float,
        rounds: int) -> tuple[Path, list[calibration.Measurement], dict[str, str]]:
    """Measure, save this node's entry, and return (file, measurements, skipped transports with why)."""
    from mpcomm.registry import load_plugins

    cfg = build_config(ctx, config)
    path = calibration.calibration_path(cfg)
    found = installed_transports(ctx, config, wanted)
    entries = load_plugins().transports
    done: list[calibration.Measurement] = []
    skipped: dict[str, str] = {}
    for name, info in found.items():
        caps = info["capabilities"]
        if not caps.get("intra_node", True):
            skipped[name] = "cannot reach the same host (capabilities.intra_node is false)"
            continue
        if cfg.transport.mode not in caps.get("modes", ()):
            skipped[name] = f"does not support transport.mode {cfg.transport.mode!r}"
            continue
        entry = entries[name]
        version, native = calibration.transport_versions(entry)
        err_console.print(f"[dim]calibrating {name} ({seconds:g} s)...[/]", highlight=False, soft_wrap=True)
        try:
            m = measure_transport(ctx, config, name, info, version, native, seconds=seconds, rounds=rounds)
        except (MpcommError, CliError) as exc:
            skipped[name] = f"{type(exc).__name__}: {exc}"
            continue
        err_console.print(f"[dim]{name}: {format_rate(m.gbps * 1e9)} (rounds "
                          f"{', '.join(f'{r:.2f}' for r in m.rounds_gbps)} GB/s), p50 {m.p50_us:.1f} us "
                          f"-> {m.bandwidth_class} (declared {m.declared_class})[/]",
                          highlight=False, soft_wrap=True)
        done.append(m)
    if not done:
        reasons = "; ".join(f"{k}: {v}" for k, v in skipped.items()) or "no transport"
        raise CliError(f"nothing was measured ({reasons}); {path} is unchanged")
    calibration.save(path, calibration.Calibration(calibration.node_identity(), tuple(done), time.time(),
                                                   mpcomm.__version__))
    return path, done, skipped
