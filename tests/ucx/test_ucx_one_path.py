"""The ucx transport has one general path and one fast path (issue 28, items 3 and 5).

The fast path is one native entry, a bound lane's ``move`` (``mp_move`` in _ucxloop.c): the
engine's inline move of one request, ``post()`` of one request and ``post_many()`` of a group
all go through it, each request one call. Every range it moves is checked with the one bounds
rule (``mpcomm.engine.checks.fits``) against the lane's snapshot of both regions: the
differential tests below drive it at the int64 edges and require the rule's answer.
"""

from __future__ import annotations

from array import array
from itertools import product
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from ucx_support import StandInLane, ucx_pair

import mpcomm
from mpcomm.engine.checks import fits
from mpcomm.plugins.ucx import _native
from mpcomm.plugins.ucx.transport import UcxTransport
from mpcomm.testing.fixtures import make_engine  # noqa: F401 (fixture)

LSIZE, RSIZE = 8192, 4096  # different, so a check against the wrong region shows
TOP = (1 << 63) - 1
EDGES = sorted({0, 1, -1, 1 << 31, 1 << 32, TOP, (1 << 64) - 1, 1 << 63, -(1 << 63),
                LSIZE - 1, LSIZE, LSIZE + 1, RSIZE - 1, RSIZE, RSIZE + 1})
INT64 = [v for v in EDGES if -(1 << 63) <= v <= TOP]
OUT_OF_RANGE = -19


def _module() -> Any:
    mod = _native.module()
    if mod is None:
        pytest.skip(f"no extension module for the ucx helper: {_native.reason}")
    return mod


def test_the_helper_exposes_one_fast_path_entry() -> None:
    """One Python-facing entry (a lane's move) and no other call that moves bytes: the single-request
    and group calls of earlier versions are gone, from the module and from the ctypes library."""
    mod = _module()
    calls = sorted(n for n in dir(mod) if callable(getattr(mod, n)) and not n.startswith("_"))
    assert calls == ["lane", "moves"]
    lib = _native.load()
    for gone in ("mpcomm_ucx_rma_one",):
        with pytest.raises(AttributeError):
            getattr(lib, gone)
    for gone in ("_hot_ep", "_packed", "_packed_group"):
        assert not hasattr(UcxTransport, gone)


def _expect_single(lo: int, ro: int, n: int, limit: int) -> bool:
    return 0 < n <= limit and fits(lo, n, LSIZE) and fits(ro, n, RSIZE)


def test_a_single_move_agrees_with_the_one_check_at_every_edge() -> None:
    s = StandInLane(lsize=LSIZE, rsize=RSIZE, limit=TOP)
    for lo, ro, n in product(EDGES, EDGES, EDGES):
        before = len(s.issued)
        got = s.move(lo, ro, n)
        want = _expect_single(lo, ro, n, TOP)
        assert got is want, (lo, ro, n)
        assert s.puts()[before:] == ([(lo, n, ro)] if want else []), (lo, ro, n)
    assert s.ep_gate[1] == 0


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(INT64), st.sampled_from(INT64), st.sampled_from(INT64)), min_size=1,
                max_size=5), st.sampled_from([TOP, LSIZE]))
def test_a_group_move_agrees_with_the_one_check_piece_by_piece(pieces: list[tuple[int, int, int]],
                                                              limit: int) -> None:
    """A group: declined as a whole (nothing issued) when it has a negative length, no byte, or more
    than the lane's limit in all; else each piece is issued exactly when the one check passes on
    both sides, and refused alone (UCS_ERR_OUT_OF_RANGE) when it does not."""
    s = StandInLane(lsize=LSIZE, rsize=RSIZE, limit=limit, merge=0)  # merge 0: one put per piece
    lo, ro, ln = (array("q", [p[k] for p in pieces]) for k in range(3))
    got = s.raw(lo, ro, ln)
    total = sum(ln)
    if min(ln) < 0 or total == 0 or total > limit:
        assert got is False and s.issued == []
        return
    ok = [fits(a, n, LSIZE) and fits(b, n, RSIZE) for a, b, n in pieces]
    assert s.puts() == [(p[0], p[2], p[1]) for p, good in zip(pieces, ok) if good]
    if len(pieces) == 1 and not ok[0]:
        assert got is False  # a group of one that does not fit is declined, never refused
    elif all(ok):
        assert got is True
    else:
        code, _pending, statuses = got
        assert code == 0
        assert [x - 256 if x > 127 else x for x in statuses] == [0 if g else OUT_OF_RANGE for g in ok]
    assert s.ep_gate[1] == 0


def test_a_group_of_one_that_does_not_fit_is_declined() -> None:
    s = StandInLane(lsize=LSIZE, rsize=RSIZE, limit=TOP)
    for lo, ro, n in product(INT64, INT64, INT64):
        got = s.raw(array("q", [lo]), array("q", [ro]), array("q", [n]))
        assert got is _expect_single(lo, ro, n, TOP), (lo, ro, n)
    with pytest.raises(OverflowError):  # past int64 nothing reaches the entry as an array
        array("q", [1 << 63])


def test_single_requests_and_groups_go_through_the_same_entry_once_each() -> None:
    """Over real UCX: the engine's bound move, post() and post_many() each make one call of the
    one entry per request (or group), and the engine's bound move is the attachment's lane."""
    mod = _module()
    with ucx_pair() as (target, ini, kv, remote, src):
        ucx = ini.transports["ucx"]
        for _ in range(3):  # attach (general path), then the lane binds
            assert ini.write(src, remote, 0, 4096).result(10) == 4096

        def one_call(fn: Any) -> Any:
            before = mod.moves()
            got = fn()
            assert mod.moves() - before == 1, fn
            return got

        src.view[:4096] = b"\x11" * 4096
        assert one_call(lambda: ini.write(src, remote, 4096, 4096).result(10)) == 4096  # inline or post
        assert one_call(lambda: ini.read(src, remote, 4096, 4096, local_offset=8192).result(10)) == 4096
        n = 16
        lo = [i * 4096 for i in range(n)]
        ro = [65536 + i * 4104 for i in range(n)]
        assert one_call(lambda: ini.write_many(src, remote, lo, ro, [4096] * n).result(10)) == n * 4096
        assert one_call(lambda: ini.read_many(src, remote, [(512 << 10) + x for x in lo], ro,
                                              [4096] * n).result(10)) == n * 4096
        assert bytes(kv.view[4096:8192]) == b"\x11" * 4096 and bytes(src.view[8192:12288]) == b"\x11" * 4096
        assert bytes(src.view[512 << 10:(512 << 10) + n * 4096]) == bytes(src.view[:n * 4096])
        # What the engine bound, where the endpoint's RMA is a local copy, is the lane's own move.
        peer = next(iter(ucx._peers.values()))
        att = next(iter(peer.attached.values()))
        lanes = [v[2][0] for k, v in att.lanes.items() if k[:2] == (True, src.id)]
        bound = [b.move for k, b in ini._pipeline.bindings.items() if k[2] == "write"]
        if ucx._local_rma(peer):
            assert bound and bound[0] in lanes


def test_a_fast_path_write_restarted_on_a_fresh_endpoint_lands(make_engine: Any) -> None:
    """A write whose flush the fast path left in flight (tcp, target stopped) is restarted on a
    fresh endpoint when another request's abort force-closes the stalled one: it is issued again
    from its own local range (the general path's items), and lands once the target resumes."""
    from ucx_support import StoppableTarget

    cfg = {"runtime": {"abort_grace_ms": 200}, "plugins": {"ucx": {"tls": "tcp,self"}}}
    with StoppableTarget() as target:
        ini = make_engine(cfg, transports=["ucx"])
        remote = ini.open(target.address, "kv", timeout=10)
        src = ini.allocate(1 << 16)
        for _ in range(3):
            assert ini.write(src, remote, 0, 4096).result(5) == 4096  # attached and wired up
        src.view[4096:8192] = b"\x5e" * 4096

        def post() -> tuple[Any, Any]:
            a = ini.write(src, remote, 4096, 4096, local_offset=4096)
            b = ini.write(src, remote, 8192, 4096, timeout=0.2)
            return a, b

        a, b = target.paused(1.5, post)
        with pytest.raises(mpcomm.TransferTimeout):
            b.result(5)
        assert a.result(15) == 4096
        back = bytearray(4096)
        assert ini.read(back, remote, 4096).result(5) == 4096 and bytes(back) == b"\x5e" * 4096
