"""A real ``mpcomm serve`` subprocess for the CLI tests."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
from dataclasses import dataclass
from typing import Any


@dataclass
class Server:
    proc: subprocess.Popen[bytes]
    address: str
    info: dict[str, Any]

    def region(self, name: str) -> dict[str, Any]:
        return next(r for r in self.info["regions"] if r["name"] == name)

    def stop(self, sig: int = signal.SIGTERM) -> tuple[int, str]:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            _, err = self.proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            _, err = self.proc.communicate()
        return self.proc.returncode, err.decode(errors="replace")


def start_server(*args: str, json_out: bool = True, env: dict[str, str] | None = None) -> Server:
    cmd = [sys.executable, "-m", "mpcomm.cli", "serve", "--endpoint", "127.0.0.1:0", "--transport", "tcp", *args]
    if json_out:
        cmd.append("--json")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
                            env={**os.environ, **(env or {})})
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], 30)
    line = proc.stdout.readline().decode() if ready else ""
    if not line:
        proc.kill()
        _, err = proc.communicate()
        raise AssertionError(f"mpcomm serve did not print its address: {err.decode()}")
    if json_out:
        info = json.loads(line)
        return Server(proc, info["address"], info)
    return Server(proc, line.strip(), {})
