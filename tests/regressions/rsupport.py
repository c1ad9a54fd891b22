"""Helpers for the request-path regression tests (real processes, real sockets)."""

from __future__ import annotations

import pytest  # noqa: I001 (need() skips)

import json
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any

from mpcomm.testing import LineProcess

HERE = Path(__file__).resolve().parent


class TargetError(RuntimeError):
    """The target process raised; ``kind`` is the exception's class name."""

    def __init__(self, text: str) -> None:
        super().__init__(text)
        self.kind = text.split(":", 1)[0]


class RTarget(LineProcess):
    """A target engine in a child process (``rtarget.py``), driven with Python snippets.

    The kit's line protocol (:class:`mpcomm.testing.LineProcess`) with JSON
    requests: ``run`` executes statements there, ``ev`` returns an expression's value.
    """

    quit_line = json.dumps({"quit": True})
    quit_wait = 5.0

    def __init__(self, transports: list[str], config: dict[str, Any] | None = None,
                 start_timeout: float = 30.0) -> None:
        spec = {"transports": transports, "config": config or {}}
        super().__init__([sys.executable, str(HERE / "rtarget.py"), json.dumps(spec)], start_timeout=start_timeout)
        self.address: str = self.hello["address"]

    def _ask(self, req: dict[str, Any], timeout: float) -> Any:
        reply = json.loads(self.request(json.dumps(req), timeout))
        if "error" in reply:
            raise TargetError(reply["error"])
        return reply["ok"]

    def run(self, code: str, timeout: float = 30.0) -> None:
        self._ask({"exec": code}, timeout)

    def ev(self, expr: str, timeout: float = 30.0) -> Any:
        return self._ask({"eval": expr}, timeout)


class SilentPeer:
    """A loopback listener that accepts TCP connections and never says a word.

    Counts the connections it accepted (single-flight checks) and holds them
    open until closed.
    """

    def __init__(self) -> None:
        self._sock = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self._sock.getsockname()[1]}"
        self.accepted: list[socket.socket] = []
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            self.accepted.append(conn)

    def close(self) -> None:
        self._sock.close()
        for c in self.accepted:
            c.close()


class LoopLag:
    """Largest gap between ticks of an asyncio ticker task (a hang detector, not a benchmark)."""

    def __init__(self) -> None:
        self.max_gap = 0.0
        self._stop = False

    async def run(self) -> None:
        import asyncio

        last = time.monotonic()
        while not self._stop:
            await asyncio.sleep(0.005)
            now = time.monotonic()
            self.max_gap = max(self.max_gap, now - last)
            last = now

    def stop(self) -> None:
        self._stop = True


# -- a transport that is full ------------------------------------------------------------------


def busy_plugin() -> Any:
    """A plugin module with :class:`BusyTransport` (name ``busy``)."""
    from mpcomm.testing import plugin_module

    return plugin_module("busy_fake_plugin", BusyTransport)


def _busy_base() -> Any:
    from mpcomm import Transport

    return Transport


class BusyTransport(_busy_base()):  # type: ignore[misc]
    """Moves bytes between engines of this process with at most ``capacity`` requests in flight;
    beyond that ``post`` raises TransportBusy, as the contract says a full transport does.

    A worker thread takes the requests in order, checks the access on the target
    engine exactly as a real target does (``regions.serve``) and ``memmove``s the
    bytes. With ``finish_on_busy`` the in-flight requests are finished inside the
    refused ``post`` just before it raises: the moment a real transport's worker
    finishes its last request while a new one is being refused, made deterministic.
    """

    from mpcomm import Capabilities as _Caps

    name = "busy"
    capabilities = _Caps(inflight_cancel=False)
    default_options = {"capacity": 1, "finish_on_busy": False}
    tables: dict[str, Any] = {}

    def __init__(self, ctx: Any) -> None:
        super().__init__(ctx)
        self.capacity = int(ctx.options["capacity"])
        self.finish_on_busy = bool(ctx.options["finish_on_busy"])
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._queue: list[Any] = []
        self._inflight = 0
        self.refused = 0
        self._closed = False
        self._worker = threading.Thread(target=self._run, name="busy-worker", daemon=True)

    def start(self) -> dict[str, Any]:
        BusyTransport.tables[self.ctx.node_id] = self.ctx.regions
        self._worker.start()
        return {"node": self.ctx.node_id}

    def close(self) -> None:
        BusyTransport.tables.pop(self.ctx.node_id, None)
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def post(self, op: Any) -> None:
        from mpcomm import TransportBusy

        with self._cond:
            if self._inflight >= self.capacity:
                self.refused += 1
                early = []
                if self.finish_on_busy:
                    early, self._queue[:] = self._queue[:], []
            else:
                self._inflight += 1
                self._queue.append(op)
                self._cond.notify()
                return
        for old in early:
            self._move(old)
        raise TransportBusy(f"{self.capacity} requests in flight")

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                op = self._queue.pop(0)
            time.sleep(0.002)
            self._move(op)

    def _move(self, op: Any) -> None:
        import mpcomm

        try:
            table = BusyTransport.tables[op.remote.node_id]
            region = table.serve(op.remote.region_id, op.remote.token, op.remote.epoch, op.remote_offset,
                                 op.length, "w" if op.kind == "write" else "r")
        except mpcomm.MpcommError as exc:
            self._done()
            op.fail(exc)
            return
        try:
            remote = region.slice(op.remote_offset, op.length)
            src, dst = (op.local_view, remote) if op.kind == "write" else (remote, op.local_view)
            dst[:] = src
        finally:
            region.release()
        self._done()
        op.complete(op.length)

    def _done(self) -> None:
        with self._cond:
            self._inflight -= 1


def available(name: str) -> str | None:
    """None when transport ``name`` can run here, else the reason it cannot."""
    from mpcomm.registry import load_plugins

    entry = load_plugins().transports.get(name)
    if entry is None:
        return f"no plugin provides transport {name!r}"
    avail = entry.cls.availability()
    return None if avail else f"transport {name!r} is not available here: {avail.reason}"


def need(name: str) -> None:
    reason = available(name)
    if reason is not None:
        pytest.skip(reason)
