"""tcp transport vs plain Python sockets, between two processes, in the seed's record format.

    python benchmarks/bench_tcp.py [--quick] [--json]

For each size (4 KiB, 64 KiB, 4 MiB, 64 MiB), direction (write, read) and
concurrency (1, 8 in flight) it measures the tcp transport (target engine in
a child process) and, in the same run, plain sockets moving the same bytes
the same way (a child process that recv_into()s / sendall()s a preallocated
buffer and acknowledges each message). It prints one record per case plus
``ratio_to_socket`` = tcp throughput / plain-socket throughput. The issue's
target is tcp 4 MiB write >= 0.8x the plain-socket figure.

``--batch N`` adds batches of N x 4 KiB (``Engine.submit``, which the engine
hands to the transport's ``post_many`` as one group: one frame per
connection) against plain sockets sending the same N x 4 KiB as one message
with one acknowledgement. ``--sizes 4KiB,4MiB`` restricts the sizes. ``--tls`` runs both engines with
``transport.tls = true`` (mutual certificates from a throwaway CA made with the
``openssl`` CLI), so tcp data connections run TLS; compare with a run without it
for the cost of TLS (the plain-socket baseline stays plain).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import psutil

import mpcomm
from benchlib import make_pki, timing_fields, tls_section
from mpcomm.cli.records import format_rate, format_record, format_size
from mpcomm.testing import TargetProcess

KiB, MiB = 1 << 10, 1 << 20
SIZES = [4 * KiB, 64 * KiB, 4 * MiB, 64 * MiB]

PLAIN_SERVER = r"""
import socket, struct, sys, threading
buf = bytearray(64 << 20)
view = memoryview(buf)
srv = socket.socket(); srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
srv.bind(("127.0.0.1", 0)); srv.listen(64)
print(srv.getsockname()[1], flush=True)
def serve(c):
    c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    while True:
        h = c.recv(9, socket.MSG_WAITALL)
        if len(h) < 9: return
        op, n = struct.unpack("!BQ", h)
        if op == 1:                      # write: receive n bytes, ack
            got = 0
            while got < n:
                r = c.recv_into(view[got:n], n - got)
                if not r: return
                got += r
            c.sendall(b"k")
        else:                            # read: send n bytes
            c.sendall(view[:n])
while True:
    c, _ = srv.accept()
    threading.Thread(target=serve, args=(c,), daemon=True).start()
"""


def measure(fn: Callable[[int], None], concurrency: int, iters: int, pids: list[int]) -> dict[str, float]:
    """Run ``fn(worker_index)`` iters times on each of ``concurrency`` threads."""
    lats: list[float] = []
    lock = threading.Lock()
    procs = [psutil.Process(p) for p in pids]
    cpu0 = sum(sum(p.cpu_times()[:2]) for p in procs)

    def worker(k: int) -> None:
        mine = []
        for _ in range(iters):
            t0 = time.perf_counter()
            fn(k)
            mine.append(time.perf_counter() - t0)
        with lock:
            lats.extend(mine)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(concurrency)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    cpu = sum(sum(p.cpu_times()[:2]) for p in procs) - cpu0
    lats.sort()
    return {"wall": wall, "ops": len(lats), "p50": statistics.median(lats),
            "p99": lats[min(len(lats) - 1, int(len(lats) * 0.99))], "cpu": cpu / wall}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="fewer iterations (CI-sized)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--mode", default="zero-copy", choices=["zero-copy", "copy"])
    ap.add_argument("--sizes", default="", help="comma-separated subset of 4KiB,64KiB,4MiB,64MiB")
    ap.add_argument("--batch", type=int, default=0, help="also measure batches of this many 4 KiB writes")
    ap.add_argument("--concurrency", default="1,8", help="comma-separated in-flight counts")
    ap.add_argument("--ops", default="write,read", help="comma-separated: write, read")
    ap.add_argument("--tls", action="store_true", help="TLS on the control channel and the tcp data connections")
    args = ap.parse_args()
    names = {"4KiB": 4 * KiB, "64KiB": 64 * KiB, "4MiB": 4 * MiB, "64MiB": 64 * MiB}
    sizes = [names[x] for x in args.sizes.split(",")] if args.sizes else SIZES
    concs = [int(x) for x in args.concurrency.split(",")]

    cfg: dict | None = {"transport": {"mode": args.mode}} if args.mode != "zero-copy" else None
    if args.tls:
        import tempfile
        from pathlib import Path

        pki = Path(tempfile.mkdtemp(prefix="bench-tcp-tls-"))
        make_pki(pki)
        cfg = cfg or {"transport": {}}
        cfg["transport"]["tls"] = True
        cfg["tls"] = tls_section(pki)
    target = TargetProcess("tcp", config=cfg, regions={"dst": [8 * 64 * MiB, "allocate"]})
    plain = subprocess.Popen([sys.executable, "-c", PLAIN_SERVER], stdout=subprocess.PIPE, text=True)
    assert plain.stdout is not None
    plain_port = int(plain.stdout.readline())
    records = []

    def compare(op: str, size: int, moved: int, conc: int, via_tcp: Callable[[int], None],
                via_socket: Callable[[int], None], n: int) -> None:
        """Measure plain sockets, then tcp, the same way; record (and print) tcp with its ratio to sockets.

        ``size`` is the record's message size, ``moved`` the bytes one call moves (a batch: N x size).
        """
        base = measure(via_socket, conc, n, [os.getpid(), plain.pid])
        res = measure(via_tcp, conc, n, [os.getpid(), target.pid])
        thr = res["ops"] * moved / res["wall"]
        base_thr = base["ops"] * moved / base["wall"]
        rec = {
            "transport": "tcp+tls" if args.tls else "tcp", "mode": args.mode, "memory": "host", "op": op,
            "message_size": format_size(size), "concurrency": conc, "numa_binding": "none",
            "throughput": format_rate(thr), **timing_fields(res["p50"], res["p99"], res["cpu"]),
            "baseline": "plain-socket", "baseline_throughput": format_rate(base_thr),
            "ratio_to_socket": f"{thr / base_thr:.2f}",
        }
        records.append(rec)
        if not args.json:
            print(format_record(rec), flush=True)

    try:
        with mpcomm.Engine(cfg, transports=["tcp"]) as eng:
            remote = eng.open(target.address, "dst")
            src = eng.allocate(64 * MiB)
            src.view[:] = os.urandom(MiB) * 64
            socks = []
            for _ in range(8):
                s = socket.create_connection(("127.0.0.1", plain_port))
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                socks.append(s)
            for size in sizes:
                iters = max(3, min(2000, (256 * MiB) // size)) // (4 if args.quick else 1)
                for op in args.ops.split(","):
                    for conc in concs:
                        n = max(2, iters // conc)

                        def via_tcp(k: int, size: int = size, op: str = op) -> None:
                            fn = eng.write if op == "write" else eng.read
                            fn(src, remote, k * 64 * MiB, size).result(60)

                        def via_socket(k: int, size: int = size, op: str = op) -> None:
                            s = socks[k]
                            view = src.view[:size]
                            if op == "write":
                                s.sendall(struct.pack("!BQ", 1, size))
                                s.sendall(view)
                                s.recv(1)
                            else:
                                s.sendall(struct.pack("!BQ", 2, size))
                                got = 0
                                while got < size:
                                    got += s.recv_into(view[got:], size - got)

                        compare(op, size, size, conc, via_tcp, via_socket, n)
            if args.batch:
                nb = args.batch
                size = 4 * KiB
                for conc in concs:
                    n = max(2, (400 // (4 if args.quick else 1)) // conc)

                    def batch_tcp(k: int, nb: int = nb) -> None:
                        reqs = [mpcomm.Request("write", src, remote, k * 64 * MiB + i * size, size, i * size)
                                for i in range(nb)]
                        eng.submit(reqs).result(60)

                    def batch_socket(k: int, nb: int = nb) -> None:
                        s = socks[k]
                        s.sendmsg([struct.pack("!BQ", 1, nb * size), src.view[: nb * size]])
                        s.recv(1)

                    compare(f"write-batch{nb}", size, nb * size, conc, batch_tcp, batch_socket, n)
            for s in socks:
                s.close()
    finally:
        target.close()
        plain.kill()
    if args.json:
        print(json.dumps(records, indent=2))


if __name__ == "__main__":
    main()
