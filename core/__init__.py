"""mpcomm: one-sided transfers between the memory of many machines.

A core that defines the contract (buffer ownership, completion, timeouts,
cancellation, errors) and loads transports (tcp, shm, ucx, rdma_zerocopy, or
third-party ones) through the ``mpcomm.transports`` entry-point group::

    import mpcomm
    with mpcomm.Engine() as target, mpcomm.Engine() as initiator:
        kv = target.register(bytearray(64 << 20), name="kv")
        remote = initiator.open(target.address, "kv")
        src = initiator.register(bytearray(1 << 20))
        initiator.write(src, remote, remote_offset=4096).result(timeout=5)
"""

from __future__ import annotations

__version__ = "0.1.0"

from .config import Config, load_config
from .engine import CompletionQueue, Engine, Notification, TransportStatus
from .errors import (
    AccessError,
    AlignmentError,
    AllocationError,
    AuthenticationError,
    BackPressureError,
    ConfigError,
    EngineClosedError,
    HandshakeTimeout,
    LimitError,
    MemoryKindUnsupported,
    MpcommError,
    OutOfBoundsError,
    PeerConnectionError,
    PermissionDeniedError,
    PluginError,
    ProtocolError,
    RegionBusyError,
    RegionClosedError,
    RegionError,
    StaleRegionError,
    TransferError,
    TransferTimeout,
    TransportUnavailable,
    UnknownRegionError,
)
from .hookspecs import hookimpl
from .memory import Region
from .memory_kinds import DeviceBuffer, MemoryLocation
from .remote import RemoteRegion
from .transfer import Batch, Request, Transfer, TransferStatus
from .transport import (
    Availability,
    Capabilities,
    Operation,
    OperationGroup,
    Transport,
    TransportBusy,
    TransportContext,
)

__all__ = [
    "AccessError",
    "AlignmentError",
    "AllocationError",
    "AuthenticationError",
    "Availability",
    "BackPressureError",
    "Batch",
    "Capabilities",
    "CompletionQueue",
    "Config",
    "ConfigError",
    "DeviceBuffer",
    "Engine",
    "EngineClosedError",
    "HandshakeTimeout",
    "LimitError",
    "MemoryKindUnsupported",
    "MemoryLocation",
    "MpcommError",
    "Notification",
    "Operation",
    "OperationGroup",
    "OutOfBoundsError",
    "PeerConnectionError",
    "PermissionDeniedError",
    "PluginError",
    "ProtocolError",
    "Region",
    "RegionBusyError",
    "RegionClosedError",
    "RegionError",
    "RemoteRegion",
    "Request",
    "StaleRegionError",
    "Transfer",
    "TransferError",
    "TransferStatus",
    "TransferTimeout",
    "Transport",
    "TransportBusy",
    "TransportContext",
    "TransportStatus",
    "TransportUnavailable",
    "UnknownRegionError",
    "__version__",
    "hookimpl",
    "load_config",
]
