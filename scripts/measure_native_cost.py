"""Measure what each compiled helper saves: the same operation with the helper off and on.

``python scripts/measure_native_cost.py [--rounds 3]``: the figures behind
``mpcomm.native_helper.COST``. Each case runs in a fresh child process per
setting (the helpers are chosen once per process), against a target engine in
another child; per process the fastest twentieth of the operations is timed, and the
best of ``--rounds`` is kept (a shared machine only ever adds time). Cases:

* ``fastlane``: ``Engine.write(64 B) + result()`` on a bound shm pair with the inline
  lane off (``MPCOMM_FASTLANE=0``: the pair's requests are posted) against on. The
  engine's native module itself is required, so this figure is no ``COST`` entry;
* ``copyloop``: ``Engine.write_many`` of 256 pieces of 64 B + ``result()`` over shm
  (``MPCOMM_SHM_NATIVE=0`` against 1);
* ``ucxloop``: the same batch over ucx (``MPCOMM_UCX_NATIVE=0`` against 1);
* ``busypoll``: ``Engine.write(64 B) + result()`` over loopback tcp
  (``MPCOMM_TCP_BUSY_POLL=0`` and ``MPCOMM_TCP_NATIVE_WAITS=0`` against both 1).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import textwrap

TARGET = textwrap.dedent("""
    import json, sys, mpcomm
    e = mpcomm.Engine(transports=[sys.argv[1]])
    e.allocate(1 << 20, name="mem")
    print(json.dumps({"address": e.address}), flush=True)
    sys.stdin.read()
    e.close()
""")

CLIENT = textwrap.dedent("""
    import json, sys, time
    from array import array
    import mpcomm
    case, transport, address, n = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    with mpcomm.Engine(transports=[transport]) as e:
        r = e.open(address, "mem")
        src = e.allocate(1 << 20, name="src")
        if case in ("copyloop", "ucxloop"):
            offs = array("q", range(0, 256 * 128, 128))
            lens = array("q", [64] * 256)
            op = lambda: e.write_many(src, r, offs, offs, lens).result(10)
        else:
            op = lambda: e.write(src, r, 0, 64).result(10)
        for _ in range(min(n, 500)):
            op()
        chunk, best = max(n // 20, 1), float("inf")
        for _ in range(20):  # the fastest twentieth: preemption on a shared machine only adds time
            t0 = time.perf_counter()
            for _ in range(chunk):
                op()
            best = min(best, (time.perf_counter() - t0) / chunk)
        print(json.dumps({"us": best * 1e6}))
""")

CASES = {
    "fastlane": ("shm", 20000, {"MPCOMM_FASTLANE": "0"}),
    "copyloop": ("shm", 2000, {"MPCOMM_SHM_NATIVE": "0"}),
    "ucxloop": ("ucx", 2000, {"MPCOMM_UCX_NATIVE": "0"}),
    "busypoll": ("tcp", 3000, {"MPCOMM_TCP_BUSY_POLL": "0", "MPCOMM_TCP_NATIVE_WAITS": "0"}),
}


def run(case: str, off: bool) -> float:
    transport, n, switches = CASES[case]
    env = {**os.environ, **(switches if off else {})}
    target = subprocess.Popen([sys.executable, "-c", TARGET, transport], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True, env=env)
    try:
        address = json.loads(target.stdout.readline())["address"]
        out = subprocess.run([sys.executable, "-c", CLIENT, case, transport, address, str(n)], env=env,
                             capture_output=True, text=True, timeout=300, check=True)
        return json.loads(out.stdout.strip().splitlines()[-1])["us"]
    finally:
        target.stdin.close()
        target.wait(30)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("cases", nargs="*", default=list(CASES))
    args = ap.parse_args()
    for case in args.cases:
        on = min(run(case, False) for _ in range(args.rounds))
        off = min(run(case, True) for _ in range(args.rounds))
        print(f"{case}: with helper {on:.1f} us, without {off:.1f} us: {off / on:.2f}x", flush=True)


if __name__ == "__main__":
    main()
