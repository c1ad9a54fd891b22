#!/usr/bin/env python3
"""A/B of the engine's request paths between two source trees, same machine, same run.

Each tree is made importable as ``mpcomm`` (core/ + plugins/ + cli/ + tent/ copied into
``<tmp>/<tag>/mpcomm``, built extensions included: build them in each checkout first).
Processes alternate A, B, B, A, ...; each one interleaves rounds of:

* ``shm_write_4k``: ``Engine.write`` 4 KiB + ``result()`` on a bound shm pair;
* ``shm_write_4k_full_path``: the same with ``route="shm"`` (a hint: the full path);
* ``shm_write_many_64x4k``: ``write_many`` of 64 x 4 KiB;
* ``tcp_write_4k``: ``Engine.write`` 4 KiB over tcp (a bound pair: posted with its cached routing);
* ``shm_first_write_4k`` / ``tcp_first_write_4k``: the first 4 KiB write + ``result()`` of a new
  pair (a fresh local region; the remote's route cached): the binding made from the route cache.

It prints the median per-request time of each and the B/A ratio. Run with
``MPCOMM_FASTLANE=0`` too, for bound pairs without the inline lane (posted with their
cached routing). Compare an A/A run (the same tree twice) to see the noise of the machine.

    python benchmarks/ab_engine_paths.py /path/to/checkout-A /path/to/checkout-B --reps 10
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def child(rounds: int, n: int) -> None:
    from array import array

    import mpcomm

    def pair(tp: str):  # type: ignore[no-untyped-def]
        tgt, ini = mpcomm.Engine(transports=[tp]), mpcomm.Engine(transports=[tp])
        tgt.allocate(1 << 20, name="kv")
        return tgt, ini, ini.open(tgt.address, "kv"), ini.allocate(1 << 20, name="src")

    shm, tcp = pair("shm"), pair("tcp")
    offs, lens = array("q", [i * 4096 for i in range(64)]), array("q", [4096] * 64)
    cases = {
        "shm_write_4k": (lambda p: p[1].write(p[3], p[2], 0, 4096).result(5), shm, n),
        "shm_write_4k_full_path": (lambda p: p[1].write(p[3], p[2], 0, 4096, route="shm").result(5), shm, n // 4),
        "shm_write_many_64x4k": (lambda p: p[1].write_many(p[3], p[2], offs, offs, lens).result(5), shm, n // 4),
        "tcp_write_4k": (lambda p: p[1].write(p[3], p[2], 0, 4096).result(5), tcp, n // 2),
    }
    firsts = {"shm_first_write_4k": shm, "tcp_first_write_4k": tcp}
    for fn, p, _ in cases.values():
        for _ in range(200):
            fn(p)
    out: dict[str, list[float]] = {k: [] for k in (*cases, *firsts)}
    for _ in range(rounds):
        for name, (fn, p, count) in cases.items():
            ts = []
            for _ in range(count):
                t0 = time.perf_counter()
                fn(p)
                ts.append(time.perf_counter() - t0)
            out[name].append(statistics.median(ts) * 1e6)
        for name, p in firsts.items():
            fresh = [p[1].allocate(8192) for _ in range(n // 8)]  # new pairs: made outside the timing
            ts = []
            for r in fresh:
                t0 = time.perf_counter()
                p[1].write(r, p[2], 0, 4096).result(5)
                ts.append(time.perf_counter() - t0)
            out[name].append(statistics.median(ts) * 1e6)
            for r in fresh:
                p[1].unregister(r)
    print(json.dumps(out))
    for p in (shm, tcp):
        p[1].close(timeout=5)
        p[0].close(timeout=5)


def snapshot(checkout: Path, dest: Path) -> None:
    pkg = dest / "mpcomm"
    shutil.copytree(checkout / "core", pkg)
    for sub in ("plugins", "cli", "tent"):
        shutil.copytree(checkout / sub, pkg / sub)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("a", type=Path, nargs="?")
    ap.add_argument("b", type=Path, nargs="?")
    ap.add_argument("--reps", type=int, default=10, help="processes per tree (alternating)")
    ap.add_argument("--child", nargs=2, type=int, metavar=("ROUNDS", "N"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(*args.child)
        return
    with tempfile.TemporaryDirectory() as tmp:
        trees = {}
        for tag, src in (("A", args.a), ("B", args.b)):
            trees[tag] = Path(tmp) / tag
            snapshot(src.resolve(), trees[tag])
        res: dict[str, dict[str, list[float]]] = {"A": {}, "B": {}}
        for i in range(args.reps):
            for tag in ("A", "B") if i % 2 == 0 else ("B", "A"):
                env = dict(os.environ, PYTHONPATH=str(trees[tag]))
                done = subprocess.run([sys.executable, __file__, "--child", "3", "2000"], env=env, cwd=tmp,
                                      capture_output=True, text=True, timeout=300, check=True)
                for k, v in json.loads(done.stdout.strip().splitlines()[-1]).items():
                    res[tag].setdefault(k, []).extend(v)
    for k in res["A"]:
        ma, mb = statistics.median(res["A"][k]), statistics.median(res["B"][k])
        print(f"{k:24s} A {ma:8.1f} us  B {mb:8.1f} us  B/A {mb / ma:.3f}")


if __name__ == "__main__":
    main()
