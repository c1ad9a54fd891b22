"""Back-pressure, deadlines, abort grace, cancel after posting and leases, with a
deliberately slow fake transport (see core_support.SlowTransport) between two
engines of this process."""

from __future__ import annotations

import concurrent.futures as cf
import logging
import time
from typing import Any

import pytest
from core_support import slow_plugin

import mpcomm
from mpcomm import TransferStatus


def slow_pair(make_engine: Any, transport: str = "slow", delay: float = 0.6, **runtime: Any) -> Any:
    cfg = {"runtime": {"queue_depth": 2, "worker_threads": 4, **runtime},
           "plugins": {"slow": {"delay": delay}, "stuck": {"delay": delay}}}
    plugin = slow_plugin()
    target = make_engine(cfg, transports=[transport], plugins=[plugin], autoload=False)
    initiator = make_engine(cfg, transports=[transport], plugins=[plugin], autoload=False)
    buf = bytearray(4096)
    target.register(buf, name="kv")
    return target, initiator, buf, initiator.open(target.address, "kv")


def test_slow_transport_moves_bytes(make_engine: Any) -> None:
    _, initiator, buf, remote = slow_pair(make_engine, delay=0.05)
    t = initiator.write(b"slow" * 4, remote, remote_offset=10)
    assert t.result(5) == 16 and t.transport == "slow"
    assert buf[10:26] == b"slow" * 4
    back = bytearray(16)
    initiator.read(back, remote, remote_offset=10).result(5)
    assert back == b"slow" * 4


def test_third_request_blocks_until_its_deadline(make_engine: Any) -> None:
    _, initiator, buf, remote = slow_pair(make_engine, delay=1.5)
    first = initiator.write(b"a" * 8, remote, timeout=5)
    second = initiator.write(b"b" * 8, remote, remote_offset=8, timeout=5)
    src = initiator.register(bytearray(b"c" * 8))
    start = time.monotonic()
    with pytest.raises(mpcomm.BackPressureError) as info:
        initiator.write(src, remote, remote_offset=16, timeout=0.3)
    took = time.monotonic() - start
    assert 0.25 <= took < 1.4, took  # well before a slot frees at 1.5 s
    assert info.value.retryable is True
    assert src.leases == 0  # the refused request let go of its lease
    assert first.result(5) == 8 and second.result(5) == 8
    assert buf[16:24] == bytes(8)  # the refused one never moved
    # Slots are free again: the same request now goes through.
    assert initiator.write(src, remote, remote_offset=16, timeout=5).result(5) == 8
    assert buf[:24] == b"a" * 8 + b"b" * 8 + b"c" * 8


def test_blocked_request_proceeds_when_a_slot_frees(make_engine: Any) -> None:
    _, initiator, buf, remote = slow_pair(make_engine, delay=0.3)
    ts = [initiator.write(bytes([65 + i]) * 4, remote, remote_offset=4 * i, timeout=5) for i in range(2)]
    start = time.monotonic()
    third = initiator.write(b"Z" * 4, remote, remote_offset=8, timeout=5)  # blocks ~0.3 s, then posts
    assert time.monotonic() - start >= 0.2
    # It got a slot because one of the first two let go of theirs.
    assert cf.wait(ts, timeout=1).not_done == set()
    assert third.result(5) == 4
    assert buf[:12] == b"AAAABBBBZZZZ"


def test_backpressure_raise_raises_at_once(make_engine: Any) -> None:
    _, initiator, _, remote = slow_pair(make_engine, delay=0.5, backpressure="raise")
    held = [initiator.write(b"x", remote, remote_offset=i, timeout=5) for i in range(2)]
    start = time.monotonic()
    with pytest.raises(mpcomm.BackPressureError, match="queue_depth"):
        initiator.write(b"y", remote, remote_offset=3, timeout=5)
    assert time.monotonic() - start < 0.25  # not the 5 s deadline, nor the 0.5 s a slot takes
    for t in held:
        t.result(5)


def test_submit_respects_queue_depth(make_engine: Any) -> None:
    _, initiator, buf, remote = slow_pair(make_engine, delay=0.5, backpressure="raise")
    # A batch's requests to one region take one slot: two fit in queue_depth=2 ...
    first = initiator.submit([mpcomm.Request("write", b"q", remote, remote_offset=i, timeout=5) for i in range(3)])
    second = initiator.submit([mpcomm.Request("write", b"r", remote, remote_offset=8 + i, timeout=5)
                               for i in range(3)])
    # ... a third batch does not, and is refused whole: nothing of it is posted or held.
    with pytest.raises(mpcomm.BackPressureError):
        initiator.submit([mpcomm.Request("write", b"s", remote, remote_offset=16 + i, timeout=5) for i in range(3)])
    assert first.result(5) == 3 and second.result(5) == 3
    time.sleep(0.3)
    assert buf[:3] == b"qqq" and buf[8:11] == b"rrr" and buf[16:19] == bytes(3)


def test_staged_batches_hold_slots(make_engine: Any) -> None:
    _, initiator, buf, remote = slow_pair(make_engine, delay=0.05, backpressure="raise")
    staged = [initiator.submit([mpcomm.Request("write", b"z", remote, remote_offset=i, timeout=5)], post=False)
              for i in range(2)]
    with pytest.raises(mpcomm.BackPressureError):
        initiator.write(b"y", remote, remote_offset=5, timeout=5)
    assert staged[0].cancel() is True  # a staged batch cancels at once and frees its slot
    assert initiator.write(b"y", remote, remote_offset=5, timeout=5).result(5) == 1
    initiator.post(staged[1]).result(5)
    assert buf[:2] == b"\x00z" and buf[5:6] == b"y"


def test_timeout_stops_the_request_before_it_lands(make_engine: Any) -> None:
    _, initiator, buf, remote = slow_pair(make_engine, delay=2.0)
    src = initiator.register(bytearray(b"late" * 4))
    start = time.monotonic()
    t = initiator.write(src, remote, timeout=0.3)
    with pytest.raises(TimeoutError) as info:  # builtin TimeoutError catches it
        t.result(5)
    assert time.monotonic() - start < 1.5
    assert isinstance(info.value, mpcomm.TransferTimeout)
    assert info.value.confirmed is True
    assert t.status is TransferStatus.TIMED_OUT
    assert src.leases == 0
    time.sleep(0.1)
    assert buf[:16] == bytes(16)  # it never landed


def test_abort_grace_fails_a_stuck_request(make_engine: Any, caplog: pytest.LogCaptureFixture) -> None:
    _, initiator, _, remote = slow_pair(make_engine, transport="stuck", abort_grace_ms=200)
    src = initiator.register(bytearray(8))
    start = time.monotonic()
    with caplog.at_level(logging.ERROR, logger="mpcomm.engine"):
        t = initiator.write(src, remote, timeout=0.2)
        assert not t.done()
        with pytest.raises(mpcomm.TransferTimeout) as info:
            t.result(5)
    took = time.monotonic() - start
    assert 0.35 <= took < 1.5, took
    assert info.value.confirmed is False
    assert "may still land" in str(info.value)
    assert t.status is TransferStatus.TIMED_OUT
    # The transport never said it stopped, so it may still touch the buffer:
    # the lease stays until it reports or the engine closes its transports.
    assert src.leases == 1
    initiator.close()
    assert src.leases == 0
    assert any(r.levelno == logging.ERROR and "abort_grace_ms" in r.getMessage() for r in caplog.records)


def test_cancel_after_posting_without_inflight_cancel(make_engine: Any) -> None:
    _, initiator, buf, remote = slow_pair(make_engine, delay=0.4)
    t = initiator.write(b"done" * 2, remote, timeout=5)
    assert t.status is TransferStatus.POSTED
    assert t.cancel() is False  # posted, and the transport cannot abort in flight
    assert t.result(5) == 8  # so it runs to completion
    assert t.status is TransferStatus.COMPLETED
    assert buf[:8] == b"done" * 2


def test_cancel_before_posting_always_succeeds(make_engine: Any) -> None:
    _, initiator, buf, remote = slow_pair(make_engine, delay=0.05)
    src = initiator.register(bytearray(b"s" * 8))
    batch = initiator.submit([mpcomm.Request("write", src, remote)], post=False)
    assert src.leases == 1  # leased from submit on
    assert batch.transfers[0].cancel() is True
    assert src.leases == 0
    initiator.post(batch)  # nothing left to post
    with pytest.raises(cf.CancelledError):
        batch.result(5)
    assert initiator.transports["slow"].posted == 0
    time.sleep(0.2)
    assert buf[:8] == bytes(8)


def test_unregister_waits_for_a_transfer_in_flight(make_engine: Any) -> None:
    _, initiator, buf, remote = slow_pair(make_engine, delay=0.5)
    src = initiator.register(bytearray(b"L" * 32), name="src")
    t = initiator.write(src, remote, timeout=5)
    assert src.leases == 1
    with pytest.raises(mpcomm.RegionBusyError, match="in flight"):
        initiator.unregister(src)
    assert not src.closed
    initiator.unregister(src, timeout=5)
    assert t.done() and t.result() == 32
    assert src.closed and src.leases == 0
    assert buf[:32] == b"L" * 32
    with pytest.raises(mpcomm.RegionClosedError):
        initiator.write(src, remote)


def test_target_region_leased_while_served(make_engine: Any) -> None:
    target, initiator, _, remote = slow_pair(make_engine, delay=0.05)
    kv = target.regions()[0]
    # Hold the target-side lease the way a serving transport does.
    served = target.transports["slow"].ctx.regions.serve(remote.region_id, remote.token, remote.epoch, 0, 8, "w")
    try:
        with pytest.raises(mpcomm.RegionBusyError):
            target.unregister(kv)
    finally:
        served.release()
    target.unregister(kv)
