"""A target that exits or unregisters never crashes an initiator."""

from __future__ import annotations

import fcntl
import os
import signal
import threading
import time

import numpy as np
import pytest
from shm_support import make_engine

import mpcomm
from mpcomm.plugins.shm import _native


@pytest.mark.parametrize("name", ["mem", "buf"])
def test_target_killed_mid_stream(spawn, initiator: mpcomm.Engine, name: str) -> None:
    target = spawn({"mem": [16 << 20, "allocate"], "buf": [16 << 20, "buffer"]})
    remote = initiator.open(target.address, name)
    src = np.ones(4 << 20, dtype=np.uint8)
    outcomes: list[str] = []
    stop = threading.Event()

    def stream() -> None:
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and not stop.is_set():
            try:
                initiator.write(src, remote, remote_offset=(len(outcomes) % 3) * (4 << 20), timeout=5).result(10)
                outcomes.append("ok")
            except mpcomm.MpcommError as exc:
                outcomes.append(type(exc).__name__)
                if len(outcomes) - outcomes.index(type(exc).__name__) > 3:
                    return  # errors are stable: done
            except TimeoutError:  # Transfer.result(10) itself: a hang
                outcomes.append("HANG")
                return

    th = threading.Thread(target=stream)
    th.start()
    time.sleep(0.3)
    os.kill(target.pid, signal.SIGKILL)
    th.join(30)
    stop.set()
    assert not th.is_alive()
    assert "HANG" not in outcomes
    assert outcomes.count("ok") > 0
    errors = [o for o in outcomes if o != "ok"]
    assert errors, "writes to a dead peer must end in a clear error"
    assert set(errors) <= {"PeerConnectionError", "StaleRegionError", "TransportUnavailable"}, errors
    # The initiator is healthy: another peer still works.
    other = spawn({"r": [4096, "buffer"]})
    initiator.write(b"x" * 100, initiator.open(other.address, "r")).result(10)


@pytest.mark.parametrize("name", ["mem", "buf"])
def test_region_unregistered_while_mapped(spawn, initiator: mpcomm.Engine, name: str) -> None:
    target = spawn({name: [1 << 20, "allocate" if name == "mem" else "buffer"]})
    remote = initiator.open(target.address, name)
    initiator.write(b"a" * 4096, remote).result(10)  # attached (mapped / CMA route known)
    assert target.cmd("unregister", name) == "ok"  # returns once the initiator dropped it
    with pytest.raises(mpcomm.AccessError) as info:
        initiator.write(b"b" * 4096, remote).result(10)
    assert isinstance(info.value, mpcomm.UnknownRegionError)
    shm = initiator.transports["shm"]
    assert (remote.epoch, remote.region_id) not in shm._maps


def test_unregister_during_a_large_write(spawn) -> None:
    """An in-flight striped write into a region being revoked stops and fails cleanly."""
    with make_engine({"plugins": {"shm": {"chunk": 4096}}, "transport": {"mode": "copy"}}) as e:
        target = spawn({"mem": [64 << 20, "allocate"]})
        remote = e.open(target.address, "mem")
        e.write(b"x", remote).result(10)
        src = np.ones(64 << 20, dtype=np.uint8)
        transfers = [e.write(src, remote, timeout=20) for _ in range(4)]
        assert target.cmd("unregister", "mem") == "ok"
        results = []
        for t in transfers:
            try:
                results.append(t.result(20))
            except mpcomm.UnknownRegionError:
                results.append("revoked")
        assert "revoked" in results  # the last ones cannot have finished yet


def test_memfd_is_sealed_against_shrinking() -> None:
    fd, mm = _native.memfd_segment(1 << 20)
    try:
        _native.seal_access(fd, writable=True)  # what register() does before any fd is handed out
        seals = fcntl.fcntl(fd, _native.F_GET_SEALS)
        assert seals & _native.F_SEAL_SHRINK and seals & _native.F_SEAL_SEAL
        with pytest.raises(PermissionError):
            os.ftruncate(fd, 4096)
    finally:
        mm.close()
        os.close(fd)


def test_mapping_survives_the_target_process(spawn, initiator: mpcomm.Engine) -> None:
    """memfd pages stay alive while mapped: a write right after the target died lands without SIGBUS."""
    target = spawn({"mem": [8 << 20, "allocate"]})
    remote = initiator.open(target.address, "mem")
    initiator.write(b"x", remote).result(10)
    m = initiator.transports["shm"]._maps[(remote.epoch, remote.region_id)]
    assert m.enter() is None  # what a copy in flight holds: the mapping stays until exit()
    try:
        target.kill()
        time.sleep(0.2)  # the control link drops; peer_changed revokes the mapping meanwhile
        _native.memcpy(m.base, bytes(8 << 20), 8 << 20)  # straight into the orphaned pages: no crash
        assert m.mm is not None
    finally:
        m.exit()
    deadline = time.monotonic() + 10
    while m.error is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert m.error is not None and m.mm is None  # revoked, and unmapped once no copy runs


def test_engine_close_drops_mappings(spawn) -> None:
    target = spawn({"mem": [1 << 20, "allocate"]})
    e = make_engine()
    remote = e.open(target.address, "mem")
    e.write(b"x" * 10, remote).result(10)
    m = e.transports["shm"]._maps[(remote.epoch, remote.region_id)]
    e.close()
    assert m.mm is None and m.error is not None
