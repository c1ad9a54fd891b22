"""Cancel and timeout stop an shm copy within a chunk."""

from __future__ import annotations

from concurrent.futures import CancelledError

import numpy as np
import pytest
from shm_support import make_engine

import mpcomm

SLOW = {"plugins": {"shm": {"chunk": 4096}}, "transport": {"mode": "copy"}}  # slow on purpose


@pytest.fixture(scope="module")
def target_engine():
    with make_engine() as t:
        t.allocate(64 << 20, name="mem")
        t.register(bytearray(64 << 20), name="buf")
        yield t


@pytest.mark.parametrize("name", ["mem", "buf"])
def test_cancel_in_flight(target_engine: mpcomm.Engine, name: str) -> None:
    with make_engine(SLOW) as e:
        remote = e.open(target_engine.address, name)
        e.write(b"x", remote).result(10)
        t = e.write(np.ones(64 << 20, dtype=np.uint8), remote, timeout=30)
        assert t.cancel(timeout=10) is True
        assert t.status == mpcomm.TransferStatus.CANCELLED
        with pytest.raises(CancelledError):
            t.result(1)
        e.write(b"y" * 100, remote).result(10)  # the route still works


@pytest.mark.parametrize("name", ["mem", "buf"])
def test_timeout_in_flight(target_engine: mpcomm.Engine, name: str) -> None:
    with make_engine(SLOW) as e:
        remote = e.open(target_engine.address, name)
        e.write(b"x", remote).result(10)
        t = e.read(np.zeros(64 << 20, dtype=np.uint8), remote, timeout=0.02)
        with pytest.raises(mpcomm.TransferTimeout):
            t.result(10)
        assert t.status == mpcomm.TransferStatus.TIMED_OUT


def test_completed_request_cannot_be_cancelled(target_engine: mpcomm.Engine) -> None:
    with make_engine() as e:
        t = e.write(b"z" * 64, e.open(target_engine.address, "mem"))
        t.result(10)
        assert t.cancel() is False
