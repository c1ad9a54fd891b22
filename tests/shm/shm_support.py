"""Helpers for the shm tests: target engines in real processes."""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
from pathlib import Path
from typing import Any


import mpcomm

TARGET = str(Path(__file__).with_name("shm_target.py"))


class Target:
    """A target engine in a subprocess, driven over its stdin/stdout."""

    def __init__(self, spec: dict[str, Any], prefix: list[str] | None = None) -> None:
        self.proc = subprocess.Popen([*(prefix or []), sys.executable, TARGET, json.dumps(spec)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        hello = json.loads(self._line(30))
        self.address: str = hello["address"]
        self.pid: int = hello["pid"]

    def _line(self, timeout: float = 20) -> str:
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not ready:
            raise TimeoutError("target did not answer")
        line = self.proc.stdout.readline()
        if not line:
            raise EOFError(f"target exited with {self.proc.poll()}")
        return line.strip()

    def cmd(self, *words: Any, timeout: float = 20) -> str:
        assert self.proc.stdin is not None
        self.proc.stdin.write(" ".join(map(str, words)) + "\n")
        self.proc.stdin.flush()
        return self._line(timeout)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.cmd("quit", timeout=5)
            except (OSError, TimeoutError, EOFError):
                pass
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            self.kill()


def make_engine(config: dict[str, Any] | None = None) -> mpcomm.Engine:
    return mpcomm.Engine(config, transports=["shm", "tcp"])


def is_root() -> bool:
    return os.geteuid() == 0
