"""Per-request route hints: ``route=`` on write/read/write_many/read_many/submit and Request.route."""

from __future__ import annotations

import os

import pytest

import mpcomm

RULES = [{"name": "same-host", "same_host": True, "transports": ["shm", "tcp"]}]


def _shm_available() -> bool:
    from mpcomm.plugins.shm.transport import ShmTransport

    return bool(ShmTransport.availability())


needs_shm = pytest.mark.skipif(not _shm_available(), reason="the shm transport is not available here")


@needs_shm
def test_a_hint_overrides_the_rules_on_every_entry_point() -> None:
    cfg = {"route": RULES}
    with mpcomm.Engine(cfg) as target, mpcomm.Engine(cfg) as initiator:
        kv = target.allocate(1 << 20, "kv")
        remote = initiator.open(target.address, "kv")
        data = os.urandom(1 << 16)
        plain = initiator.write(data, remote)
        plain.result(10)
        assert (plain.transport, plain.route, plain.route_rule) == ("shm", ("shm", "tcp"), "same-host")

        w = initiator.write(data, remote, remote_offset=1 << 16, route=("tcp", "shm"))
        w.result(10)
        assert (w.transport, w.route, w.route_rule) == ("tcp", ("tcp", "shm"), "hint")
        one = initiator.write(data, remote, remote_offset=2 << 16, route="tcp")
        one.result(10)
        assert (one.transport, one.route, one.route_rule) == ("tcp", ("tcp",), "hint")

        back = bytearray(1 << 16)
        r = initiator.read(back, remote, remote_offset=1 << 16, route=["tcp"])
        r.result(10)
        assert r.transport == "tcp" and r.route_rule == "hint" and bytes(back) == data

        src = initiator.allocate(1 << 16)
        src.view[:] = data
        b = initiator.write_many(src, remote, [0, 4096], [3 << 16, (3 << 16) + 4096], [4096, 4096], route=("tcp",))
        b.result(10)
        assert (b.transport, b.route_rule) == ("tcp", "hint")
        dst = initiator.allocate(8192)
        rb = initiator.read_many(dst, remote, [0, 4096], [3 << 16, (3 << 16) + 4096], [4096, 4096], route=("tcp",))
        rb.result(10)
        assert rb.transport == "tcp" and bytes(dst.view) == data[:8192]

        # submit: per-request hints, the call's hint as their default, and none (the rules).
        reqs = [
            mpcomm.Request("write", data[:4096], remote, remote_offset=4 << 16, route=("tcp",)),
            mpcomm.Request("write", data[:4096], remote, remote_offset=(4 << 16) + 4096),
        ]
        sb = initiator.submit(reqs)
        sb.result(10)
        # Different hints never share a vectorised group: one part per hint.
        parts = sorted(u.transport.name for _, u in sb.parts)
        assert parts == ["shm", "tcp"], parts
        sb2 = initiator.submit(reqs[1:], route=("tcp",))
        sb2.result(10)
        assert sb2.transport == "tcp" and sb2.route_rule == "hint"
        assert bytes(kv.view[4 << 16:(4 << 16) + 4096]) == data[:4096]


def test_a_hint_naming_no_installed_transport_is_refused_before_anything_moves() -> None:
    with mpcomm.Engine() as target, mpcomm.Engine() as initiator:
        kv = target.allocate(1 << 16, "kv")
        remote = initiator.open(target.address, "kv")
        held = initiator.stats()["requests_held"]
        with pytest.raises(mpcomm.MpcommError, match="'carrier-pigeon', which is not installed"):
            initiator.write(b"x" * 100, remote, route=("carrier-pigeon", "tcp"))
        with pytest.raises(mpcomm.MpcommError, match="route must be"):
            initiator.write(b"x" * 100, remote, route=())
        with pytest.raises(mpcomm.MpcommError, match="not installed"):
            initiator.submit([mpcomm.Request("write", b"x", remote, route=("nope",))])
        assert initiator.stats()["requests_held"] == held
        assert bytes(kv.view[:100]) == bytes(100)


def test_a_hinted_route_fails_over_in_its_own_order(faulty) -> None:
    cfg = {"plugins": {"faulty": {"fail_every": 1}}}
    with mpcomm.Engine(cfg, transports=["tcp", "faulty"]) as target, \
            mpcomm.Engine(cfg, transports=["tcp", "faulty"]) as initiator:
        kv = target.allocate(1 << 20, "kv")
        remote = initiator.open(target.address, "kv")
        data = os.urandom(1 << 20)
        t = initiator.write(data, remote, route=("faulty", "tcp"))
        assert t.result(10) == len(data)
        assert (t.transport, t.route, t.route_rule) == ("tcp", ("faulty", "tcp"), "hint")
        assert bytes(kv.view) == data
        assert initiator.stats()["health"]["failover_paths"] == {"faulty->tcp": 1}
