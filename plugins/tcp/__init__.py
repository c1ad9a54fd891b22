"""The tcp transport plugin (see :mod:`mpcomm.plugins.tcp.transport`).

This module is all a plugin needs: a ``mpcomm_register_transports`` hook
implementation, named by an entry point in the ``mpcomm.transports`` group.
"""

from __future__ import annotations

from collections.abc import Callable

from mpcomm import Transport, hookimpl


@hookimpl
def mpcomm_register_transports(register: Callable[[type[Transport]], None]) -> None:
    from .transport import TcpTransport

    register(TcpTransport)
