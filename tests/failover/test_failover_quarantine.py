"""Cool-down and quarantine with a peer that fails on purpose, next to a healthy one.

The bad target's faulty server drops every request half-way
(``serve_fail``) and its tcp transport has stopped (its port refuses), so
every attempt on either path of the route fails with a retryable error. The
initiator's paths to it pause, the peer is quarantined, further requests to
it fail fast at the call with an error that says so (nothing is sent), one
probe goes through after the cool-down — while requests to a healthy peer,
from another thread, all succeed with the right bytes. Behaviour only: the
healthy peer's latency is measured in benchmarks/bench_failover.py.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import threading
import time

import pytest

import mpcomm
from mpcomm.errors import PeerConnectionError

RULES = [{"name": "faulty-first", "transports": ["faulty", "tcp"]}]


def _engine(**faulty: object) -> mpcomm.Engine:
    return mpcomm.Engine({"route": RULES, "plugins": {"faulty": dict(faulty)}}, transports=["faulty", "tcp"],
                         endpoint="127.0.0.1:0")


def test_failing_peer_is_quarantined_and_the_healthy_one_is_not_held_up(faulty) -> None:
    with _engine() as good, _engine(serve_fail=True) as bad, _engine() as initiator:
        good_kv = good.allocate(4 << 20, "kv")
        bad.allocate(1 << 20, "kv")
        g = initiator.open(good.address, "kv")
        b = initiator.open(bad.address, "kv")
        bad.transports["tcp"].close()  # its data port refuses from now on
        # Cool-downs long enough that a loaded machine cannot outrun them mid-test.
        initiator.health.policy = dataclasses.replace(initiator.health.policy, base_cooldown=1.0)

        src = initiator.allocate(4 << 20)
        src.view[:] = os.urandom(4 << 20)
        stop = threading.Event()
        healthy: list[mpcomm.Transfer] = []
        healthy_errors: list[BaseException] = []

        def hammer_good() -> None:
            i = 0
            while not stop.is_set():
                off = (i % 64) * 65536
                try:
                    t = initiator.write(src, g, remote_offset=off, length=65536, local_offset=off, timeout=10)
                    t.result(10)
                    healthy.append(t)
                except BaseException as exc:  # noqa: BLE001
                    healthy_errors.append(exc)
                i += 1

        th = threading.Thread(target=hammer_good)
        th.start()
        try:
            payload = b"\xee" * 65536
            # 1. Requests to the bad peer fail (each tried on faulty, then on tcp) until it is quarantined.
            failures = []
            fast = None
            for _ in range(30):
                try:
                    t = initiator.write(payload, b, timeout=5)
                except PeerConnectionError as exc:  # refused at the call: nothing was posted
                    fast = exc
                    break
                with pytest.raises(PeerConnectionError) as info:
                    t.result(10)
                failures.append((t.transport, info.value))
            assert fast is not None, f"the failing peer was never paused or quarantined: {failures[-3:]}"
            assert "quarantined" in str(fast) and bad.address in str(fast) and fast.retryable, str(fast)
            assert failures and {tr for tr, _ in failures} <= {"faulty", "tcp"}
            assert any(tr == "tcp" for tr, _ in failures), "the failing requests never failed over to tcp"
            h = initiator.health
            assert h.quarantined(bad.address)
            assert h.paused(bad.address, "faulty")
            stats = initiator.stats()["health"]
            assert stats["quarantines"]["by_peer"] == {bad.address: 1}
            assert stats["retries"]["by_peer"].get(bad.address, 0) >= 1
            assert good.address not in stats["quarantines"]["by_peer"]

            # 2. While quarantined, requests fail fast: nothing reaches the bad server.
            dropped = faulty.counters["served_dropped"]
            for _ in range(50):
                with pytest.raises(PeerConnectionError, match="quarantined"):
                    initiator.write(payload, b, timeout=5)
            assert faulty.counters["served_dropped"] == dropped

            # 3. After the cool-down one probe goes through (and fails: the peer
            # is still bad), then the peer is quarantined again, for longer.
            first_pause = h.path_state(bad.address, "faulty")["paused_for"]
            deadline = time.monotonic() + 30
            while h.quarantined(bad.address) and time.monotonic() < deadline:
                time.sleep(0.01)
            assert not h.quarantined(bad.address)
            probe = initiator.write(payload, b, timeout=5)
            with pytest.raises(PeerConnectionError) as info:
                probe.result(10)
            assert "quarantined" not in str(info.value), "the probe was not let through"
            assert faulty.counters["served_dropped"] == dropped + 1, "exactly one probe reaches the bad server"
            assert h.quarantined(bad.address)
            assert h.path_state(bad.address, "faulty")["failures"] > len(failures) // 2
            assert h.path_state(bad.address, "faulty")["paused_for"] > first_pause
        finally:
            stop.set()
            th.join(30)

        # 4. The healthy peer never noticed.
        assert not healthy_errors, healthy_errors[:3]
        assert len(healthy) >= 10
        assert all(t.transport == "faulty" for t in healthy), "healthy requests were moved off their first path"
        assert hashlib.sha256(good_kv.view).digest() == hashlib.sha256(src.view).digest()
        assert not initiator.health.quarantined(good.address)
