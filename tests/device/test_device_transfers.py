"""Device memory end to end (issue 31), on a machine with an NVIDIA GPU: every pair of
(local, remote) memory kinds over each transport whose CUDA support is available, the
completion rule of docs/contract.md §11, and revocation of a device region.

The target is another process (mpcomm.testing.device_target): CUDA IPC maps only
another process's memory. Skipped with "no CUDA device" elsewhere (conftest.py).
"""

from __future__ import annotations

import hashlib
from typing import Any

import pytest

import mpcomm

SIZE = 4 << 20


def _local(kind: str, data: bytes) -> Any:
    import torch

    t = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    if kind == "cuda":
        t = t.to("cuda")
    elif kind == "pinned":
        t = t.pin_memory()
    torch.cuda.synchronize()  # the producer's work is done before posting (the caller's duty)
    return t


def _bytes(t: Any) -> bytes:
    return bytes(t.cpu().numpy().tobytes())


@pytest.mark.parametrize("local_kind", ["cuda", "pinned", "bytearray"])
@pytest.mark.parametrize("remote_name", ["dev", "host"])
def test_write_then_read_every_pair(device_target: Any, local_kind: str, remote_name: str) -> None:
    transport, target = device_target
    data = bytes((i * 7 + 3) % 251 for i in range(SIZE))
    remote = target.regions[remote_name]
    if remote_name == "host" and local_kind != "cuda":
        pytest.skip("host to host is tested everywhere else")
    with mpcomm.Engine(transports=[transport], endpoint="127.0.0.1:0") as e:
        src = bytearray(data) if local_kind == "bytearray" else _local(local_kind, data)
        t = e.write(src, remote, remote_offset=4096)
        assert t.result(60) == SIZE and t.transport == transport
        assert target.cmd("sha", remote_name, 4096, SIZE) == hashlib.sha256(data).hexdigest()
        back = bytearray(SIZE) if local_kind == "bytearray" else _local(local_kind, bytes(SIZE))
        e.read(back, remote, remote_offset=4096).result(60)
        assert (bytes(back) if local_kind == "bytearray" else _bytes(back)) == data


def test_complete_means_visible_to_later_work_on_the_target_device(device_target: Any) -> None:
    """A kernel the target launches right after completion, with no synchronize, sees every byte."""
    transport, target = device_target
    import torch

    with mpcomm.Engine(transports=[transport], endpoint="127.0.0.1:0") as e:
        for round_ in range(5):
            val = 1 + round_
            src = torch.full((SIZE,), val, dtype=torch.uint8, device="cuda")
            torch.cuda.synchronize()
            e.write(src, target.regions["dev"]).result(60)
            assert int(target.cmd("sum", 0, SIZE)) == val * SIZE


def test_registered_device_region_and_4k_writes(device_target: Any) -> None:
    transport, target = device_target
    import torch

    with mpcomm.Engine(transports=[transport], endpoint="127.0.0.1:0") as e:
        src = torch.arange(SIZE, dtype=torch.int64, device="cuda").to(torch.uint8)
        torch.cuda.synchronize()
        region = e.register(src, "src")
        assert region.location == mpcomm.MemoryLocation("cuda", torch.cuda.current_device())
        for off in range(0, 64 * 4096, 4096):
            e.write(region, target.regions["dev"], remote_offset=off, length=4096).result(30)
        want = hashlib.sha256(_bytes(src[:4096]) * 64).hexdigest()
        assert target.cmd("sha", "dev", 0, 64 * 4096) == want
        e.unregister(region)


def test_unregister_revokes_the_mapping(device_target: Any) -> None:
    transport, target = device_target
    import torch

    with mpcomm.Engine(transports=[transport], endpoint="127.0.0.1:0") as e:
        src = torch.ones(4096, dtype=torch.uint8, device="cuda")
        torch.cuda.synchronize()
        e.write(src, target.regions["dev"]).result(30)  # maps the target's memory
        assert target.cmd("unregister", "dev") == "ok"
        with pytest.raises(mpcomm.MpcommError):
            e.write(src, target.regions["dev"]).result(30)


def test_tcp_stages_local_device_memory() -> None:
    """tcp: local CUDA memory through pinned bounce buffers (several chunks), to and from a remote host region."""
    from conftest import transport_cuda_reason

    why = transport_cuda_reason("tcp")
    if why:
        pytest.skip(why)
    from mpcomm.testing.device_target import DeviceTarget

    size = 20 << 20  # > 2 staging chunks of 8 MiB
    data = bytes((i * 13 + 1) % 253 for i in range(size))
    target = DeviceTarget("tcp", size)
    try:
        assert "tcp" in target.regions["host"].transports
        with mpcomm.Engine(transports=["tcp"], endpoint="127.0.0.1:0") as e:
            src = _local("cuda", data)
            assert e.write(src, target.regions["host"]).result(60) == size
            assert target.cmd("sha", "host", 0, size) == hashlib.sha256(data).hexdigest()
            back = _local("cuda", bytes(size))
            e.read(back, target.regions["host"]).result(60)
            assert _bytes(back) == data
            with pytest.raises(mpcomm.MemoryKindUnsupported):  # the target serves host memory only
                e.write(src, target.regions["dev"]).result(60)
    finally:
        target.close()
