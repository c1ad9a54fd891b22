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


def test_the_timer_thread_sleeps_through_deadlines_later_than_the_one_it_waits_for() -> None:
    """Scheduling a later deadline runs no Python on the timer thread (a result() caller's wait
    must not schedule another Python thread), even after the heap was compacted empty; an
    earlier one still wakes it in time."""
    ran: list[str] = []

    def hook(frame, event, arg):  # type: ignore[no-untyped-def]
        if threading.current_thread().name == "deadline-test":
            ran.append(f"{event} {frame.f_code.co_name}")

    threading.setprofile(hook)
    timer = DeadlineTimer(name="deadline-test")
    try:
        first = timer.schedule(time.monotonic() + 60, lambda: None)  # starts the thread: asleep towards +60 s
        time.sleep(0.1)
        timer.cancel(first)
        entries = [timer.schedule(time.monotonic() + 70, lambda: None) for _ in range(100)]
        for e in entries:
            timer.cancel(e)  # dead entries outnumber live ones: compacted, `first` dropped with them
        ran.clear()
        for _ in range(50):
            # Earlier than every entry left (the heap's first), later than the thread's +60 s.
            timer.schedule(time.monotonic() + 65, lambda: None)
        time.sleep(0.1)
        assert ran == [], ran[:8]
        hit = threading.Event()
        timer.schedule(time.monotonic() + 0.05, hit.set)  # earlier than +60 s: wakes it
        assert hit.wait(5)
    finally:
        threading.setprofile(None)  # type: ignore[arg-type]
        timer.close()


def test_cancels_from_many_threads_without_the_mutex_keep_the_heap_bounded() -> None:
    """cancel() takes no lock in the usual case (once per request): cancels racing each other,
    schedule() and the timer thread still leave no pile of dead entries, and no live call is lost."""
    timer = DeadlineTimer()
    fired = threading.Event()
    far = time.monotonic() + 3600

    def churn() -> None:
        for i in range(3000):
            timer.cancel(timer.schedule(far + i, lambda: None))

    threads = [threading.Thread(target=churn) for _ in range(4)]
    for t in threads:
        t.start()
    live = timer.schedule(time.monotonic() + 0.05, fired.set)
    for t in threads:
        t.join()
    assert len(timer._heap) < 400, f"{len(timer._heap)} entries kept after 12000 cancels"
    assert fired.wait(2), "a live deadline was lost to a racing compaction"
    timer.cancel(live)
    timer.close()


def test_a_deadline_beyond_the_longest_lock_wait_does_not_end_the_timer_thread() -> None:
    """A request timeout of 1e10 s is valid (positive, finite); the thread's wait towards it used
    to raise OverflowError (over threading.TIMEOUT_MAX), and no later deadline fired."""
    timer = DeadlineTimer()
    timer.schedule(time.monotonic() + 1e10, lambda: None)
    time.sleep(0.1)  # the thread is asleep towards it
    hit = threading.Event()
    timer.schedule(time.monotonic() + 0.05, hit.set)
    assert hit.wait(2), "the timer thread died on a far deadline"
    timer.close()
