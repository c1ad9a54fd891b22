"""The native data port's header parser (``_dataport.c`` parse_req, exposed as ``parse_head``) reads a
header as server.py's ``_one`` does: the same fields, the same time budget, a refusal where it
raises ProtocolError. ``Port.run`` parses every header with it; tests/fuzz/fuzz_dataport.py
fuzzes it the same way under the sanitizers."""

from __future__ import annotations

import math
import struct
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mpcomm.errors import ProtocolError
from mpcomm.plugins.tcp import dataport, server, wire

pytestmark = pytest.mark.skipif(dataport.load() is None, reason=f"native data port: {dataport.reason}")

U64 = (1 << 64) - 1
EDGES = [0, 1, (1 << 31) - 1, 1 << 31, (1 << 32) - 1, 1 << 32, (1 << 63) - 1, 1 << 63, U64 - 1, U64]
NOW, MAX_REQUEST = 1.7e9, 600.0


def python_head(head: bytes) -> tuple[Any, ...] | None:
    """server.py's header rule (parse_head, what _one calls) on ``head``: (op, count, req_id, region_id, token, epoch, offset, length, budget,
    flags)"""
    try:
        return server.parse_head(head, NOW, MAX_REQUEST)
    except ProtocolError:
        return None


def native_head(head: bytes) -> tuple[Any, ...] | None:
    try:
        return dataport.load().parse_head(head, NOW, MAX_REQUEST)  # type: ignore[no-any-return]
    except ValueError:
        return None


_u64 = st.one_of(st.sampled_from(EDGES), st.integers(0, U64))
_deadline = st.one_of(st.sampled_from([0.0, -0.0, -1.0, 1.0, NOW, NOW + 1, 1e12, math.inf, -math.inf, math.nan,
                                       5e-324]), st.floats(allow_nan=True, allow_infinity=True))


@settings(max_examples=500, deadline=None)
@given(magic=st.sampled_from([b"MQ", b"MR", b"XX", b"QM"]), op=st.integers(0, 255), flags=st.integers(0, 255),
       count=st.one_of(st.sampled_from([0, 1, 4096, 4097, 0xFFFFFFFF]), st.integers(0, 0xFFFFFFFF)),
       ints=st.lists(_u64, min_size=6, max_size=6), deadline=_deadline)
def test_the_native_header_parser_reads_what_server_py_reads(magic: bytes, op: int, flags: int, count: int,
                                                             ints: list[int], deadline: float) -> None:
    head = wire.REQ.pack(magic, op, flags, count, *ints, deadline)
    assert native_head(head) == python_head(head)


def test_a_header_of_another_size_is_refused() -> None:
    head = wire.REQ.pack(b"MQ", wire.OP_READ, 0, 0, 1, 2, 3, 4, 5, 6, 1e12)
    assert native_head(head) == (wire.OP_READ, 0, 1, 2, 3, 4, 5, 6, MAX_REQUEST, 0)
    for bad in (head[:-1], head + b"\0", b""):
        with pytest.raises(ValueError, match="64 bytes"):
            dataport.load().parse_head(bad, NOW, MAX_REQUEST)
    nan = head[:56] + struct.pack("!d", math.nan)
    with pytest.raises(ValueError, match="not a finite positive time"):
        dataport.load().parse_head(nan, NOW, MAX_REQUEST)


@settings(max_examples=400, deadline=None)
@given(op=st.sampled_from([wire.OP_WRITE, wire.OP_READ, wire.OP_WRITEV, wire.OP_READV, wire.OP_NOTIFY, 0, 255]),
       flags=st.one_of(st.sampled_from([0, wire.FLAG_NOTE, 2, 3, 0x80, 0x81, 0xFF]), st.integers(0, 255)),
       count=st.one_of(st.sampled_from([0, 1, wire.MAX_NOTE_REGION - 1, wire.MAX_NOTE_REGION,
                                        wire.MAX_NOTE_REGION + 1, (1 << 31), 0xFFFFFFFF]),
                       st.integers(0, 0xFFFFFFFF)),
       n=st.sampled_from(EDGES))
def test_the_note_flag_is_decided_alike(op: int, flags: int, count: int, n: int) -> None:
    """A noting WRITE (wire.FLAG_NOTE): the flag only on a WRITE, no other flag bit, the region
    name (``count``) at most MAX_NOTE_REGION; the rest of the frame is the same rule."""
    head = wire.REQ.pack(b"MQ", op, flags, count, 1, 2, 3, 4, 5, n, 1e12)
    python = python_head(head)
    assert native_head(head) == python
    ok = flags == 0 or (flags == wire.FLAG_NOTE and op == wire.OP_WRITE and count <= wire.MAX_NOTE_REGION)
    assert (python is not None) == ok
    if ok:
        assert python is not None and python[-1] == flags
