"""Peer identity: endpoints, host identity and what a handshake tells us."""

from __future__ import annotations

import ipaddress
import json
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


# Bounds on what a peer may say about itself (PeerInfo.from_dict); far above real values.
MAX_ID = 128  # node_id, epoch
MAX_ADDRESS = 300
MAX_HOST_KEYS = 32
MAX_HOST_VALUE = 512
MAX_TRANSPORTS = 16
MAX_TRANSPORT_INFO = 16 << 10  # bytes of JSON per transport entry


def _text(d: dict[str, Any], key: str, limit: int, required: bool = True) -> str:
    if key not in d:
        if required:
            raise ValueError(f"missing {key!r}")
        return ""
    v = d[key]
    if not isinstance(v, str):
        raise ValueError(f"{key} must be a string, not {type(v).__name__}")
    if len(v) > limit:
        raise ValueError(f"{key} is {len(v)} characters long (at most {limit})")
    return v


@dataclass
class PeerInfo:
    """A peer as its handshake described it.

    Everything here is the peer's own claim; ``authenticated`` (never sent,
    set by the control server) says whether the connection it arrived on
    proved the shared secret. See docs/security.md for which claims the
    handshake checks.
    """

    node_id: str
    epoch: str
    address: str
    host: dict[str, Any] = field(default_factory=dict)
    transports: dict[str, dict[str, Any]] = field(default_factory=dict)
    protocol: int = 1
    authenticated: bool = field(default=False, compare=False, repr=False)
    #: The peer's hardware (issue 10); validated and size-bounded on receipt,
    #: None for peers that do not send it.
    topology: Topology | None = None

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        del d["authenticated"]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> PeerInfo:
        """Validate a peer's self-description: types, lengths and sizes are bounded (ValueError)."""
        if not isinstance(d, dict):
            raise ValueError(f"peer info must be an object, not {type(d).__name__}")
        node_id = _text(d, "node_id", MAX_ID)
        epoch = _text(d, "epoch", MAX_ID)
        if not node_id or not epoch:
            raise ValueError("node_id and epoch must not be empty")
        address = _text(d, "address", MAX_ADDRESS)
        host = d.get("host") or {}
        if not isinstance(host, dict):
            raise ValueError(f"host must be an object, not {type(host).__name__}")
        if len(host) > MAX_HOST_KEYS:
            raise ValueError(f"host has {len(host)} keys (at most {MAX_HOST_KEYS})")
        for k, v in host.items():
            if len(k) > MAX_ID or not (v is None or isinstance(v, (str, int, float, bool))):
                raise ValueError(f"host.{k[:MAX_ID]} must be a short scalar")
            if isinstance(v, str) and len(v) > MAX_HOST_VALUE:
                raise ValueError(f"host.{k} is longer than {MAX_HOST_VALUE} characters")
        transports = d.get("transports") or {}
        if not isinstance(transports, dict):
            raise ValueError(f"transports must be an object, not {type(transports).__name__}")
        if len(transports) > MAX_TRANSPORTS:
            raise ValueError(f"transports has {len(transports)} entries (at most {MAX_TRANSPORTS})")
        for k, v in transports.items():
            if len(k) > MAX_ID or not isinstance(v, dict):
                raise ValueError(f"transports.{k[:MAX_ID]} must be an object")
            if len(json.dumps(v)) > MAX_TRANSPORT_INFO:
                raise ValueError(f"transports.{k} is larger than {MAX_TRANSPORT_INFO} bytes")
        protocol = d.get("protocol", 1)
        if isinstance(protocol, bool) or not isinstance(protocol, int) or not 0 < protocol < 1 << 16:
            raise ValueError(f"protocol must be a small positive integer, not {protocol!r}")
        return cls(
            node_id=node_id,
            epoch=epoch,
            address=address,
            host=dict(host),
            transports={str(k): dict(v) for k, v in transports.items()},
            protocol=protocol,
            # TopologyError is a ValueError: the handshake turns it into a ProtocolError.
            topology=Topology.from_dict(d["topology"]) if d.get("topology") is not None else None,
        )
