"""The [cluster] section and the [[route]] array in a TOML file."""

from __future__ import annotations

from pathlib import Path

import pytest

import mpcomm

GOOD = """
[cluster]
metadata = "etcd://127.0.0.1:2379,127.0.0.1:22379/prod"
lease_ttl_s = 5

[[route]]
name = "same-host"
same_host = true
transports = ["shm", "tcp"]

[[route]]
name = "big"
min_size = "1MiB"
transports = ["tcp"]
split_min = "64MiB"
"""


def test_file_with_cluster_and_routes(tmp_path: Path) -> None:
    f = tmp_path / "c.toml"
    f.write_text(GOOD)
    cfg = mpcomm.Config.load(f)
    assert cfg.cluster.metadata.startswith("etcd://") and cfg.cluster.lease_ttl_s == 5
    assert [r["name"] for r in cfg.route] == ["same-host", "big"]
    assert mpcomm.Config().cluster.metadata == "" and mpcomm.Config().route == ()
    replaced = cfg.with_overrides(route=[{"name": "only", "transports": ["tcp"]}], cluster={"lease_ttl_s": 3})
    assert [r["name"] for r in replaced.route] == ["only"] and replaced.cluster.lease_ttl_s == 3
    assert replaced.cluster.metadata == cfg.cluster.metadata


@pytest.mark.parametrize(
    "text, message",
    [
        ('[cluster]\nmetadata = "zookeeper://x:1"\n', "cluster.metadata 'zookeeper://x:1': expected"),
        ('[cluster]\nmetadata = "etcd://"\n', "no etcd endpoint"),
        ('[cluster]\nmetadata = "etcd://host:99999"\n', "port 99999 out of range"),
        ('[cluster]\nlease_ttl_s = 1\n', "lease_ttl_s must be at least 2"),
        ('[cluster]\nleases = 1\n', "unknown key cluster.leases"),
        ('[[route]]\nname = "x"\ntransports = "tcp"\n', "route 'x': transports must be a list"),
        ('route = 3\n', "route must be an array of tables"),
        ('[[route]]\nname = "x"\ntransports = ["tcp"]\nmax_size = "big"\n', "max_size: not a size"),
    ],
)
def test_bad_values_name_the_file(tmp_path: Path, text: str, message: str) -> None:
    f = tmp_path / "bad.toml"
    f.write_text(text)
    with pytest.raises(mpcomm.ConfigError, match=message) as ei:
        mpcomm.Config.load(f)
    assert str(f) in str(ei.value)


def test_metadata_url_forms() -> None:
    from mpcomm.metadata import parse_metadata_url

    assert parse_metadata_url("") == ("p2p", [], "")
    assert parse_metadata_url("p2p") == ("p2p", [], "")
    assert parse_metadata_url("etcd://a:1,b:2") == ("etcd", [("a", 1), ("b", 2)], "/mpcomm/v1")
    assert parse_metadata_url("etcd://a/x/y/") == ("etcd", [("a", 2379)], "/x/y")
    assert parse_metadata_url("etcd://[::1]:2379") == ("etcd", [("::1", 2379)], "/mpcomm/v1")
    assert parse_metadata_url("etcd://[::1]") == ("etcd", [("::1", 2379)], "/mpcomm/v1")
