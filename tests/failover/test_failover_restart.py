"""A restarted peer (new epoch) is reconnected once, whatever the number of callers.

Sixteen threads in each of two initiator engines write to a target process
that is SIGKILLed and restarted on the same control port. Every caller sees
its region go stale (or the peer gone), re-opens it and carries on; the new
target process counts the handshakes it answers: exactly one per initiator
engine — the engine's per-peer single-flight connect shares one handshake
among all its callers, and failed attempts while the port was closed never
reached a handshake. The new epoch also resets the peer's health record (its
cool-downs and quarantine from while it was down), keyed by address: the
restarted process has a new node_id as well.
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

import mpcomm
from mpcomm.errors import PeerConnectionError, StaleRegionError, TransferError, TransferTimeout

HERE = Path(__file__).resolve().parent
THREADS = 16


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(endpoint: str, counts: Path) -> tuple[subprocess.Popen, dict]:
    env = {k: v for k, v in os.environ.items() if k not in ("MPCOMM_PLUGINS",)}
    proc = subprocess.Popen([sys.executable, str(HERE / "target_proc.py"), endpoint, str(counts)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    line = proc.stdout.readline()  # type: ignore[union-attr]
    assert line, "the target process did not start"
    return proc, json.loads(line)


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait(10)


def test_the_faulty_plugin_did_not_leak_out_of_its_modules() -> None:
    from mpcomm.registry import load_plugins

    assert "faulty" not in load_plugins().transports


def test_restarted_peer_is_reconnected_once_per_engine(tmp_path: Path) -> None:
    endpoint = f"127.0.0.1:{_free_port()}"
    counts1, counts2 = tmp_path / "c1.json", tmp_path / "c2.json"
    proc, info1 = _start(endpoint, counts1)
    engines = [mpcomm.Engine(transports=["tcp"]), mpcomm.Engine(transports=["tcp"])]
    stop = threading.Event()
    restarted = threading.Event()
    after: dict[int, int] = {}
    errors: list[BaseException] = []
    lock = threading.Lock()

    def worker(k: int, engine: mpcomm.Engine) -> None:
        remote = engine.open(endpoint, "kv", timeout=10)
        data = bytes([k]) * 4096
        ok_after = 0
        while not stop.is_set():
            seen_restart = restarted.is_set()
            try:
                engine.write(data, remote, remote_offset=k * 4096, timeout=5).result(6)
                if seen_restart:
                    ok_after += 1
                    if ok_after >= 20:
                        break
            except (StaleRegionError, PeerConnectionError, TransferTimeout, TransferError):
                # The target died (a write it could not confirm is a TransferError) or
            # restarted: open the region again (this is where a
                # storm of reconnects would come from).
                while not stop.is_set():
                    try:
                        remote = engine.open(endpoint, "kv", timeout=2)
                        break
                    except mpcomm.MpcommError:  # the port is closed, or the new process is starting
                        time.sleep(0.01)
            except BaseException as exc:  # noqa: BLE001
                with lock:
                    errors.append(exc)
                return
        with lock:
            after[k] = ok_after

    threads = [threading.Thread(target=worker, args=(i, engines[i % 2]), daemon=True)
               for i in range(2 * THREADS)]
    proc2 = None
    try:
        for t in threads:
            t.start()
        time.sleep(0.5)
        before = json.loads(counts1.read_text())
        assert before == {engines[0].node_id: 1, engines[1].node_id: 1}, before
        _stop(proc)  # SIGKILL mid-traffic
        time.sleep(0.3)
        proc2, info2 = _start(endpoint, counts2)
        assert info2["epoch"] != info1["epoch"]
        restarted.set()
        t0 = time.monotonic()
        for t in threads:
            t.join(60)
        print(f"all callers carried on {time.monotonic() - t0:.2f}s after the restart")
        stop.set()
        assert not errors, errors[:3]
        assert len(after) == 2 * THREADS and all(n >= 20 for n in after.values()), after
        # The new epoch starts with a clean record: the cool-downs and the
        # quarantine earned while the port was closed were forgotten.
        for e in engines:
            assert e.health.path_state(endpoint, "tcp")["failures"] == 0
            assert not e.health.quarantined(endpoint)
        seen = json.loads(counts2.read_text())
        assert seen == {engines[0].node_id: 1, engines[1].node_id: 1}, \
            f"the restarted target answered {seen} handshakes; expected one per initiator engine"
    finally:
        stop.set()
        for e in engines:
            e.close()
        _stop(proc)
        if proc2 is not None:
            _stop(proc2)
