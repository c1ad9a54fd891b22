"""The Transfer contract (a real Future), batches, RemoteRegion descriptors, and registering memory."""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import logging
import mmap
import threading
import time
from typing import Any

import numpy as np
import pytest

import mpcomm
from mpcomm import RemoteRegion, Request, Transfer, TransferStatus


@pytest.fixture
def kv(pair: tuple[mpcomm.Engine, mpcomm.Engine]) -> tuple[mpcomm.Engine, mpcomm.Engine, bytearray, RemoteRegion]:
    target, initiator = pair
    buf = bytearray(1 << 16)
    target.register(buf, name="kv")
    return target, initiator, buf, initiator.open(target.address, "kv")


def test_transfer_is_a_future(kv: Any) -> None:
    _, initiator, buf, remote = kv
    t = initiator.write(b"\x01" * 100, remote)
    assert isinstance(t, cf.Future) and isinstance(t, Transfer)
    assert t.result(timeout=5) == 100
    assert t.status is TransferStatus.COMPLETED
    assert t.transport == "tcp"
    assert t.bytes_moved == 100
    assert t.elapsed is not None and t.elapsed >= 0
    assert t.cancel() is False  # done: cannot be cancelled
    assert buf[:100] == b"\x01" * 100


def test_wait_and_as_completed(kv: Any) -> None:
    _, initiator, buf, remote = kv
    handles = [initiator.write(bytes([i]) * 4096, remote, remote_offset=i * 4096) for i in range(8)]
    done, not_done = cf.wait(handles, timeout=10)
    assert not not_done and len(done) == 8
    reads = [initiator.read(bytearray(4096), remote, remote_offset=i * 4096) for i in range(8)]
    finished = list(cf.as_completed(reads, timeout=10))
    assert sorted(map(id, finished)) == sorted(map(id, reads))
    assert all(t.result() == 4096 for t in finished)
    for i in range(8):
        assert buf[i * 4096 : (i + 1) * 4096] == bytes([i]) * 4096


def test_the_future_base_is_built_only_when_asked_for(kv: Any) -> None:
    """result() and callbacks answer without the Future machinery; concurrent.futures and a
    Future method called directly get a Future resolved exactly as the handle is."""
    _, initiator, _buf, remote = kv
    t = initiator.write(b"a" * 4096, remote)
    assert t.result(10) == 4096 and t.done() and not t.cancelled() and t.exception() is None
    assert "_condition" not in vars(t)  # nobody asked for it
    assert cf.Future.result(t, 0) == 4096  # Future's own method: built and resolved on demand
    assert "_condition" in vars(t)
    # Built while pending (wait() installs its waiter), resolved when the outcome lands.
    for _ in range(20):
        pending = [initiator.write(b"b" * 4096, remote, 4096 * i) for i in range(4)]
        done, not_done = cf.wait(pending, timeout=10)
        assert not not_done and all(cf.Future.result(h, 0) == 4096 for h in done)
    # A cancellation (or, if the read won the race, its result) reaches the Future base too.
    slow = initiator.read(bytearray(1 << 16), remote, 0)
    slow.cancel()
    done, _ = cf.wait([slow], timeout=10)
    assert slow in done
    if slow.cancelled():
        assert cf.Future.cancelled(slow)
        with pytest.raises(cf.CancelledError):
            slow.result(0)
    else:
        assert cf.Future.result(slow, 0) == slow.result(0) == 1 << 16
    # A failure the target reports: the same exception from the handle and from its Future base.
    target = kv[0]
    (region,) = [r for r in target.regions() if r.name == "kv"]
    target.unregister(region, timeout=10)  # the cancelled read may still hold its lease there a moment
    failed = initiator.write(b"e" * 16, remote)
    done, _ = cf.wait([failed], timeout=10)
    err = failed.exception(0)
    assert failed in done and isinstance(err, mpcomm.errors.MpcommError)
    assert cf.Future.exception(failed, 0) is err and failed.status is TransferStatus.FAILED


def test_result_right_after_another_thread_settled_sees_it_done(kv: Any) -> None:
    """A waiter that finds the outcome recorded while another thread applies it never times out."""
    _, initiator, _buf, remote = kv
    for i in range(300):
        t = initiator.write(b"d" * 64, remote, 64 * (i % 64))
        if i % 2:
            t.add_done_callback(lambda _t: None)  # the completion thread settles these
        assert t.result(0 if t.done() else 10) == 64
        assert t.status is TransferStatus.COMPLETED and t.bytes_moved == 64


def test_await_in_asyncio(kv: Any) -> None:
    _, initiator, buf, remote = kv

    async def main() -> list[int]:
        ts = [initiator.write(b"\x07" * 512, remote, remote_offset=512 * i) for i in range(4)]
        return list(await asyncio.gather(*ts))

    assert asyncio.run(main()) == [512] * 4
    assert buf[: 512 * 4] == b"\x07" * 2048


def test_done_callback_runs_at_once_when_done(kv: Any) -> None:
    _, initiator, _, remote = kv
    t = initiator.write(b"x" * 10, remote)
    t.result(5)
    seen: list[Any] = []
    t.add_done_callback(lambda f: seen.append((f, threading.get_ident())))
    assert seen == [(t, threading.get_ident())]  # synchronously, on this thread


def test_raising_callback_is_logged_not_raised(kv: Any, caplog: pytest.LogCaptureFixture) -> None:
    _, initiator, _, remote = kv

    def bad(_f: Any) -> None:
        raise ValueError("callback bug")

    pending = initiator.submit([Request("write", b"y" * 10, remote)], post=False).transfers[0]
    pending.add_done_callback(bad)
    t = initiator.write(b"x" * 10, remote)
    t.result(5)
    with caplog.at_level(logging.ERROR):
        t.add_done_callback(bad)  # already done: runs now, must not raise
        assert pending.cancel() is True  # runs on the completion thread, must not raise either
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            bugs = [r for r in caplog.records if r.exc_info and isinstance(r.exc_info[1], ValueError)]
            if len(bugs) == 2:
                break
            time.sleep(0.01)
    assert len(bugs) == 2


def test_status_transitions(kv: Any) -> None:
    target, initiator, buf, remote = kv
    batch = initiator.submit([Request("write", b"z" * 8, remote)], post=False)
    staged = batch.transfers[0]
    assert staged.status is TransferStatus.PENDING and staged.transport is None
    assert staged.cancel() is True
    assert staged.status is TransferStatus.CANCELLED and staged.cancelled()
    with pytest.raises(cf.CancelledError):
        staged.result(0)
    initiator.post(batch)  # posting skips the cancelled member
    assert buf[:8] == bytes(8)

    ok = initiator.write(b"z" * 8, remote)
    ok.result(5)
    assert ok.status is TransferStatus.COMPLETED

    # The target unregisters the region: the request is refused there, nothing lands.
    target.unregister(target.regions()[0])
    failed = initiator.write(b"w" * 8, remote)
    with pytest.raises(mpcomm.UnknownRegionError):
        failed.result(5)
    assert failed.status is TransferStatus.FAILED
    assert buf[:8] == b"z" * 8


def test_batch_result_and_members(kv: Any) -> None:
    _, initiator, buf, remote = kv
    src = initiator.register(bytearray(b"abcdefgh" * 512))
    batch = initiator.submit([
        Request("write", src, remote, remote_offset=0, length=100),
        Request("write", src, remote, remote_offset=1000, length=200, local_offset=8),
        Request("read", bytearray(50), remote, remote_offset=0, length=50),
    ])
    assert batch.result(5) == 350
    assert [t.result() for t in batch.transfers] == [100, 200, 50]
    assert all(t.status is TransferStatus.COMPLETED for t in batch.transfers)
    assert batch.status is TransferStatus.COMPLETED
    assert bytes(buf[1000:1200]) == bytes(src.view[8:208])
    assert src.leases == 0


def test_batch_with_a_failing_member(kv: Any) -> None:
    target, initiator, _, remote = kv
    other = bytearray(64)
    target.register(other, name="other")
    doomed = initiator.open(target.address, "other")
    target.unregister(target.regions()[-1])
    batch = initiator.submit([Request("write", b"a" * 8, remote), Request("write", b"b" * 8, doomed)])
    with pytest.raises(mpcomm.UnknownRegionError):
        batch.result(5)
    assert batch.transfers[0].result() == 8  # the good member still completed
    assert isinstance(batch.transfers[1].exception(), mpcomm.UnknownRegionError)


def test_empty_batch(kv: Any) -> None:
    assert kv[1].submit([]).result(0) == 0


def test_remote_region_round_trip_and_raw_addresses(kv: Any) -> None:
    _, initiator, buf, remote = kv
    data = remote.to_bytes()
    assert isinstance(data, bytes) and len(data) < 1024
    again = RemoteRegion.from_bytes(data)
    assert again == remote
    assert RemoteRegion.from_bytes(data.decode()) == remote
    # A descriptor that travelled out of band works for a transfer.
    initiator.write(b"oob", again, remote_offset=again.offset_of(remote.base_address + 77)).result(5)
    assert buf[77:80] == b"oob"
    assert remote.offset_of(remote.base_address) == 0
    for bad in (remote.base_address - 1, remote.base_address + remote.size + 1, 0):
        with pytest.raises(mpcomm.OutOfBoundsError):
            remote.offset_of(bad)
    with pytest.raises(mpcomm.MpcommError):
        RemoteRegion.from_bytes(b"not json")
    with pytest.raises(mpcomm.MpcommError):
        RemoteRegion.from_bytes(b'{"address": "x"}')


def test_out_of_bounds_is_refused_before_anything_moves(kv: Any) -> None:
    _, initiator, buf, remote = kv
    with pytest.raises(mpcomm.OutOfBoundsError):
        initiator.write(b"x" * 10, remote, remote_offset=remote.size - 5, length=10)
    with pytest.raises(mpcomm.OutOfBoundsError):
        initiator.read(bytearray(4), remote, length=8)
    with pytest.raises(mpcomm.OutOfBoundsError):
        initiator.write(b"x" * 10, remote, remote_offset=-1)
    assert buf == bytearray(len(buf))


def test_register_read_only_bytes_is_source_only(kv: Any) -> None:
    _, initiator, buf, remote = kv
    src = initiator.register(b"read-only source")
    assert src.access == "r"
    initiator.write(src, remote).result(5)
    assert buf[: src.size] == b"read-only source"
    with pytest.raises(mpcomm.PermissionDeniedError):
        initiator.read(src, remote)
    with pytest.raises(mpcomm.PermissionDeniedError):
        initiator.read(b"bytes are read-only", remote)  # unregistered buffer: same rule
    assert src.leases == 0


def test_read_only_remote_region(pair: Any) -> None:
    target, initiator = pair
    target.register(b"\x05" * 64, name="ro")
    remote = initiator.open(target.address, "ro")
    assert not remote.writable and remote.readable
    with pytest.raises(mpcomm.PermissionDeniedError):
        initiator.write(b"x", remote)
    out = bytearray(64)
    initiator.read(out, remote).result(5)
    assert out == b"\x05" * 64


def test_register_numpy_mmap_memoryview(kv: Any) -> None:
    _, initiator, buf, remote = kv
    arr = np.arange(256, dtype=np.uint32)
    r = initiator.register(arr)
    assert r.size == arr.nbytes and r.access == "rw"
    initiator.write(r, remote).result(5)
    assert bytes(buf[: arr.nbytes]) == arr.tobytes()

    mm = mmap.mmap(-1, 8192)
    rm = initiator.register(mm)
    initiator.read(rm, remote, length=arr.nbytes).result(5)
    assert mm[: arr.nbytes] == arr.tobytes()

    back = np.zeros(256, dtype=np.uint32)
    initiator.read(initiator.register(memoryview(back)), remote, length=arr.nbytes).result(5)
    assert (back == arr).all()

    two_d = np.ones((4, 16), dtype=np.float64)  # multi-dimensional, still contiguous
    assert initiator.register(two_d).size == two_d.nbytes
    for region in initiator.regions():
        initiator.unregister(region)


def test_non_contiguous_buffer_is_refused(make_engine: Any) -> None:
    e = make_engine()
    with pytest.raises(mpcomm.RegionError, match="contiguous"):
        e.register(np.arange(100)[::2])
    with pytest.raises(mpcomm.RegionError, match="contiguous"):
        e.register(memoryview(bytearray(100))[::3])
    with pytest.raises(mpcomm.RegionError):
        e.register(object())
    with pytest.raises(mpcomm.RegionError):
        e.register(bytearray())


def test_duplicate_region_name(make_engine: Any) -> None:
    e = make_engine()
    e.register(bytearray(16), name="dup")
    with pytest.raises(mpcomm.RegionError, match="dup"):
        e.register(bytearray(16), name="dup")
    assert [r.name for r in e.regions()] == ["dup"]


def test_alignment(make_engine: Any) -> None:
    e = make_engine({"memory": {"alignment": 4096}})
    for size in (1, 4096, 10_000):
        assert e.allocate(size).address % 4096 == 0
    page = mmap.mmap(-1, 3 * 4096)
    view = memoryview(page)
    aligned = e.register(view[4096:8192], name="aligned")  # mmap is page aligned
    assert aligned.address % 4096 == 0
    with pytest.raises(mpcomm.AlignmentError) as info:
        e.register(view[1:4097], name="unaligned")
    assert "memory.alignment" in str(info.value) and "allocate" in str(info.value)
    assert "unaligned" not in [r.name for r in e.regions()]
    e.unregister(aligned)


def test_unregister_refuses_a_leased_region_and_waits_with_a_timeout(make_engine: Any) -> None:
    e = make_engine()
    r = e.register(bytearray(64), name="leased")
    r.acquire()  # what a request in flight holds (see test_core_backpressure for a real one)
    with pytest.raises(mpcomm.RegionBusyError):
        e.unregister(r)
    with pytest.raises(mpcomm.RegionBusyError):
        e.unregister(r, timeout=0.1)
    threading.Timer(0.3, r.release).start()
    e.unregister(r, timeout=5)
    assert r.closed and e.regions() == []


def test_unregistered_buffer_can_be_freed(make_engine: Any) -> None:
    e = make_engine()
    page = mmap.mmap(-1, 4096)
    region = e.register(page, name="page")
    e.unregister(region)
    page.close()  # the caller owns the buffer again
    buf = bytearray(64)
    e.unregister(e.register(buf, name="grow"))
    buf.extend(b"more")
    assert len(buf) == 68


def test_closed_engine(make_engine: Any) -> None:
    e = make_engine()
    e.close()
    with pytest.raises(mpcomm.EngineClosedError):
        e.register(bytearray(8))
    e.close()  # idempotent


def test_prepared_batch_posts_again_and_again(kv: Any) -> None:
    target, initiator, buf, remote = kv
    src = initiator.register(bytearray(b"p" * 64 + b"q" * 64))
    prepared = initiator.prepare([Request("write", src, remote, 0, 64), Request("write", src, remote, 64, 64,
                                                                                 local_offset=64)])
    assert prepared.count == 2
    for _ in range(3):
        batch = prepared.post()
        assert batch.result(5) == 128 and batch.statuses == [TransferStatus.COMPLETED] * 2
    assert bytes(buf[:128]) == b"p" * 64 + b"q" * 64
    many = initiator.prepare_many("write", src, remote, [0, 64], [256, 512], [64, 64])
    assert many.post().result(5) == 128 and bytes(buf[256:320]) == b"p" * 64 and bytes(buf[512:576]) == b"q" * 64


def test_prepare_refuses_what_it_cannot_repeat(kv: Any) -> None:
    _, initiator, _, remote = kv
    with pytest.raises(mpcomm.MpcommError, match="registered Regions"):
        initiator.prepare([Request("write", b"plain bytes", remote, 0)])
    src = initiator.register(bytearray(16))
    with pytest.raises(mpcomm.OutOfBoundsError, match="request 1 of the batch"):
        initiator.prepare([Request("write", src, remote, 0, 16), Request("write", src, remote, remote.size - 8, 16)])
    with pytest.raises(mpcomm.OutOfBoundsError):
        initiator.prepare_many("write", src, remote, [0], [remote.size], [16])


def test_write_many_names_the_bad_index_and_moves_nothing(kv: Any) -> None:
    _, initiator, buf, remote = kv
    src = initiator.register(bytearray(b"z" * 64))
    with pytest.raises(mpcomm.OutOfBoundsError, match="request 2 of the batch"):
        initiator.write_many(src, remote, [0, 0, 0], [0, 16, remote.size - 4], [8, 8, 8])
    assert bytes(buf[:24]) == bytes(24)
    np_batch = initiator.write_many(src, remote, np.array([0, 8]), np.array([100, 200]), np.array([8, 8]))
    assert np_batch.result(5) == 16 and np_batch.failed == [] and np_batch.bytes_per_request == [8, 8]


def test_waiters_settle_and_callbacks_run_once_under_races(kv: Any) -> None:
    """A handle whose waiter settles it (no completion-thread hop) still runs every callback once,
    wakes concurrent.futures.wait, and is settled even when its waiter gave up just before the report."""
    _target, ini, _buf, remote = kv
    ran: list[int] = []
    lock = threading.Lock()
    handles: list[Transfer] = []

    def note(k: int) -> Any:
        def cb(_t: Transfer) -> None:
            with lock:
                ran.append(k)
        return cb

    def worker(base: int) -> None:
        for k in range(base, base + 150):
            t = ini.write(b"x" * 4096, remote, (k % 16) * 4096)
            handles.append(t)
            mode = k % 4
            if mode == 0:
                t.add_done_callback(note(k))  # before the waiter: the completion thread runs it
                t.result(10)
            elif mode == 1:
                try:
                    t.result(0.00005)  # gives up, likely just before the report
                except TimeoutError:
                    pass
                t.add_done_callback(note(k))
            elif mode == 2:
                th = threading.Thread(target=lambda t=t, k=k: t.add_done_callback(note(k)))
                th.start()  # races with the waiter below
                t.result(10)
                th.join()
            else:
                t.result(10)
                t.add_done_callback(note(k))  # done: at once

    threads = [threading.Thread(target=worker, args=(b,)) for b in (0, 1000, 2000)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    done, not_done = cf.wait(handles, timeout=10)
    assert not not_done and all(t.status is TransferStatus.COMPLETED for t in handles)
    deadline = time.monotonic() + 10
    while len(ran) < len(handles) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert sorted(ran) == sorted(range(0, 150)) + sorted(range(1000, 1150)) + sorted(range(2000, 2150))


def test_a_finished_request_is_freed_without_the_cyclic_gc(kv: Any) -> None:
    """Handle and operation do not keep each other alive: buffers go when the caller drops them."""
    import gc
    import weakref

    from mpcomm import Operation

    _target, ini, _buf, remote = kv
    gc.collect()
    gc.disable()
    try:
        refs = []
        for _ in range(50):
            src = bytearray(b"y" * 8192)  # an ephemeral region per request
            t = ini.write(src, remote, 0)
            assert t.result(10) == 8192
            assert t.request.length == 8192 and t.request.op == "write"  # still there after the release
            refs.append(weakref.ref(t))
            del t, src
        time.sleep(0.2)  # the completion thread lets go of the last ones
        left = [o for o in gc.get_objects() if isinstance(o, Operation)]
        assert sum(r() is not None for r in refs) <= 2 and len(left) <= 2, (len(left), sum(r() is not None for r in refs))
    finally:
        gc.enable()


def test_dropping_a_request_of_a_prepared_posting_leaves_the_batchs_arrays_alone(kv: Any) -> None:
    """A prepared batch's groups share its checked arrays (``copy=False``); cancelling one
    request of one posting (``OperationGroup.drop``) must not empty it in every later one."""
    from array import array

    from mpcomm.transport import OperationGroup

    _, initiator, _, remote = kv
    local = initiator.register(bytearray(64), name="src")
    offsets, lengths = array("q", [0, 8, 16]), array("q", [8, 8, 8])
    now = time.monotonic()
    shared = OperationGroup("write", local, remote, offsets, offsets, lengths, now + 5, time.time() + 5, copy=False)
    with shared.lock:
        shared.drop(1)
    assert list(shared.lengths) == [8, 0, 8] and list(lengths) == [8, 8, 8]
    own = OperationGroup("write", local, remote, offsets, offsets, lengths, now + 5, time.time() + 5)
    with own.lock:
        own.drop(0)
    assert list(own.lengths) == [0, 8, 8] and list(lengths) == [8, 8, 8]


@pytest.mark.parametrize("kw", [{"length": 16.0}, {"local_offset": 1.0}, {"remote_offset": 8.0}, {"length": "16"}])
def test_a_non_integer_offset_or_length_is_refused_before_anything_moves(kv: Any, kw: dict[str, Any]) -> None:
    """A float that compares in bounds used to be posted and fail inside the transport."""
    _, initiator, buf, remote = kv
    src = initiator.register(bytearray(b"\x07" * 64), name="src")
    buf[:64] = bytes(64)
    for _ in range(2):  # the first request of the pair, then with its binding made
        with pytest.raises(mpcomm.MpcommError, match="must be an integer"):
            initiator.write(src, remote, **kw)
        initiator.write(src, remote, 32, 8).result(10)
    assert buf[:32] == bytes(32) and buf[32:40] == b"\x07" * 8


def test_numpy_integers_are_offsets_and_lengths(kv: Any) -> None:
    _, initiator, buf, remote = kv
    src = initiator.register(bytearray(b"\x05" * 64), name="src")
    initiator.write(src, remote, np.int64(8), np.int32(16), local_offset=np.uint8(4)).result(10)
    assert buf[8:24] == b"\x05" * 16


@pytest.mark.parametrize("how", ["submit", "write_many", "read_many", "prepared", "members", "submit-notify"])
@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_a_finished_batch_and_its_groups_are_freed_without_the_cyclic_gc(make_engine: Any, how: str,
                                                                         transport: str) -> None:
    """Batch -> parts -> group -> batch (the engine's back reference) and member -> group ->
    member_handles -> member were cycles: every finished batch waited for the cycle collector.
    With the collector off, the batch and its groups go when the caller drops the handle."""
    import gc
    import weakref

    from mpcomm.transport import OperationGroup

    target, ini = make_engine(transports=[transport]), make_engine(transports=[transport])
    target.register(bytearray(1 << 16), name="kv")
    remote = ini.open(target.address, "kv")
    src = ini.register(bytearray(1 << 16), name="src")
    offs, lens = [0, 4096, 8192], [4096, 4096, 4096]
    prepared = ini.prepare_many("write", src, remote, offs, offs, lens) if how == "prepared" else None

    def one() -> mpcomm.Batch:
        if how == "submit":
            return ini.submit([Request("write", src, remote, o, o, n) for o, n in zip(offs, lens)])
        if how == "submit-notify":  # a lone notifying request beside a group
            return ini.submit([Request("write", src, remote, o, o, n, notify=b"n" if o == 0 else None)
                               for o, n in zip(offs, lens)])
        if how in ("write_many", "members"):
            return ini.write_many(src, remote, offs, offs, lens)
        if how == "read_many":
            return ini.read_many(src, remote, offs, offs, lens)
        return prepared.post()

    for _ in range(3):  # warm: connections, bindings, caches
        one().result(10)
    gc.collect()
    gc.disable()
    try:
        refs = []
        for _ in range(30):
            b = one()
            assert b.result(10) == sum(lens)
            if how == "members":
                assert [t.result(10) for t in b.transfers] == lens
            groups = [p for _, p in b.parts if isinstance(p, OperationGroup)]
            assert groups
            refs += [weakref.ref(b)] + [weakref.ref(g) for g in groups]
            del b, groups
        deadline = time.monotonic() + 5
        while any(r() is not None for r in refs) and time.monotonic() < deadline:
            time.sleep(0.01)  # the completion thread lets go of the last ones
        alive = sum(r() is not None for r in refs)
        assert alive == 0, f"{alive} of {len(refs)} batches and groups kept alive by cycles"
        assert gc.collect() < 10  # nothing was left to the collector (one batch's cycle was 17-27 objects)
    finally:
        gc.enable()
