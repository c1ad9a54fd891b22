"""The transport contract's one fast lane: the engine calls only ``inline_path``; ``post_inline`` is its older form.

A plugin that implements only ``post_inline`` (written for the older contract)
still gets the lane, through the default ``inline_path``; one that implements
only ``inline_path`` answers ``post_inline`` callers through its move; the base
class offers neither. The in-tree shm transport implements ``inline_path`` only,
and a real pair lands through it and through the derived ``post_inline`` alike.
"""

from __future__ import annotations

from typing import Any, ClassVar

import mpcomm
from mpcomm.engine.bound import offers_inline
from mpcomm.transport import Transport


class _Older(Transport):
    name: ClassVar[str] = "older"

    def __init__(self) -> None:  # no context needed for the lane itself
        self.calls: list[tuple[Any, ...]] = []

    def post(self, op: Any) -> None:  # pragma: no cover - not posted here
        raise AssertionError

    def post_inline(self, kind: str, local: Any, local_offset: int, remote: Any, remote_offset: int,
                    length: int) -> bool:
        self.calls.append((kind, local, local_offset, remote, remote_offset, length))
        return length <= 64


class _Newer(_Older):
    name: ClassVar[str] = "newer"
    post_inline = Transport.post_inline  # type: ignore[assignment]

    def inline_path(self, kind: str, local: Any, remote: Any) -> Any:
        def move(lo: int, ro: int, n: int) -> bool:
            self.calls.append((kind, local, lo, remote, ro, n))
            return n <= 64
        return move


class _Plain(_Older):
    name: ClassVar[str] = "plain"
    post_inline = Transport.post_inline  # type: ignore[assignment]


def test_a_plugin_with_only_post_inline_gets_the_lane_through_inline_path() -> None:
    t = _Older()
    assert offers_inline(t)
    move = t.inline_path("write", "L", "R")
    assert move is not None and move(1, 2, 64) is True and move(1, 2, 65) is False
    assert t.calls == [("write", "L", 1, "R", 2, 64), ("write", "L", 1, "R", 2, 65)]


def test_a_plugin_with_only_inline_path_answers_post_inline() -> None:
    t = _Newer()
    assert offers_inline(t)
    assert t.post_inline("read", "L", 3, "R", 4, 8) is True and t.post_inline("read", "L", 3, "R", 4, 99) is False
    assert t.calls == [("read", "L", 3, "R", 4, 8), ("read", "L", 3, "R", 4, 99)]


def test_a_plugin_with_neither_has_no_lane() -> None:
    t = _Plain()
    assert not offers_inline(t)
    assert t.inline_path("write", "L", "R") is None
    assert t.post_inline("write", "L", 0, "R", 0, 8) is False and t.calls == []


def test_shm_lands_through_inline_path_and_the_derived_post_inline() -> None:
    with mpcomm.Engine(transports=["shm"]) as target, mpcomm.Engine(transports=["shm"]) as ini:
        kv = target.allocate(1 << 16, name="kv")
        remote = ini.open(target.address, "kv")
        src = ini.allocate(1 << 16, name="src")
        assert ini.write(src, remote, 0, 64).result(5) == 64  # attaches the mapping; the route cached
        shm = ini.transports["shm"]
        assert "post_inline" not in vars(type(shm)) and offers_inline(shm)
        src.view[:64] = b"\x42" * 64
        src.acquire()  # the lease the engine holds around a move
        try:
            assert shm.post_inline("write", src, 0, remote, 128, 64) is True
        finally:
            src.release()
        assert bytes(kv.view[128:192]) == b"\x42" * 64
        src.view[:64] = b"\x43" * 64
        t = ini.write(src, remote, 256, 64)  # the binding made from the route cache: inline
        assert isinstance(t, mpcomm.transfer.Landed) and bytes(kv.view[256:320]) == b"\x43" * 64
        other = ini.allocate(1 << 12, name="other")
        other.view[:64] = b"\x44" * 64
        first = ini.write(other, remote, 512, 64)  # a new pair's very first request lands inline too
        assert isinstance(first, mpcomm.transfer.Landed) and first.done()
        assert bytes(kv.view[512:576]) == b"\x44" * 64
