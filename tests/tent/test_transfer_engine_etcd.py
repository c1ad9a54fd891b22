"""mpcomm.tent.TransferEngine with an etcd metadata server (a real etcd on loopback), as Mooncake's
``initialize(local_hostname, "host:2379", ...)``: peers are named by their local_hostname."""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import sys
import types
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


@contextlib.contextmanager
def _named_pair(etcd):  # type: ignore[no-untyped-def]
    """Engines A and B named by host:port through etcd, each with a registered 64 KiB buffer."""
    p = types.SimpleNamespace(server=etcd.url.removeprefix("etcd://"), name_a=f"127.0.0.1:{free_port()}",
                              a=TransferEngine(), b=TransferEngine())
    try:
        assert p.a.initialize(p.name_a, p.server, "tcp", "") == 0
        assert p.b.initialize(f"127.0.0.1:{free_port()}", p.server, "tcp", "") == 0
        p.ma, p.pa, p._anchor_a = _buf(1 << 16)
        p.mb, p.pb, p._anchor_b = _buf(1 << 16)
        assert p.a.register_memory(p.pa, 1 << 16) == 0 and p.b.register_memory(p.pb, 1 << 16) == 0
        yield p
    finally:
        p.a.close()
        p.b.close()


def test_sessions_by_name_through_etcd(etcd) -> None:  # type: ignore[no-untyped-def]
    with _named_pair(etcd) as p:
        server, name_a, a, b, ma, pa, mb, pb = p.server, p.name_a, p.a, p.b, p.ma, p.pa, p.mb, p.pb
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


def test_a_forged_segment_record_is_not_followed(etcd) -> None:  # type: ignore[no-untyped-def]
    """Issue 30 item 4 for the Mooncake API: A's directory record rewritten to point at a third engine
    that serves a directory of the same name; B's writes to segment A never reach the third engine."""
    import json

    import mpcomm
    from mpcomm.metadata import DEFAULT_PREFIX
    from mpcomm.tent.provider import directory_name_for

    with _named_pair(etcd) as p, mpcomm.Engine() as third:
        name_a, a, b, ma, pa, mb, pb = p.name_a, p.a, p.b, p.ma, p.pa, p.mb, p.pb
        # The third engine impersonates A: a copy of A's directory, and a decoy region under the name
        # of each buffer it lists (what a reader that follows the forged record then writes into).
        from mpcomm.tent.provider import DIRECTORY_SIZE

        a_eng = a.get_engine()
        dir_copy = bytearray(DIRECTORY_SIZE)
        third.read(dir_copy, third.open(a_eng.address, directory_name_for(name_a)), 0, DIRECTORY_SIZE).result(10)
        third.register(dir_copy, name=directory_name_for(name_a))
        n = int.from_bytes(dir_copy[8:12], "little")  # the header: generation, payload length, crc32
        listing = json.loads(bytes(dir_copy[16:16 + n]))
        decoys = [bytearray(length) for _addr, length, _numa, _name in listing["buffers"]]
        for d, (_addr, _length, _numa, name) in zip(decoys, listing["buffers"]):
            third.register(d, name=name)
        import urllib.parse

        key = f"{DEFAULT_PREFIX}/regions/{urllib.parse.quote(directory_name_for(name_a), safe='')}/{a_eng.node_id}"
        genuine = json.loads(etcd.get_raw(key))
        etcd.put_raw(key, json.dumps(genuine | {"address": third.address}), etcd.grant())
        mb[0:6] = b"forged"
        assert b.transfer_sync_write(name_a, pb, pa, 6) == -1
        assert all(not any(d) for d in decoys) and ma[0:6] != b"forged"
