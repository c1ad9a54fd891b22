"""Fixtures for the core tests: engines in this process and target engines in subprocesses."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
from core_support import Target

import mpcomm


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("MPCOMM_SECRET", "MPCOMM_PLUGINS", "MPCOMM_DISABLE_PLUGIN_AUTOLOAD", "MPCOMM_CONFIG"):
        monkeypatch.delenv(var, raising=False)


@pytest.fixture
def make_engine() -> Iterator[Callable[..., mpcomm.Engine]]:
    """Engines on tcp only, closed at teardown."""
    made: list[mpcomm.Engine] = []

    def make(config: Any = None, **kw: Any) -> mpcomm.Engine:
        kw.setdefault("transports", ["tcp"])
        e = mpcomm.Engine(config, **kw)
        made.append(e)
        return e

    yield make
    for e in reversed(made):
        e.close(timeout=2)


@pytest.fixture
def pair(make_engine: Callable[..., mpcomm.Engine]) -> tuple[mpcomm.Engine, mpcomm.Engine]:
    """(target, initiator) on tcp."""
    return make_engine(), make_engine()


@pytest.fixture
def spawn() -> Iterator[Callable[..., Target]]:
    started: list[Target] = []

    def start(regions: dict[str, list[Any]], **kw: Any) -> Target:
        t = Target(regions, **kw)
        started.append(t)
        return t

    yield start
    for t in started:
        t.close()
