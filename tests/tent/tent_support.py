"""Memory at a raw address for the tent tests (the Mooncake API takes addresses, not buffers)."""

from __future__ import annotations

import ctypes
import mmap

SIZE = 1 << 16


class Mem:
    """An anonymous mapping of ``n`` bytes and its address (kept valid by the anchor)."""

    def __init__(self, n: int = SIZE) -> None:
        self.mm = mmap.mmap(-1, n)
        self._anchor = ctypes.c_char.from_buffer(self.mm)
        self.addr = ctypes.addressof(self._anchor)
