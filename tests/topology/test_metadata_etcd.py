"""Cluster metadata in a real etcd (started here on loopback, killed at teardown).

Skipped, with the reason, only where the etcd server or the etcd3gw client is
not installed (scripts/test installs Debian's etcd-server when run as root).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

import mpcomm
from mpcomm import topology
from mpcomm.metadata import EtcdMetadata, NodeRecord, RegionRecord, open_metadata

from etcd_support import EtcdServer, etcd_binary

HERE = Path(__file__).resolve().parent
TTL = 2

pytestmark = [
    pytest.mark.skipif(etcd_binary() is None,
                       reason="etcd is not installed (Debian: apt-get install etcd-server; scripts/test does it as root)"),
]
etcd3gw = pytest.importorskip("etcd3gw", reason="the etcd3gw client is not installed (pip install 'mpcomm[etcd]')")


@pytest.fixture(scope="module")
def etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdServer]:
    server = EtcdServer(tmp_path_factory.mktemp("etcd"))
    server.start()
    yield server
    server.kill()


@pytest.fixture
def fresh_etcd(tmp_path: Path) -> Iterator[EtcdServer]:
    server = EtcdServer(tmp_path)
    server.start()
    yield server
    server.kill()


@pytest.fixture
def url(etcd: EtcdServer) -> str:
    return f"{etcd.url}/mpcomm-test-{uuid.uuid4().hex[:8]}"  # one key space per test


def spawn_engine(url: str, name: str, size: int = 8192) -> tuple[subprocess.Popen[str], dict]:
    proc = subprocess.Popen([sys.executable, str(HERE / "engine_proc.py"), url, name, str(size), str(TTL)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line:
        proc.kill()
        raise AssertionError(f"engine process exited with {proc.wait(10)}")
    return proc, json.loads(line)


def stop(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait(10)


def wait_for(pred, timeout: float, what: str) -> float:
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if pred():
            return time.monotonic() - start
        time.sleep(0.05)
    raise AssertionError(f"{what} did not happen within {timeout}s")


def test_region_published_by_one_process_is_found_by_another(url: str, etcd: EtcdServer) -> None:
    proc, info = spawn_engine(url, "weights/layer0", 8192)
    try:
        with mpcomm.Engine({"cluster": {"metadata": url, "lease_ttl_s": TTL}}) as reader:
            records = reader.metadata.lookup("weights/layer0")
            assert [(r.address, r.node_id, r.size, r.access) for r in records] == \
                [(info["address"], info["node_id"], 8192, "rw")]
            remote = reader.open("weights/layer0")  # by name: metadata, then the owner's handshake
            assert remote.address == info["address"] and remote.token == info["token"]
            buf = bytearray(8192)
            reader.read(buf, remote).result(10)
            assert buf == bytes(i % 251 for i in range(8192))
            nodes = {n.node_id for n in reader.metadata.list_nodes()}
            assert {info["node_id"], reader.node_id} <= nodes
    finally:
        stop(proc)


def test_etcd_holds_no_secret(url: str, etcd: EtcdServer) -> None:
    proc, info = spawn_engine(url, "kv", 4096)
    try:
        prefix = "/" + url.rsplit("/", 1)[1] + "/"
        values = etcd.raw_values(prefix)
        assert values, "nothing was published"
        for v in values:
            assert str(info["token"]) not in v
            d = json.loads(v)
            assert not {"token", "region_id", "base_address"} & set(d), d
            assert all(isinstance(t, str) for t in d.get("transports", []))  # node records: names only, no keys
        region = next(json.loads(v) for v in values if json.loads(v).get("name") == "kv")
        assert set(region) == {"name", "node_id", "address", "epoch", "size", "access", "kind", "published_at",
                               "numa_node", "device"}  # device: the CUDA ordinal, -1 for host memory (issue 31)
        assert (region["kind"], region["device"]) == ("host", -1)
        assert region["numa_node"] in {n.id for n in topology.discover().numa_nodes} | {-1}
    finally:
        stop(proc)


def test_killed_engine_regions_vanish_after_its_lease(url: str, etcd: EtcdServer) -> None:
    proc, info = spawn_engine(url, "ephemeral", 4096)
    store = open_metadata(url)
    try:
        assert [r.node_id for r in store.lookup("ephemeral")] == [info["node_id"]]
        proc.kill()  # SIGKILL: no chance to withdraw anything
        proc.wait(10)
        assert store.lookup("ephemeral"), "gone before the lease ran out: not the lease that removed it"
        took = wait_for(lambda: not store.lookup("ephemeral"), TTL + 5, "the killed engine's region vanishing")
        assert took <= TTL + 5
        assert info["node_id"] not in {n.node_id for n in store.list_nodes()}
    finally:
        stop(proc)
        store.close()


def test_clean_close_withdraws_at_once(url: str) -> None:
    store = open_metadata(url)
    try:
        with mpcomm.Engine({"cluster": {"metadata": url, "lease_ttl_s": 30}}) as e:
            region = e.register(bytearray(4096), "short-lived")
            assert [r.name for r in store.list_regions()] == ["short-lived"]
            e.unregister(region)
            assert store.list_regions() == []
            e.register(bytearray(4096), "until-close")
            assert store.lookup("until-close")
        assert store.lookup("until-close") == []  # revoked with the lease, not after 30 s
    finally:
        store.close()


def _live_store(url: str) -> EtcdMetadata:
    store = open_metadata(url, ttl=TTL)
    assert isinstance(store, EtcdMetadata)
    store.start(NodeRecord("node-live", "127.0.0.1:40001", "epoch-1", "h", ("tcp",)))
    store.publish_region(RegionRecord("live-kv", "node-live", "127.0.0.1:40001", "epoch-1", 1 << 20, "rw"))
    return store


@pytest.mark.parametrize("wipe", [False, True], ids=["same-data-dir", "wiped-data-dir"])
def test_restarted_etcd_keeps_live_registrations(fresh_etcd: EtcdServer, wipe: bool) -> None:
    url = fresh_etcd.url
    live = _live_store(url)
    reader = open_metadata(url)
    try:
        assert [r.name for r in reader.lookup("live-kv")] == ["live-kv"]
        fresh_etcd.kill()
        time.sleep(TTL / 2)  # keep-alives fail meanwhile
        fresh_etcd.restart(wipe=wipe)  # wiped: etcd lost every lease and key
        wait_for(lambda: [r.node_id for r in reader.lookup("live-kv")] == ["node-live"], 4 * TTL + 10,
                 "the live node's region reappearing")
        wait_for(lambda: [n.node_id for n in reader.list_nodes()] == ["node-live"], 4 * TTL + 10,
                 "the live node's record reappearing")
        # ... and it stays: the lease is being kept alive, not a one-off write
        time.sleep(TTL + 1)
        assert [r.name for r in reader.lookup("live-kv")] == ["live-kv"]
        if wipe:
            assert live.lease_renewals >= 1
    finally:
        live.close()
        reader.close()


def test_publish_while_etcd_is_down_lands_when_it_returns(fresh_etcd: EtcdServer) -> None:
    live = _live_store(fresh_etcd.url)
    reader = open_metadata(fresh_etcd.url)
    try:
        fresh_etcd.kill()
        live.publish_region(RegionRecord("late", "node-live", "127.0.0.1:40001", "epoch-1", 4096, "r"))  # no raise
        live.unpublish_region("live-kv")
        fresh_etcd.start()
        wait_for(lambda: [r.name for r in reader.list_regions()] == ["late"], 4 * TTL + 10,
                 "the queued publish and unpublish reaching etcd")
    finally:
        live.close()
        reader.close()


def test_garbage_in_etcd_is_skipped(url: str, etcd: EtcdServer) -> None:
    prefix = "/" + url.rsplit("/", 1)[1]
    etcd.put_raw(f"{prefix}/regions/bad/n1", "not json")
    etcd.put_raw(f"{prefix}/regions/bad/n2", json.dumps({"name": "bad", "size": -1}))
    etcd.put_raw(f"{prefix}/regions/bad/n3", json.dumps({"name": "bad", "node_id": "n3", "address": "nowhere",
                                                          "epoch": "e", "size": 1, "access": "rw"}))
    etcd.put_raw(f"{prefix}/regions/bad/n4", "x" * 20000)
    store = open_metadata(url)
    try:
        assert store.lookup("bad") == []
        assert store.list_regions() == []
    finally:
        store.close()


def test_ambiguous_name_and_missing_name(url: str) -> None:
    with mpcomm.Engine({"cluster": {"metadata": url}}) as a, mpcomm.Engine({"cluster": {"metadata": url}}) as b:
        a.register(bytearray(4096), "dup")
        b.register(bytearray(4096), "dup")
        with pytest.raises(mpcomm.UnknownRegionError, match="published by 2 nodes"):
            a.open("dup")
        with pytest.raises(mpcomm.UnknownRegionError, match="no region named 'nope' is published"):
            a.open("nope")
        # with the owner's address the name is unambiguous, as before
        assert a.open(b.address, "dup").node_id == b.node_id


def test_unreachable_etcd_at_start_is_a_clear_error() -> None:
    from etcd_support import free_port

    with pytest.raises(mpcomm.MpcommError, match="cannot publish node"):
        mpcomm.Engine({"cluster": {"metadata": f"etcd://127.0.0.1:{free_port()}"}})


def test_peer_to_peer_open_by_name_says_what_to_do() -> None:
    with mpcomm.Engine() as e:
        with pytest.raises(mpcomm.UnknownRegionError, match="needs cluster metadata"):
            e.open("kv")
