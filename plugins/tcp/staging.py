"""tcp's device-memory path (issue 31): local CUDA memory staged through pinned host bounce buffers.

A request whose local region is CUDA memory is carried as a sequence of host
requests of at most one bounce buffer each (``staging_chunk`` bytes): for a
write, each chunk is copied device -> pinned bounce (``cudaMemcpy``), then
sent as tcp sends host memory; for a read, each chunk is received into the
bounce, then copied bounce -> device before the next one starts. Bounce
buffers come from one :class:`~mpcomm.cuda_runtime.PinnedPool` per transport
of at most ``staging_limit`` bytes in all, however many requests run.

The target side is unchanged: it serves host memory only, so tcp declares
``cuda`` for the local side alone (``remote_memory_kinds = {"host"}``).
Completion: the last chunk's copy to the device is synchronous, so a
completed read is visible to later work on the device (docs/contract.md §11).
"""

from __future__ import annotations

import ctypes
import threading
import time
from collections.abc import Callable
from typing import Any

from mpcomm import Region, TransferTimeout, cuda_runtime
from mpcomm.transport import Operation

__all__ = ["Staged"]


class Staged:
    """One request with CUDA local memory, carried chunk by chunk through a pinned bounce buffer.

    ``post`` is the transport's host :meth:`post`; the request's ``state`` is
    this object, so the transport's abort reaches the chunk in flight.
    """

    def __init__(self, op: Operation, pool: cuda_runtime.PinnedPool, post: Callable[[Operation], None]) -> None:
        self.op = op
        self.pool = pool
        self.post = post
        self.pos = 0
        self.bounce = 0
        self.current: Operation | None = None
        self.lock = threading.Lock()

    def start(self) -> None:
        try:
            self.bounce = self.pool.take(timeout=max(self.op.time_left(), 0.001))
        except cuda_runtime.CudaError as exc:
            self.op.fail(exc)
            return
        self._next()

    def abort(self) -> None:
        with self.lock:
            cur = self.current
        if cur is not None and self.op.abort_exc is not None:
            cur.abort(self.op.abort_exc)

    def _next(self) -> None:
        op = self.op
        n = min(self.pool.size, op.length - self.pos)
        dev = op.local.address + op.local_offset + self.pos
        try:
            if op.abort_exc is not None:
                raise op.abort_exc
            if time.monotonic() > op.deadline:
                raise TransferTimeout(f"tcp staged {op.kind} passed its deadline after {self.pos} bytes",
                                      region=op.remote.name, peer=op.remote.address)
            if op.kind == "write":
                cuda_runtime.memcpy(self.bounce, dev, n)
            view = memoryview((ctypes.c_char * n).from_address(self.bounce)).cast("B")
            host = Region(view, name=f"{op.local.name}/staged", access="rw", owner=self)
            sub = Operation(op.kind, host, 0, op.remote, op.remote_offset + self.pos, n, op.deadline,
                            op.deadline_wall, op.peer, sink=self._chunk_done)
        except BaseException as exc:  # noqa: BLE001 - reported through the request
            self._end(exc)
            return
        sub.transport = op.transport  # so that aborting the chunk reaches the transport
        with self.lock:
            self.current = sub
        try:
            self.post(sub)
        except BaseException as exc:  # noqa: BLE001
            sub.fail(exc)

    def _chunk_done(self, sub: Operation, error: BaseException | None, nbytes: int) -> None:
        if error is None and self.op.kind == "read":
            try:
                dev = self.op.local.address + self.op.local_offset + self.pos
                cuda_runtime.memcpy(dev, self.bounce, sub.length)
            except BaseException as exc:  # noqa: BLE001
                error = exc
        if error is not None:
            self._end(error)
            return
        self.pos += sub.length
        if self.pos >= self.op.length:
            self._end(None)
        else:
            self._next()

    def _end(self, error: BaseException | None) -> None:
        bounce, self.bounce = self.bounce, 0
        if bounce:
            self.pool.give(bounce)
        if error is None:
            self.op.complete(self.op.length)
        else:
            self.op.fail(error)


def state_of(op: Any) -> Staged | None:
    """The staging of ``op`` if it has one (the transport's abort and drive ask)."""
    st = getattr(op, "state", None)
    return st if isinstance(st, Staged) else None
