"""A caller's own deadline never counts against a path, and a probe slot is always freed.

A real target process serves a 64 MiB region over shm; the initiator has shm
only, so a path the health tracker wrongly pauses shows at once as "every
path to ... is cooling down" (issue 30, item 7). With 4 KiB copy chunks the
shm copy loop sees the deadline itself between two chunks (the case that used
to count against the path); with the default chunks the engine's timer
usually ends the request first (the case whose probe slot used to stay taken).
"""

from __future__ import annotations

import time

import numpy as np
import pytest
from shm_support import Target

import mpcomm
from mpcomm.errors import PeerConnectionError

SIZE = 64 << 20
SLOW = {"plugins": {"shm": {"chunk": 4096}}, "transport": {"mode": "copy"}}
CHUNKS = pytest.mark.parametrize("chunks", [SLOW, {}], ids=["copy-loop-sees-it", "default-chunks"])


@pytest.fixture(scope="module")
def target():
    t = Target({"regions": {"kv": [SIZE, "allocate"], "gone": [1 << 20, "allocate"]}})
    yield t
    t.close()


def _engine(config: dict | None = None, chunks: dict = SLOW) -> mpcomm.Engine:
    return mpcomm.Engine({**chunks, **(config or {})}, transports=["shm"])


def _state(e: mpcomm.Engine, peer: str) -> dict:
    return e.health.path_state(peer, "shm")


@CHUNKS
def test_requests_timing_out_by_their_own_deadline_leave_the_peer_usable(target: Target, chunks: dict) -> None:
    """The sequence of the issue: 1 ms writes of 64 MiB, then ordinary requests to the same peer."""
    with _engine(chunks=chunks) as e:
        remote = e.open(target.address, "kv")
        e.write(b"x", remote).result(10)
        big = np.ones(SIZE, dtype=np.uint8)
        for _ in range(8):
            t = e.write(big, remote, timeout=0.001)
            with pytest.raises(mpcomm.TransferTimeout):
                t.result(10)
        for i in range(5):
            e.write(bytes([i]) * 4096, remote, timeout=10).result(10)  # never "cooling down"
        assert _state(e, target.address) == {"failures": 0, "paused_for": 0.0, "probing": False}
        assert not e.health.quarantined(target.address)
        e.read(bytearray(4096), remote, timeout=10).result(10)
        assert e.stats()["health"]["quarantines"]["total"] == 0


def _cool_down(e: mpcomm.Engine, peer: str) -> None:
    """Pause the shm path as real connection failures would (once), then wait out the cool-down."""
    while _state(e, peer)["failures"] < e.health.policy.pause_after:
        e.health.failure(peer, "shm", PeerConnectionError("reset by the test"))
    deadline = time.monotonic() + 10
    while e.health.paused(peer, "shm"):
        assert time.monotonic() < deadline, "the cool-down never ended"
        time.sleep(0.01)


def _next_request_is_admitted(e: mpcomm.Engine, remote: mpcomm.RemoteRegion, peer: str) -> None:
    """The probe slot is free: the next request goes through as the probe, and its success heals the path."""
    state = _state(e, peer)
    assert state["probing"] is False, state
    e.write(b"p" * 4096, remote, timeout=10).result(10)
    assert _state(e, peer)["failures"] == 0


@CHUNKS
def test_a_probe_ending_by_its_deadline_frees_the_slot(target: Target, chunks: dict) -> None:
    with _engine({"health": {"base_cooldown_ms": 20}}, chunks) as e:
        remote = e.open(target.address, "kv")
        e.write(b"x", remote).result(10)
        big = np.ones(SIZE, dtype=np.uint8)
        for _ in range(4):  # whoever sees the deadline first: the copy loop or the engine's timer
            _cool_down(e, target.address)
            failures = _state(e, target.address)["failures"]
            t = e.write(big, remote, timeout=0.001)
            with pytest.raises(mpcomm.TransferTimeout):
                t.result(10)
            state = _state(e, target.address)
            assert state["probing"] is False and state["failures"] == failures, state  # freed, not counted
        _next_request_is_admitted(e, remote, target.address)


def test_a_cancelled_probe_frees_the_slot(target: Target) -> None:
    with _engine({"health": {"base_cooldown_ms": 20}}) as e:
        remote = e.open(target.address, "kv")
        e.write(b"x", remote).result(10)
        _cool_down(e, target.address)
        t = e.write(np.ones(SIZE, dtype=np.uint8), remote, timeout=30)
        deadline = time.monotonic() + 10
        while t.status != mpcomm.TransferStatus.POSTED:  # cancel the probe in flight, not before it is admitted
            assert time.monotonic() < deadline and not t.done(), t.status
            time.sleep(0.0005)
        assert t.cancel(timeout=10) is True
        _next_request_is_admitted(e, remote, target.address)


def test_a_probe_failing_with_the_requests_own_error_frees_the_slot(target: Target) -> None:
    with _engine({"health": {"base_cooldown_ms": 20}}) as e:
        remote = e.open(target.address, "kv")
        gone = e.open(target.address, "gone")
        e.write(b"x", remote).result(10)
        assert target.cmd("unregister", "gone") == "ok"
        _cool_down(e, target.address)
        with pytest.raises(mpcomm.MpcommError) as ei:
            e.write(b"g" * 4096, gone, timeout=10).result(10)
        assert not isinstance(ei.value, PeerConnectionError), ei.value  # the region's fault, not the path's
        _next_request_is_admitted(e, remote, target.address)


def test_a_probe_failing_on_the_path_counts(target: Target) -> None:
    """The other side of the rule: a failure of the path itself still pauses it again."""
    with _engine({"health": {"base_cooldown_ms": 20}}) as e:
        remote = e.open(target.address, "kv")
        e.write(b"x", remote).result(10)
        _cool_down(e, target.address)
        assert e.health.admit(target.address, "shm") == "probe"
        e.health.failure(target.address, "shm", PeerConnectionError("the probe's connection broke"))
        state = _state(e, target.address)
        assert state["failures"] == e.health.policy.pause_after + 1 and state["paused_for"] > 0, state
