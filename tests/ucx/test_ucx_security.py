"""ucx: defaults, revocation and the target's word, between two processes.

The target is a separate engine process (engine_peer.py); everything that needs
UCX skips with the reason when libucp cannot load.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

import mpcomm
from mpcomm.errors import AccessError, OutOfBoundsError, PermissionDeniedError, UnknownRegionError
from mpcomm.plugins.ucx.transport import UcxTransport

AVAIL = UcxTransport.availability()
pytestmark = pytest.mark.skipif(not AVAIL, reason=f"ucx transport unavailable: {AVAIL.reason}")
PEER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "engine_peer.py")


class Target:
    """engine_peer.py in a child process."""

    def __init__(self, config: dict | None = None, env: dict | None = None) -> None:
        self.proc = subprocess.Popen([sys.executable, PEER, json.dumps(config or {})], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, bufsize=1,
                                     env={**os.environ, **env} if env else None)
        hello = json.loads(self.proc.stdout.readline())
        self.address, self.pid = hello["address"], hello["pid"]

    def cmd(self, line: str) -> dict:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        out = self.proc.stdout.readline()
        assert out, f"the target died (rc={self.proc.poll()})"
        res = json.loads(out)
        assert "error" not in res, res
        return res

    def alive(self) -> bool:
        return self.proc.poll() is None

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write("quit\n")
                self.proc.stdin.flush()
                self.proc.wait(10)
            except Exception:  # noqa: BLE001
                self.proc.kill()
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)


@pytest.fixture
def target():
    t = Target()
    yield t
    t.close()


@pytest.fixture
def engine():
    e = mpcomm.Engine(transports=["ucx"])
    yield e
    e.close()


def test_default_config_rides_cma_with_error_handling(target, engine):
    """As installed: peer error handling on, and RMA over cma (not tcp with emulated RMA) on one host."""
    if os.environ.get("UCX_TLS") or os.environ.get("UCX_RNDV_THRESH"):
        pytest.skip("UCX_TLS / UCX_RNDV_THRESH set in the environment")
    target.cmd("register kv 65536 rw buffer")
    remote = engine.open(target.address, "kv")
    engine.write(b"x" * 4096, remote).result(10)
    t = engine.transports["ucx"]
    assert t.error_handling is True
    lanes = [ln for p in t._peers.values() for ln in p.ep.info().splitlines() if "lane[" in ln]
    assert any("cma/" in ln and "rma_bw" in ln for ln in lanes), lanes
    assert target.cmd("count kv 120")["n"] == 4096


def test_write_after_unregister_is_refused_and_lands_nowhere(target, engine):
    """After the target's unregister returns, the old descriptor writes nothing (R17)."""
    target.cmd("register kv 1048576 rw buffer")
    remote = engine.open(target.address, "kv")
    src = engine.register(bytearray(b"A" * 4096))
    engine.write(src, remote, 0, 4096).result(10)
    assert target.cmd("count kv 65")["n"] == 4096
    target.cmd("unregister kv")
    target.cmd("fill kv 0")  # the owner reuses the buffer
    src.view[:] = b"B" * 4096
    with pytest.raises(AccessError):
        engine.write(src, remote, 0, 4096, timeout=5).result(10)
    with pytest.raises(AccessError):
        engine.read(bytearray(4096), remote, 0, 4096, timeout=5).result(10)
    time.sleep(0.2)
    assert target.cmd("count kv 66")["n"] == 0


def test_unregister_quiesces_writes_in_flight(target, engine):
    """Writers hammer a region while the target unregisters it: once unregister returned, nothing lands."""
    target.cmd("register kv 8388608 rw buffer")
    remote = engine.open(target.address, "kv")
    src = engine.allocate(4 << 20)
    src.view[:] = b"C" * (4 << 20)
    stop = threading.Event()
    outcomes: list[str] = []

    def pump() -> None:
        while not stop.is_set():
            try:
                engine.write(src, remote, 0, 4 << 20, timeout=5).result(10)
                outcomes.append("ok")
            except AccessError:
                outcomes.append("refused")
            except Exception as exc:  # noqa: BLE001
                outcomes.append(f"unexpected {type(exc).__name__}: {exc}")
                return

    threads = [threading.Thread(target=pump) for _ in range(2)]
    for th in threads:
        th.start()
    time.sleep(0.3)
    target.cmd("unregister kv")
    target.cmd("fill kv 0")
    time.sleep(0.5)
    stop.set()
    for th in threads:
        th.join(20)
    assert "ok" in outcomes and "refused" in outcomes, outcomes[:5] + outcomes[-5:]
    assert not [o for o in outcomes if o.startswith("unexpected")], outcomes
    assert target.cmd("count kv 67")["n"] == 0, "bytes landed after unregister returned"


def test_stale_descriptor_after_free_does_not_kill_the_target(target, engine):
    """Issue 11: a write through a stale descriptor after unregister + free: an error, the target lives."""
    for how in ("buffer", "allocate"):
        target.cmd(f"register kv{how} 1048576 rw {how}")
        remote = engine.open(target.address, f"kv{how}")
        engine.write(b"D" * 65536, remote).result(10)
        target.cmd(f"unregister kv{how}")
        target.cmd(f"free kv{how}")
        for _ in range(3):
            with pytest.raises(AccessError):
                engine.write(b"E" * 65536, remote, timeout=5).result(10)
        assert target.alive() and target.cmd("ping")["ok"]


def test_forged_descriptors_are_refused(target, engine):
    """The target's word is final: forged size, base, access or token move nothing."""
    target.cmd("register small 8192 rw buffer")
    target.cmd("register ro 8192 r buffer")
    remote = engine.open(target.address, "small")
    src = engine.register(bytearray(b"F" * 16384))
    info = remote.transports["ucx"]
    # A bigger size (descriptor and ucx info agree, as an attacker would make them) past the region.
    bigger = dataclasses.replace(remote, size=16384, transports={"ucx": dict(info, size=16384)})
    with pytest.raises(PermissionDeniedError):
        engine.write(src, bigger, 8192, 4096, timeout=5).result(10)
    # Another base address.
    moved = dataclasses.replace(remote, base_address=remote.base_address - 4096,
                                transports={"ucx": dict(info, base=info["base"] - 4096)})
    with pytest.raises(PermissionDeniedError):
        engine.write(src, moved, 0, 4096, timeout=5).result(10)
    # A wrong token: the target refuses the attach.
    with pytest.raises(PermissionDeniedError):
        engine.write(src, dataclasses.replace(remote, token=remote.token ^ 1), 0, 4096, timeout=5).result(10)
    # A read-only region made writable in the descriptor.
    ro = engine.open(target.address, "ro")
    rw = dataclasses.replace(ro, access="rw", transports={"ucx": dict(ro.transports["ucx"], access="rw")})
    with pytest.raises(PermissionDeniedError):
        engine.write(src, rw, 0, 4096, timeout=5).result(10)
    assert target.cmd("count small 70")["n"] == 0 and target.cmd("count ro 70")["n"] == 0
    # The honest descriptor still works, and the transport's own bounds check holds without the engine's.
    engine.write(src, remote, 0, 8192).result(10)
    assert target.cmd("count small 70")["n"] == 8192
    t = engine.transports["ucx"]
    att = next(a for p in t._peers.values() for a in p.attached.values() if a.key[0] == remote.region_id)
    from mpcomm.plugins.ucx.transport import _Work

    op = type("Op", (), {"remote": remote, "remote_offset": 8000, "length": 4096, "kind": "write"})()
    w = _Work.__new__(_Work)
    w.op, w.group, w.kind = op, False, "write"
    assert isinstance(t._check(w, att), OutOfBoundsError)


def test_descriptor_carries_no_rkey(target, engine):
    """The rkey travels only over the authenticated control channel, never in the descriptor."""
    target.cmd("register kv 4096 rw buffer")
    remote = engine.open(target.address, "kv")
    assert set(remote.transports["ucx"]) == {"base", "size", "access"}


def test_dead_target_is_an_error_not_a_crash(engine):
    """Default config (cma + peer error handling): a target killed mid-stream fails requests, nothing aborts."""
    t = Target()
    try:
        t.cmd("register kv 16777216 rw allocate")
        remote = engine.open(t.address, "kv")
        src = engine.allocate(16 << 20)
        engine.write(src, remote).result(10)
        os.kill(t.pid, signal.SIGKILL)
        t.proc.wait(10)
        errors = []
        for _ in range(3):
            try:
                engine.write(src, remote, timeout=5).result(15)
            except mpcomm.MpcommError as exc:
                errors.append(type(exc).__name__)
        assert len(errors) == 3, errors
    finally:
        t.close()


def test_progress_thread_sleeps_on_events_not_slices(engine):
    """A request outstanding on a stalled tcp target: the progress thread sleeps instead of waking every ms."""
    t = Target(env={"UCX_TLS": "tcp"})
    old = os.environ.get("UCX_TLS")
    try:
        os.environ["UCX_TLS"] = "tcp"
        with mpcomm.Engine(transports=["ucx"]) as e:
            t.cmd("register kv 1048576 rw buffer")
            remote = e.open(t.address, "kv")
            e.write(b"w" * 4096, remote).result(10)
            os.kill(t.pid, signal.SIGSTOP)
            try:
                tr = e.transports["ucx"]
                fut = e.write(b"s" * 65536, remote, timeout=3)
                time.sleep(0.2)
                before = tr.wakeups
                time.sleep(1.0)
                woke = tr.wakeups - before
                c0 = time.monotonic()
                fut.cancel()  # a request, not a wait: returns at once even though the target is stopped
                assert time.monotonic() - c0 < 1.0
            finally:
                os.kill(t.pid, signal.SIGCONT)
            assert woke < 50, f"the progress thread woke {woke} times in 1 s with nothing happening"
            try:
                fut.result(10)
            except Exception:  # noqa: BLE001 - cancelled or timed out: either is fine here
                pass
    finally:
        if old is None:
            os.environ.pop("UCX_TLS", None)
        else:
            os.environ["UCX_TLS"] = old
        t.close()


def _native_modes():
    return ["native", "python"]


@pytest.mark.parametrize("native", _native_modes())
def test_post_many_writes_and_reads_each_index(target, engine, native, monkeypatch):
    """write_many/read_many: one post_many (N puts/gets and one flush), every index reported and in place."""
    from mpcomm.plugins.ucx import _ucp

    if native == "python":
        monkeypatch.setattr(_ucp, "_native_helper", lambda: None)
    elif _ucp._native_helper() is None:
        pytest.skip("no C compiler here: the compiled batch helper is unavailable")
    target.cmd("register kv 1048576 rw buffer")
    remote = engine.open(target.address, "kv")
    t = engine.transports["ucx"]
    groups = []
    orig = t.post_many
    monkeypatch.setattr(t, "post_many", lambda g: (groups.append(g.count), orig(g))[1])
    n, size = 64, 4096
    src = engine.register(bytearray(b"G" * (n * size + 8)))
    lo = [i * size + 3 for i in range(n)]  # odd local offsets
    ro = [i * (size + 5) for i in range(n)]  # gaps between the pieces on the target
    batch = engine.write_many(src, remote, lo, ro, [size] * n)
    batch.result(10)
    assert groups == [n], groups
    assert batch.statuses == [mpcomm.TransferStatus.COMPLETED] * n and batch.bytes_per_request == [size] * n
    assert target.cmd("count kv 71")["n"] == n * size
    dst = engine.register(bytearray(n * size))
    rb = engine.read_many(dst, remote, [i * size for i in range(n)], ro, [size] * n)
    rb.result(10)
    assert bytes(dst.view) == b"G" * (n * size)


def test_post_many_after_unregister_fails_every_index(target, engine):
    target.cmd("register kv 1048576 rw buffer")
    remote = engine.open(target.address, "kv")
    src = engine.register(bytearray(b"H" * 65536))
    engine.write_many(src, remote, [0, 4096], [0, 4096], [4096, 4096]).result(10)
    target.cmd("unregister kv")
    target.cmd("fill kv 0")
    batch = engine.write_many(src, remote, [i * 4096 for i in range(16)], [i * 4096 for i in range(16)],
                              [4096] * 16, timeout=5)
    with pytest.raises(AccessError):
        batch.result(10)
    assert len(batch.failed) == 16
    assert target.cmd("count kv 72")["n"] == 0


def test_hung_initiator_quarantines_instead_of_freeing():
    """An attached initiator that does not confirm the revocation (SIGSTOPped): unregister returns after
    revoke_timeout, the pages stay mapped and referenced (a late write lands in allocated memory, never in
    freed pages), and the target keeps asking: once the initiator runs again it drops the region, later
    writes are refused, and the target lets the buffer go."""
    cfg = {"plugins": {"ucx": {"revoke_timeout": 0.5}}}
    ini = Target()
    try:
        with mpcomm.Engine(cfg, transports=["ucx"]) as tgt:
            buf = bytearray(65536)
            reg = tgt.register(buf, name="kv")
            ini.cmd(f"open {tgt.address} kv")
            assert ini.cmd("write kv 0 4096 73") == {"ok": True}
            assert buf[:4096] == b"I" * 4096
            t = tgt.transports["ucx"]
            os.kill(ini.pid, signal.SIGSTOP)
            try:
                t0 = time.monotonic()
                tgt.unregister(reg, timeout=30)
                took = time.monotonic() - t0
                assert len(t._quarantine) == 1 and t._quarantine[0][1].obj is buf
                with pytest.raises(BufferError):
                    buf.extend(b"x")  # still exported: it cannot move or shrink
            finally:
                os.kill(ini.pid, signal.SIGCONT)
            assert took < 15, took
            deadline = time.monotonic() + 20
            while t._quarantine and time.monotonic() < deadline:
                time.sleep(0.1)
            assert not t._quarantine, "the revocation was never confirmed after the initiator resumed"
            buf[:] = bytes(len(buf))
            res = ini.cmd("write kv 0 4096 74")
            assert res.get("failed") in ("UnknownRegionError", "PermissionDeniedError", "StaleRegionError"), res
            assert buf.count(74) == 0
            buf.extend(b"x")  # released: the owner has its buffer back
    finally:
        ini.close()


def _tables(t: UcxTransport) -> dict[str, int]:
    """The initiator-side tables a revocation cycle touches, and the rkeys alive on the endpoints."""
    peers = list(t._peers.values())
    return {"peers": len(peers), "attached": sum(len(p.attached) for p in peers),
            "rkeys": sum(len(p.ep.rkeys) for p in peers if p.ep is not None),
            "connecting": sum(len(p.connecting) for p in peers), "active": len(t._active), "waits": len(t._waits)}


def test_repeated_revocations_leave_nothing_behind_on_the_initiator(target, engine):
    """30 unregister / re-register cycles on the target (a new region id each time) with writes and reads
    running: the initiator's threads and tables come back to a bound, and every rkey alive on the
    endpoint belongs to an attachment (each revocation destroyed its own). Before the fix one rkey per
    cycle was orphaned (a second attach of a region already attached dropped the attachment)."""
    size = 8 << 20
    target.cmd(f"register kv {size} rw buffer")
    t = engine.transports["ucx"]
    stop = threading.Event()
    outcomes: dict[str, int] = {}
    lock = threading.Lock()

    def pump(k: int) -> None:
        remote = None
        src = engine.allocate(1 << 20)
        dst = bytearray(1 << 20)
        n = 0
        while not stop.is_set():
            n += 1
            ln = (4096, 65536, 1 << 20)[n % 3]
            try:
                if remote is None:
                    remote = engine.open(target.address, "kv", timeout=5)
                if n % 4:
                    engine.write(src, remote, k * (2 << 20), ln, timeout=5).result(10)
                else:
                    engine.read(dst, remote, k * (2 << 20), ln, timeout=5).result(10)
                what = "ok"
            except AccessError:
                what, remote = "refused", None
            except Exception as exc:  # noqa: BLE001 - counted, and the test fails on it
                what, remote = f"unexpected {type(exc).__name__}: {exc}", None
            with lock:
                outcomes[what] = outcomes.get(what, 0) + 1

    def cycle() -> None:
        time.sleep(0.05)
        target.cmd("unregister kv")
        target.cmd(f"register kv {size} rw buffer")

    pumps = [threading.Thread(target=pump, args=(k,), daemon=True) for k in range(2)]
    for th in pumps:
        th.start()
    try:
        for _ in range(3):  # warm-up: the target's control link to us, the engine's lazily started pools
            cycle()
        base = threading.active_count()
        peak = {"threads": 0, "attached": 0, "rkeys": 0}
        for _ in range(30):
            cycle()
            now = _tables(t)
            peak = {"threads": max(peak["threads"], threading.active_count() - base),
                    "attached": max(peak["attached"], now["attached"]), "rkeys": max(peak["rkeys"], now["rkeys"])}
    finally:
        stop.set()
        for th in pumps:
            th.join(20)
    assert outcomes.get("ok", 0) > 30 and outcomes.get("refused", 0) > 0, outcomes
    assert not [k for k in outcomes if k.startswith("unexpected")], outcomes
    # Within a cycle: the current region's attachment, maybe a stale one being refused.
    assert peak["attached"] <= 3 and peak["rkeys"] <= 3, peak
    assert peak["threads"] <= 3, peak  # an attach connector while a region is new, not one per cycle
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        now = _tables(t)
        names = [th.name for th in threading.enumerate()]
        if now["active"] == now["waits"] == now["connecting"] == 0 and "mpcomm-ucx-attach" not in names:
            break
        time.sleep(0.1)
    assert now["peers"] == 1 and now["attached"] <= 1 and now["active"] == now["waits"] == now["connecting"] == 0, now
    with t._lock:
        held = {id(a.rkey) for p in t._peers.values() for a in p.attached.values() if a.rkey is not None}
        alive = [rk for p in t._peers.values() if p.ep is not None for rk in p.ep.rkeys]
    assert all(id(rk) in held for rk in alive), f"{len(alive) - len(held)} rkeys belong to no attachment"
    assert "mpcomm-ucx-attach" not in names and threading.active_count() <= base + 1, names


def test_a_finished_request_leaves_no_cycle_behind(target, engine):
    """The transport's per-request state is not reachable from the Operation (op.state stays unset): a
    finished request's _Work and the local memory it named go by reference counting, not by the cyclic
    gc (which under load ran late enough to hold hundreds of MiB of finished requests' buffers).

    Requests larger than a chunk and batches take the general path (a _Work each); small lone ones
    the hot path, which makes none."""
    from mpcomm.plugins.ucx.transport import _Work

    size = 8 << 20
    target.cmd(f"register kv {size} rw buffer")
    remote = engine.open(target.address, "kv")
    src = engine.allocate(size)
    engine.write(src, remote, 0, 4096).result(10)  # attached, wired up
    offs = [i * 65536 for i in range(8)]
    gc.collect()
    gc.disable()
    try:
        for i in range(60):
            if i % 4 == 0:
                engine.write(src, remote, 0, size).result(10)
            elif i % 4 == 1:
                engine.read(src, remote, 0, size).result(10)
            elif i % 4 == 2:
                engine.write_many(src, remote, offs, offs, [4096] * len(offs)).result(10)
            else:
                engine.read_many(src, remote, offs, offs, [4096] * len(offs)).result(10)
        # What only the cyclic gc would free (a _Work still named by the progress thread's locals is alive).
        gc.set_debug(gc.DEBUG_SAVEALL)
        gc.collect()
        left = sum(isinstance(o, _Work) for o in gc.garbage)
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
    assert left == 0, f"{left} _Work objects of finished requests were left to the cyclic gc"
