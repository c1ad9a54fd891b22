"""The ucx transport plugin (see :mod:`mpcomm.plugins.ucx.transport`).

Importing this module does not load UCX: the transport loads libucp (from the
``libucx-cu12`` wheel that ``mpcomm[ucx]`` installs) only when the engine asks
for its availability or starts it.
"""

from __future__ import annotations

from collections.abc import Callable

from mpcomm import Transport, hookimpl


@hookimpl
def mpcomm_register_transports(register: Callable[[type[Transport]], None]) -> None:
    from .transport import UcxTransport

    register(UcxTransport)
