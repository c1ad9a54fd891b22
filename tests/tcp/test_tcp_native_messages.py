"""Refusals of the native data port name the region as server.py's do, whatever its name.

Issue 28 (found by the differential table fuzz target's long names): ``_dataport.c`` cut the
quoted region name at 1024 bytes and its messages at 1023. A long name lost its end, and a
cut inside a UTF-8 character made the refusal's JSON invalid UTF-8: ``Port.check`` raised
UnicodeDecodeError and the initiator took the refusal (wrong token, rights, bounds) for a
malformed reply (ProtocolError). Names whose repr fits 4096 bytes now read in full.
"""

from __future__ import annotations

import json
import socket
import struct
import time
from typing import Any

import pytest
from tcp_support import reply, req

import mpcomm
from mpcomm.auth import client_authenticate
from mpcomm.engine.regions import RegionTable
from mpcomm.errors import MpcommError
from mpcomm.memory import Region
from mpcomm.plugins.tcp import dataport, wire

pytestmark = pytest.mark.skipif(dataport.load() is None, reason=f"native data port: {dataport.reason}")

NAMES = ["é" * 600, "€" * 1000, "x" * 2000, 'quote " back \\ newline \n tab \t' * 40, "kv"]
EPOCH = 0x1234


def _port() -> Any:
    return dataport.load().Port(epoch=EPOCH, epoch_ok=True, idle_ms=1000.0, max_request_ms=1000.0, grace_ms=0.0,
                                handshake_ms=1000.0, max_batch=16, chunk=1 << 16, busy_ns=0)


@pytest.mark.parametrize("name", NAMES, ids=["e-acute-600", "euro-1000", "ascii-2000", "escapes", "short"])
def test_the_native_table_names_a_long_region_as_regions_serve_does(name: str) -> None:
    port, table = _port(), RegionTable(f"{EPOCH:016x}")
    region = Region(memoryview(bytearray(64)), name=name, access="r")
    port.publish(region.id, region.token, region.access, region.view, repr(region.name))
    table.add(region)
    for token, off, n, access in [(region.token ^ 1, 0, 8, "r"), (region.token, 0, 8, "w"),
                                  (region.token, 60, 8, "r"), (region.token, (1 << 64) - 1, 1, "r")]:
        try:
            table.serve(region.id, token, f"{EPOCH:016x}", off, n, access)
        except MpcommError as exc:
            python = (exc.code, str(exc))
        assert port.check(region.id, token, EPOCH, off, n, access) == python


def _refusal_bytes(engine: mpcomm.Engine, frame: bytes) -> tuple[int, int, bytes]:
    """(status, count, body) of the target's answer to ``frame``, the body as it came on the wire."""
    info = engine.info()
    s = socket.create_connection(("127.0.0.1", int(info.transports["tcp"]["port"])), timeout=10)
    try:
        node, epoch = wire.ident("raw"), wire.ident(info.epoch)
        s.sendall(wire.HELLO.pack(wire.HELLO_MAGIC, wire.VERSION, 0, node, epoch))
        client_authenticate(s, "", time.monotonic() + 10, wire.context(node, epoch))
        s.sendall(frame)
        status, _rid, count, body = reply(s)
        return status, count, body
    finally:
        s.close()


def _refusal(engine: mpcomm.Engine, frame: bytes) -> tuple[int, dict[str, Any]]:
    status, _count, body = _refusal_bytes(engine, frame)
    return status, json.loads(body)  # valid UTF-8 JSON, or this raises


def test_a_refusal_naming_a_long_non_ascii_region_reaches_the_peer_intact() -> None:
    """Both servers refuse a wrong token for a region named 'é' * 600 with the same JSON."""
    got = []
    for native in (True, False):
        e = mpcomm.Engine({"plugins": {"tcp": {"native_server": native}}}, transports=["tcp"])
        try:
            assert (e.transports["tcp"].dataport is not None) == native
            region = e.register(bytearray(4096), name="é" * 600)
            frame = req(wire.OP_READ, region_id=region.id, token=region.token ^ 1, epoch=int(e.info().epoch, 16),
                        offset=0, length=8)
            got.append(_refusal(e, frame))
        finally:
            e.close()
    native_answer, python_answer = got
    assert native_answer[0] == wire.ST_ERR and native_answer[1]["code"] == "permission_denied"
    assert native_answer == python_answer
    assert native_answer[1]["message"] == f"wrong token for region {'é' * 600!r}"


# Non-ASCII in every UTF-8 length (2, 3, 4 bytes: a surrogate pair in JSON) and at the edges of each,
# controls and DEL (repr escapes those), a non-printable format character beside printable astral
# ones, quotes and backslashes.
ODD_NAMES = ["é日本😀", "\xff\u0100\u07ff\u0800\ufffd\U00010000", "\x01\x1f\x7f\n\t\r\b\f",
             "a\u200bb\U0001d11e\U0002a6d6", "q\"u'o\\te"]


@pytest.mark.parametrize("name", ODD_NAMES, ids=["utf8-lengths", "utf8-edges", "controls", "format-and-astral",
                                                 "quotes"])
def test_refusals_naming_an_odd_region_are_the_bytes_server_py_sends(name: str) -> None:
    """The native port escaped only quotes, backslashes and controls and sent the rest of a name as raw
    UTF-8, where server.py's json.dumps escapes it (ensure_ascii): the same once parsed, other bytes.
    Now every refusal body (wrong token, rights, bounds, a batch's partial answer) is byte for byte."""
    answers: list[list[tuple[int, int, bytes]]] = []
    for native in (True, False):
        e = mpcomm.Engine({"plugins": {"tcp": {"native_server": native}}}, transports=["tcp"])
        try:
            assert (e.transports["tcp"].dataport is not None) == native
            region = e.register(bytes(4096), name=name)  # read-only
            epoch = int(e.info().epoch, 16)
            head = {"region_id": region.id, "token": region.token, "epoch": epoch}
            frames = [req(wire.OP_READ, **{**head, "token": region.token ^ 1}, offset=0, length=8),
                      req(wire.OP_WRITE, **head, offset=0, length=8) + b"w" * 8,
                      req(wire.OP_READ, **head, offset=4090, length=8),
                      req(wire.OP_READV, **head, count=2, length=16) + struct.pack("<2Q", 0, 4092)
                      + struct.pack("<2Q", 8, 8)]
            answers.append([_refusal_bytes(e, f) for f in frames])
        finally:
            e.close()
    native_answers, python_answers = answers
    assert [a[0] for a in native_answers] == [wire.ST_ERR] * 3 + [wire.ST_PARTIAL]
    for status, _count, body in native_answers[:3]:
        assert body.isascii(), body
    assert native_answers == python_answers
    assert json.loads(native_answers[0][2])["message"] == f"wrong token for region {name!r}"
