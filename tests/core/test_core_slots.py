"""The queue_depth semaphore (engine.units.Slots): lock-free take and give back, a lock only to wait."""

from __future__ import annotations

import threading
import time

from mpcomm.engine.units import Slots


def test_waiters_are_never_lost_and_capacity_is_never_exceeded() -> None:
    """8 threads share 2 slots, most of them waiting: each release reaches a waiter (no lost
    wake-up: every acquire returns well before its 10 s), at most 2 are held at any time."""
    slots = Slots(2)
    held, peak, lock = [0], [0], threading.Lock()
    failed: list[int] = []

    def worker(k: int) -> None:
        for _ in range(300):
            if not slots.acquire(time.monotonic() + 10):
                failed.append(k)
                return
            with lock:
                held[0] += 1
                peak[0] = max(peak[0], held[0])
            time.sleep(0)
            with lock:
                held[0] -= 1
            slots.release()

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not failed, f"threads {failed} timed out waiting for a free slot"
    assert peak[0] <= 2
    assert slots.in_use == 0 and slots.waiting == 0


def test_try_acquire_and_a_timed_wait_on_a_full_queue() -> None:
    slots = Slots(1)
    assert slots.try_acquire() and not slots.try_acquire()
    t0 = time.monotonic()
    assert not slots.acquire(time.monotonic() + 0.05)
    assert time.monotonic() - t0 >= 0.04
    threading.Timer(0.05, slots.release).start()
    assert slots.acquire(time.monotonic() + 5)  # woken by the release
    assert slots.in_use == 1
    slots.release()
    assert slots.in_use == 0
