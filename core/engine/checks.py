"""The one bounds and timeout rule of every request.

The engine's one request path (``Pipeline.single``, for a bound pair as for
any other) checks every single request here (:func:`check_span`,
:func:`timeout_seconds`) before it takes the pair's binding or the full
routing; the vectorised batches (``write_many``/``read_many``/``submit``/
``prepare_many``) check through :func:`first_bad`. The only other deciding
code is native: the C form of a binding's inline step, which runs before the
one path and declines (to it) whatever :func:`span` and :func:`timeout_ok`
would not take.

The rule, for a range ``[off, off + n)`` of a region of ``size`` bytes, is
written the way native code must write it, in unsigned arithmetic, so it
cannot wrap::

    n <= size && off <= size - n        (off, n, size >= 0)

The native code mirrors it and must stay in step: ``fits()`` in
``core/engine/_fastlane.c`` (the C inline step, and its ``first_bad``, which
:func:`first_bad` hands the engine's own int64 arrays), ``mp_fits()`` in
``plugins/shm/_copyloop.c`` (the copy loops re-check every piece at the point
of use) and ``mp_fits()`` in ``plugins/ucx/_ucxloop.c``. The test that holds
them together is ``tests/core/test_lane_agreement.py`` (a hypothesis-driven
differential test over every lane and transport with offsets and lengths at
0, ±1, 2**31, 2**32, 2**63-1, 2**64-1 and size±1), with the native helpers
also built under AddressSanitizer by ``tests/core/test_native_sanitized.py``.
"""

from __future__ import annotations

import math
import operator
import sys
from array import array
from operator import add
from typing import Any

from ..errors import MpcommError, OutOfBoundsError
from . import fastlane

__all__ = ["fits", "span", "check_span", "integer", "first_bad", "timeout_ok", "timeout_seconds"]

_INF = math.inf
_MAX_INT = int(sys.float_info.max)
_I64 = 1 << 63

#: ``_fastlane.c``'s first_bad (this rule over array('q') buffers, one pass in C), False where
#: that module is not in use; resolved at the first batch.
_scan: Any = None


def fits(off: int, n: int, size: int) -> bool:
    """``[off, off + n)`` lies inside ``[0, size)`` (an empty range may sit at ``size``)."""
    return 0 <= n <= size and 0 <= off <= size - n


def span(lo: int, ro: int, length: int | None, lsize: int, rsize: int) -> int | None:
    """The bytes a request moves (``length``, or to the end of the local region when None),
    or None when it does not fit both regions or an argument is not an exact ``int`` (then
    :func:`check_span` converts it or says why not)."""
    if type(lo) is not int or type(ro) is not int or (length is not None and type(length) is not int):
        return None
    if length is None:
        length = lsize - lo
    if 0 <= length <= lsize and length <= rsize and 0 <= lo <= lsize - length and 0 <= ro <= rsize - length:
        return length
    return None


def check_span(lname: str, lsize: int, rname: str, rsize: int, peer: str | None, lo: int, ro: int,
               length: int | None, request: Any = None) -> int:
    """:func:`span`, raising OutOfBoundsError (naming the side and the region) where it says None.

    Offsets and the length must be integers (``int`` or anything with ``__index__``, such as a
    numpy integer): a float that happens to compare in bounds is refused here, not by a
    transport after the request was posted.
    """
    if type(lo) is not int or type(ro) is not int or (length is not None and type(length) is not int):
        lo, ro = integer(lo, "local_offset"), integer(ro, "remote_offset")
        if length is not None:
            length = integer(length, "length")
    got = span(lo, ro, length, lsize, rsize)
    if got is not None:
        return got
    if lo < 0 or ro < 0:
        raise OutOfBoundsError(f"offsets must not be negative (local_offset={lo}, remote_offset={ro})",
                               region=lname, request=request)
    if lo > lsize:
        raise OutOfBoundsError(f"local_offset {lo} is past the end of {lname!r} ({lsize} bytes)", region=lname,
                               request=request)
    if ro > rsize:
        raise OutOfBoundsError(f"remote_offset {ro} is past the end of {rname!r} ({rsize} bytes)", region=rname,
                               peer=peer, request=request)
    if length is None:
        length = lsize - lo
    if length < 0:
        raise OutOfBoundsError(f"length must not be negative, not {length}", region=lname, request=request)
    if not fits(lo, length, lsize):
        raise OutOfBoundsError(f"local [{lo}, {lo + length}) exceeds {lname!r} of {lsize} bytes", region=lname,
                               request=request)
    raise OutOfBoundsError(f"remote [{ro}, {ro + length}) exceeds {rname!r} of {rsize} bytes; nothing was "
                           "transferred", region=rname, peer=peer, request=request)


def integer(value: Any, name: str) -> int:
    """``value`` as an int (``operator.index``), else MpcommError naming ``name``."""
    try:
        return operator.index(value)
    except TypeError:
        raise MpcommError(f"{name} must be an integer, not {type(value).__name__}") from None


def first_bad(lo: Any, ro: Any, ln: Any, lsize: int, rsize: int) -> int:
    """The first index ``i`` whose request does not fit (:func:`span` with ``ln[i]``), or -1.

    The engine's int64 arrays go through ``_fastlane.c``'s ``first_bad`` (``fits`` per
    entry in one C pass; a 64-piece batch spent as long in min/max below as in its copies).
    Otherwise vectorised for the common case (min/max over the arrays, one C-level map):
    with Python's unbounded ints, ``min >= 0`` and ``max(off + len) <= size``
    is exactly :func:`fits` for every index; the loop runs only to name the
    bad index.
    """
    global _scan
    n = len(ln)
    if n == 0:
        return -1
    scan = _scan
    if scan is None:
        scan = _scan = fastlane.native("first_bad")
    if (scan and type(lo) is array and type(ro) is array and type(ln) is array and lo.typecode == "q"
            and ro.typecode == "q" and ln.typecode == "q" and len(lo) == n and len(ro) == n
            and type(lsize) is int and type(rsize) is int and 0 <= lsize < _I64 and 0 <= rsize < _I64):
        return scan(lo, ro, ln, lsize, rsize)  # the engine's own copies: the same rule in one C pass
    if (min(ln) >= 0 and min(lo) >= 0 and min(ro) >= 0 and max(map(add, lo, ln)) <= lsize
            and max(map(add, ro, ln)) <= rsize):
        return -1
    for i in range(n):
        if span(lo[i], ro[i], ln[i], lsize, rsize) is None:
            return i
    return -1  # pragma: no cover - unreachable


def timeout_ok(timeout: Any) -> bool:
    """The C inline step's timeout test: None, or an exact float in (0, inf) or int in (0, the
    largest float] (what ``_fastlane.c`` takes: PyLong_AsDouble fails beyond). Anything else
    it declines to the one path, whose :func:`timeout_seconds` accepts or refuses it."""
    t = type(timeout)
    return timeout is None or (t is float and 0 < timeout < _INF) or (t is int and 0 < timeout <= _MAX_INT)


def timeout_seconds(timeout: Any, default: float) -> float:
    """A request's timeout in seconds (``default`` for None); MpcommError unless positive and finite."""
    t = default if timeout is None else timeout
    try:
        ok = t > 0 and not math.isinf(t)
    except (TypeError, ValueError, OverflowError):  # not a number, or an int no float holds
        ok = False
    if not ok:
        raise MpcommError(f"timeout must be a positive number of seconds, not {timeout!r}")
    return t
