"""Connects to a down peer are rate-limited per address, and a peer that is back is used at once.

Everything is real: a target engine process (target_proc.py) on a loopback port
chosen here, killed; in its place a listening socket of this test that accepts
each connection and closes it at once, and counts the accepts (so the number of
dials is observed outside the engine); then nothing on the port (refused); then a
new target process on the same port. The initiator loops on open() and write()
the whole time, as a caller retrying a dead address would.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import mpcomm
from mpcomm.errors import PeerConnectionError, StaleRegionError

HERE = Path(__file__).resolve().parent
START_MS, CAP_MS = 100, 400
FAIL_FAST_S = 2.0  # against the 5 s timeout of each request in _hammer


def _closed_port() -> int:
    """A loopback port nothing listens on (bound once, then closed)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_target(endpoint: str, counts: Path) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != "MPCOMM_PLUGINS"}
    proc = subprocess.Popen([sys.executable, str(HERE / "target_proc.py"), endpoint, str(counts)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    assert proc.stdout is not None and proc.stdout.readline(), "the target process did not start"  # listening now
    return proc


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait(10)


class SlamListener:
    """Accepts on ``port`` and closes each connection at once; counts the accepts."""

    def __init__(self, port: int) -> None:
        self.sock = socket.socket()
        # The killed target's side of its connections may still be in TIME_WAIT.
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", port))
        self.sock.listen(128)
        self.accepted = 0
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return  # closed
            with self._lock:
                self.accepted += 1
            conn.close()

    def count(self) -> int:
        with self._lock:
            return self.accepted

    def close(self) -> None:
        """Make the port unavailable: from now on connects are refused."""
        self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()
        self._thread.join(5)


def _hammer(initiator: mpcomm.Engine, address: str, remote: mpcomm.RemoteRegion, seconds: float
            ) -> tuple[int, list[PeerConnectionError], float]:
    """open() and write() to ``address`` in a loop; every one must fail with PeerConnectionError.

    Returns (requests made, the back-off refusals, the slowest request in seconds)."""
    t0 = time.monotonic()
    n, refusals, slowest = 0, [], 0.0
    while time.monotonic() - t0 < seconds:
        s = time.monotonic()
        with pytest.raises(PeerConnectionError) as info:
            if n % 2:
                initiator.write(b"x" * 4096, remote, timeout=5).result(5)
            else:
                initiator.open(address, "kv", timeout=5)
        slowest = max(slowest, time.monotonic() - s)
        n += 1
        if "not connecting to" in str(info.value):
            refusals.append(info.value)
    return n, refusals, slowest


def test_a_down_peer_is_dialled_a_handful_of_times_and_used_once_it_is_back(tmp_path: Path) -> None:
    port = _closed_port()
    address = f"127.0.0.1:{port}"
    cfg = {"health": {"connect_backoff_ms": START_MS, "connect_backoff_max_ms": CAP_MS}}
    counts1, counts2 = tmp_path / "c1.json", tmp_path / "c2.json"
    target = _start_target(address, counts1)
    listener = target2 = None
    with mpcomm.Engine(cfg, transports=["tcp"]) as initiator:
        try:
            remote = initiator.open(address, "kv", timeout=10)
            initiator.write(b"a" * 4096, remote, timeout=10).result(10)
            _stop(target)  # SIGKILL: the port is free again
            deadline = time.monotonic() + 10
            while initiator.stats()["health"]["connections"] and time.monotonic() < deadline:
                time.sleep(0.01)  # the link's loss is seen: the next request dials
            assert not initiator.stats()["health"]["connections"]
            listener = SlamListener(port)

            # 1. A caller looping on the dead address for a second: a handful of dials.
            n, refusals, slowest = _hammer(initiator, address, remote, 1.0)
            dials = listener.count()
            h = initiator.stats()["health"]
            print(f"{n} requests in 1s -> {dials} connects, slowest request {slowest * 1000:.1f} ms")
            assert n >= 100, f"only {n} requests: the loop did not hammer"
            # Windows of 100, 200, 400, 400 ms from the first failure on: at most 5 dials in a second.
            assert 2 <= dials <= 6, f"{dials} connection attempts for {n} requests in one second"
            assert h["connect_failures"]["by_peer"] == {address: dials}, "the engine's count is not the dials seen"
            assert h["connect_backoffs"]["by_peer"] == {address: len(refusals)}
            assert len(refusals) == n - dials, "every request that did not dial was refused by the back-off"
            # Failing fast means not waiting for a dial or for the request's 5 s timeout; the bound sits
            # well below that and well above what a machine shared with busy loops adds (0.6 s was seen).
            assert slowest < FAIL_FAST_S, f"a request to the down peer took {slowest:.3f}s: it did not fail fast"
            err = refusals[-1]
            assert err.retryable and err.peer == address
            assert "last connect attempt failed" in str(err) and "retry after" in str(err), str(err)
            assert isinstance(err.__cause__, PeerConnectionError), "the last connect's own error is not the cause"
            assert 0 < err.retry_after <= CAP_MS / 1000
            assert h["connect_backoff"][address]["failures"] == dials

            # 2. The port is made unavailable (connects are refused): still rate-limited.
            listener.close()
            before = initiator.stats()["health"]["connect_failures"]["total"]
            n2, refusals2, slowest2 = _hammer(initiator, address, remote, 1.0)
            failed2 = initiator.stats()["health"]["connect_failures"]["total"] - before
            assert n2 >= 100 and 1 <= failed2 <= 4, f"{failed2} refused connects for {n2} requests in a second"
            assert slowest2 < FAIL_FAST_S
            assert "refused" in str(refusals2[-1].__cause__), str(refusals2[-1])

            # 3. The peer comes back on the same port: used once the current window passes.
            target2 = _start_target(address, counts2)
            up = time.monotonic()
            got = None
            while got is None and time.monotonic() - up < 10:
                try:
                    got = initiator.open(address, "kv", timeout=5)
                except PeerConnectionError as exc:
                    assert "not connecting to" in str(exc), f"the target is up but connecting failed: {exc}"
                    time.sleep(exc.retry_after)  # type: ignore[attr-defined]
            waited = time.monotonic() - up
            print(f"reconnected {waited * 1000:.0f} ms after the target was up")
            assert got is not None, "never reconnected to the restarted target"
            assert waited < CAP_MS / 1000 + 1.0, f"reconnecting took {waited:.2f}s: longer than one window"
            with pytest.raises(StaleRegionError):  # the old handle's epoch is gone; the new one works
                initiator.write(b"b" * 4096, remote, timeout=5).result(5)
            assert initiator.write(b"c" * 4096, got, timeout=5).result(5) == 4096
            h = initiator.stats()["health"]
            assert h["connect_backoff"] == {}, "a successful connect did not clear the back-off"
            seen = json.loads(counts2.read_text())
            assert seen == {initiator.node_id: 1}, f"the restarted target answered {seen} handshakes"
        finally:
            if listener is not None and listener.sock.fileno() >= 0:
                listener.close()
            _stop(target)
            if target2 is not None:
                _stop(target2)


def test_without_the_back_off_every_request_dials() -> None:
    """connect_backoff_ms = 0 turns it off: the same count then sees one dial per request
    (so the counting above observes every attempt there is)."""
    port = _closed_port()
    listener = SlamListener(port)
    try:
        with mpcomm.Engine({"health": {"connect_backoff_ms": 0}}, transports=["tcp"]) as initiator:
            for _ in range(30):
                with pytest.raises(PeerConnectionError) as info:
                    initiator.open(f"127.0.0.1:{port}", "kv", timeout=5)
                assert "not connecting to" not in str(info.value)
            deadline = time.monotonic() + 5
            while listener.count() < 30 and time.monotonic() < deadline:
                time.sleep(0.01)
            assert listener.count() == 30
            h = initiator.stats()["health"]
            assert h["connect_failures"]["total"] == 30 and h["connect_backoffs"]["total"] == 0
    finally:
        listener.close()


def test_the_back_off_is_per_address_and_a_healthy_peer_is_not_held_up(tmp_path: Path) -> None:
    dead = f"127.0.0.1:{_closed_port()}"
    with mpcomm.Engine(transports=["tcp"]) as target, \
            mpcomm.Engine({"health": {"connect_backoff_ms": 5000, "connect_backoff_max_ms": 5000}},
                          transports=["tcp"]) as initiator:
        target.allocate(1 << 16, "kv")
        for _ in range(3):
            with pytest.raises(PeerConnectionError):
                initiator.open(dead, "kv", timeout=5)
        assert initiator.stats()["health"]["connect_failures"]["total"] == 1
        # Another address is dialled at once.
        remote = initiator.open(target.address, "kv", timeout=5)
        assert initiator.write(b"z" * 100, remote, timeout=5).result(5) == 100
        assert initiator.stats()["health"]["connect_backoff"].keys() == {dead}


def test_the_window_doubles_up_to_the_cap_and_a_success_clears_it() -> None:
    """ConnectBackoff on a clock the test moves: the exact windows."""
    from mpcomm.health import ConnectBackoff, ManualClock

    clock = ManualClock()
    b = ConnectBackoff.from_ms(START_MS, CAP_MS, clock=clock)
    assert b.refusal("p") is None  # nothing recorded: dial
    refused = PeerConnectionError("cannot connect to p: Connection refused")
    for n, window in enumerate((0.1, 0.2, 0.4, 0.4), start=1):
        assert b.failed("p", refused) == window
        err = b.refusal("p")
        assert err is not None and err.retryable and err.__cause__ is refused
        assert err.retry_after == pytest.approx(window) and f"{n} failed in a row" in str(err)  # type: ignore[attr-defined]
        assert b.refusal("q") is None  # per address
        clock.advance(window * 0.99)
        assert b.refusal("p") is not None
        clock.advance(window * 0.02)
        assert b.refusal("p") is None, "the window passed but the next attempt is still held back"
    assert b.state("p")["failures"] == 4
    assert b.metrics.snapshot()["connect_backoffs"]["by_peer"] == {"p": 8}
    b.succeeded("p")
    assert b.state("p") == {"failures": 0, "retry_in": 0.0}
    b.failed("p", refused)
    assert b.refusal("p").retry_after == pytest.approx(0.1)  # type: ignore[union-attr]  # back to the first window
