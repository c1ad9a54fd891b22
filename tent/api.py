"""``MPComm``: the provider's API in Python, with the C++ API's names and codes.

Every method returns a status code (``SUCCESS`` = 0, negative on failure) or,
for ``put_async``/``get_async``/the multi-host calls, a handle (0 = not
issued; :attr:`MPComm.last_error` says why). Nothing raises for a refusal; a
released or unknown handle is ``ERR_INVALID_HANDLE``, never a crash. Handles
are released exactly once with :meth:`release_transfer`.

Completions are reaped in bulk on the caller's thread, as TENT's poll loop
does: every handle is posted with the engine's
:class:`~mpcomm.engine.CompletionQueue`, and :meth:`MPComm.poll_completions`
(or any ``is_transfer_complete`` that finds its handle unfinished) settles
what finished, with no hop through the engine's completion thread.

This is the same layer the C++ library (``libmpcomm.so``) drives; there the
handle table lives in C++ so that polling never needs the GIL (completions
reach it through a callback instead of a queue a C++ poller would have to
drain under the GIL).
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from mpcomm import Transfer

from . import codes
from .provider import Provider

__all__ = ["MPComm", "RemoteBufferEntry", "TransferResult"]


@dataclass(frozen=True)
class TransferResult:
    error_code: int
    bytes_transferred: int


@dataclass(frozen=True)
class RemoteBufferEntry:
    addr: int
    length: int
    numa_node: int


def outcome(t: Transfer) -> tuple[int, int]:
    """(code, bytes) of a finished Transfer; never raises."""
    if t.cancelled():
        return codes.ERR_CANCELLED, 0
    exc = t.exception()
    if exc is not None:
        return codes.code_for(exc), 0
    return codes.SUCCESS, int(t.bytes_moved)


class MPComm:
    """Python twin of ``mpcomm::MPComm`` (``include/mpcomm.h``)."""

    def __init__(self) -> None:
        self.provider = Provider()
        self._handles: dict[int, Transfer] = {}
        self._by_transfer: dict[int, int] = {}  # id(Transfer) -> handle, for poll_completions
        self._ids = itertools.count(1)
        self._last = threading.local()
        self._cq = None
        # Finished inside the issue call, for polling without a completion queue. With one, every
        # handle reaches the queue (the engine hands inline-finished ones to it too): listing them
        # here as well reported them twice and, counted, hid others.
        self._inline: deque[int] = deque()

    @property
    def last_error(self) -> tuple[int, str]:
        """(code, message) of this thread's last failure."""
        return getattr(self._last, "value", (codes.SUCCESS, ""))

    def _call(self, fn, *args) -> int:  # type: ignore[no-untyped-def]
        try:
            fn(*args)
            return codes.SUCCESS
        except Exception as exc:  # noqa: BLE001 - every refusal becomes a code
            return self._fail(exc)

    def _fail(self, exc: BaseException) -> int:
        code = codes.code_for(exc)
        self._last.value = (code, f"{type(exc).__name__}: {exc}")
        return code

    # -- lifecycle ----------------------------------------------------------------

    def init(self, host_id: str, device_names: str = "", tcp_port: int = 0) -> int:
        rc = self._call(self.provider.init, host_id, device_names, tcp_port)
        if rc == codes.SUCCESS and self.provider.engine is not None:
            self._cq = self.provider.engine.completion_queue()
        return rc

    def get_tcp_port(self) -> int:
        return self.provider.tcp_port

    def start_accept_thread(self) -> int:
        return self._call(self.provider.start_accept)

    def stop_accept_thread(self) -> int:
        return self._call(self.provider.stop_accept)

    def shutdown(self) -> int:
        rc = self._call(self.provider.shutdown)
        return rc

    # -- memory ---------------------------------------------------------------------

    def register_memory(self, addr: int, length: int) -> int:
        return self._call(self.provider.register_memory, addr, length)

    def unregister_memory(self, addr: int) -> int:
        return self._call(self.provider.unregister_memory, addr)

    def publish_buffer(self, addr: int, length: int, numa_node: int = -1) -> int:
        return self._call(self.provider.publish, addr, length, numa_node)

    def unpublish_buffer(self, addr: int) -> int:
        return self._call(self.provider.unpublish, addr)

    # -- peers --------------------------------------------------------------------------

    def connect(self, host_id: str, tcp_addr: str, tcp_port: int) -> int:
        return self._call(self.provider.connect, host_id, tcp_addr, tcp_port)

    def query_remote_buffer(self, host_id: str, tcp_addr: str = "", tcp_port: int = 0
                            ) -> tuple[int, list[RemoteBufferEntry]]:
        try:
            bufs = self.provider.query(host_id, tcp_addr or None, tcp_port)
        except Exception as exc:  # noqa: BLE001
            return self._fail(exc), []
        return codes.SUCCESS, [RemoteBufferEntry(b.addr, b.length, b.numa_node) for b in bufs]

    # -- data path --------------------------------------------------------------------------

    def _track(self, make) -> int:  # type: ignore[no-untyped-def]
        try:
            t = make()
        except Exception as exc:  # noqa: BLE001
            self._fail(exc)
            return 0
        h = next(self._ids)
        self._handles[h] = t
        self._by_transfer[id(t)] = h
        if self._cq is None and t.done():
            self._inline.append(h)
        return h

    def put_async(self, local_addr: int, host_id: str, remote_addr: int, length: int,
                  timeout: float | None = None) -> int:
        return self._track(lambda: self.provider.issue("write", local_addr, host_id, remote_addr, length, timeout,
                                                       self._cq))

    def get_async(self, local_addr: int, host_id: str, remote_addr: int, length: int,
                  timeout: float | None = None) -> int:
        return self._track(lambda: self.provider.issue("read", local_addr, host_id, remote_addr, length, timeout,
                                                       self._cq))

    def scatter_async(self, local_addr: int, host_ids: Sequence[str], remote_addrs: Sequence[int],
                      chunk: int, timeout: float | None = None) -> int:
        """Chunk ``i`` of the local buffer to ``host_ids[i]`` at ``remote_addrs[i]``; one handle."""
        n = len(host_ids)
        return self._track(lambda: self.provider.issue_many(
            "write", local_addr, host_ids, remote_addrs, [chunk] * n, [i * chunk for i in range(n)], timeout, self._cq))

    def gather_async(self, local_addr: int, host_ids: Sequence[str], remote_addrs: Sequence[int],
                     chunk: int, timeout: float | None = None) -> int:
        """``chunk`` bytes from each host into consecutive chunks of the local buffer."""
        n = len(host_ids)
        return self._track(lambda: self.provider.issue_many(
            "read", local_addr, host_ids, remote_addrs, [chunk] * n, [i * chunk for i in range(n)], timeout, self._cq))

    def broadcast_async(self, local_addr: int, host_ids: Sequence[str], remote_addrs: Sequence[int],
                        length: int, timeout: float | None = None) -> int:
        """The whole local buffer to every host; one handle."""
        n = len(host_ids)
        return self._track(lambda: self.provider.issue_many(
            "write", local_addr, host_ids, remote_addrs, [length] * n, [0] * n, timeout, self._cq))

    def poll_completions(self, max_items: int = 64, timeout: float = 0.0) -> list[int]:
        """Handles that finished since the last poll (settled here, on this thread).

        Waits up to ``timeout`` seconds when none has; their results are then
        available from :meth:`get_transfer_result` until they are released.
        """
        out = []
        while self._inline and len(out) < max_items:
            try:
                out.append(self._inline.popleft())
            except IndexError:
                break
        if self._cq is None or len(out) >= max_items:
            return out
        for t in self._cq.poll(max_items - len(out), 0.0 if out else timeout):
            h = self._by_transfer.get(id(t))
            if h is not None:
                out.append(h)
        return out

    def is_transfer_complete(self, handle: int) -> bool:
        """True once the transfer is terminal, or for an unknown handle (nothing to wait for)."""
        t = self._handles.get(handle)
        if t is None or t.done():
            return True
        self.poll_completions(1 << 16)  # settle whatever finished meanwhile
        return t.done()

    def get_transfer_result(self, handle: int) -> TransferResult:
        t = self._handles.get(handle)
        if t is None:
            return TransferResult(codes.ERR_INVALID_HANDLE, 0)
        if not t.done():
            self.poll_completions(1 << 16)
            if not t.done():
                return TransferResult(codes.ERR_IN_PROGRESS, 0)
        return TransferResult(*outcome(t))

    def wait_transfer(self, handle: int, timeout_ms: int = -1) -> int:
        """Wait for a handle; its result code, ERR_TIMEOUT if it is still running after ``timeout_ms``."""
        t = self._handles.get(handle)
        if t is None:
            return codes.ERR_INVALID_HANDLE
        deadline = None if timeout_ms < 0 else time.monotonic() + timeout_ms / 1000
        while not t.done():  # reap completions until ours is among them
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return codes.ERR_TIMEOUT
            self.poll_completions(1 << 16, 0.05 if left is None else min(left, 0.05))
        return outcome(t)[0]

    def release_transfer(self, handle: int) -> int:
        """Forget a handle; a second release (or an unknown handle) is ERR_INVALID_HANDLE."""
        t = self._handles.pop(handle, None)
        if t is None:
            return codes.ERR_INVALID_HANDLE
        self._by_transfer.pop(id(t), None)
        return codes.SUCCESS
