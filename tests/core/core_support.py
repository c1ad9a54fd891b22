"""Helpers for the core tests: target engines in real processes, a recording
TCP proxy, and a deliberately slow fake transport.

Nothing here is a mock: the target is ``python -m mpcomm.testing.target`` (the
conformance kit's own target process), the proxy forwards real bytes, and the
slow transport really moves bytes with ``memmove`` after sleeping.
"""

from __future__ import annotations

import socket
import threading
import types
from typing import Any, ClassVar

import mpcomm
from mpcomm import Availability, Capabilities, Operation, Transport, TransportContext
from mpcomm.engine import fastlane
from mpcomm.testing import TargetProcess, plugin_module  # noqa: F401 - re-exported for the core tests

#: The largest int64: where the C lane's integers end.
I64 = (1 << 63) - 1


def fastlane_c(name: str | None = None) -> Any:
    """The engine's native module (``_fastlane.c``'s, required: ``import mpcomm`` fails without it),
    or its function ``name``."""
    return fastlane.mod if name is None else getattr(fastlane.mod, name)

# -- a target engine in a subprocess ------------------------------------------------


class Target(TargetProcess):
    """The kit's target process (``python -m mpcomm.testing.target``) on tcp, called as ``cmd("sha", name, ...)``."""

    def __init__(self, regions: dict[str, list[Any]], *, endpoint: str = "127.0.0.1:0",
                 config: dict[str, Any] | None = None, env: dict[str, str] | None = None) -> None:
        super().__init__("tcp", config=config, endpoint=endpoint, regions=regions, env=env)

    def cmd(self, *words: Any, timeout: float = 20) -> str:  # type: ignore[override]
        return super().cmd(" ".join(map(str, words)), timeout=timeout)


# -- a recording TCP proxy ------------------------------------------------------------


class RecordingProxy:
    """Forwards every connection to ``upstream`` and keeps every byte seen, both ways."""

    def __init__(self, upstream: tuple[str, int]) -> None:
        self.upstream = upstream
        self.seen = bytearray()
        self._lock = threading.Lock()
        self._sock = socket.create_server(("127.0.0.1", 0))
        self.port = self._sock.getsockname()[1]
        self._socks: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _accept(self) -> None:
        while True:
            try:
                a, _ = self._sock.accept()
            except OSError:
                return
            b = socket.create_connection(self.upstream)
            self._socks += [a, b]
            threading.Thread(target=self._pump, args=(a, b), daemon=True).start()
            threading.Thread(target=self._pump, args=(b, a), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                with self._lock:
                    self.seen += data
                dst.sendall(data)
        except OSError:
            pass
        finally:
            try:
                dst.shutdown(socket.SHUT_WR)
            except OSError:
                pass

    def close(self) -> None:
        self._sock.close()
        for s in self._socks:
            s.close()


# -- a slow fake transport ------------------------------------------------------------------


class SlowTransport(Transport):
    """Serves reads and writes between engines of this process, slowly on purpose.

    A worker sleeps ``delay`` seconds (waking early when the engine aborts the
    operation), then checks the access on the target engine exactly as a real
    target does (``regions.serve``) and ``memmove``s the bytes. It cannot cancel
    in flight (``inflight_cancel=False``) but honours abort (timeouts) before
    it starts copying, so a timed-out request never lands.
    """

    name: ClassVar[str] = "slow"
    capabilities: ClassVar[Capabilities] = Capabilities(inflight_cancel=False, modes=frozenset({"zero-copy"}))
    default_options: ClassVar[dict[str, Any]] = {"delay": 0.5}
    #: node_id -> that engine's region table (the "network").
    tables: ClassVar[dict[str, Any]] = {}

    def __init__(self, ctx: TransportContext) -> None:
        super().__init__(ctx)
        self.delay = float(ctx.options["delay"])
        self.posted = 0
        self.copied = 0

    def start(self) -> dict[str, Any]:
        SlowTransport.tables[self.ctx.node_id] = self.ctx.regions
        return {"node": self.ctx.node_id}

    def close(self) -> None:
        SlowTransport.tables.pop(self.ctx.node_id, None)

    def post(self, op: Operation) -> None:
        self.posted += 1
        op.state = threading.Event()
        self.ctx.executor.submit(self._run, op)

    def abort(self, op: Operation) -> None:
        if isinstance(op.state, threading.Event):
            op.state.set()

    def _run(self, op: Operation) -> None:
        op.state.wait(self.delay)
        if op.aborted:
            op.fail(op.abort_exc)  # type: ignore[arg-type]
            return
        try:
            table = SlowTransport.tables[op.remote.node_id]
            access = "w" if op.kind == "write" else "r"
            region = table.serve(op.remote.region_id, op.remote.token, op.remote.epoch,
                                 op.remote_offset, op.length, access)
        except mpcomm.MpcommError as exc:
            op.fail(exc)
            return
        except KeyError:
            op.fail(mpcomm.PeerConnectionError("peer engine is gone"))
            return
        try:
            remote = region.slice(op.remote_offset, op.length)
            local = op.local_view
            src, dst = (local, remote) if op.kind == "write" else (remote, local)
            dst[:] = src  # a memmove
            self.copied += 1
        finally:
            region.release()
        op.complete(op.length)


class StuckTransport(SlowTransport):
    """Never finishes a request and ignores abort: the engine's abort grace must fail it."""

    name: ClassVar[str] = "stuck"

    def post(self, op: Operation) -> None:
        self.posted += 1

    def abort(self, op: Operation) -> None:
        pass


def slow_plugin() -> types.ModuleType:
    return plugin_module("slow_fake_plugin", SlowTransport, StuckTransport)
