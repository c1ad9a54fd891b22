"""post() never waits on the peer: the first request to a region attaches on a worker."""

from __future__ import annotations

import os
import signal
import time

import pytest

import mpcomm


def _wait_stopped(pid: int) -> None:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # every thread, not just the leader
        states = []
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                states.append(f.read().rsplit(")", 1)[1].split()[0])
        if all(s in ("T", "t") for s in states):
            return
        time.sleep(0.01)
    raise AssertionError(f"pid {pid} did not stop")


@pytest.mark.parametrize("name", ["mem", "buf"])
def test_first_request_to_a_stopped_peer_returns_at_once(spawn, initiator: mpcomm.Engine, name: str) -> None:
    target = spawn({"mem": [1 << 20, "allocate"], "buf": [1 << 20, "buffer"]})
    remote = initiator.open(target.address, name)
    os.kill(target.pid, signal.SIGSTOP)  # the attach round trip cannot be answered now
    _wait_stopped(target.pid)
    try:
        t0 = time.monotonic()
        t = initiator.write(b"x" * 4096, remote, timeout=1.0)
        assert time.monotonic() - t0 < 0.5, "write() waited for the peer"
        with pytest.raises(mpcomm.TransferTimeout):
            t.result(10)
    finally:
        os.kill(target.pid, signal.SIGCONT)
    # Once the peer answers again the region attaches and works.
    initiator.write(b"y" * 4096, remote, timeout=10).result(15)
    import hashlib

    assert target.cmd("sha", name, 0, 4096) == hashlib.sha256(b"y" * 4096).hexdigest()
