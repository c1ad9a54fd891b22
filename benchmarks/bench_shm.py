"""shm transport benchmark: write/read, zero-copy vs copy, next to numpy.copyto.

``python benchmarks/bench_shm.py [--seconds 0.15] [--sizes 4KiB,64KiB,4MiB,64MiB]``

The target engine runs in a child process (shm + tcp) with a 64 MiB
``Engine.allocate`` region (memfd route) and a 64 MiB registered bytearray
(cross-memory-attach route). The initiator (this process) measures, for each
route, mode, direction, size and concurrency (1 and 8 in flight), and prints
one record per line in the seed's format plus ``ratio_to_memcpy=``: the
throughput divided by a single-thread ``numpy.copyto`` of the same size
measured in the same run. ``cpu_utilization`` is the initiator's CPU time per
wall-clock second (1.00 = one core busy); the target's CPU is idle (one-sided).
Latencies are per request, submit to completion. Targets are reported, not asserted.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import textwrap
import time
from typing import Any

import numpy as np

import mpcomm
from mpcomm.cli.records import format_seconds, format_size, parse_size

MiB = 1 << 20
REGION = 64 * MiB
TARGET = textwrap.dedent(f"""
    import json, os, sys
    import mpcomm
    e = mpcomm.Engine(transports=["shm", "tcp"])
    e.allocate({REGION}, name="mem")
    keep = bytearray({REGION}); e.register(keep, name="buf")
    print(json.dumps({{"address": e.address}}), flush=True)
    sys.stdin.read()
    e.close()
""")


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(len(xs) * q))]


def memcpy_baseline(size: int, seconds: float) -> tuple[float, float]:
    """Single-thread numpy.copyto: (bytes/s, p50 seconds)."""
    src = np.ones(size, dtype=np.uint8)
    dst = np.empty(size, dtype=np.uint8)
    np.copyto(dst, src)
    lat: list[float] = []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end or len(lat) < 5:
        t0 = time.perf_counter()
        np.copyto(dst, src)
        lat.append(time.perf_counter() - t0)
    return size * len(lat) / sum(lat), pct(lat, 0.5)


def run_case(engine: mpcomm.Engine, local: mpcomm.Region, remote: mpcomm.RemoteRegion, kind: str, size: int,
             conc: int, seconds: float) -> dict[str, Any]:
    op = engine.write if kind == "write" else engine.read
    for _ in range(2):  # warm: attach/map, route cache, pages
        op(local, remote, 0, size).result(30)
    lat: list[float] = []
    nbytes = 0
    cpu0, t0 = time.process_time(), time.perf_counter()
    end = t0 + seconds
    transports = set()
    while time.perf_counter() < end or len(lat) < 4 * conc:
        if conc == 1:
            s = time.perf_counter()
            t = op(local, remote, 0, size)
            t.result(30)
            lat.append(time.perf_counter() - s)
            transports.add(t.transport)
        else:
            ts = [op(local, remote, (i * size) % (REGION - size + 1), size, local_offset=(i * size) % (REGION - size + 1))
                  for i in range(conc)]
            for t in ts:
                t.result(30)
                lat.append(t.elapsed or 0.0)
                transports.add(t.transport)
        nbytes += size * conc
    wall = time.perf_counter() - t0
    cpu = time.process_time() - cpu0
    return {"throughput": nbytes / wall, "p50": pct(lat, 0.5), "p99": pct(lat, 0.99), "cpu": cpu / wall,
            "via": ",".join(sorted(transports))}


def record(**kw: Any) -> str:
    return " ".join(f"{k}={v}" for k, v in kw.items())


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seconds", type=float, default=0.15, help="measuring time per case")
    p.add_argument("--sizes", default="4KiB,64KiB,4MiB,64MiB")
    p.add_argument("--routes", default="memfd,cma")
    args = p.parse_args()
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    routes = {"memfd": "mem", "cma": "buf"}
    proc = subprocess.Popen([sys.executable, "-c", TARGET], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        address = json.loads(proc.stdout.readline())["address"]
        base = {size: memcpy_baseline(size, args.seconds) for size in sizes}
        for size in sizes:
            print(record(transport="memcpy", mode="numpy.copyto", memory="host", message_size=format_size(size),
                         concurrency=1, numa_binding="none", throughput=f"{base[size][0] / 1e9:.2f}GB/s",
                         p50_latency=format_seconds(base[size][1])), flush=True)
        results: dict[tuple[str, str, str, int, int], dict[str, Any]] = {}
        for mode in ("zero-copy", "copy"):
            with mpcomm.Engine({"transport": {"mode": mode}}, transports=["shm", "tcp"]) as e:
                local = e.allocate(REGION)
                local.view[:] = b"\x5a" * REGION
                for route in args.routes.split(","):
                    remote = e.open(address, routes[route])
                    for kind in ("write", "read"):
                        for size in sizes:
                            for conc in (1, 8):
                                r = run_case(e, local, remote, kind, size, conc, args.seconds)
                                results[(mode, route, kind, size, conc)] = r
                                print(record(transport=f"shm/{route}" if r["via"] == "shm" else r["via"], mode=mode,
                                             memory="host", op=kind, message_size=format_size(size), concurrency=conc,
                                             numa_binding="none", throughput=f"{r['throughput'] / 1e9:.2f}GB/s",
                                             p50_latency=format_seconds(r["p50"]), p99_latency=format_seconds(r["p99"]),
                                             cpu_utilization=f"{r['cpu']:.2f}cores",
                                             ratio_to_memcpy=f"{r['throughput'] / base[size][0]:.2f}"), flush=True)
                    # A batch of 64 x 4 KiB through Engine.submit (one handle).
                    reqs = [mpcomm.Request("write", local, remote, k * 4096, 4096, local_offset=k * 4096)
                            for k in range(64)]
                    e.submit(reqs).result(30)
                    lat = []
                    end = time.perf_counter() + args.seconds
                    while time.perf_counter() < end or len(lat) < 10:
                        s = time.perf_counter()
                        e.submit(reqs).result(30)
                        lat.append(time.perf_counter() - s)
                    print(record(transport=f"shm/{route}", mode=mode, memory="host", op="write",
                                 message_size="64x4KiB", concurrency=64, numa_binding="none",
                                 throughput=f"{64 * 4096 * len(lat) / sum(lat) / 1e9:.2f}GB/s",
                                 p50_latency=format_seconds(pct(lat, 0.5)), p99_latency=format_seconds(pct(lat, 0.99))), flush=True)
                    if mode == "zero-copy":
                        raw_batch(e, local, remote, route, args.seconds)
        summarize(results, base, sizes)
    finally:
        if proc.stdin:
            proc.stdin.close()
        proc.wait(10)
    return 0


def raw_batch(e: mpcomm.Engine, local: mpcomm.Region, remote: mpcomm.RemoteRegion, route: str, seconds: float) -> None:
    """What the transport itself needs for 64 x 4 KiB, without the engine's per-request work.

    Uses the mapping the transport set up (memfd: 64 memcpy calls; CMA: one
    process_vm_writev with 64 iovecs) — the cost a batched post hook in the
    core would pay.
    """
    from mpcomm.plugins.shm import _native

    shm = e.transports["shm"]
    m = shm._maps[(remote.epoch, remote.region_id)]
    pairs = [(local.address + k * 4096, m.base + k * 4096) for k in range(64)]
    lat = []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end or len(lat) < 10:
        s = time.perf_counter()
        if m.kind == "map":
            cp = _native.memcpy
            for src, dst in pairs:
                cp(dst, src, 4096)
        else:
            _native.cma_batch(True, m.pid, [(a, 4096) for a, _ in pairs], [(b, 4096) for _, b in pairs])
        lat.append(time.perf_counter() - s)
    print(record(transport=f"shm/{route}", mode="zero-copy-raw", memory="host", op="write", message_size="64x4KiB",
                 concurrency=64, numa_binding="none", throughput=f"{64 * 4096 * len(lat) / sum(lat) / 1e9:.2f}GB/s",
                 p50_latency=format_seconds(pct(lat, 0.5)), p99_latency=format_seconds(pct(lat, 0.99))), flush=True)


def summarize(results: dict[tuple[str, str, str, int, int], dict[str, Any]], base: dict[int, tuple[float, float]],
              sizes: list[int]) -> None:
    print("# targets (reported, not asserted)")
    for size in (s for s in sizes if s >= 4 * MiB):
        for route in ("memfd", "cma"):
            r1 = results.get(("zero-copy", route, "write", size, 1))
            r8 = results.get(("zero-copy", route, "write", size, 8))
            c1 = results.get(("copy", route, "write", size, 1))
            if not r1:
                continue
            print(f"# {route} write {format_size(size)}: 1 in flight {r1['throughput'] / base[size][0]:.2f}x memcpy "
                  f"(target 0.9), 8 in flight {r8['throughput'] / base[size][0]:.2f}x (target 1.2), "
                  f"zero-copy/copy {r1['throughput'] / c1['throughput']:.2f}x (target 1.3)")
    r = results.get(("zero-copy", "memfd", "write", 4096, 1))
    if r:
        print(f"# 4KiB write p50 {format_seconds(r['p50'])} (target 5us)")


if __name__ == "__main__":
    sys.exit(main())
