"""An idle engine uses no CPU: no busy loops while nothing is in flight."""

from __future__ import annotations

import resource
import time
from typing import Any


def cpu_seconds() -> float:
    """CPU time of the whole process (every thread), user + system."""
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def test_connected_engines_idle_without_cpu(make_engine: Any) -> None:
    target = make_engine({"runtime": {"request_timeout_ms": 1000}})
    initiator = make_engine({"runtime": {"request_timeout_ms": 1000}})
    target.register(bytearray(1 << 20), name="kv")
    remote = initiator.open(target.address, "kv")
    src = initiator.register(bytearray(1 << 20))
    # Exercise everything that starts threads: control link, data connections
    # (striped and inline), the worker pool, the deadline timer.
    for _ in range(3):
        initiator.write(src, remote).result(5)
        initiator.read(src, remote, length=4096).result(5)
    time.sleep(1.2)  # past every deadline the requests above scheduled
    before_cpu, before_wall = cpu_seconds(), time.monotonic()
    time.sleep(2.0)
    used = cpu_seconds() - before_cpu
    assert time.monotonic() - before_wall >= 2.0
    assert used < 0.1, f"idle engines used {used:.3f}s of CPU in 2s"
    # And they still work afterwards.
    assert initiator.write(src, remote, length=64).result(5) == 64
