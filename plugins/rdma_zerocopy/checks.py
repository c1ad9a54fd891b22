"""Range checks for rdma_zerocopy: our options, the device's limits, and what a peer sends at connect.

Pure Python (no pyverbs), so the rules are testable anywhere. The bit widths
are InfiniBand's (IBTA spec vol. 1): QPN and PSN are 24 bits, LID 16, the
local ACK timeout a 5-bit exponent, retry counters 3 bits, the service level
4 bits; libibverbs passes these fields through unchecked and a wrong value
is silently truncated by the adapter, or rejected with a bare EINVAL by
``ibv_modify_qp``.
"""

from __future__ import annotations

import ipaddress
from typing import Any

from mpcomm.errors import ConfigError, ProtocolError

__all__ = ["IB_MAX_MSG", "check_options", "check_peer_info", "device_cap", "rd_atomic", "wr_bytes"]

#: The largest RDMA message InfiniBand allows (2 GiB); also our cap when a device reports 0.
IB_MAX_MSG = 1 << 31
#: Bytes per work request when neither side limits it further.
DEFAULT_WR_BYTES = 1 << 30
_MTU_ENUM = range(1, 6)  # IBV_MTU_256 .. IBV_MTU_4096

#: option → (lowest, highest, why), inclusive.
OPTION_RANGES: dict[str, tuple[int, int, str]] = {
    "port": (0, 255, "0 = the first ACTIVE port; ports are numbered from 1"),
    "gid_index": (-1, (1 << 31) - 1, "-1 = automatic"),
    "sq_depth": (1, 1 << 20, "outstanding work requests per queue pair"),
    "cq_depth": (1, 1 << 22, "completion queue entries per engine"),
    "chunk": (0, IB_MAX_MSG, "bytes per work request; 0 = the ports' max_msg_sz; InfiniBand allows at most 2 GiB"),
    "poll_spin_us": (0, 1_000_000, "microseconds of polling before sleeping"),
    "ack_timeout": (1, 31, "a 5-bit exponent: 4.096 us * 2**n; 0 would mean 'never time out', so a dead peer "
                    "would never be detected by the adapter"),
    "retry_count": (0, 7, "a 3-bit counter"),
    "traffic_class": (0, 255, "the 8-bit GRH traffic class"),
    "service_level": (0, 15, "a 4-bit service level"),
    "max_reposts": (0, 1000, "times a flushed chunk of an innocent request is reposted"),
    "staging_bytes": (0, 1 << 30, "the pre-registered slab for per-request buffers; 0 = none"),
    "staging_slot": (4096, 16 << 20, "the largest per-request buffer that goes through the slab"),
}


def check_options(options: dict[str, Any], name: str = "rdma_zerocopy") -> dict[str, int]:
    """The numeric options as ints, or ConfigError naming the option, its range and why."""
    out: dict[str, int] = {}
    for key, (lo, hi, why) in OPTION_RANGES.items():
        raw = options.get(key)
        if isinstance(raw, bool) or not isinstance(raw, int):
            try:
                value = int(str(raw), 0)
            except ValueError:
                raise ConfigError(f"plugins.{name}.{key} must be an integer in [{lo}, {hi}] ({why}), "
                                  f"not {raw!r}") from None
        else:
            value = raw
        if not lo <= value <= hi:
            raise ConfigError(f"plugins.{name}.{key} = {value} is outside [{lo}, {hi}] ({why})")
        out[key] = value
    return out


def device_cap(wanted: int, limit: int) -> int:
    """``wanted`` bounded by a device limit; a limit of 0 (or less) means the device did not report one.

    Some providers report 0 for limits they do not enforce; ``max(1, min(wanted, 0))``
    would then cripple the queue to one entry. Unreported limits leave the
    request as configured, and the verbs call that creates the resource says
    if it is too much.
    """
    return wanted if limit <= 0 else max(1, min(wanted, limit))


def rd_atomic(local: int, remote: int) -> int:
    """Outstanding RDMA READs: the smaller of the two reported limits (0 = unreported), at least 1."""
    known = [v for v in (int(local), int(remote)) if v > 0]
    return min(known) if known else 1


def wr_bytes(chunk: int, local_max: int, remote_max: int) -> int:
    """Bytes per work request on a link: the option, both ports' max_msg_sz (0 = unreported), 1 GiB."""
    limits = [v for v in (chunk, local_max, remote_max) if v > 0]
    return min([DEFAULT_WR_BYTES, *limits])


def _int(body: dict[str, Any], key: str, lo: int, hi: int, default: int | None = None) -> int:
    if key not in body and default is not None:
        return default
    value = body.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise ProtocolError(f"rdma connect: {key} must be an integer in [{lo}, {hi}], not {value!r}")
    return value


def check_peer_info(body: dict[str, Any], link_layer: str) -> dict[str, Any]:
    """Validate a peer's queue-pair description (untrusted: it came over the network).

    Returns the normalised fields; raises ProtocolError saying which field is wrong.
    """
    if not isinstance(body, dict):
        raise ProtocolError("rdma connect: the queue-pair description must be an object")
    out: dict[str, Any] = {
        "qpn": _int(body, "qpn", 1, (1 << 24) - 1),
        "psn": _int(body, "psn", 0, (1 << 24) - 1),
        "lid": _int(body, "lid", 0, 0xFFFF, 0),
        "mtu": _int(body, "mtu", _MTU_ENUM.start, _MTU_ENUM.stop - 1),
        "rd_atom": _int(body, "rd_atom", 0, 255, 0),
        "init_rd_atom": _int(body, "init_rd_atom", 0, 255, 0),
        "max_msg_sz": _int(body, "max_msg_sz", 0, (1 << 32) - 1, 0),
    }
    gid = body.get("gid", "")
    if not isinstance(gid, str):
        raise ProtocolError(f"rdma connect: gid must be a string, not {type(gid).__name__}")
    if gid:
        try:
            ipaddress.IPv6Address(gid)
        except ValueError:
            raise ProtocolError(f"rdma connect: gid {gid[:64]!r} is not a GID") from None
    out["gid"] = gid
    ll = body.get("link_layer")
    if ll != link_layer:
        raise ProtocolError(f"rdma connect: the peer's link layer is {str(ll)[:32]!r}, this port's {link_layer!r}")
    out["link_layer"] = ll
    if ll == "Ethernet" and not gid:
        raise ProtocolError("rdma connect: a RoCE peer must send its GID")
    if ll == "InfiniBand" and not out["lid"] and (not gid or gid.lower().startswith("fe80:")):
        raise ProtocolError("rdma connect: an InfiniBand peer without a LID needs a routable GID")
    if "conn" in body:
        out["conn"] = _int(body, "conn", 0, (1 << 63) - 1)
    return out
