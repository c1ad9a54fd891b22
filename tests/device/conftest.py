"""GPU tests (issue 31): skipped with the reason "no CUDA device" where there is none.

They need torch with CUDA (the target process registers torch tensors) and,
per transport, that transport's CUDA support (shm: cuda-python; ucx: UCX's
CUDA transports). Run them with scripts/gpu-check.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest

from mpcomm.testing.device_target import DeviceTarget


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
