"""pytest plugin (``pytest11`` entry point ``mpcomm``): conformance fixtures.

* ``--mpcomm-transport NAME`` (repeatable): transports to check; default every
  transport whose plugin is installed (unavailable ones are skipped with their
  reason).
* ``--mpcomm-plugin MODULE`` (repeatable): modules with hookimpls to load in
  both processes, for transports not installed through entry points.
* fixture ``mpcomm_conformance``: a :class:`~mpcomm.testing.ConformanceEnv`,
  one per transport, shared by the checks of that transport;
* fixture ``mpcomm_check``: parametrized over :data:`~mpcomm.testing.CHECKS`.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("mpcomm", "mpcomm transport conformance")
    group.addoption("--mpcomm-transport", action="append", default=[], help="transport(s) to run the conformance kit on")
    group.addoption("--mpcomm-plugin", action="append", default=[], help="module(s) holding transport hookimpls")


def _transports(config: pytest.Config) -> list[str]:
    chosen = config.getoption("--mpcomm-transport")
    if chosen:
        return list(chosen)
    from mpcomm.registry import load_plugins

    return sorted(load_plugins().transports)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "mpcomm_conformance" in metafunc.fixturenames:
        names = _transports(metafunc.config)
        metafunc.parametrize("mpcomm_transport_name", names, ids=names, scope="module")
    if "mpcomm_check" in metafunc.fixturenames:
        from mpcomm.testing.kit import CHECKS

        metafunc.parametrize("mpcomm_check", CHECKS, ids=[c.__name__.removeprefix("check_") for c in CHECKS])


@pytest.fixture(scope="module")
def mpcomm_conformance(request: pytest.FixtureRequest, mpcomm_transport_name: str) -> Iterator[Any]:
    from mpcomm.testing.kit import ConformanceEnv, Skip

    plugins = request.config.getoption("--mpcomm-plugin")
    try:
        env = ConformanceEnv(mpcomm_transport_name, plugins=plugins)
    except Skip as exc:
        pytest.skip(str(exc))
    yield env
    env.close()


@pytest.hookimpl(hookwrapper=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function) -> Iterator[None]:
    outcome = yield
    from mpcomm.testing.kit import Skip

    excinfo = outcome.excinfo
    if excinfo is not None and isinstance(excinfo[1], Skip):
        outcome.force_exception(pytest.skip.Exception(str(excinfo[1]), _use_item_location=True))
    if excinfo is not None and "mpcomm_conformance" in pyfuncitem.fixturenames:
        env = pyfuncitem.funcargs.get("mpcomm_conformance")
        if env is not None and env.target.proc.poll() is not None:
            env.target = env.spawn()
