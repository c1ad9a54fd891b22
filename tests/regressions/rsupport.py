"""Helpers for the request-path regression tests (real processes, real sockets)."""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


class TargetError(RuntimeError):
    """The target process raised; ``kind`` is the exception's class name."""

    def __init__(self, text: str) -> None:
        super().__init__(text)
        self.kind = text.split(":", 1)[0]


class RTarget:
    """A target engine in a child process (``rtarget.py``), driven with Python snippets."""

    def __init__(self, transports: list[str], config: dict[str, Any] | None = None,
                 start_timeout: float = 30.0) -> None:
        spec = {"transports": transports, "config": config or {}}
        self.proc = subprocess.Popen([sys.executable, str(HERE / "rtarget.py"), json.dumps(spec)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)
        try:
            hello = json.loads(self._readline(start_timeout))
        except Exception:
            self.kill()
            raise
        self.address: str = hello["address"]
        self.pid: int = hello["pid"]
        self.stopped = False

    def _readline(self, timeout: float) -> str:
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not ready:
            raise TimeoutError(f"target process did not answer within {timeout}s")
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"target process exited (code {self.proc.poll()})")
        return line

    def _ask(self, req: dict[str, Any], timeout: float) -> Any:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        reply = json.loads(self._readline(timeout))
        if "error" in reply:
            raise TargetError(reply["error"])
        return reply["ok"]

    def run(self, code: str, timeout: float = 30.0) -> None:
        self._ask({"exec": code}, timeout)

    def ev(self, expr: str, timeout: float = 30.0) -> Any:
        return self._ask({"eval": expr}, timeout)

    def stop(self) -> None:
        os.kill(self.pid, signal.SIGSTOP)
        self.stopped = True

    def cont(self) -> None:
        os.kill(self.pid, signal.SIGCONT)
        self.stopped = False

    def kill(self) -> None:
        if self.proc.poll() is None:
            try:
                os.kill(self.proc.pid, signal.SIGCONT)
            except OSError:
                pass
            self.proc.kill()
        self.proc.wait(10)
        for f in (self.proc.stdin, self.proc.stdout):
            try:
                if f is not None:
                    f.close()
            except OSError:
                pass

    def close(self) -> None:
        if self.stopped:
            self.cont()
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.write(json.dumps({"quit": True}) + "\n")
                self.proc.stdin.flush()
                self.proc.wait(5)
            except Exception:  # noqa: BLE001
                pass
        self.kill()


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
