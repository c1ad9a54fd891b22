"""A lost connection reported after a request's deadline is that request's timeout (core/transport.py).

The target enforces the initiator's deadline and drops the connection of a request that
outlived it; on a loaded machine that drop can reach the initiator before the engine's own
timer aborted the request. The caller must still see the timeout it asked for (and the
path must not be blamed), not the connection error the deadline caused.
"""

from __future__ import annotations

import time

from mpcomm import PeerConnectionError, TransferTimeout
from mpcomm.memory import Region
from mpcomm.remote import RemoteRegion
from mpcomm.transport import Operation, OperationGroup

REMOTE = RemoteRegion("127.0.0.1:1", "n", "e", "kv", 7, 1 << 20, 0, "rw", 1)


def _op(deadline: float, seen: list) -> Operation:
    local = Region(memoryview(bytearray(1 << 20)), name="src", access="rw")
    return Operation("write", local, 0, REMOTE, 0, 4096, deadline, time.time(),
                     sink=lambda op, err, n: seen.append(err))


def _group(deadline: float, seen: list) -> OperationGroup:
    local = Region(memoryview(bytearray(1 << 20)), name="src", access="rw")
    return OperationGroup("read", local, REMOTE, [0, 4096], [0, 4096], [4096, 4096], deadline, time.time(),
                          sink=lambda g: seen.append(dict(g.errors)))


def test_a_connection_lost_after_the_deadline_is_reported_as_the_confirmed_timeout() -> None:
    seen: list = []
    lost = PeerConnectionError("127.0.0.1:1 closed the data connection")
    _op(time.monotonic() - 0.001, seen).fail(lost)
    (err,) = seen
    assert isinstance(err, TransferTimeout) and err.confirmed is True
    assert err.__cause__ is lost


def test_an_unconfirmed_loss_after_the_deadline_is_an_unconfirmed_timeout() -> None:
    seen: list = []
    _op(time.monotonic() - 0.001, seen).fail(PeerConnectionError("cut"), confirmed=False)
    (err,) = seen
    assert isinstance(err, TransferTimeout) and err.confirmed is False


def test_a_connection_lost_before_the_deadline_stays_a_connection_error() -> None:
    seen: list = []
    lost = PeerConnectionError("127.0.0.1:1 closed the data connection")
    _op(time.monotonic() + 60, seen).fail(lost)
    assert seen == [lost]


def test_other_errors_after_the_deadline_are_left_as_they_are() -> None:
    from mpcomm import OutOfBoundsError

    seen: list = []
    refused = OutOfBoundsError("remote range refused", region="kv")
    _op(time.monotonic() - 0.001, seen).fail(refused)
    assert seen == [refused]


def test_a_group_after_its_deadline_reports_the_timeout_for_every_index() -> None:
    seen: list = []
    _group(time.monotonic() - 0.001, seen).fail(PeerConnectionError("cut"))
    (errors,) = seen
    assert sorted(errors) == [0, 1]
    assert all(isinstance(e, TransferTimeout) and e.confirmed is True for e in errors.values())
    seen.clear()
    _group(time.monotonic() + 60, seen).fail(PeerConnectionError("cut"))
    assert all(type(e) is PeerConnectionError for e in seen[0].values())
