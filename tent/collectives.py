"""One local buffer to or from many remote regions, as one handle.

``Engine.scatter/gather/broadcast`` in the issue's words; they live here as
functions taking an Engine because the engine's request path is being
rewritten. Each is one ``Engine.submit`` batch: every request is validated
before any is posted, and the returned :class:`mpcomm.Batch` completes when
all members did (or fails with the first member's error).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from mpcomm import Batch, Engine, RemoteRegion, Request

__all__ = ["broadcast", "gather", "scatter"]

Target = tuple[RemoteRegion, int]  # (region, offset in it)


def _targets(targets: Sequence[RemoteRegion | Target]) -> list[Target]:
    out = []
    for t in targets:
        out.append((t, 0) if isinstance(t, RemoteRegion) else (t[0], int(t[1])))
    if not out:
        raise ValueError("at least one target is needed")
    return out


def scatter(engine: Engine, src: Any, targets: Sequence[RemoteRegion | Target], chunk: int, *,
            local_offset: int = 0, timeout: float | None = None) -> Batch:
    """Chunk ``i`` of ``src`` (from ``local_offset``) to ``targets[i]``."""
    reqs = [Request("write", src, r, off, chunk, local_offset + i * chunk)
            for i, (r, off) in enumerate(_targets(targets))]
    return engine.submit(reqs, timeout=timeout)


def gather(engine: Engine, dst: Any, sources: Sequence[RemoteRegion | Target], chunk: int, *,
           local_offset: int = 0, timeout: float | None = None) -> Batch:
    """``chunk`` bytes from each source into consecutive chunks of ``dst``."""
    reqs = [Request("read", dst, r, off, chunk, local_offset + i * chunk)
            for i, (r, off) in enumerate(_targets(sources))]
    return engine.submit(reqs, timeout=timeout)


def broadcast(engine: Engine, src: Any, targets: Sequence[RemoteRegion | Target], length: int | None = None, *,
              local_offset: int = 0, timeout: float | None = None) -> Batch:
    """The same ``length`` bytes of ``src`` to every target."""
    if length is None:
        length = memoryview(src).nbytes - local_offset if not hasattr(src, "size") else src.size - local_offset
    reqs = [Request("write", src, r, off, length, local_offset) for r, off in _targets(targets)]
    return engine.submit(reqs, timeout=timeout)
