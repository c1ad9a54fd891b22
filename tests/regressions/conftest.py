"""Fixtures for the request-path regression tests (issue 8).

``_clean_env`` and the engine and target factories come from :mod:`mpcomm.testing.fixtures`
(shared with tests/core and tests/tcp).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from rsupport import RTarget, available, need  # noqa: E402,F401 (re-exported for the tests)

import mpcomm  # noqa: E402
from mpcomm.testing.fixtures import _clean_env, make_engine, spawn_fixture  # noqa: E402,F401 (fixtures)

#: ``target(transports, config=None)``: a target engine in a child process (``rtarget.py``), closed at teardown.
target = spawn_fixture(RTarget, name="target")


@pytest.fixture
def engine(make_engine: Callable[..., mpcomm.Engine]) -> Callable[..., mpcomm.Engine]:
    """``engine(transports, config=None, **kw)``: initiator engines in this process, closed at teardown."""

    def make(transports: list[str], config: Any = None, **kw: Any) -> mpcomm.Engine:
        return make_engine(config, transports=transports, **kw)

    return make
