"""The one bounds and timeout rule of every request.

The engine's one request path (``Pipeline.single``, for a bound pair as for
any other) checks every single request here (:func:`check_span`,
:func:`timeout_seconds`) before it takes the pair's binding or the full
routing; the vectorised batches (``write_many``/``read_many``/``submit``/
``prepare_many``) check through :func:`first_bad`, which is native. The only
other deciding code is native too: the C form of a binding's inline step, which
runs before the one path and declines (to it) whatever :func:`span` would not
take and any timeout but None or an exact float or int in (0, inf).

The rule, for a range ``[off, off + n)`` of a region of ``size`` bytes, is
written the way native code must write it, in unsigned arithmetic, so it
cannot wrap::

    n <= size && off <= size - n        (off, n, size >= 0)

The native code mirrors it and must stay in step: ``fits()`` in
``core/engine/_fastlane.c`` (the C inline step, and :func:`first_bad` over the
engine's own int64 arrays), ``mp_fits()`` in
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
from typing import Any

from ..errors import MpcommError, OutOfBoundsError
from . import fastlane

__all__ = ["fits", "span", "check_span", "integer", "first_bad", "timeout_seconds"]

#: ``first_bad(lo, ro, ln, lsize, rsize)``: the first index ``i`` whose request does not fit
#: (:func:`span` with ``ln[i]``), or -1: :func:`fits` per entry, in one pass in C over the engine's
#: own ``array('q')`` copies of a batch's offsets and lengths (``_fastlane.c``).
first_bad = fastlane.native("first_bad")


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
    lo, ro = integer(lo, "local_offset"), integer(ro, "remote_offset")
    n = lsize - lo if length is None else integer(length, "length")
    if fits(lo, n, lsize) and fits(ro, n, rsize):
        return n
    if lo < 0 or ro < 0:
        msg = f"offsets must not be negative (local_offset={lo}, remote_offset={ro})"
    elif lo > lsize:
        msg = f"local_offset {lo} is past the end of {lname!r} ({lsize} bytes)"
    elif ro > rsize:
        raise OutOfBoundsError(f"remote_offset {ro} is past the end of {rname!r} ({rsize} bytes)", region=rname,
                               peer=peer, request=request)
    elif n < 0:
        msg = f"length must not be negative, not {n}"
    elif not fits(lo, n, lsize):
        msg = f"local [{lo}, {lo + n}) exceeds {lname!r} of {lsize} bytes"
    else:
        raise OutOfBoundsError(f"remote [{ro}, {ro + n}) exceeds {rname!r} of {rsize} bytes; nothing was "
                               "transferred", region=rname, peer=peer, request=request)
    raise OutOfBoundsError(msg, region=lname, request=request)


def integer(value: Any, name: str) -> int:
    """``value`` as an int (``operator.index``), else MpcommError naming ``name``."""
    try:
        return operator.index(value)
    except TypeError:
        raise MpcommError(f"{name} must be an integer, not {type(value).__name__}") from None


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
