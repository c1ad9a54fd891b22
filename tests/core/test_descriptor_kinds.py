"""The memory kind travels in the descriptor (RemoteRegion) and the metadata
record (RegionRecord); both read older input without it as host memory."""

from __future__ import annotations

import json

import pytest

from mpcomm import MemoryLocation, MpcommError, RemoteRegion
from mpcomm.memory_kinds import HOST
from mpcomm.metadata import MetadataError, RegionRecord

BASE = {"address": "127.0.0.1:5000", "node_id": "n", "epoch": "e", "name": "kv", "region_id": 1, "size": 4096,
        "base_address": 0, "access": "rw", "token": 7}


def test_descriptor_carries_kind_and_device() -> None:
    d = RemoteRegion(**BASE, kind="cuda", device=2)
    back = RemoteRegion.from_bytes(d.to_bytes())
    assert back == d and back.location == MemoryLocation("cuda", 2)
    assert json.loads(d.to_bytes())["device"] == 2
    assert "memory=cuda:2" in repr(d) and "token=<hidden>" in repr(d)


def test_older_descriptor_is_host() -> None:
    d = RemoteRegion.from_bytes(json.dumps(BASE))
    assert (d.kind, d.device, d.location) == ("host", -1, HOST)


@pytest.mark.parametrize("bad", [-2, "0", True, 1.5])
def test_descriptor_refuses_bad_device(bad: object) -> None:
    with pytest.raises(MpcommError, match="'device' must be an integer >= -1"):
        RemoteRegion.from_dict({**BASE, "kind": "cuda", "device": bad})


def test_unknown_kind_from_a_newer_peer_is_kept() -> None:
    # A kind this version does not know is kept by name: the router refuses it (no transport moves it).
    d = RemoteRegion.from_dict({**BASE, "kind": "rocm", "device": 1})
    assert str(d.location) == "rocm:1"


def test_region_record_carries_kind_and_device() -> None:
    rec = RegionRecord(name="kv", node_id="n", address="127.0.0.1:5000", epoch="e", size=10, access="rw",
                       kind="cuda", device=1)
    assert RegionRecord.from_dict(json.loads(rec.to_json())) == rec


def test_older_region_record_is_host() -> None:
    old = {"name": "kv", "node_id": "n", "address": "127.0.0.1:5000", "epoch": "e", "size": 10, "access": "rw"}
    rec = RegionRecord.from_dict(old)
    assert (rec.kind, rec.device) == ("host", -1)
    with pytest.raises(MetadataError, match="device"):
        RegionRecord.from_dict({**old, "kind": "cuda", "device": "zero"})
