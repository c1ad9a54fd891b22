"""shm's CUDA IPC path (issue 31) where it cannot run: it says why, and device
regions are never registered with it nor routed through it. The copy path
itself runs in tests/device/ on a GPU."""

from __future__ import annotations

import pytest

import mpcomm
from mpcomm import cuda_runtime
from mpcomm.plugins.shm.transport import ShmTransport
from mpcomm.transport import effective_capabilities

FAKE_PTR = 0x7F00_0000_0000

pytestmark = pytest.mark.skipif(cuda_runtime.unavailable_reason() is None, reason="CUDA works here: see tests/device/")


class FakeCuda:
    """A description of CUDA memory (never dereferenced)."""

    __cuda_array_interface__ = {"data": (FAKE_PTR, False), "shape": (4096,), "typestr": "|u1", "version": 3}

    def __dlpack_device__(self) -> tuple[int, int]:
        return (2, 0)


def test_declares_cuda_and_says_why_not_here() -> None:
    assert "cuda" in ShmTransport.capabilities.memory_kinds
    avail = ShmTransport.memory_kind_availability()["cuda"]
    assert not avail and avail.reason == cuda_runtime.unavailable_reason()
    caps, missing = effective_capabilities(ShmTransport)
    assert caps.memory_kinds == {"host"} and missing == {"cuda": avail.reason}


def test_device_region_not_offered_over_shm() -> None:
    with mpcomm.Engine(transports=["shm"]) as target, mpcomm.Engine(transports=["shm"]) as initiator:
        d = target.describe(target.register(FakeCuda(), "g"))
        assert d.kind == "cuda" and "shm" not in d.transports
        with pytest.raises(mpcomm.MemoryKindUnsupported, match="shm moves local host, remote host"):
            initiator.write(b"x" * 16, d).result(10)
