"""docs/tent-transport.example.toml is valid, says what the seed says, and starts an engine."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import mpcomm

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "docs" / "tent-transport.example.toml"


@pytest.fixture(scope="module")
def config() -> mpcomm.Config:
    return mpcomm.Config.load(EXAMPLE)


def test_seed_values(config: mpcomm.Config) -> None:
    assert config.source == str(EXAMPLE)
    t = config.transport
    assert (t.name, t.mode, t.endpoint) == ("auto", "zero-copy", "0.0.0.0:18400")
    assert t.order == ("shm", "rdma_zerocopy", "ucx", "tcp")
    assert t.secret == "", "the example must not carry a secret"
    m = config.memory
    assert (m.types, m.registration, m.alignment) == (("host", "device"), "eager", 4096)
    r = config.runtime
    assert (r.worker_threads, r.queue_depth, r.request_timeout_ms) == (8, 1024, 5000)
    assert config.request_timeout == 5.0
    o = config.observability
    assert (o.metrics, o.trace_transfers) == (True, False)
    assert config.plugins == {"tcp": {"connections": 4}}


def test_name_comment_maps_the_seed(config: mpcomm.Config) -> None:
    text = EXAMPLE.read_text()
    assert "ucl-mpcomm" in text, "the comment mapping the seed's `name: ucl-mpcomm` is missing"
    assert re.search(r'^name = "auto"', text, re.M)


def test_engine_starts_from_it(config: mpcomm.Config) -> None:
    # The file binds 0.0.0.0:18400; a test binds loopback on a free port.
    with mpcomm.Engine(EXAMPLE, endpoint="127.0.0.1:0") as target, \
            mpcomm.Engine(config, endpoint="127.0.0.1:0") as initiator:
        assert target.config.memory.alignment == 4096
        assert target.config.transport.endpoint == "127.0.0.1:0"
        assert "tcp" in target.transports, target.transport_status()
        kv = target.allocate(1 << 20, name="kv")
        assert kv.address % 4096 == 0
        remote = initiator.open(target.address, "kv")
        src = initiator.allocate(64 << 10)
        src.view[:] = bytes(range(256)) * 256
        t = initiator.write(src, remote, remote_offset=4096)
        assert t.result(timeout=10) == 64 << 10
        assert bytes(kv.view[4096 : 4096 + (64 << 10)]) == bytes(src.view)


def test_configuration_doc_covers_every_key() -> None:
    """docs/configuration.md documents every key of every section."""
    doc = (REPO / "docs" / "configuration.md").read_text()
    for section in ("transport", "memory", "runtime", "observability"):
        cls = type(getattr(mpcomm.Config(), section))
        for name in cls.__dataclass_fields__:
            assert f"`{section}.{name}`" in doc, f"docs/configuration.md does not document {section}.{name}"
