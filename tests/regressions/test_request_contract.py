"""The contract statements of issue 8 ("What the request path must become") that are not
a numbered defect: callback threads, vectorised batches and bulk polling.

The target engine runs in its own process (``rtarget.py``); the initiator here.
"""

from __future__ import annotations

import dataclasses
import hashlib
import threading
import time
from typing import Any

import pytest

import mpcomm
from mpcomm import Request, TransferStatus
from mpcomm.errors import AccessError, MpcommError, OutOfBoundsError, TransferError, TransferTimeout

np = pytest.importorskip("numpy")

CALLBACK_THREADS = {"mpcomm-completions", "MainThread"}
PIECE = 4096


def _sha(b: Any) -> str:
    return hashlib.sha256(b).hexdigest()


def _serve(tgt: Any, size: int, name: str = "kv", var: str = "reg") -> None:
    tgt.run(f"buf_{var} = bytearray({size}); {var} = engine.register(buf_{var}, name={name!r})")


@pytest.fixture(params=["shm", "tcp"])
def env(request, engine, target):
    """(initiator, target process, remote 'kv' of 1 MiB, transport name)."""
    tgt = target([request.param])
    _serve(tgt, 1 << 20)
    tgt.run("buf_reg[:] = bytes(range(251)) * (len(buf_reg) // 251) + bytes(len(buf_reg) % 251)")
    ini = engine([request.param], {"runtime": {"abort_grace_ms": 300}})
    return ini, tgt, ini.open(tgt.address, "kv"), request.param


# -- callbacks: which thread, no lock, may submit and wait ------------------------------------------


def test_callbacks_run_on_the_completion_thread_outside_locks(env):
    """Callbacks of successes, failures, timeouts and cancels run on the completion thread (or the
    caller's), never on a transport's thread or the deadline timer, hold no lock, and may submit
    and wait on another transfer."""
    ini, tgt, remote, transport = env
    src = ini.allocate(1 << 20)
    seen: list[tuple[str, str, Any]] = []
    lock = threading.Lock()
    done = threading.Semaphore(0)

    def cb(label: str) -> Any:
        def run(t: Any) -> None:
            name = threading.current_thread().name
            # Another thread can look at the handle and the engine meanwhile: no lock is held.
            probe = threading.Thread(target=lambda: (t.done(), t.status, ini.stats()))
            probe.start()
            probe.join(2.0)
            follow: Any
            try:
                follow = ini.write(src, remote, 0, 64, timeout=5).result(5)  # submit and wait, in a callback
            except BaseException as exc:  # noqa: BLE001
                follow = exc
            with lock:
                seen.append((label, name, (probe.is_alive(), follow)))
            done.release()
        return run

    handles = {
        "ok-small": ini.write(src, remote, 0, 4096),
        "ok-large": ini.write(src, remote, 0, 1 << 20),
        "ok-batch": ini.write_many(src, remote, [0, 4096], [8192, 16384], [4096, 4096]),
        "failed": ini.write(src, dataclasses.replace(remote, token=remote.token ^ 1), 0, 4096),
        "cancelled": ini.write_many(src, remote, [0], [0], [64], post=False),
    }
    for label, h in handles.items():
        h.add_done_callback(cb(label))
    handles["cancelled"].cancel()
    for _ in handles:
        assert done.acquire(timeout=15), f"callbacks ran: {[s[0] for s in seen]}"
    for label, name, (blocked, follow) in seen:
        assert name in CALLBACK_THREADS, f"{label}: callback ran on {name!r}"
        assert not blocked, f"{label}: another thread blocked on the handle while its callback ran"
        assert follow == 64, f"{label}: a write submitted and awaited in the callback gave {follow!r}"
    assert handles["failed"].status is TransferStatus.FAILED
    assert handles["cancelled"].status is TransferStatus.CANCELLED


def test_timeout_callback_runs_off_the_timer(engine, target):
    """The callback of a request that timed out (deadline timer, abort) runs on the completion thread."""
    tgt = target(["tcp"])
    _serve(tgt, 4 << 20)
    ini = engine(["tcp"], {"runtime": {"abort_grace_ms": 200}})
    remote = ini.open(tgt.address, "kv")
    src = ini.allocate(1 << 20)
    ini.write(src, remote, 0, 4096).result(5)
    tgt.stop()
    try:
        names: list[str] = []
        ev = threading.Event()
        t = ini.write(src, remote, 0, 1 << 20, timeout=0.2)
        t.add_done_callback(lambda f: (names.append(threading.current_thread().name), ev.set()))
        with pytest.raises(TransferTimeout):
            t.result(5)
        assert ev.wait(5)
        assert names == ["mpcomm-completions"], names
    finally:
        tgt.cont()


# -- vectorised batches -----------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["numpy", "list", "addresses"])
def test_write_many_and_read_many(env, kind):
    """N requests in one call (numpy arrays, lists, or raw remote addresses): one handle, per-index
    status and byte counts, the bytes exactly where each index says."""
    ini, tgt, remote, _ = env
    n = 64
    rng = np.random.default_rng(7)
    local_off = (np.arange(n, dtype=np.int64) * PIECE)[::-1].copy()
    remote_off = rng.permutation(np.arange(n, dtype=np.int64) * 2 * PIECE + 3)
    lengths = rng.integers(1, PIECE, n, dtype=np.int64)
    src = ini.register(bytearray(rng.integers(0, 256, n * PIECE, dtype=np.uint8).tobytes()))
    args: dict[str, Any]
    if kind == "numpy":
        args = {"remote_offsets": remote_off}
        lo: Any = local_off
        ln: Any = lengths
    elif kind == "list":
        args = {"remote_offsets": remote_off.tolist()}
        lo, ln = local_off.tolist(), lengths.tolist()
    else:
        args = {"remote_addresses": (remote_off + remote.base_address).tolist()}
        lo, ln = local_off, lengths.tolist()
    before = tgt.ev("sha(buf_reg)")
    b = ini.write_many(src, remote, lo, lengths=ln, **args)
    assert isinstance(b, mpcomm.Batch) and b.count == n
    assert b.result(10) == int(lengths.sum())
    assert b.statuses == [TransferStatus.COMPLETED] * n
    assert b.bytes_per_request == lengths.tolist()
    assert b.failed == []
    for i in range(n):
        lo_i, ro_i, ln_i = int(local_off[i]), int(remote_off[i]), int(lengths[i])
        assert tgt.ev(f"sha(buf_reg[{ro_i}:{ro_i + ln_i}])") == _sha(src.view[lo_i:lo_i + ln_i]), f"index {i}"
    assert tgt.ev("sha(buf_reg)") != before
    dst = ini.register(bytearray(n * PIECE))
    r = ini.read_many(dst, remote, lo, lengths=ln, **args)
    assert r.result(10) == int(lengths.sum())
    assert r.statuses == [TransferStatus.COMPLETED] * n
    for i in range(n):
        lo_i, ln_i = int(local_off[i]), int(lengths[i])
        assert bytes(dst.view[lo_i:lo_i + ln_i]) == bytes(src.view[lo_i:lo_i + ln_i]), f"read index {i}"
    assert src.leases == dst.leases == 0


def test_batch_bounds_checked_before_anything_moves(env):
    """One bad index refuses the whole batch before any byte moves, holding nothing."""
    ini, tgt, remote, _ = env
    src = ini.register(bytearray(b"\x99" * (16 * PIECE)))
    before = tgt.ev("sha(buf_reg)")
    lo = np.arange(16, dtype=np.int64) * PIECE
    ro = np.arange(16, dtype=np.int64) * PIECE
    ln = np.full(16, PIECE, dtype=np.int64)
    for bad_ro, bad_lo, bad_ln in ((remote.size - 10, None, None), (None, 15 * PIECE + 1, None), (None, None, -1)):
        r, l_, n_ = ro.copy(), lo.copy(), ln.copy()
        if bad_ro is not None:
            r[9] = bad_ro
        if bad_lo is not None:
            l_[9] = bad_lo
        if bad_ln is not None:
            n_[9] = bad_ln
        with pytest.raises(OutOfBoundsError, match="request 9"):
            ini.write_many(src, remote, l_, r, n_)
    with pytest.raises(MpcommError):
        ini.write_many(src, remote, lo, ro, ln[:-1])  # lengths of unequal size
    with pytest.raises(MpcommError):
        ini.write_many(src, remote, lo.reshape(4, 4), ro, ln)
    time.sleep(0.1)
    assert tgt.ev("sha(buf_reg)") == before, "a refused batch moved bytes"
    assert src.leases == 0 and ini.stats()["requests_held"] == 0


def test_batch_partial_failure_reports_failed_indices(env):
    """Indices the target refuses (past the real end, through a descriptor forged to be larger) fail;
    the handle says which, and every index it reports completed landed. (A transport may refuse a
    forged descriptor for the whole group: shm checks the size it mapped; tcp checks per index.)"""
    ini, tgt, remote, transport = env
    forged = dataclasses.replace(remote, size=remote.size * 2)
    n = 8
    ro = [i * PIECE if i % 3 else remote.size + i * PIECE for i in range(n)]  # 0, 3, 6 past the end
    src = ini.register(bytearray(b"\x5c" * (n * PIECE)))
    b = ini.write_many(src, forged, [i * PIECE for i in range(n)], ro, [PIECE] * n, timeout=5)
    with pytest.raises((AccessError, TransferError)):
        b.result(10)
    failed = b.failed
    assert {0, 3, 6} <= set(failed), failed
    assert set(b.errors) == set(failed)
    if transport == "tcp":
        assert failed == [0, 3, 6], failed
    for i in range(n):
        want = TransferStatus.FAILED if i in failed else TransferStatus.COMPLETED
        assert b.statuses[i] is want, (i, b.statuses[i])
        assert b.bytes_per_request[i] == (0 if i in failed else PIECE)
        if i % 3:
            got = tgt.ev(f"sha(buf_reg[{ro[i]}:{ro[i] + PIECE}])")
            assert (got == _sha(b"\x5c" * PIECE)) == (i not in failed), f"index {i}: landed iff completed"
    assert src.leases == 0


def test_completion_queue_bulk_polling(env):
    """Handles posted with a completion queue are reaped in bulk by poll(), on the polling thread."""
    ini, tgt, remote, _ = env
    q = ini.completion_queue()
    src = ini.allocate(64 * PIECE)
    ran_on: list[int] = []
    posted: list[Any] = []
    for i in range(10):
        posted.append(ini.write(src, remote, i * PIECE, PIECE, local_offset=i * PIECE, completion_queue=q))
        posted.append(ini.write_many(src, remote, [0, PIECE], [100 * PIECE, 101 * PIECE], [PIECE, PIECE],
                                     completion_queue=q))
    for h in posted:
        h.add_done_callback(lambda f: ran_on.append(threading.get_ident()))
    reaped: list[Any] = []
    end = time.monotonic() + 10
    while len(reaped) < len(posted) and time.monotonic() < end:
        reaped += q.poll(7, timeout=0.5)
    assert len(reaped) == len(posted), f"reaped {len(reaped)} of {len(posted)}"
    assert {id(h) for h in reaped} == {id(h) for h in posted}, "a handle was reaped twice or not at all"
    assert all(h.status is TransferStatus.COMPLETED for h in reaped)
    assert ran_on and set(ran_on) == {threading.get_ident()}, "callbacks did not run on the polling thread"
    assert len(ran_on) == len(posted)
    assert q.poll(64, timeout=0) == []
    # result() still works on a queue's handle from any thread, reaped or not.
    h = ini.write(src, remote, 0, PIECE, completion_queue=q)
    assert h.result(5) == PIECE
    assert q.poll(64, timeout=1) == [h]


def test_submit_groups_into_one_slot(env):
    """A batch of many same-shaped requests takes one queue_depth slot, one lease and one deadline,
    and moves every index."""
    ini, tgt, remote, _ = env
    src = ini.allocate(256 * PIECE)
    reqs = [Request("write", src, remote, i * PIECE, PIECE, local_offset=i * PIECE) for i in range(256)]
    b = ini.submit(reqs, post=False)
    assert ini.stats()["requests_held"] == 1  # one slot
    assert src.leases == 1  # one lease
    assert len([e for e in ini._timer._heap if e[2] is not None]) == 1  # one deadline
    ini.post(b)
    assert b.result(10) == 256 * PIECE
    assert tgt.ev(f"sha(buf_reg[:{256 * PIECE}])") == _sha(src.view)
    assert ini.stats()["requests_held"] == 0


# -- a full transport: the engine holds the request -------------------------------------------------


@pytest.mark.parametrize("finish_on_busy", [False, True], ids=["busy", "last-finishes-while-refused"])
def test_full_transport_requests_are_held_not_lost(finish_on_busy):
    """A transport that says it is full (TransportBusy) gets the request again once one of its
    requests finished, also when that last one finishes exactly while the new one is refused.

    In one process: the fake transport's "network" is the process's own region tables.
    """
    from rsupport import busy_plugin

    cfg = {"plugins": {"busy": {"capacity": 1, "finish_on_busy": finish_on_busy}}}
    tgt = mpcomm.Engine(cfg, transports=["busy"], plugins=[busy_plugin()], autoload=False)
    ini = mpcomm.Engine(cfg, transports=["busy"], plugins=[busy_plugin()], autoload=False)
    try:
        buf = bytearray(64 * PIECE)
        tgt.register(buf, name="kv")
        remote = ini.open(tgt.address, "kv")
        src = ini.register(bytearray(b"\x3c" * (64 * PIECE)))
        handles = [ini.write(src, remote, i * PIECE, PIECE, local_offset=i * PIECE, timeout=3) for i in range(16)]
        for i, h in enumerate(handles):
            assert h.result(5) == PIECE, f"request {i}: {h!r}"
        assert bytes(buf[: 16 * PIECE]) == b"\x3c" * (16 * PIECE)
        assert ini.transports["busy"].refused > 0, "the transport was never full: nothing was tested"
        assert ini.stats()["requests_held"] == 0
    finally:
        ini.close(timeout=2)
        tgt.close(timeout=2)


def test_full_transport_batch_is_held_not_failed():
    """A vectorised batch on a transport that is full (default post_many) is held, not failed."""
    from rsupport import busy_plugin

    cfg = {"plugins": {"busy": {"capacity": 1}}}
    tgt = mpcomm.Engine(cfg, transports=["busy"], plugins=[busy_plugin()], autoload=False)
    ini = mpcomm.Engine(cfg, transports=["busy"], plugins=[busy_plugin()], autoload=False)
    try:
        buf = bytearray(16 * PIECE)
        tgt.register(buf, name="kv")
        remote = ini.open(tgt.address, "kv")
        src = ini.register(bytearray(b"\x3d" * (16 * PIECE)))
        offs = [i * PIECE for i in range(8)]
        b = ini.write_many(src, remote, offs, offs, [PIECE] * 8, timeout=3)
        assert b.result(5) == 8 * PIECE, b.failed
        assert bytes(buf[: 8 * PIECE]) == b"\x3d" * (8 * PIECE)
    finally:
        ini.close(timeout=2)
        tgt.close(timeout=2)


def test_batch_float_offsets_are_refused(env):
    """Offsets and lengths must be integers: a numpy float array is bad input, refused with a clear error."""
    ini, tgt, remote, _ = env
    src = ini.register(bytearray(8 * PIECE))
    with pytest.raises(MpcommError):
        ini.write_many(src, remote, [0, PIECE], [0.0, 1.0], [PIECE, PIECE])  # a list of floats: refused
    with pytest.raises(MpcommError):
        ini.write_many(src, remote, np.array([0.0, 4096.5]), np.array([0, PIECE]), np.array([PIECE, PIECE]))


def test_every_handle_is_delivered_exactly_once_under_concurrency(env):
    """Many threads posting small and large requests, single and vectorised, with and without a
    completion queue: every callback runs exactly once and every queue handle is reaped exactly once."""
    ini, tgt, remote, _ = env
    src = ini.allocate(1 << 20)
    q = ini.completion_queue()
    lock = threading.Lock()
    calls: dict[int, int] = {}
    queued: list[Any] = []
    direct: list[Any] = []

    def count(f: Any) -> None:
        with lock:
            calls[id(f)] = calls.get(id(f), 0) + 1

    def worker(k: int) -> None:
        for i in range(150):
            size = PIECE if i % 3 else 300 << 10  # inline and off-thread completions
            cq = q if i % 2 else None
            if i % 5 == 0:
                h = ini.write_many(src, remote, [0, PIECE], [k * PIECE, (k + 8) * PIECE], [PIECE, PIECE],
                                   completion_queue=cq)
            else:
                h = ini.write(src, remote, 0, size, completion_queue=cq)
            h.add_done_callback(count)
            with lock:
                (queued if cq is not None else direct).append(h)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    [t.start() for t in threads]
    reaped: list[Any] = []
    while any(t.is_alive() for t in threads):
        reaped += q.poll(64, timeout=0.01)
    [t.join() for t in threads]
    end = time.monotonic() + 20
    while len(reaped) < len(queued) and time.monotonic() < end:
        reaped += q.poll(64, timeout=0.2)
    assert len(reaped) == len(queued), f"reaped {len(reaped)} of {len(queued)}"
    assert len({id(h) for h in reaped}) == len(reaped), "a handle was reaped twice"
    for h in direct:
        h.result(10)
    end = time.monotonic() + 10
    while sum(calls.values()) < len(queued) + len(direct) and time.monotonic() < end:
        time.sleep(0.01)
    handles = queued + direct
    assert all(calls.get(id(h)) == 1 for h in handles), \
        f"{sum(calls.get(id(h), 0) != 1 for h in handles)} handles' callbacks did not run exactly once"
    assert all(h.status is TransferStatus.COMPLETED for h in handles)
