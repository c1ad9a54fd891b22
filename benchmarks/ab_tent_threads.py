#!/usr/bin/env python3
"""A/B of mpcomm.tent's T-thread sync writes over tcp between installs, interleaved in one run.

The workload of ../shared/peers/te_threads.py, mpcomm only: a target process (idle, or spinning
in Python as a busy application) and an initiator whose T threads each do
``transfer_sync_write`` of 4 KiB for S seconds. Rounds alternate the order of the installs
(A B C, C B A, ...); the medians and their ratios to the first install are printed last.

Beside ops/s each run reports how the replies were read, to tell a real regression from the
machine's noise (its load moves ops/s by 2x from run to run on a shared 2-core box):

* ``drives``: result() callers that read replies on their own thread (``Conn.enter_drive``
  succeeded); ``refused``: callers that found another driver and blocked instead;
* ``handovers``: drivers that left with requests pending and nobody driving;
  ``stall_ms`` / ``stalls_over_1ms``: the time from such a hand-over to the next driver;
* ``by_reader``: replies the connection's reader thread read (every other one was driven);
* ``reader_wakeups_s``: the reader thread's context switches per second (/proc);
* ``cpu_us_op``: the initiator's CPU time per request.

``--rt`` runs both processes at SCHED_RR priority 1 (needs root): on a loaded machine that
stands in for a quiet one (idle mode only: a spinning real-time target starves its CPU).

    python benchmarks/ab_tent_threads.py old=/path/a/.venv/bin/python new=/path/b/.venv/bin/python \
        --rounds 5 --threads 8 --mode idle
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess

TARGET = r"""
import json, sys, time
from mpcomm.tent import TransferEngine
te = TransferEngine()
assert te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
addr = te.allocate_managed_buffer(64 << 20)
print(json.dumps({"port": te.get_rpc_port(), "addr": addr}), flush=True)
if sys.argv[1] == "spin":
    while True:
        pass
time.sleep(600)
"""

INITIATOR = r"""
import json, resource, sys, threading, time
from mpcomm.plugins.tcp.client import Conn
from mpcomm.tent import TransferEngine
port, raddr, T, S = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
te = TransferEngine()
assert te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
src = te.allocate_managed_buffer(T * 4096)
peer = f"127.0.0.1:{port}"
WARM = 20
for _ in range(WARM):
    assert te.transfer_sync_write(peer, src, raddr, 4096) == 0

# Counted around the connection's public drive steps (the counters are only ever bumped by the
# thread that holds the drive, or right after leaving it, so a plain dict is enough).
K = {"drives": 0, "refused": 0, "handovers": 0}
gap = {"since": None, "all": []}
conns = set()
enter, leave = Conn.enter_drive, Conn.leave_drive
def counted_enter(self, piece):
    sock = enter(self, piece)
    if sock is None:
        K["refused"] += 1
    else:
        K["drives"] += 1
        conns.add(self)
        t = gap["since"]
        if t is not None:
            gap["all"].append(time.perf_counter() - t)
            gap["since"] = None
    return sock
def counted_leave(self):
    leave(self)
    if self.pending and not self.driving and gap["since"] is None:
        K["handovers"] += 1
        gap["since"] = time.perf_counter()
Conn.enter_drive, Conn.leave_drive = counted_enter, counted_leave

def reader_switches():
    n = 0
    for t in threading.enumerate():
        if t.name.startswith("mpcomm-tcp-r") and t.native_id is not None:
            try:
                with open(f"/proc/self/task/{t.native_id}/status") as f:
                    n += sum(int(l.split()[1]) for l in f if l.startswith(("voluntary_ctxt", "nonvoluntary_ctxt")))
            except OSError:
                pass
    return n

done = [0] * T
stop = time.perf_counter() + S
def work(i):
    c = 0
    while time.perf_counter() < stop:
        assert te.transfer_sync_write(peer, src + i * 4096, raddr + i * 4096, 4096) == 0
        c += 1
    done[i] = c
ths = [threading.Thread(target=work, args=(i,)) for i in range(T)]
ru0, sw0 = resource.getrusage(resource.RUSAGE_SELF), reader_switches()
t0 = time.perf_counter()
[t.start() for t in ths]; [t.join() for t in ths]
wall = time.perf_counter() - t0
ru1, sw1 = resource.getrusage(resource.RUSAGE_SELF), reader_switches()
n = sum(done)
driven = sum(c.driven for c in conns)
gaps = gap["all"]
print(json.dumps({
    "ops": round(n / wall), **K, "by_reader": max(n + WARM - driven, 0),
    "stall_ms": round(sum(gaps) * 1e3, 1), "stalls_over_1ms": sum(g > 1e-3 for g in gaps),
    "reader_wakeups_s": round((sw1 - sw0) / wall),
    "cpu_us_op": round((ru1.ru_utime + ru1.ru_stime - ru0.ru_utime - ru0.ru_stime) / max(n, 1) * 1e6, 1),
}), flush=True)
"""


def one_run(python: str, mode: str, threads: int, seconds: float, rt: bool) -> dict:
    pre = ["chrt", "-r", "1"] if rt else []
    target = subprocess.Popen(pre + [python, "-c", TARGET, mode], stdout=subprocess.PIPE,
                              stderr=subprocess.DEVNULL, text=True)
    try:
        info = json.loads(target.stdout.readline())  # type: ignore[union-attr]
        r = subprocess.run(pre + [python, "-c", INITIATOR, str(info["port"]), str(info["addr"]), str(threads),
                                  str(seconds)], capture_output=True, text=True, timeout=120)
        lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
        return json.loads(lines[-1]) if lines else {"error": (r.stderr.strip().splitlines() or ["?"])[-1][:200]}
    finally:
        target.kill()
        target.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("installs", nargs="+", help="tag=python of a venv with mpcomm installed")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=8)
    ap.add_argument("--seconds", type=float, default=2.0)
    ap.add_argument("--mode", choices=("idle", "spin"), default="idle")
    ap.add_argument("--rt", action="store_true", help="SCHED_RR 1 for both processes (idle mode)")
    a = ap.parse_args()
    if a.rt and a.mode == "spin":
        ap.error("--rt with a spinning target starves a CPU")
    installs = [tuple(x.split("=", 1)) for x in a.installs]
    runs: dict[str, list[dict]] = {tag: [] for tag, _ in installs}
    for r in range(a.rounds):
        for tag, python in installs if r % 2 == 0 else installs[::-1]:
            res = one_run(python, a.mode, a.threads, a.seconds, a.rt)
            runs[tag].append(res)
            print(f"round {r} {tag}: {json.dumps(res)}", flush=True)
    base = statistics.median(x.get("ops", 0) for x in runs[installs[0][0]]) or 1
    for tag, _ in installs:
        ok = [x for x in runs[tag] if "ops" in x]
        if not ok:
            print(f"{tag}: no run succeeded")
            continue
        med = {k: statistics.median(x[k] for x in ok) for k in ok[0]}
        print(f"{tag}: ops/s median {med['ops']:.0f} ({med['ops'] / base:.2f}x {installs[0][0]}), runs "
              f"{[x['ops'] for x in ok]}; medians: " + ", ".join(f"{k} {v:g}" for k, v in med.items() if k != "ops"))


if __name__ == "__main__":
    main()
