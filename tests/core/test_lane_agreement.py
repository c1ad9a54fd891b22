"""Every request lane decides bounds as the one rule does (issue 28), at the int64 limits too.

A differential property test: hypothesis draws (kind, local_offset, remote_offset,
length) from the values where arithmetic goes wrong -- 0, ±1, 2**31, 2**32,
2**63-1, 2**63, 2**64-1, -2**63 and each region's size ±1 -- and drives the
same request through every lane:

* ``c``: a bound pair with the C inline step (``_fastlane.c``) in front of the one
  request path (for tcp, whose bindings have no move, the one path's posted step);
* ``python``: the same pair bound with ``MPCOMM_FASTLANE=0`` (the one path alone, with the binding);
* ``write_many`` / ``read_many``, ``submit``, and ``prepare_many`` + ``post()``;

across every transport available here: shm through a memfd mapping (the target's
region from ``allocate``) and through cross-memory attach (a registered
``bytearray``), tcp, and ucx when its plugin is available. Each must end as
:func:`mpcomm.engine.checks.span` says: the bytes moved (and they are the right
bytes), or ``OutOfBoundsError`` -- raised by the call or reported by the handle,
the same class either way. The engines live for the whole module; hypothesis is
derandomized and bounded so the module runs well under a minute.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import mpcomm
from mpcomm import Request
from mpcomm.engine import checks
from mpcomm.errors import OutOfBoundsError

LSIZE, RSIZE = 64 << 10, 32 << 10  # different, so a check of the wrong side shows


def _routes() -> list[str]:
    names = ["shm-memfd", "shm-cma", "tcp"]
    try:
        from mpcomm.plugins.ucx.transport import UcxTransport

        if UcxTransport.availability().available:
            names.append("ucx")
    except Exception:  # noqa: BLE001 - the ucx plugin is not importable here
        pass
    return names


class Setup:
    """A target and an initiator on one transport, with two bound pairs (C lane, Python lane)."""

    def __init__(self, route: str) -> None:
        transport = route.split("-")[0]
        self.target = mpcomm.Engine(transports=[transport])
        self.initiator = mpcomm.Engine(transports=[transport])
        if route == "shm-memfd":
            region = self.target.allocate(RSIZE, name="kv")
            self.dst = region.view
        else:
            self.dst = memoryview(bytearray(RSIZE))
            self.target.register(self.dst, name="kv")
        self.remote = self.initiator.open(self.target.address, "kv")
        self.src = {lane: self.initiator.allocate(LSIZE) for lane in ("c", "python", "batch")}
        pattern = bytes(i % 251 for i in range(LSIZE))
        for r in self.src.values():
            r.view[:] = pattern
        # Bind each pair: the first request lands through the full path or the inline lane
        # and binds; MPCOMM_FASTLANE is read at each binding.
        for lane, env in (("c", None), ("python", "0")):
            if env is not None:
                os.environ["MPCOMM_FASTLANE"] = env
            try:
                for _ in range(3):
                    self.initiator.write(self.src[lane], self.remote, 0, 8).result(timeout=10)
                    self.initiator.read(self.src[lane], self.remote, 0, 8).result(timeout=10)
            finally:
                os.environ.pop("MPCOMM_FASTLANE", None)

    def close(self) -> None:
        self.initiator.close()
        self.target.close()


@pytest.fixture(scope="module", params=_routes())
def setup(request: pytest.FixtureRequest) -> Iterator[Setup]:
    s = Setup(request.param)
    yield s
    s.close()


def _values(size: int) -> list[int]:
    return [size - 1, size, size + 1]


SPECIAL = [0, 1, -1, 8, 2**31, 2**32, 2**63 - 1, 2**63, 2**64 - 1, -(2**63)]
OFFSETS = st.sampled_from(sorted(set(SPECIAL + _values(LSIZE) + _values(RSIZE) + [RSIZE - 8, LSIZE - 8])))
LENGTHS = st.sampled_from(sorted(set(SPECIAL + _values(LSIZE) + _values(RSIZE) + [4096])))
LANES = ("c", "python", "many", "submit", "prepared")


def _run(s: Setup, lane: str, kind: str, lo: int, ro: int, n: int) -> Any:
    e, remote = s.initiator, s.remote
    src = s.src["batch" if lane in ("many", "submit", "prepared") else lane]
    if lane in ("c", "python"):
        if kind == "write":
            return e.write(src, remote, ro, n, local_offset=lo).result(timeout=10)
        return e.read(src, remote, ro, n, local_offset=lo).result(timeout=10)
    if lane == "many":
        many = e.write_many if kind == "write" else e.read_many
        return many(src, remote, [lo], [ro], [n]).result(timeout=10)
    if lane == "submit":
        return e.submit([Request(kind, src, remote, ro, n, lo)]).result(timeout=10)
    return e.prepare_many(kind, src, remote, [lo], [ro], [n]).post().result(timeout=10)


def _outcome(s: Setup, lane: str, kind: str, lo: int, ro: int, n: int) -> Any:
    try:
        got = _run(s, lane, kind, lo, ro, n)
    except Exception as exc:  # noqa: BLE001 - the class is the outcome
        return type(exc)
    src = s.src["batch" if lane in ("many", "submit", "prepared") else lane]
    # The bytes moved are the right ones: both ends agree on the range.
    assert bytes(src.view[lo : lo + n]) == bytes(s.dst[ro : ro + n]), (lane, kind, lo, ro, n)
    return ("moved", got)


@settings(max_examples=150, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(kind=st.sampled_from(["write", "read"]), lo=OFFSETS, ro=OFFSETS, n=LENGTHS)
def test_every_lane_decides_as_the_one_check(setup: Setup, kind: str, lo: int, ro: int, n: int) -> None:
    want = checks.span(lo, ro, n, LSIZE, RSIZE)
    expected = OutOfBoundsError if want is None else ("moved", want)
    got = {lane: _outcome(setup, lane, kind, lo, ro, n) for lane in LANES}
    assert got == dict.fromkeys(LANES, expected), (kind, lo, ro, n)


LIMITS = [(2**63 - 1, 0, 8), (0, 2**63 - 1, 8), (2**63 - 8, 2**63 - 8, 8), (0, 0, 2**63 - 1), (8, 0, 2**64 - 1),
          (2**64 - 1, 0, 8), (LSIZE, RSIZE, 0), (LSIZE + 1, 0, 0), (0, RSIZE + 1, 0), (RSIZE - 8, RSIZE - 8, 8),
          (-1, 0, 8), (0, -1, 8), (0, 0, -1), (2**32, 0, 8), (0, 2**31, 8)]


@pytest.mark.parametrize("lo,ro,n", LIMITS, ids=repr)
def test_the_lanes_agree_at_the_named_limits(setup: Setup, lo: int, ro: int, n: int) -> None:
    """The cases of the issue, every time (hypothesis samples; these are not left to chance)."""
    want = checks.span(lo, ro, n, LSIZE, RSIZE)
    expected = OutOfBoundsError if want is None else ("moved", want)
    for kind in ("write", "read"):
        got = {lane: _outcome(setup, lane, kind, lo, ro, n) for lane in LANES}
        assert got == dict.fromkeys(LANES, expected), (kind, lo, ro, n)


@pytest.mark.parametrize("off,n,size", [(0, 0, 0), (0, 1, 0), (1, 0, 0), (0, 8, 8), (1, 8, 8), (8, 0, 8),
                                        (9, 0, 8), (2**63 - 1, 1, 2**63 - 1), (2**63 - 2, 1, 2**63 - 1),
                                        (2**64 - 1, 1, 2**63), (-1, 1, 8), (0, -1, 8)])
def test_fits_is_the_unsigned_rule(off: int, n: int, size: int) -> None:
    """What the C mirrors compute (n <= size && off <= size - n, unsigned; negatives refused first)."""
    assert checks.fits(off, n, size) == (off >= 0 and n >= 0 and off + n <= size)


TIMEOUTS = [None, 5, 5.0, True, 0, 0.0, -1, float("nan"), float("inf"), float("-inf"), "1", 10**400]


@pytest.mark.parametrize("timeout", TIMEOUTS, ids=repr)
def test_every_lane_takes_or_refuses_a_timeout_alike(setup: Setup, timeout: Any) -> None:
    """The timeout half of the one rule (checks.timeout_seconds; _fastlane.c's bound lane declines
    what it would not take, so the full path raises it)."""
    try:
        checks.timeout_seconds(timeout, 30.0)
        expected: Any = ("moved", 8)
    except Exception as exc:  # noqa: BLE001 - the class is the outcome
        expected = type(exc)
    e, remote = setup.initiator, setup.remote
    calls = {
        "c": lambda: e.write(setup.src["c"], remote, 0, 8, timeout=timeout),
        "python": lambda: e.write(setup.src["python"], remote, 0, 8, timeout=timeout),
        "many": lambda: e.write_many(setup.src["batch"], remote, [0], [0], [8], timeout=timeout),
        "submit": lambda: e.submit([Request("write", setup.src["batch"], remote, 0, 8, 0, timeout=timeout)]),
        "prepared": lambda: e.prepare_many("write", setup.src["batch"], remote, [0], [0], [8], timeout=timeout).post(),
    }
    got = {}
    for lane, call in calls.items():
        try:
            got[lane] = ("moved", call().result(timeout=10))
        except Exception as exc:  # noqa: BLE001
            got[lane] = type(exc)
    assert got == dict.fromkeys(LANES, expected), timeout


@pytest.mark.parametrize("timeout", TIMEOUTS, ids=repr)
def test_the_timeout_rule_refuses_with_mpcomm_error(timeout: Any) -> None:
    ok = timeout is None or (not isinstance(timeout, str) and timeout < 10**300 and timeout > 0
                             and timeout != float("inf"))
    if ok:
        assert checks.timeout_seconds(timeout, 30.0) == (30.0 if timeout is None else timeout)
    else:
        with pytest.raises(mpcomm.MpcommError, match="timeout must be"):
            checks.timeout_seconds(timeout, 30.0)
