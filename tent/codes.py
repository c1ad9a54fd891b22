"""The provider's status codes, shared by the C++ library and the Python API.

``SUCCESS`` is 0 and every failure is negative, as TENT's adapter expects
(``MPCOMM_SUCCESS == 0``). ``include/mpcomm.h`` declares the same values;
``tests/tent`` checks that the two agree.
"""

from __future__ import annotations

from concurrent.futures import CancelledError

from mpcomm.errors import (
    AccessError,
    BackPressureError,
    EngineClosedError,
    MpcommError,
    OutOfBoundsError,
    PeerConnectionError,
    PermissionDeniedError,
    RegionBusyError,
    RegionError,
    StaleRegionError,
    TransferTimeout,
    TransportUnavailable,
    UnknownRegionError,
)

SUCCESS = 0
ERR_GENERIC = -1
ERR_INVALID_ARGUMENT = -2
ERR_NOT_INITIALIZED = -3
ERR_ALREADY_INITIALIZED = -4
ERR_OUT_OF_RANGE = -5  # an address outside every registered / published range
ERR_UNKNOWN_HOST = -6  # no connect() for that host id
ERR_CONNECTION = -7  # the peer cannot be reached or went away
ERR_TIMEOUT = -8
ERR_INVALID_HANDLE = -9  # unknown or already released handle
ERR_PERMISSION = -10
ERR_STALE = -11  # the peer restarted since its buffers were queried
ERR_SHUTDOWN = -12  # shut down while the transfer was in flight
ERR_RUNTIME = -13  # the embedded Python runtime failed (the C++ library only)
ERR_BUSY = -14  # region in use, or too many requests in flight
ERR_IN_PROGRESS = -15  # result asked for before the transfer completed
ERR_CANCELLED = -16
ERR_TRANSPORT = -17  # no transport reaches the peer, or the transport failed

NAMES = {v: k for k, v in globals().items() if k == "SUCCESS" or k.startswith("ERR_")}


class ProviderError(MpcommError):
    """A refusal of the provider layer itself, carrying its status code."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


def code_for(exc: BaseException | None) -> int:
    """Map an exception to a status code (None -> SUCCESS). Never raises."""
    if exc is None:
        return SUCCESS
    if isinstance(exc, ProviderError):
        return exc.code
    if isinstance(exc, CancelledError):
        return ERR_CANCELLED
    for cls, code in _MAP:
        if isinstance(exc, cls):
            return code
    if isinstance(exc, (ValueError, TypeError, OverflowError)):
        return ERR_INVALID_ARGUMENT
    return ERR_GENERIC


_MAP: tuple[tuple[type[BaseException], int], ...] = (
    (TransferTimeout, ERR_TIMEOUT),
    (EngineClosedError, ERR_SHUTDOWN),
    (StaleRegionError, ERR_STALE),
    (PeerConnectionError, ERR_CONNECTION),
    (OutOfBoundsError, ERR_OUT_OF_RANGE),
    (UnknownRegionError, ERR_OUT_OF_RANGE),
    (PermissionDeniedError, ERR_PERMISSION),
    (RegionBusyError, ERR_BUSY),
    (BackPressureError, ERR_BUSY),
    (TransportUnavailable, ERR_TRANSPORT),
    (AccessError, ERR_PERMISSION),
    (RegionError, ERR_INVALID_ARGUMENT),
    (ConnectionError, ERR_CONNECTION),
    (TimeoutError, ERR_TIMEOUT),
    (OSError, ERR_CONNECTION),
)
