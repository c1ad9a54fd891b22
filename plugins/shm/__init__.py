"""The shm transport plugin (see :mod:`mpcomm.plugins.shm.transport`).

Registered through the ``mpcomm.transports`` entry point ``shm``, like any
third-party transport.
"""

from __future__ import annotations

from collections.abc import Callable

from mpcomm import Transport, hookimpl


@hookimpl
def mpcomm_register_transports(register: Callable[[type[Transport]], None]) -> None:
    from .transport import ShmTransport

    register(ShmTransport)
