"""The engine's deadline timer: calls fire on time, cancelled ones never, and
cancelled entries do not pile up (the heap is compacted)."""

from __future__ import annotations

import threading
import time

from mpcomm.engine.deadlines import DeadlineTimer


def test_fires_in_order_and_cancelled_never() -> None:
    timer = DeadlineTimer()
    fired: list[str] = []
    done = threading.Event()
    now = time.monotonic()
    timer.schedule(now + 0.10, lambda: fired.append("late") or done.set())
    timer.schedule(now + 0.02, lambda: fired.append("early"))
    dropped = timer.schedule(now + 0.05, lambda: fired.append("cancelled"))
    timer.cancel(dropped)
    timer.cancel(dropped)  # twice is harmless
    assert done.wait(2)
    assert fired == ["early", "late"]
    timer.close()


def test_cancelled_entries_are_compacted_and_live_ones_still_fire() -> None:
    timer = DeadlineTimer()
    hit = threading.Event()
    far = time.monotonic() + 3600
    entries = [timer.schedule(far + i, lambda: None) for i in range(1000)]
    live = timer.schedule(time.monotonic() + 0.05, hit.set)
    for e in entries:
        timer.cancel(e)
    assert len(timer._heap) < 100, "cancelled entries were kept"
    assert hit.wait(2), "a live deadline was lost in the compaction"
    timer.cancel(live)  # after it ran: a no-op
    timer.close()
