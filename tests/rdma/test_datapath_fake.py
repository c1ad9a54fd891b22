"""The transport's data path, completions, abort-by-flush and recovery, on a simulated adapter.

``fake_verbs.FakeDevice`` replaces ``verbs.Device`` (see its docstring): two
real engines talk over their control channels, the transport connects QPs,
registers memory, chunks and posts work requests, and reaps completions
exactly as it would on hardware. What the fake cannot show — that a real
adapter behaves this way — is covered by test_hardware.py.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import CancelledError
from typing import Any

import pytest
from fake_verbs import FakeDevice

from mpcomm import Availability, Engine, TransferTimeout, hookimpl
from mpcomm.errors import PermissionDeniedError
from mpcomm.plugins.rdma_zerocopy.transport import RdmaZeroCopyTransport


class FakeRdma(RdmaZeroCopyTransport):
    name = "rdma_fake"
    device_factory = FakeDevice

    @classmethod
    def availability(cls) -> Availability:
        return Availability.yes("simulated adapter")


class FakePlugin:
    @hookimpl
    def mpcomm_register_transports(self, register: Any) -> None:
        register(FakeRdma)


def _engine(**plugin_opts: Any) -> Engine:
    cfg = {"plugins": {"rdma_fake": {"poll_spin_us": 0, **plugin_opts}}, "runtime": {"abort_grace_ms": 2000}}
    return Engine(cfg, transports=["rdma_fake"], plugins=[FakePlugin()], autoload=False)


@pytest.fixture
def pair(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Engine, Engine]]:
    monkeypatch.setattr(FakeDevice, "delay", 0.0)
    monkeypatch.setattr(FakeDevice, "max_msg_sz", 1 << 30)
    target, init = _engine(), _engine()
    try:
        yield target, init
    finally:
        init.close()
        target.close()


def _dev(engine: Engine) -> FakeDevice:
    return engine.transports["rdma_fake"].dev  # type: ignore[attr-defined]


def test_write_and_read_roundtrip(pair: tuple[Engine, Engine]) -> None:
    target, init = pair
    region = target.allocate(1 << 20, "kv")
    info = region.transport_info["rdma_fake"]
    assert set(info) == {"rkey", "addr", "length"} and info["addr"] == region.address
    remote = init.open(target.address, "kv")
    src = init.register(bytearray(b"abcd" * 1024))
    t = init.write(src, remote, 4096)
    assert t.result(5) == 4096 and t.transport == "rdma_fake"
    assert bytes(region.view[4096:8192]) == b"abcd" * 1024
    dst = bytearray(4096)
    assert init.read(dst, remote, 4096).result(5) == 4096
    assert dst == b"abcd" * 1024


def test_chunked_at_max_msg_sz(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(FakeDevice, "max_msg_sz", 4096)
    with _engine() as target, _engine(sq_depth=4) as init:
        region = target.allocate(1 << 20, "kv")
        remote = init.open(target.address, "kv")
        payload = bytes(range(256)) * 1024  # 256 KiB → 64 work requests through a 4-deep send queue
        assert init.write(payload, remote).result(5) == len(payload)
        assert bytes(region.view[: len(payload)]) == payload
        assert len(_dev(init).executed) == 64
        assert max(w.length for w in _dev(init).executed) == 4096


def test_many_concurrent_requests(pair: tuple[Engine, Engine]) -> None:
    target, init = pair
    region = target.allocate(1 << 20, "kv")
    remote = init.open(target.address, "kv")
    ts = [init.write(bytes([i]) * 1024, remote, i * 1024) for i in range(64)]
    assert all(t.result(5) == 1024 for t in ts)
    assert all(bytes(region.view[i * 1024 : (i + 1) * 1024]) == bytes([i]) * 1024 for i in range(64))


def test_cancel_in_flight_flushes_and_nothing_lands_after(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(FakeDevice, "delay", 0.3)
    monkeypatch.setattr(FakeDevice, "max_msg_sz", 4096)
    with _engine() as target, _engine() as init:
        region = target.allocate(1 << 16, "kv")
        remote = init.open(target.address, "kv")
        t = init.write(b"\xee" * 16384, remote)  # 4 chunks, 0.3 s each
        time.sleep(0.45)  # the first chunk landed, the second is "on the wire"
        assert t.cancel(timeout=5) is True
        assert t.cancelled()
        landed = bytes(region.view[:16384])
        time.sleep(0.7)
        assert bytes(region.view[:16384]) == landed  # no byte after the flush
        assert landed[:4096] == b"\xee" * 4096 and landed[8192:] == bytes(8192)
        # The link recovers: a new QP serves the next request.
        assert init.write(b"\x11" * 100, remote).result(5) == 100
        assert bytes(region.view[:100]) == b"\x11" * 100


def test_abort_reposts_flushed_work_of_other_requests(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(FakeDevice, "delay", 0.2)
    with _engine() as target, _engine() as init:
        region = target.allocate(1 << 16, "kv")
        remote = init.open(target.address, "kv")
        victim = init.write(b"\x01" * 1000, remote, 0)
        bystander = init.write(b"\x02" * 1000, remote, 4096)
        time.sleep(0.05)
        assert victim.cancel(timeout=5) is True
        assert bystander.result(5) == 1000  # flushed, then reposted on a fresh QP
        assert bytes(region.view[4096:5096]) == b"\x02" * 1000


def test_timeout_is_reported_only_after_the_flush(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(FakeDevice, "delay", 1.0)
    with _engine() as target, _engine() as init:
        target.allocate(1 << 16, "kv")
        remote = init.open(target.address, "kv")
        t = init.write(b"\x07" * 512, remote, timeout=0.2)
        with pytest.raises(TransferTimeout):
            t.result(5)
        assert _dev(init).bytes_moved == 0


def test_cancel_before_connect_completes(pair: tuple[Engine, Engine]) -> None:
    target, init = pair
    target.allocate(4096, "kv")
    remote = init.open(target.address, "kv")
    t = init.write(b"x" * 10, remote)
    t.cancel(timeout=5)
    assert t.done()


def test_unregistered_target_region_is_refused_by_the_adapter(pair: tuple[Engine, Engine]) -> None:
    target, init = pair
    region = target.allocate(1 << 16, "kv")
    remote = init.open(target.address, "kv")
    target.unregister(region)  # deregisters the MR: the rkey is dead
    t = init.write(b"z" * 64, remote)
    with pytest.raises(PermissionDeniedError, match="IBV_WC_REM_ACCESS_ERR"):
        t.result(5)
    other = target.allocate(1 << 16, "kv2")
    assert init.write(b"y" * 64, init.open(target.address, "kv2")).result(5) == 64
    assert bytes(other.view[:64]) == b"y" * 64


def test_read_only_region_cannot_be_written(pair: tuple[Engine, Engine]) -> None:
    target, init = pair
    data = bytes(4096)
    target.register(data, "ro")
    remote = init.open(target.address, "ro")
    assert target.regions()[0].transport_info["rdma_fake"]["length"] == 4096
    buf = bytearray(16)
    assert init.read(buf, remote).result(5) == 16


def test_close_with_requests_in_flight(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(FakeDevice, "delay", 0.5)
    target, init = _engine(), _engine()
    try:
        target.allocate(1 << 16, "kv")
        remote = init.open(target.address, "kv")
        t = init.write(b"q" * 100, remote)
        time.sleep(0.05)
    finally:
        init.close()
        target.close()
    assert t.done()
    with pytest.raises((CancelledError, Exception)):
        t.result(0)
