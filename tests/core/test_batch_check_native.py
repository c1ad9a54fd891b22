"""The batch bounds scan in C (``_fastlane.c``'s first_bad) decides as ``checks.first_bad``'s Python rule.

``checks.first_bad`` hands the engine's own ``array('q')`` copies to the C scan
(a 64-piece batch spent as long in Python's min/max over them as in its copies);
anything else (lists, other sizes) stays in Python. Both must name the same first
bad index, at the int64 edges too.
"""

from __future__ import annotations

from array import array

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from core_support import I64, fastlane_c

from mpcomm.engine import checks

EDGES = [0, 1, -1, 4095, 4096, 4097, 2**31, 2**32, I64, I64 - 1, -I64 - 1, -2]
VALUES = st.one_of(st.sampled_from(EDGES), st.integers(-(1 << 63), I64))
SIZES = st.one_of(st.sampled_from([0, 1, 4096, 2**32, I64]), st.integers(0, I64))


@settings(max_examples=300, deadline=None, derandomize=True, database=None)
@given(rows=st.lists(st.tuples(VALUES, VALUES, VALUES), min_size=1, max_size=6), lsize=SIZES, rsize=SIZES)
def test_the_c_scan_names_the_first_bad_index_as_the_python_rule(rows: list, lsize: int, rsize: int) -> None:
    scan = fastlane_c("first_bad")
    lo, ro, ln = (array("q", col) for col in zip(*rows))
    python = checks.first_bad(list(lo), list(ro), list(ln), lsize, rsize)  # lists: the Python rule
    expected = next((i for i, (a, b, n) in enumerate(rows) if checks.span(a, b, n, lsize, rsize) is None), -1)
    assert python == expected
    assert scan(lo, ro, ln, lsize, rsize) == expected
    assert checks.first_bad(lo, ro, ln, lsize, rsize) == expected  # the engine's arrays: the C scan


def test_the_c_scan_refuses_what_it_cannot_read_exactly() -> None:
    scan = fastlane_c("first_bad")
    q = array("q", [0])
    with pytest.raises(TypeError):
        scan(array("i", [0]), q, q, 8, 8)  # not int64
    with pytest.raises(TypeError):
        scan(q, q, array("q", [0, 0]), 8, 8)  # lengths differ
    with pytest.raises(TypeError):
        scan(q, q, q, -1, 8)
    with pytest.raises(OverflowError):
        scan(q, q, q, 1 << 63, 8)
    # first_bad itself keeps such inputs in Python: the same answer as the rule.
    assert checks.first_bad(q, q, q, 1 << 63, 8) == -1
    assert checks.first_bad(array("q", [1]), q, array("q", [8]), 8, 8) == 0
