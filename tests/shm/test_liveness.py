"""A handle's outcome is true: nothing written to a dead peer is reported as completed.

The target's connections are kept open by a forked child ("hold"), so the
engine gets no peer-lost signal: only the owner's pid tells that nobody will
read the bytes (a write into a dead peer's memfd lands in orphaned pages).
"""

from __future__ import annotations

import os
import signal

import numpy as np
import pytest
from shm_support import make_engine

import mpcomm

SIZES = [4096, 1 << 20, 24 << 20]  # locked small path, inline chunks, worker stripes (with the config below)
CONFIG = {"plugins": {"shm": {"inline_threshold": 8 << 20, "stripe_threshold": 16 << 20, "stripes": 2}}}


def _kill_holding_connections(target) -> int:
    holder = int(target.cmd("hold"))
    os.kill(target.pid, signal.SIGKILL)
    target.proc.wait(10)  # reaped: the pid names nobody now
    return holder


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("name", ["mem", "buf"])
def test_writes_to_a_killed_peer_fail(spawn, name: str, native: bool) -> None:
    target = spawn({"mem": [32 << 20, "allocate"], "buf": [32 << 20, "buffer"]})
    cfg = {"plugins": {"shm": {**CONFIG["plugins"]["shm"], "native": native}}}
    with make_engine(cfg) as e:
        remote = e.open(target.address, name)
        src = np.ones(max(SIZES), dtype=np.uint8)
        for size in SIZES:  # attached, every path works while the owner lives
            assert e.write(src, remote, 0, size).result(10) == size
        holder = _kill_holding_connections(target)
        try:
            for size in SIZES:
                with pytest.raises(mpcomm.PeerConnectionError):
                    e.write(src, remote, 0, size, timeout=5).result(10)
                with pytest.raises(mpcomm.PeerConnectionError):
                    e.read(np.zeros(size, dtype=np.uint8), remote, 0, size, timeout=5).result(10)
        finally:
            os.kill(holder, signal.SIGKILL)


def test_first_failure_names_the_dead_process(spawn) -> None:
    target = spawn({"mem": [1 << 20, "allocate"]})
    with make_engine() as e:
        remote = e.open(target.address, "mem")
        e.write(b"x" * 4096, remote).result(10)
        holder = _kill_holding_connections(target)
        try:
            with pytest.raises(mpcomm.PeerConnectionError, match="exited"):
                e.write(b"y" * 4096, remote, timeout=5).result(10)
        finally:
            os.kill(holder, signal.SIGKILL)


def test_live_peer_with_a_forked_child_still_works(spawn) -> None:
    """The check follows the owner's pid, not whoever else holds the memfd."""
    target = spawn({"mem": [1 << 20, "allocate"]})
    with make_engine() as e:
        remote = e.open(target.address, "mem")
        holder = int(target.cmd("hold"))
        try:
            e.write(b"z" * 4096, remote).result(10)
            import hashlib

            assert target.cmd("sha", "mem", 0, 4096) == hashlib.sha256(b"z" * 4096).hexdigest()
        finally:
            os.kill(holder, signal.SIGKILL)
