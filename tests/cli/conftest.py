"""Fixtures for the CLI tests: a CliRunner, and a real ``mpcomm serve`` subprocess."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest
from typer.testing import CliRunner

from mpcomm.cli.app import app
from mpcomm_cli_helpers import Server, start_server


@pytest.fixture
def runner() -> CliRunner:
    return CliRunner()


@pytest.fixture
def invoke(runner: CliRunner, monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.delenv("MPCOMM_SECRET", raising=False)
    monkeypatch.delenv("MPCOMM_CONFIG", raising=False)

    def run(*args: str, **kw: Any) -> Any:
        return runner.invoke(app, [str(a) for a in args], **kw)

    return run


@pytest.fixture
def server() -> Iterator[Server]:
    srv = start_server("--region", "kv=1MiB", "--region", "small=4KiB")
    yield srv
    srv.stop()


@pytest.fixture
def data_file(tmp_path: Any) -> Any:
    path = tmp_path / "data.bin"
    path.write_bytes(os.urandom(300_000))
    return path


@pytest.fixture(autouse=True)
def _restore_mpcomm_logger():
    """The CLI configures the ``mpcomm`` logger for its process; CliRunner runs it
    in ours, so put the logger back for the tests that follow."""
    import logging

    logger = logging.getLogger("mpcomm")
    saved = (list(logger.handlers), logger.propagate, logger.level)
    yield
    logger.handlers[:] = saved[0]
    logger.propagate, logger.level = saved[1], saved[2]
