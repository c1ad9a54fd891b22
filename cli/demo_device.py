"""``mpcomm demo``'s device-memory part (issue 31): where a GPU is present, each running
transport that moves CUDA memory writes ``size`` bytes from this process's GPU memory into a
spawned target's GPU memory (:mod:`mpcomm.testing.device_target`) and reads them back into
host memory, checking the bytes; elsewhere each transport says why it was skipped."""

from __future__ import annotations

import ctypes
import hashlib
import time
from collections.abc import Sequence
from typing import Any

from .bench_device import usable_caps

__all__ = ["line", "run"]


def run(transports: Sequence[str], size: int) -> list[dict[str, Any]]:
    out = []
    for name in transports:
        caps, why = usable_caps(name)
        if why:
            out.append({"transport": name, "status": "skipped", "reason": why})
        else:  # into the target's GPU memory where the transport reaches it (tcp: its host memory)
            out.append(_pair(name, size, "dev" if caps.moves("cuda", "cuda") else "host"))
    return out


def _pair(transport: str, size: int, into: str) -> dict[str, Any]:
    import mpcomm
    from mpcomm import cuda_runtime
    from mpcomm.testing.device_target import DeviceTarget

    pattern = (hashlib.sha256(b"mpcomm device demo").digest() * (size // 32 + 1))[:size]
    host_src = ctypes.create_string_buffer(pattern, size)
    dev = cuda_runtime.malloc(size)
    target = DeviceTarget(transport, size)
    try:
        cuda_runtime.memcpy(dev, ctypes.addressof(host_src), size)
        with mpcomm.Engine(transports=[transport], endpoint="127.0.0.1:0") as eng:
            t0 = time.perf_counter()
            eng.write(mpcomm.DeviceBuffer(dev, size, 0), target.regions[into]).result(60)
            write_s = time.perf_counter() - t0
            back = bytearray(size)
            t0 = time.perf_counter()
            eng.read(back, target.regions[into]).result(60)
            read_s = time.perf_counter() - t0
        ok = target.cmd("sha", into, 0, size) == hashlib.sha256(pattern).hexdigest() and bytes(back) == pattern
        kind = "cuda" if into == "dev" else "host"
        return {"transport": transport, "status": "ok" if ok else "mismatch",
                "memory": f"cuda->{kind}, {kind}->host",
                "write_throughput": size / write_s, "read_throughput": size / read_s}
    finally:
        target.close()
        cuda_runtime.free(dev)


def line(d: dict[str, Any]) -> str:
    """One human line per transport (stdout, with the table), as rich markup: the reason is escaped
    (it names extras such as ``mpcomm[cuda]``, which rich would take for a tag)."""
    from rich.markup import escape

    from mpcomm.cli.records import format_rate

    if d["status"] == "skipped":
        return f"device memory over {d['transport']}: skipped ({escape(d['reason'])})"
    return (f"device memory over {d['transport']}: {d['status']}, write {format_rate(d['write_throughput'])}, "
            f"read {format_rate(d['read_throughput'])} ({d['memory']})")
