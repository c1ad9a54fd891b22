"""Vectorised batches over tcp (``write_many``/``read_many``/``submit`` → ``post_many``), target in a child process.

One frame per connection carries the descriptor list and the gathered
payload; the target checks every index against its own region table (a
forged descriptor gets its out-of-range indices refused, and nothing lands
outside); reads scatter straight into the local buffer.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import time
from typing import Any

import pytest

import mpcomm

N, K = 64, 4096


def _pool(engine: mpcomm.Engine) -> Any:
    (pool,) = engine.transports["tcp"]._pools.values()
    return pool


def test_write_many_and_read_many_round_trip(spawn: Any, make_engine: Any) -> None:
    target = spawn({"kv": [4 << 20, "buffer"]})
    ini = make_engine()
    remote = ini.open(target.address, "kv")
    src = ini.allocate(N * K)
    src.view[:] = os.urandom(N * K)
    # Scattered on both sides, odd lengths, one empty request.
    lens = [K - (i % 7) for i in range(N)]
    lens[5] = 0
    loffs = [i * K for i in range(N)][::-1]
    roffs = [(i * 3 % N) * K * 2 + 1 for i in range(N)]
    b = ini.write_many(src, remote, loffs, roffs, lens, timeout=10)
    assert b.result(10) == sum(lens)
    for i in (0, 1, 5, 33, N - 1):
        want = bytes(src.view[loffs[i] : loffs[i] + lens[i]])
        assert target.cmd(f"sha kv {roffs[i]} {lens[i]}") == hashlib.sha256(want).hexdigest(), i
    dst = ini.allocate(N * K)
    r = ini.read_many(dst, remote, loffs, roffs, lens, timeout=10)
    assert r.result(10) == sum(lens)
    for i in range(N):
        assert dst.view[loffs[i] : loffs[i] + lens[i]] == src.view[loffs[i] : loffs[i] + lens[i]], i


def test_a_batch_is_one_frame_on_one_connection(spawn: Any, make_engine: Any) -> None:
    target = spawn({"kv": [4 << 20, "buffer"]})
    ini = make_engine()
    remote = ini.open(target.address, "kv")
    src = ini.allocate(N * K)
    ini.write(src, remote, 0, K).result(5)  # the connection is up
    target.stop()
    try:
        b = ini.write_many(src, remote, [i * K for i in range(N)], [i * K for i in range(N)], [K] * N, timeout=20)
        pool = _pool(ini)
        pending = [p for c in pool._conns for p in c.pending.values()]
        assert len(pending) == 1 and pending[0].count == N
    finally:
        target.cont()
    assert b.result(20) == N * K


def test_submit_groups_same_region_requests_into_one_frame(spawn: Any, make_engine: Any) -> None:
    target = spawn({"kv": [4 << 20, "buffer"]})
    ini = make_engine()
    remote = ini.open(target.address, "kv")
    src = ini.allocate(N * K)
    src.view[:] = os.urandom(N * K)
    ini.write(src, remote, 0, K).result(5)
    target.stop()
    try:
        b = ini.submit([mpcomm.Request("write", src, remote, i * K, K, i * K) for i in range(N)], timeout=20)
        pending = [p for c in _pool(ini)._conns for p in c.pending.values()]
        assert [p.count for p in pending] == [N]
    finally:
        target.cont()
    assert b.result(20) == N * K
    assert target.cmd(f"sha kv 0 {N * K}") == hashlib.sha256(src.view).hexdigest()


def test_the_target_refuses_out_of_range_indices_of_a_forged_descriptor(spawn: Any, make_engine: Any) -> None:
    target = spawn({"kv": [1 << 20, "buffer"]})
    ini = make_engine()
    remote = ini.open(target.address, "kv")
    forged = dataclasses.replace(remote, size=remote.size * 4)  # the engine checks against this; the target does not
    target.cmd("zero kv")
    src = ini.allocate(4 * K)
    src.view[:] = b"\x5a" * (4 * K)
    roffs = [0, remote.size - K // 2, 2 * K, remote.size + 8 * K]  # 1 straddles the end, 3 is beyond it
    b = ini.write_many(src, forged, [0, K, 2 * K, 3 * K], roffs, [K] * 4, timeout=10)
    with pytest.raises(mpcomm.OutOfBoundsError):
        b.result(10)
    assert b.failed == [1, 3]
    assert b.statuses[0] == mpcomm.TransferStatus.COMPLETED and b.statuses[2] == mpcomm.TransferStatus.COMPLETED
    assert b.bytes_per_request == [K, 0, K, 0]
    assert target.cmd(f"sha kv 0 {K}") == hashlib.sha256(b"\x5a" * K).hexdigest()
    # Nothing of index 1 landed, not even the part inside the region.
    assert target.cmd(f"sha kv {remote.size - K // 2} {K // 2}") == hashlib.sha256(bytes(K // 2)).hexdigest()
    dst = ini.allocate(4 * K)
    r = ini.read_many(dst, forged, [0, K, 2 * K, 3 * K], roffs, [K] * 4, timeout=10)
    with pytest.raises(mpcomm.OutOfBoundsError):
        r.result(10)
    assert r.failed == [1, 3]
    assert bytes(dst.view[:K]) == b"\x5a" * K and bytes(dst.view[K : 2 * K]) == bytes(K)


def test_a_large_batch_is_split_over_connections(spawn: Any, make_engine: Any) -> None:
    target = spawn({"kv": [32 << 20, "allocate"]})
    ini = make_engine({"plugins": {"tcp": {"stripe_threshold": 1 << 20, "connections": 3}}})
    remote = ini.open(target.address, "kv")
    n, size = 48, 256 << 10
    src = ini.allocate(n * size)
    src.view[:] = os.urandom(1 << 20) * (n * size >> 20)
    offs = [i * size for i in range(n)]
    b = ini.write_many(src, remote, offs, offs, [size] * n, timeout=20)
    assert b.result(20) == n * size
    assert target.cmd(f"sha kv 0 {n * size}") == hashlib.sha256(src.view).hexdigest()
    assert len(_pool(ini)._conns) == 3
    dst = ini.allocate(n * size)
    ini.read_many(dst, remote, offs, offs, [size] * n, timeout=20).result(20)
    assert dst.view == src.view


def test_a_batch_to_a_stopped_target_times_out_honestly(spawn: Any, make_engine: Any) -> None:
    target = spawn({"kv": [1 << 20, "buffer"]})
    ini = make_engine({"runtime": {"abort_grace_ms": 400}})
    remote = ini.open(target.address, "kv")
    src = ini.allocate(N * K)
    ini.write(src, remote, 0, K).result(5)
    target.stop()
    try:
        t0 = time.monotonic()
        w = ini.write_many(src, remote, [i * K for i in range(16)], [i * K for i in range(16)], [K] * 16, timeout=0.5)
        r = ini.read_many(src, remote, [i * K for i in range(16)], [i * K for i in range(16)], [K] * 16, timeout=0.5)
        assert time.monotonic() - t0 < 0.2  # posting did not wait
        with pytest.raises(mpcomm.TransferTimeout) as wi:
            w.result(5)
        with pytest.raises(mpcomm.TransferTimeout) as ri:
            r.result(5)
        assert wi.value.confirmed is False  # in the stopped target's socket: may still land
        assert ri.value.confirmed is not False  # only our reader writes our buffer, and it stopped
    finally:
        target.cont()
