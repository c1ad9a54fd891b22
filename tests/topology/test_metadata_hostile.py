"""Hostile and broken records in a real etcd (issue 30, items 4-6): whoever can write to etcd
must not be able to send an engine's reads and writes to another engine, break every look-up,
or hide a real record.

Each test writes what an attacker with etcd access would (straight through etcd's gateway),
next to real engines publishing real records, and checks what readers do with it.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

import mpcomm
from mpcomm.metadata import EtcdMetadata, MetadataError, parse_metadata_url

from etcd_support import EtcdServer, etcd_binary

pytestmark = [
    pytest.mark.skipif(etcd_binary() is None,
                       reason="etcd is not installed (Debian: apt-get install etcd-server; scripts/test does it as root)"),
]
pytest.importorskip("etcd3gw", reason="the etcd3gw client is not installed (pip install 'mpcomm[etcd]')")

SECRET = "a3f1" * 16  # 32 bytes as hex
OTHER_SECRET = "7c0e" * 16


@pytest.fixture(scope="module")
def etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdServer]:
    server = EtcdServer(tmp_path_factory.mktemp("etcd"))
    server.start()
    yield server
    server.kill()


@pytest.fixture
def url(etcd: EtcdServer) -> str:
    return f"{etcd.url}/mpcomm-test-{uuid.uuid4().hex[:8]}"  # one key space per test


def prefix_of(url: str) -> str:
    return "/" + url.rsplit("/", 1)[1]


def cluster(url: str, **extra: object) -> dict:
    return {"cluster": {"metadata": url, "lease_ttl_s": 30}, **extra}


def run_cli(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    """``mpcomm ARGS`` in its own process, with only the given MPCOMM_* settings."""
    base = {k: v for k, v in os.environ.items() if k not in ("MPCOMM_CONFIG", "MPCOMM_METADATA", "MPCOMM_SECRET")}
    return subprocess.run([sys.executable, "-m", "mpcomm.cli", *args], capture_output=True, text=True, timeout=60,
                          env=base | env)


def skip_warnings(caplog: pytest.LogCaptureFixture) -> str:
    return "\n".join(r.getMessage() for r in caplog.records if r.name == "mpcomm.metadata")


# -- item 4: a forged record must not send writes to the wrong engine ------------------------------


def test_forged_address_in_the_owners_record_is_refused(url: str, etcd: EtcdServer) -> None:
    """The owner's own key rewritten to point at a third engine: open(name) refuses, and the
    third engine's region of the same name is not touched."""
    with mpcomm.Engine(cluster(url)) as owner, mpcomm.Engine() as third, mpcomm.Engine(cluster(url)) as reader:
        kv = bytearray(4096)
        owner.register(kv, "kv")
        decoy = bytearray(4096)
        third.register(decoy, "kv")  # peer-to-peer: not published, reachable by address
        key = f"{prefix_of(url)}/regions/kv/{owner.node_id}"
        genuine = json.loads(etcd.get_raw(key))
        lease = etcd.grant()

        etcd.put_raw(key, json.dumps(genuine | {"address": third.address}), lease)
        with pytest.raises(mpcomm.AccessError, match=f"names node {owner.node_id}.*the node there is {third.node_id}"):
            reader.open("kv")

        # the right address but another epoch (a previous life of the node) is refused too
        etcd.put_raw(key, json.dumps(genuine | {"epoch": "0123456789abcdef"}), lease)
        with pytest.raises(mpcomm.AccessError, match="epoch 0123456789abcdef"):
            reader.open("kv")
        assert decoy == bytearray(4096)

        # the genuine record (written back as the owner wrote it) opens as before
        etcd.put_raw(key, json.dumps(genuine), lease)
        remote = reader.open("kv")
        reader.write(b"\x07" * 4096, remote).result(10)
        assert kv == b"\x07" * 4096 and decoy == bytearray(4096)


def test_record_of_another_node_pointing_at_the_reader_is_refused(url: str, etcd: EtcdServer) -> None:
    """A record of node A that points at the reader, beside the reader's own record of the same
    name, would have the reader write into its own region (one owner address, no ambiguity)."""
    with mpcomm.Engine(cluster(url)) as owner, mpcomm.Engine(cluster(url)) as reader:
        owner.register(bytearray(4096), "shared")
        own = bytearray(4096)
        reader.register(own, "shared")
        key = f"{prefix_of(url)}/regions/shared/{owner.node_id}"
        forged = json.loads(etcd.get_raw(key)) | {"address": reader.address}
        etcd.put_raw(key, json.dumps(forged), etcd.grant())
        with pytest.raises(mpcomm.AccessError, match=f"names node {owner.node_id}.*the node there is {reader.node_id}"):
            reader.open("shared")
        assert own == bytearray(4096)


def test_with_a_cluster_secret_only_signed_records_are_read(url: str, etcd: EtcdServer,
                                                             caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="mpcomm.metadata")
    p = prefix_of(url)
    with mpcomm.Engine(cluster(url), secret=SECRET) as owner, mpcomm.Engine(cluster(url), secret=SECRET) as reader:
        owner.register(bytearray(4096), "kv")
        key = f"{p}/regions/kv/{owner.node_id}"
        signed = json.loads(etcd.get_raw(key))
        assert isinstance(signed.get("mac"), str)  # written signed
        lease = etcd.grant()
        unsigned = {k: v for k, v in signed.items() if k != "mac"} | {"node_id": "n-unsigned"}
        etcd.put_raw(f"{p}/regions/kv/n-unsigned", json.dumps(unsigned), lease)
        badly = signed | {"node_id": "n-bad", "mac": "00" * 32}
        etcd.put_raw(f"{p}/regions/kv/n-bad", json.dumps(badly), lease)
        moved = signed | {"node_id": "n-moved"}  # a genuine signature, on another node's key
        etcd.put_raw(f"{p}/regions/kv/n-moved", json.dumps(moved), lease)
        etcd.put_raw(f"{p}/nodes/n-unsigned", json.dumps({"node_id": "n-unsigned", "address": "127.0.0.1:1",
                                                           "epoch": "e"}), lease)

        assert [r.node_id for r in reader.metadata.lookup("kv")] == [owner.node_id]
        assert [r.node_id for r in reader.metadata.list_regions()] == [owner.node_id]
        assert {n.node_id for n in reader.metadata.list_nodes()} == {owner.node_id, reader.node_id}
        warned = skip_warnings(caplog)
        for bad in ("regions/kv/n-unsigned", "regions/kv/n-bad", "regions/kv/n-moved", "nodes/n-unsigned"):
            assert f"{p}/{bad}" in warned, (bad, warned)
        assert "not signed" in warned and "signature is wrong" in warned
        assert reader.open("kv").node_id == owner.node_id
        # `mpcomm regions` reads with the cluster secret from the environment, as engines do
        cli = run_cli("regions", "--metadata", url, "--json", MPCOMM_SECRET=SECRET)
        assert cli.returncode == 0, cli.stderr
        assert [r["node_id"] for r in json.loads(cli.stdout)["regions"]] == [owner.node_id]
        assert f"{p}/regions/kv/n-unsigned" in "".join(cli.stderr.split())

        # a reader holding another secret reads none of them
        with _store(url, secret=OTHER_SECRET) as other:
            assert other.lookup("kv") == [] and other.list_nodes() == []
        # a reader without a secret cannot check signatures and reads the records as they are
        with _store(url) as plain:
            assert owner.node_id in {r.node_id for r in plain.lookup("kv")}


class _store:
    """A reader's store (nothing published) as a context manager; ``kw`` go to EtcdMetadata."""

    def __init__(self, url: str, **kw: object) -> None:
        _, endpoints, prefix = parse_metadata_url(url)
        self.store = EtcdMetadata(endpoints, prefix=prefix, **kw)  # type: ignore[arg-type]

    def __enter__(self) -> EtcdMetadata:
        return self.store

    def __exit__(self, *exc: object) -> None:
        self.store.close()


def test_records_without_a_lease_are_ignored(url: str, etcd: EtcdServer, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="mpcomm.metadata")
    p = prefix_of(url)
    with mpcomm.Engine(cluster(url)) as owner:
        owner.register(bytearray(4096), "kv")
        genuine = json.loads(etcd.get_raw(f"{p}/regions/kv/{owner.node_id}"))
        etcd.put_raw(f"{p}/regions/kv/n-nolease", json.dumps(genuine | {"node_id": "n-nolease"}))  # no lease
        with _store(url) as store:
            assert [r.node_id for r in store.lookup("kv")] == [owner.node_id]
        assert f"{p}/regions/kv/n-nolease" in skip_warnings(caplog)
        assert "no lease" in skip_warnings(caplog)


def test_a_record_under_another_records_key_is_ignored(url: str, etcd: EtcdServer,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="mpcomm.metadata")
    p = prefix_of(url)
    with mpcomm.Engine(cluster(url)) as owner:
        owner.register(bytearray(4096), "kv")
        genuine = etcd.get_raw(f"{p}/regions/kv/{owner.node_id}")
        lease = etcd.grant()
        etcd.put_raw(f"{p}/regions/kv/n-elsewhere", genuine, lease)  # node A's record under node B's key
        etcd.put_raw(f"{p}/regions/other/{owner.node_id}", genuine, lease)  # ... under another name
        with _store(url) as store:
            assert [r.node_id for r in store.lookup("kv")] == [owner.node_id]
            assert [(r.name, r.node_id) for r in store.list_regions()] == [("kv", owner.node_id)]
            assert store.lookup("other") == []
        warned = skip_warnings(caplog)
        assert f"{p}/regions/kv/n-elsewhere" in warned and f"{p}/regions/other/{owner.node_id}" in warned


# -- item 5: one deep record must not break every look-up ----------------------------------------------


def test_a_deeply_nested_record_is_skipped_and_everything_else_works(url: str, etcd: EtcdServer,
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="mpcomm.metadata")
    p = prefix_of(url)
    deep = "[" * 1500 + "]" * 1500  # 3 KB, under MAX_RECORD
    with mpcomm.Engine(cluster(url)) as owner, mpcomm.Engine(cluster(url)) as reader:
        owner.register(bytearray(4096), "good")
        lease = etcd.grant()
        etcd.put_raw(f"{p}/regions/good/x", deep, lease)
        etcd.put_raw(f"{p}/nodes/x", '{"a":' * 1500 + "1" + "}" * 1500, lease)
        etcd.put_raw(f"{p}/regions/good/y", json.dumps({"name": [[[[[["good"]]]]]]}), lease)
        genuine = json.loads(etcd.get_raw(f"{p}/regions/good/{owner.node_id}"))
        huge = json.dumps(genuine | {"node_id": "z", "published_at": 10 ** 400})
        etcd.put_raw(f"{p}/regions/good/z", huge, lease)  # float() of it would raise OverflowError

        assert [r.node_id for r in reader.metadata.lookup("good")] == [owner.node_id]
        assert [r.name for r in reader.metadata.list_regions()] == ["good"]
        assert {n.node_id for n in reader.metadata.list_nodes()} == {owner.node_id, reader.node_id}
        assert reader.open("good").node_id == owner.node_id
        warned = skip_warnings(caplog)
        for bad in ("regions/good/x", "nodes/x", "regions/good/y", "regions/good/z"):
            assert f"{p}/{bad}" in warned, (bad, warned)
        assert "nests deeper than" in warned

        # the command line lists the good records and exits 0
        cli = run_cli("regions", "--metadata", url, "--json")
        assert cli.returncode == 0, cli.stderr
        data = json.loads(cli.stdout)
        assert [(r["name"], r["node_id"]) for r in data["regions"]] == [("good", owner.node_id)]
        assert {n["node_id"] for n in data["nodes"]} == {owner.node_id, reader.node_id}
        assert f"{p}/regions/good/x" in "".join(cli.stderr.split())  # the skip is said, naming the key


# -- item 6: a key flood must not hide the real record -----------------------------------------------------


def test_a_key_flood_does_not_hide_the_real_record(url: str, etcd: EtcdServer,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="mpcomm.metadata")
    p = prefix_of(url)
    with mpcomm.Engine(cluster(url)) as owner, mpcomm.Engine(cluster(url)) as reader:
        owner.register(bytearray(4096), "kvF")
        # 10,050 junk keys that sort before the owner's node id ('!' < any hex digit)
        lease = etcd.grant()
        etcd.put_many([(f"{p}/regions/kvF/!junk-{i:05d}", "{}") for i in range(10_050)], lease)

        assert [r.node_id for r in reader.metadata.lookup("kvF")] == [owner.node_id]
        assert [r.node_id for r in reader.metadata.list_regions()] == [owner.node_id]
        assert reader.open("kvF").node_id == owner.node_id
        # junk is skipped with a bounded number of lines: the first keys named, the rest counted
        lines = [r.getMessage() for r in caplog.records if r.name == "mpcomm.metadata"]
        assert f"{p}/regions/kvF/!junk-00000" in lines[0]
        assert any(f"skipped 10040 more bad etcd records under {p}/regions/kvF/" in m for m in lines), lines[-3:]
        assert len(lines) <= 3 * 11


def test_a_listing_past_its_limit_says_so(url: str, etcd: EtcdServer, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="mpcomm.metadata")
    p = prefix_of(url)
    with mpcomm.Engine(cluster(url)) as owner:
        owner.register(bytearray(4096), "kvF")
        etcd.put_many([(f"{p}/regions/kvF/!junk-{i:05d}", "{}") for i in range(600)], etcd.grant())
        with _store(url, max_list=300) as store:
            with pytest.raises(MetadataError, match=f"more than 300 keys under {p}/regions/kvF/"):
                store.lookup("kvF")  # an answer from part of the keys could miss the owner
            caplog.clear()
            assert store.list_regions() == []  # the owner's record is past the limit ...
            assert any(f"more than 300 keys under {p}/regions/" in r.getMessage()
                       for r in caplog.records)  # ... and the listing says it stopped
