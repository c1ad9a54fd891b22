"""The data port reads a frame's header and as much of what follows as has come in one recv
(a small write's header and payload together). Whatever it read ahead is consumed in stream
order by every later read: a payload, a refused write's drain, the next frames' headers."""

from __future__ import annotations

import socket
import time
from typing import Any

import pytest
from tcp_support import error_code, raw_to, reply, req

from mpcomm.plugins.tcp import dataport, wire

BIG = bytes(range(256)) * 160  # 40 KiB: more than the port reads ahead with one header


def _frames(remote: Any) -> list[bytes]:
    return [
        req(wire.OP_WRITE, remote=remote, offset=0, length=100, req_id=1) + b"a" * 100,
        # refused (outside the 1 MiB region): its payload is drained, from what was read ahead
        req(wire.OP_WRITE, remote=remote, offset=1 << 20, length=8, req_id=2) + b"x" * 8,
        req(wire.OP_READ, remote=remote, offset=0, length=100, req_id=3),
        req(wire.OP_WRITE, remote=remote, offset=8192, length=len(BIG), req_id=4) + BIG,
        req(wire.OP_WRITE, remote=remote, offset=200, length=4096, req_id=5) + b"b" * 4096,
        req(wire.OP_READ, remote=remote, offset=200, length=4096, req_id=6),
    ]


def _check(s: socket.socket, region: Any) -> None:
    got = [reply(s) for _ in range(6)]
    assert [r[1] for r in got] == [1, 2, 3, 4, 5, 6]
    assert [r[0] for r in got] == [wire.ST_OK, wire.ST_ERR, wire.ST_OK, wire.ST_OK, wire.ST_OK, wire.ST_OK]
    assert error_code(got[1][3]) == "out_of_bounds"
    assert got[2][3] == b"a" * 100 and got[5][3] == b"b" * 4096
    assert bytes(region.view[8192:8192 + len(BIG)]) == BIG


@pytest.mark.parametrize("server", ["native", "python"])
@pytest.mark.parametrize("split", ["one-segment", "cut-anywhere"])
def test_frames_that_arrive_together_or_cut_are_served_in_stream_order(
        make_engine: Any, monkeypatch: pytest.MonkeyPatch, server: str, split: str) -> None:
    if server == "native" and dataport.load() is None:
        pytest.skip(f"native data port: {dataport.reason}")
    if server == "python":
        monkeypatch.setenv(dataport.ENV, "0")
    tgt = make_engine()
    monkeypatch.delenv(dataport.ENV, raising=False)
    assert (tgt.transports["tcp"].dataport is not None) == (server == "native")
    region = tgt.allocate(1 << 20, name="kv")
    region.view[:] = bytes(1 << 20)
    remote = make_engine().open(tgt.address, "kv", timeout=5)
    s = raw_to(tgt)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    stream = b"".join(_frames(remote))
    if split == "one-segment":
        s.sendall(stream)  # the first read takes several whole frames and the start of BIG
    else:
        # mid-header, mid-payload, a header split right after the read-ahead's end, ...
        cuts = [0, 10, 64 + 3, 64 + 100 + 30, 300, 16384 - 5, 16384 + 64, 30000, len(stream)]
        for a, b in zip(cuts, cuts[1:]):
            s.sendall(stream[a:b])
            time.sleep(0.02)  # each piece arrives on its own
    _check(s, region)
    s.close()
