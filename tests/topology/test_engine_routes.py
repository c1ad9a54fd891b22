"""The route policy inside real engines: the route and its rule on every handle."""

from __future__ import annotations

import pytest

import mpcomm
from mpcomm.control import PeerLink
from mpcomm.peer import PeerInfo

RULES = [
    {"name": "tiny-over-tcp", "max_size": "4KiB", "transports": ["tcp"]},
    {"name": "same-host", "same_host": True, "transports": ["shm", "ucx", "tcp"]},
    {"name": "other-hosts", "transports": ["ucx", "tcp"]},
]


def _shm_available() -> bool:
    from mpcomm.plugins.shm.transport import ShmTransport

    return bool(ShmTransport.availability())


needs_shm = pytest.mark.skipif(not _shm_available(), reason="the shm transport is not available here")


@needs_shm
def test_two_engines_on_one_host_pick_shm() -> None:
    with mpcomm.Engine() as target, mpcomm.Engine() as initiator:
        target.allocate(1 << 20, "kv")
        remote = initiator.open(target.address, "kv")
        t = initiator.write(b"x" * 65536, remote)
        assert t.result(10) == 65536
        assert t.transport == "shm"
        assert t.route[0] == "shm" and t.route_rule == "default"
        assert "tcp" in t.route  # the next in line for failover


@needs_shm
def test_rules_choose_per_request() -> None:
    cfg = {"route": RULES}
    with mpcomm.Engine(cfg) as target, mpcomm.Engine(cfg) as initiator:
        target.allocate(1 << 20, "kv")
        remote = initiator.open(target.address, "kv")
        small = initiator.write(b"s" * 100, remote)
        big = initiator.write(b"b" * 100_000, remote, remote_offset=4096)
        assert small.result(10) == 100 and big.result(10) == 100_000
        assert (small.transport, small.route, small.route_rule) == ("tcp", ("tcp",), "tiny-over-tcp")
        same_host = tuple(n for n in ("shm", "ucx", "tcp") if n in initiator.transports)
        assert (big.transport, big.route, big.route_rule) == ("shm", same_host, "same-host")
        back = bytearray(4096 + 100_000)
        initiator.read(back, remote, length=len(back)).result(10)
        assert back[:100] == b"s" * 100 and back[4096:] == b"b" * 100_000


def test_explicit_order_is_kept_by_the_default_route() -> None:
    with mpcomm.Engine(transports=["tcp", "shm"]) as target, mpcomm.Engine(transports=["tcp", "shm"]) as initiator:
        target.allocate(1 << 16, "kv")
        remote = initiator.open(target.address, "kv")
        t = initiator.write(b"z" * 1000, remote)
        t.result(10)
        assert t.transport == "tcp" and t.route_rule == "default"
        assert t.route[0] == "tcp"


def test_rule_naming_a_missing_transport_is_a_config_error() -> None:
    with pytest.raises(mpcomm.ConfigError, match="names transport 'verbs9', which is not installed"):
        mpcomm.Engine({"route": [{"name": "fast", "transports": ["verbs9", "tcp"]}]})


def test_no_usable_transport_says_which_rule() -> None:
    cfg = {"route": [{"name": "only-shm", "transports": ["shm"]}]}
    with mpcomm.Engine(transports=["tcp"]) as target, mpcomm.Engine(cfg, transports=["shm"]) as initiator:
        target.register(bytearray(4096), "kv")
        remote = initiator.open(target.address, "kv")
        with pytest.raises(mpcomm.TransportUnavailable, match="no transport reaches"):
            initiator.write(b"x", remote)


def test_handshake_carries_the_topology() -> None:
    with mpcomm.Engine() as a, mpcomm.Engine() as b:
        link = a._peer(b.address)
        assert link.info.topology == b.topology
        assert link.info.topology is not None and link.info.topology.cpus == b.topology.cpus


class _EvilInfo(PeerInfo):
    def to_dict(self):  # type: ignore[override]
        d = super().to_dict()
        d["topology"] = {"interfaces": [{"name": "x" * 10}] * 100_000}  # far past the caps
        return d


def test_garbage_topology_closes_that_connection_only() -> None:
    with mpcomm.Engine() as server, mpcomm.Engine() as honest:
        evil = _EvilInfo(node_id="evil", epoch="e", address="127.0.0.1:1")
        with pytest.raises(mpcomm.MpcommError):
            PeerLink(server.address, local_info=evil, secret="", timeout=5, on_lost=lambda link: None)
        server.register(bytearray(4096), "still-serving")
        assert honest.open(server.address, "still-serving").size == 4096
