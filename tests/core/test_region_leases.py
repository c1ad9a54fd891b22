"""Region leases take no lock: close() and acquire() racing from many threads never lose a lease."""

from __future__ import annotations

import threading
import time

import pytest

import mpcomm
from mpcomm.errors import RegionClosedError


def test_close_waits_for_leases_taken_while_it_waits_and_none_after() -> None:
    e = mpcomm.Engine(transports=["tcp"])
    try:
        r = e.register(bytearray(4096), name="leased")
        stop = threading.Event()
        after_close: list[int] = []
        closed = threading.Event()

        def churn() -> None:
            while not stop.is_set():
                try:
                    r.acquire()
                except RegionClosedError:
                    continue
                if closed.is_set():
                    after_close.append(1)  # a lease granted once close() had returned
                time.sleep(0)
                r.release()

        threads = [threading.Thread(target=churn) for _ in range(4)]
        for t in threads:
            t.start()
        time.sleep(0.05)
        r.close(timeout=10)
        closed.set()
        time.sleep(0.05)
        stop.set()
        for t in threads:
            t.join(5)
        assert r.closed and r.leases == 0
        assert not after_close
        with pytest.raises(RegionClosedError):
            r.acquire()
        assert r.leases == 0  # the refused acquire left nothing behind
    finally:
        e.close()


def test_a_close_that_times_out_leaves_the_region_usable() -> None:
    e = mpcomm.Engine(transports=["tcp"])
    try:
        r = e.register(bytearray(4096), name="leased")
        r.acquire()
        with pytest.raises(mpcomm.RegionBusyError, match="still has 1"):
            r.close(timeout=0.05)
        assert not r.closed
        r.acquire()  # still open: a new lease is granted
        r.release()
        r.release()
        releaser = threading.Timer(0.05, r.release)
        r.acquire()
        releaser.start()
        r.close(timeout=5)  # waits for the lease released by the timer
        assert r.closed and r.leases == 0
    finally:
        e.close()
