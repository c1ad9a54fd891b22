"""The real data path. Runs only where availability() finds an ACTIVE port
(a NIC, or soft-RoCE: ``rdma link add rxe0 type rxe netdev eth0``);
elsewhere every test is skipped with availability()'s reason."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from mpcomm import Engine, TransferTimeout
from mpcomm.errors import PermissionDeniedError
from mpcomm.plugins.rdma_zerocopy.transport import RdmaZeroCopyTransport

AVAIL = RdmaZeroCopyTransport.availability()
pytestmark = pytest.mark.skipif(not AVAIL.available, reason=f"rdma_zerocopy unavailable: {AVAIL.reason}")

CFG = {"transport": {"name": "rdma_zerocopy"}, "memory": {"alignment": 4096}}


@pytest.fixture
def pair() -> Iterator[tuple[Engine, Engine]]:
    with Engine(CFG) as target, Engine(CFG) as init:
        yield target, init


def test_write_read_roundtrip(pair: tuple[Engine, Engine]) -> None:
    target, init = pair
    region = target.allocate(8 << 20, "kv")
    remote = init.open(target.address, "kv")
    assert set(remote.transports["rdma_zerocopy"]) == {"rkey", "addr", "length"}
    src = init.allocate(4 << 20)
    src.view[:] = bytes(range(256)) * (16 << 10)
    t = init.write(src, remote, 4096)
    assert t.result(10) == 4 << 20 and t.transport == "rdma_zerocopy"
    assert bytes(region.view[4096 : 4096 + (4 << 20)]) == bytes(src.view)
    dst = init.allocate(4 << 20)
    assert init.read(dst, remote, 4096).result(10) == 4 << 20
    assert bytes(dst.view) == bytes(src.view)


def test_chunking_and_many_requests() -> None:
    cfg = {**CFG, "plugins": {"rdma_zerocopy": {"chunk": 64 << 10, "sq_depth": 8}}}
    with Engine(cfg) as target, Engine(cfg) as init:
        region = target.allocate(4 << 20, "kv")
        remote = init.open(target.address, "kv")
        ts = [init.write(bytes([i]) * (64 << 10), remote, i * (64 << 10)) for i in range(64)]
        assert all(t.result(10) == 64 << 10 for t in ts)
        assert all(region.view[i * (64 << 10)] == i for i in range(64))


def test_cancel_in_flight(pair: tuple[Engine, Engine]) -> None:
    target, init = pair
    region = target.allocate(1 << 30, "big")
    remote = init.open(target.address, "big")
    src = init.allocate(1 << 30)
    t = init.write(src, remote)
    ok = t.cancel(timeout=10)
    assert t.done()
    if ok:
        snapshot = bytes(region.view[-(1 << 20):])
        time.sleep(0.2)
        assert bytes(region.view[-(1 << 20):]) == snapshot  # nothing lands after cancel() returned
    assert init.write(b"after", remote).result(10) == 5  # the link recovered


def test_timeout(pair: tuple[Engine, Engine]) -> None:
    target, init = pair
    target.allocate(1 << 30, "big")
    remote = init.open(target.address, "big")
    src = init.allocate(1 << 30)
    t = init.write(src, remote, timeout=0.001)
    try:
        t.result(10)
    except TransferTimeout:
        pass


def test_stale_rkey_is_refused(pair: tuple[Engine, Engine]) -> None:
    target, init = pair
    region = target.allocate(1 << 16, "kv")
    remote = init.open(target.address, "kv")
    target.unregister(region)
    with pytest.raises(PermissionDeniedError):
        init.write(b"x" * 64, remote).result(10)
