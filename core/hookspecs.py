"""Hook specifications for transport plugins.

A plugin is a module (or object) named by an entry point in the
``mpcomm.transports`` group::

    [project.entry-points."mpcomm.transports"]
    mytransport = "mytransport_pkg.plugin"

and implements hooks marked with :data:`mpcomm.hookimpl`. Hooks are called
with keyword arguments only.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import pluggy

if TYPE_CHECKING:
    from .transport import Transport

hookspec = pluggy.HookspecMarker("mpcomm")
hookimpl = pluggy.HookimplMarker("mpcomm")


@hookspec
def mpcomm_register_transports(register: Callable[[type[Transport]], None]) -> None:
    """Register the transport classes this plugin provides.

    Call ``register(TransportClass)`` once per class. The core validates each
    class (a :class:`mpcomm.Transport` subclass with a unique, non-empty
    ``name``) and reports a bad one as a broken plugin instead of failing.
    Do not import native libraries here: availability is asked later through
    ``TransportClass.availability()``.
    """
