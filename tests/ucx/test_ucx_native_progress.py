"""The worker's progress in a native loop (plugins/ucx/_ucxloop.c, mpcomm_ucx_loop_run): a target
whose interpreter is busy still serves UCX's two-sided work (tcp's emulated puts and gets), and a
result() waiter reports its own request (Transport.drive) without the transport's Python thread."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time
from typing import Any

import pytest
from ucx_support import StoppableTarget

import mpcomm
from mpcomm.plugins.ucx import _native
from mpcomm.testing.fixtures import make_engine  # noqa: F401 (fixture)
from mpcomm.testing.spinning import SpinningTarget
from mpcomm.plugins.ucx.transport import UcxTransport

AVAIL = UcxTransport.availability()
pytestmark = [
    pytest.mark.skipif(not AVAIL, reason=f"ucx transport unavailable: {AVAIL.reason}"),
    pytest.mark.skipif(AVAIL and _native.load() is None, reason=f"ucx native helper: {_native.reason}"),
]

TCP = {"plugins": {"ucx": {"tls": "tcp,self"}}}  # RMA emulated over active messages: the target must progress

def _p50(ini: mpcomm.Engine, src: Any, remote: Any, n: int, fill: int) -> float:
    lat = []
    for i in range(n):
        src.view[:4096] = bytes([(fill + i) % 251]) * 4096
        t = time.perf_counter()
        ini.write(src, remote, (i % 16) * 4096, 4096).result(5)
        lat.append(time.perf_counter() - t)
    return sorted(lat)[len(lat) // 2]


def _wired(ini: Any, address: str, writes: int) -> tuple[Any, Any, Any]:
    """``ini``'s handle on the target's "kv", a 4 KiB source and its ucx transport, after ``writes``
    4 KiB writes (the region attached and the endpoint wired up)."""
    remote = ini.open(address, "kv", timeout=10)
    src = ini.allocate(4096)
    for _ in range(writes):
        ini.write(src, remote, 0, 4096).result(5)
    return remote, src, ini.transports["ucx"]


def test_a_target_spinning_in_python_still_serves_tcp_puts_and_gets(make_engine: Any) -> None:
    with SpinningTarget(TCP, ["ucx"]) as target:
        ini = make_engine(TCP, transports=["ucx"])
        remote = ini.open(target.address, "kv", timeout=10)
        src = ini.allocate(256 << 10)
        idle = _p50(ini, src, remote, 50, 0)  # attaches and wires up while the target is idle
        target.spin()  # the spinner has the GIL; with a 10 s switch interval it keeps it
        t0 = time.monotonic()
        busy = _p50(ini, src, remote, 50, 100)  # each within 5 s (Python progress: ~10 s each)
        back = bytearray(16 * 4096)
        ini.read(back, remote, 0).result(5)
        last = {i % 16: i for i in range(50)}  # the last of the 50 writes to each 4 KiB slot
        expect = b"".join(bytes([(100 + last[k]) % 251]) * 4096 for k in range(16))
        assert bytes(back) == expect
        big = bytes(range(256)) * 1024  # 256 KiB: many tcp fragments, all served by the target's loop
        src.view[:] = big
        ini.write(src, remote, 512 << 10).result(5)
        back = bytearray(256 << 10)
        ini.read(back, remote, 512 << 10).result(5)
        assert bytes(back) == big
        took = time.monotonic() - t0
        assert took < 5, f"50 writes and 3 more requests took {took:.1f} s against a target holding its GIL"
        print(f"\nspinning target over UCX_TLS=tcp,self: 4 KiB write p50 {busy * 1e6:.0f} us vs idle "
              f"{idle * 1e6:.0f} us (ratio {busy / idle:.2f}); the rest in {took:.2f} s")


def test_without_the_native_loop_the_spinning_target_stalls_its_peer(make_engine: Any) -> None:
    """The control: the same target with the Python progress thread (MPCOMM_UCX_NATIVE=0) is what the
    native loop fixes -- one write waits for the target's GIL (its 10 s switch interval)."""
    with SpinningTarget(TCP, ["ucx"], env=dict(os.environ, MPCOMM_UCX_NATIVE="0")) as target:
        ini = make_engine(TCP, transports=["ucx"])
        remote = ini.open(target.address, "kv", timeout=10)
        src = ini.allocate(4096)
        _p50(ini, src, remote, 5, 0)
        target.spin()
        t0 = time.monotonic()
        with pytest.raises((mpcomm.TransferTimeout, TimeoutError)):
            ini.write(src, remote, 0, 4096).result(2)
        assert time.monotonic() - t0 >= 1.9


def test_a_result_waiter_reports_its_own_request(make_engine: Any) -> None:
    """Over tcp a write's flush waits for the target (stopped here for 50 ms per request, so the
    waiter is surely in result() before the answer comes): result() drives it, the completion is
    reported on the waiting thread, and the transport's Python thread is not woken for it."""
    with StoppableTarget() as target:
        ini = make_engine(TCP, transports=["ucx"])
        remote, src, tr = _wired(ini, target.address, 5)
        woke, driven = tr.wakeups, tr.waiter_reports
        for i in range(20):
            src.view[:8] = i.to_bytes(8, "little")
            target.paused(0.05, lambda: ini.write(src, remote, i * 4096, 4096)).result(5)
        woke, driven = tr.wakeups - woke, tr.waiter_reports - driven
        back = bytearray(20 * 4096)
        ini.read(back, remote, 0).result(5)
        assert all(back[i * 4096:i * 4096 + 8] == i.to_bytes(8, "little") for i in range(20))
        assert driven == 20, f"{driven} of 20 writes were reported by their waiter"
        assert woke <= 5, f"the transport's Python thread woke {woke} times for 20 driven writes"


def test_an_idle_target_never_wakes_its_python_thread(make_engine: Any) -> None:
    """A pure target: the native loop serves every emulated put; the Python thread sleeps throughout."""
    tgt = make_engine(TCP, transports=["ucx"])
    tgt.register(bytearray(1 << 20), name="kv")
    ttr = tgt.transports["ucx"]
    ini = make_engine(TCP, transports=["ucx"])
    remote = ini.open(tgt.address, "kv", timeout=10)
    src = ini.allocate(65536)
    ini.write(src, remote, 0, 4096).result(5)
    before = ttr.wakeups
    for _ in range(200):
        ini.write(src, remote, 0, 65536).result(5)
    assert ttr.wakeups == before


def _native_threads() -> int:
    return sum(1 for t in threading.enumerate() if t.name == "mpcomm-ucx-native" and t.is_alive())


def test_close_stops_the_native_loop_before_the_worker_goes(make_engine: Any) -> None:
    before = _native_threads()
    e = make_engine(TCP, transports=["ucx"])
    assert _native_threads() == before + 1
    e.close()  # joins the loop's thread (it returns from its one ctypes call) before the worker goes
    assert _native_threads() == before


def test_a_request_nobody_waits_on_is_reported_after_each_new_attach(make_engine: Any) -> None:
    """No result() waiter drives these: the Python thread must hear of every completion, including
    one the native loop made between the request's issue and its hand-off (a lost wake-up there
    left the first write after an attach pending for ever, now and then)."""
    tgt = make_engine(TCP, transports=["ucx"])
    ini = make_engine(TCP, transports=["ucx"])
    src = ini.allocate(4096)
    src.view[:] = b"n" * 4096
    for i in range(40):
        buf = bytearray(8192)
        tgt.register(buf, name=f"r{i}")
        remote = ini.open(tgt.address, f"r{i}", timeout=10)
        fut = ini.write(src, remote, 4096, 4096)  # the first request attaches, then goes in flight over tcp
        end = time.monotonic() + 5
        while not fut.done() and time.monotonic() < end:  # done() does not drive: the Python thread reports
            time.sleep(0.001)
        assert fut.done(), f"round {i}: a write nobody waited on was never reported"
        fut.result(0)
        assert bytes(buf[4096:]) == b"n" * 4096


def _claiming(claim_us: int) -> dict[str, Any]:
    return {"plugins": {"ucx": {"tls": "tcp,self", "claim_us": claim_us}}}


def test_an_answer_that_beats_its_caller_to_result_is_reported_by_the_caller(make_engine: Any) -> None:
    """The race of docs/ucx.md: the target answers a handed-off write before its caller reaches
    result() (here the caller sleeps 30 ms first). Within the claim window the native loop holds
    the Python thread's wake-up, so result() claims the request and reports it on its own thread.
    The target process is stopped while each write is posted and resumed 5 ms later: a write's
    one round trip (its flush goes out with its put) is otherwise often over before the posting
    thread hands it off, and the posting thread then reports it itself -- not this race."""
    with StoppableTarget() as target:
        ini = make_engine(_claiming(2_000_000), transports=["ucx"])  # 2 s: surely longer than the sleep
        remote, src, tr = _wired(ini, target.address, 3)
        woke, driven = tr.wakeups, tr.waiter_reports
        for i in range(10):
            src.view[:8] = i.to_bytes(8, "little")
            fut = target.paused(0.005, lambda: ini.write(src, remote, i * 4096, 4096))
            time.sleep(0.03)  # the answer comes meanwhile
            fut.result(5)
        woke, driven = tr.wakeups - woke, tr.waiter_reports - driven
        back = bytearray(10 * 4096)
        ini.read(back, remote, 0).result(5)
        assert all(back[i * 4096:i * 4096 + 8] == i.to_bytes(8, "little") for i in range(10))
        # One whose answer came before its hand-off is reported by the posting thread (not counted
        # as the waiter's): the Python thread reports none.
        assert woke <= 2, f"the transport's Python thread woke {woke} times for 10 writes ({driven} claimed)"
        assert driven >= 3, f"only {driven} of 10 writes were reported by their waiter"


def test_a_held_wake_up_is_released_when_the_claim_window_ends(make_engine: Any) -> None:
    """Nobody claims these writes: the native loop, asleep, wakes itself at the window's end
    (its poll timeout) and wakes the Python thread, which reports them."""
    tgt = make_engine(TCP, transports=["ucx"])
    tgt.register(bytearray(1 << 20), name="kv")
    ini = make_engine(_claiming(200_000), transports=["ucx"])
    remote = ini.open(tgt.address, "kv", timeout=10)
    src = ini.allocate(4096)
    ini.write(src, remote, 0, 4096).result(5)
    for i in range(5):
        fut = ini.write(src, remote, i * 4096, 4096)
        end = time.monotonic() + 5
        while not fut.done() and time.monotonic() < end:  # done() does not drive
            time.sleep(0.005)
        assert fut.done(), f"write {i}: nobody claimed it, and it was never reported"
        fut.result(0)


def test_pipelined_waiters_never_sleep_out_their_wait_step(make_engine: Any) -> None:
    """64 writes in flight, then result() on each in turn: the later ones are handed off, and the
    Python thread's own progress calls may complete the one a waiter drives. The waiter must hear
    of it (the loop's event counter); it used to sleep out its 1 s wait step, now and then."""
    tgt = make_engine(TCP, transports=["ucx"])
    tgt.register(bytearray(1 << 20), name="kv")
    ini = make_engine(TCP, transports=["ucx"])
    remote = ini.open(tgt.address, "kv", timeout=10)
    src = ini.allocate(4096)
    ini.write(src, remote, 0, 4096).result(5)
    slow = []
    for k in range(150):
        t = time.monotonic()
        futs = [ini.write(src, remote, i * 4096, 4096) for i in range(64)]
        for f in futs:
            f.result(5)
        if time.monotonic() - t > 0.5:  # about 10 ms each here
            slow.append(k)
    assert not slow, f"batches of 64 writes that took over 0.5 s: {slow}"


_BUSY_INITIATOR = textwrap.dedent("""
    import sys, threading, mpcomm
    e = mpcomm.Engine({"plugins": {"ucx": {"tls": "tcp,self"}}}, transports=["ucx"])
    r = e.open(sys.argv[1], "kv", timeout=10)
    src = e.allocate(65536)
    e.write(src, r, 0, 65536).result(10)     # attached
    def writer():
        while True:                          # requests in flight when the revocation comes
            try:
                e.write(src, r, 0, 65536).result(10)
            except mpcomm.MpcommError:
                return                       # revoked: every later request is refused
    threading.Thread(target=writer, daemon=True).start()
    print("spinning", flush=True)
    while True:                              # the application holds the GIL (default 5 ms switch interval)
        pass
""")


def test_a_busy_initiator_confirms_a_revocation_in_time(make_engine: Any, caplog: Any) -> None:
    """The revocation answer is Python (the authenticated control channel; docs/ucx.md): an initiator
    whose main thread spins still confirms within revoke_timeout, fencing its writes in flight, so the
    target unmaps instead of quarantining."""
    tgt = make_engine(TCP, transports=["ucx"])
    buf = bytearray(1 << 20)
    region = tgt.register(buf, name="kv")
    proc = subprocess.Popen([sys.executable, "-c", _BUSY_INITIATOR, tgt.address], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "spinning"  # type: ignore[union-attr]
        time.sleep(0.3)
        t0 = time.monotonic()
        with caplog.at_level("WARNING", logger="mpcomm"):
            tgt.unregister(region)
        took = time.monotonic() - t0
        assert not [r for r in caplog.records if "did not confirm" in r.getMessage()], "the region was quarantined"
        assert took < 2.0, f"unregister took {took:.2f} s"
        print(f"\nrevocation confirmed by a spinning initiator in {took * 1e3:.0f} ms")
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.parametrize("park_us", [100_000, 0], ids=["parks", "never-parks"])
def test_a_waiter_polls_for_its_answer_and_the_loop_thread_stays_asleep(make_engine: Any, park_us: int) -> None:
    """A result() waiter polls the worker itself (mpcomm_ucx_loop_wait's `poller`), and the native
    loop parks meanwhile (and `park_us` after): the answer to a write wakes its waiter only, not the
    loop thread and then the waiter. The target is stopped while each write is posted (resumed
    2 ms later), so every write is waited for. With park_us 0 -- the loop polls for every waiter, as
    before -- each answer ends a poll of the loop thread (`sleeps`): the control. Then 300 writes
    back to back: none sleeps out the 1 s wait step (a progress call of another thread that
    consumed the polling waiter's event signals it)."""
    with StoppableTarget() as target:
        ini = make_engine({"plugins": {"ucx": {"tls": "tcp,self", "park_us": park_us}}}, transports=["ucx"])
        remote, src, tr = _wired(ini, target.address, 20)
        loop = tr._loop
        n = 30
        sleeps, driven = loop.sleeps, tr.waiter_reports
        for i in range(n):
            target.paused(0.002, lambda: ini.write(src, remote, i * 4096, 4096)).result(5)
        sleeps, driven = loop.sleeps - sleeps, tr.waiter_reports - driven
        if park_us:
            assert driven == n, f"{driven} of {n} writes were reported by their waiter"
        else:
            # The control's loop thread polls beside the waiter: a waiter preempted past the claim
            # window (a loaded machine) leaves its answer to the loop, as designed.
            assert driven >= n - 3, f"{driven} of {n} writes were reported by their waiter"
        if park_us:
            assert sleeps <= 3, f"the loop thread's poll ended {sleeps} times for {n} waited-for writes"
        else:
            assert sleeps >= n, f"the control: the loop thread's poll ended only {sleeps} times for {n} writes"
        worst = 0.0
        for i in range(300):
            t = time.monotonic()
            ini.write(src, remote, (i % 16) * 4096, 4096).result(5)
            worst = max(worst, time.monotonic() - t)
        assert worst < 0.5, f"a write took {worst:.3f} s: its waiter slept out a wait step"


_COUNTING_TARGET = textwrap.dedent("""
    import os, sys, mpcomm
    e = mpcomm.Engine({"plugins": {"ucx": {"tls": "tcp,self"}}}, transports=["ucx"])
    e.register(bytearray(1 << 20), name="kv")
    print(e.address, flush=True)
    def ucx_async_switches():  # UCX's async thread (named "async"): its voluntary context switches
        n = 0
        for t in os.listdir("/proc/self/task"):
            with open(f"/proc/self/task/{t}/comm") as f:
                if f.read().strip() != "async":
                    continue
            with open(f"/proc/self/task/{t}/status") as f:
                n += int(next(x for x in f if x.startswith("voluntary_ctxt_switches")).split()[1])
        return n
    for line in sys.stdin:
        print(ucx_async_switches(), flush=True)
""")


def test_an_idle_target_serves_each_write_without_ucx_async_thread(make_engine: Any) -> None:
    """A target's tcp interface receives only UCT's own put requests, which never activate it
    under UCX's adaptive progress: each write then woke UCX's async thread, which signalled the
    worker for the native loop -- two wake-ups in a row per write. With the native loop the
    transport turns adaptive progress off (UCX_ADAPTIVE_PROGRESS=n): the loop's poll takes the
    write itself."""
    proc = subprocess.Popen([sys.executable, "-c", _COUNTING_TARGET], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)
    try:
        address = proc.stdout.readline().strip()  # type: ignore[union-attr]
        ini = make_engine(TCP, transports=["ucx"])
        remote, src, _ = _wired(ini, address, 20)

        def async_switches() -> int:
            proc.stdin.write("\n")  # type: ignore[union-attr]
            proc.stdin.flush()  # type: ignore[union-attr]
            return int(proc.stdout.readline())  # type: ignore[union-attr]

        before, n = async_switches(), 200
        for i in range(n):
            ini.write(src, remote, (i % 16) * 4096, 4096).result(5)
        woke = async_switches() - before
        assert woke <= n // 10, f"UCX's async thread woke {woke} times for {n} writes"
    finally:
        proc.kill()
        proc.wait()
