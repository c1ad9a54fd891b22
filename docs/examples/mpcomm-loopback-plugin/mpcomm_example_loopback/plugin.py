"""The module the entry point names: one hook implementation, nothing else.

Keep this module cheap to import. mpcomm imports every installed plugin at
engine start-up; heavy or native imports belong inside the transport's methods
(see ``ExamplePipeTransport.availability``).
"""

from __future__ import annotations

from collections.abc import Callable

from mpcomm import Transport, hookimpl


@hookimpl
def mpcomm_register_transports(register: Callable[[type[Transport]], None]) -> None:
    # Import the transport here, not at module top, so a bug in it is reported
    # as this plugin's failure (name, distribution, reason) instead of an
    # ImportError somewhere else. The core validates what we register.
    from .transport import ExamplePipeTransport

    register(ExamplePipeTransport)
