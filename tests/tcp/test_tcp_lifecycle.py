"""Connections come and go without losing requests; aborts hurt no neighbour; close resolves everything."""

from __future__ import annotations

import contextlib
import hashlib
import os
import random
import threading
import time
from collections import Counter
from typing import Any

import pytest
from tcp_support import wait_for

import mpcomm
from mpcomm.peer import format_endpoint


def test_initiator_retires_idle_connections_before_the_target_does(spawn: Any, make_engine: Any) -> None:
    target = spawn(config={"plugins": {"tcp": {"idle_timeout_ms": 600}}})
    ini = make_engine()
    remote = ini.open(target.address, "kv")
    for round_ in range(3):
        data = bytes([round_]) * 4096
        ini.write(data, remote, 0).result(5)  # never fails on a connection the target closed
        assert target.cmd("sha kv 0 4096") == hashlib.sha256(data).hexdigest()
        time.sleep(0.8)  # past the target's idle timeout: our side retired the connection at ~0.3 s
    pool = next(iter(ini.transports["tcp"]._pools.values()))
    assert wait_for(lambda: not pool._conns, 2)
    # The connections' reader and writer threads ended with them. Only this pool's threads count:
    # engines of earlier tests in the same process may still be closing theirs.
    mine = (f"mpcomm-tcp-r-{pool.where}", f"mpcomm-tcp-w-{pool.where}")
    assert wait_for(lambda: not [t for t in threading.enumerate() if t.name in mine], 5)


def test_close_resolves_requests_to_a_stopped_target(spawn: Any) -> None:
    target = spawn()
    ini = mpcomm.Engine(transports=["tcp"])
    remote = ini.open(target.address, "kv")
    ini.write(b"x" * 4096, remote, 0).result(5)
    target.stop()
    try:
        ts = [ini.write(b"y" * 4096, remote, 0, timeout=30) for _ in range(10)]
        ts.append(ini.read(bytearray(1 << 20), remote, 0, timeout=30))
        t0 = time.monotonic()
        ini.close(timeout=5)
        assert time.monotonic() - t0 < 8
        for t in ts:
            assert t.done()
            assert t.exception(0) is not None
    finally:
        target.cont()


def test_aborts_never_fail_their_neighbours(spawn: Any, make_engine: Any) -> None:
    """Mixed load with timeouts and cancels on the same connections: every other request succeeds."""
    target = spawn({"kv": [32 << 20, "allocate"]})
    ini = make_engine({"plugins": {"tcp": {"connections": 2}}})
    remote = ini.open(target.address, "kv")
    errors: Counter[str] = Counter()
    outcomes: Counter[str] = Counter()
    stop = time.monotonic() + 3.0

    def worker(k: int) -> None:
        rnd = random.Random(k)
        base = k * (8 << 20)
        src, dst = ini.allocate(4 << 20), ini.allocate(4 << 20)
        src.view[:] = os.urandom(4 << 20)
        while time.monotonic() < stop:
            try:
                c = rnd.random()
                if c < 0.5:
                    n = rnd.choice([64, 4096, 65536, 1 << 20])
                    ini.write(src, remote, base, n).result(20)
                    ini.read(dst, remote, base, n).result(20)
                    if dst.view[:n] != src.view[:n]:
                        errors["mismatch"] += 1
                    outcomes["ok"] += 1
                elif c < 0.75:
                    t = ini.write(src, remote, base + (4 << 20), 4 << 20, timeout=0.002)
                    try:
                        t.result(20)
                        outcomes["short ok"] += 1
                    except mpcomm.TransferTimeout as exc:
                        outcomes[f"timeout confirmed={exc.confirmed}"] += 1
                else:
                    t = ini.write(src, remote, base + (4 << 20), 2 << 20, timeout=20)
                    t.cancel(timeout=5)
                    try:
                        t.result(20)
                        outcomes["cancel too late"] += 1
                    except mpcomm.MpcommError as exc:
                        errors[f"cancel gave {type(exc).__name__}"] += 1
                    except Exception:  # noqa: BLE001 - CancelledError
                        outcomes["cancelled"] += 1
            except mpcomm.MpcommError as exc:
                # "cooling down" / "quarantined" included: the deliberate timeouts are the
                # requests' own deadlines and never count against the path (issue 30, item 7).
                errors[f"{type(exc).__name__}: {exc}"[:120]] += 1

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, (errors, outcomes)
    assert outcomes["ok"] > 0 and "timeout confirmed=False" not in outcomes, outcomes
    assert target.proc.poll() is None


def test_writer_threads_end_with_a_killed_peer(spawn: Any, make_engine: Any) -> None:
    """Issue 30, item 8: a reader that meets a dead peer's connection wakes its writer.

    Reads are in flight on every connection (their request frames are out, so
    each writer waits for work), then the target is SIGKILLed: the readers meet
    the end of their connections and retire them. Their writers used to wait
    out ``idle_close`` (30 s here) before they noticed.
    """
    target = spawn({"kv": [32 << 20, "allocate"]})
    ini = make_engine({"plugins": {"tcp": {"connections": 8, "idle_timeout_ms": 60_000}}})
    remote = ini.open(target.address, "kv")
    ini.write(b"x" * 4096, remote).result(10)
    mine = {f"mpcomm-tcp-{side}-{format_endpoint(target.host, target.port)}" for side in "rw"}

    def threads() -> list[str]:
        return [t.name for t in threading.enumerate() if t.name in mine]

    reads = [ini.read(bytearray(32 << 20), remote, timeout=30) for _ in range(4)]
    assert threads()
    target.kill()
    for t in reads:
        with contextlib.suppress(mpcomm.MpcommError):
            t.result(30)
    deadline = time.monotonic() + 5  # well under idle_close (30 s)
    while threads():
        assert time.monotonic() < deadline, f"still running 5 s after the peer died: {threads()}"
        time.sleep(0.01)
