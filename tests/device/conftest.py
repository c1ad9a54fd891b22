"""GPU tests (issue 31): skipped with the reason "no CUDA device" where there is none.

They need torch with CUDA (the target process registers torch tensors) and,
per transport, that transport's CUDA support (shm: cuda-python; ucx: UCX's
CUDA transports). Run them with scripts/gpu-check.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest


def cuda_skip_reason() -> str | None:
    """None where torch sees a CUDA device, else the reason (starting "no CUDA device")."""
    try:
        import torch
    except ImportError:
        return "no CUDA device (torch is not installed)"
    try:
        if torch.cuda.is_available() and torch.cuda.device_count() > 0:
            return None
    except Exception as exc:  # noqa: BLE001
        return f"no CUDA device ({exc})"
    return "no CUDA device"


REASON = cuda_skip_reason()


def pytest_collection_modifyitems(config: Any, items: list[Any]) -> None:
    if REASON is None:
        return
    here = os.path.dirname(os.path.abspath(__file__))
    for item in items:
        if str(item.fspath).startswith(here):
            item.add_marker(pytest.mark.skip(reason=REASON))


class DeviceTarget:
    """``python -m mpcomm.testing.device_target`` in its own process."""

    def __init__(self, transport: str, size: int) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "mpcomm.testing.device_target", transport, str(size)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline()  # type: ignore[union-attr]
        if not line:
            raise RuntimeError(f"the device target ({transport}) exited with {self.proc.wait(30)}")
        import mpcomm

        self.regions = {n: mpcomm.RemoteRegion.from_dict(d) for n, d in json.loads(line).items()}

    def cmd(self, *words: Any) -> str:
        self.proc.stdin.write(" ".join(map(str, words)) + "\n")  # type: ignore[union-attr]
        self.proc.stdin.flush()  # type: ignore[union-attr]
        return self.proc.stdout.readline().strip()  # type: ignore[union-attr]

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.cmd("quit")
            except (BrokenPipeError, OSError):
                pass
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def transport_cuda_reason(name: str) -> str | None:
    """None where ``name`` runs here and moves CUDA memory, else why not."""
    import mpcomm

    try:
        with mpcomm.Engine(transports=[name], endpoint="127.0.0.1:0") as e:
            st = next(s for s in e.transport_status() if s.name == name)
    except (mpcomm.MpcommError, StopIteration) as exc:
        return f"{name} does not run here: {exc}"
    if "cuda" in st.capabilities["memory_kinds"]:
        return None
    return f"{name}: cuda unavailable: {st.capabilities.get('memory_kinds_unavailable', {}).get('cuda', '?')}"


@pytest.fixture(params=["shm", "ucx"])
def device_target(request: Any) -> Iterator[tuple[str, DeviceTarget]]:
    why = transport_cuda_reason(request.param)
    if why:
        pytest.skip(why)
    t = DeviceTarget(request.param, 64 << 20)
    try:
        yield request.param, t
    finally:
        t.close()
