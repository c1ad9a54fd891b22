"""Fixtures for the tcp transport's tests: target engines in child processes, engines here.

``_clean_env``, ``make_engine`` and the ``spawn`` fixture's machinery are shared with
tests/core and tests/regressions (:mod:`mpcomm.testing.fixtures`).
"""

from __future__ import annotations

from tcp_support import Target

from mpcomm.testing.fixtures import _clean_env, make_engine, spawn_fixture  # noqa: F401 (fixtures)

#: ``spawn(regions=None, config=, secret=)``: a tcp target (default: a 1 MiB "kv" buffer), closed at teardown.
spawn = spawn_fixture(Target)
