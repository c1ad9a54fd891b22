"""mpcomm.tent: mpcomm as Mooncake TENT's MPCOMM provider, and a drop-in for
Mooncake's Python ``TransferEngine``.

* :class:`MPComm` — the provider API (the one ``include/mpcomm.h`` declares
  for C++) in Python: raw addresses on both sides, hosts by host id, status
  codes from :mod:`mpcomm.tent.codes`, handles released exactly once.
* :class:`TransferEngine` — the methods, arguments, address model and return
  codes of ``mooncake.engine.TransferEngine``.
* :func:`scatter`, :func:`gather`, :func:`broadcast` — one local buffer to or
  from many regions as one handle, on an :class:`mpcomm.Engine`.
* ``libmpcomm.so`` — built at install time into the mpcomm package directory
  (an ``MPCOMM_ROOT``); :func:`native_status` says whether it is there.

See docs/tent.md.
"""

from __future__ import annotations

from . import codes
from .api import MPComm, RemoteBufferEntry, TransferResult
from .collectives import broadcast, gather, scatter
from .provider import Provider
from .transfer_engine import TransferEngine, TransferNotify, TransferOpcode



def native_status() -> dict:  # type: ignore[type-arg]
    """Whether libmpcomm.so is installed in the mpcomm package dir, or why not."""
    from .build import native_status as status

    return status()


__all__ = [
    "MPComm",
    "Provider",
    "RemoteBufferEntry",
    "TransferEngine",
    "TransferNotify",
    "TransferOpcode",
    "TransferResult",
    "broadcast",
    "codes",
    "gather",
    "native_status",
    "scatter",
]
