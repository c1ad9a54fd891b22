"""Data lands intact over both shm routes, at odd offsets, from 1 B to 64 MiB."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator

import numpy as np
import pytest

import mpcomm

from shm_support import Target, make_engine

SIZES = [1, 7, 4095, 4096 + 3, (256 << 10) + 1, (1 << 20) + 5, (5 << 20) + 11, (64 << 20) - 7]
REGION = (64 << 20) + 8192
ROUTES = {"mem": "map", "buf": "cma"}  # allocate() → mapped memfd; bytearray → cross-memory attach


@pytest.fixture(scope="module")
def target() -> Iterator[Target]:
    t = Target({"regions": {"mem": [REGION, "allocate"], "buf": [REGION, "buffer"]}})
    yield t
    t.close()


@pytest.fixture(scope="module")
def engine() -> Iterator[mpcomm.Engine]:
    with make_engine() as e:
        yield e


@pytest.fixture(scope="module")
def copy_engine() -> Iterator[mpcomm.Engine]:
    with make_engine({"transport": {"mode": "copy"}}) as e:
        yield e


def _data(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def _route(engine: mpcomm.Engine, remote: mpcomm.RemoteRegion) -> str:
    shm = engine.transports["shm"]
    return shm._maps[(remote.epoch, remote.region_id)].kind  # type: ignore[attr-defined]


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("name", ["mem", "buf"])
def test_write(target: Target, engine: mpcomm.Engine, name: str, size: int) -> None:
    remote = engine.open(target.address, name)
    src = _data(size + 5, size)
    t = engine.write(src, remote, remote_offset=3, length=size, local_offset=5)
    assert t.result(timeout=20) == size
    assert t.transport == "shm"
    assert _route(engine, remote) == ROUTES[name]
    assert target.cmd("sha", name, 3, size) == hashlib.sha256(src[5 : 5 + size]).hexdigest()


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("name", ["mem", "buf"])
def test_read(target: Target, engine: mpcomm.Engine, name: str, size: int) -> None:
    remote = engine.open(target.address, name)
    assert target.cmd("fill", name, size) == "ok"
    expected = _data(REGION, size)[3 : 3 + size]
    dst = np.zeros(size + 9, dtype=np.uint8)
    t = engine.read(dst, remote, remote_offset=3, length=size, local_offset=9)
    assert t.result(timeout=20) == size
    assert t.transport == "shm"
    assert np.array_equal(dst[9:], expected)
    assert not dst[:9].any()


@pytest.mark.parametrize("size", [4095, (1 << 20) + 5, (9 << 20) + 1])
@pytest.mark.parametrize("name", ["mem", "buf"])
def test_copy_mode(target: Target, copy_engine: mpcomm.Engine, name: str, size: int) -> None:
    remote = copy_engine.open(target.address, name)
    src = _data(size, size + 1)
    copy_engine.write(src, remote, remote_offset=1, length=size).result(timeout=20)
    assert target.cmd("sha", name, 1, size) == hashlib.sha256(src).hexdigest()
    dst = np.zeros(size, dtype=np.uint8)
    copy_engine.read(dst, remote, remote_offset=1, length=size).result(timeout=20)
    assert np.array_equal(dst, src)


@pytest.mark.parametrize("name", ["mem", "buf"])
def test_batch_of_small_writes(target: Target, engine: mpcomm.Engine, name: str) -> None:
    remote = engine.open(target.address, name)
    src = engine.register(bytearray(_data(64 * 4096, 64).tobytes()))
    try:
        reqs = [mpcomm.Request("write", src, remote, 4096 * (63 - k) + 1, 4096, local_offset=4096 * k)
                for k in range(64)]
        assert engine.submit(reqs).result(timeout=20) == 64 * 4096
        for k in (0, 17, 63):
            want = hashlib.sha256(src.view[4096 * k : 4096 * (k + 1)]).hexdigest()
            assert target.cmd("sha", name, 4096 * (63 - k) + 1, 4096) == want
    finally:
        engine.unregister(src)


@pytest.mark.parametrize("name", ["mem", "buf"])
def test_notification_follows_the_data(target: Target, engine: mpcomm.Engine, name: str) -> None:
    """The documented ordering guarantee: a notified target reads every byte of the request."""
    remote = engine.open(target.address, name)
    before = len(json.loads(target.cmd("notes")))
    for size in (4096, 3 << 20, 16 << 20):
        src = _data(size, size + 2)
        note = json.dumps({"off": 64, "len": size, "sha": hashlib.sha256(src).hexdigest()}).encode()
        engine.write(src, remote, remote_offset=64, notify=note).result(timeout=20)
    notes = json.loads(target.cmd("notes"))[before:]
    assert len(notes) == 3 and all(n["in_place"] for n in notes)


def test_read_only_source_buffer(target: Target, engine: mpcomm.Engine) -> None:
    remote = engine.open(target.address, "buf")
    src = bytes(range(256)) * 16
    engine.write(src, remote, remote_offset=10).result(timeout=10)
    assert target.cmd("sha", "buf", 10, len(src)) == hashlib.sha256(src).hexdigest()


@pytest.mark.parametrize("name", ["mem", "buf"])
def test_forged_descriptor_cannot_reach_past_the_region(target: Target, engine: mpcomm.Engine, name: str) -> None:
    """Bounds come from the target's attach answer, not the descriptor, even once mapped."""
    import dataclasses

    remote = engine.open(target.address, name)
    engine.write(b"\0", remote).result(10)  # mapped / attached with the true size
    forged = dataclasses.replace(remote, size=remote.size + (1 << 20), access="rw")
    with pytest.raises(mpcomm.OutOfBoundsError):
        engine.write(b"\xee" * 8192, forged, remote.size - 4096).result(10)
    assert target.cmd("sha", name, remote.size - 4096, 4096) != ""  # the target is alive and answering
