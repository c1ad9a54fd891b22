"""submit()'s plan by runs decides alike whichever way a request is planned.

A run of requests sharing the same local buffer, remote descriptor, op, timeout and route objects
(without notify) is planned by ``_fastlane.c``'s scan; a request it stops at is planned alone, in
Python. Whatever the batch holds, the outcome must not depend on that: the same bytes, or the same
error class naming the same request. The Python step is reached here with a Request subclass as the
first request (the scan takes plain Requests only; the planner takes any Request).
"""

from __future__ import annotations

from typing import Any, Callable

import pytest

import mpcomm
from mpcomm import Request


class _Req(Request):
    """A Request the scan leaves to the planner's Python step."""


@pytest.fixture
def kv(make_engine: Callable[..., mpcomm.Engine]) -> Any:
    target, initiator = make_engine(), make_engine()
    target.register(bytearray(1 << 16), name="kv")
    target.register(bytearray(1 << 12), name="ro", access="r")
    return initiator, initiator.open(target.address, "kv"), initiator.open(target.address, "ro")


def _outcome(engine: mpcomm.Engine, reqs: list[Any], **kw: Any) -> tuple[str, Any]:
    try:
        b = engine.submit(reqs, **kw)
        return "ok", (b.result(10), b.bytes_per_request)
    except Exception as exc:  # noqa: BLE001 - the class and message are what is compared
        return type(exc).__name__, getattr(exc, "request", None) is not None and reqs.index(exc.request)


def _both(engine: mpcomm.Engine, make: Callable[[type], list[Any]], **kw: Any) -> tuple[Any, Any]:
    return _outcome(engine, make(Request), **kw), _outcome(engine, make(_Req), **kw)


def _batch(src: Any, remote: Any, n: int = 8, op: str = "write", **over: Any) -> Callable[[type], list[Any]]:
    """n requests of 64 bytes; over = {index: {field: value}} changes single requests."""
    def make(first: type) -> list[Any]:
        out = []
        for i in range(n):
            f = dict(op=op, local=src, remote=remote, remote_offset=i * 64, length=64, local_offset=i * 64)
            f.update(over.get(f"r{i}", {}))
            out.append((first if i == 0 else Request)(**f))
        return out
    return make


def test_a_uniform_batch_lands_alike(kv: Any) -> None:
    ini, remote, _ = kv
    src = ini.register(bytearray(b"u" * 4096))
    a, b = _both(ini, _batch(src, remote))
    assert a == b == ("ok", (512, [64] * 8))
    a, b = _both(ini, _batch(src, remote, op="read"))
    assert a == b == ("ok", (512, [64] * 8))


@pytest.mark.parametrize("bad", [
    {"r3": {"remote_offset": (1 << 16) - 10}},  # past the remote region
    {"r5": {"local_offset": -1}},
    {"r7": {"length": (1 << 63) - 1}},
    {"r2": {"remote_offset": (1 << 64) - 1}},  # outside int64
    {"r0": {"length": 0}, "r1": {"length": 1 << 20}},
])
def test_a_bad_range_is_named_alike(kv: Any, bad: dict[str, Any]) -> None:
    ini, remote, _ = kv
    src = ini.register(bytearray(4096))
    a, b = _both(ini, _batch(src, remote, **bad))
    assert a == b and a[0] == "OutOfBoundsError", (a, b)


def test_what_the_scan_passes_on_plans_alike(kv: Any) -> None:
    ini, remote, ro = kv
    src = ini.register(bytearray(4096))
    other = ini.register(bytearray(4096))
    cases = [
        {"r4": {"length": None}},  # the rest of the buffer: the Python step works it out
        {"r2": {"local": other}},  # two groups
        {"r6": {"remote": ro, "op": "read"}},
        {"r1": {"notify": b"hi"}},
        {"r3": {"timeout": 5.0}},
        {"r5": {"route": ("tcp",)}},
    ]
    for over in cases:
        a, b = _both(ini, _batch(src, remote, **over))
        assert a == b, (over, a, b)
    assert _both(ini, _batch(src, ro)) == (("PermissionDeniedError", 0), ("PermissionDeniedError", 0))
    assert _both(ini, _batch(src, remote, r0={"op": "move"}))[0][0] == "MpcommError"
    a, b = _both(ini, _batch(src, remote), timeout=0)
    assert a == b and a[0] == "MpcommError"
    a, b = _both(ini, _batch(src, remote), route="nope")
    assert a == b and a[0] == "MpcommError"


def test_a_foreign_object_is_named_by_its_index(kv: Any) -> None:
    ini, remote, _ = kv
    src = ini.register(bytearray(4096))
    reqs = _batch(src, remote)(Request)
    reqs[5] = ("write", src, remote)
    with pytest.raises(mpcomm.MpcommError, match=r"index 5"):
        ini.submit(reqs)


def test_a_closed_local_region_is_refused_first(kv: Any) -> None:
    ini, remote, _ = kv
    src = ini.register(bytearray(4096))
    make = _batch(src, remote)
    ini.unregister(src)
    assert _both(ini, make) == (("RegionClosedError", False), ("RegionClosedError", False))
