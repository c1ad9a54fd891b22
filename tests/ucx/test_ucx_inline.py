"""The ucx inline lane: small writes put and flushed on the caller's thread, with revocation intact."""

from __future__ import annotations

from typing import Any

import pytest

import mpcomm
from mpcomm.plugins.ucx.transport import UcxTransport

AVAIL = UcxTransport.availability()
pytestmark = pytest.mark.skipif(not AVAIL, reason=f"ucx transport unavailable: {AVAIL.reason}")


@pytest.fixture
def bound() -> Any:
    target = mpcomm.Engine(transports=["ucx"])
    ini = mpcomm.Engine(transports=["ucx"])
    buf = bytearray(1 << 20)
    kv = target.register(buf, name="kv")
    kv.buf = buf  # type: ignore[attr-defined]  # the memory itself, readable after unregister
    remote = ini.open(target.address, "kv")
    src = ini.allocate(1 << 20, name="src")
    for _ in range(3):  # attach (full path), then one through post_inline, which binds the pair
        assert ini.write(src, remote, 0, 4096).result(10) == 4096
    assert ini._pipeline._fast, "the pair should be bound"
    yield target, ini, kv, remote, src
    ini.close(timeout=5)
    target.close(timeout=5)


def test_small_write_lands_in_the_call_without_post(bound: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    target, ini, kv, remote, src = bound
    ucx = ini.transports["ucx"]
    posted: list[Any] = []
    monkeypatch.setattr(ucx, "post", lambda op: posted.append(op) or UcxTransport.post(ucx, op))
    src.view[:8192] = b"\x77" * 8192
    t = ini.write(src, remote, 12288, 8192)
    assert t.done() and t.result(0) == 8192 and t.transport == "ucx" and posted == []
    assert bytes(kv.view[12288:20480]) == b"\x77" * 8192
    r = ini.read(src, remote, 0, 4096, local_offset=4096)  # reads keep the full path (see inline_path)
    assert r.result(10) == 4096 and len(posted) == 1
    with pytest.raises(mpcomm.OutOfBoundsError):
        ini.write(src, remote, (1 << 20) - 10, 4096)


def test_revocation_reaches_a_bound_pair(bound: Any) -> None:
    target, ini, kv, remote, src = bound
    buf = kv.buf
    target.unregister(kv)  # the initiator confirmed: nothing of ours can reach it any more
    before = bytes(buf[:64])
    src.view[:64] = b"\x99" * 64
    t = ini.write(src, remote, 0, 64)
    with pytest.raises(mpcomm.MpcommError):
        t.result(10)
    assert t.status is not mpcomm.TransferStatus.COMPLETED and bytes(buf[:64]) == before


class _Pending:
    """Stands for a UCX request still in flight (cma never leaves one: it completes in progress)."""

    def __init__(self) -> None:
        self.done = False
        self.freed = False

    def status(self) -> int:
        return 0 if self.done else 1

    def free(self) -> None:
        self.freed = True


def test_a_declined_write_left_in_flight_holds_revocation(bound: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A put the lane leaves in flight is kept, reaped once done, and waited for by a revocation."""
    target, ini, kv, remote, src = bound
    ucx = ini.transports["ucx"]
    pend = _Pending()
    peer = next(iter(ucx._peers.values()))
    real = type(peer.ep).rma_flush_now
    calls = []

    def once_pending(self: Any, *a: Any) -> Any:
        calls.append(a)
        return pend if len(calls) == 1 else real(self, *a)

    monkeypatch.setattr(type(peer.ep), "rma_flush_now", once_pending)
    assert ini.write(src, remote, 0, 64).result(10) == 64  # the lane declined; the full path carried it
    att = next(a for a in peer.attached.values() if a.orphans)
    assert att.orphans == [pend] and att in ucx._orphaned
    with ucx._lock:
        ucx._reap_orphans()
    assert att.orphans == [pend] and not pend.freed  # still in flight: kept
    pend.done = True
    with ucx._lock:
        ucx._reap_orphans()
    assert att.orphans == [] and pend.freed and att not in ucx._orphaned
