"""Batch frames (WRITEV/READV) against a target in a child process, from a raw client.

The target checks every index against its own region table before touching
memory: refused indices are drained (writes) or skipped (reads), the reply
says which, and nothing lands outside the served ranges.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
from array import array
from typing import Any

import pytest
from tcp_support import closed, recv_exact, req

import mpcomm
from mpcomm.plugins.tcp import wire


def frame(op: int, remote: mpcomm.RemoteRegion, offs: list[int], lens: list[int], payload: bytes = b"",
          total: int | None = None, req_id: int = 9, token: int | None = None) -> bytes:
    o, n = array("q", offs), array("q", lens)
    if not wire.LITTLE:
        o.byteswap()
        n.byteswap()
    head = req(op, remote=remote, count=len(offs), length=sum(lens) if total is None else total, req_id=req_id)
    if token is not None:
        head = head[:24] + token.to_bytes(8, "big") + head[32:]
    return head + o.tobytes() + n.tobytes() + payload


def read_reply(s: socket.socket, count: int, lens: list[int]) -> tuple[int, bytes, dict[str, Any] | None, bytes]:
    magic, status, _f, n, rid, length = wire.RESP.unpack(recv_exact(s, wire.RESP.size))
    assert magic == wire.RESP_MAGIC and rid == 9
    body = recv_exact(s, length)
    if status == wire.ST_OK:
        assert n == count
        return status, bytes(count), None, body
    if status == wire.ST_ERR:
        return status, b"\x01" * count, json.loads(body), b""
    st = body[:count]
    (jl,) = wire.JSON_LEN.unpack(body[count : count + 4])
    return status, st, json.loads(body[count + 4 : count + 4 + jl]), body[count + 4 + jl :]


@pytest.fixture
def setup(spawn: Any, make_engine: Any) -> Any:
    target = spawn({"kv": [1 << 20, "buffer"]})
    remote = make_engine().open(target.address, "kv")
    return target, remote


def test_writev_and_readv_in_bounds(setup: Any) -> None:
    target, remote = setup
    offs, lens = [0, 8192, 100_000, 4096], [4096, 100, 0, 3]
    data = [os.urandom(n) for n in lens]
    s = target.raw()
    s.sendall(frame(wire.OP_WRITEV, remote, offs, lens, b"".join(data)))
    status, st, _err, _ = read_reply(s, 4, lens)
    assert status == wire.ST_OK
    for o, d in zip(offs, data):
        assert target.cmd(f"sha kv {o} {len(d)}") == hashlib.sha256(d).hexdigest()
    s.sendall(frame(wire.OP_READV, remote, offs, lens))
    status, st, _err, payload = read_reply(s, 4, lens)
    assert status == wire.ST_OK and payload == b"".join(data)


def test_partial_batch_refuses_only_the_bad_indices_and_writes_nothing_outside(setup: Any) -> None:
    target, remote = setup
    target.cmd("zero kv")
    size = remote.size
    offs, lens = [0, size - 2, 4096, size + 10], [16, 8, 16, 4]  # 1 and 3 reach past the end
    payload = b"\xab" * 16 + b"\xcd" * 8 + b"\xef" * 16 + b"\x99" * 4
    s = target.raw()
    s.sendall(frame(wire.OP_WRITEV, remote, offs, lens, payload))
    status, st, err, _ = read_reply(s, 4, lens)
    assert status == wire.ST_PARTIAL and list(st) == [0, 1, 0, 1]
    assert err is not None and err["code"] == "out_of_bounds"
    assert target.cmd("sha kv 0 16") == hashlib.sha256(b"\xab" * 16).hexdigest()
    assert target.cmd("sha kv 4096 16") == hashlib.sha256(b"\xef" * 16).hexdigest()
    assert target.cmd(f"sha kv {size - 2} 2") == hashlib.sha256(bytes(2)).hexdigest()  # nothing of index 1
    s.sendall(frame(wire.OP_READV, remote, offs, lens))
    status, st, err, got = read_reply(s, 4, lens)
    assert status == wire.ST_PARTIAL and list(st) == [0, 1, 0, 1]
    assert got == b"\xab" * 16 + b"\xef" * 16  # only the served indices, in order
    # The connection is still in step: a plain request on it works.
    s.sendall(req(remote=remote, length=16))
    status = wire.RESP.unpack(recv_exact(s, wire.RESP.size))[1]
    assert status == wire.ST_OK and recv_exact(s, 16) == b"\xab" * 16


def test_a_batch_with_a_wrong_token_is_refused_whole(setup: Any) -> None:
    target, remote = setup
    target.cmd("fill kv 2")
    before = target.cmd(f"sha kv 0 {remote.size}")
    s = target.raw()
    s.sendall(frame(wire.OP_WRITEV, remote, [0, 64], [32, 32], b"\x01" * 64, token=remote.token ^ 5))
    status, _st, err, _ = read_reply(s, 2, [32, 32])
    assert status == wire.ST_ERR and err is not None and err["code"] == "permission_denied"
    assert target.cmd(f"sha kv 0 {remote.size}") == before


@pytest.mark.parametrize("what", ["lengths disagree", "negative offset", "negative length"])
def test_inconsistent_descriptors_close_the_connection(setup: Any, what: str) -> None:
    target, remote = setup
    target.cmd("fill kv 4")
    before = target.cmd(f"sha kv 0 {remote.size}")
    offs, lens, total = [0, 64], [32, 32], None
    if what == "lengths disagree":
        total = 10
    elif what == "negative offset":
        offs = [-4096, 64]
    else:
        lens, total = [64, -32], 32
    s = target.raw()
    s.sendall(frame(wire.OP_WRITEV, remote, offs, lens, b"\x02" * 64, total=total))
    assert closed(s)
    assert target.cmd(f"sha kv 0 {remote.size}") == before
