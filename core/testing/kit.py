"""The conformance checks every transport must pass, between two processes.

Each check is a function ``check_x(env)`` that raises AssertionError (or any
exception) on failure and :class:`Skip` when it does not apply. ``env`` is a
:class:`ConformanceEnv`: an initiator engine in this process that runs only
the transport under test, and a target engine in a child process
(:mod:`mpcomm.testing.target`) that runs only that transport too.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
import types
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import CancelledError, wait
from dataclasses import dataclass, field
from typing import Any

import mpcomm
from mpcomm import Request, TransferStatus
from mpcomm.errors import (
    AccessError,
    MpcommError,
    OutOfBoundsError,
    PeerConnectionError,
    PermissionDeniedError,
    RegionBusyError,
    StaleRegionError,
    TransferTimeout,
    UnknownRegionError,
)

from .patterns import pattern

MiB = 1 << 20
BIG = 64 * MiB
REGION_SIZE = BIG + MiB
SIZES = (1, 7, 4099, 65537, MiB + 13, 4 * MiB + 1, BIG)
TARGET_REGIONS = {
    "alloc": [REGION_SIZE, "allocate"],
    "buf": [REGION_SIZE, "buffer"],
    "ro": [64 << 10, "readonly"],
    "small": [4096, "buffer"],
}
INITIATOR_CONFIG = {
    "runtime": {"request_timeout_ms": 15000, "abort_grace_ms": 1000, "queue_depth": 64, "worker_threads": 4},
}
SLACK = 3.0  # seconds allowed beyond deadline + abort grace on a loaded 2-core machine


class Skip(Exception):
    """The check does not apply to this transport (the message says why)."""


class LineProcess:
    """A child process spoken to one line at a time: it prints a JSON hello line, then one reply per request line.

    The protocol the kit's target (:mod:`mpcomm.testing.target`) speaks, and any
    test helper of the same shape (a richer target, an initiator driven from a
    test): give it the ``argv`` to run, read :attr:`hello`, send lines with
    :meth:`request`. ``prefix`` runs it under a launcher (``ip netns exec NS``);
    ``env`` adds to this process's environment. :meth:`close` sends
    :attr:`quit_line` and waits for the exit, killing it if it lingers.
    """

    #: The line that asks the child to exit.
    quit_line = "quit"
    #: Seconds :meth:`close` waits for an exit after :attr:`quit_line` before killing.
    quit_wait = 10.0

    def __init__(self, argv: Sequence[str], *, start_timeout: float = 30.0, prefix: Sequence[str] = (),
                 env: dict[str, str] | None = None) -> None:
        self.stopped = False
        self.proc = subprocess.Popen(
            [*prefix, *argv], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1,
            env={**os.environ, **env} if env else None,
        )
        try:
            #: The child's first line, parsed.
            self.hello: dict[str, Any] = json.loads(self._readline(start_timeout))
        except Exception:
            self.kill()
            raise
        #: The child's own pid (from its hello: a launcher's pid is not the engine's).
        self.pid: int = int(self.hello.get("pid", self.proc.pid))

    def _readline(self, timeout: float) -> str:
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not ready:
            raise TimeoutError(f"{type(self).__name__} did not answer within {timeout}s")
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"{type(self).__name__} exited (code {self.proc.poll()})")
        return line.strip()

    def request(self, line: str, timeout: float = 60.0) -> str:
        """Send one line, return the one-line reply as it came (TimeoutError, RuntimeError if it exited)."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        return self._readline(timeout)

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> None:
        """SIGSTOP the child (a peer that hangs); :meth:`close` continues it before asking it to quit."""
        os.kill(self.pid, signal.SIGSTOP)
        self.stopped = True

    def cont(self) -> None:
        os.kill(self.pid, signal.SIGCONT)
        self.stopped = False

    def kill(self) -> None:
        if self.proc.poll() is None:
            try:
                os.kill(self.proc.pid, signal.SIGCONT)
            except OSError:
                pass
            self.proc.kill()
        self.proc.wait(10)
        for f in (self.proc.stdin, self.proc.stdout):
            try:
                if f is not None:
                    f.close()
            except OSError:
                pass

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                if self.stopped:
                    self.cont()
                assert self.proc.stdin is not None
                self.proc.stdin.write(self.quit_line + "\n")
                self.proc.stdin.flush()
                self.proc.wait(self.quit_wait)
            except Exception:  # noqa: BLE001 - gone already, or stuck: killed below
                pass
        self.kill()


class TargetProcess(LineProcess):
    """A target engine in a child process (:mod:`mpcomm.testing.target`), driven over its stdin/stdout."""

    def __init__(self, transport: str, *, plugins: Sequence[str] = (), config: dict[str, Any] | None = None,
                 endpoint: str = "127.0.0.1:0", regions: dict[str, list[Any]] | None = None,
                 autoload: bool | None = None, start_timeout: float = 30.0,
                 prefix: Sequence[str] = (), env: dict[str, str] | None = None) -> None:
        spec = {"transport": transport, "plugins": list(plugins), "config": config or {}, "endpoint": endpoint,
                "regions": regions if regions is not None else TARGET_REGIONS, "autoload": autoload}
        super().__init__([sys.executable, "-m", "mpcomm.testing.target", json.dumps(spec)],
                         start_timeout=start_timeout, prefix=prefix, env=env)
        self.address: str = self.hello["address"]
        self.node_id: str = self.hello["node_id"]

    def cmd(self, line: str, timeout: float = 60.0) -> str:
        """One command (see :mod:`mpcomm.testing.target`); RuntimeError with the target's ``error ...`` reply."""
        reply = self.request(line, timeout)
        if reply.startswith("error "):
            raise RuntimeError(f"target: {reply[6:]}")
        return reply

    def sha(self, region: str, offset: int, length: int) -> str:
        return self.cmd(f"sha {region} {offset} {length}")


class ConformanceEnv:
    """An initiator engine here and a target process, both running ``transport`` only."""

    def __init__(self, transport: str, *, plugins: Sequence[str] = (), config: dict[str, Any] | None = None,
                 autoload: bool | None = None, target_host: str = "127.0.0.1",
                 target_prefix: Sequence[str] = ()) -> None:
        """``target_prefix`` runs the target under a launcher (``ip netns exec NS``,
        for a second host in a network namespace) bound to ``target_host``."""
        import importlib

        self.transport = transport
        self.plugins = list(plugins)
        self.autoload = autoload
        self.config = config or {}
        self.target_host = target_host
        self.target_prefix = list(target_prefix)
        cfg = mpcomm.Config.from_dict(INITIATOR_CONFIG).with_overrides(**self.config) if self.config else \
            mpcomm.Config.from_dict(INITIATOR_CONFIG)
        try:
            self.engine = mpcomm.Engine(cfg, transports=[transport],
                                        plugins=[importlib.import_module(m) for m in self.plugins], autoload=autoload)
        except mpcomm.TransportUnavailable as exc:
            raise Skip(f"transport {transport!r} is not available here: {exc}") from exc
        if transport not in self.engine.transports:
            reason = dict((s.name, s.availability.reason) for s in self.engine.transport_status()).get(transport, "not found")
            self.engine.close()
            raise Skip(f"transport {transport!r} is not available here: {reason}")
        self.capabilities = type(self.engine.transports[transport]).capabilities
        self.target = self.spawn()

    def spawn(self, endpoint: str | None = None, regions: dict[str, list[Any]] | None = None) -> TargetProcess:
        from mpcomm.peer import format_endpoint

        return TargetProcess(self.transport, plugins=self.plugins, config=self.config,
                             endpoint=endpoint or format_endpoint(self.target_host, 0),
                             regions=regions, autoload=self.autoload, prefix=self.target_prefix)

    def remote(self, name: str, target: TargetProcess | None = None) -> mpcomm.RemoteRegion:
        return self.engine.open((target or self.target).address, name)

    def grace(self) -> float:
        return self.engine.config.runtime.abort_grace_ms / 1000

    def close(self) -> None:
        self.target.close()
        self.engine.close()


def _sha(data: Any) -> str:
    return hashlib.sha256(data).hexdigest()


def _local_buffers(env: ConformanceEnv, size: int) -> list[tuple[str, mpcomm.Region]]:
    alloc = env.engine.allocate(size)
    buf = env.engine.register(bytearray(size))
    return [("allocated", alloc), ("registered", buf)]


# -- checks -------------------------------------------------------------------------


def check_write_integrity(env: ConformanceEnv) -> None:
    """Writes of 1 B .. 64 MiB at odd offsets land exactly, from allocated and registered memory."""
    locals_ = _local_buffers(env, BIG + 8)
    try:
        for (kind, local), remote_name in zip(locals_, ("alloc", "buf")):
            remote = env.remote(remote_name)
            local.view[:] = pattern(3, local.size)
            env.target.cmd(f"zero {remote_name}")
            for i, size in enumerate(SIZES):
                roff = 4097 + i
                before = env.target.sha(remote_name, roff - 1, 1)
                t = env.engine.write(local, remote, roff, size, local_offset=3)
                assert t.result(timeout=60) == size, f"{kind}: write of {size} reported {t.bytes_moved} bytes"
                assert t.status is TransferStatus.COMPLETED
                assert t.transport == env.transport
                want = _sha(local.view[3 : 3 + size])
                got = env.target.sha(remote_name, roff, size)
                assert got == want, f"{kind} → {remote_name}: {size} bytes at offset {roff} differ on the target"
                # The byte before the range must be untouched.
                assert env.target.sha(remote_name, roff - 1, 1) == before, f"write of {size} spilled before its range"
    finally:
        for _, r in locals_:
            env.engine.unregister(r)


def check_read_integrity(env: ConformanceEnv) -> None:
    """Reads of 1 B .. 64 MiB at odd offsets return exactly the target's bytes."""
    locals_ = _local_buffers(env, BIG + 8)
    try:
        for (kind, local), remote_name in zip(locals_, ("alloc", "buf")):
            env.target.cmd(f"fill {remote_name} 5")
            remote = env.remote(remote_name)
            expected = pattern(5, REGION_SIZE)
            for i, size in enumerate(SIZES):
                roff = 8191 + i
                local.view[:] = bytes(local.size)
                t = env.engine.read(local, remote, roff, size, local_offset=5)
                assert t.result(timeout=60) == size
                got = bytes(local.view[5 : 5 + size])
                assert got == expected[roff : roff + size], f"{kind}: read of {size} at {roff} returned wrong bytes"
                assert local.view[4] == 0 and (5 + size >= local.size or local.view[5 + size] == 0), \
                    f"read of {size} spilled outside its local range"
    finally:
        for _, r in locals_:
            env.engine.unregister(r)


def check_batch(env: ConformanceEnv) -> None:
    """A batch gives one handle per request plus one for the whole; reads and writes mix."""
    remote = env.remote("buf")
    env.target.cmd("fill buf 9")
    src = env.engine.register(bytearray(pattern(11, 64 * 4096)))
    dst = env.engine.register(bytearray(64 * 4096))
    try:
        reqs = [Request("write", src, remote, (2 * i) * 4096 + 1, 4096, local_offset=i * 4096) for i in range(32)]
        reqs += [Request("read", dst, remote, (2 * i + 1) * 4096 + 1, 4096, local_offset=i * 4096) for i in range(32)]
        batch = env.engine.submit(reqs)
        assert batch.result(timeout=30) == 64 * 4096
        assert len(batch.transfers) == 64 and all(t.status is TransferStatus.COMPLETED for t in batch.transfers)
        expected = pattern(9, REGION_SIZE)
        for i in range(32):
            off = (2 * i + 1) * 4096 + 1
            assert bytes(dst.view[i * 4096 : (i + 1) * 4096]) == expected[off : off + 4096], f"batch read {i} wrong"
            woff = 2 * i * 4096 + 1
            assert env.target.sha("buf", woff, 4096) == _sha(src.view[i * 4096 : (i + 1) * 4096]), f"batch write {i} wrong"
    finally:
        env.engine.unregister(src, timeout=10)
        env.engine.unregister(dst, timeout=10)


def check_concurrency(env: ConformanceEnv) -> None:
    """Requests up to the queue depth in flight at once, from several threads, all land."""
    depth = env.engine.config.runtime.queue_depth
    remote = env.remote("alloc")
    size = 64 << 10
    src = env.engine.register(bytearray(pattern(21, depth * size)))
    errors: list[BaseException] = []
    transfers: list[mpcomm.Transfer] = []
    lock = threading.Lock()

    def worker(k: int) -> None:
        try:
            mine = [env.engine.write(src, remote, i * size, size, local_offset=i * size) for i in range(k, depth, 4)]
            with lock:
                transfers.extend(mine)
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    try:
        threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(60)
        assert not errors, f"submitting {depth} concurrent requests failed: {errors[0]!r}"
        done, not_done = wait(transfers, timeout=60)
        assert not not_done, f"{len(not_done)} of {depth} concurrent transfers did not finish"
        for t in transfers:
            t.result()
        assert env.target.sha("alloc", 0, depth * size) == _sha(src.view), "concurrent writes corrupted the region"
    finally:
        env.engine.unregister(src, timeout=10)


def _assert_stable(env: ConformanceEnv, region: str, offset: int, length: int) -> None:
    first = env.target.sha(region, offset, length)
    time.sleep(0.3)
    assert env.target.sha(region, offset, length) == first, "bytes kept landing after the handle was done"


def check_timeout(env: ConformanceEnv) -> None:
    """A deadline that passes mid-transfer fails the handle with a TimeoutError, in time, with nothing landing later."""
    remote = env.remote("alloc")
    src = env.engine.allocate(BIG)
    src.view[:] = pattern(31, BIG)
    try:
        outcomes = []
        for timeout in (0.001, 0.005):
            t0 = time.monotonic()
            t = env.engine.write(src, remote, 0, BIG, timeout=timeout)
            try:
                t.result(timeout=timeout + env.grace() + SLACK)
                outcomes.append("completed")
            except TransferTimeout as exc:
                assert isinstance(exc, TimeoutError), "TransferTimeout must be a builtin TimeoutError"
                assert t.status is TransferStatus.TIMED_OUT
                outcomes.append("timed_out")
            elapsed = time.monotonic() - t0
            assert elapsed <= timeout + env.grace() + SLACK, f"timeout of {timeout}s took {elapsed:.2f}s to report"
            _assert_stable(env, "alloc", 0, BIG)
        assert "timed_out" in outcomes, f"a 64 MiB write with a 1 ms deadline never timed out ({outcomes})"
    finally:
        env.engine.unregister(src, timeout=10)


def check_timeout_stalled_target(env: ConformanceEnv) -> None:
    """With the target process stopped, a request ends by its deadline; after it resumes nothing more lands."""
    remote = env.remote("small")
    env.target.cmd("zero small")
    src = env.engine.register(bytearray(b"\xab" * 4096))
    env.target.stop()
    try:
        t0 = time.monotonic()
        t = env.engine.write(src, remote, 0, 4096, timeout=0.5)
        outcome = "completed"
        try:
            t.result(timeout=0.5 + env.grace() + SLACK)
        except TransferTimeout as exc:
            outcome = "timed_out" if exc.confirmed else "unconfirmed"
        elapsed = time.monotonic() - t0
        assert elapsed <= 0.5 + env.grace() + SLACK, f"request against a stopped target took {elapsed:.2f}s"
    finally:
        env.target.cont()
    time.sleep(0.3)
    got = env.target.sha("small", 0, 4096)
    env.engine.unregister(src, timeout=10)
    if outcome == "unconfirmed":
        raise Skip("the transport cannot fence a stalled target: its timeout said so (TransferTimeout.confirmed "
                   "is False) and bytes may land when the target resumes")
    if outcome == "timed_out":
        assert got == _sha(bytes(4096)), "a timed-out write landed after the target resumed"
    else:
        assert got == _sha(b"\xab" * 4096), "a completed write is not in the target's memory"


def check_cancel_before_post(env: ConformanceEnv) -> None:
    """cancel() before posting always succeeds, and nothing of that request is transferred."""
    remote = env.remote("buf")
    env.target.cmd("zero buf")
    src = env.engine.register(bytearray(b"\x5a" * 4 * 4096))
    batch = env.engine.submit([Request("write", src, remote, i * 4096, 4096, local_offset=i * 4096) for i in range(4)],
                              post=False)
    assert all(t.status is TransferStatus.PENDING for t in batch.transfers)
    assert batch.transfers[2].cancel() is True
    assert batch.transfers[2].cancelled() and batch.transfers[2].status is TransferStatus.CANCELLED
    env.engine.post(batch)
    try:
        batch.result(timeout=30)
        raise AssertionError("a batch with a cancelled member must not succeed")
    except CancelledError:
        pass
    for i, t in enumerate(batch.transfers):
        if i != 2:
            assert t.result() == 4096
    assert env.target.sha("buf", 2 * 4096, 4096) == _sha(bytes(4096)), "a request cancelled before posting was written"
    assert env.target.sha("buf", 3 * 4096, 4096) == _sha(b"\x5a" * 4096)
    env.engine.unregister(src)


def check_cancel_after_post(env: ConformanceEnv) -> None:
    """cancel() after posting: True only once no more bytes can land; False when the transfer won the race."""
    remote = env.remote("alloc")
    src = env.engine.allocate(BIG)
    src.view[:] = pattern(41, BIG)
    try:
        results = []
        for _ in range(3):
            t = env.engine.write(src, remote, 0, BIG)
            started = time.monotonic()
            t.cancel()  # never blocks: it only starts the abort
            assert time.monotonic() - started < 1.0, "cancel() blocked"
            ok = t.cancel(timeout=60)  # waits until no more bytes can land
            if ok:
                assert t.cancelled() and t.done() and t.status is TransferStatus.CANCELLED
                try:
                    t.result(0)
                    raise AssertionError("result() of a cancelled transfer must raise CancelledError")
                except CancelledError:
                    pass
                _assert_stable(env, "alloc", 0, BIG)
            else:
                assert t.result(timeout=60) == BIG, "cancel() returned False but the transfer did not complete"
            results.append(ok)
        if not env.capabilities.inflight_cancel:
            assert not any(results), "a transport without inflight_cancel must not report an in-flight cancel"
    finally:
        env.engine.unregister(src, timeout=30)


def check_leases(env: ConformanceEnv) -> None:
    """A region leased by a request cannot be unregistered until the handle is done."""
    remote = env.remote("buf")
    src = env.engine.register(bytearray(4096))
    batch = env.engine.submit([Request("write", src, remote, 0, 4096)], post=False)
    try:
        env.engine.unregister(src)
        raise AssertionError("unregistering a leased region must be refused")
    except RegionBusyError:
        pass
    env.engine.post(batch)
    batch.result(timeout=30)
    env.engine.unregister(src, timeout=5)
    assert src.closed
    try:
        env.engine.write(src, remote, 0, 16)
        raise AssertionError("writing from an unregistered region must be refused")
    except mpcomm.RegionClosedError:
        pass


def _refused(env: ConformanceEnv, fn: Callable[[], Any], kinds: tuple[type[BaseException], ...], what: str) -> None:
    try:
        t = fn()
        t.result(timeout=30)
    except kinds:
        return
    except MpcommError as exc:
        raise AssertionError(f"{what}: refused with {type(exc).__name__}, expected {[k.__name__ for k in kinds]}") from exc
    raise AssertionError(f"{what}: was not refused")


def check_out_of_bounds(env: ConformanceEnv) -> None:
    """Out-of-bounds requests are refused with OutOfBoundsError and nothing is written (forged descriptors too)."""
    for name in ("alloc", "buf"):
        remote = env.remote(name)
        env.target.cmd(f"zero {name}")
        src = env.engine.register(bytearray(b"\xee" * 8192))
        _refused(env, lambda: env.engine.write(src, remote, remote.size - 100, 200), (OutOfBoundsError,),
                 "write past the end")
        _refused(env, lambda: env.engine.read(src, remote, remote.size, 1), (OutOfBoundsError,), "read past the end")
        # A forged descriptor that claims more memory than registered: the target side must refuse.
        forged = dataclasses.replace(remote, size=remote.size + 8192)
        _refused(env, lambda: env.engine.write(src, forged, remote.size - 4096, 8192), (OutOfBoundsError, AccessError),
                 f"write past the registered end of {name!r} through a forged descriptor (verify descriptors with "
                 "the target before trusting their size)")
        assert env.target.sha(name, remote.size - 4096, 4096) == _sha(bytes(4096)), \
            f"an out-of-bounds write to {name!r} was partly written"
        env.engine.unregister(src)


def check_forbidden(env: ConformanceEnv) -> None:
    """Unknown regions, read-only regions and wrong tokens are refused with a clear error, nothing written."""
    try:
        env.remote("no-such-region")
        raise AssertionError("opening an unknown region must fail")
    except UnknownRegionError:
        pass
    ro = env.remote("ro")
    src = env.engine.register(bytearray(b"\x11" * 4096))
    _refused(env, lambda: env.engine.write(src, ro, 0, 4096), (PermissionDeniedError,), "write to a read-only region")
    forged_rw = dataclasses.replace(ro, access="rw")
    _refused(env, lambda: env.engine.write(src, forged_rw, 0, 4096), (AccessError,),
             "write to a read-only region through a descriptor forged to say rw")
    assert env.target.sha("ro", 0, 4096) == _sha(bytes(4096)), "a read-only region was written"
    small = env.remote("small")
    env.target.cmd("zero small")
    bad_token = dataclasses.replace(small, token=small.token ^ 0x5A5A)
    _refused(env, lambda: env.engine.write(src, bad_token, 0, 4096), (AccessError,), "write with a wrong token")
    assert env.target.sha("small", 0, 4096) == _sha(bytes(4096)), "a write with a wrong token landed"
    ro_local = env.engine.register(b"\0" * 4096)
    _refused(env, lambda: env.engine.read(ro_local, small, 0, 4096), (PermissionDeniedError,),
             "read into a read-only local buffer")
    env.engine.unregister(src)
    env.engine.unregister(ro_local)


def check_notifications(env: ConformanceEnv) -> None:
    """A notification is delivered to the target after the data it follows."""
    remote = env.remote("buf")
    before = len(json.loads(env.target.cmd("notes")))
    for i, size in enumerate((16, 4 * MiB + 3)):
        data = pattern(50 + i, size)
        off = 12345 + i * 8 * MiB
        note = json.dumps({"off": off, "len": size, "sha": _sha(data)}).encode()
        env.engine.write(bytearray(data), remote, off, size, notify=note).result(timeout=30)
    deadline = time.monotonic() + 10
    while True:
        notes = json.loads(env.target.cmd("notes"))[before:]
        if len(notes) >= 2 or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert len(notes) == 2, f"expected 2 notifications, got {len(notes)}"
    for n in notes:
        assert n["region"] == "buf"
        assert n.get("data_in_place") is True, "a notification arrived before the data it follows"


def check_peer_killed(env: ConformanceEnv) -> None:
    """A peer killed mid-transfer: every request ends within its deadline with a connection error or timeout."""
    target = env.spawn(regions={"alloc": [BIG, "allocate"]})
    try:
        remote = env.remote("alloc", target)
        src = env.engine.allocate(BIG)
        stop = threading.Event()
        results: list[tuple[str, float]] = []
        timeout = 5.0

        def pump() -> None:
            while not stop.is_set():
                t0 = time.monotonic()
                try:
                    env.engine.write(src, remote, 0, BIG, timeout=timeout).result(timeout + env.grace() + SLACK + 5)
                    results.append(("ok", time.monotonic() - t0))
                except (PeerConnectionError, TransferTimeout) as exc:
                    results.append((type(exc).__name__, time.monotonic() - t0))
                    return
                except Exception as exc:  # noqa: BLE001
                    results.append((f"unexpected {type(exc).__name__}: {exc}", time.monotonic() - t0))
                    return

        th = threading.Thread(target=pump)
        th.start()
        time.sleep(0.3)
        target.kill()
        th.join(timeout + env.grace() + SLACK + 10)
        stop.set()
        assert not th.is_alive(), "a transfer to a killed peer hung"
        assert results, "no transfer ran"
        last, elapsed = results[-1]
        assert last in ("PeerConnectionError", "TransferTimeout", "ok"), f"killed peer gave {last}"
        assert elapsed <= timeout + env.grace() + SLACK, f"the failure took {elapsed:.2f}s"
        # Later requests fail fast and cleanly, they do not hang.
        t0 = time.monotonic()
        try:
            env.engine.write(src, remote, 0, 4096, timeout=timeout).result(timeout + SLACK)
            raise AssertionError("a write to a dead peer succeeded")
        except (PeerConnectionError, TransferTimeout, StaleRegionError):
            pass
        assert time.monotonic() - t0 <= timeout + SLACK
        env.engine.unregister(src, timeout=10)
    finally:
        target.kill()


def check_peer_restart(env: ConformanceEnv) -> None:
    """A peer that restarts gets a new epoch: old descriptors are refused as stale, re-opening works."""
    first = env.spawn(regions={"small": [4096, "buffer"]})
    endpoint = first.address
    try:
        old = env.remote("small", first)
        env.engine.write(bytearray(b"1" * 16), old, 0, 16).result(timeout=30)
    finally:
        first.kill()
    second = None
    for _ in range(50):  # the port may linger a moment
        try:
            second = env.spawn(endpoint=endpoint, regions={"small": [4096, "buffer"]})
            break
        except Exception:  # noqa: BLE001
            time.sleep(0.1)
    assert second is not None, f"could not restart the target on {endpoint}"
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                env.engine.write(bytearray(b"2" * 16), old, 0, 16).result(timeout=10)
                raise AssertionError("a descriptor from before the restart was accepted")
            except StaleRegionError:
                break
            except PeerConnectionError:
                assert time.monotonic() < deadline, "the engine did not reconnect to the restarted peer"
                time.sleep(0.1)
        new = env.remote("small", second)
        assert new.epoch != old.epoch
        env.engine.write(bytearray(b"3" * 16), new, 0, 16).result(timeout=30)
        assert second.sha("small", 0, 16) == _sha(b"3" * 16)
    finally:
        second.kill()


def _refused_after_unregister(env: ConformanceEnv, t: mpcomm.Transfer, what: str) -> None:
    try:
        t.result(timeout=5 + env.grace() + SLACK)
    except TransferTimeout as exc:
        raise AssertionError(f"{what}: only a timeout stopped it ({exc}); a revoked region must be refused") from exc
    except (AccessError, mpcomm.TransferError):
        return
    raise AssertionError(f"{what}: completed although the target had unregistered the region")


def check_revocation(env: ConformanceEnv) -> None:
    """Once the target's unregister returned, the old descriptor reaches nothing: writes and reads
    through it fail (AccessError, or a clear TransferError) and the old memory is unchanged, also
    after the same memory was registered again as a new region."""
    size = 1 << 20
    target = env.spawn(regions={"rv": [size, "buffer"]})
    try:
        remote = env.remote("rv", target)
        src = env.engine.register(bytearray(pattern(61, 65536)))
        dst = env.engine.register(bytearray(65536))
        try:
            # Use the descriptor first, so whatever the transport caches (mappings, keys) is in place.
            assert env.engine.write(src, remote, 0, 4096).result(timeout=30) == 4096
            target.cmd("unregister rv")
            for stage in ("after unregister", "after the memory was registered again"):
                before = target.sha("rv", 0, size)
                _refused_after_unregister(env, env.engine.write(src, remote, 8192, 65536, timeout=5),
                                          f"write through the old descriptor {stage}")
                _refused_after_unregister(env, env.engine.read(dst, remote, 0, 4096, timeout=5),
                                          f"read through the old descriptor {stage}")
                time.sleep(0.2)
                assert target.sha("rv", 0, size) == before, f"bytes landed in the old region's memory {stage}"
                if stage == "after unregister":
                    target.cmd("register rv")  # a new region (new id and token) over the same memory
            # The new region works through its own descriptor.
            fresh = env.remote("rv", target)
            assert env.engine.write(src, fresh, 0, 4096).result(timeout=30) == 4096
            assert target.sha("rv", 0, 4096) == _sha(src.view[:4096])
        finally:
            env.engine.unregister(src, timeout=10)
            env.engine.unregister(dst, timeout=10)
    finally:
        target.kill()


CHECKS: list[Callable[[ConformanceEnv], None]] = [
    check_write_integrity,
    check_read_integrity,
    check_batch,
    check_concurrency,
    check_timeout,
    check_timeout_stalled_target,
    check_cancel_before_post,
    check_cancel_after_post,
    check_leases,
    check_out_of_bounds,
    check_forbidden,
    check_notifications,
    check_peer_killed,
    check_peer_restart,
    check_revocation,
]


@dataclass
class CheckResult:
    name: str
    outcome: str  # "passed" | "failed" | "skipped"
    detail: str = ""
    seconds: float = 0.0


@dataclass
class Report:
    transport: str
    results: list[CheckResult] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(r.outcome != "failed" for r in self.results)

    def summary(self) -> str:
        lines = [f"{r.outcome:7} {r.name:32} {r.seconds:6.2f}s  {r.detail}" for r in self.results]
        counts = {k: sum(r.outcome == k for r in self.results) for k in ("passed", "failed", "skipped")}
        lines.append(f"{counts['passed']} passed, {counts['failed']} failed, {counts['skipped']} skipped")
        return "\n".join(lines)


def run_conformance(transport: str, *, plugins: Sequence[str] = (), config: dict[str, Any] | None = None,
                    checks: Iterable[Callable[[ConformanceEnv], None]] | None = None,
                    autoload: bool | None = None, **env_options: Any) -> Report:
    """Run the conformance checks on ``transport`` without pytest; returns a :class:`Report`.

    ``plugins`` are module names holding hookimpls for transports that are
    not installed through entry points (both processes import them).
    """
    report = Report(transport)
    selected = list(checks if checks is not None else CHECKS)
    try:
        env = ConformanceEnv(transport, plugins=plugins, config=config, autoload=autoload, **env_options)
    except Skip as exc:
        report.results = [CheckResult(c.__name__, "skipped", str(exc)) for c in selected]
        return report
    try:
        for check in selected:
            t0 = time.monotonic()
            try:
                check(env)
                res = CheckResult(check.__name__, "passed")
            except Skip as exc:
                res = CheckResult(check.__name__, "skipped", str(exc))
            except Exception as exc:  # noqa: BLE001
                res = CheckResult(check.__name__, "failed", f"{type(exc).__name__}: {exc}")
            res.seconds = time.monotonic() - t0
            report.results.append(res)
            if env.target.proc.poll() is not None:
                env.target = env.spawn()
    finally:
        env.close()
    return report


def plugin_module(name: str, *classes: type[mpcomm.Transport]) -> types.ModuleType:
    """A plugin module object whose ``mpcomm_register_transports`` hook registers ``classes``.

    For tests that load transports without installing a distribution:
    ``Engine(plugins=[plugin_module("my_plugin", MyTransport)])``.
    """
    mod = types.ModuleType(name)

    @mpcomm.hookimpl
    def mpcomm_register_transports(register: Any) -> None:
        for cls in classes:
            register(cls)

    mod.mpcomm_register_transports = mpcomm_register_transports  # type: ignore[attr-defined]
    return mod
