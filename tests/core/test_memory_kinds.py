"""Memory kinds (issue 31): locations, DLPack / __cuda_array_interface__ parsing,
what Engine.register makes of each kind of object, and the refusal at submit
when no transport moves a request's pair of kinds.

No GPU here: the CUDA-side objects are small fakes that expose the protocols'
*descriptions* (``__dlpack_device__`` returning ``(2, 0)``, a
``__cuda_array_interface__`` dict). They are parsing inputs only: nothing
ever reads or writes through their pointers, and every transfer tested here
is refused before it moves a byte. Real device transfers are in tests/device/.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import mpcomm
from mpcomm import DeviceBuffer, MemoryKindUnsupported, MemoryLocation, RegionError
from mpcomm.memory import region_of
from mpcomm.metadata import MetadataStore, RegionRecord
from mpcomm.memory_kinds import (
    HOST,
    cuda_array_interface,
    dlpack_location,
    dlpack_tensor,
    location_of,
    normalize_kind,
)

#: An address no test dereferences (the fakes below are descriptions, not memory).
FAKE_PTR = 0x7F00_0000_0000


class FakeCudaArray:
    """Describes a CUDA array the way CuPy / torch do; never dereferenced."""

    def __init__(self, nbytes: int = 1 << 20, device: tuple[int, int] | None = (2, 0), *,
                 shape: tuple[int, ...] | None = None, typestr: str = "|u1", strides: Any = None,
                 readonly: bool = False, mask: Any = None) -> None:
        self._dev = device
        self._cai = {"data": (FAKE_PTR, readonly), "shape": shape or (nbytes,), "typestr": typestr,
                     "strides": strides, "version": 3}
        if mask is not None:
            self._cai["mask"] = mask

    def __dlpack_device__(self) -> tuple[int, int]:
        assert self._dev is not None
        return self._dev

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        return self._cai


class OnlyCai:
    """A ``__cuda_array_interface__`` object with no DLPack (numba-style)."""

    __cuda_array_interface__ = {"data": (FAKE_PTR, False), "shape": (64,), "typestr": "<f4", "version": 2}


class DlpackOnly:
    """A CPU tensor that is not a PEP 688 buffer (as torch CPU tensors are not): DLPack only."""

    def __init__(self, arr: np.ndarray) -> None:
        self.arr = arr

    def __dlpack__(self, **kw: Any) -> Any:
        return self.arr.__dlpack__(**kw)

    def __dlpack_device__(self) -> tuple[int, int]:
        return self.arr.__dlpack_device__()


# -- locations -------------------------------------------------------------------------


def test_location_text_round_trips() -> None:
    assert str(HOST) == "host" and HOST.is_host and HOST.device == -1
    assert str(MemoryLocation("cuda", 3)) == "cuda:3"
    assert MemoryLocation.parse("cuda:3") == MemoryLocation("cuda", 3)
    assert MemoryLocation.parse("cuda") == MemoryLocation("cuda", 0)
    assert MemoryLocation.parse("device:1") == MemoryLocation("cuda", 1)  # the config's older spelling
    assert MemoryLocation.parse("host") is HOST


@pytest.mark.parametrize("bad", ["host:0", "cuda:x", "rocm:0", ""])
def test_location_parse_refuses(bad: str) -> None:
    with pytest.raises(ValueError):
        MemoryLocation.parse(bad)


def test_location_invariants() -> None:
    with pytest.raises(ValueError, match="no device ordinal"):
        MemoryLocation("host", 0)
    with pytest.raises(ValueError, match="needs a device ordinal"):
        MemoryLocation("cuda", -1)
    assert normalize_kind("device") == "cuda" and normalize_kind("host") == "host"
    with pytest.raises(ValueError, match="unknown memory kind 'tpu'"):
        normalize_kind("tpu")


def test_device_buffer_location() -> None:
    assert DeviceBuffer(FAKE_PTR, 10, 2).location == MemoryLocation("cuda", 2)
    assert DeviceBuffer(FAKE_PTR, 10, "cuda:1").location == MemoryLocation("cuda", 1)
    assert DeviceBuffer(FAKE_PTR, 10, MemoryLocation("cuda", 4)).location.device == 4


# -- DLPack ----------------------------------------------------------------------------


def test_numpy_dlpack_device_is_host() -> None:
    assert dlpack_location(np.zeros(4)) is HOST
    assert location_of(np.zeros(4)) is HOST
    assert location_of(bytearray(4)) is HOST


@pytest.mark.parametrize("dev, want", [((2, 0), "cuda:0"), ((2, 5), "cuda:5"), ((3, 0), "host"), ((1, 0), "host")])
def test_dlpack_device_types(dev: tuple[int, int], want: str) -> None:
    assert str(dlpack_location(FakeCudaArray(device=dev))) == want


@pytest.mark.parametrize("dev, name", [((13, 0), "kDLCUDAManaged"), ((10, 0), "device type 10")])
def test_dlpack_unsupported_device_types_are_named(dev: tuple[int, int], name: str) -> None:
    with pytest.raises(RegionError, match=name):
        dlpack_location(FakeCudaArray(device=dev))


def test_dlpack_capsule_of_a_numpy_array() -> None:
    arr = np.arange(24, dtype=np.float32).reshape(4, 6)
    info = dlpack_tensor(arr.__dlpack__())
    assert info.ptr == arr.ctypes.data
    assert info.nbytes == arr.nbytes == 96
    assert info.location is HOST and info.shape == (4, 6) and info.itemsize == 4


@pytest.mark.parametrize("view", [lambda a: a[:, ::2], lambda a: a.T])
def test_dlpack_capsule_refuses_non_contiguous(view: Callable[[np.ndarray], np.ndarray]) -> None:
    arr = np.zeros((4, 6), dtype=np.int16)
    with pytest.raises(RegionError, match="non-contiguous"):
        dlpack_tensor(view(arr).__dlpack__())


def test_dlpack_capsule_with_a_byte_offset() -> None:
    arr = np.arange(16, dtype=np.uint8)
    part = arr[5:]
    info = dlpack_tensor(part.__dlpack__())
    assert info.ptr == arr.ctypes.data + 5 and info.nbytes == 11


# -- __cuda_array_interface__ -------------------------------------------------------------


def test_cuda_array_interface_parsing() -> None:
    assert cuda_array_interface(FakeCudaArray(shape=(2, 3), typestr="<f4")) == (FAKE_PTR, 24, False)
    assert cuda_array_interface(FakeCudaArray(shape=(2, 3), typestr="<f8", strides=(24, 8)))[1] == 48
    assert cuda_array_interface(FakeCudaArray(readonly=True))[2] is True
    assert cuda_array_interface(FakeCudaArray(shape=(0,)))[1] == 0


def test_cuda_array_interface_refusals() -> None:
    with pytest.raises(RegionError, match="non-contiguous"):
        cuda_array_interface(FakeCudaArray(shape=(2, 3), typestr="<f4", strides=(4, 8)))
    with pytest.raises(RegionError, match="masked"):
        cuda_array_interface(FakeCudaArray(mask=object()))
    with pytest.raises(RegionError, match="typestr"):
        cuda_array_interface(FakeCudaArray(typestr="?"))

    class Broken:
        __cuda_array_interface__ = {"shape": (4,)}

    with pytest.raises(RegionError, match="malformed __cuda_array_interface__"):
        cuda_array_interface(Broken())


# -- what a buffer becomes ----------------------------------------------------------------


def test_region_of_host_objects() -> None:
    arr = np.arange(8, dtype=np.uint8)
    r = region_of(arr, name="a")
    assert r.location is HOST and r.kind == "host" and r.device == -1 and r.address == arr.ctypes.data

    # A DLPack-only CPU tensor is host memory too; the region aliases its bytes.
    t = DlpackOnly(np.zeros(16, dtype=np.uint8))
    r = region_of(t, name="t")
    assert r.location is HOST and r.size == 16 and r.address == t.arr.ctypes.data
    r.view[3] = 7
    assert t.arr[3] == 7


def test_region_of_device_objects() -> None:
    r = region_of(FakeCudaArray(nbytes=4096, device=(2, 1)), name="g")
    assert (r.kind, r.device, r.size, r.address, r.view) == ("cuda", 1, 4096, FAKE_PTR, None)
    assert r.numa_node is None
    with pytest.raises(RegionError, match="cuda:1 memory"):
        r.slice(0, 1)
    assert region_of(FakeCudaArray(readonly=True), name="ro").access == "r"
    assert region_of(OnlyCai(), name="c").location == MemoryLocation("cuda", 0)
    d = region_of(DeviceBuffer(FAKE_PTR, 100, 3), name="d")
    assert (d.kind, d.device, d.size) == ("cuda", 3, 100)


def test_region_of_refusals() -> None:
    with pytest.raises(RegionError, match="neither __dlpack__ nor __cuda_array_interface__"):
        region_of(object(), name="x")
    with pytest.raises(RegionError, match="positive integer"):
        region_of(DeviceBuffer(0, 100, 0), name="x")
    with pytest.raises(RegionError, match="empty"):
        region_of(DeviceBuffer(FAKE_PTR, 0, 0), name="x")
    with pytest.raises(RegionError, match="register host memory as a buffer"):
        region_of(DeviceBuffer(FAKE_PTR, 10, "host"), name="x")
    with pytest.raises(RegionError, match="kDLCUDAManaged"):
        region_of(FakeCudaArray(device=(13, 0)), name="x")


# -- the engine ----------------------------------------------------------------------------


def test_register_keeps_host_behaviour_and_owner(make_engine: Callable[..., mpcomm.Engine]) -> None:
    target, initiator = make_engine(), make_engine()
    arr = np.zeros(4096, dtype=np.uint8)
    r = target.register(arr, "host")
    d = target.describe(r)
    assert (d.kind, d.device, d.location) == ("host", -1, HOST) and "tcp" in d.transports
    initiator.write(b"\x05" * 100, d).result(10)
    assert arr[:100].tolist() == [5] * 100


class RecordingStore(MetadataStore):
    """A metadata store that keeps what the engine publishes (the interface's own no-op base)."""

    def __init__(self) -> None:
        self.published: dict[str, RegionRecord] = {}

    def publish_region(self, record: RegionRecord) -> None:
        self.published[record.name] = record


def test_dlpack_only_cpu_tensor_moves_as_host_memory(make_engine: Callable[..., mpcomm.Engine]) -> None:
    """A CPU tensor that is not a PEP 688 buffer (torch's are not) registers and moves as host memory."""
    target, initiator = make_engine(), make_engine()
    dst = DlpackOnly(np.zeros(4096, dtype=np.uint8))
    r = target.register(dst, "t")
    assert r.location is HOST
    d = target.describe(r)
    src = DlpackOnly(np.arange(4096, dtype=np.uint32).astype(np.uint8))
    initiator.write(src, d).result(10)  # a plain local object: registered for this request only
    assert (dst.arr == src.arr).all()
    back = DlpackOnly(np.zeros(4096, dtype=np.uint8))
    initiator.read(back, d).result(10)
    assert (back.arr == src.arr).all()


def test_register_device_memory(make_engine: Callable[..., mpcomm.Engine]) -> None:
    store = RecordingStore()
    target = make_engine(metadata=store)
    fake = FakeCudaArray(nbytes=1 << 16, device=(2, 0))
    r = target.register(fake, "kv")
    assert r.location == MemoryLocation("cuda", 0)
    d = target.describe(r)
    assert (d.kind, d.device, str(d.location), d.base_address) == ("cuda", 0, "cuda:0", FAKE_PTR)
    assert "tcp" not in d.transports  # tcp has no CUDA support here: it never saw the region
    again = mpcomm.RemoteRegion.from_bytes(d.to_bytes())
    assert (again.kind, again.device) == ("cuda", 0)
    rec = store.published["kv"]
    assert (rec.kind, rec.device) == ("cuda", 0)
    assert RegionRecord.from_dict(json.loads(rec.to_json())) == rec
    assert "memory=cuda:0" in repr(r)
    target.unregister(r)  # no view to release: fine


def test_no_transport_moves_the_pair(make_engine: Callable[..., mpcomm.Engine]) -> None:
    target, initiator = make_engine(), make_engine()
    arr = np.zeros(4096, dtype=np.uint8)
    host = target.describe(target.register(arr, "host"))
    dev = target.describe(target.register(FakeCudaArray(nbytes=4096), "dev"))
    # host -> remote cuda: refused at submit, naming both kinds
    with pytest.raises(MemoryKindUnsupported) as ei:
        initiator.write(b"x" * 64, dev).result(10)
    assert (ei.value.local_kind, ei.value.remote_kind) == ("host", "cuda")
    assert "local host memory to/from remote cuda memory" in str(ei.value)
    assert "tcp moves local host, remote host" in str(ei.value)
    from mpcomm import cuda_runtime

    if cuda_runtime.unavailable_reason():  # and why tcp cannot move CUDA memory on this machine
        assert f"tcp: cuda unavailable here: {cuda_runtime.unavailable_reason()}" in str(ei.value)
    assert isinstance(ei.value, mpcomm.TransportUnavailable)
    # local cuda -> remote host: the same, the other way round; nothing was written
    with pytest.raises(MemoryKindUnsupported, match="local cuda memory to/from remote host"):
        initiator.write(DeviceBuffer(FAKE_PTR, 64, 0), host).result(10)
    src = initiator.register(FakeCudaArray(nbytes=64), "src")
    with pytest.raises(MemoryKindUnsupported):
        initiator.write(src, host).result(10)
    assert not arr.any()


def test_transport_status_names_unavailable_kinds(make_engine: Callable[..., mpcomm.Engine]) -> None:
    e = make_engine()
    for st in e.transport_status():
        caps = st.capabilities
        assert "remote_memory_kinds" in caps
        if "cuda" in caps.get("memory_kinds_unavailable", {}):
            assert "cuda" not in caps["memory_kinds"] and caps["memory_kinds_unavailable"]["cuda"]
