"""mpcomm.tent.TransferEngine with an etcd metadata server (a real etcd on loopback), as Mooncake's
``initialize(local_hostname, "host:2379", ...)``: peers are named by their local_hostname."""

from __future__ import annotations

import ctypes
import mmap
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "topology"))  # the project's etcd test server
from etcd_support import EtcdServer, etcd_binary, free_port  # noqa: E402

from mpcomm.tent import TransferEngine  # noqa: E402

pytestmark = pytest.mark.skipif(etcd_binary() is None, reason="etcd is not installed (Debian: etcd-server)")


@pytest.fixture(scope="module")
def etcd(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    pytest.importorskip("etcd3gw", reason="mpcomm[etcd] is not installed")
    server = EtcdServer(tmp_path_factory.mktemp("etcd"))
    server.start()
    yield server
    server.kill()


def _buf(n: int):  # type: ignore[no-untyped-def]
    mm = mmap.mmap(-1, n)
    anchor = ctypes.c_char.from_buffer(mm)
    return mm, ctypes.addressof(anchor), anchor


def test_sessions_by_name_through_etcd(etcd) -> None:  # type: ignore[no-untyped-def]
    server = etcd.url.removeprefix("etcd://")
    name_a = f"127.0.0.1:{free_port()}"
    a, b = TransferEngine(), TransferEngine()
    try:
        assert a.initialize(name_a, server, "tcp", "") == 0
        assert b.initialize(f"127.0.0.1:{free_port()}", server, "tcp", "") == 0
        ma, pa, _x = _buf(1 << 16)
        mb, pb, _y = _buf(1 << 16)
        assert a.register_memory(pa, 1 << 16) == 0 and b.register_memory(pb, 1 << 16) == 0
        mb[0:5] = b"named"
        assert b.transfer_sync_write(name_a, pb, pa + 10, 5) == 0
        assert ma[10:15] == b"named"
        assert b.get_first_buffer_address(name_a) == pa
        assert b.send_probe(name_a) == 0 and b.send_probe("127.0.0.1:1") == -1
        assert b.transfer_sync_write("127.0.0.1:2", pb, pa, 5) == -1  # nobody publishes that segment

        # A restarts under the same name: found again through etcd once it has registered.
        a.close()
        a2 = TransferEngine()
        try:
            assert a2.initialize(name_a, server, "tcp", "") == 0
            m2, p2, _z = _buf(1 << 16)
            assert a2.register_memory(p2, 1 << 16) == 0
            mb[0:4] = b"back"
            rc = [b.transfer_sync_write(name_a, pb, p2, 4) for _ in range(3)]
            assert 0 in rc, rc
            assert m2[0:4] == b"back"
        finally:
            a2.close()
    finally:
        a.close()
        b.close()


def test_unsupported_metadata_is_minus_one() -> None:
    te = TransferEngine()
    assert te.initialize_ext("127.0.0.1", "127.0.0.1:6379", "tcp", "", "redis") == -1


def test_an_engine_left_open_closes_quietly_at_exit(etcd) -> None:  # type: ignore[no-untyped-def]
    """An etcd-metadata engine nobody closed: the interpreter's exit withdraws it with nothing on stderr.

    Closed from ``__del__`` during teardown, the metadata client failed to import what it
    needed ("sys.meta_path is None") and printed a traceback.
    """
    import subprocess

    name = f"127.0.0.1:{free_port()}"
    code = f"""
import ctypes, mmap
from mpcomm.tent import TransferEngine
te = TransferEngine()
assert te.initialize({name!r}, {etcd.url.removeprefix("etcd://")!r}, "tcp", "") == 0
mm = mmap.mmap(-1, 4096)
anchor = ctypes.c_char.from_buffer(mm)
assert te.register_memory(ctypes.addressof(anchor), 4096) == 0
print("UP")
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "UP", proc.stdout + proc.stderr
    assert proc.stderr == ""
    # Closed, not just gone: its records were withdrawn, so nobody finds the segment any more.
    b = TransferEngine()
    try:
        assert b.initialize(f"127.0.0.1:{free_port()}", etcd.url.removeprefix("etcd://"), "tcp", "") == 0
        assert b.send_probe(name) == -1
    finally:
        b.close()
