"""Vectorised batches over shm (``write_many`` / ``read_many`` → ``ShmTransport.post_many``), two processes."""

from __future__ import annotations

import dataclasses
import hashlib
import os
import signal
from collections.abc import Iterator

import numpy as np
import pytest
from shm_support import Target, make_engine

import mpcomm

REGION = 8 << 20
PIECE = 4096
N = 1024

pytestmark = pytest.mark.skipif(not hasattr(mpcomm.Engine, "write_many"), reason="engine without write_many")


@pytest.fixture(scope="module")
def target() -> Iterator[Target]:
    t = Target({"regions": {"mem": [REGION, "allocate"], "buf": [REGION, "buffer"]}})
    yield t
    t.close()


@pytest.fixture(scope="module", params=[True, False], ids=["native", "python"])
def engine(request: pytest.FixtureRequest) -> Iterator[mpcomm.Engine]:
    with make_engine({"plugins": {"shm": {"native": request.param}}}) as e:
        yield e


def _layout(seed: int, n: int = N) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """n pieces at scattered, odd, non-overlapping remote offsets; some empty."""
    rng = np.random.default_rng(seed)
    remote = rng.permutation(REGION // PIECE - 1)[:n] * PIECE + 1
    local = np.arange(n) * PIECE
    lengths = rng.integers(1, PIECE, n)
    lengths[::7] = 0  # empty pieces are legal
    return local, remote, lengths


def _image(src: bytes, local: np.ndarray, remote: np.ndarray, lengths: np.ndarray, base: bytes) -> bytes:
    img = bytearray(base)
    for lo, ro, ln in zip(local.tolist(), remote.tolist(), lengths.tolist()):
        img[ro : ro + ln] = src[lo : lo + ln]
    return bytes(img)


def _zero(target: Target, name: str) -> bytes:
    assert target.cmd("fill", name, 0) == "ok"  # a known background, not zeros
    return np.random.default_rng(0).integers(0, 256, REGION, dtype=np.uint8).tobytes()


@pytest.mark.parametrize("name", ["mem", "buf"])
def test_write_many_scattered(target: Target, engine: mpcomm.Engine, name: str) -> None:
    remote = engine.open(target.address, name)
    base = _zero(target, name)
    local, roffs, lengths = _layout(11)
    src = engine.allocate(len(local) * PIECE)
    data = np.random.default_rng(3).integers(0, 256, src.size, dtype=np.uint8).tobytes()
    src.view[:] = data
    try:
        batch = engine.write_many(src, remote, local, roffs, lengths)
        assert batch.result(timeout=30) == int(lengths.sum())
        assert batch.transport == "shm"
        assert target.cmd("sha", name, 0, REGION) == hashlib.sha256(_image(data, local, roffs, lengths, base)).hexdigest()
    finally:
        engine.unregister(src, timeout=10)


@pytest.mark.parametrize("name", ["mem", "buf"])
def test_read_many_scattered(target: Target, engine: mpcomm.Engine, name: str) -> None:
    remote = engine.open(target.address, name)
    assert target.cmd("fill", name, 21) == "ok"
    theirs = np.random.default_rng(21).integers(0, 256, REGION, dtype=np.uint8).tobytes()
    local, roffs, lengths = _layout(12)
    dst = bytearray(len(local) * PIECE)
    batch = engine.read_many(dst, remote, local, roffs, lengths)
    assert batch.result(timeout=30) == int(lengths.sum())
    # Read back = scatter of their bytes into our buffer.
    want = bytearray(len(dst))
    for lo, ro, ln in zip(local.tolist(), roffs.tolist(), lengths.tolist()):
        want[lo : lo + ln] = theirs[ro : ro + ln]
    assert dst == want


@pytest.mark.parametrize("name", ["mem", "buf"])
def test_batch_past_the_target_region_is_refused_whole(target: Target, engine: mpcomm.Engine, name: str) -> None:
    """The target's size decides (a forged descriptor claims more); nothing of the batch lands."""
    remote = engine.open(target.address, name)
    engine.write(b"\0", remote).result(10)  # attached with the true size
    before = target.cmd("sha", name, 0, REGION)
    forged = dataclasses.replace(remote, size=REGION + (1 << 20))
    offs = [0, 4096, REGION - 100, 8192]  # index 2 runs past the real end
    with pytest.raises(mpcomm.OutOfBoundsError, match="request 2"):
        engine.write_many(b"\xee" * 4 * 4096, forged, [0, 4096, 8192, 12288], offs, [4096] * 4).result(10)
    assert target.cmd("sha", name, 0, REGION) == before


def test_batch_during_revocation(spawn) -> None:
    """A batch on a worker (over inline_threshold) meets unregister: indices before the revoke complete, the rest fail."""
    cfg = {"plugins": {"shm": {"inline_threshold": 1 << 20, "chunk": 4096}}, "transport": {"mode": "copy"}}
    target = spawn({"mem": [64 << 20, "allocate"]})
    with make_engine(cfg) as e:
        remote = e.open(target.address, "mem")
        e.write(b"x", remote).result(10)
        n = 16384
        src = e.allocate(n * 4096)
        batches = [e.write_many(src, remote, np.arange(n) * 4096, np.arange(n) * 4096, np.full(n, 4096),
                                timeout=60) for _ in range(3)]
        assert target.cmd("unregister", "mem") == "ok"
        revoked = 0
        for b in batches:
            try:
                b.result(60)
            except mpcomm.UnknownRegionError:
                revoked += 1
                errs = b.errors
                assert errs and all(isinstance(x, mpcomm.UnknownRegionError) for x in errs.values())
                first = min(errs)
                assert all(s is mpcomm.TransferStatus.COMPLETED for s in b.statuses[:first])
        assert revoked  # the last ones cannot have finished yet
        with pytest.raises(mpcomm.UnknownRegionError):
            e.write_many(src, remote, [0], [0], [4096]).result(10)


@pytest.mark.parametrize("name", ["mem", "buf"])
def test_batch_to_a_killed_peer_fails(spawn, name: str) -> None:
    target = spawn({"mem": [1 << 20, "allocate"], "buf": [1 << 20, "buffer"]})
    with make_engine() as e:
        remote = e.open(target.address, name)
        offs = np.arange(64) * 4096
        assert e.write_many(bytes(64 * 4096), remote, offs, offs, np.full(64, 4096)).result(10) == 64 * 4096
        holder = int(target.cmd("hold"))  # its connections stay up: only the pid tells
        os.kill(target.pid, signal.SIGKILL)
        target.proc.wait(10)
        try:
            b = e.write_many(bytes(64 * 4096), remote, offs, offs, np.full(64, 4096), timeout=5)
            with pytest.raises(mpcomm.PeerConnectionError):
                b.result(10)
            assert b.failed == list(range(64))
        finally:
            os.kill(holder, signal.SIGKILL)


def test_cancel_a_batch_in_flight(spawn) -> None:
    cfg = {"plugins": {"shm": {"inline_threshold": 1 << 20, "chunk": 4096}}, "transport": {"mode": "copy"}}
    target = spawn({"mem": [64 << 20, "allocate"]})
    with make_engine(cfg) as e:
        remote = e.open(target.address, "mem")
        e.write(b"x", remote).result(10)
        n = 16384
        src = e.allocate(n * 4096)
        b = e.write_many(src, remote, np.arange(n) * 4096, np.arange(n) * 4096, np.full(n, 4096), timeout=60)
        if b.cancel(timeout=10):
            assert b.cancelled()
        else:
            assert b.result(30) == n * 4096
        e.write(b"y" * 100, remote).result(10)  # the route still works
