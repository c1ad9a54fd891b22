"""The ucx helper (_ucxloop.c) driven with stand-in UCX functions: the general path's group loop
(merging, statuses) and the fast path's one entry, a bound lane's move (bounds, gates, flush, answers)."""

from __future__ import annotations

import ctypes as C
from array import array
from typing import Any

import pytest

from ucx_support import ERR_IO, FREE, PROGRESS, RMA, StandInLane, ucx_pair

from mpcomm.plugins.ucx import _native


@pytest.fixture(scope="module")
def lib() -> Any:
    lib = _native.load()
    if lib is None:
        pytest.skip(f"the ucx helper is not built here: {_native.reason}")
    return lib


def _run(lib: Any, loff: list[int], roff: list[int], lens: list[int], merge: int, lsize: int = 1 << 40,
         rsize: int = 1 << 40,
         refuse_at: int | None = None) -> tuple[list[tuple[int, int, int]], list[int], int]:
    calls: list[tuple[int, int, int]] = []

    def rma(ep: int, laddr: int, n: int, raddr: int, rkey: int, param: int) -> int:
        calls.append((laddr, n, raddr))
        if refuse_at is not None and len(calls) - 1 == refuse_at:
            return ERR_IO & 0xFFFFFFFFFFFFFFFF
        return 0

    keep = (RMA(rma), FREE(lambda r: None), PROGRESS(lambda w: 0))
    n = len(lens)
    status = (C.c_int8 * n)()
    arr = C.c_int64 * n
    lo, ro, ln = array("q", loff), array("q", roff), array("q", lens)
    refused = lib.mpcomm_ucx_rma_many(C.cast(keep[0], C.c_void_p), C.cast(keep[1], C.c_void_p),
                                      C.cast(keep[2], C.c_void_p), None, None, arr.from_buffer(lo), 1000, lsize,
                                      arr.from_buffer(ro), 5000, rsize, arr.from_buffer(ln), n, None, None, status,
                                      merge)
    return calls, list(status), refused


def test_adjacent_pieces_go_as_one_operation(lib: Any) -> None:
    calls, status, refused = _run(lib, [0, 10, 20, 40], [0, 10, 20, 30], [10, 10, 10, 5], merge=1 << 20)
    # 0..30 continues on both sides; the fourth piece jumps locally (40 != 30): its own put.
    assert calls == [(1000, 30, 5000), (1040, 5, 5030)]
    assert status == [0, 0, 0, 0] and refused == 0


def test_merge_respects_its_limit_and_zero_disables_it(lib: Any) -> None:
    calls, _, _ = _run(lib, [0, 10, 20], [0, 10, 20], [10, 10, 10], merge=20)
    assert calls == [(1000, 20, 5000), (1020, 10, 5020)]
    calls, _, _ = _run(lib, [0, 10, 20], [0, 10, 20], [10, 10, 10], merge=0)
    assert calls == [(1000, 10, 5000), (1010, 10, 5010), (1020, 10, 5020)]


def test_a_refused_merged_operation_marks_every_piece_it_covered(lib: Any) -> None:
    calls, status, refused = _run(lib, [0, 10, 20, 100], [0, 10, 20, 100], [10, 10, 10, 10], merge=1 << 20,
                                  refuse_at=0)
    assert calls == [(1000, 30, 5000), (1100, 10, 5100)]
    assert status == [ERR_IO, ERR_IO, ERR_IO, 0] and refused == 3


def test_adjacent_batch_lands_whole_through_real_ucx() -> None:
    """A contiguous 64 x 4 KiB write_many/read_many (merged into one put/get) lands byte for byte."""
    with ucx_pair() as (target, ini, kv, remote, src):
        n, size = 64, 4096
        src.view[: n * size] = bytes(range(256)) * (n * size // 256)
        lo = [i * size for i in range(n)]
        ro = [8192 + i * size for i in range(n)]
        b = ini.write_many(src, remote, lo, ro, [size] * n)
        assert b.result(10) == n * size and b.bytes_per_request == [size] * n
        assert bytes(kv.view[8192:8192 + n * size]) == bytes(src.view[: n * size])
        assert bytes(kv.view[:8192]) == bytes(8192)  # nothing before the first piece
        back = ini.read_many(src, remote, [(512 << 10) + x for x in lo], ro, [size] * n)
        assert back.result(10) == n * size
        assert bytes(src.view[512 << 10:(512 << 10) + n * size]) == bytes(src.view[: n * size])


def test_a_group_to_an_attached_region_goes_in_one_native_call_and_lands() -> None:
    """post_many's hot path: once the region is attached, each write_many/submit group is issued
    and flushed in one native call (and, on a local-copy lane, reported inside it), byte for byte."""
    import mpcomm

    if _native.module() is None:
        pytest.skip(f"no extension module for the ucx helper: {_native.reason}")
    with ucx_pair() as (target, ini, kv, remote, src):
        t = ini.transports["ucx"]
        n, size = 64, 4096
        lo = [i * size for i in range(n)]
        ini.write_many(src, remote, lo, lo, [size] * n).result(10)  # attaches the region
        before = t.hot_groups
        for k in range(3):
            src.view[: n * size] = bytes([k + 1]) * (n * size)
            ro = [8192 + i * (size + 8) for i in range(n)]  # gaps: one put per piece
            assert ini.write_many(src, remote, lo, ro, [size] * n).result(10) == n * size
            assert all(bytes(kv.view[r:r + size]) == bytes([k + 1]) * size for r in ro)
            reqs = [mpcomm.Request("read", src, remote, r, size, local_offset=(512 << 10) + i * size)
                    for i, r in enumerate(ro)]
            assert ini.submit(reqs).result(10) == n * size
            assert bytes(src.view[512 << 10:(512 << 10) + n * size]) == bytes([k + 1]) * (n * size)
        assert t.hot_groups - before == 6


def test_a_failed_flush_status_is_read_as_the_signed_byte_it_is() -> None:
    """A flush that ends in UCS_ERR_IO_ERROR (-3) is reported as -3, freed, and never as in flight."""
    s = StandInLane(flush_request=0x2000, status=ERR_IO)
    assert s.raw(0, 0, 64) == (ERR_IO, 0, None)
    assert "free 0x2000" in s.log


def test_the_last_operation_failing_where_it_is_settled_fails_its_pieces() -> None:
    """The lane settles the last operation UCX left in flight (a single request's only one); one
    that ends in failure fails the pieces it covered, and a request of which nothing landed sends
    no flush."""
    s = StandInLane(request=0x1000, status=ERR_IO, flush_request=0x2000)
    assert s.raw(0, 0, 64) == (0, 0, bytes([ERR_IO & 0xFF])) and s.flushes == 0
    assert s.log == ["put", "check 0x1000", "free 0x1000"]
    g = StandInLane(request=0x1000, status=ERR_IO, flush_request=0)
    code, _pending, statuses = g.raw(array("q", [0, 100]), array("q", [0, 100]), array("q", [10, 10]))
    assert code == 0 and _signed(statuses) == [0, ERR_IO] and g.flushes == 1  # the first: left to the flush


def test_a_bound_lane_issues_within_its_bounds_only() -> None:
    s = StandInLane(limit=2048)
    assert s.move(100, 200, 64) is True
    assert s.puts() == [(100, 64, 200)] and s.in_flight_seen == [1]
    for lo, ro, n in ((0, 0, 0), (0, 0, -1), (0, 0, 4096), (0, 3000, 2000), (-1, 0, 8), (0, -1, 8),
                      (8190, 0, 8), (1 << 62, 0, 1 << 62), (1 << 63, 0, 8), (0, 0, (1 << 64) - 1)):
        assert s.move(lo, ro, n) is False, (lo, ro, n)  # over the limit, or outside a region
    assert len(s.issued) == 1 and s.ep_gate[1] == 0
    with pytest.raises(TypeError):
        s.move(0, 0)


def test_a_shut_gate_stops_the_lane_before_it_issues() -> None:
    s = StandInLane()
    s.att_gate[0] = 0
    assert s.move(0, 0, 64) is False
    s.att_gate[0] = 1
    s.ep_gate[0] = 0
    assert s.move(0, 0, 64) is False
    assert s.raw(array("q", [0]), array("q", [0]), array("q", [64])) is False
    assert s.issued == [] and s.ep_gate[1] == 0  # nothing issued, nothing counted in flight


def test_a_lane_request_left_in_flight_goes_to_on_pending() -> None:
    # still in flight after local progress: the put is released and its flush issued at once,
    # so what the lane leaves in flight is the flush (code 2)
    s = StandInLane(request=0x1000, status=1, flush_request=0x2000)
    assert s.move(0, 0, 64) is False  # on_pending's answer
    assert s.pending == [(2, 0x2000, None)] and s.ep_gate[1] == 0
    assert s.raw(0, 0, 64) == (2, 0x2000, None)


def test_a_lane_signals_the_progress_thread_only_while_it_has_work() -> None:
    s = StandInLane()
    assert s.move(0, 0, 64) is True and s.signals == 0
    s.active.add("work")
    assert s.move(0, 0, 64) is True and s.signals == 1


def test_a_piece_outside_its_region_is_never_issued(lib: Any) -> None:
    """The loop checks every piece where it issues it (issue 28): whatever the arrays hold, no put
    reaches outside either region; such a piece is refused as UCS_ERR_OUT_OF_RANGE (-19)."""
    top = (1 << 63) - 1
    calls, status, refused = _run(lib, [0, 10, top, 20, 0], [0, 10, 0, 20, 95], [10, 10, 8, 10, 10], merge=1 << 20,
                                  lsize=100, rsize=100)
    # pieces 0-1 merge; piece 2 wraps past 2**63 locally, piece 4 ends past the remote region
    assert calls == [(1000, 20, 5000), (1020, 10, 5020)]
    assert status == [0, 0, -19, 0, -19] and refused == 2
    # adjacent pieces whose second does not fit are not merged into the first
    calls, status, refused = _run(lib, [0, 10], [0, 10], [10, 91], merge=1 << 20, lsize=100, rsize=200)
    assert calls == [(1000, 10, 5000)] and status == [0, -19] and refused == 1


def _signed(statuses: bytes) -> list[int]:
    return [s - 256 if s > 127 else s for s in statuses]


def test_a_group_on_the_lane_checks_every_piece_where_it_issues_it_then_flushes_once() -> None:
    """The fast path's group: pieces outside either region are never issued (their statuses come
    back as UCS_ERR_OUT_OF_RANGE), the rest are merged and issued, then one flush settles them."""
    s = StandInLane(lsize=100, rsize=100, flush_request=0x2000)
    top = (1 << 63) - 1
    code, pending, statuses = s.raw(array("q", [0, 10, top, 20, 0]), array("q", [0, 10, 0, 20, 95]),
                                    array("q", [10, 10, 8, 10, 10]))
    assert s.puts() == [(0, 20, 0), (20, 10, 20)] and s.flushes == 1
    assert code == 0 and _signed(statuses) == [0, 0, -19, 0, -19]
    assert s.move(array("q", [0]), array("q", [0]), array("q", [10])) is True  # nothing refused


def test_a_group_on_the_lane_leaves_its_flush_in_flight_to_the_caller() -> None:
    s = StandInLane(flush_request=0x2000, status=1)  # UCS_INPROGRESS after local progress
    assert s.raw(array("q", [0]), array("q", [0]), array("q", [10])) == (2, 0x2000, None)
    failed = StandInLane(flush_request=0x2000, status=ERR_IO)
    assert failed.raw(array("q", [0]), array("q", [0]), array("q", [10])) == (ERR_IO, 0, None)


def test_a_group_on_the_lane_declines_what_it_would_not_finish_here_before_issuing_anything() -> None:
    s = StandInLane(lsize=100, rsize=100, limit=20)
    empty = array("q")
    assert s.raw(empty, empty, empty) is False
    assert s.raw(array("q", [0, 10]), array("q", [0, 10]), array("q", [10, 11])) is False
    # lengths whose sum wraps int64 are over any limit, not a small total
    big = StandInLane(limit=(1 << 63) - 1)
    assert big.raw(array("q", [0, 0]), array("q", [0, 0]), array("q", [(1 << 63) - 1, 2])) is False
    assert s.issued == [] and s.flushes == 0 and big.issued == []
    assert s.raw(array("q", [0, 10]), array("q", [0, 10]), array("q", [10, 10])) is True


def test_a_group_on_the_lane_takes_only_int64_arrays_of_one_length() -> None:
    s = StandInLane()
    with pytest.raises(TypeError):
        s.raw(array("i", [0]), array("q", [0]), array("q", [10]))
    with pytest.raises(TypeError):
        s.raw([0], array("q", [0]), array("q", [10]))
    with pytest.raises(ValueError):
        s.raw(array("q", [0, 10]), array("q", [0]), array("q", [10]))
    assert s.issued == [] and s.flushes == 0 and s.ep_gate[1] == 0
