"""A stopped peer's notifications do not hold back notifications to a healthy one.

shm moves the data without the target (the initiator copies into the
target's memfd), so the writes to a SIGSTOPped target land and only their
notifications (control messages) wait on it: the case where every notify
worker used to end up blocked on the one peer that cannot answer.
"""

from __future__ import annotations

import json
import time

from mpcomm.testing import TargetProcess

import mpcomm


def test_notifications_to_a_healthy_peer_pass_a_stopped_one() -> None:
    stopped = TargetProcess("shm", regions={"kv": [1 << 20, "allocate"]})
    healthy = TargetProcess("shm", regions={"kv": [1 << 20, "allocate"]})
    ini = mpcomm.Engine({"runtime": {"worker_threads": 4}}, transports=["shm"])
    try:
        r_stopped, r_healthy = ini.open(stopped.address, "kv"), ini.open(healthy.address, "kv")
        ini.write(b"w" * 64, r_stopped, 0, notify=b"warm").result(10)
        ini.write(b"w" * 64, r_healthy, 0, notify=b"warm").result(10)
        stopped.stop()
        try:
            # More notifying writes than the initiator has notify workers.
            # Their deadline outlasts the check below on a machine shared with busy loops (at 4 s one
            # had passed there before the assertion); the healthy write's 10 s deadline is shorter, so
            # a healthy write queued behind them fails rather than waits.
            waiting = [ini.write(b"s" * 64, r_stopped, 64 * k, notify=b"to-stopped", timeout=30) for k in range(8)]
            time.sleep(0.2)
            t0 = time.monotonic()
            ini.write(b"h" * 64, r_healthy, 0, notify=b"to-healthy", timeout=10).result(10)
            took = time.monotonic() - t0
            assert not any(t.done() for t in waiting[1:])  # still waiting on the stopped peer
        finally:
            stopped.cont()
        notes = [n["data"] for n in json.loads(healthy.cmd("notes"))]
        assert "to-healthy" in str(notes), notes
        # Behind the stopped peer it would have failed at its 10 s deadline; scheduling on a loaded
        # machine adds tenths of a second, not seconds.
        assert took < 5.0, f"the healthy peer's notification waited {took:.2f}s behind the stopped peer"
        for t in waiting:  # each ends (delivered late or failed by its deadline), none hangs
            t.exception(15)
    finally:
        ini.close(timeout=5)
        stopped.close()
        healthy.close()
