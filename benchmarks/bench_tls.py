"""What TLS costs on the control path, against plain TCP, in the same run, on loopback.

Two cases, each run plain and with TLS (mutual certificates from a throwaway
CA made with the ``openssl`` CLI), interleaved in rounds so drift hits both:

* ``control``: request round trips over a real ControlServer/PeerLink pair
  (the control channel's own framing, one request in flight): ops/s, p50, p99;
* ``bulk``: bytes streamed one way over one connection in 1 MiB sends,
  what a TLS-wrapped data connection would pay: GB/s.

It prints one record line per case and mode, then the TLS/plain ratios.

    python benchmarks/bench_tls.py [--seconds 1.0] [--rounds 3] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from benchlib import make_pki, timing_fields, tls_section
from mpcomm import Config, tls
from mpcomm.cli.records import format_rate, format_record, self_cpu
from mpcomm.control import ControlServer, PeerLink
from mpcomm.peer import PeerInfo

MiB = 1 << 20


def config(d: Path, use_tls: bool) -> Config:
    return Config.from_dict({"transport": {"tls": use_tls}, "tls": tls_section(d)})


def control_case(cfg: Config, seconds: float) -> dict[str, Any]:
    info = PeerInfo(node_id="bench-server", epoch="e" * 16, address="127.0.0.1:0")
    server = ControlServer("127.0.0.1", 0, local_info=lambda: info, secret="", handshake_timeout=5,
                           handler=lambda peer, msg: {"t": "pong"}, config=cfg)
    link = PeerLink(f"127.0.0.1:{server.port}", local_info=PeerInfo(node_id="bench-client", epoch="c" * 16,
                                                                     address="127.0.0.1:1"),
                    secret="", timeout=5, on_lost=lambda _l: None, config=cfg)
    lat = []
    try:
        for _ in range(50):
            link.request({"t": "ping"}, 5)
        cpu0, t0 = self_cpu(), time.perf_counter()
        end = t0 + seconds
        while True:
            s = time.perf_counter()
            link.request({"t": "ping"}, 5)
            e = time.perf_counter()
            lat.append(e - s)
            if e >= end:
                break
        wall = time.perf_counter() - t0
        cpu = self_cpu() - cpu0
    finally:
        link.close()
        server.close()
    lat.sort()
    return {"ops": len(lat) / wall, "p50": lat[len(lat) // 2], "p99": lat[int(len(lat) * 0.99)], "cpu": cpu / wall}


def bulk_case(cfg: Config, seconds: float) -> dict[str, Any]:
    lsock = socket.create_server(("127.0.0.1", 0))
    port = lsock.getsockname()[1]
    sctx = tls.server_context(cfg) if cfg.transport.tls else None
    received = [0]

    def sink() -> None:
        conn, _ = lsock.accept()
        if sctx is not None:
            conn = tls.tls_server(conn, sctx, time.monotonic() + 5)
        buf = bytearray(MiB)
        with conn:
            while True:
                n = conn.recv_into(buf)
                if not n:
                    return
                received[0] += n

    th = threading.Thread(target=sink)
    th.start()
    raw = socket.create_connection(("127.0.0.1", port))
    s = tls.tls_client(raw, tls.client_context(cfg), "127.0.0.1", time.monotonic() + 5) if cfg.transport.tls else raw
    chunk = os.urandom(MiB)
    sent = 0
    cpu0, t0 = self_cpu(), time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        s.sendall(chunk)
        sent += len(chunk)
    s.close()
    th.join()
    wall = time.perf_counter() - t0
    cpu = self_cpu() - cpu0
    lsock.close()
    return {"bytes": received[0], "rate": received[0] / wall, "cpu": cpu / wall}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=1.0, help="per case, mode and round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="mpcomm-bench-tls-") as tmp:
        d = Path(tmp)
        make_pki(d)
        results: dict[tuple[str, str], list[dict[str, Any]]] = {}
        for _ in range(args.rounds):
            for mode in ("plain", "tls"):
                cfg = config(d, mode == "tls")
                results.setdefault(("control", mode), []).append(control_case(cfg, args.seconds))
                results.setdefault(("bulk", mode), []).append(bulk_case(cfg, args.seconds))

    def med(case: str, mode: str, key: str) -> float:
        return statistics.median(r[key] for r in results[(case, mode)])

    out: dict[str, Any] = {}
    for mode in ("plain", "tls"):
        rec = {"case": "control", "mode": mode, "message_size": "ping", "concurrency": 1,
               "rate": f"{med('control', mode, 'ops'):.0f}ops/s",
               **timing_fields(med("control", mode, "p50"), med("control", mode, "p99"), med("control", mode, "cpu"))}
        print(format_record(rec))
        out[f"control_{mode}"] = rec
        rec = {"case": "bulk", "mode": mode, "message_size": "1MiB", "concurrency": 1,
               "throughput": format_rate(med("bulk", mode, "rate")),
               "cpu_utilization": f"{med('bulk', mode, 'cpu'):.2f}cores"}
        print(format_record(rec))
        out[f"bulk_{mode}"] = rec
    ratios = {
        "control_ops_tls_over_plain": med("control", "tls", "ops") / med("control", "plain", "ops"),
        "control_p50_tls_over_plain": med("control", "tls", "p50") / med("control", "plain", "p50"),
        "bulk_throughput_tls_over_plain": med("bulk", "tls", "rate") / med("bulk", "plain", "rate"),
    }
    print(format_record({k: f"{v:.2f}" for k, v in ratios.items()}))
    if args.json:
        print(json.dumps({**out, "ratios": ratios}))


if __name__ == "__main__":
    main()
