"""A batch of Requests that is one group is planned by ``_fastlane.c``'s scan (issue 28, speed).

``Planning._plan`` grouped every request in a Python loop: about 20 us of a 64 x 4 KiB
shm submit, more than its copies. The scan reads the requests' slots (``Request.FIELDS``)
in one C pass and copies their integers into the engine's arrays when the whole batch is
one group; anything else (a subclass, another object, a notify, a length of None, an
integer that is not an exact int64) ends its run and the loop plans the batch as before.
These tests hold the scan to that: the same outcome as the loop for any batch, and the
engine's own copies of the integers (a caller changing its requests later moves nothing
else).
"""

from __future__ import annotations

from array import array
from collections import deque
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from core_support import I64, fastlane_c

import mpcomm
from mpcomm import Request
from mpcomm.engine import planning

SIZE = 64 << 10


def native() -> Any:
    return fastlane_c("scan")


def _scan(reqs: list[Any]) -> tuple[int, list[int], list[int], list[int]]:
    n = len(reqs)
    lo, ro, ln = array("q", bytes(8 * n)), array("q", bytes(8 * n)), array("q", bytes(8 * n))
    j = native()(reqs, Request, Request.FIELDS, lo, ro, ln)
    return j, list(lo[:j]), list(ro[:j]), list(ln[:j])


class _Sub(Request):
    __slots__ = ()


def test_the_scan_copies_a_uniform_batch_and_stops_at_the_first_request_the_loop_must_plan() -> None:
    a, b, r = object(), object(), object()
    reqs = [Request("write", a, r, 8 * i, 8, local_offset=-i) for i in range(5)]
    assert _scan(reqs) == (5, [0, -1, -2, -3, -4], [0, 8, 16, 24, 32], [8] * 5)
    assert _scan(reqs[:0]) == (0, [], [], [])
    assert _scan(tuple(reqs))[0] == 5
    edges = [Request("write", a, r, I64, -I64 - 1, local_offset=I64)]
    assert _scan(edges) == (1, [I64], [I64], [-I64 - 1])
    np = pytest.importorskip("numpy")
    for bad in (Request("write", b, r, 0, 8), Request("read", a, r, 0, 8), Request("write", a, object(), 0, 8),
                Request("write", a, r, 0, None), Request("write", a, r, 0, True), Request("write", a, r, 1 << 63, 8),
                Request("write", a, r, 0, 8, local_offset=np.int64(0)), Request("write", a, r, 0, 8, notify=b"x"),
                Request("write", a, r, 0, 8, timeout=1.0), Request("write", a, r, 0, 8, route="shm"),
                _Sub("write", a, r, 0, 8), (1, 2)):
        assert _scan(reqs[:2] + [bad] + reqs[2:])[0] == 2, bad
    assert _scan(deque(reqs))[0] == 0  # neither a list nor a tuple: the loop


def test_the_scan_refuses_arrays_it_cannot_fill_and_descriptors_of_another_type() -> None:
    scan = native()
    reqs = [Request("write", 1, 2, 0, 8)] * 3
    q = array("q", bytes(24))
    with pytest.raises(TypeError):
        scan(reqs, Request, Request.FIELDS, q, q, array("q", bytes(16)))  # too short
    with pytest.raises(TypeError):
        scan(reqs, Request, Request.FIELDS, q, q, array("i", bytes(24)))  # not int64
    with pytest.raises(BufferError):
        scan(reqs, Request, Request.FIELDS, q, q, bytes(24))  # read-only
    with pytest.raises(TypeError):
        scan(reqs, _Sub, Request.FIELDS, q, q, q)  # the descriptors are Request's
    with pytest.raises(TypeError):
        scan(reqs, Request, Request.FIELDS[:-1], q, q, q)


class Pair:
    def __init__(self) -> None:
        self.target = mpcomm.Engine(transports=["shm"])
        self.initiator = mpcomm.Engine(transports=["shm"])
        self.dst = self.target.allocate(SIZE, name="kv")
        self.remote = self.initiator.open(self.target.address, "kv")
        self.src = [self.initiator.allocate(SIZE) for _ in range(2)]
        for k, r in enumerate(self.src):
            r.view[:] = bytes((i + 7 * k) % 251 for i in range(SIZE))

    def close(self) -> None:
        self.initiator.close()
        self.target.close()


@pytest.fixture(scope="module")
def pair() -> Iterator[Pair]:
    p = Pair()
    yield p
    p.close()


def _outcome(p: Pair, reqs: list[Any], scan: bool, monkeypatch: pytest.MonkeyPatch) -> Any:
    p.dst.view[:] = bytes(SIZE)
    with monkeypatch.context() as m:
        if not scan:
            m.setattr(planning, "_scan", False)
        try:
            batch = p.initiator.submit(reqs, timeout=10)
        except Exception as exc:  # noqa: BLE001 - compared below
            return type(exc), str(exc)
    try:
        got = batch.result(timeout=10)
    except Exception as exc:  # noqa: BLE001
        return type(exc), str(exc), bytes(p.dst.view)
    return got, bytes(p.dst.view)


OFFS = st.sampled_from([0, 8, 4096, SIZE - 8, SIZE, SIZE + 1, -1, I64, 1 << 63])
LENS = st.sampled_from([8, 0, 4096, SIZE, SIZE + 1, -1, I64, None, True])


@settings(max_examples=120, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(rows=st.lists(st.tuples(st.sampled_from([0, 0, 0, 1]), OFFS, OFFS, LENS, st.sampled_from(["write", "read"])),
                     min_size=1, max_size=5), same=st.booleans())
def test_a_batch_ends_alike_planned_by_the_scan_or_by_the_loop(pair: Pair, rows: list[Any], same: bool,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    if same:  # the scan's case: one local, one kind, good integers but for what was drawn
        rows = [(0, lo, ro, ln, "write") for _, lo, ro, ln, _ in rows]
    reqs = [Request(kind, pair.src[k], pair.remote, ro, ln, local_offset=lo) for k, lo, ro, ln, kind in rows]
    assert _outcome(pair, reqs, True, monkeypatch) == _outcome(pair, reqs, False, monkeypatch)


def test_a_uniform_batch_moves_what_was_submitted_whatever_its_requests_become(pair: Pair) -> None:
    native()
    src = pair.src[0]
    reqs = [Request("write", src, pair.remote, 4096 * i, 4096, local_offset=4096 * i) for i in range(8)]
    pair.dst.view[:] = bytes(SIZE)
    batch = pair.initiator.submit(reqs, post=False)
    prepared = pair.initiator.prepare(reqs)
    for r in reqs:  # what a caller may do once submit() returned: the engine holds its own copies
        r.remote_offset, r.local_offset, r.length = SIZE - 8, 1 << 40, SIZE
    pair.initiator.post(batch).result(timeout=10)
    assert bytes(pair.dst.view[:8 * 4096]) == bytes(src.view[:8 * 4096])
    assert bytes(pair.dst.view[8 * 4096:]) == bytes(SIZE - 8 * 4096)
    pair.dst.view[:] = bytes(SIZE)
    prepared.post().result(timeout=10)
    assert bytes(pair.dst.view[:8 * 4096]) == bytes(src.view[:8 * 4096])
