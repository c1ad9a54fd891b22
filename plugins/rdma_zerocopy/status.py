"""``ibv_wc_status`` → mpcomm error: the one table, and the function that applies it.

Pure Python (no pyverbs): the numeric codes are libibverbs' ABI
(``enum ibv_wc_status`` in ``infiniband/verbs.h``), stable since the first
release, so this module can be imported and tested on a machine without
rdma-core. ``tests/rdma`` checks the names and numbers against pyverbs'
own enum wherever pyverbs is importable.

Every completion with an error status except ``IBV_WC_WR_FLUSH_ERR`` moves an
RC QP into the error state, after which every later work request on it
completes with ``IBV_WC_WR_FLUSH_ERR``. A flush is therefore never the cause:
the transport reposts flushed chunks of unrelated operations on a fresh QP,
and only reports it when a chunk is flushed again and again.
"""

from __future__ import annotations

from typing import Any

from mpcomm.errors import (
    MpcommError,
    OutOfBoundsError,
    PeerConnectionError,
    PermissionDeniedError,
    ProtocolError,
    RegionError,
    TransferError,
)

__all__ = ["WC_STATUS", "WC_ERRORS", "FLUSH", "SUCCESS", "status_name", "wc_error"]

#: ``enum ibv_wc_status`` (libibverbs ABI).
WC_STATUS: dict[str, int] = {
    "IBV_WC_SUCCESS": 0,
    "IBV_WC_LOC_LEN_ERR": 1,
    "IBV_WC_LOC_QP_OP_ERR": 2,
    "IBV_WC_LOC_EEC_OP_ERR": 3,
    "IBV_WC_LOC_PROT_ERR": 4,
    "IBV_WC_WR_FLUSH_ERR": 5,
    "IBV_WC_MW_BIND_ERR": 6,
    "IBV_WC_BAD_RESP_ERR": 7,
    "IBV_WC_LOC_ACCESS_ERR": 8,
    "IBV_WC_REM_INV_REQ_ERR": 9,
    "IBV_WC_REM_ACCESS_ERR": 10,
    "IBV_WC_REM_OP_ERR": 11,
    "IBV_WC_RETRY_EXC_ERR": 12,
    "IBV_WC_RNR_RETRY_EXC_ERR": 13,
    "IBV_WC_LOC_RDD_VIOL_ERR": 14,
    "IBV_WC_REM_INV_RD_REQ_ERR": 15,
    "IBV_WC_REM_ABORT_ERR": 16,
    "IBV_WC_INV_EECN_ERR": 17,
    "IBV_WC_INV_EEC_STATE_ERR": 18,
    "IBV_WC_FATAL_ERR": 19,
    "IBV_WC_RESP_TIMEOUT_ERR": 20,
    "IBV_WC_GENERAL_ERR": 21,
    "IBV_WC_TM_ERR": 22,
    "IBV_WC_TM_RNDV_INCOMPLETE": 23,
}
_NAMES = {v: k for k, v in WC_STATUS.items()}

SUCCESS = WC_STATUS["IBV_WC_SUCCESS"]
FLUSH = WC_STATUS["IBV_WC_WR_FLUSH_ERR"]

#: status → (error class, what it means for the caller, retryable override or None).
#: REM_ACCESS_ERR is refined by :func:`wc_error`: OutOfBoundsError when the
#: range lies outside the registration the peer published, else PermissionDeniedError.
WC_ERRORS: dict[int, tuple[type[MpcommError], str, bool | None]] = {
    WC_STATUS["IBV_WC_LOC_LEN_ERR"]: (TransferError, "local length error (work request larger than the device allows)", False),
    WC_STATUS["IBV_WC_LOC_QP_OP_ERR"]: (TransferError, "local QP operation error (the QP was not ready for this request)", True),
    WC_STATUS["IBV_WC_LOC_EEC_OP_ERR"]: (TransferError, "local EE context operation error", False),
    WC_STATUS["IBV_WC_LOC_PROT_ERR"]: (RegionError, "local protection error: the local buffer is not (or no longer) registered", False),
    WC_STATUS["IBV_WC_WR_FLUSH_ERR"]: (PeerConnectionError, "work request flushed: the queue pair went into the error state", True),
    WC_STATUS["IBV_WC_MW_BIND_ERR"]: (TransferError, "memory window bind error", False),
    WC_STATUS["IBV_WC_BAD_RESP_ERR"]: (ProtocolError, "unexpected transport-layer response from the peer's adapter", False),
    WC_STATUS["IBV_WC_LOC_ACCESS_ERR"]: (PermissionDeniedError, "local access error: the local registration does not allow this access", False),
    WC_STATUS["IBV_WC_REM_INV_REQ_ERR"]: (PermissionDeniedError, "remote invalid request: the peer's QP does not allow this operation or length", False),
    WC_STATUS["IBV_WC_REM_ACCESS_ERR"]: (PermissionDeniedError, "remote access error: the rkey is invalid (region unregistered or re-registered) or does not allow this access", False),
    WC_STATUS["IBV_WC_REM_OP_ERR"]: (TransferError, "remote operation error: the peer's adapter could not complete the request", False),
    WC_STATUS["IBV_WC_RETRY_EXC_ERR"]: (PeerConnectionError, "transport retry counter exceeded: the peer does not answer (down, unreachable, or its QP is gone)", True),
    WC_STATUS["IBV_WC_RNR_RETRY_EXC_ERR"]: (PeerConnectionError, "receiver-not-ready retry counter exceeded", True),
    WC_STATUS["IBV_WC_LOC_RDD_VIOL_ERR"]: (TransferError, "local RDD violation", False),
    WC_STATUS["IBV_WC_REM_INV_RD_REQ_ERR"]: (TransferError, "remote invalid RD request", False),
    WC_STATUS["IBV_WC_REM_ABORT_ERR"]: (PeerConnectionError, "the peer aborted the operation", True),
    WC_STATUS["IBV_WC_INV_EECN_ERR"]: (TransferError, "invalid EE context number", False),
    WC_STATUS["IBV_WC_INV_EEC_STATE_ERR"]: (TransferError, "invalid EE context state", False),
    WC_STATUS["IBV_WC_FATAL_ERR"]: (TransferError, "fatal adapter error", False),
    WC_STATUS["IBV_WC_RESP_TIMEOUT_ERR"]: (PeerConnectionError, "response timeout", True),
    WC_STATUS["IBV_WC_GENERAL_ERR"]: (TransferError, "general adapter error", None),
    WC_STATUS["IBV_WC_TM_ERR"]: (TransferError, "tag matching error", False),
    WC_STATUS["IBV_WC_TM_RNDV_INCOMPLETE"]: (TransferError, "tag matching rendezvous incomplete", False),
}


def status_name(status: int) -> str:
    return _NAMES.get(status, f"ibv_wc_status({status})")


def wc_error(status: int, vendor_err: int = 0, *, op: Any = None, info: dict[str, Any] | None = None) -> MpcommError:
    """The mpcomm error for a failed work completion.

    ``op`` (an :class:`~mpcomm.Operation`) and ``info`` (the peer's published
    registration, ``{"rkey", "addr", "length"}``) sharpen the result and fill
    ``.peer`` / ``.region``.
    """
    cls, meaning, retryable = WC_ERRORS.get(status, (TransferError, "unknown completion status", None))
    peer = getattr(getattr(op, "remote", None), "address", None)
    region = getattr(getattr(op, "remote", None), "name", None)
    if status == WC_STATUS["IBV_WC_REM_ACCESS_ERR"] and op is not None and info is not None:
        registered = int(info.get("length", -1))
        if registered >= 0 and op.remote_offset + op.length > registered:
            cls, meaning = OutOfBoundsError, (
                f"remote access error: [{op.remote_offset}, {op.remote_offset + op.length}) is outside "
                f"the {registered} registered bytes"
            )
    what = f"rdma {op.kind} " if op is not None else "rdma "
    where = f" ({peer}, region {region!r})" if peer else ""
    msg = f"{what}failed: {meaning}{where} [{status_name(status)}, vendor_err={vendor_err:#x}]"
    return cls(msg, retryable=retryable, peer=peer, region=region)
