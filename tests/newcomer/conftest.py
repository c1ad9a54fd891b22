"""Fixtures of the new-user tests (helpers: newcomer_support)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from newcomer_support import Serve, start_serve


@pytest.fixture
def serve() -> Iterator[Serve]:
    """A real ``mpcomm serve`` (tcp, loopback, free port) with regions ``kv`` (1 MiB) and ``small`` (4 KiB)."""
    srv = start_serve("--region", "kv=1MiB", "--region", "small=4KiB", "--endpoint", "127.0.0.1:0", "-t", "tcp")
    yield srv
    srv.stop()
