"""A batch of Requests is planned run by run: ``_fastlane.c``'s scan finds each run (issue 28).

``Planning._plan`` cuts a batch into its maximal runs of consecutive requests sharing op, local,
remote, timeout and route objects without notify: the scan reads the requests' slots
(``Request.FIELDS``) from a start index on, in one C pass, and copies their integers into the
engine's arrays. A request it stops at (a subclass, another object, a notify, a length of None,
an integer that is not an exact int64) is planned alone, in Python, with the same checks. These
tests hold the two to that: the same outcome for any batch, and the engine's own copies of the
integers (a caller changing its requests later moves nothing else).
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

SIZE = 64 << 10


def native() -> Any:
    return fastlane_c("scan")


def _scan(reqs: list[Any], start: int = 0) -> tuple[int, list[int], list[int], list[int]]:
    n = len(reqs)
    lo, ro, ln = array("q", bytes(8 * n)), array("q", bytes(8 * n)), array("q", bytes(8 * n))
    j = native()(reqs, start, Request, Request.FIELDS, lo, ro, ln)
    assert not any(lo[:start]) and not any(ln[j:])  # only the run's own entries are written
    return j, list(lo[start:j]), list(ro[start:j]), list(ln[start:j])


class _Sub(Request):
    __slots__ = ()


def test_the_scan_copies_a_run_and_stops_at_the_first_request_of_another_group() -> None:
    a, b, r = object(), object(), object()
    reqs = [Request("write", a, r, 8 * i, 8, local_offset=-i) for i in range(5)]
    assert _scan(reqs) == (5, [0, -1, -2, -3, -4], [0, 8, 16, 24, 32], [8] * 5)
    assert _scan(reqs, 3) == (5, [-3, -4], [24, 32], [8] * 2)
    assert _scan(reqs, 5) == (5, [], [], [])
    assert _scan(reqs[:0]) == (0, [], [], [])
    assert _scan(tuple(reqs))[0] == 5
    edges = [Request("write", a, r, I64, -I64 - 1, local_offset=I64)]
    assert _scan(edges) == (1, [I64], [I64], [-I64 - 1])
    np = pytest.importorskip("numpy")
    # (a request the run of reqs stops at, whether the scan plans it alone: it starts no run itself)
    stops = [(Request("write", b, r, 0, 8), False), (Request("read", a, r, 0, 8), False),
             (Request("write", a, object(), 0, 8), False), (Request("write", a, r, 0, 8, timeout=1.0), False),
             (Request("write", a, r, 0, 8, route="shm"), False), (Request("write", a, r, 0, None), True),
             (Request("write", a, r, 0, True), True), (Request("write", a, r, 1 << 63, 8), True),
             (Request("write", a, r, 0, 8, local_offset=np.int64(0)), True),
             (Request("write", a, r, 0, 8, notify=b"x"), True), (_Sub("write", a, r, 0, 8), True), ((1, 2), True)]
    for bad, alone in stops:
        batch = reqs[:2] + [bad] + reqs[2:]
        assert _scan(batch)[0] == 2 and _scan(batch, 1)[0] == 2, bad
        assert _scan(batch, 2)[0] == (2 if alone else 3), bad
        assert _scan(batch, 3) == (6, [-2, -3, -4], [16, 24, 32], [8] * 3), bad


def test_the_scan_refuses_arrays_it_cannot_fill_and_descriptors_of_another_type() -> None:
    scan = native()
    reqs = [Request("write", 1, 2, 0, 8)] * 3
    q = array("q", bytes(24))
    with pytest.raises(TypeError):
        scan(reqs, 0, Request, Request.FIELDS, q, q, array("q", bytes(16)))  # too short
    with pytest.raises(TypeError):
        scan(reqs, 0, Request, Request.FIELDS, q, q, array("i", bytes(24)))  # not int64
    with pytest.raises(BufferError):
        scan(reqs, 0, Request, Request.FIELDS, q, q, bytes(24))  # read-only
    with pytest.raises(TypeError):
        scan(reqs, 0, _Sub, Request.FIELDS, q, q, q)  # the descriptors are Request's
    with pytest.raises(TypeError):
        scan(reqs, 0, Request, Request.FIELDS[:-1], q, q, q)
    for start in (-1, 1.0, None, 1 << 70):
        with pytest.raises((TypeError, OverflowError)):
            scan(reqs, start, Request, Request.FIELDS, q, q, q)
    with pytest.raises(TypeError):
        scan(deque(reqs), 0, Request, Request.FIELDS, q, q, q)  # planning hands it a list


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


def _outcome(p: Pair, reqs: list[Any]) -> Any:
    p.dst.view[:] = bytes(SIZE)
    try:
        batch = p.initiator.submit(reqs, timeout=10)
    except Exception as exc:  # noqa: BLE001 - compared below
        return type(exc), str(exc), getattr(exc, "request", None) is not None and reqs.index(exc.request)
    try:
        got = batch.result(timeout=10)
    except Exception as exc:  # noqa: BLE001
        return type(exc), str(exc), bytes(p.dst.view)
    return got, batch.bytes_per_request, bytes(p.dst.view)


OFFS = st.sampled_from([0, 8, 4096, SIZE - 8, SIZE, SIZE + 1, -1, I64, 1 << 63])
LENS = st.sampled_from([8, 0, 4096, SIZE, SIZE + 1, -1, I64, None, True])


@settings(max_examples=120, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(rows=st.lists(st.tuples(st.sampled_from([0, 0, 0, 1]), OFFS, OFFS, LENS, st.sampled_from(["write", "read"]),
                               st.sampled_from([None, None, None, b"n"])), min_size=1, max_size=6),
       same=st.booleans())
def test_a_batch_ends_alike_planned_in_runs_or_request_by_request(pair: Pair, rows: list[Any], same: bool) -> None:
    """The same requests as plain Requests (the scan's runs) and as a subclass (each one planned
    alone, in Python): the same bytes, or the same error naming the same request."""
    if same:  # long runs: one local, one kind, good integers but for what was drawn
        rows = [(0, lo, ro, ln, "write", None) for _, lo, ro, ln, _, _ in rows]

    def make(cls: type) -> list[Any]:
        return [cls(kind, pair.src[k], pair.remote, ro, ln, local_offset=lo, notify=note)
                for k, lo, ro, ln, kind, note in rows]
    assert _outcome(pair, make(Request)) == _outcome(pair, make(_Sub))


def test_an_interleaved_batch_is_cut_into_runs_and_lands_every_request(pair: Pair) -> None:
    a, b = pair.src
    reqs = [Request("write", a if i % 2 == 0 else b, pair.remote, 64 * i, 64, local_offset=64 * i) for i in range(8)]
    reqs[4:4] = [Request("write", a, pair.remote, 4096, 8, notify=b"mid")]
    reqs += [Request("write", a, pair.remote, 8192 + 64 * i, 64, local_offset=64 * i) for i in range(4)]
    # Without the notify: nine groups, the last one the run of four.
    assert repr(pair.initiator.prepare(reqs[:4] + reqs[5:])) == "<PreparedBatch x12 in 9 group(s)>"
    pair.dst.view[:] = bytes(SIZE)
    batch = pair.initiator.submit(reqs, timeout=10)
    assert batch.result(timeout=10) == 12 * 64 + 8 and batch.bytes_per_request == [64] * 4 + [8] + [64] * 8
    for i in range(8):
        src = a if i % 2 == 0 else b
        assert bytes(pair.dst.view[64 * i:64 * (i + 1)]) == bytes(src.view[64 * i:64 * (i + 1)])
    assert bytes(pair.dst.view[8192:8192 + 256]) == bytes(a.view[:256])


def test_a_run_the_scan_does_not_take_is_still_one_group(pair: Pair) -> None:
    """numpy integers, a subclass, a length of None: read in Python, one group all the same (one
    lease, one queue_depth slot, as the contract says), and prepare() takes it."""
    np = pytest.importorskip("numpy")
    a = pair.src[0]
    reqs = [Request("write", a, pair.remote, np.int64(64 * i), np.int32(64), local_offset=np.uint16(64 * i))
            for i in range(4)] + [_Sub("write", a, pair.remote, 4096, None, local_offset=SIZE - 16)]
    prepared = pair.initiator.prepare(reqs)
    assert repr(prepared) == "<PreparedBatch x5 in 1 group(s)>"
    pair.dst.view[:] = bytes(SIZE)
    assert prepared.post().result(timeout=10) == 4 * 64 + 16
    assert bytes(pair.dst.view[:256]) == bytes(a.view[:256])
    assert bytes(pair.dst.view[4096:4096 + 16]) == bytes(a.view[SIZE - 16:])
    assert pair.initiator.submit(deque(reqs), timeout=10).result(timeout=10) == 4 * 64 + 16  # any sequence


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
