"""Posted shm copies (past inline_threshold): the result() caller claims them, else a worker takes them.

(The property itself, no other Python thread while the caller waits, is tests/conformance/
test_completion_on_waiter.py; these are the rest of the contract.)
"""

from __future__ import annotations

import hashlib
import threading
import time
from concurrent.futures import wait

import pytest
from shm_support import make_engine

import mpcomm
from mpcomm.plugins.shm import _copyloop, _posted

MiB = 1 << 20
POSTED = {"plugins": {"shm": {"inline_threshold": 64 << 10}}}


@pytest.mark.parametrize("name", ["mem", "buf"])
def test_posted_copies_nobody_waits_on_land_through_the_workers(spawn, name: str) -> None:
    """No caller in result(): each copy is taken by a worker after the claim window, and the
    callbacks run on the engine's completion thread, as before."""
    target = spawn({"mem": [8 * MiB, "allocate"], "buf": [8 * MiB, "buffer"]})
    with make_engine(POSTED) as eng:
        remote = eng.open(target.address, name)
        src = eng.allocate(8 * MiB)
        src.view[:] = bytes(range(256)) * (8 * MiB // 256)
        seen: list[str] = []
        ts = []
        for i in range(8):
            t = eng.write(src, remote, i * MiB, MiB, local_offset=i * MiB)
            t.add_done_callback(lambda _t: seen.append(threading.current_thread().name))
            ts.append(t)
        done, _ = wait(ts, timeout=30)
        assert len(done) == 8 and all(t.exception() is None for t in ts)
        deadline = time.monotonic() + 10
        while len(seen) < 8 and time.monotonic() < deadline:
            time.sleep(0.01)
        # On the completion thread, or here when the copy had landed before add_done_callback
        # (a handle already done runs it at once): never on the thread that copied.
        assert len(seen) == 8 and set(seen) <= {"mpcomm-completions", threading.current_thread().name}, seen
        assert target.cmd("sha", name, 0, 8 * MiB) == hashlib.sha256(src.view).hexdigest()


def test_a_posted_batch_and_a_striped_copy_land_when_waited_on(spawn) -> None:
    target = spawn({"mem": [64 * MiB, "allocate"]})
    cfg = {"plugins": {"shm": {"inline_threshold": 64 << 10, "stripe_threshold": 4 * MiB, "stripes": 4}}}
    with make_engine(cfg) as eng:
        remote = eng.open(target.address, "mem")
        src = eng.allocate(64 * MiB)
        src.view[:] = bytes(range(251)) * (64 * MiB // 251) + bytes(64 * MiB % 251)
        assert eng.write(src, remote, 0, 16 * MiB).result(30) == 16 * MiB  # four pieces
        offs = [i * 256 * 1024 for i in range(64)]
        assert eng.write_many(src, remote, offs, offs, [256 * 1024] * 64).result(30) == 16 * MiB
        assert target.cmd("sha", "mem", 0, 16 * MiB) == hashlib.sha256(src.view[: 16 * MiB]).hexdigest()
        dst = eng.allocate(16 * MiB)
        assert eng.read(dst, remote, 0, 16 * MiB).result(30) == 16 * MiB
        assert bytes(dst.view) == bytes(src.view[: 16 * MiB])


def test_each_posted_job_runs_once_whoever_claims_it() -> None:
    """Claims from several threads against the workers: every job runs exactly once, and a
    slot reused by a later job is never run by an earlier job's claim."""
    loop = _copyloop.get()
    if not loop.native:
        pytest.skip(f"no compiled copy loop: {loop.reason}")
    import logging

    ring = _posted.PostedCopies(loop, 2, 20e-6, logging.getLogger("test"))
    runs: dict[int, int] = {}
    lock = threading.Lock()

    def job(i: int) -> None:
        with lock:
            runs[i] = runs.get(i, 0) + 1

    jobs = []
    for i in range(2000):
        j = ring.post(job, i)
        while j is None:  # every slot waits: let the workers drain some
            time.sleep(0.0001)
            j = ring.post(job, i)
        jobs.append(j)
        if i % 3 == 0 and ring.claim(j):
            j.run()
    stale = jobs[:50]  # their slots were reused many times since
    claimed = [j for j in stale if ring.claim(j)]
    assert claimed == []
    deadline = time.monotonic() + 10
    while len(runs) < 2000 and time.monotonic() < deadline:
        time.sleep(0.01)
    ring.close()
    assert sorted(runs) == list(range(2000)) and set(runs.values()) == {1}


def test_close_with_posted_copies_waiting_returns_after_they_ended(spawn) -> None:
    target = spawn({"mem": [64 * MiB, "allocate"]})
    eng = make_engine({"plugins": {"shm": {"inline_threshold": 64 << 10}}})
    remote = eng.open(target.address, "mem")
    src = eng.allocate(64 * MiB)
    ts = [eng.write(src, remote, 0, 8 * MiB) for _ in range(6)]
    eng.close()
    for t in ts:
        assert t.done()
        assert t.exception() is None or isinstance(t.exception(), mpcomm.MpcommError)
