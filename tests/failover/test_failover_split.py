"""Large requests split across two routes when a rule sets split_min.

The split request keeps one handle (one lease, slot and deadline); its
stripes run side by side, each on its own transport and each failed over on
its own. ``Transfer.stripes`` says which transport carried which part.
"""

from __future__ import annotations

import array
import gc
import hashlib
import os
import weakref
from concurrent.futures import CancelledError

import mpcomm

MiB = 1 << 20


def _rules(across: str = "transports", transports: tuple[str, ...] = ("faulty", "tcp")) -> list[dict]:
    return [{"name": "big-split", "transports": list(transports), "split_min": "1MiB", "max_stripes": 2,
             "split_across": across}]


def _pair(rules: list[dict], transports: tuple[str, ...] = ("faulty", "tcp"), **faulty: object):
    cfg = {"route": rules, "plugins": {"faulty": dict(faulty)}}
    target = mpcomm.Engine(cfg, transports=list(transports), endpoint="127.0.0.1:0")
    initiator = mpcomm.Engine(cfg, transports=list(transports), endpoint="127.0.0.1:0")
    return target, initiator


def _sha(b: object) -> bytes:
    return hashlib.sha256(memoryview(b)).digest()  # type: ignore[arg-type]


def test_a_large_write_and_read_are_carried_by_both_transports(faulty) -> None:
    target, initiator = _pair(_rules())
    with target, initiator:
        size = 8 * MiB
        kv = target.allocate(size + 4096, "kv")
        remote = initiator.open(target.address, "kv")
        data = os.urandom(size)
        t = initiator.write(data, remote, remote_offset=4096, timeout=20)
        assert t.result(20) == size
        half = size // 2
        assert t.stripes == ((0, half, "faulty"), (half, half, "tcp")), t.stripes
        assert (t.transport, t.route, t.route_rule) == ("faulty+tcp", ("faulty", "tcp"), "big-split")
        assert _sha(kv.view[4096:]) == _sha(data)
        assert faulty.counters["posted"] == 1  # the faulty transport carried exactly one stripe

        back = initiator.allocate(size)
        r = initiator.read(back, remote, remote_offset=4096, timeout=20)
        assert r.result(20) == size
        assert [s[2] for s in r.stripes] == ["faulty", "tcp"]
        assert _sha(back.view) == _sha(data)

        small = initiator.write(data[:4096], remote, timeout=20)  # below split_min: sent whole
        small.result(20)
        assert small.stripes == () and small.transport == "faulty"
        assert initiator.stats()["requests_held"] == 0


def test_lanes_keep_every_stripe_on_the_first_transport(faulty) -> None:
    target, initiator = _pair(_rules("lanes", ("tcp", "faulty")))
    with target, initiator:
        kv = target.allocate(4 * MiB, "kv")
        remote = initiator.open(target.address, "kv")
        data = os.urandom(4 * MiB)
        t = initiator.write(data, remote, timeout=20)
        t.result(20)
        assert [s[2] for s in t.stripes] == ["tcp", "tcp"] and t.transport == "tcp"
        assert _sha(kv.view) == _sha(data)
        assert faulty.counters["posted"] == 0


def test_a_failing_stripe_fails_over_alone_and_is_rewritten_whole(faulty) -> None:
    target, initiator = _pair(_rules(), fail_every=1)  # the faulty stripe fails half-way, corrupted
    with target, initiator:
        size = 8 * MiB
        kv = target.allocate(size, "kv")
        remote = initiator.open(target.address, "kv")
        data = os.urandom(size)
        t = initiator.write(data, remote, timeout=20)
        assert t.result(20) == size
        assert t.stripes == ((0, size // 2, "tcp"), (size // 2, size // 2, "tcp"))
        assert _sha(kv.view) == _sha(data)
        h = initiator.stats()["health"]
        assert h["failover_paths"] == {"faulty->tcp": 1} and faulty.counters["injected"] == 1


def test_a_cancelled_split_request_resolves(faulty) -> None:
    target, initiator = _pair(_rules())
    with target, initiator:
        target.allocate(64 * MiB, "kv")
        remote = initiator.open(target.address, "kv")
        src = initiator.allocate(64 * MiB)
        outcomes = set()
        for _ in range(3):
            t = initiator.write(src, remote, timeout=20)
            t.cancel()
            try:
                t.result(20)
                outcomes.add("completed")
            except CancelledError:
                outcomes.add("cancelled")
            except mpcomm.MpcommError as exc:
                outcomes.add(type(exc).__name__)
        assert outcomes <= {"completed", "cancelled", "TransferError"}, outcomes
        assert initiator.stats()["requests_held"] == 0
        assert initiator.stats()["health"]["retries"]["total"] == 0


def test_a_finished_split_request_lets_go_of_the_callers_buffer() -> None:
    """A split request used to stay in the engine's in-flight table after it finished (it was
    added without being marked tracked, so its release never took it out): the caller's buffer
    (and the request) stayed referenced until the engine closed."""
    target, initiator = _pair(_rules("lanes", ("tcp",)), ("tcp",))
    with target, initiator:
        kv = target.allocate(4 * MiB, "kv")
        remote = initiator.open(target.address, "kv")
        data = array.array("B", os.urandom(4 * MiB))
        alive = weakref.ref(data)
        t = initiator.write(data, remote, timeout=20)
        assert t.result(20) == 4 * MiB and len(t.stripes) == 2
        assert _sha(kv.view) == _sha(data)
        del data, t
        gc.collect()
        assert alive() is None, "the finished split request still holds the caller's buffer"


def test_a_split_request_finished_inside_post_reaches_its_completion_queue() -> None:
    """A split request whose stripes all land inside post() (shm copies there) is handed to its
    completion queue as any other request is, and its poller reaps it. It used to be settled on
    the posting thread and never queued, so a poller waited for it forever."""
    target, initiator = _pair(_rules("lanes", ("shm",)), ("shm",))
    with target, initiator:
        kv = target.allocate(4 * MiB, "kv")
        remote = initiator.open(target.address, "kv")
        src = initiator.allocate(4 * MiB)
        src.view[:] = os.urandom(4 * MiB)
        for _ in range(5):
            cq = initiator.completion_queue()
            t = initiator.write(src, remote, timeout=20, completion_queue=cq)
            assert cq.poll(timeout=10) == [t], "the split request never reached its completion queue"
            assert t.result(0) == 4 * MiB and len(t.stripes) == 2
        assert _sha(kv.view) == _sha(src.view)
        assert initiator.stats()["requests_held"] == 0
