"""Fixtures for the tcp transport's tests: target engines in child processes, engines here."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
from tcp_support import Target

import mpcomm


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("MPCOMM_SECRET", "MPCOMM_PLUGINS", "MPCOMM_DISABLE_PLUGIN_AUTOLOAD", "MPCOMM_CONFIG"):
        monkeypatch.delenv(var, raising=False)


@pytest.fixture
def spawn() -> Iterator[Callable[..., Target]]:
    started: list[Target] = []

    def start(regions: dict[str, list[Any]] | None = None, **kw: Any) -> Target:
        t = Target(regions or {"kv": [1 << 20, "buffer"]}, **kw)
        started.append(t)
        return t

    yield start
    for t in started:
        t.close()


@pytest.fixture
def make_engine() -> Iterator[Callable[..., mpcomm.Engine]]:
    made: list[mpcomm.Engine] = []

    def make(config: Any = None, **kw: Any) -> mpcomm.Engine:
        kw.setdefault("transports", ["tcp"])
        e = mpcomm.Engine(config, **kw)
        made.append(e)
        return e

    yield make
    for e in reversed(made):
        e.close(timeout=2)
