"""Writes the seed corpora of fuzz_dataport.py: ``python tests/fuzz/seeds.py`` (files under corpus/).

The corpora are checked in; this script says what each seed is and rewrites them if the wire or
the table target's input format changes. Frames use the selectors of fuzz_dataport.py: region_id
0/1/2 is the engine's ``rw``/``ro``/``wo`` region, token 0 its token, epoch 0 the engine's epoch.
Deadlines are absolute wall-clock times as on the wire: 1e12 (far future: the server caps it at
``max_request_ms``) for requests that should be served, 1.0 for one that arrived too late.
"""

from __future__ import annotations

import math
import struct
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
REQ = struct.Struct("!2sBBIQQQQQQd")  # wire.REQ (this script runs without mpcomm installed)
OP_WRITE, OP_READ, OP_WRITEV, OP_READV = 1, 2, 3, 4
U64 = (1 << 64) - 1
I63 = (1 << 63) - 1
EDGES = [0, 1, (1 << 31) - 1, 1 << 31, (1 << 32) - 1, 1 << 32, I63, 1 << 63, U64 - 1, U64]
FAR, RW, RO, WO = 1e12, 0, 1, 2


NOTE_LEN = struct.Struct("!Q")  # wire.NOTE_LEN
FLAG_NOTE, MAX_NOTIFY = 1, 64 << 10
U32 = (1 << 32) - 1


def req(op: int, rid: int = RW, off: int = 0, n: int = 0, *, count: int = 0, token: int = 0, epoch: int = 0,
        deadline: float = FAR, req_id: int = 1, magic: bytes = b"MQ", flags: int = 0) -> bytes:
    return REQ.pack(magic, op, flags, count, req_id, rid, token, epoch, off, n, deadline)


def noting(rid: int = RW, off: int = 0, data: bytes = b"", note: bytes = b"note", name: bytes = b"rw", *,
           count: int | None = None, note_len: int | None = None, deadline: float = FAR, req_id: int = 1,
           flags: int = FLAG_NOTE, op: int = OP_WRITE) -> bytes:
    """A WRITE carrying its note (wire.py FLAG_NOTE): header, NOTE_LEN, name, note, data."""
    return (req(op, rid, off, len(data), count=len(name) if count is None else count, deadline=deadline,
                req_id=req_id, flags=flags)
            + NOTE_LEN.pack(len(note) if note_len is None else note_len) + name + note + data)


def batch(op: int, offs: list[int], lens: list[int], *, rid: int = RW, total: int | None = None,
          payload: bool = True) -> bytes:
    tot = sum(lens) & U64 if total is None else total
    out = req(op, rid, 0, tot, count=len(offs)) + struct.pack(f"<{len(offs)}Q", *offs) + struct.pack(
        f"<{len(lens)}Q", *lens)
    if op == OP_WRITEV and payload:
        out += bytes(range(256)) * (tot // 256) + bytes(range(tot % 256))
    return out


def frames() -> dict[str, bytes]:
    s: dict[str, bytes] = {
        "read": req(OP_READ, RW, 0, 8),
        "read_whole": req(OP_READ, RW, 0, 256),
        "read_ro": req(OP_READ, RO, 8, 16),
        "write": req(OP_WRITE, RW, 16, 8) + b"abcdefgh",
        "write_tail": req(OP_WRITE, RW, 255, 1) + b"z",
        "write_wo": req(OP_WRITE, WO, 0, 64) + b"w" * 64,
        "write_ro_denied": req(OP_WRITE, RO, 0, 8) + b"x" * 8,
        "read_wo_denied": req(OP_READ, WO, 0, 8),
        "readv": batch(OP_READV, [0, 100, 248], [8, 16, 8]),
        "readv_empty_piece": batch(OP_READV, [0, 256], [8, 0]),
        "writev": batch(OP_WRITEV, [0, 64, 200], [4, 8, 56]),
        "readv_partial": batch(OP_READV, [I63, 64], [8, 8]),
        "writev_partial": batch(OP_WRITEV, [250, 0], [8, 8]),
        "readv_all_refused": batch(OP_READV, [300, 257], [1, 0]),
        "unknown_region": req(OP_READ, 7, 0, 8),
        "unknown_region_u64": req(OP_READ, U64, 0, 8),
        "wrong_token": req(OP_READ, RW, 0, 8, token=1),
        "stale_epoch": req(OP_READ, RW, 0, 8, epoch=1),
        "late": req(OP_READ, RW, 0, 8, deadline=1.0),
        "late_write": req(OP_WRITE, RW, 0, 8, deadline=1.0) + b"l" * 8,
        "deadline_nan": req(OP_READ, deadline=math.nan),
        "deadline_inf": req(OP_READ, deadline=math.inf),
        "deadline_negative": req(OP_READ, deadline=-1.0),
        "deadline_zero": req(OP_READ, deadline=0.0),
        "bad_magic": req(OP_READ, magic=b"XX"),
        "unknown_op": req(99),
        "batch_count_0": req(OP_READV, count=0),
        "batch_count_4097": req(OP_READV, count=4097),
        "batch_count_u32": req(OP_READV, count=0xFFFFFFFF),
        "batch_negative_offset": batch(OP_READV, [U64], [8]),
        "batch_negative_length": batch(OP_READV, [0], [U64], total=U64),
        "batch_sum_wraps": batch(OP_READV, [0] * 4, [1 << 62] * 4),
        "batch_sum_disagrees": batch(OP_READV, [0], [8], total=16),
        "batch_descriptors_cut": req(OP_READV, count=4, n=32) + b"\x00" * 40,
        "header_cut": req(OP_READ)[:30],
        "write_payload_cut": req(OP_WRITE, RW, 0, 64) + b"p" * 10,
        "write_huge_announced": req(OP_WRITE, RW, 0, U64) + b"h" * 100,
        "pipelined": (req(OP_WRITE, RW, 0, 4, req_id=1) + b"pipe" + req(OP_READ, RW, 0, 4, req_id=2)
                      + batch(OP_READV, [0, 2], [2, 2]) + req(OP_READ, RO, 0, 4, req_id=4)
                      + req(OP_READ, RW, 0, 8, token=5, req_id=5) + req(OP_READ, RW, 255, 2, req_id=6)),
        "pipelined_then_garbage": req(OP_READ, RW, 0, 4) + req(OP_READ, RW, 4, 4, req_id=2) + b"MQ\x07garbage",
    }
    s.update({
        "note_write": noting(RW, 16, b"abcdefgh", b"hello"),
        "note_write_empty": noting(RW, 0, b"e", b"", b""),
        "note_write_no_data": noting(RW, 0, b"", b"only-a-note"),
        "note_write_wo": noting(WO, 0, b"w" * 64, b"to-wo", b"wo"),
        "note_write_ro_denied": noting(RO, 0, b"x" * 8, b"never"),
        "note_write_out_of_bounds": noting(RW, 250, b"y" * 8, b"never"),
        "note_write_unknown_region": noting(7, 0, b"u" * 8, b"never"),
        "note_write_late": noting(RW, 0, b"l" * 8, b"late", deadline=1.0),
        "note_write_name_1024": noting(RW, 0, b"n", b"x", b"r" * 1024),
        "note_write_name_1025": noting(RW, 0, b"n", b"x", b"r" * 1025),
        "note_write_name_u32": noting(RW, 0, b"n" * 64, b"x", count=U32),
        "note_write_len_max": noting(RW, 0, b"m", b"M" * MAX_NOTIFY),
        "note_write_len_max_plus_1": noting(RW, 0, b"m" * 64, b"M" * 64, note_len=MAX_NOTIFY + 1),
        "note_write_len_u32": noting(RW, 0, b"m" * 64, b"M" * 64, note_len=U32),
        "note_write_len_u64": noting(RW, 0, b"m" * 64, b"M" * 64, note_len=U64),
        "note_write_cut_in_note": noting(RW, 0, b"c" * 8, b"cut", note_len=100)[: REQ.size + 8 + 2 + 3],
        "note_flag_on_read": noting(RW, 0, b"", b"x", op=OP_READ),
        "note_flag_on_writev": req(OP_WRITEV, count=1, n=8, flags=FLAG_NOTE) + bytes(16),
        "unknown_flag": req(OP_READ, RW, 0, 8, flags=2),
        "unknown_flag_high": noting(RW, 0, b"h", b"x", flags=FLAG_NOTE | 0x80),
        "note_pipelined": (noting(RW, 0, b"1111", b"first", req_id=1) + req(OP_READ, RW, 0, 4, req_id=2)
                           + noting(RW, 4, b"2222", b"second", b"", req_id=3)
                           + noting(RO, 0, b"3333", b"refused", req_id=4) + req(OP_READ, RW, 0, 8, req_id=5)),
    })
    # More pieces than one sendmsg takes (IOV_MAX 1024): the native reply goes out in several calls.
    s["readv_past_iov_max"] = batch(OP_READV, [i % 256 for i in range(1100)], [i % 2 for i in range(1100)])
    s["writev_past_iov_max"] = batch(OP_WRITEV, [i % 64 for i in range(1030)], [1] * 1030)
    for i, v in enumerate(EDGES):
        s[f"read_offset_edge_{i}"] = req(OP_READ, RW, v, 8)
        s[f"read_length_edge_{i}"] = req(OP_READ, RW, 0, v)
        s[f"read_both_edge_{i}"] = req(OP_READ, RW, v, v)
        s[f"write_offset_edge_{i}"] = req(OP_WRITE, RW, v, 8) + b"e" * 8
        s[f"readv_edge_{i}"] = batch(OP_READV, [v, 0], [8, 8])
    for off, n in [(256, 0), (257, 0), (255, 1), (255, 2), (0, 257), (1, 256)]:
        s[f"read_size_edge_{off}_{n}"] = req(OP_READ, RW, off, n)
    return s


U8, Q = struct.Struct("<B"), struct.Struct("<Q")


def publish(rid: int, token: int, size_i: int = 2, acc_i: int = 0, ro: int = 0) -> bytes:
    return U8.pack(0) + Q.pack(rid) + Q.pack(token) + bytes([size_i, acc_i, ro])


def burst(base: int, stride_i: int, k: int) -> bytes:
    return U8.pack(1) + Q.pack(base) + bytes([stride_i, k])


def revoke(rid: int, flags: int = 1) -> bytes:
    return U8.pack(2) + Q.pack(rid) + bytes([flags])


def check(rid: int = 0, token: int = 0, epoch: int = 0, off: int = 0, n: int = 0, write: int = 0,
          flags: int = 1 | 2 | 4) -> bytes:
    return U8.pack(3) + b"".join(Q.pack(v) for v in (rid, token, epoch, off, n)) + bytes([write, flags])


def table() -> dict[str, bytes]:
    epoch = Q.pack(0x132EA5ABF590DB60)
    s = {
        "publish_check_revoke": epoch + publish(5, 77) + check(off=0, n=64) + check(off=1, n=64)
        + revoke(0) + check(flags=2 | 4),
        "readonly_write_denied": epoch + publish(9, 1, 2, 0, 1) + check(write=1) + check(write=0),
        "write_only": epoch + publish(9, 1, 2, 2) + check(write=1) + check(write=0),
        "wrong_token_stale_epoch": epoch + publish(3, 3) + check(flags=1 | 4) + check(flags=1 | 2),
        "duplicate_publish": epoch + publish(11, 1) + publish(11, 2) + check(),
        "revoke_unknown": epoch + revoke(12345, 0) + publish(1, 1) + revoke(2, 0),
        "size_edges": epoch + publish(1, 1, 4) + b"".join(check(off=o, n=m, flags=1 | 2 | 4 | f)
                                                          for o in range(3) for m in range(3)
                                                          for f in (8, 16, 24)),
        "burst_rehash": epoch + burst(0, 0, 79) + burst(1 << 40, 2, 79) + check(rid=70) + revoke(3) + check(rid=3),
        "long_names": epoch + b"".join(publish(20 + k, k, 2, 1, k << 1) + check(rid=20 + k, flags=1 | 4)
                                        + check(rid=20 + k, off=60, n=8) + check(rid=20 + k, write=1)
                                        for k in range(6)),
        "burst_top_bit": epoch + burst(I63, 3, 4) + check(rid=1) + check(rid=2),
    }
    for i, v in enumerate(EDGES):
        s[f"id_edge_{i}"] = epoch + publish(v, v) + check() + check(rid=v, flags=2 | 4) + revoke(v, 0)
        s[f"offset_edge_{i}"] = epoch + publish(1, 1) + check(off=v, n=8) + check(off=v, n=0)
        s[f"length_edge_{i}"] = epoch + publish(1, 1) + check(off=0, n=v) + check(off=1, n=v)
        s[f"both_edge_{i}"] = epoch + publish(1, 1, 3) + check(off=v, n=v) + check(off=v, n=U64 - v)
        s[f"epoch_edge_{i}"] = Q.pack(v) + publish(1, 1) + check() + check(epoch=v, flags=1 | 2)
    return s


def main() -> None:
    for target, seeds in (("dataport_frames", frames()), ("region_table", table())):
        d = HERE / "corpus" / target
        d.mkdir(parents=True, exist_ok=True)
        for old in d.iterdir():
            old.unlink()
        for name, data in seeds.items():
            (d / name).write_bytes(data)
        print(f"{d}: {len(seeds)} seeds", file=sys.stderr)


if __name__ == "__main__":
    main()
