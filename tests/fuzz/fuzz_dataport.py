"""Coverage-guided fuzzing (atheris) of the tcp data port's native code, with the Python rule as the oracle.

``python fuzz_dataport.py TARGET [libFuzzer args]``; run bounded (``-max_total_time=N``) by
tests/core/test_native_sanitized.py under the ``-fsanitize=address,undefined`` build of the helpers.
The seed corpora are in ``corpus/<target>/`` beside this file (written by ``seeds.py``).

``frames``: the input is the byte stream of a data connection after HELLO and authentication.
It is sent, over a real loopback connection, to two engines in this process: one whose
connections are served by the native loop (``_dataport.c``: ``Port.run`` parses every header,
batch descriptor and payload of the stream with its own parser against its own native region
table) and one served by ``server.py``. The property: both send back the same bytes, byte for
byte, and leave the same bytes in their regions; and the native one never crashes, hangs, or
trips the sanitizers. Only three fields are rewritten per engine before sending, so that inputs
can name that engine's regions: a header whose region_id is 0, 1 or 2 names the engine's region
``rw`` (256 bytes), ``ro`` (256, read-only) or ``wo`` (64, write-only); a token of 0 is that
region's token and an epoch of 0 the engine's epoch (any other value is sent as it is; a
region_id that happens to be a real id of either engine gets its top bit set, so it is unknown
to both). Headers are found by walking the stream as the wire defines it (wire.py): a WRITE
carries ``length`` payload bytes (a noting WRITE, flag FLAG_NOTE, first NOTE_LEN, ``count``
name bytes and the note), a batch ``16 * count`` descriptor bytes and, for WRITEV,
``length`` payload bytes; past the first frame a server refuses to parse, nothing is read.
The notes a stream's noting WRITEs delivered must be the same on both sides too (sender,
region name, bytes, order); both queues are emptied after each input.
The Python server's code is instrumented, so its branches (the same decisions the C loop makes)
guide the search.

``table``: the input is decoded (format below) into a sequence of publish / revoke / check
operations on a native region table (``Port.publish``/``revoke``/``check``: the lookups and the
one overflow-safe range check the loop admits every request with) and on a Python
:class:`RegionTable` holding the same regions. Ids, tokens, epochs, offsets and lengths are
any 64-bit values (the seeds hold the edges 0, 2^31, 2^32, 2^63-1, 2^64-1) or the region's
size - 1, size, size + 1; a burst publishes up to 80 regions at once (the hash table grows and
rehashes). The property:
every check gives ``RegionTable.serve``'s outcome (None, or the same error code and message),
an admitted range satisfies ``mpcomm.engine.checks.fits``, a revoke reports what the Python
table held, a duplicate publish is refused, and ``published()`` counts the model's entries.

Every header the walk finds is also given to the C loop's header parser on its own
(``parse_head``, the function ``Port.run`` parses each header with) and must decode to the
fields and time budget server.py's ``_one`` reads, or be refused where it refuses.

Any other outcome raises AssertionError: atheris prints the input and exits non-zero.
"""

from __future__ import annotations

import os
import socket
import struct
import sys
import time
from typing import Any

import atheris

import mpcomm
from mpcomm.auth import client_authenticate
from mpcomm.engine import checks, regions
from mpcomm.engine.regions import RegionTable
from mpcomm.errors import MpcommError, ProtocolError
from mpcomm.memory import Region
from mpcomm.plugins.tcp import dataport, server, wire


def _instrument(*modules: Any) -> None:
    """Coverage feedback from these modules' functions and methods, in place (they may have been
    imported before this module, e.g. by the prelude that puts the sanitized helpers first)."""
    for mod in modules:
        for obj in vars(mod).values():
            if getattr(obj, "__module__", None) != mod.__name__:
                continue
            funcs = [obj] if callable(obj) and hasattr(obj, "__code__") else [
                f for f in vars(obj).values() if hasattr(f, "__code__")] if isinstance(obj, type) else []
            for f in funcs:
                atheris.instrument_func(f)


_instrument(server, regions, checks)  # server.py's branches are the C loop's decisions: they guide the search

U64 = (1 << 64) - 1
EDGES = [0, 1, 2, (1 << 31) - 1, 1 << 31, (1 << 32) - 1, 1 << 32, (1 << 63) - 1, 1 << 63, U64 - 1, U64]
#: Selectors 0, 1, 2 of a frame's region_id. The third's long name (with quotes and backslashes) is
#: in every refusal naming it: both servers must send it whole and escaped alike.
REGIONS = (("rw", 256, "rw"), ("ro", 256, "r"), ('wo "quoted" \\ ' * 150, 64, "w"))

# -- frames -------------------------------------------------------------------------------------


class _Side:
    """An engine on tcp whose data connections are served natively or by server.py."""

    def __init__(self, native: bool) -> None:
        self.engine = mpcomm.Engine({"plugins": {"tcp": {"native_server": native}}}, transports=["tcp"])
        if (self.engine.transports["tcp"].dataport is not None) != native:
            raise SystemExit(f"the {'native' if native else 'Python'} server is not what serves: {dataport.reason}")
        self.regions = [self.engine.register(bytearray(size) if "w" in acc else bytes(size), name=name, access=acc)
                        for name, size, acc in REGIONS]
        info = self.engine.info()
        self.epoch = info.epoch
        self.port = int(info.transports["tcp"]["port"])

    def notes(self) -> list[tuple[str, str, bytes]]:
        """Every note queued so far, in order (the queue is empty after)."""
        out = []
        while True:
            try:
                n = self.engine.wait_notification(0)
            except TimeoutError:
                return out
            out.append((n.peer, n.region, n.data))

    def exchange(self, stream: bytes) -> bytes:
        """Send ``stream`` on a fresh authenticated connection; every byte the server sends back."""
        s = socket.create_connection(("127.0.0.1", self.port), timeout=20)
        try:
            node = wire.ident("fuzz")
            s.sendall(wire.HELLO.pack(wire.HELLO_MAGIC, wire.VERSION, 0, node, wire.ident(self.epoch)))
            client_authenticate(s, "", time.monotonic() + 20, wire.context(node, wire.ident(self.epoch)))
            s.settimeout(20)
            try:
                s.sendall(stream)
                s.shutdown(socket.SHUT_WR)
            except OSError:
                pass  # the server closed on a frame it refused to parse: what it sent is still readable
            got = bytearray()
            while True:
                try:
                    chunk = s.recv(1 << 16)
                except ConnectionResetError:
                    break
                except TimeoutError:
                    raise AssertionError(f"the server neither answered nor closed in 20 s ({len(got)} bytes so far)")
                if not chunk:
                    break
                got += chunk
            return bytes(got)
        finally:
            s.close()


def headers(stream: bytes) -> list[int]:
    """Where the stream's request headers start, walking it as the wire defines (module docstring)."""
    at, pos = [], 0
    while pos + wire.REQ.size <= len(stream):
        _magic, op, flags, count, _req_id, _rid, _token, _epoch, _off, n, _dl = wire.REQ.unpack_from(stream, pos)
        at.append(pos)
        pos += wire.REQ.size
        if op == wire.OP_WRITE and flags & wire.FLAG_NOTE:
            if pos + wire.NOTE_LEN.size > len(stream):
                break
            (note_len,) = wire.NOTE_LEN.unpack_from(stream, pos)
            pos += wire.NOTE_LEN.size + count + note_len + n
        elif op == wire.OP_WRITE:
            pos += n
        elif op in (wire.OP_WRITEV, wire.OP_READV):
            pos += 16 * count + (n if op == wire.OP_WRITEV else 0)
    return at


def patch(stream: bytes, side: _Side, taken: set[int]) -> bytes:
    """``stream`` with region selectors, zero tokens and zero epochs made ``side``'s (module docstring)."""
    out = bytearray(stream)
    for pos in headers(stream):
        magic, op, flags, count, req_id, rid, token, epoch, off, n, dl = wire.REQ.unpack_from(out, pos)
        if rid < len(side.regions):
            region = side.regions[rid]
            rid, token = region.id, token or region.token
        elif rid in taken:
            rid |= 1 << 63
        epoch = epoch or int(side.epoch, 16)
        if op == wire.OP_NOTIFY:
            # Only the native port serves NOTIFY (it alone advertises "notify"), so the two servers
            # may not answer it alike: made an op neither knows. Its frames have their own
            # generated-input test (tests/tcp/test_tcp_notify_native.py).
            op = 0x7F
        wire.REQ.pack_into(out, pos, magic, op, flags, count, req_id, rid, token, epoch, off, n, dl)
    return bytes(out)


_NOW, _MAX_REQUEST = 1.7e9, 600.0


def python_head(head: bytes) -> tuple[Any, ...] | None:
    """server.py's _one on a header: its fields and time budget, or None where it raises ProtocolError."""
    try:
        return server.parse_head(head, _NOW, _MAX_REQUEST)
    except ProtocolError:
        return None


def check_headers(stream: bytes) -> None:
    """The C loop's header parser (``parse_head``, what ``Port.run`` calls) against the Python rule."""
    parse = dataport.load().parse_head
    for pos in headers(stream):
        head = stream[pos : pos + wire.REQ.size]
        try:
            native = parse(head, _NOW, _MAX_REQUEST)
        except ValueError:
            native = None
        assert native == python_head(head), f"header {head.hex()}: native {native} != python {python_head(head)}"


_sides: list[_Side] = []


def fuzz_frames(data: bytes) -> None:
    if not _sides:
        _sides.extend([_Side(True), _Side(False)])
    taken = {r.id for side in _sides for r in side.regions}
    native, python = _sides
    check_headers(data)
    got_n = native.exchange(patch(data, native, taken))
    got_p = python.exchange(patch(data, python, taken))
    assert got_n == got_p, f"the servers answered differently:\nnative {got_n[:400]!r}\npython {got_p[:400]!r}"
    for rn, rp in zip(native.regions, python.regions):
        assert bytes(rn.view) == bytes(rp.view), f"region {rn.name!r} differs after the same stream"
    notes_n, notes_p = native.notes(), python.notes()
    assert notes_n == notes_p, f"the servers queued different notes:\nnative {notes_n!r}\npython {notes_p!r}"


# -- table --------------------------------------------------------------------------------------
# The input: the table's epoch (u64), then records, each an op byte and its fields (integers
# little-endian; a record cut short ends the input):
#   0 publish  id u64, token u64, size index u8 (_SIZES), access index u8 (_ACCESS), u8: bit 0 read-only,
#              bits 1-3 the name's kind (_NAMES: long and non-ASCII names, quoted in every refusal)
#   1 burst    base id u64, stride index u8 (_STRIDES), how many u8 (1..80 as k % 80 + 1)
#   2 revoke   id u64, flags u8
#   3 check    id u64, token u64, epoch u64, offset u64, length u64, access u8 (odd: "w"), flags u8
# flags: 1 the id is that of a published region (id % their number, in publish order), 2 the
# token is that region's, 4 the epoch is the table's, 8 the offset is size - 1 + offset % 3,
# 16 the length likewise (the edges around the region's size).

_SIZES = [1, 7, 64, 4095, 4096, 4097]
#: Name stems (the publish count is appended: names are unique). Their reprs stay within the
#: 4096 bytes the native table keeps of a name (_dataport.c QNAME_MAX).
_NAMES = ["r", "é" * 1990, "€" * 1300, "x" * 4000, 'q"\\\n\t' * 500, "名前"]
_ACCESS = ["rw", "r", "w"]
_STRIDES = [1, 64, 1 << 32, 1 << 63]
_U8, _U64 = struct.Struct("<B"), struct.Struct("<Q")


class _Reader:
    def __init__(self, data: bytes) -> None:
        self.data, self.pos = data, 0

    def take(self, st: struct.Struct) -> int:
        if self.pos + st.size > len(self.data):
            raise EOFError
        (v,) = st.unpack_from(self.data, self.pos)
        self.pos += st.size
        return int(v)


class _Tables:
    """A native table and a Python RegionTable with the same regions."""

    def __init__(self, epoch: int) -> None:
        self.epoch = epoch
        self.native = dataport.load().Port(epoch=epoch, epoch_ok=True, idle_ms=1000.0, max_request_ms=1000.0,
                                           grace_ms=0.0, handshake_ms=1000.0, max_batch=16, chunk=1 << 16,
                                           busy_ns=0)
        self.python = RegionTable(f"{epoch:016x}")
        self.model: dict[int, Region] = {}
        self.made = 0

    def known(self, rid: int, flags: int) -> int:
        ids = list(self.model)
        return ids[rid % len(ids)] if flags & 1 and ids else rid

    def publish(self, rid: int, token: int, size: int, access: str, readonly: bool, stem: str = "r") -> None:
        self.made += 1
        buf = bytes(size) if readonly else bytearray(size)
        region = Region(memoryview(buf), name=f"{stem}{self.made}", access=access)
        region.id, region.token = rid, token  # the ids and tokens under test, published as the transport does
        try:
            self.native.publish(region.id, region.token, region.access, region.view, repr(region.name))
        except ValueError:
            assert rid in self.model, f"publish of a new id {rid} was refused"
            return
        assert rid not in self.model, f"a second publish of id {rid} was taken"
        self.python.add(region)
        self.model[rid] = region

    def revoke(self, rid: int) -> None:
        was = self.native.revoke(rid, 0.0)
        region = self.model.pop(rid, None)
        assert was == (region is not None), (rid, was)
        if region is not None:
            assert self.python.remove(region)

    def check(self, rid: int, token: int, epoch: int, off: int, n: int, access: str) -> None:
        native = self.native.check(rid, token, epoch, off, n, access)
        try:
            self.python.serve(rid, token, f"{epoch:016x}", off, n, access).release()
            python = None
        except MpcommError as exc:
            python = (exc.code, str(exc))
        assert native == python, f"check({rid}, {token}, {epoch}, {off}, {n}, {access!r}): {native} != {python}"
        if native is None:
            assert checks.fits(off, n, self.model[rid].size), (off, n, self.model[rid].size)


def fuzz_table(data: bytes) -> None:
    r = _Reader(data)
    try:
        t = _Tables(r.take(_U64))
    except EOFError:
        return
    try:
        while True:
            op = r.take(_U8) % 4
            if op == 0:
                rid, token, size, acc, ro = r.take(_U64), r.take(_U64), r.take(_U8), r.take(_U8), r.take(_U8)
                t.publish(rid, token, _SIZES[size % len(_SIZES)], _ACCESS[acc % len(_ACCESS)], bool(ro & 1),
                          _NAMES[(ro >> 1) % len(_NAMES)])
            elif op == 1:  # a burst: the hash table grows and rehashes under the entries already there
                base, stride, k = r.take(_U64), _STRIDES[r.take(_U8) % len(_STRIDES)], r.take(_U8) % 80 + 1
                for i in range(k):
                    t.publish((base + i * stride) & U64, i, 64, "rw", False)
            elif op == 2:
                rid, flags = r.take(_U64), r.take(_U8)
                t.revoke(t.known(rid, flags))
            else:
                rid, token, epoch, off, n = (r.take(_U64) for _ in range(5))
                access, flags = "w" if r.take(_U8) & 1 else "r", r.take(_U8)
                rid = t.known(rid, flags)
                region = t.model.get(rid)
                if region is not None:
                    token = region.token if flags & 2 else token
                    off = region.size - 1 + off % 3 if flags & 8 else off
                    n = region.size - 1 + n % 3 if flags & 16 else n
                epoch = t.epoch if flags & 4 else epoch
                t.check(rid, token, epoch, off, n, access)
            assert t.native.published() == len(t.model), (t.native.published(), len(t.model))
    except EOFError:
        pass
    for rid in list(t.model):
        t.revoke(rid)


def main() -> None:
    target = {"frames": fuzz_frames, "table": fuzz_table}[sys.argv[1]]
    if dataport.load() is None:
        raise SystemExit(f"the native data port is not built: {dataport.reason}")
    print(f"dataport: {dataport.reason}", flush=True)  # which build: the test checks it is the sanitized one
    atheris.Setup([sys.argv[0], *sys.argv[2:]], target)
    atheris.Fuzz()


if __name__ == "__main__":
    os.environ.setdefault("MPCOMM_LOG_LEVEL", "ERROR")
    main()
