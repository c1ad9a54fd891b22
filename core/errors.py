"""The exception tree of mpcomm.

Every error mpcomm raises derives from :class:`MpcommError`. Each class says
whether retrying the same operation can help (``retryable``); an instance may
override that (a refused connection is worth retrying, a version mismatch is
not)::

    MpcommError                      (root; .retryable)
    ├── ConfigError                  bad TOML, unknown key, bad value (names key and file)
    ├── PluginError                  a transport plugin failed to load or misbehaved
    ├── TransportUnavailable         no usable transport for this peer / memory kind
    │   └── MemoryKindUnsupported    no transport moves this (local, remote) pair of memory kinds
    ├── RegionError                  local registration problems
    │   ├── AllocationError          size larger than memory, /dev/shm or memlock can hold
    │   ├── AlignmentError           buffer does not satisfy memory.alignment
    │   ├── RegionBusyError          unregister/close refused: the region is leased
    │   └── RegionClosedError        the region was unregistered
    ├── AccessError                  refused by the target; nothing was written
    │   ├── UnknownRegionError       no region of that name / id on the target
    │   ├── OutOfBoundsError         offset + length past the registered bounds
    │   ├── PermissionDeniedError    access right missing (write to a read-only region, bad token)
    │   └── StaleRegionError         descriptor from an earlier epoch of the target (re-open it)
    ├── TransferError                the transfer itself failed
    │   ├── TransferTimeout          (also builtin TimeoutError) deadline passed
    │   │   └── HandshakeTimeout     a connection's handshake did not finish in time
    │   ├── PeerConnectionError      (also builtin ConnectionError) peer unreachable / died
    │   ├── ProtocolError            malformed or unexpected frame; the connection is closed
    │   ├── AuthenticationError      shared-secret handshake failed
    │   ├── LimitError               a peer's request exceeds a limit of the target ([limits])
    │   └── BackPressureError        queue_depth requests already in flight
    └── EngineClosedError            the engine was closed

``concurrent.futures.CancelledError`` (not part of this tree) is what a
cancelled :class:`~mpcomm.Transfer` raises from ``result()``, as every Future
does.

Errors carry what they concern where there is one: ``.region`` (a name),
``.peer`` (an address) and ``.request`` (a :class:`~mpcomm.Request`).
Native errors (``OSError``, UCX status codes, ibverbs errors) are mapped at
the plugin boundary with :func:`map_errors` and chained with ``raise ... from``.
"""

from __future__ import annotations

import contextlib
import errno
from collections.abc import Iterator
from typing import Any

__all__ = [
    "AccessError",
    "AlignmentError",
    "AllocationError",
    "AuthenticationError",
    "BackPressureError",
    "ConfigError",
    "EngineClosedError",
    "HandshakeTimeout",
    "LimitError",
    "MemoryKindUnsupported",
    "MpcommError",
    "OutOfBoundsError",
    "PeerConnectionError",
    "PermissionDeniedError",
    "PluginError",
    "ProtocolError",
    "RegionBusyError",
    "RegionClosedError",
    "RegionError",
    "StaleRegionError",
    "TransferError",
    "TransferTimeout",
    "TransportUnavailable",
    "UnknownRegionError",
    "error_from_code",
    "map_errors",
]


class MpcommError(Exception):
    """Root of every mpcomm error.

    ``retryable`` tells whether issuing the same operation again may succeed.
    """

    retryable: bool = False
    #: Short stable identifier used on the wire and in metrics ("out_of_bounds").
    code: str = "error"

    def __init__(
        self,
        message: str = "",
        *,
        retryable: bool | None = None,
        region: str | None = None,
        peer: str | None = None,
        request: Any = None,
    ) -> None:
        super().__init__(message)
        if retryable is not None:
            self.retryable = retryable
        self.region = region
        self.peer = peer
        self.request = request


class ConfigError(MpcommError):
    code = "config"


class PluginError(MpcommError):
    code = "plugin"


class TransportUnavailable(MpcommError):
    code = "unavailable"


class MemoryKindUnsupported(TransportUnavailable):
    """No running transport moves this pair of memory kinds (``local_kind``, ``remote_kind``).

    Raised at submit, before anything moves: a CUDA region with no transport
    whose CUDA support is available here, say. The message names the kinds and
    what each transport moves.
    """

    code = "memory_kind"

    def __init__(self, message: str = "", *, local_kind: str = "", remote_kind: str = "", **kw: Any) -> None:
        super().__init__(message, **kw)
        self.local_kind = local_kind
        self.remote_kind = remote_kind


class RegionError(MpcommError):
    code = "region"


class AllocationError(RegionError):
    """A size this host cannot hold (memory, /dev/shm, RLIMIT_MEMLOCK); nothing was allocated."""

    code = "allocation"


class AlignmentError(RegionError):
    code = "alignment"


class RegionBusyError(RegionError):
    code = "region_busy"
    retryable = True


class RegionClosedError(RegionError):
    code = "region_closed"


class AccessError(MpcommError):
    code = "access"


class UnknownRegionError(AccessError):
    code = "unknown_region"


class OutOfBoundsError(AccessError):
    code = "out_of_bounds"


class PermissionDeniedError(AccessError):
    code = "permission_denied"


class StaleRegionError(AccessError):
    code = "stale_region"
    retryable = True


class TransferError(MpcommError):
    code = "transfer"


class TransferTimeout(TransferError, TimeoutError):
    """The request's deadline passed.

    Raised only once the transport guarantees that no more bytes of the request
    will land (see ``landed`` for what may have happened before).
    """

    code = "timeout"
    retryable = True
    #: False when the transport could not confirm, within ``runtime.abort_grace_ms``
    #: after the deadline, that the request stopped: then bytes may still land.
    confirmed: bool = True


class HandshakeTimeout(TransferTimeout):
    """A connection's handshake (authentication, hello) did not finish by its deadline.

    The deadline covers the whole exchange, not each read: a peer trickling one
    byte at a time is cut when the handshake's time is up.
    """

    code = "handshake_timeout"


class PeerConnectionError(TransferError, ConnectionError):
    code = "connection"
    retryable = True


class ProtocolError(TransferError):
    code = "protocol"


class AuthenticationError(TransferError):
    code = "auth"


class LimitError(TransferError):
    """The request exceeds one of the target's ``[limits]`` (a notification too large, say); nothing was done."""

    code = "limit"


class BackPressureError(TransferError):
    code = "back_pressure"
    retryable = True


class EngineClosedError(MpcommError):
    code = "engine_closed"


_BY_CODE: dict[str, type[MpcommError]] = {
    cls.code: cls
    for cls in [
        MpcommError, ConfigError, PluginError, TransportUnavailable, MemoryKindUnsupported, RegionError,
        AllocationError, AlignmentError, RegionBusyError, RegionClosedError, AccessError,
        UnknownRegionError, OutOfBoundsError, PermissionDeniedError, StaleRegionError,
        TransferError, TransferTimeout, HandshakeTimeout, PeerConnectionError, ProtocolError,
        AuthenticationError, LimitError, BackPressureError, EngineClosedError,
    ]
}


def error_from_code(code: str, message: str, **kw: Any) -> MpcommError:
    """Rebuild an error a peer reported by its wire ``code``."""
    return _BY_CODE.get(code, MpcommError)(message, **kw)


_CONNECTION_ERRNOS = {
    errno.ECONNREFUSED, errno.ECONNRESET, errno.ECONNABORTED, errno.EPIPE,
    errno.EHOSTUNREACH, errno.ENETUNREACH, errno.ENOTCONN, errno.ESHUTDOWN,
}


@contextlib.contextmanager
def map_errors(peer: str | None = None, what: str = "transfer") -> Iterator[None]:
    """Map native ``OSError``s raised inside the block onto the mpcomm tree.

    Plugins wrap their low-level calls with it so callers only ever see
    :class:`MpcommError` subclasses; the native error stays as ``__cause__``.
    """
    try:
        yield
    except MpcommError:
        raise
    except (TimeoutError, OSError) as exc:
        if isinstance(exc, TimeoutError):
            raise TransferTimeout(f"{what}: timed out talking to {peer}", peer=peer) from exc
        if isinstance(exc, ConnectionError) or exc.errno in _CONNECTION_ERRNOS:
            raise PeerConnectionError(f"{what}: connection to {peer} failed: {exc}", peer=peer) from exc
        raise TransferError(f"{what}: {exc}", peer=peer) from exc
