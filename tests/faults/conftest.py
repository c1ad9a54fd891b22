"""The fault suite: hosts in network namespaces (netns.py), an initiator driver in a namespace
(driver.py), a target with more levers (host.py), and generated hostile input. The raw control
client is shared with tests/core.

Every test here runs under a watchdog (no plugin needed): past its limit
(``@pytest.mark.watchdog(seconds)``, default 120 s) the stacks of every thread
go to stderr and the test fails, so a hang is a failure with a cause, never a
stuck suite.
"""

from __future__ import annotations

import faulthandler
import signal
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "core"))  # rawpeer, core_support
sys.path.insert(0, str(Path(__file__).parent))  # support, netns

DEFAULT_LIMIT = 120.0


class WatchdogExpired(Exception):
    pass


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "watchdog(seconds): fail the test (with every thread's stack) past this time")


@pytest.fixture(autouse=True)
def watchdog(request: pytest.FixtureRequest) -> Iterator[None]:
    mark = request.node.get_closest_marker("watchdog")
    limit = float(mark.args[0]) if mark else DEFAULT_LIMIT

    def expired(_sig: int, _frame: object) -> None:
        faulthandler.dump_traceback(all_threads=True)
        raise WatchdogExpired(f"{request.node.nodeid} ran past its {limit:.0f} s watchdog (stacks on stderr)")

    old = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, limit)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
