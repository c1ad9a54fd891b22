"""mpcomm.tent.TransferEngine against a careless caller and a hostile peer (issue 30, items 9-12, 17).

Every Mooncake-API method answers with its error value: no crash, no exception,
and nothing lands where it should not. What could crash the interpreter runs in
a subprocess, so a crash shows as a failure instead of taking pytest down.
"""

from __future__ import annotations

import ctypes
import mmap
import subprocess
import sys
import textwrap
import time
import zlib
from pathlib import Path

import pytest

from mpcomm.tent import TransferEngine
from mpcomm.tent.codes import ProviderError
from mpcomm.tent.provider import DIRECTORY, DIRECTORY_SIZE, Provider

ROOT = Path(__file__).resolve().parents[2]


def _buf(n: int) -> tuple[mmap.mmap, int, ctypes.c_char]:
    mm = mmap.mmap(-1, n)
    anchor = ctypes.c_char.from_buffer(mm)
    return mm, ctypes.addressof(anchor), anchor


def _run(code: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)


# -- item 9 ----------------------------------------------------------------------------------


def test_second_initialize_is_refused_and_the_first_engine_keeps_serving(tcp_engines) -> None:  # type: ignore[no-untyped-def]
    a, b = tcp_engines
    port = a.get_rpc_port()
    assert a.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == -1
    assert a.initialize_ext("127.0.0.1", "127.0.0.1:1", "tcp", "", "etcd") == -1
    assert a.get_rpc_port() == port
    ma, pa, _x = _buf(1 << 16)
    mb, pb, _y = _buf(1 << 16)
    assert a.register_memory(pa, 1 << 16) == 0 and b.register_memory(pb, 1 << 16) == 0
    mb[0:6] = b"served"
    assert b.transfer_sync_write(f"127.0.0.1:{port}", pb, pa + 64, 6) == 0
    assert ma[64:70] == b"served"
    assert a.read_bytes_from_buffer(pa + 64, 6) == b"served"


# -- item 10 ---------------------------------------------------------------------------------


def test_bad_lengths_and_addresses_are_error_values_not_crashes() -> None:
    """Run in a child: before the fix ``read_bytes_from_buffer(addr, -1)`` killed it with SIGSEGV."""
    proc = _run("""
        import ctypes, mmap
        from mpcomm.tent import TransferEngine
        te = TransferEngine()
        assert te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
        addr = te.allocate_managed_buffer(8192)
        assert addr
        assert te.write_bytes_to_buffer(addr, b"abcdef", 6) == 0
        mm = mmap.mmap(-1, 4096); anchor = ctypes.c_char.from_buffer(mm); raw = ctypes.addressof(anchor)
        out = {
            "read -1": te.read_bytes_from_buffer(addr, -1),
            "read -2": te.read_bytes_from_buffer(addr, -2),
            "read past the arena": te.read_bytes_from_buffer(addr, 1 << 40),
            "read 2**64": te.read_bytes_from_buffer(addr, 1 << 64),
            "read at 0": te.read_bytes_from_buffer(0, 8),
            "read unregistered": te.read_bytes_from_buffer(raw, 8),
            "read float": te.read_bytes_from_buffer(addr, 1.5),
            "read str addr": te.read_bytes_from_buffer(str(addr), 4),
            "read 0": te.read_bytes_from_buffer(addr, 0),
            "write -1": te.write_bytes_to_buffer(addr, b"xy", -1),
            "write past the data": te.write_bytes_to_buffer(addr, b"xy", 3),
            "write unregistered": te.write_bytes_to_buffer(raw, b"xy", 2),
            "write at 0": te.write_bytes_to_buffer(0, b"xy", 2),
            "write 2**64 addr": te.write_bytes_to_buffer(1 << 64, b"xy", 2),
            "write None": te.write_bytes_to_buffer(addr, None, 2),
            "register -1": te.register_memory(raw, -1),
            "register at 0": te.register_memory(0, 4096),
            "register float": te.register_memory(raw, 4096.0),
            "unregister None": te.unregister_memory(None),
            "sync -1": te.transfer_sync_write("127.0.0.1:1", addr, addr, -1),
            "sync 2**64": te.transfer_sync_read("127.0.0.1:1", addr, addr, 1 << 64),
            "batch -1": te.batch_transfer_sync_write("127.0.0.1:1", [addr], [addr], [-1]),
            "async -1": te.batch_transfer_async_write("127.0.0.1:1", [addr], [addr], [-1]),
            "async mismatched": te.batch_transfer_async_read("127.0.0.1:1", [addr], [], [8]),
            "submit None": te.transfer_submit_write("127.0.0.1:1", None, addr, 8),
            "check str": te.transfer_check_status("x"),
            "batch status None": te.get_batch_transfer_status(None),
            "allocate -1": te.allocate_managed_buffer(-1),
            "allocate str": te.allocate_managed_buffer("8"),
        }
        assert te.read_bytes_from_buffer(addr, 6) == b"abcdef"  # nothing above wrote anything
        for k, v in out.items():
            print(k, "=", repr(v))
        te.close()
        print("ALIVE")
    """)
    assert proc.returncode == 0, f"rc {proc.returncode}\n{proc.stdout}\n{proc.stderr[-3000:]}"
    got = dict(line.split(" = ", 1) for line in proc.stdout.splitlines() if " = " in line)
    assert proc.stdout.strip().endswith("ALIVE")
    for k in ("read -1", "read -2", "read past the arena", "read 2**64", "read at 0", "read unregistered",
              "read float", "read str addr", "read 0"):
        assert got[k] == "b''", (k, got[k])
    assert got["write unregistered"] == got["write at 0"] == got["write 2**64 addr"] == "-3"
    for k in ("write -1", "write past the data", "write None", "register -1", "register at 0", "register float",
              "unregister None", "sync -1", "sync 2**64", "batch -1", "check str", "batch status None"):
        assert got[k] == "-1", (k, got[k])
    for k in ("async -1", "async mismatched", "submit None", "allocate -1", "allocate str"):
        assert got[k] == "0", (k, got[k])


# -- item 11 ---------------------------------------------------------------------------------


def test_free_managed_buffer_refuses_double_free_wrong_class_and_foreign() -> None:
    te = TransferEngine()
    assert te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    try:
        x = te.allocate_managed_buffer(5000)  # the 8 KiB class
        big = te.allocate_managed_buffer(300 << 20)  # above the largest class: a buffer of its own
        assert x and big
        assert te.free_managed_buffer(x, 100_000) == -1  # another size class
        assert te.free_managed_buffer(x, 8000) == 0  # the same class: fine
        assert te.free_managed_buffer(x, 8000) == -1  # a double free
        mm, foreign, _a = _buf(8192)
        assert te.free_managed_buffer(foreign, 5000) == -1  # never handed out
        assert te.free_managed_buffer(x + 8192, 5000) == -1  # inside an arena, but not handed out
        assert te.free_managed_buffer(big, 5000) == -1  # a large buffer with a small length
        assert te.free_managed_buffer(big, 300 << 20) == 0
        assert te.free_managed_buffer(big, 300 << 20) == -1
        # x went back once, so it is handed out once: two allocations are two different blocks.
        got = {te.allocate_managed_buffer(5000) for _ in range(2)}
        assert len(got) == 2 and x in got
        assert te.free_managed_buffer(None, 5000) == -1
    finally:
        te.close()


# -- item 12 ---------------------------------------------------------------------------------

HOSTILE_PEER = """
import sys, zlib
from mpcomm import Engine
DIRECTORY, SIZE = sys.argv[1], int(sys.argv[2])
depth = 3000
payload = ('{"host_id":"x","buffers":' + "[" * depth + "]" * depth + "}").encode()
buf = bytearray(SIZE)
gen = (2).to_bytes(8, "little")  # even: a complete copy
buf[0:8] = gen
buf[SIZE - 8:] = gen
buf[8:12] = len(payload).to_bytes(4, "little")
buf[12:16] = zlib.crc32(payload).to_bytes(4, "little")
buf[16:16 + len(payload)] = payload
eng = Engine(endpoint="127.0.0.1:0", transports=["tcp"])
eng.register(buf, name=DIRECTORY, access="r")
print(eng.address.rsplit(":", 1)[1], flush=True)
sys.stdin.readline()
eng.close()
"""


def test_a_peer_with_a_deeply_nested_directory_is_an_error_code() -> None:
    peer = subprocess.Popen([sys.executable, "-c", HOSTILE_PEER, DIRECTORY, str(DIRECTORY_SIZE)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT)
    te = TransferEngine()
    try:
        assert peer.stdout is not None
        port = int(peer.stdout.readline())
        assert te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
        mm, addr, _a = _buf(4096)
        assert te.register_memory(addr, 4096) == 0
        session = f"127.0.0.1:{port}"
        t0 = time.monotonic()
        assert te.transfer_sync_write(session, addr, 0x10000, 8) == -1
        assert te.batch_transfer_async_write(session, [addr], [0x10000], [8]) == 0
        assert te.batch_transfer_sync_read(session, [addr, addr + 8], [0x10000, 0x10008], [8, 8]) == -1
        assert te.get_first_buffer_address(session) == 0
        assert time.monotonic() - t0 < 30
    finally:
        te.close()
        if peer.stdin is not None:
            peer.stdin.close()
        peer.wait(30)


# -- item 17 ---------------------------------------------------------------------------------

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]


def test_register_refuses_ranges_that_are_not_mapped() -> None:
    page = mmap.PAGESIZE
    p = Provider()
    p.init("127.0.0.1:reg", bind="127.0.0.1", transports=["tcp"])
    base = _libc.mmap(None, 3 * page, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
    assert base not in (None, ctypes.c_void_p(-1).value)
    try:
        assert _libc.munmap(base + page, page) == 0  # a hole in the middle
        for addr, length in [(0x1000, 4096), (base, 1 << 62), (base, 3 * page), (base + page, page),
                             (base + page - 1, 2), ((1 << 64) - 4096, 4096), (base, -1), (0, page)]:
            with pytest.raises(ProviderError):
                p.register_memory(addr, length)
        p.register_memory(base, page)  # the mapped pages are fine
        p.register_memory(base + 2 * page + 100, page - 100)
        mm, addr, _a = _buf(4096)
        with pytest.raises(ProviderError):
            p.publish(addr, 1 << 62)
        te = TransferEngine()
        assert te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
        try:
            assert te.register_memory(0x1000, 4096) == -1
            assert te.register_memory(addr, 1 << 62) == -1
            assert te.register_memory(addr, 4096) == 0
        finally:
            te.close()
    finally:
        p.shutdown()
        _libc.munmap(base, page)
        _libc.munmap(base + 2 * page, page)
