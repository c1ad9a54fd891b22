"""Peer identity: endpoints, host identity and what a handshake tells us."""

from __future__ import annotations

import ipaddress
import os
import socket
from dataclasses import asdict, dataclass, field
from typing import Any

from .topology import Topology

__all__ = ["PeerInfo", "host_identity", "parse_endpoint", "format_endpoint", "same_host"]


def parse_endpoint(endpoint: str) -> tuple[str, int]:
    """``host:port``, ``[v6]:port`` or ``v6addr`` forms → (host, port)."""
    endpoint = endpoint.strip()
    if endpoint.startswith("["):
        host, sep, rest = endpoint[1:].partition("]")
        if not sep or not rest.startswith(":"):
            raise ValueError(f"bad endpoint {endpoint!r}: expected [v6addr]:port")
        port_s = rest[1:]
    else:
        host, sep, port_s = endpoint.rpartition(":")
        if not sep or not host:
            raise ValueError(f"bad endpoint {endpoint!r}: expected host:port")
        if ":" in host:
            raise ValueError(f"bad endpoint {endpoint!r}: write IPv6 addresses as [addr]:port")
    try:
        port = int(port_s)
    except ValueError:
        raise ValueError(f"bad endpoint {endpoint!r}: port {port_s!r} is not a number") from None
    if not 0 <= port <= 65535:
        raise ValueError(f"bad endpoint {endpoint!r}: port {port} out of range")
    return host, port


def format_endpoint(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def is_wildcard(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_unspecified
    except ValueError:
        return False


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


def _ns(kind: str) -> str:
    try:
        return os.readlink(f"/proc/self/ns/{kind}")
    except OSError:
        return ""


def host_identity() -> dict[str, Any]:
    """What tells two processes they share a kernel and can share memory.

    The hostname alone is not enough: two containers on different hosts may
    share it. The boot id identifies the kernel instance; the IPC, mount and
    PID namespaces tell whether shared memory and pids are visible across.
    """
    return {
        "hostname": socket.gethostname(),
        "boot_id": _read("/proc/sys/kernel/random/boot_id"),
        "ipc_ns": _ns("ipc"),
        "mnt_ns": _ns("mnt"),
        "pid_ns": _ns("pid"),
        "net_ns": _ns("net"),
        "uid": os.getuid(),
        "pid": os.getpid(),
    }


def same_host(a: dict[str, Any], b: dict[str, Any], *, need: tuple[str, ...] = ("ipc_ns",)) -> bool:
    """True only when both identities name the same kernel and share ``need`` namespaces."""
    if not a.get("boot_id") or a.get("boot_id") != b.get("boot_id"):
        return False
    return all(a.get(k) and a.get(k) == b.get(k) for k in need)


@dataclass
class PeerInfo:
    """A peer as its handshake described it."""

    node_id: str
    epoch: str
    address: str
    host: dict[str, Any] = field(default_factory=dict)
    transports: dict[str, dict[str, Any]] = field(default_factory=dict)
    protocol: int = 1
    #: The peer's hardware (issue 10); validated and size-bounded on receipt,
    #: None for peers that do not send it.
    topology: Topology | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> PeerInfo:
        return cls(
            node_id=str(d["node_id"]),
            epoch=str(d["epoch"]),
            address=str(d["address"]),
            host=dict(d.get("host") or {}),
            transports={str(k): dict(v) for k, v in (d.get("transports") or {}).items()},
            protocol=int(d.get("protocol", 1)),
            # TopologyError is a ValueError: the handshake turns it into a ProtocolError.
            topology=Topology.from_dict(d["topology"]) if d.get("topology") is not None else None,
        )
