"""The ibv_wc_status → mpcomm error table."""

from __future__ import annotations

import types

import pytest

from mpcomm.errors import (
    MpcommError,
    OutOfBoundsError,
    PeerConnectionError,
    PermissionDeniedError,
    RegionError,
    TransferError,
)
from mpcomm.plugins.rdma_zerocopy import verbs
from mpcomm.plugins.rdma_zerocopy.status import FLUSH, SUCCESS, WC_ERRORS, WC_STATUS, status_name, wc_error


def test_every_error_status_has_an_entry() -> None:
    assert set(WC_ERRORS) == set(WC_STATUS.values()) - {SUCCESS}
    for cls, meaning, _retry in WC_ERRORS.values():
        assert issubclass(cls, MpcommError) and meaning


def test_codes_match_pyverbs() -> None:
    try:
        verbs.load_pyverbs()
    except verbs.PyverbsMissing as exc:
        pytest.skip(f"pyverbs not loadable: {exc}")
    import pyverbs.enums as e

    assert {m.name: int(m.value) for m in e.ibv_wc_status} == WC_STATUS


@pytest.mark.parametrize(
    ("name", "cls"),
    [
        ("IBV_WC_REM_ACCESS_ERR", PermissionDeniedError),
        ("IBV_WC_REM_INV_REQ_ERR", PermissionDeniedError),
        ("IBV_WC_RETRY_EXC_ERR", PeerConnectionError),
        ("IBV_WC_RNR_RETRY_EXC_ERR", PeerConnectionError),
        ("IBV_WC_WR_FLUSH_ERR", PeerConnectionError),
        ("IBV_WC_LOC_PROT_ERR", RegionError),
        ("IBV_WC_LOC_ACCESS_ERR", PermissionDeniedError),
        ("IBV_WC_REM_OP_ERR", TransferError),
        ("IBV_WC_FATAL_ERR", TransferError),
    ],
)
def test_mapping(name: str, cls: type) -> None:
    err = wc_error(WC_STATUS[name], 0x32)
    assert type(err) is cls
    assert name in str(err) and "vendor_err=0x32" in str(err)


def test_retry_exceeded_is_a_retryable_connection_error() -> None:
    err = wc_error(WC_STATUS["IBV_WC_RETRY_EXC_ERR"])
    assert isinstance(err, ConnectionError) and err.retryable
    assert wc_error(FLUSH).retryable
    assert not wc_error(WC_STATUS["IBV_WC_REM_ACCESS_ERR"]).retryable


def test_remote_access_error_is_refined_by_the_published_length() -> None:
    remote = types.SimpleNamespace(address="10.0.0.2:18400", name="kv")
    op = types.SimpleNamespace(kind="write", remote=remote, remote_offset=4096, length=8192)
    inside = wc_error(WC_STATUS["IBV_WC_REM_ACCESS_ERR"], op=op, info={"length": 1 << 20})
    outside = wc_error(WC_STATUS["IBV_WC_REM_ACCESS_ERR"], op=op, info={"length": 8192})
    assert type(inside) is PermissionDeniedError and type(outside) is OutOfBoundsError
    assert outside.peer == "10.0.0.2:18400" and outside.region == "kv"
    assert "rdma write" in str(outside)


def test_unknown_status() -> None:
    assert status_name(99) == "ibv_wc_status(99)"
    assert type(wc_error(99)) is TransferError
