"""shm transport benchmark: small-request latency, batches and large copies, next to memcpy.

``python benchmarks/bench_shm.py [--rounds 3] [--seconds 0.2] [--routes memfd,cma] [--mode zero-copy]``

The target engine runs in a child process (shm only) with a 64 MiB
``Engine.allocate`` region (memfd route) and a 64 MiB registered bytearray
(cross-memory-attach route). This process is the initiator. Every round runs
every case once, the baselines included, so load on the machine hits both
sides of a ratio alike; ratios are per round, reported as median (min-max).

Cases (writes, one in flight, ``result()`` after each):

* ``w4k``: one 4 KiB write; p50 latency next to a 4 KiB ``numpy.copyto``.
* ``w4m`` / ``w64m``: one 4 MiB / 64 MiB write; throughput / single-thread
  ``numpy.copyto`` of the same size (target: ≥ 0.9 at 4 MiB).
* ``b64x4k`` / ``b1024x4k``: one ``Engine.write_many`` of 64 / 1024 pieces of
  4 KiB at scattered remote offsets. ``raw`` is the same pieces copied through
  the same mapping by the copy loop alone (one native call); ``py/req`` is
  (batch time - raw time) / pieces: the Python paid per request above the
  copies (target: ≤ 1 µs at 1024). ``xport/req`` is the same for the
  transport's share alone (``post_many`` of an ``OperationGroup``, no engine).

One record per case and round in the seed's format, then a summary. Targets
are reported, not asserted. The machine may be shared: short rounds, noisy.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import textwrap
import time
from array import array
from typing import Any

import numpy as np

import mpcomm
from mpcomm.cli.records import format_seconds, format_size

MiB = 1 << 20
KiB = 1 << 10
REGION = 64 * MiB
TARGET = textwrap.dedent(f"""
    import json, sys
    import mpcomm
    e = mpcomm.Engine(transports=["shm"])
    e.allocate({REGION}, name="mem")
    keep = bytearray({REGION}); e.register(keep, name="buf")
    print(json.dumps({{"address": e.address}}), flush=True)
    sys.stdin.read()
    e.close()
""")


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(len(xs) * q))]


def timed(fn: Any, seconds: float, min_iters: int = 5) -> list[float]:
    fn()
    lat: list[float] = []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end or len(lat) < min_iters:
        t0 = time.perf_counter()
        fn()
        lat.append(time.perf_counter() - t0)
    return lat


def memcpy_case(size: int, seconds: float) -> list[float]:
    src = np.ones(size, dtype=np.uint8)
    dst = np.empty(size, dtype=np.uint8)
    return timed(lambda: np.copyto(dst, src), seconds)


def record(**kw: Any) -> str:
    return " ".join(f"{k}={v}" for k, v in kw.items())


class Route:
    """One route's initiator state: a local region, the remote one and the transport's mapping."""

    def __init__(self, e: mpcomm.Engine, address: str, name: str, local: mpcomm.Region) -> None:
        self.e = e
        self.remote = e.open(address, name)
        self.local = local
        e.write(local, self.remote, 0, 4096).result(30)  # attach
        self.shm = e.transports["shm"]
        self.m = self.shm._maps[(self.remote.epoch, self.remote.region_id)]
        rng = np.random.default_rng(5)
        self.pieces = {}
        for n in (64, 1024):
            slots = rng.permutation(REGION // (4 * KiB))[:n]
            self.pieces[n] = (array("q", range(0, n * 4 * KiB, 4 * KiB)), array("q", (slots * 4 * KiB).tolist()),
                              array("q", [4 * KiB] * n))

    def single(self, size: int, seconds: float) -> list[float]:
        e, local, remote = self.e, self.local, self.remote
        return timed(lambda: e.write(local, remote, 0, size).result(30), seconds)

    def batch(self, n: int, seconds: float) -> list[float]:
        e, local, remote = self.e, self.local, self.remote
        lo, ro, ln = self.pieces[n]
        if hasattr(e, "write_many"):
            return timed(lambda: e.write_many(local, remote, lo, ro, ln).result(30), seconds)
        reqs = [mpcomm.Request("write", local, remote, ro[i], ln[i], local_offset=lo[i]) for i in range(n)]
        return timed(lambda: e.submit(reqs).result(30), seconds)

    def raw(self, n: int, seconds: float) -> list[float]:
        """The copies alone: one copy-loop call through the transport's own mapping."""
        lo, ro, ln = self.pieces[n]
        m, loop, la = self.m, self.shm._loop, self.local.address
        if m.kind == "map":
            return timed(lambda: loop.copy_many(m.base, ro, la, lo, ln, 0, n, 1 << 62, m.pidfd), seconds)
        return timed(lambda: loop.cma_many(m.pid, 1, la, lo, m.base, ro, ln, 0, n, 1 << 62, m.pidfd), seconds)

    def transport_only(self, n: int, seconds: float) -> list[float] | None:
        """post_many of a contract OperationGroup straight into the transport (no engine)."""
        try:
            from mpcomm.transport import OperationGroup
        except ImportError:
            return None
        lo, ro, ln = self.pieces[n]
        peer = None  # the region is attached already: post_many needs no peer

        def one() -> None:
            g = OperationGroup("write", self.local, self.remote, lo, ro, ln, time.monotonic() + 30,
                               time.time() + 30, peer)
            self.shm.post_many(g)
            if not g.done:
                raise RuntimeError(f"the group did not finish inline: {g!r}")

        try:
            return timed(one, seconds)
        except (AttributeError, TypeError, RuntimeError) as exc:
            print(f"# transport-only case skipped: {exc}", file=sys.stderr)
            return None


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seconds", type=float, default=0.2, help="measuring time per case and round")
    p.add_argument("--routes", default="memfd,cma")
    p.add_argument("--mode", default="zero-copy", choices=["zero-copy", "copy"])
    args = p.parse_args()
    names = {"memfd": "mem", "cma": "buf"}
    proc = subprocess.Popen([sys.executable, "-c", TARGET], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    rows: dict[tuple[str, str], list[dict[str, float]]] = {}
    try:
        assert proc.stdout is not None
        address = json.loads(proc.stdout.readline())["address"]
        with mpcomm.Engine({"transport": {"mode": args.mode}}, transports=["shm"]) as e:
            local = e.allocate(REGION)
            local.view[:] = b"\x5a" * REGION
            routes = {r: Route(e, address, names[r], local) for r in args.routes.split(",")}
            loop = next(iter(routes.values())).shm._loop
            print(f"# copy loop: {loop.reason}", flush=True)
            for rnd in range(args.rounds):
                base = {4 * KiB: memcpy_case(4 * KiB, args.seconds), 4 * MiB: memcpy_case(4 * MiB, args.seconds),
                        64 * MiB: memcpy_case(64 * MiB, args.seconds)}
                for size, lat in base.items():
                    print(record(round=rnd, transport="memcpy", mode="numpy.copyto", op="copy",
                                 message_size=format_size(size), concurrency=1,
                                 throughput=f"{size / statistics.median(lat) / 1e9:.2f}GB/s",
                                 p50_latency=format_seconds(pct(lat, 0.5))), flush=True)
                for rname, route in routes.items():
                    for case, size in (("w4k", 4 * KiB), ("w4m", 4 * MiB), ("w64m", 64 * MiB)):
                        lat = route.single(size, args.seconds)
                        ratio = statistics.median(base[size]) / statistics.median(lat)
                        rows.setdefault((rname, case), []).append({"p50": pct(lat, 0.5), "ratio": ratio,
                                                                   "p50_base": pct(base[size], 0.5)})
                        print(record(round=rnd, transport=f"shm/{rname}", mode=args.mode, op="write",
                                     message_size=format_size(size), concurrency=1,
                                     throughput=f"{size / statistics.median(lat) / 1e9:.2f}GB/s",
                                     p50_latency=format_seconds(pct(lat, 0.5)),
                                     p99_latency=format_seconds(pct(lat, 0.99)), ratio_to_memcpy=f"{ratio:.2f}"),
                              flush=True)
                    for n in (64, 1024):
                        lat = route.batch(n, args.seconds)
                        raw = route.raw(n, args.seconds)
                        xport = route.transport_only(n, args.seconds)
                        t_b, t_r = statistics.median(lat), statistics.median(raw)
                        row = {"gbps": n * 4 * KiB / t_b / 1e9, "p50": pct(lat, 0.5), "py_per_req": (t_b - t_r) / n,
                               "raw_gbps": n * 4 * KiB / t_r / 1e9}
                        extra = {}
                        if xport:
                            row["xport_per_req"] = (statistics.median(xport) - t_r) / n
                            extra["xport_per_req"] = format_seconds(row["xport_per_req"])
                        rows.setdefault((rname, f"b{n}x4k"), []).append(row)
                        print(record(round=rnd, transport=f"shm/{rname}", mode=args.mode, op="write_many",
                                     message_size=f"{n}x4KiB", concurrency=n,
                                     throughput=f"{row['gbps']:.2f}GB/s", p50_latency=format_seconds(row["p50"]),
                                     raw_throughput=f"{row['raw_gbps']:.2f}GB/s",
                                     py_per_req=format_seconds(row["py_per_req"]), **extra), flush=True)
        summarize(rows)
    finally:
        if proc.stdin:
            proc.stdin.close()
        proc.wait(10)
    return 0


def _med(rows: list[dict[str, float]], key: str) -> str:
    xs = [r[key] for r in rows if key in r]
    if not xs:
        return "n/a"
    return f"{statistics.median(xs):.3g} ({min(xs):.3g}-{max(xs):.3g})"


def summarize(rows: dict[tuple[str, str], list[dict[str, float]]]) -> None:
    print("# summary: median (min-max) over rounds; targets reported, not asserted")
    for (route, case), rs in sorted(rows.items()):
        if case == "w4k":
            us = [r["p50"] * 1e6 for r in rs]
            base = [r["p50_base"] * 1e6 for r in rs]
            print(f"# {route} 4KiB write p50 {statistics.median(us):.2f}us ({min(us):.2f}-{max(us):.2f}); "
                  f"4KiB memcpy p50 {statistics.median(base):.2f}us (target: <= NIXL-UCX p50, see compare.py)")
        elif case in ("w4m", "w64m"):
            print(f"# {route} {case[1:]} write / memcpy: {_med(rs, 'ratio')} (target 0.9 at 4MiB)")
        else:
            per = [r["py_per_req"] * 1e6 for r in rs]
            xp = [r["xport_per_req"] * 1e6 for r in rs if "xport_per_req" in r]
            xs = f", transport share {statistics.median(xp):.3f}us" if xp else ""
            print(f"# {route} {case}: {_med(rs, 'gbps')} GB/s (copies alone {_med(rs, 'raw_gbps')}); Python per "
                  f"request above the copies {statistics.median(per):.3f}us{xs} (target <= 1us at 1024)")


if __name__ == "__main__":
    sys.exit(main())
