"""Fixtures for the core tests: engines in this process and target engines in subprocesses.

``_clean_env``, ``make_engine`` and the ``spawn`` fixture's machinery are shared with
tests/tcp and tests/regressions (:mod:`mpcomm.testing.fixtures`).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
from core_support import Target

import mpcomm
from mpcomm.testing.fixtures import _clean_env, make_engine, spawn_fixture  # noqa: F401 (fixtures)

#: ``spawn(regions, endpoint=, config=, env=)``: the kit's target process on tcp, closed at teardown.
spawn = spawn_fixture(Target)


@pytest.fixture
def pair(make_engine: Callable[..., mpcomm.Engine]) -> tuple[mpcomm.Engine, mpcomm.Engine]:
    """(target, initiator) on tcp."""
    return make_engine(), make_engine()
