"""RemoteRegion: the serializable descriptor of a peer's registered region."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

from .errors import MpcommError

__all__ = ["RemoteRegion"]


@dataclass(frozen=True)
class RemoteRegion:
    """What an initiator needs to address a region on a peer.

    Small and serializable (:meth:`to_bytes` / :meth:`from_bytes`, JSON), so it
    can travel out of band: a metadata service, a file, another RPC.

    Attributes:
        address: the peer engine's control endpoint (``host:port``).
        node_id, epoch: the peer's identity; a descriptor from an earlier epoch
            (the peer restarted) is refused with StaleRegionError.
        name, region_id, size, access: the region as registered on the peer.
        base_address: the region's address in the peer's process, for callers
            that address remote memory by raw address (:meth:`offset_of`).
        token: capability every access must present (like an rkey).
        kind: memory kind on the peer (``host``/``device``).
        transports: per-transport registration info (rkeys, shm handles).
    """

    address: str
    node_id: str
    epoch: str
    name: str
    region_id: int
    size: int
    base_address: int
    access: str
    token: int
    kind: str = "host"
    transports: dict[str, dict[str, Any]] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_bytes(self) -> bytes:
        return json.dumps(self.to_dict(), separators=(",", ":"), sort_keys=True).encode()

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RemoteRegion:
        try:
            return cls(**{k: d[k] for k in cls.__dataclass_fields__ if k in d})
        except TypeError as exc:
            raise MpcommError(f"malformed RemoteRegion descriptor: {exc}") from exc

    @classmethod
    def from_bytes(cls, data: bytes | str) -> RemoteRegion:
        try:
            d = json.loads(data)
        except ValueError as exc:
            raise MpcommError(f"malformed RemoteRegion descriptor: {exc}") from exc
        if not isinstance(d, dict):
            raise MpcommError("malformed RemoteRegion descriptor: not a JSON object")
        return cls.from_dict(d)

    def offset_of(self, remote_address: int) -> int:
        """Translate a raw address in the peer's process into an offset."""
        off = remote_address - self.base_address
        if not 0 <= off <= self.size:
            from .errors import OutOfBoundsError

            raise OutOfBoundsError(
                f"address {remote_address:#x} is outside region {self.name!r} "
                f"[{self.base_address:#x}, {self.base_address + self.size:#x})",
                region=self.name,
                peer=self.address,
            )
        return off

    @property
    def writable(self) -> bool:
        return "w" in self.access

    @property
    def readable(self) -> bool:
        return "r" in self.access
