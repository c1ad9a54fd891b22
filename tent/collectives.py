"""One local buffer to or from many remote regions, as one handle.

The engine does the work (:meth:`mpcomm.Engine.scatter`, ``gather``,
``broadcast``); these functions keep the spelling UCL-MPComm's callers know
(``scatterAsync`` and friends map onto them).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from mpcomm import Batch, Engine, RemoteRegion

__all__ = ["broadcast", "gather", "scatter"]

Target = tuple[RemoteRegion, int]  # (region, offset in it)


def scatter(engine: Engine, src: Any, targets: Sequence[RemoteRegion | Target], chunk: int, *,
            local_offset: int = 0, timeout: float | None = None) -> Batch:
    """Chunk ``i`` of ``src`` (from ``local_offset``) to ``targets[i]``."""
    return engine.scatter(src, targets, chunk, local_offset=local_offset, timeout=timeout)


def gather(engine: Engine, dst: Any, sources: Sequence[RemoteRegion | Target], chunk: int, *,
           local_offset: int = 0, timeout: float | None = None) -> Batch:
    """``chunk`` bytes from each source into consecutive chunks of ``dst``."""
    return engine.gather(dst, sources, chunk, local_offset=local_offset, timeout=timeout)


def broadcast(engine: Engine, src: Any, targets: Sequence[RemoteRegion | Target], length: int | None = None, *,
              local_offset: int = 0, timeout: float | None = None) -> Batch:
    """The same ``length`` bytes of ``src`` to every target."""
    return engine.broadcast(src, targets, length, local_offset=local_offset, timeout=timeout)
