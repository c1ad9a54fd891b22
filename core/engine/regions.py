"""Local regions: the table peers' requests are checked against, leases, and
registration with the transports (once per region and transport, even when
many threads race to use a lazily registered region).

Revocation: ``unregister`` first marks the region closed (no new lease, no
new peer access: :meth:`RegionTable.serve` refuses it), waits for the leases
to end (a wait that times out reopens the region), then unregisters it from every transport, each of which guarantees on
return that no peer can reach it through that transport any more. Only then
does ``unregister`` return and the caller's buffer is released.
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, Any

from ..errors import (
    OutOfBoundsError,
    PermissionDeniedError,
    RegionClosedError,
    RegionError,
    StaleRegionError,
    UnknownRegionError,
)
from ..memory import Region
from ..transport import effective_capabilities

if TYPE_CHECKING:
    from ..transport import Transport

__all__ = ["RegionTable"]

log = logging.getLogger("mpcomm.engine")


class RegionTable:
    """Local regions by name and id; serves peers' accesses (target side)."""

    def __init__(self, epoch: str) -> None:
        self._epoch = epoch
        self._by_name: dict[str, Region] = {}
        self._by_id: dict[int, Region] = {}
        self._lock = threading.Lock()
        self._reg_locks: dict[int, threading.Lock] = {}

    def add(self, region: Region) -> None:
        with self._lock:
            if region.name in self._by_name:
                raise RegionError(f"a region named {region.name!r} is already registered", region=region.name)
            self._by_name[region.name] = region
            self._by_id[region.id] = region
            self._reg_locks[region.id] = threading.Lock()

    def remove(self, region: Region) -> bool:
        """Forget ``region``; a newer region of the same name stays. False if it was not here."""
        with self._lock:
            if self._by_id.get(region.id) is not region:
                return False
            del self._by_id[region.id]
            self._reg_locks.pop(region.id, None)
            if self._by_name.get(region.name) is region:
                del self._by_name[region.name]
            return True

    def by_name(self, name: str) -> Region:
        region = self._by_name.get(name)
        if region is None:
            raise UnknownRegionError(f"no region named {name!r} is registered here", region=name)
        return region

    def all(self) -> list[Region]:
        with self._lock:
            return list(self._by_id.values())

    def serve(self, region_id: int, token: int, epoch: str | None, offset: int, length: int, access: str) -> Region:
        """Check a peer's access and lease the region; the caller must ``release()`` it.

        Raises the AccessError subclass that says why nothing may be touched.
        """
        if epoch is not None and epoch != self._epoch:
            raise StaleRegionError("descriptor is from an earlier epoch of this node; open the region again")
        region = self._by_id.get(region_id)
        if region is None:
            raise UnknownRegionError(f"no region with id {region_id} is registered here")
        if token != region.token:
            raise PermissionDeniedError(f"wrong token for region {region.name!r}", region=region.name)
        if access not in region.access:
            verb = "written" if access == "w" else "read"
            raise PermissionDeniedError(f"region {region.name!r} may not be {verb} by peers", region=region.name)
        if offset < 0 or length < 0 or offset + length > region.size:
            raise OutOfBoundsError(
                f"[{offset}, {offset + length}) is outside region {region.name!r} of {region.size} bytes",
                region=region.name,
            )
        try:
            region.acquire()
        except RegionClosedError as exc:
            raise UnknownRegionError(str(exc), region=region.name) from exc
        return region

    # -- registration with transports ------------------------------------------------

    def register_with(self, region: Region, transports: dict[str, Transport]) -> None:
        """Register ``region`` with each transport that has not seen it (single-flight)."""
        lock = self._reg_locks.get(region.id)
        if lock is None:  # an ephemeral buffer: registered by its one request only
            lock = threading.Lock()
        with lock:
            for name, t in transports.items():
                if name in region.transport_info:
                    continue
                if region.kind != "host" and not _holds(t, region.kind):
                    continue  # it cannot move this memory: peers will not route through it
                info = t.register(region)
                if info is not None:
                    region.transport_info[name] = info

    def ensure_registered(self, region: Region, transport: Transport) -> None:
        if transport.name in region.transport_info:
            return
        self.register_with(region, {transport.name: transport})

    @staticmethod
    def unregister_from(region: Region, transports: dict[str, Any]) -> list[str]:
        """Revoke ``region`` on every transport; returns ``"name: error"`` for those that could not confirm."""
        failed = []
        for name, t in transports.items():
            if name in region.transport_info:
                try:
                    t.unregister(region)
                except Exception as exc:  # noqa: BLE001 - every transport gets its turn
                    log.exception("transport %s failed to unregister %s", name, region.name)
                    failed.append(f"{name}: {exc}")
        region.transport_info.clear()
        return failed


def _holds(t: Any, kind: str) -> bool:
    """Does transport ``t`` move memory of ``kind`` here (on either side)?"""
    caps, _ = effective_capabilities(type(t))
    return kind in caps.memory_kinds or kind in caps.remote_kinds


def release_view(region: Region) -> None:
    """Give the caller's buffer back (a bytearray can resize, an mmap can close).

    After the transports' unregister, which may still read the view.
    """
    if region.view is None:
        region.release_owner()  # device memory: a transport that still needs it holds the owner itself
        return
    try:
        region.view.release()
    except BufferError:
        pass  # something still exports from it; the reference drops with the region
