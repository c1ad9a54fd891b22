"""mpcomm.tent.TransferEngine's calls beyond the shared workload (two engines in one process, loopback)."""

from __future__ import annotations

import ctypes
import mmap

import pytest

from mpcomm.tent import TransferEngine, TransferNotify, TransferOpcode


@pytest.fixture
def engines():  # type: ignore[no-untyped-def]
    a, b = TransferEngine(), TransferEngine()
    assert a.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    assert b.initialize("127.0.0.1", "P2PHANDSHAKE", "", "") == 0
    yield a, b
    a.close()
    b.close()


def _buf(n: int) -> tuple[mmap.mmap, int, ctypes.c_char]:
    mm = mmap.mmap(-1, n)
    anchor = ctypes.c_char.from_buffer(mm)
    return mm, ctypes.addressof(anchor), anchor


def test_managed_buffers_and_bytes(engines) -> None:  # type: ignore[no-untyped-def]
    a, b = engines
    addr = a.allocate_managed_buffer(5000)
    assert addr and a.write_bytes_to_buffer(addr, b"hello", 5) == 0
    assert a.read_bytes_from_buffer(addr, 5) == b"hello"
    other = a.allocate_managed_buffer(5000)
    assert other and other != addr
    big = a.allocate_managed_buffer(300 << 20)  # above the largest class: a buffer of its own
    assert big
    session = f"127.0.0.1:{a.get_rpc_port()}"
    dst = b.allocate_managed_buffer(4096)
    assert b.transfer_sync_read(session, dst, addr, 5) == 0
    assert b.read_bytes_from_buffer(dst, 5) == b"hello"
    assert a.free_managed_buffer(addr, 5000) == 0 and a.free_managed_buffer(big, 300 << 20) == 0
    assert a.allocate_managed_buffer(5000) == addr  # reused from its class
    mm, raw, _anchor = _buf(4096)
    assert a.write_bytes_to_buffer(raw, b"x", 1) == -3  # not registered: refused, not memcpy'd
    assert a.read_bytes_from_buffer(raw, 1) == b""  # not registered: refused (logged), no exception
    assert a.allocate_managed_buffer(0) == 0


def test_notify_and_probe(engines) -> None:  # type: ignore[no-untyped-def]
    a, b = engines
    mm, addr, _x = _buf(1 << 16)
    mm2, addr2, _y = _buf(1 << 16)
    assert a.register_memory(addr, 1 << 16) == 0 and b.register_memory(addr2, 1 << 16) == 0
    assert a.register_memory(addr + 4096, 10) == -7  # overlapped, Mooncake's ERR_ADDRESS_OVERLAPPED
    session = f"127.0.0.1:{a.get_rpc_port()}"
    mm2[0:3] = b"abc"
    assert b.transfer_sync(session, addr2, addr + 100, 3, TransferOpcode.Write, TransferNotify("n1", "m1")) == 0
    assert mm[100:103] == b"abc"
    notes = a.get_notifies()
    assert [(n.name, n.msg) for n in notes] == [("n1", "m1")]
    assert a.get_notifies() == []
    assert b.send_probe(session) == 0 and b.send_probe("127.0.0.1:1") == -1
    assert b.get_first_buffer_address(session) == addr
    assert b.transfer_check_status(424242) == -1  # unknown batch id: an error, not a crash
    assert b.get_batch_transfer_status([424242]) == -1
    bid = b.batch_transfer_async(session, [addr2, addr2 + 8], [addr, addr + 8], [8, 8], TransferOpcode.Read)
    assert bid and b.get_batch_transfer_status([bid]) == 0
    assert a.unregister_memory(addr) == 0 and a.unregister_memory(addr) == -3
    assert b.batch_register_memory([addr2 + 100], [1]) == -7
    assert a.initialize_ext("127.0.0.1", "etcd://127.0.0.1:2379", "tcp", "", "etcd") == -1
