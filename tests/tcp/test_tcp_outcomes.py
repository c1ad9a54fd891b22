"""A handle's outcome is true: the abort fence is per connection that carried the request (target in a child process)."""

from __future__ import annotations

import hashlib
import time
from typing import Any

import pytest

import mpcomm


def test_timed_out_requests_on_a_live_target_are_confirmed(spawn: Any, make_engine: Any) -> None:
    target = spawn({"kv": [128 << 20, "allocate"]})
    ini = make_engine({"runtime": {"abort_grace_ms": 2000}})
    remote = ini.open(target.address, "kv")
    src = ini.allocate(128 << 20)
    ini.write(src, remote, 0, 4096).result(5)
    for kind in ("write", "read"):
        t = (ini.write if kind == "write" else ini.read)(src, remote, 0, 128 << 20, timeout=0.02)
        with pytest.raises(mpcomm.TransferTimeout) as info:
            t.result(10)
        assert info.value.confirmed is True, kind
    # The target is unharmed and serves the next request.
    ini.write(b"z" * 4096, remote, 0).result(5)
    assert target.cmd("sha kv 0 4096") == hashlib.sha256(b"z" * 4096).hexdigest()


def test_a_request_queued_behind_another_times_out_confirmed_and_never_lands(spawn: Any, make_engine: Any) -> None:
    target = spawn({"kv": [96 << 20, "allocate"]})
    ini = make_engine({"plugins": {"tcp": {"connections": 1}}})
    remote = ini.open(target.address, "kv")
    src = ini.allocate(64 << 20)
    ini.write(src, remote, 0, 4096).result(5)
    target.cmd("zero kv")
    big = ini.write(src, remote, 0, 64 << 20, timeout=20)
    small = ini.write(b"\x77" * 4096, remote, 80 << 20, timeout=0.001)
    with pytest.raises(mpcomm.TransferTimeout) as info:
        small.result(5)
    assert info.value.confirmed is True
    assert big.result(20) == 64 << 20  # the request that carried the connection is not collateral
    assert target.cmd(f"sha kv {80 << 20} 4096") == hashlib.sha256(bytes(4096)).hexdigest()


def test_cancel_in_flight_on_a_live_target(spawn: Any, make_engine: Any) -> None:
    target = spawn({"kv": [128 << 20, "allocate"]})
    ini = make_engine()
    remote = ini.open(target.address, "kv")
    src = ini.allocate(128 << 20)
    ini.write(src, remote, 0, 4096).result(5)
    t = ini.write(src, remote, 0, 128 << 20, timeout=20)
    time.sleep(0.01)
    t0 = time.monotonic()
    assert t.cancel(timeout=2) is True
    assert time.monotonic() - t0 < 2
    assert t.status == mpcomm.TransferStatus.CANCELLED
    ini.write(b"q" * 4096, remote, 0).result(5)


def test_a_killed_target_fails_requests_promptly(spawn: Any, make_engine: Any) -> None:
    target = spawn({"kv": [64 << 20, "allocate"]})
    ini = make_engine()
    remote = ini.open(target.address, "kv")
    src = ini.allocate(64 << 20)
    ini.write(src, remote, 0, 4096).result(5)
    ts = [ini.write(src, remote, 0, 64 << 20, timeout=30) for _ in range(3)]
    time.sleep(0.02)
    target.kill()
    t0 = time.monotonic()
    for t in ts:
        try:
            t.result(10)
        except mpcomm.MpcommError as exc:
            assert not isinstance(exc, mpcomm.TransferTimeout), exc
    assert time.monotonic() - t0 < 5
