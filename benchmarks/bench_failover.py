"""A healthy peer's latency while another peer fails on purpose, in one run.

    python benchmarks/bench_failover.py [--quick] [--json]

One initiator engine talks to two targets. The healthy one is a separate
process (tcp). The failing one is an engine whose tcp data port has been shut
(every connection refused: a retryable error on every path), so its paths
pause and it is quarantined (mpcomm.health). The run measures the healthy
peer's 64 KiB write latency (one request at a time) in alternating rounds (``--rounds``):

* ``baseline``: alone;
* ``with_failing_peer``: while ``--bad-threads`` threads keep sending to the
  failing peer (each request either fails after its attempts, or fails fast
  at the call once the peer is quarantined).

It prints one record per phase and the ratios ``p50_ratio`` / ``p99_ratio``
(with / baseline; 1.0 = unaffected), plus what the failing peer's requests
did (attempted vs refused fast) and the engine's health counters.
``--no-quarantine`` is the control: the same run with pausing and quarantine
off, so every request to the failing peer is really tried; ``--bad-threads 0``
measures the noise floor (both phases alike). Bounded:
``--requests`` per phase (default 3000, 600 with --quick). Timing varies with
machine load; compare ratios from the same run only.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import threading
import time

import mpcomm
from mpcomm.cli.records import format_record
from mpcomm.errors import MpcommError
from mpcomm.testing import TargetProcess

SIZE = 64 << 10


def _latencies(fn, n: int) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def _summary(lats: list[float]) -> dict[str, float]:
    s = sorted(lats)
    return {"ops": len(s), "p50_us": round(statistics.median(s) * 1e6, 1),
            "p99_us": round(s[min(len(s) - 1, int(len(s) * 0.99))] * 1e6, 1)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--requests", type=int, default=None)
    ap.add_argument("--bad-threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3, help="alternations of the two phases")
    ap.add_argument("--no-quarantine", action="store_true",
                    help="control: never pause or quarantine, so every request to the failing peer is tried")
    ap.add_argument("--backoff", type=float, default=0.002, help="seconds a failing-peer caller sleeps after a fast refusal")
    args = ap.parse_args()
    n = args.requests or (600 if args.quick else 3000)

    good = TargetProcess("tcp", regions={"dst": [SIZE, "allocate"]})
    records = []
    try:
        with mpcomm.Engine(transports=["tcp"]) as bad, mpcomm.Engine(transports=["tcp"]) as eng:
            bad.allocate(SIZE, "dst")
            g = eng.open(good.address, "dst")
            b = eng.open(bad.address, "dst")
            bad.transports["tcp"].close()  # the failing peer: its data port refuses from now on
            src = eng.allocate(SIZE)
            if args.no_quarantine:
                eng.health.policy = dataclasses.replace(eng.health.policy, pause_after=1 << 30,
                                                        quarantine_after=1 << 30)

            def healthy() -> None:
                eng.write(src, g, timeout=10).result(10)

            _latencies(healthy, min(200, n))  # warm-up
            tally = {"attempted_failed": 0, "refused_fast": 0, "succeeded": 0}
            lock = threading.Lock()

            def hammer(stop: threading.Event) -> None:
                while not stop.is_set():
                    try:
                        t = eng.write(src, b, timeout=5)
                    except MpcommError:
                        key = "refused_fast"
                    else:
                        try:
                            t.result(10)
                            key = "succeeded"
                        except MpcommError:
                            key = "attempted_failed"
                    with lock:
                        tally[key] += 1
                    if key == "refused_fast":
                        time.sleep(args.backoff)  # the error says "try again later": a real caller backs off

            # Phases alternate in rounds so that drifting machine load hits both alike.
            base_l: list[float] = []
            bad_l: list[float] = []
            per = max(1, n // args.rounds)
            for _ in range(args.rounds):
                base_l += _latencies(healthy, per)
                stop = threading.Event()
                threads = [threading.Thread(target=hammer, args=(stop,)) for _ in range(args.bad_threads)]
                for t in threads:
                    t.start()
                try:
                    time.sleep(0.1)  # let the failing peer be found out (again)
                    bad_l += _latencies(healthy, per)
                finally:
                    stop.set()
                    for t in threads:
                        t.join(30)
            base, with_bad = _summary(base_l), _summary(bad_l)
            health = eng.stats()["health"]
            records.append({"case": "baseline", **base})
            records.append({"case": "with_failing_peer", **with_bad, "bad_threads": args.bad_threads,
                            "quarantine": not args.no_quarantine, **tally})
            records.append({
                "case": "ratio",
                "p50_ratio": round(with_bad["p50_us"] / base["p50_us"], 3),
                "p99_ratio": round(with_bad["p99_us"] / base["p99_us"], 3),
                "bad_quarantined_times": health["quarantines"]["by_peer"].get(bad.address, 0),
                "bad_retries": health["retries"]["by_peer"].get(bad.address, 0),
                "good_quarantined": health["quarantines"]["by_peer"].get(good.address, 0),
            })
    finally:
        good.close()
    for r in records:
        print(json.dumps(r) if args.json else format_record(r))


if __name__ == "__main__":
    main()
