"""ucx under load: W writers, each keeping N requests of S bytes in flight, for T seconds.

    python benchmarks/soak_ucx.py [--writers 8] [--inflight 1024] [--size 65536] [--seconds 20]
                                  [--timeout 5] [--config-json '{"plugins": {"ucx": {...}}}']

The target is a second engine in a child process (this script with ``--target``). Every
request is timed from post to its done-callback; the run fails (exit status 1) when any
request took longer than its deadline plus the abort grace plus a slack for this loaded
machine, when any request failed with anything but a timeout, when a completed write is
missing from the target's memory (the last write of every slot is checked), or when the
target died. One summary line in the record format, then the verdict.
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import json
import os
import subprocess
import sys
import threading
import time
from typing import Any

SLACK = 3.0  # seconds beyond deadline + abort grace allowed on a loaded 2-core machine


def target_main(region: int) -> int:
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    import mpcomm

    with mpcomm.Engine(transports=["ucx"]) as engine:
        r = engine.allocate(region, name="soak")
        out.write(json.dumps({"address": engine.address, "pid": os.getpid()}) + "\n")
        for line in sys.stdin:
            cmd = line.split()
            if cmd and cmd[0] == "sha":
                off, ln = int(cmd[1]), int(cmd[2])
                out.write(hashlib.sha256(r.view[off : off + ln]).hexdigest() + "\n")
            elif cmd and cmd[0] == "quit":
                break
    return 0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--writers", type=int, default=8)
    ap.add_argument("--inflight", type=int, default=1024)
    ap.add_argument("--size", type=int, default=64 << 10)
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--timeout", type=float, default=5.0)
    ap.add_argument("--slots", type=int, default=1024, help="distinct target offsets per writer")
    ap.add_argument("--config-json", default="{}")
    ap.add_argument("--target", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--region", type=int, default=0, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.target:
        return target_main(a.region)

    import mpcomm
    from mpcomm.cli.records import format_rate, format_seconds, format_size

    region = a.writers * a.slots * a.size
    tgt = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--target", "--region", str(region)],
                           stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)
    hello = json.loads(tgt.stdout.readline())  # type: ignore[union-attr]
    cfg: dict[str, Any] = json.loads(a.config_json)
    rt = cfg.setdefault("runtime", {})
    rt.setdefault("queue_depth", a.writers * a.inflight)
    rt.setdefault("request_timeout_ms", int(a.timeout * 1000))
    engine = mpcomm.Engine(cfg, transports=["ucx"])
    grace = engine.config.runtime.abort_grace_ms / 1000
    bound = a.timeout + grace + SLACK
    outcomes: collections.Counter[str] = collections.Counter()
    late: list[float] = []
    lat: list[float] = []
    lock = threading.Lock()
    stop = threading.Event()
    last_ok: dict[tuple[int, int], int] = {}  # (writer, slot) -> half of the last write that completed
    busy: collections.Counter[tuple[int, int]] = collections.Counter()  # writes in flight per slot
    overlapped: set[tuple[int, int]] = set()  # slots that had two writes in flight at once: order unknown
    posted = [0]
    try:
        remote = engine.open(hello["address"], "soak")
        srcs = []
        for w in range(a.writers):
            s = engine.allocate(a.size * 2)
            s.view[:] = bytes([w + 1]) * a.size + bytes([w + 101]) * a.size
            srcs.append(s)

        def writer(w: int) -> None:
            sem = threading.Semaphore(a.inflight)
            seq = 0
            base = w * a.slots * a.size
            while not stop.is_set():
                if not sem.acquire(timeout=0.1):
                    continue
                slot, half = seq % a.slots, (seq // a.slots) % 2
                seq += 1
                t0 = time.monotonic()
                with lock:
                    posted[0] += 1
                    if busy[(w, slot)]:
                        overlapped.add((w, slot))
                    busy[(w, slot)] += 1

                def done(t: Any, t0: float = t0, slot: int = slot, half: int = half) -> None:
                    dt = time.monotonic() - t0
                    exc = t.exception()
                    with lock:
                        busy[(w, slot)] -= 1
                        lat.append(dt)
                        if dt > bound:
                            late.append(dt)
                        if exc is None:
                            outcomes["ok"] += 1
                            last_ok[(w, slot)] = half
                        else:
                            outcomes[type(exc).__name__] += 1
                            last_ok.pop((w, slot), None)  # unknown content now
                    sem.release()

                try:
                    t = engine.write(srcs[w], remote, base + slot * a.size, a.size, local_offset=half * a.size,
                                     timeout=a.timeout)
                except mpcomm.MpcommError as exc:
                    with lock:
                        posted[0] -= 1
                        busy[(w, slot)] -= 1
                        outcomes["refused:" + type(exc).__name__] += 1
                    sem.release()
                    continue
                t.add_done_callback(done)
            for _ in range(a.inflight):  # drain: every request of this writer reported
                if not sem.acquire(timeout=bound + 5):
                    with lock:
                        outcomes["never_reported"] += 1

        threads = [threading.Thread(target=writer, args=(w,), name=f"soak-writer-{w}") for w in range(a.writers)]
        t_start = time.monotonic()
        for th in threads:
            th.start()
        time.sleep(a.seconds)
        stop.set()
        for th in threads:
            th.join(bound + 30)
        wall = time.monotonic() - t_start
        hung = sum(th.is_alive() for th in threads)
        alive = tgt.poll() is None
        # The last completed write of every slot must be in the target's memory (sampled).
        wrong = 0
        checked = 0
        if alive:
            sample = [(k, v) for k, v in last_ok.items() if k not in overlapped]
            for (w, slot), half in sample[:: max(1, len(sample) // 64)]:
                off = w * a.slots * a.size + slot * a.size
                tgt.stdin.write(f"sha {off} {a.size}\n")  # type: ignore[union-attr]
                tgt.stdin.flush()  # type: ignore[union-attr]
                got = tgt.stdout.readline().strip()  # type: ignore[union-attr]
                want = hashlib.sha256(bytes([w + 1 + 100 * half]) * a.size).hexdigest()
                checked += 1
                wrong += got != want
        lat.sort()
        n = len(lat)
        ok = outcomes["ok"]
        unexpected = {k: v for k, v in outcomes.items() if k not in ("ok", "TransferTimeout")}
        p50 = lat[n // 2] if n else 0.0
        p99 = lat[min(n - 1, int(n * 0.99))] if n else 0.0
        print(f"transport=ucx mode=zero-copy memory=host message_size={format_size(a.size)} "
              f"concurrency={a.writers}x{a.inflight} numa_binding=none throughput={format_rate(ok * a.size / wall)} "
              f"p50_latency={format_seconds(p50)} p99_latency={format_seconds(p99)} cpu_utilization=- "
              f"case=soak_ucx seconds={a.seconds:g} posted={posted[0]} reported={n} "
              f"outcomes={dict(outcomes)} max_latency={format_seconds(lat[-1] if n else 0.0)} "
              f"over_bound={len(late)} bound={bound:.1f}s checked={checked} wrong={wrong} "
              f"target_alive={alive} hung_writers={hung}", flush=True)
        verdict = not late and not unexpected and not wrong and alive and not hung and n == posted[0]
        print("# soak " + ("held" if verdict else "FAILED"), flush=True)
        return 0 if verdict else 1
    finally:
        engine.close()
        if tgt.poll() is None:
            try:
                tgt.stdin.write("quit\n")  # type: ignore[union-attr]
                tgt.stdin.flush()  # type: ignore[union-attr]
                tgt.wait(10)
            except Exception:  # noqa: BLE001
                tgt.kill()
        if tgt.poll() is None:
            tgt.kill()


if __name__ == "__main__":
    sys.exit(main())
