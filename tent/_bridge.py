"""What ``libmpcomm.so`` calls into (one Bridge per ``mpcomm::MPComm``).

Every method returns an int status and never raises: the C++ side treats an
exception that escapes anyway as ``ERR_RUNTIME``. Completion is pushed to C++
through ``_mpcomm_native.complete(handle, code, nbytes)`` (a module the
library creates), so C++ threads poll their handles without taking the GIL.

The library looks up no attribute by name: when it imports this module,
the module hands :func:`open_bridge` to ``_mpcomm_native.attach``, and
``open_bridge`` returns a new Bridge's entry points as a tuple, in the order
of ``BridgeFn`` in tent/native/mpcomm.cpp.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Sequence
from typing import Any

from . import codes
from .api import outcome
from .provider import Provider

log = logging.getLogger("mpcomm.tent")


class Bridge:
    def __init__(self, complete: Callable[[int, int, int], None]) -> None:
        self.provider = Provider()
        self._complete = complete

    @staticmethod
    def _fail(exc: BaseException) -> tuple[int, str]:
        """(code, message): the C++ side keeps both per calling thread."""
        return codes.code_for(exc), f"{type(exc).__name__}: {exc}"

    def call(self, name: str, *args: Any) -> Any:
        try:
            getattr(self.provider, name)(*args)
            return codes.SUCCESS
        except Exception as exc:  # noqa: BLE001
            return self._fail(exc)

    def tcp_port(self) -> int:
        return self.provider.tcp_port

    def query(self, host_id: str, tcp_addr: str, tcp_port: int) -> Any:
        """(code, [(addr, length, numa), ...])."""
        try:
            bufs = self.provider.query(host_id, tcp_addr or None, tcp_port)
        except Exception as exc:  # noqa: BLE001
            return self._fail(exc)
        return codes.SUCCESS, [b.as_tuple() for b in bufs]

    def _watch(self, handle: int, t: Any) -> int:
        complete = self._complete

        def done(tr: Any) -> None:
            code, nbytes = outcome(tr)
            try:
                complete(handle, code, nbytes)
            except Exception:  # noqa: BLE001 - a completion must never raise into a transport
                log.exception("mpcomm.tent: completing handle %d failed", handle)

        t.add_done_callback(done)
        return codes.SUCCESS

    def issue(self, handle: int, kind: str, local: int, host_id: str, remote: int, length: int) -> Any:
        try:
            t = self.provider.issue(kind, local, host_id, remote, length)
        except Exception as exc:  # noqa: BLE001
            return self._fail(exc)
        return self._watch(handle, t)

    def issue_many(self, handle: int, mode: str, local: int, host_ids: Sequence[str],
                   remotes: Sequence[int], length: int) -> Any:
        n = len(host_ids)
        try:
            if mode == "broadcast":
                lengths, offsets, kind = [length] * n, [0] * n, "write"
            else:
                lengths, offsets = [length] * n, [i * length for i in range(n)]
                kind = "write" if mode == "scatter" else "read"
            t = self.provider.issue_many(kind, local, list(host_ids), list(remotes), lengths, offsets)
        except Exception as exc:  # noqa: BLE001
            return self._fail(exc)
        return self._watch(handle, t)


def open_bridge(complete: Callable[[int, int, int], None]) -> tuple[Callable[..., Any], ...]:
    """A new Bridge's entry points, in mpcomm.cpp's ``BridgeFn`` order: call, issue, issue_many,
    tcp_port, query (one Bridge per ``mpcomm::MPComm``; the tuple keeps it alive)."""
    b = Bridge(complete)
    return (b.call, b.issue, b.issue_many, b.tcp_port, b.query)


def _attach() -> None:
    """Hand :func:`open_bridge` to libmpcomm.so, which created ``_mpcomm_native`` before importing us."""
    native = sys.modules.get("_mpcomm_native")
    if native is not None:
        native.attach(open_bridge)


_attach()
