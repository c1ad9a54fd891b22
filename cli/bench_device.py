"""``mpcomm bench --case memory`` (``--memory``): the seed's memory matrix (issue 31).

host->host, host->cuda, cuda->host and cuda->cuda (``LOCAL->REMOTE`` in the
record's ``memory=`` field; a write from local to remote memory) between this
process and a spawned :mod:`mpcomm.testing.device_target` on the same GPU:
64 MiB writes for throughput, 4 KiB writes for p50/p99 latency. Local device
memory comes from ``cudaMalloc`` (:mod:`mpcomm.cuda_runtime`), local host
memory from ``Engine.allocate``; the target's host region is pinned. A pair
whose transport cannot move CUDA memory here is a ``skipped`` record with the
reason (the machine's: no GPU, no cuda-python, no CUDA-enabled UCX).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

from mpcomm.errors import MpcommError

__all__ = ["PAIRS", "cuda_reason", "parse_pairs", "run", "usable_caps"]

PAIRS = (("host", "host"), ("host", "cuda"), ("cuda", "host"), ("cuda", "cuda"))
SIZE = 64 << 20
SMALL = 4 << 10


def parse_pairs(values: Sequence[str] | None) -> list[tuple[str, str]]:
    """``--memory`` values: ``KIND`` (both sides) or ``LOCAL:REMOTE``; kinds ``host``/``cuda`` (``device``)."""
    if not values:
        return list(PAIRS)
    from mpcomm.memory_kinds import normalize_kind

    out = []
    for v in values:
        local, _, remote = v.partition(":")
        try:
            pair = (normalize_kind(local.strip()), normalize_kind((remote or local).strip()))
        except ValueError as exc:
            raise ValueError(f"--memory {v!r}: {exc}") from None
        if pair not in out:
            out.append(pair)
    return out


def usable_caps(transport: str) -> tuple[Any, str]:
    """(capabilities usable here, why CUDA is not) of ``transport``; (None, why) when not installed."""
    from mpcomm.registry import load_plugins
    from mpcomm.transport import effective_capabilities

    entry = load_plugins().transports.get(transport)
    if entry is None:
        return None, f"{transport} is not installed"
    caps, missing = effective_capabilities(entry.cls)
    if "cuda" in caps.memory_kinds:
        return caps, ""
    return caps, missing.get("cuda") or f"{transport} does not move CUDA memory (capabilities.memory_kinds=" \
        f"{','.join(sorted(caps.memory_kinds))})"


def cuda_reason(transport: str) -> str:
    """'' when ``transport`` moves CUDA memory here (on some side), else why not."""
    return usable_caps(transport)[1]


def run(transport: str, pairs: Sequence[tuple[str, str]], record: Callable[..., None], iters: int = 10) -> None:
    """Measure each pair over ``transport``; ``record(memory, size, **fields)`` emits one record."""
    caps, why = usable_caps(transport)
    todo = []
    for local, remote in pairs:
        label = f"{local}->{remote}"
        if why:
            extra = "measured by the latency and throughput cases (memory=host); the device target needs CUDA: " \
                if (local, remote) == ("host", "host") else ""
            record(label, SIZE, status="skipped", reason=extra + why)
        elif not caps.moves(local, remote):
            record(label, SIZE, status="skipped", reason=f"{transport} moves local "
                   f"{','.join(sorted(caps.memory_kinds))}, remote {','.join(sorted(caps.remote_kinds))}")
        else:
            todo.append((local, remote))
    if not todo:
        return
    import mpcomm
    from mpcomm import cuda_runtime
    from mpcomm.testing.device_target import DeviceTarget

    target = DeviceTarget(transport, SIZE)
    dev_ptr = cuda_runtime.malloc(SIZE)
    try:
        with mpcomm.Engine(transports=[transport], endpoint="127.0.0.1:0") as eng:
            local = {"host": eng.allocate(SIZE, "bench-host"),
                     "cuda": eng.register(mpcomm.DeviceBuffer(dev_ptr, SIZE, 0), "bench-cuda")}
            remote = {"host": target.regions["host"], "cuda": target.regions["dev"]}
            for lk, rk in todo:
                src, dst = local[lk], remote[rk]
                try:
                    eng.write(src, dst).result(60)
                    times = []
                    for _ in range(iters):
                        t0 = time.perf_counter()
                        eng.write(src, dst).result(60)
                        times.append(time.perf_counter() - t0)
                    lat = []
                    for _ in range(1000):
                        t0 = time.perf_counter()
                        eng.write(src, dst, length=SMALL).result(30)
                        lat.append(time.perf_counter() - t0)
                except MpcommError as exc:
                    record(f"{lk}->{rk}", SIZE, status="failed", reason=str(exc), errors={exc.code: 1})
                    continue
                lat.sort()
                record(f"{lk}->{rk}", SIZE, throughput=SIZE / statistics.median(times), requests=iters)
                record(f"{lk}->{rk}", SMALL, p50_latency=lat[len(lat) // 2], p99_latency=lat[int(len(lat) * 0.99)],
                       requests=len(lat))
    finally:
        target.close()
        cuda_runtime.free(dev_ptr)


def emit_with(emit: Callable[[Any], None], make: Callable[..., Any], transport: str, numa: str) -> Callable[..., None]:
    """A ``record`` callback for :func:`run` that builds bench Records (``make`` = bench.Record)."""
    def record(memory: str, size: int, **fields: Any) -> None:
        emit(make(transport, "zero-copy", memory, size, 1, numa, case="memory", **fields))
    return record
