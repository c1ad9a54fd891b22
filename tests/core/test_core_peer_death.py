"""A peer that dies: open() fails fast; when a new target comes up on the same
endpoint, open() works again and descriptors from the old epoch are refused."""

from __future__ import annotations

import hashlib
import time
from typing import Any

import pytest

import mpcomm
from mpcomm.testing.patterns import pattern


def wait_dead_link(initiator: mpcomm.Engine, address: str, timeout: float = 5.0) -> None:
    """Give the initiator's control reader the moment it needs to see the EOF."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            initiator.open(address, "kv", timeout=0.5)
        except mpcomm.PeerConnectionError:
            return
        time.sleep(0.05)
    raise AssertionError("the initiator never noticed that its peer died")


def test_dead_peer_then_restart_on_the_same_endpoint(spawn: Any, make_engine: Any) -> None:
    first = spawn({"kv": [1 << 16, "buffer"]})
    initiator = make_engine()
    old = initiator.open(first.address, "kv")
    data = pattern(11, 4096)
    initiator.write(data, old, remote_offset=100).result(5)
    assert first.cmd("sha", "kv", 100, 4096) == hashlib.sha256(data).hexdigest()

    first.kill()
    wait_dead_link(initiator, first.address)

    # Dead: open fails fast (connection refused), well within its timeout.
    start = time.monotonic()
    with pytest.raises(mpcomm.PeerConnectionError) as info:
        initiator.open(first.address, "kv", timeout=5)
    assert time.monotonic() - start < 1.0
    assert info.value.retryable is True
    # A request on the old descriptor fails fast too, with a connection error.
    start = time.monotonic()
    with pytest.raises(mpcomm.PeerConnectionError):
        initiator.write(data, old, timeout=5).result(5)
    assert time.monotonic() - start < 1.0

    # A new target (new epoch) on the same endpoint.
    second = spawn({"kv": [1 << 16, "buffer"]}, endpoint=first.address)
    assert second.address == first.address and second.node_id != first.node_id
    fresh = initiator.open(second.address, "kv")  # reconnects
    assert fresh.epoch != old.epoch
    initiator.write(data, fresh, remote_offset=7).result(5)
    assert second.cmd("sha", "kv", 7, 4096) == hashlib.sha256(data).hexdigest()

    with pytest.raises(mpcomm.StaleRegionError) as stale:
        initiator.write(data, old, remote_offset=0).result(5)
    assert stale.value.retryable is True
    with pytest.raises(mpcomm.StaleRegionError):
        initiator.read(bytearray(16), old).result(5)
    assert second.cmd("sha", "kv", 0, 7) == hashlib.sha256(bytes(7)).hexdigest()  # nothing landed
    assert second.alive

