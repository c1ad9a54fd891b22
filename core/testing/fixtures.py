"""pytest fixtures for suites that start engines here and target engines in child processes.

mpcomm's own suites (tests/core, tests/tcp, tests/regressions) take them from
here, and a plugin's suite can do the same: import them into a ``conftest.py``
(pytest registers a fixture under the name it has there)::

    from mpcomm.testing.fixtures import _clean_env, make_engine, spawn_fixture  # noqa: F401
    from my_support import Target

    spawn = spawn_fixture(Target)

* ``_clean_env`` (autouse where imported): the ``MPCOMM_*`` variables that
  change what an engine loads or how it authenticates are unset for each
  test, so the developer's shell does not leak into it;
* ``make_engine``: ``make_engine(config=None, **Engine_kwargs)``, tcp only unless
  ``transports=`` says otherwise, every engine closed at teardown;
* :func:`spawn_fixture`: a fixture that starts a target class (a
  :class:`~mpcomm.testing.TargetProcess` or any object with ``close()``) with
  the arguments it is called with, and closes each one at teardown;
* :func:`two_hosts_fixture`: a module-scoped second "host" in a network
  namespace (:func:`mpcomm.testing.netns.two_hosts`), skipped with the reason
  where namespaces cannot be made.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import pytest

import mpcomm

__all__ = ["ENV_VARS", "closing_all", "make_engine", "spawn_fixture", "two_hosts_fixture"]

T = TypeVar("T")

#: Unset for every test by ``_clean_env``.
ENV_VARS = ("MPCOMM_SECRET", "MPCOMM_PLUGINS", "MPCOMM_DISABLE_PLUGIN_AUTOLOAD", "MPCOMM_CONFIG")


@contextmanager
def closing_all(make: Callable[..., T], close: Callable[[T], Any] | None = None) -> Iterator[Callable[..., T]]:
    """``make`` as a factory whose every product is closed (last made first) when the block ends."""
    made: list[T] = []

    def start(*args: Any, **kw: Any) -> T:
        obj = make(*args, **kw)
        made.append(obj)
        return obj

    try:
        yield start
    finally:
        for obj in reversed(made):
            if close is not None:
                close(obj)
            else:
                obj.close()  # type: ignore[attr-defined]


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ENV_VARS:
        monkeypatch.delenv(var, raising=False)


@pytest.fixture
def make_engine() -> Iterator[Callable[..., mpcomm.Engine]]:
    """Engines on tcp only (unless ``transports=`` is given), closed at teardown."""

    def make(config: Any = None, **kw: Any) -> mpcomm.Engine:
        kw.setdefault("transports", ["tcp"])
        return mpcomm.Engine(config, **kw)

    with closing_all(make, lambda e: e.close(timeout=2)) as start:
        yield start


def spawn_fixture(target: Callable[..., T], name: str = "spawn") -> Any:
    """A fixture (called ``name``) that yields ``start(*args, **kw) -> target(*args, **kw)``, closing each at teardown."""

    @pytest.fixture(name=name)
    def spawn() -> Iterator[Callable[..., T]]:
        with closing_all(target) as start:
            yield start

    return spawn


def two_hosts_fixture(label: str, first_octets: str, *, here: bool = True, name: str = "two_hosts") -> Any:
    """A module-scoped fixture (called ``name``) yielding :class:`~mpcomm.testing.netns.TwoHosts`.

    ``here``: side a is this process's namespace (the test's own engine is one
    host); otherwise two fresh namespaces. Skipped with the reason where
    namespaces cannot be made (not root, no iproute2).
    """
    from . import netns

    @pytest.fixture(scope="module", name=name)
    def hosts() -> Iterator[netns.TwoHosts]:
        why = netns.unavailable()
        if why:
            pytest.skip(why)
        with netns.two_hosts(label, first_octets, here=here) as pair:
            yield pair

    return hosts
