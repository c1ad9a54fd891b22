"""RemoteRegion: the serializable descriptor of a peer's registered region."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

from .errors import MpcommError
from .memory_kinds import HOST, MemoryLocation

__all__ = ["RemoteRegion"]


_REQUIRED: dict[str, str] = {
    "address": "a 'host:port' string",
    "node_id": "a string",
    "epoch": "a string",
    "name": "a string",
    "region_id": "an integer",
    "size": "a positive integer",
    "base_address": "a non-negative integer",
    "access": "'r', 'w' or 'rw'",
    "token": "an integer",
}
_OPTIONAL: dict[str, str] = {"kind": "a string", "device": "an integer >= -1",
                             "transports": "an object of objects"}


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _field_ok(key: str, v: Any) -> bool:
    if key in ("address", "node_id", "epoch", "name", "kind"):
        return isinstance(v, str) and (bool(v) or key == "epoch")
    if key in ("region_id", "token"):
        return _is_int(v)
    if key == "device":
        return _is_int(v) and v >= -1
    if key == "size":
        return _is_int(v) and v > 0
    if key == "base_address":
        return _is_int(v) and v >= 0
    if key == "access":
        return v in ("r", "w", "rw")
    if key == "transports":
        return isinstance(v, dict) and all(isinstance(k, str) and isinstance(x, dict) for k, x in v.items())
    return True


def _problems(d: dict[str, Any]) -> list[str]:
    """Everything wrong with a descriptor dict, in words (empty when it is fine)."""
    missing = [k for k in _REQUIRED if k not in d]
    out = [f"missing field{'s' if len(missing) > 1 else ''} {', '.join(missing)}"] if missing else []
    for key, want in {**_REQUIRED, **_OPTIONAL}.items():
        if key in d and not _field_ok(key, d[key]):
            shown = repr(d[key]) if key != "token" else f"a {type(d[key]).__name__}"
            out.append(f"{key!r} must be {want}, not {shown[:60]}")
    if "address" in d and isinstance(d["address"], str) and d["address"]:
        from .peer import parse_endpoint

        try:
            parse_endpoint(d["address"])
        except ValueError as exc:
            out.append(f"'address' {d['address']!r}: {exc}")
    return out


@dataclass(frozen=True, repr=False)
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
        kind: memory kind on the peer (``host``/``cuda``); absent in older
            descriptors, which describe host memory.
        device: device ordinal on the peer for device memory; -1 for host.
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
    device: int = -1

    def __repr__(self) -> str:
        # The token is a capability (docs/contract.md): never in logs or tracebacks.
        return (f"RemoteRegion(name={self.name!r}, address={self.address!r}, node_id={self.node_id!r}, "
                f"epoch={self.epoch!r}, region_id={self.region_id}, size={self.size}, "
                f"base_address={self.base_address:#x}, access={self.access!r}, memory={self.location}, "
                f"transports={sorted(self.transports)}, token=<hidden>)")

    def to_dict(self) -> dict[str, Any]:
        """Every field, token included: treat the result as a secret."""
        return asdict(self)

    def to_bytes(self) -> bytes:
        return json.dumps(self.to_dict(), separators=(",", ":"), sort_keys=True).encode()

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RemoteRegion:
        """Build from a dict (e.g. one region of ``mpcomm serve --json``); unknown keys are ignored.

        Raises MpcommError naming every missing or ill-typed field.
        """
        if not isinstance(d, dict):
            raise MpcommError(f"malformed RemoteRegion descriptor: expected a JSON object, not {type(d).__name__}")
        problems = _problems(d)
        if problems:
            hint = ""
            if "regions" in d and "address" in d:
                hint = " (this looks like the whole `mpcomm serve --json` line: pass one entry of its 'regions')"
            raise MpcommError("malformed RemoteRegion descriptor: " + "; ".join(problems) + hint)
        return cls(**{k: d[k] for k in cls.__dataclass_fields__ if k in d})

    @classmethod
    def from_bytes(cls, data: bytes | str) -> RemoteRegion:
        if len(data) > 1 << 20:
            raise MpcommError(f"malformed RemoteRegion descriptor: {len(data)} bytes (at most 1 MiB)")
        try:
            d = json.loads(data)
        except RecursionError:
            raise MpcommError("malformed RemoteRegion descriptor: nested too deeply") from None
        except ValueError as exc:
            raise MpcommError(f"malformed RemoteRegion descriptor: not JSON ({exc})") from None
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
    def location(self) -> MemoryLocation:
        """Where the region's bytes live on the peer (an unknown kind keeps its name)."""
        if self.kind == "host":
            return HOST
        return MemoryLocation(self.kind, max(self.device, 0))

    @property
    def writable(self) -> bool:
        return "w" in self.access

    @property
    def readable(self) -> bool:
        return "r" in self.access
