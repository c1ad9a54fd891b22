"""Revocation is "target-check": once unregister returned on the target, the old descriptor reaches nothing."""

from __future__ import annotations

import hashlib
from typing import Any

import pytest

import mpcomm


def test_unregister_revokes_writes_reads_and_batches(spawn: Any, make_engine: Any) -> None:
    target = spawn({"kv": [1 << 20, "buffer"], "other": [1 << 20, "buffer"]})
    ini = make_engine()
    old = ini.open(target.address, "kv")
    ini.write(b"a" * 4096, old, 0).result(5)  # connection up, region served
    target.cmd("fill other 9")
    before = target.cmd(f"sha other 0 {1 << 20}")
    assert target.cmd("unregister kv") == "ok"
    with pytest.raises(mpcomm.AccessError):
        ini.write(b"b" * 4096, old, 0).result(5)
    with pytest.raises(mpcomm.AccessError):
        ini.read(bytearray(4096), old, 0).result(5)
    batch = ini.write_many(b"c" * 8192, old, [0, 4096], [0, 4096], [4096, 4096])
    with pytest.raises(mpcomm.AccessError):
        batch.result(5)
    assert batch.failed == [0, 1]
    assert target.cmd(f"sha other 0 {1 << 20}") == before  # nothing landed anywhere else either
    # The connection is still good for regions that are still registered.
    other = ini.open(target.address, "other")
    ini.write(b"d" * 4096, other, 0).result(5)
    assert target.cmd("sha other 0 4096") == hashlib.sha256(b"d" * 4096).hexdigest()
