"""Fixtures for the request-path regression tests (issue 8)."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from rsupport import RTarget, available, need  # noqa: E402,F401 (re-exported for the tests)

import mpcomm  # noqa: E402


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("MPCOMM_SECRET", "MPCOMM_PLUGINS", "MPCOMM_DISABLE_PLUGIN_AUTOLOAD", "MPCOMM_CONFIG"):
        monkeypatch.delenv(var, raising=False)


@pytest.fixture
def engine() -> Iterator[Callable[..., mpcomm.Engine]]:
    """Initiator engines in this process, closed at teardown."""
    made: list[mpcomm.Engine] = []

    def make(transports: list[str], config: Any = None, **kw: Any) -> mpcomm.Engine:
        e = mpcomm.Engine(config, transports=transports, **kw)
        made.append(e)
        return e

    yield make
    for e in reversed(made):
        e.close(timeout=2)


@pytest.fixture
def target() -> Iterator[Callable[..., RTarget]]:
    """Target engines in child processes (``rtarget.py``), killed at teardown."""
    started: list[RTarget] = []

    def start(transports: list[str], config: dict[str, Any] | None = None) -> RTarget:
        t = RTarget(transports, config)
        started.append(t)
        return t

    yield start
    for t in started:
        t.close()
