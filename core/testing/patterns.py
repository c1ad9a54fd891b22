"""Deterministic test data."""

from __future__ import annotations


def pattern(seed: int, n: int, start: int = 0) -> bytes:
    """Deterministic bytes with a prime period, so shifted data never matches."""
    base = bytes((i * 7 + seed * 13) % 251 for i in range(251))
    reps = (start % 251 + n) // 251 + 2
    s = start % 251
    return (base * reps)[s : s + n]
