"""Sizes as people write them (``4KiB``, ``64MiB``) and back; shared by the config, the
route rules and the command line. Binary units for ``K``/``KiB``/``M``..., decimal
for ``KB``/``MB``... (as network links are rated)."""

from __future__ import annotations

import re

__all__ = ["format_size", "parse_size"]

_UNITS = {
    "": 1, "b": 1,
    "k": 1 << 10, "kb": 1000, "kib": 1 << 10,
    "m": 1 << 20, "mb": 1000**2, "mib": 1 << 20,
    "g": 1 << 30, "gb": 1000**3, "gib": 1 << 30,
    "t": 1 << 40, "tb": 1000**4, "tib": 1 << 40,
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str) -> int:
    """``"64MiB"`` → 67108864; ``K``/``M``/``G`` are binary, ``KB``/``MB``/``GB`` decimal.

    Raises ValueError naming the text.
    """
    m = _SIZE_RE.match(text)
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"not a size: {text!r} (examples: 4096, 64KiB, 4MiB, 1GiB)")
    value = float(m.group(1)) * _UNITS[m.group(2).lower()]
    if value != int(value):
        raise ValueError(f"not a whole number of bytes: {text!r}")
    return int(value)


def format_size(n: float) -> str:
    """Binary units without a fractional part where exact: 4096 → ``4KiB``."""
    for unit, factor in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= factor:
            q = n / factor
            return f"{q:.0f}{unit}" if q == int(q) else f"{q:.1f}{unit}"
    return f"{int(n)}B"
