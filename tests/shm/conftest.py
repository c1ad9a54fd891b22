"""Fixtures for the shm tests: target engines in real processes."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from shm_support import Target, make_engine

import mpcomm


@pytest.fixture
def spawn() -> Iterator[Any]:
    started: list[Target] = []

    def start(regions: dict[str, list[Any]], config: dict[str, Any] | None = None,
              prefix: list[str] | None = None, transports: list[str] | None = None) -> Target:
        spec: dict[str, Any] = {"regions": regions, "config": config}
        if transports:
            spec["transports"] = transports
        t = Target(spec, prefix)
        started.append(t)
        return t

    yield start
    for t in started:
        t.close()


@pytest.fixture
def initiator() -> Iterator[mpcomm.Engine]:
    with make_engine() as e:
        yield e
