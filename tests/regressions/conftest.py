"""Fixtures for the request-path regression tests (issue 8)."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from rsupport import RTarget  # noqa: E402

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


def available(name: str) -> str | None:
    """None when transport ``name`` can run here, else the reason it cannot."""
    from mpcomm.registry import load_plugins

    entry = load_plugins().transports.get(name)
    if entry is None:
        return f"no plugin provides transport {name!r}"
    avail = entry.cls.availability()
    return None if avail else f"transport {name!r} is not available here: {avail.reason}"


def need(name: str) -> None:
    reason = available(name)
    if reason is not None:
        pytest.skip(reason)
