"""The rdma_zerocopy transport plugin (see :mod:`mpcomm.plugins.rdma_zerocopy.transport`).

Importing this module imports no native library: pyverbs is loaded by
``RdmaZeroCopyTransport.availability()`` and ``start()``, through
:mod:`mpcomm.plugins.rdma_zerocopy.verbs`, the only module that touches it.
"""

from __future__ import annotations

from collections.abc import Callable

from mpcomm import Transport, hookimpl


@hookimpl
def mpcomm_register_transports(register: Callable[[type[Transport]], None]) -> None:
    from .transport import RdmaZeroCopyTransport

    register(RdmaZeroCopyTransport)
