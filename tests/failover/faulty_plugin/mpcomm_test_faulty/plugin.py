"""The module the ``faulty`` entry point names: one hook implementation."""

from __future__ import annotations

from collections.abc import Callable

from mpcomm import Transport, hookimpl


@hookimpl
def mpcomm_register_transports(register: Callable[[type[Transport]], None]) -> None:
    from .transport import FaultyTransport

    register(FaultyTransport)
