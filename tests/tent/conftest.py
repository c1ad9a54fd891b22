"""Set-ups the tent tests share: two tcp TransferEngines (the Mooncake API), and two Providers of
which one has the other's published range (real engines, loopback)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from tent_support import SIZE, Mem

from mpcomm.tent import TransferEngine
from mpcomm.tent.provider import Provider


@pytest.fixture
def tcp_engines() -> Iterator[tuple[TransferEngine, TransferEngine]]:
    """Two TransferEngines over tcp with P2PHANDSHAKE metadata, closed afterwards."""
    a, b = TransferEngine(), TransferEngine()
    try:
        assert a.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
        assert b.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
        yield a, b
    finally:
        b.close()
        a.close()


def _provider(name: str) -> Provider:
    p = Provider()
    p.init(f"127.0.0.1:{name}", "", 0, bind="127.0.0.1", transports=["tcp"])
    p.start_accept()
    return p


@contextmanager
def provider_nodes(suffix: str = "") -> Iterator[tuple[Provider, Provider, Mem, Mem]]:
    """(a, b, ma, mb): A publishes ``ma`` (SIZE bytes); B registers ``mb`` and has A's keys as host "A"."""
    a, b = _provider("a" + suffix), _provider("b" + suffix)
    try:
        ma, mb = Mem(), Mem()
        a.publish(ma.addr, SIZE)
        b.register_memory(mb.addr, SIZE)
        b.connect("A", "127.0.0.1", a.tcp_port)
        b.query("A")
        yield a, b, ma, mb
    finally:
        b.shutdown()
        a.shutdown()


@pytest.fixture(scope="module")
def nodes() -> Iterator[tuple[Provider, Provider, Mem, Mem]]:
    """provider_nodes() shared by a module's tests (each leaves it as it found it)."""
    with provider_nodes() as n:
        yield n


@pytest.fixture
def own_nodes() -> Iterator[tuple[Provider, Provider, Mem, Mem]]:
    """provider_nodes() for one test (one that breaks them)."""
    with provider_nodes("2") as n:
        yield n
