"""The default HealthPolicy (pause_after=3, quarantine_after=5) on a clock the test moves."""

from __future__ import annotations

from mpcomm.errors import PeerConnectionError
from mpcomm.health import HealthTracker, ManualClock


def test_a_counted_quarantine_pauses_the_peer_with_the_default_policy() -> None:
    clock = ManualClock()
    h = HealthTracker(clock=clock)
    p = h.policy
    assert (p.pause_after, p.quarantine_after) == (3, 5)
    err = PeerConnectionError("refused")
    for i in range(p.quarantine_after - 1):
        h.failure("bad", ("a", "b")[i % 2], err)
    assert not h.quarantined("bad") and h.metrics.snapshot()["quarantines"]["total"] == 0
    h.failure("bad", "a", err)  # the quarantine_after-th failure in a row
    assert h.metrics.snapshot()["quarantines"]["by_peer"] == {"bad": 1}
    assert h.quarantined("bad"), "a quarantine was counted but nothing is paused"
    assert h.admit("bad", "c") == "paused"  # even a path that never failed
    assert h.admit("good", "a") == "ok"
    clock.advance(p.base_cooldown * 1.01)
    assert not h.quarantined("bad")
    assert h.admit("bad", "c") == "probe"  # one probe after the cool-down
    assert h.admit("bad", "c") == "paused"
    h.failure("bad", "c", err)
    assert h.quarantined("bad")
    clock.advance(p.base_cooldown)
    assert h.quarantined("bad"), "the second step did not back off"
    clock.advance(p.base_cooldown * 1.01)
    assert not h.quarantined("bad")
    h.success("bad", "c")
    assert not h.quarantined("bad") and h.admit("bad", "c") == "ok"
    assert h.admit("bad", "a") == "probe"  # a has its own record: one probe before reuse
