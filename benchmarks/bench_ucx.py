"""ucx write/read next to shm, tcp and UCX's own ``ucx_perftest ucp_put_bw``, in one run.

    python benchmarks/bench_ucx.py [--quick]

For 4 KiB, 4 MiB and 64 MiB, one request in flight, between two processes
(the target is ``python -m mpcomm.testing.target``): ucx with ``UCX_TLS``
unset (the default configuration: error handling on, cma on one host) and with
``UCX_TLS=tcp``, with peer error handling on (the default) and off; the shm and
tcp transports; and ``ucx_perftest -t ucp_put_bw`` for the same size and
transports (``-e`` when error handling is on, with ``UCX_RNDV_THRESH=inf`` as
the transport sets it), with the ratio ucx write / ucx_perftest printed. One line per case, in the seed's record
format; ``cpu_utilization`` is both processes' CPU time over the wall time,
in percent of one core. Takes about a minute.
"""

from __future__ import annotations

import json
import os
import re
import socket
import statistics
import subprocess
import sys
import time
from typing import Any

import mpcomm
from mpcomm.cli.records import format_rate, format_seconds, format_size, proc_cpu, self_cpu

SIZES = [4 << 10, 4 << 20, 64 << 20]
REGION = (64 << 20) + 4096
# (UCX_TLS or None, error_handling)
UCX_CASES = [(None, True), (None, False), ("tcp", True), ("tcp", False)]


def env_for(tls: str | None) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("UCX_TLS", None)
    if tls:
        env["UCX_TLS"] = tls
    return env


class Target:
    def __init__(self, transport: str, config: dict[str, Any], env: dict[str, str]) -> None:
        spec = {"transport": transport, "config": config, "regions": {"r": [REGION, "allocate"]}}
        self.proc = subprocess.Popen([sys.executable, "-m", "mpcomm.testing.target", json.dumps(spec)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                     text=True, env=env)
        line = self.proc.stdout.readline()  # type: ignore[union-attr]
        if not line:
            raise RuntimeError(f"{transport} target did not start")
        self.address = json.loads(line)["address"]

    def close(self) -> None:
        try:
            self.proc.stdin.write("quit\n")  # type: ignore[union-attr]
            self.proc.stdin.flush()  # type: ignore[union-attr]
            self.proc.wait(10)
        except Exception:  # noqa: BLE001
            self.proc.kill()
            self.proc.wait()


def iters_for(size: int, quick: bool) -> int:
    n = 2000 if size <= 64 << 10 else 40 if size <= 8 << 20 else 6
    return max(3, n // 4) if quick else n


def measure(transport: str, config: dict[str, Any], env: dict[str, str], quick: bool, label: dict[str, str]) -> dict:
    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(env)  # this engine's UCX context reads UCX_TLS at start
    out: dict[tuple[str, int], float] = {}
    try:
        try:
            engine = mpcomm.Engine(config, transports=[transport])
        except mpcomm.MpcommError as exc:
            for size in SIZES:
                print(f"transport={transport} mode=zero-copy memory=host message_size={format_size(size)} concurrency=1 "
                      f"numa_binding=none throughput=- p50_latency=- p99_latency=- cpu_utilization=- "
                      f"status=skipped reason={str(exc)!r}", flush=True)
            return out
        target = Target(transport, config, env)
        try:
            remote = engine.open(target.address, "r")
            local = engine.allocate(REGION)
            local.view[:] = b"\x5a" * REGION
            for size in SIZES:
                for op in ("write", "read"):
                    fn = engine.write if op == "write" else engine.read
                    for _ in range(3 if size > 1 << 20 else 50):  # warm-up: wire-up, caches
                        fn(local, remote, 0, size).result(60)
                    n = iters_for(size, quick)
                    lat = []
                    c0, t0cpu, w0 = self_cpu(), proc_cpu(target.proc.pid), time.perf_counter()
                    for _ in range(n):
                        s = time.perf_counter()
                        fn(local, remote, 0, size).result(60)
                        lat.append(time.perf_counter() - s)
                    wall = time.perf_counter() - w0
                    cpu = self_cpu() - c0 + proc_cpu(target.proc.pid) - t0cpu
                    lat.sort()
                    rate = size * n / wall
                    out[(op, size)] = rate
                    extra = " ".join(f"{k}={v}" for k, v in label.items())
                    print(f"transport={transport} mode=zero-copy memory=host message_size={format_size(size)} "
                          f"concurrency=1 numa_binding=none throughput={format_rate(rate)} "
                          f"p50_latency={format_seconds(statistics.median(lat))} "
                          f"p99_latency={format_seconds(lat[min(len(lat) - 1, int(len(lat) * 0.99))])} "
                          f"cpu_utilization={cpu / wall * 100:.0f}% case=bench_ucx op={op} requests={n}"
                          + (f" {extra}" if extra else ""), flush=True)
            engine.unregister(local)
        finally:
            target.close()
            engine.close()
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def listening(port: int) -> bool:
    for path in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(path) as f:
                for line in f.readlines()[1:]:
                    parts = line.split()
                    if parts[3] == "0A" and int(parts[1].rsplit(":", 1)[1], 16) == port:
                        return True
        except OSError:
            pass
    return False


def perftest(tls: str | None, eh: bool, size: int, quick: bool) -> tuple[float | None, str]:
    """ucx_perftest ucp_put_bw bandwidth in bytes/s (its 'overall' figure)."""
    from mpcomm.plugins.ucx import _ucp

    exe, env = _ucp.tool("ucx_perftest")
    env.pop("UCX_TLS", None)
    if tls:
        env["UCX_TLS"] = tls
    env.setdefault("UCX_RNDV_THRESH", "inf")  # what the transport's context uses (see docs/ucx.md)
    port = free_port()
    n = iters_for(size, quick) * (1 if size > 64 << 10 else 5)
    srv = subprocess.Popen([exe, "-p", str(port)], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(100):  # wait for the server's listener (without connecting: it accepts only one)
            if listening(port):
                break
            time.sleep(0.02)
        res = subprocess.run([exe, "127.0.0.1", "-p", str(port), "-t", "ucp_put_bw", "-s", str(size), "-n", str(n),
                              "-w", "3"] + (["-e"] if eh else []), env=env, capture_output=True, text=True, timeout=60)
    finally:
        try:
            srv.wait(10)
        except subprocess.TimeoutExpired:
            srv.kill()
            srv.wait()
    rows = [r for r in res.stdout.splitlines() if r.strip().startswith("Final:")]
    if not rows:
        return None, (res.stdout + res.stderr).strip()[-200:]
    nums = re.findall(r"[\d.]+", rows[-1])
    return float(nums[5]) * (1 << 20), rows[-1].strip()  # MB/s column is MiB/s


def main() -> None:
    quick = "--quick" in sys.argv
    t_start = time.monotonic()
    try:
        from mpcomm.plugins.ucx.transport import UcxTransport

        avail = UcxTransport.availability()
    except Exception as exc:  # noqa: BLE001
        avail = mpcomm.Availability.no(str(exc))
    print(f"# ucx: {avail.reason or avail.available}; cores={os.cpu_count()}", flush=True)
    for name in ("shm", "tcp"):
        measure(name, {}, env_for(None), quick, {})
    if not avail:
        print(f"# ucx skipped: {avail.reason}")
        return
    for tls, eh in UCX_CASES:
        label = {"ucx_tls": tls or "unset", "error_handling": str(eh).lower()}
        cfg = {"plugins": {"ucx": {"error_handling": eh}}}
        got = measure("ucx", cfg, env_for(tls), quick, label)
        for size in SIZES:
            ref, row = perftest(tls, eh, size, quick)
            ours = got.get(("write", size))
            if ref is None or ours is None:
                print(f"# ucx_perftest ucp_put_bw UCX_TLS={tls or 'unset'}{' -e' if eh else ''} "
                      f"-s {size}: no figure ({row})")
                continue
            print(f"# ucx_perftest ucp_put_bw UCX_TLS={tls or 'unset'}{' -e' if eh else ''} "
                  f"message_size={format_size(size)}: {format_rate(ref)}; ucx write/perftest = {ours / ref:.2f}", flush=True)
    print(f"# total {time.monotonic() - t_start:.1f}s")


if __name__ == "__main__":
    main()
