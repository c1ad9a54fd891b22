"""The one batch bounds check (``checks.first_bad``: ``_fastlane.c``'s first_bad) names the first
index the rule (``checks.span``) refuses.

``checks.first_bad`` is the C pass over the engine's own ``array('q')`` copies of a batch's
offsets and lengths (every batch path makes them); there is no other implementation. It must
name the same first bad index as the rule at the int64 edges, and with region sizes at and past
2**63 and 2**64 (a peer's descriptor may say any positive size).
"""

from __future__ import annotations

from array import array

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from core_support import I64

from mpcomm.engine import checks

EDGES = [0, 1, -1, 4095, 4096, 4097, 2**31, 2**32, I64, I64 - 1, -I64 - 1, -2]
VALUES = st.one_of(st.sampled_from(EDGES), st.integers(-(1 << 63), I64))
SIZES = st.one_of(st.sampled_from([0, 1, 4096, 2**32, I64, 2**63, 2**64 - 2, 2**64 - 1, 2**64, 2**65]),
                  st.integers(0, 2**66))


@settings(max_examples=400, deadline=None, derandomize=True, database=None)
@given(rows=st.lists(st.tuples(VALUES, VALUES, VALUES), min_size=1, max_size=6), lsize=SIZES, rsize=SIZES)
def test_the_c_check_names_the_first_bad_index_as_the_rule(rows: list, lsize: int, rsize: int) -> None:
    lo, ro, ln = (array("q", col) for col in zip(*rows))
    expected = next((i for i, (a, b, n) in enumerate(rows) if checks.span(a, b, n, lsize, rsize) is None), -1)
    assert checks.first_bad(lo, ro, ln, lsize, rsize) == expected


@pytest.mark.parametrize("size", [2**63, 2**64 - 2, 2**64 - 1, 2**64, 2**200])
def test_sizes_past_int64_decide_exactly(size: int) -> None:
    big = array("q", [I64])
    # off + n = 2**64 - 2: inside a region of 2**64 - 2 bytes or more, outside one of 2**63.
    assert checks.first_bad(big, big, big, size, size) == (0 if size == 2**63 else -1)
    assert checks.first_bad(array("q", [0]), array("q", [1]), big, size, size) == (-1 if size >= 2**63 else 0)


def test_the_c_check_refuses_what_it_cannot_read_exactly() -> None:
    q = array("q", [0])
    assert checks.first_bad(array("q"), array("q"), array("q"), 0, 0) == -1
    with pytest.raises(TypeError):
        checks.first_bad(array("i", [0]), q, q, 8, 8)  # not int64
    with pytest.raises(TypeError):
        checks.first_bad([0], q, q, 8, 8)  # not a buffer
    with pytest.raises(TypeError):
        checks.first_bad(q, q, array("q", [0, 0]), 8, 8)  # fewer offsets than lengths
    assert checks.first_bad(array("q", [0, -1]), q, q, 8, 8) == -1  # only len(ln) entries are read
    for size in (-1, -(2**64), 8.0, None):
        with pytest.raises(TypeError):
            checks.first_bad(q, q, q, size, 8)
        with pytest.raises(TypeError):
            checks.first_bad(q, q, q, 8, size)
    assert checks.first_bad(array("q", [1]), q, array("q", [8]), 8, 8) == 0
