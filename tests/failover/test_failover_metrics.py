"""engine.stats()["health"]: the queue backlog and connections per peer, read now."""

from __future__ import annotations

import threading
import time

import mpcomm


def test_queue_backlog_and_connections_are_current() -> None:
    cfg = {"runtime": {"queue_depth": 1}}
    with mpcomm.Engine(transports=["tcp"]) as target, mpcomm.Engine(cfg, transports=["tcp"]) as initiator:
        target.allocate(1 << 16, "kv")
        remote = initiator.open(target.address, "kv")
        h = initiator.stats()["health"]
        assert h["queue_backlog"] == 0 and h["connections"] == {target.address: 1}
        staged = initiator.submit([mpcomm.Request("write", b"a" * 100, remote)], post=False)  # holds the one slot
        done = threading.Event()
        results: list[object] = []

        def waiter() -> None:
            results.append(initiator.write(b"b" * 100, remote, remote_offset=4096, timeout=20).result(20))
            done.set()

        th = threading.Thread(target=waiter)
        th.start()
        deadline = time.monotonic() + 10
        while initiator.stats()["health"]["queue_backlog"] != 1 and time.monotonic() < deadline:
            time.sleep(0.005)
        assert initiator.stats()["health"]["queue_backlog"] == 1, "the caller waiting for a slot is not counted"
        assert not done.is_set()
        initiator.post(staged).result(10)
        th.join(20)
        assert results == [100]
        assert initiator.stats()["health"]["queue_backlog"] == 0
    # the target is gone: no live connection is reported any more
    assert initiator.stats()["health"]["connections"] == {}
