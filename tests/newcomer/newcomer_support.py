"""Helpers of the new-user tests: real ``mpcomm`` processes, a real ``mpcomm serve``."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def cli_env(**extra: str) -> dict[str, str]:
    """The environment of a user's shell: this venv's ``mpcomm`` first on PATH, no inherited mpcomm settings."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MPCOMM_")}
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    env["COLUMNS"] = "80"
    env.update(extra)
    return env


def mpcomm(*args: Any, cwd: Path | None = None, timeout: float = 120, env: dict[str, str] | None = None,
           ) -> subprocess.CompletedProcess[str]:
    """Run ``python -m mpcomm.cli ARGS`` as a separate process."""
    return subprocess.run([sys.executable, "-m", "mpcomm.cli", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, cwd=cwd, env=env or cli_env())


@dataclass
class Serve:
    proc: subprocess.Popen[str]
    address: str
    info: dict[str, Any]

    def region(self, name: str) -> dict[str, Any]:
        return next(r for r in self.info["regions"] if r["name"] == name)

    def stop(self) -> tuple[int, str]:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            _, err = self.proc.communicate(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            _, err = self.proc.communicate()
        return self.proc.returncode, err


def start_serve(*args: Any, prefix: list[str] | None = None, env: dict[str, str] | None = None) -> Serve:
    """``mpcomm serve ARGS --json`` in the background; returns once it printed its address."""
    cmd = [*(prefix or []), sys.executable, "-m", "mpcomm.cli", "serve", *map(str, args), "--json"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True,
                            env=env or cli_env())
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], 30)
    line = proc.stdout.readline() if ready else ""
    if not line:
        proc.kill()
        _, err = proc.communicate()
        raise AssertionError(f"mpcomm serve did not start: {err}")
    info = json.loads(line)
    return Serve(proc, info["address"], info)
