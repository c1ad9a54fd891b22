"""Memory kinds: where a registered region's bytes live, and how to find out.

A region has a :class:`MemoryLocation`: its *kind* (``"host"``, or ``"cuda"``
with the device ordinal) names what can reach the bytes. Transports declare
the kinds they move (``Capabilities.memory_kinds`` for the local side,
``remote_memory_kinds`` for the peer's); the router never picks one that
cannot move a request's pair of kinds.

What :meth:`Engine.register <mpcomm.Engine.register>` accepts, in this order:

* a :class:`DeviceBuffer` (a raw device pointer, a size and a device);
* any PEP 688 buffer (``bytearray``, ``mmap``, a numpy array): host memory;
* an object with ``__cuda_array_interface__`` (CuPy, torch CUDA tensors):
  contiguous only; the device comes from ``__dlpack_device__`` when the
  object has it, else from its ``device`` attribute (CuPy's ``.id``, torch's
  ``.index``), else 0;
* an object with ``__dlpack__`` / ``__dlpack_device__`` (torch, JAX, ...):
  a CPU or pinned-host one registers as host memory, a CUDA one as ``cuda``.

Everything here is pure Python (ctypes for the DLPack capsule); nothing
imports a CUDA library. DLPack device types (dlpack.h): kDLCPU = 1,
kDLCUDA = 2, kDLCUDAHost = 3 (pinned host memory), kDLCUDAManaged = 13.

Public API: :class:`MemoryLocation`, :class:`DeviceBuffer`, :data:`HOST`,
:func:`normalize_kind`, :func:`location_of`, :func:`dlpack_location`,
:func:`cuda_array_interface`, :func:`dlpack_tensor`.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any

from .errors import RegionError

__all__ = [
    "CUDA",
    "DLPACK_DEVICE_TYPES",
    "HOST",
    "KINDS",
    "DeviceBuffer",
    "DLTensorInfo",
    "MemoryLocation",
    "cuda_array_interface",
    "dlpack_location",
    "dlpack_tensor",
    "location_of",
    "normalize_kind",
]

#: Kinds mpcomm knows; a transport may declare only these.
KINDS = ("host", "cuda")
#: Older spellings accepted in configuration (``memory.types``, ``[[route]]``).
_ALIASES = {"device": "cuda", "gpu": "cuda"}

#: DLPack ``DLDeviceType`` codes mpcomm understands, with the kind each maps to
#: (None: known, but not a kind any transport moves).
DLPACK_DEVICE_TYPES: dict[int, tuple[str, str | None]] = {
    1: ("kDLCPU", "host"),
    2: ("kDLCUDA", "cuda"),
    3: ("kDLCUDAHost", "host"),  # pinned host memory: the CPU reaches it like any host page
    13: ("kDLCUDAManaged", None),  # unified memory: migrates between host and device on its own
}


def normalize_kind(kind: str) -> str:
    """``"device"`` -> ``"cuda"``; ``"host"``/``"cuda"`` unchanged; anything else is a ValueError."""
    k = _ALIASES.get(kind, kind)
    if k not in KINDS:
        raise ValueError(f"unknown memory kind {kind!r} (known: {', '.join(KINDS)}; 'device' means cuda)")
    return k


@dataclass(frozen=True, order=True)
class MemoryLocation:
    """Where a region's bytes live: ``kind`` and, for device memory, ``device`` (ordinal).

    ``str()`` gives ``"host"`` or ``"cuda:0"``; :meth:`parse` reads it back.
    """

    kind: str = "host"
    device: int = -1

    def __post_init__(self) -> None:
        if not isinstance(self.kind, str) or not self.kind:
            raise ValueError(f"memory kind must be a non-empty string, not {self.kind!r}")
        if not isinstance(self.device, int) or isinstance(self.device, bool):
            raise ValueError(f"device ordinal must be an integer, not {self.device!r}")
        if self.kind == "host" and self.device != -1:
            raise ValueError("host memory has no device ordinal")
        if self.kind != "host" and self.device < 0:
            raise ValueError(f"{self.kind} memory needs a device ordinal >= 0, not {self.device}")

    @property
    def is_host(self) -> bool:
        return self.kind == "host"

    def __str__(self) -> str:
        return "host" if self.kind == "host" else f"{self.kind}:{self.device}"

    @classmethod
    def parse(cls, text: str) -> MemoryLocation:
        """``"host"``, ``"cuda"`` (device 0), ``"cuda:3"``, ``"device:1"``."""
        kind, _, dev = str(text).partition(":")
        kind = normalize_kind(kind.strip())
        if kind == "host":
            if dev:
                raise ValueError(f"host memory has no device ordinal: {text!r}")
            return HOST
        try:
            ordinal = int(dev) if dev else 0
        except ValueError:
            raise ValueError(f"bad device ordinal in {text!r}") from None
        return cls(kind, ordinal)


HOST = MemoryLocation()


def CUDA(device: int = 0) -> MemoryLocation:  # noqa: N802 - reads like a constant
    """The location of memory on CUDA device ``device``."""
    return MemoryLocation("cuda", device)


@dataclass(frozen=True)
class DeviceBuffer:
    """Device memory named by a raw pointer: ``DeviceBuffer(ptr, size, device)``.

    ``device`` is a CUDA ordinal (int), a :class:`MemoryLocation` or a string
    such as ``"cuda:1"``. ``owner`` (optional) is kept alive while the region
    is registered, as mpcomm keeps a host buffer's exporter alive: pass the
    object whose lifetime holds the allocation. ``readonly`` registers it as
    a source only.
    """

    ptr: int
    size: int
    device: Any = 0
    owner: Any = None
    readonly: bool = False

    @property
    def location(self) -> MemoryLocation:
        d = self.device
        if isinstance(d, MemoryLocation):
            return d
        if isinstance(d, str):
            return MemoryLocation.parse(d)
        return MemoryLocation("cuda", d)


# -- DLPack ----------------------------------------------------------------------------


def dlpack_location(obj: Any) -> MemoryLocation | None:
    """The location ``obj.__dlpack_device__()`` reports, None when it has none.

    Raises RegionError for a device type mpcomm cannot move (managed memory,
    ROCm, ...), naming it.
    """
    fn = getattr(obj, "__dlpack_device__", None)
    if fn is None:
        return None
    try:
        dev = fn()
        dtype, ordinal = int(dev[0]), int(dev[1])
    except Exception as exc:  # noqa: BLE001 - a broken exporter is the caller's problem, said plainly
        raise RegionError(f"cannot register {type(obj).__name__}: __dlpack_device__() failed ({exc})") from exc
    name, kind = DLPACK_DEVICE_TYPES.get(dtype, (f"device type {dtype}", None))
    if kind is None:
        raise RegionError(f"cannot register {type(obj).__name__}: DLPack {name} memory is not supported "
                          f"(mpcomm moves {', '.join(KINDS)} memory)")
    return HOST if kind == "host" else MemoryLocation(kind, ordinal)


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", _DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", _DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


_capsule_get = ctypes.pythonapi.PyCapsule_GetPointer
_capsule_get.argtypes = [ctypes.py_object, ctypes.c_char_p]
_capsule_get.restype = ctypes.c_void_p
_capsule_valid = ctypes.pythonapi.PyCapsule_IsValid
_capsule_valid.argtypes = [ctypes.py_object, ctypes.c_char_p]
_capsule_valid.restype = ctypes.c_int


@dataclass(frozen=True)
class DLTensorInfo:
    """What a DLPack capsule describes: the first byte, the size, where it lives."""

    ptr: int
    nbytes: int
    location: MemoryLocation
    device_type: int
    shape: tuple[int, ...]
    itemsize: int


def dlpack_tensor(capsule: Any, owner_name: str = "object") -> DLTensorInfo:
    """Read a ``"dltensor"`` capsule (the result of ``__dlpack__()``); C-contiguous only.

    The capsule is not consumed: whoever holds it keeps the memory alive, and
    its destructor releases the producer's tensor when it is dropped.
    """
    if not _capsule_valid(capsule, b"dltensor"):
        raise RegionError(f"cannot register {owner_name}: __dlpack__() did not return an unused 'dltensor' capsule")
    managed = _capsule_get(capsule, b"dltensor")
    t = _DLTensor.from_address(managed)  # DLManagedTensor starts with its DLTensor
    ndim = int(t.ndim)
    shape = tuple(int(t.shape[i]) for i in range(ndim))
    bits = int(t.dtype.bits) * int(t.dtype.lanes or 1)
    if bits % 8:
        raise RegionError(f"cannot register {owner_name}: {bits}-bit elements are not whole bytes")
    itemsize = bits // 8
    count = 1
    for n in shape:
        count *= n
    if t.strides and count:
        expected = 1
        for i in reversed(range(ndim)):
            if shape[i] != 1 and int(t.strides[i]) != expected:
                raise RegionError(f"cannot register a non-contiguous {owner_name} (shape {shape}, strides "
                                  f"{tuple(int(t.strides[j]) for j in range(ndim))} in elements); "
                                  "copy it into a contiguous one first")
            expected *= shape[i]
    dtype = int(t.device.device_type)
    name, kind = DLPACK_DEVICE_TYPES.get(dtype, (f"device type {dtype}", None))
    if kind is None:
        raise RegionError(f"cannot register {owner_name}: DLPack {name} memory is not supported")
    loc = HOST if kind == "host" else MemoryLocation(kind, int(t.device.device_id))
    return DLTensorInfo(int(t.data or 0) + int(t.byte_offset), count * itemsize, loc, dtype, shape, itemsize)


# -- __cuda_array_interface__ --------------------------------------------------------------


def _typestr_size(typestr: str) -> int:
    try:
        return int(typestr[2:])
    except (ValueError, TypeError, IndexError):
        raise RegionError(f"__cuda_array_interface__ typestr {typestr!r} is not understood") from None


def cuda_array_interface(obj: Any) -> tuple[int, int, bool]:
    """``(pointer, nbytes, readonly)`` of an object's ``__cuda_array_interface__`` (v2/v3).

    Only C-contiguous arrays: ``strides`` must be absent/None or equal the
    contiguous strides; anything else is a RegionError that says so. A mask
    is refused too.
    """
    cai = getattr(obj, "__cuda_array_interface__", None)
    if not isinstance(cai, dict):
        raise RegionError(f"cannot register {type(obj).__name__}: __cuda_array_interface__ is not a dict")
    try:
        data = cai["data"]
        shape = tuple(int(n) for n in cai["shape"])
        typestr = cai["typestr"]
    except (KeyError, TypeError, ValueError) as exc:
        raise RegionError(f"cannot register {type(obj).__name__}: malformed __cuda_array_interface__ "
                          f"({type(exc).__name__}: {exc})") from None
    if not (isinstance(data, (tuple, list)) and len(data) == 2):
        raise RegionError(f"cannot register {type(obj).__name__}: __cuda_array_interface__ 'data' must be "
                          "(pointer, read_only)")
    if cai.get("mask") is not None:
        raise RegionError(f"cannot register a masked {type(obj).__name__}")
    itemsize = _typestr_size(typestr)
    count = 1
    for n in shape:
        count *= n
    strides = cai.get("strides")
    if strides is not None and count:
        expected = itemsize
        for n, s in zip(reversed(shape), reversed(tuple(int(x) for x in strides))):
            if n != 1 and s != expected:
                raise RegionError(f"cannot register a non-contiguous {type(obj).__name__} (shape {shape}, "
                                  f"strides {tuple(strides)} in bytes); copy it into a contiguous one first")
            expected *= n
    return int(data[0] or 0), count * itemsize, bool(data[1])


# -- what a buffer is ------------------------------------------------------------------


def _is_buffer(obj: Any) -> bool:
    try:
        memoryview(obj).release()
    except TypeError:
        return False
    return True


def location_of(obj: Any) -> MemoryLocation:
    """Where ``obj``'s bytes live, without registering anything (see the module docstring)."""
    if isinstance(obj, DeviceBuffer):
        return obj.location
    if _is_buffer(obj):
        return HOST
    loc = dlpack_location(obj)
    if loc is not None:
        return loc
    if hasattr(obj, "__cuda_array_interface__"):
        return CUDA(_cai_device(obj))
    raise RegionError(f"cannot register {type(obj).__name__}: not a buffer, and it exposes neither "
                      "__dlpack__ nor __cuda_array_interface__")


def _cai_device(obj: Any) -> int:
    """The CUDA ordinal of a ``__cuda_array_interface__`` object that has no ``__dlpack_device__``."""
    dev = getattr(obj, "device", None)
    for attr in ("id", "index"):  # CuPy's Device.id, torch.device.index
        v = getattr(dev, attr, None)
        if isinstance(v, int):
            return v
    return 0
