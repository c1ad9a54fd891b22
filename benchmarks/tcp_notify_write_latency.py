"""Notifying 4 KiB tcp write latency: the note carried on the WRITE frame against the note sent after.

``python benchmarks/tcp_notify_write_latency.py [--size 4096] [--rounds 10] [--per-round 300]``

A target engine in a child process (tcp only; a thread there takes every notification with
``wait_notification`` so its queue never fills) and an initiator here. Rounds alternate, in the
same run, between:

* ``carried``: what the engine does now: one WRITE frame with FLAG_NOTE, one reply
  (``Transport.carries_notification``);
* ``after``: the path before it: the data frame, then, once it landed, a NOTIFY frame from one of
  the engine's notify workers (forced here by having this tcp transport answer
  ``carries_notification`` with False);
* ``plain``: the same write without a notification, for reference.

Prints the p50/p90 of each and their ratio. Absolute times depend on the machine's load;
compare the ratio of the same run.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import textwrap
import time

import mpcomm

TARGET = textwrap.dedent("""
    import sys, threading, mpcomm
    e = mpcomm.Engine({"plugins": {"tcp": {"native_server": sys.argv[1] == "1"}}}, transports=["tcp"])
    e.register(bytearray(1 << 20), name="kv")
    def drain():
        while True:
            try:
                e.wait_notification(None)
            except Exception:
                return
    threading.Thread(target=drain, daemon=True).start()
    print(e.address, flush=True)
    sys.stdin.readline()
    e.close()
""")


def _round(e: mpcomm.Engine, src: mpcomm.Region, remote: mpcomm.RemoteRegion, n: int, size: int,
           note: bool = True) -> list[float]:
    out = []
    for i in range(n):
        t0 = time.perf_counter()
        e.write(src, remote, 0, size, notify=b"note-%d" % i if note else None).result(10)
        out.append(time.perf_counter() - t0)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", type=int, default=4096)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--per-round", type=int, default=300)
    ap.add_argument("--python-server", action="store_true", help="the target serves with server.py")
    a = ap.parse_args()
    proc = subprocess.Popen([sys.executable, "-c", TARGET, "0" if a.python_server else "1"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        address = proc.stdout.readline().strip()  # type: ignore[union-attr]
        with mpcomm.Engine({"plugins": {"tcp": {"connections": 1}}}, transports=["tcp"]) as e:
            remote = e.open(address, "kv", timeout=10)
            src = e.allocate(a.size)
            tcp = e.transports["tcp"]
            carried = tcp.carries_notification
            samples: dict[str, list[float]] = {"carried": [], "after": [], "plain": []}
            for r in range(a.rounds):
                for mode in (("carried", "after", "plain") if r % 2 == 0 else ("plain", "after", "carried")):
                    tcp.carries_notification = carried if mode == "carried" else (lambda op: False)
                    _round(e, src, remote, 30, a.size, mode != "plain")  # warm-up of this mode
                    samples[mode] += _round(e, src, remote, a.per_round, a.size, mode != "plain")
            tcp.carries_notification = carried
    finally:
        proc.stdin.write("\n")  # type: ignore[union-attr]
        proc.stdin.flush()  # type: ignore[union-attr]
        proc.wait(10)
    res = {}
    for mode, xs in samples.items():
        xs.sort()
        res[mode] = (statistics.median(xs) * 1e6, xs[int(len(xs) * 0.9)] * 1e6)
        print(f"{mode:8s} {a.size} B write: p50 {res[mode][0]:7.1f} us  p90 {res[mode][1]:7.1f} us  "
              f"({len(xs)} samples)")
    print(f"carried/after p50 ratio: {res['carried'][0] / res['after'][0]:.2f}")


if __name__ == "__main__":
    main()
