"""The error tree, retry hints, and the completeness of ``mpcomm.__all__``."""

from __future__ import annotations

import errno
import inspect

import pytest

import mpcomm
from mpcomm import errors
from mpcomm.errors import error_from_code, map_errors


def all_error_classes() -> list[type[mpcomm.MpcommError]]:
    return [c for _, c in inspect.getmembers(errors, inspect.isclass)
            if issubclass(c, mpcomm.MpcommError) and c.__module__ == errors.__name__]


def test_one_root() -> None:
    for cls in all_error_classes():
        assert issubclass(cls, mpcomm.MpcommError)


def test_timeout_is_a_builtin_timeout_error() -> None:
    assert issubclass(mpcomm.TransferTimeout, TimeoutError)
    assert issubclass(mpcomm.TransferTimeout, mpcomm.TransferError)
    with pytest.raises(TimeoutError):
        raise mpcomm.TransferTimeout("late")
    assert mpcomm.TransferTimeout("late").confirmed is True


def test_peer_connection_error_is_a_builtin_connection_error() -> None:
    assert issubclass(mpcomm.PeerConnectionError, ConnectionError)
    assert issubclass(mpcomm.PeerConnectionError, mpcomm.TransferError)
    with pytest.raises(ConnectionError):
        raise mpcomm.PeerConnectionError("gone")


@pytest.mark.parametrize("cls, parent", [
    (mpcomm.AlignmentError, mpcomm.RegionError),
    (mpcomm.RegionBusyError, mpcomm.RegionError),
    (mpcomm.RegionClosedError, mpcomm.RegionError),
    (mpcomm.UnknownRegionError, mpcomm.AccessError),
    (mpcomm.OutOfBoundsError, mpcomm.AccessError),
    (mpcomm.PermissionDeniedError, mpcomm.AccessError),
    (mpcomm.StaleRegionError, mpcomm.AccessError),
    (mpcomm.ProtocolError, mpcomm.TransferError),
    (mpcomm.AuthenticationError, mpcomm.TransferError),
    (mpcomm.BackPressureError, mpcomm.TransferError),
])
def test_tree(cls: type, parent: type) -> None:
    assert issubclass(cls, parent)


@pytest.mark.parametrize("cls, retryable", [
    (mpcomm.TransferTimeout, True),
    (mpcomm.PeerConnectionError, True),
    (mpcomm.BackPressureError, True),
    (mpcomm.StaleRegionError, True),
    (mpcomm.RegionBusyError, True),
    (mpcomm.ConfigError, False),
    (mpcomm.AuthenticationError, False),
    (mpcomm.ProtocolError, False),
    (mpcomm.OutOfBoundsError, False),
    (mpcomm.PermissionDeniedError, False),
    (mpcomm.UnknownRegionError, False),
    (mpcomm.EngineClosedError, False),
])
def test_retryable_flags(cls: type[mpcomm.MpcommError], retryable: bool) -> None:
    assert cls.retryable is retryable
    assert cls("x").retryable is retryable
    assert cls("x", retryable=not retryable).retryable is (not retryable)  # an instance may override


def test_errors_carry_what_they_concern() -> None:
    e = mpcomm.OutOfBoundsError("past the end", region="kv", peer="10.0.0.1:1")
    assert (e.region, e.peer, str(e)) == ("kv", "10.0.0.1:1", "past the end")


def test_wire_codes_are_unique_and_round_trip() -> None:
    classes = all_error_classes()
    codes = [c.code for c in classes]
    assert len(codes) == len(set(codes))
    for cls in classes:
        rebuilt = error_from_code(cls.code, "from a peer", peer="p")
        assert type(rebuilt) is cls
        assert rebuilt.peer == "p"
    assert type(error_from_code("no-such-code", "?")) is mpcomm.MpcommError


def test_module_docstring_draws_every_class() -> None:
    doc = errors.__doc__ or ""
    for cls in all_error_classes():
        assert cls.__name__ in doc, f"{cls.__name__} missing from the tree in mpcomm.errors"


def test_map_errors_maps_native_errors_and_chains_them() -> None:
    with pytest.raises(mpcomm.PeerConnectionError) as info:
        with map_errors("peer:1"):
            raise ConnectionRefusedError(errno.ECONNREFUSED, "refused")
    assert isinstance(info.value.__cause__, ConnectionRefusedError)
    assert info.value.peer == "peer:1"
    with pytest.raises(mpcomm.PeerConnectionError):
        with map_errors("peer:1"):
            raise OSError(errno.EPIPE, "broken pipe")
    with pytest.raises(mpcomm.TransferTimeout):
        with map_errors("peer:1"):
            raise TimeoutError("slow")
    with pytest.raises(mpcomm.TransferError) as info2:
        with map_errors("peer:1"):
            raise OSError(errno.ENOMEM, "no memory")
    assert type(info2.value) is mpcomm.TransferError
    with pytest.raises(mpcomm.OutOfBoundsError):  # mpcomm errors pass through untouched
        with map_errors("peer:1"):
            raise mpcomm.OutOfBoundsError("x")


def test_every_exported_name_exists() -> None:
    for name in mpcomm.__all__:
        assert hasattr(mpcomm, name), name


def test_all_is_sorted_and_unique() -> None:
    assert mpcomm.__all__ == sorted(mpcomm.__all__)
    assert len(mpcomm.__all__) == len(set(mpcomm.__all__))


def test_all_is_complete() -> None:
    public_errors = {
        name for name, obj in vars(mpcomm).items()
        if not name.startswith("_") and inspect.isclass(obj) and issubclass(obj, mpcomm.MpcommError)
    }
    assert public_errors - set(mpcomm.__all__) == set()
    # Every error class mpcomm.errors defines is reachable from the top level.
    assert {c.__name__ for c in all_error_classes()} <= set(mpcomm.__all__)
    # And errors.__all__ lists its own classes.
    assert {c.__name__ for c in all_error_classes()} <= set(errors.__all__)
