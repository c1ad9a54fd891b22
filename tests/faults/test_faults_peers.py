"""Peers that die or freeze, on loopback, for every transport on main.

* SIGKILL mid-transfer, then a restart on the same endpoint (a new epoch):
  every request ends in time with success or a clear error; nothing submitted
  after the death is reported complete; the old descriptor is refused
  (StaleRegionError, or PeerConnectionError while the link is re-made); the
  initiator re-opens and carries on, bytes verified.
* SIGSTOP past the deadline: the request ends within deadline + abort grace
  (TransferTimeout for a transport that needs the target's CPU; a one-sided
  transport may complete, because the target's memory is there while its CPU
  is stopped). ``confirmed`` tells the truth: while the target is still stopped
  the test reads the range from ``/proc/<pid>/mem``; if the timeout said
  confirmed, not one byte of it may change after SIGCONT. No byte lands
  outside the range; the target serves again after SIGCONT.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator

import pytest
from support import SLACK, HostProcess, outside_untouched, sha, transports

import mpcomm
from mpcomm.testing.patterns import pattern

MiB = 1 << 20
SIZE = 32 * MiB
FILL = 707
GRACE = 1.0
CONFIG = {"runtime": {"abort_grace_ms": int(GRACE * 1000), "request_timeout_ms": 5000}}
CLEAR = (mpcomm.AccessError, mpcomm.TransferTimeout, mpcomm.PeerConnectionError, mpcomm.TransferError)

pytestmark = pytest.mark.parametrize("transport", transports())


@pytest.fixture
def initiator(transport: str) -> Iterator[mpcomm.Engine]:
    with mpcomm.Engine(CONFIG, transports=[transport]) as e:
        yield e


def test_target_killed_mid_transfer_and_restarted_with_a_new_epoch(transport: str, initiator: mpcomm.Engine) -> None:
    t = HostProcess(transport, {"kv": [SIZE, "buffer", FILL]})
    reborn = None
    try:
        kv = initiator.open(t.address, "kv")
        deadline = 2.0
        results: list[tuple[float, float, BaseException | None]] = []  # (submitted at, took, error)
        stop = threading.Event()

        def worker(k: int) -> None:
            n = 0
            while not stop.is_set():
                n += 1
                length = (MiB, 4 * MiB + 1, 64 << 10)[n % 3]
                t0 = time.monotonic()
                try:
                    initiator.write(pattern(k * 1000 + n, length), kv, k * 8 * MiB, timeout=deadline).result(
                        deadline + GRACE + SLACK + 30)
                    err = None
                except BaseException as exc:  # noqa: BLE001
                    err = exc
                results.append((t0, time.monotonic() - t0, err))
                if err is not None:
                    time.sleep(0.02)

        threads = [threading.Thread(target=worker, args=(k,), daemon=True) for k in range(3)]
        for th in threads:
            th.start()
        time.sleep(0.6)
        t.proc.kill()
        t.proc.wait(10)
        killed_at = time.monotonic()
        time.sleep(deadline + GRACE)
        stop.set()
        for th in threads:
            th.join(deadline + GRACE + SLACK + 40)
            assert not th.is_alive(), "a request never ended"
        for t0, took, err in results:
            assert took <= deadline + GRACE + SLACK, f"a write took {took:.1f}s against a {deadline}s deadline"
            if err is not None:
                assert isinstance(err, CLEAR), f"unclear error: {type(err).__name__}: {err}"
            if t0 > killed_at + 0.5:
                assert err is not None, "a write submitted after the target died was reported complete"
        assert any(e is None for _, _, e in results), "nothing completed before the kill: the case did not run"
        assert any(t0 > killed_at + 0.5 for t0, _, _ in results), "no request was tried after the death"

        reborn = t.restart()
        assert reborn.epoch != t.epoch
        deadline_at = time.monotonic() + 20
        while True:  # the old descriptor: refused, clearly, until we re-open
            try:
                initiator.write(b"stale", kv, 0, timeout=3).result(10)
                raise AssertionError("a descriptor from the dead epoch was accepted")
            except (mpcomm.StaleRegionError, mpcomm.UnknownRegionError) as exc:
                assert exc.retryable or isinstance(exc, mpcomm.UnknownRegionError)
                break
            except mpcomm.PeerConnectionError:
                assert time.monotonic() < deadline_at, "the restarted target was never reached"
                time.sleep(0.2)
        fresh = initiator.open(reborn.address, "kv")
        assert fresh.epoch == reborn.epoch
        initiator.write(pattern(77, 4 * MiB), fresh, MiB, timeout=10).result(20)
        assert reborn.sha("kv", MiB, 4 * MiB) == sha(pattern(77, 4 * MiB))
        outside_untouched(reborn, "kv", FILL, SIZE, [(MiB, 4 * MiB)])
    finally:
        stop.set()
        t.kill()
        if reborn is not None:
            reborn.close()


def _read_stopped(pid: int, address: int, length: int) -> bytes:
    """Bytes of a (stopped) process's memory, straight from the kernel."""
    with open(f"/proc/{pid}/mem", "rb", buffering=0) as f:
        f.seek(address)
        return f.read(length)


@pytest.mark.skipif(os.geteuid() != 0, reason="reads the stopped target's memory through /proc/<pid>/mem (root)")
@pytest.mark.parametrize("how", ["buffer", "allocate"])
def test_target_stopped_past_the_deadline(transport: str, how: str, initiator: mpcomm.Engine) -> None:
    t = HostProcess(transport, {"kv": [SIZE, how, FILL]})
    try:
        kv = initiator.open(t.address, "kv")
        initiator.write(b"warm", kv, 0, timeout=5).result(10)  # links, mappings, connections up
        off, length, deadline = 4 * MiB + 3, 16 * MiB, 1.0
        t.stop()
        try:
            t0 = time.monotonic()
            fut = initiator.write(pattern(51, length), kv, off, timeout=deadline)
            try:
                fut.result(deadline + GRACE + SLACK + 30)
                err: BaseException | None = None
            except BaseException as exc:  # noqa: BLE001
                err = exc
            took = time.monotonic() - t0
            frozen = _read_stopped(t.pid, kv.base_address + off, length)
        finally:
            t.cont()
        assert took <= deadline + GRACE + SLACK, f"took {took:.1f}s against a {deadline}s deadline"
        print(f"{transport}/{how}: {type(err).__name__ if err else 'completed'} "
              f"confirmed={getattr(err, 'confirmed', None)} after {took:.2f}s")
        if err is None:
            # Only a transport that needs no target CPU may finish against a stopped target.
            assert type(initiator.transports[transport]).capabilities.one_sided, \
                f"{transport} reported a write to a stopped target complete"
            assert frozen == pattern(51, length), "reported complete, but the bytes were not in place"
        else:
            assert isinstance(err, mpcomm.TransferTimeout), f"{type(err).__name__}: {err}"
            time.sleep(deadline + GRACE)  # whatever the resumed target still does, it has done by now
            if err.confirmed:
                assert t.sha("kv", off, length) == sha(frozen), "confirmed=True, yet bytes landed after the timeout"
        outside_untouched(t, "kv", FILL, SIZE, [(0, 4), (off, length)])
        again = initiator.write(pattern(52, MiB), kv, 24 * MiB, timeout=10)
        again.result(20)
        assert t.sha("kv", 24 * MiB, MiB) == sha(pattern(52, MiB))
    finally:
        t.close()
