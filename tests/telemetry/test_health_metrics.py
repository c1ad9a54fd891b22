"""Peer-health metrics (retries, failovers, quarantines, backlog, connections) as OpenTelemetry instruments."""

from __future__ import annotations

from typing import Any

import pytest

import mpcomm


def _shm_available() -> bool:
    from mpcomm.plugins.shm.transport import ShmTransport

    return bool(ShmTransport.availability())


def _value(view: Any, name: str, attrs: dict[str, str]) -> float:
    total = 0.0
    for p in view.points.get(name, []):
        if all(p.attributes.get(k) == v for k, v in attrs.items()):
            total += p.value
    return total


@pytest.mark.skipif(not _shm_available(), reason="the shm transport is not available here")
def test_failovers_reach_the_meter(collect: Any) -> None:
    cfg = {"observability": {"metrics": True}, "route": [{"name": "tcp-first", "transports": ["tcp", "shm"]}]}
    with mpcomm.Engine(cfg, transports=["tcp", "shm"]) as target, \
            mpcomm.Engine(cfg, transports=["tcp", "shm"]) as initiator:
        kv = target.allocate(1 << 16, "kv")
        remote = initiator.open(target.address, "kv")
        # The target's tcp transport stops serving: its data port refuses connections,
        # a retryable error; the request fails over to shm.
        target.transports["tcp"].close()
        t = initiator.write(b"\x42" * 4096, remote)
        assert t.result(10) == 4096
        assert (t.transport, t.route, t.route_rule) == ("shm", ("tcp", "shm"), "tcp-first")
        assert bytes(kv.view[:4096]) == b"\x42" * 4096
        who = {"mpcomm.node_id": initiator.node_id, "mpcomm.peer": target.address}
        view = collect()
        assert _value(view, "mpcomm.peer.retries", who) == 1
        assert _value(view, "mpcomm.peer.failovers", who) == 1
        assert _value(view, "mpcomm.peer.quarantines", who) == 0
        assert _value(view, "mpcomm.peer.connections", who) == 1
        assert _value(view, "mpcomm.queue.backlog", {"mpcomm.node_id": initiator.node_id}) == 0
        h = initiator.stats()["health"]
        assert h["retries"]["by_peer"] == {target.address: 1}
        assert h["connections"] == {target.address: 1}
        assert h["queue_backlog"] == 0
        node = initiator.node_id
    # A closed engine's series are gone.
    assert not [p for p in collect().points.get("mpcomm.peer.retries", [])
                if p.attributes.get("mpcomm.node_id") == node]


def test_metrics_off_feeds_nothing(collect: Any) -> None:
    with mpcomm.Engine(transports=["tcp"]) as e:
        assert not e.telemetry.metrics
        assert not [p for p in collect().points.get("mpcomm.queue.backlog", [])
                    if p.attributes.get("mpcomm.node_id") == e.node_id]
        assert e.stats()["health"]["queue_backlog"] == 0
