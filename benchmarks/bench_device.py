"""Device memory benchmark (issue 31), next to torch in the same run: needs torch with CUDA.

``python benchmarks/bench_device.py [--transports shm,ucx] [--rounds 3] [--iters 10] [--json]``

The target engine runs in another process (``python -m mpcomm.testing.device_target``: a
64 MiB CUDA tensor and a 64 MiB pinned host tensor, registered). This
process is the initiator, on the same GPU. Cases, per transport whose CUDA
support is available here (one request in flight, ``result()`` after each):

* ``d2d`` 64 MiB: local CUDA tensor -> the target's CUDA tensor; throughput /
  in-process ``dst.copy_(src)`` of 64 MiB on the same device (target >= 0.8).
* ``h2d`` 64 MiB: local pinned host tensor -> the target's CUDA tensor, and
  ``d2h``: read the target's CUDA tensor into local pinned memory; each /
  torch's pinned copy in the same direction (target >= 0.8).
* ``d2h-remote`` 64 MiB: local CUDA -> the target's pinned host tensor.
* ``w4k``: a 4 KiB local CUDA -> remote CUDA write; p50 and p99 latency (reported).

One record per case and round in the seed's format (``memory=LOCAL->REMOTE``
for a write, ``memory=REMOTE->LOCAL`` for a read), then a summary line per
ratio: median over rounds. Targets are reported, not asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

import torch

import mpcomm
from mpcomm.cli.records import format_rate, format_record, format_seconds

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests", "device"))
from conftest import transport_cuda_reason  # noqa: E402
from mpcomm.testing.device_target import DeviceTarget

SIZE = 64 << 20


def _time(fn: Any, iters: int) -> float:
    """Median seconds of ``fn()`` over ``iters`` runs (after one warm-up)."""
    fn()
    out = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def torch_baselines(iters: int) -> dict[str, float]:
    src = torch.ones(SIZE, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    pinned = torch.empty(SIZE, dtype=torch.uint8).pin_memory()

    def d2d() -> None:
        dst.copy_(src)
        torch.cuda.synchronize()

    def h2d() -> None:
        dst.copy_(pinned, non_blocking=True)
        torch.cuda.synchronize()

    def d2h() -> None:
        pinned.copy_(src, non_blocking=True)
        torch.cuda.synchronize()

    return {"d2d": _time(d2d, iters), "h2d": _time(h2d, iters), "d2h": _time(d2h, iters)}


def record(transport: str, memory: str, size: int, seconds: float, **extra: str) -> dict[str, Any]:
    fields = {"transport": transport, "mode": "zero-copy", "memory": memory,
              "message_size": f"{size >> 20}MiB" if size >= 1 << 20 else f"{size >> 10}KiB", "concurrency": 1,
              "numa_binding": "none", "throughput": format_rate(size / seconds), **extra}
    return fields


def run_transport(transport: str, rounds: int, iters: int, emit: Any) -> dict[str, list[float]]:
    ratios: dict[str, list[float]] = {"d2d": [], "h2d": [], "d2h": []}
    target = DeviceTarget(transport, SIZE)
    try:
        dev, host = target.regions["dev"], target.regions["host"]
        with mpcomm.Engine(transports=[transport], endpoint="127.0.0.1:0") as e:
            src = e.register(torch.full((SIZE,), 5, dtype=torch.uint8, device="cuda"), "src")
            pinned = e.register(torch.full((SIZE,), 6, dtype=torch.uint8).pin_memory(), "pinned")
            small = e.register(torch.ones(4096, dtype=torch.uint8, device="cuda"), "small")
            torch.cuda.synchronize()
            for _ in range(rounds):
                base = torch_baselines(iters)  # same round, same GPU: load hits both sides alike
                t = _time(lambda: e.write(src, dev).result(60), iters)
                ratios["d2d"].append(base["d2d"] / t)
                emit(record(transport, "cuda->cuda", SIZE, t, vs_torch_copy=f"{base['d2d'] / t:.2f}"))
                t = _time(lambda: e.write(pinned, dev).result(60), iters)
                ratios["h2d"].append(base["h2d"] / t)
                emit(record(transport, "host(pinned)->cuda", SIZE, t, vs_torch_pinned=f"{base['h2d'] / t:.2f}"))
                t = _time(lambda: e.read(pinned, dev).result(60), iters)
                ratios["d2h"].append(base["d2h"] / t)
                emit(record(transport, "cuda->host(pinned)", SIZE, t, vs_torch_pinned=f"{base['d2h'] / t:.2f}"))
                t = _time(lambda: e.write(src, host).result(60), iters)
                emit(record(transport, "cuda->host(pinned,remote)", SIZE, t))
                lat = []
                for _ in range(2000):
                    t0 = time.perf_counter()
                    e.write(small, dev, length=4096).result(30)
                    lat.append(time.perf_counter() - t0)
                lat.sort()
                p50, p99 = lat[len(lat) // 2], lat[int(len(lat) * 0.99)]
                emit(record(transport, "cuda->cuda", 4096, p50, p50_latency=format_seconds(p50),
                            p99_latency=format_seconds(p99)))
    finally:
        target.close()
    return ratios


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--transports", default="shm,ucx")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--json", action="store_true", help="one JSON object per record")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to measure", file=sys.stderr)
        return 2
    print(f"# device: {torch.cuda.get_device_name(0)}; torch {torch.__version__}; mpcomm {mpcomm.__version__}",
          flush=True)

    def emit(fields: dict[str, Any]) -> None:
        print(json.dumps(fields) if a.json else format_record(fields), flush=True)

    measured = 0
    for name in a.transports.split(","):
        why = transport_cuda_reason(name)
        if why:
            print(f"transport={name} status=skipped reason={why!r}", flush=True)
            continue
        ratios = run_transport(name, a.rounds, a.iters, emit)
        measured += 1
        for case, target in (("d2d", "same-GPU two-process d2d vs in-process tensor.copy_()"),
                             ("h2d", "pinned host->device vs torch pinned copy"),
                             ("d2h", "device->pinned host vs torch pinned copy")):
            r = ratios[case]
            verdict = "meets" if statistics.median(r) >= 0.8 else "MISSES"
            print(f"summary transport={name} case={case} ratio={statistics.median(r):.2f} "
                  f"(min {min(r):.2f}, max {max(r):.2f}) target>=0.8 {verdict}: {target}", flush=True)
    return 0 if measured else 3


if __name__ == "__main__":
    sys.exit(main())
