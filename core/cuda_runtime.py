"""The few CUDA runtime calls the transports need, through cuda-python, imported lazily.

mpcomm's core has no CUDA dependency. The ``mpcomm[cuda]`` extra installs
``cuda-bindings`` (NVIDIA's cuda-python low-level bindings; 12.6 or newer,
any 12.x or 13.x release matching the driver: 13.x needs an R580+ driver),
and this module imports it on first use only, from
``cuda.bindings.runtime`` (cuda-bindings >= 12.6) or the older
``cuda.cudart``. Nothing here runs at import time.

:func:`unavailable_reason` says, without raising, why device memory cannot
be moved here (no bindings, no driver, no device). Every other function
raises :class:`CudaError` (a TransferError) with the CUDA error's name.

What is used: ``cudaMemcpy``/``cudaMemcpyAsync`` with ``cudaMemcpyDefault``
(unified addressing picks the direction), ``cudaStreamCreateWithFlags``
(non-blocking stream per copying thread), ``cudaHostAlloc`` (pinned bounce
buffers), ``cudaIpcGetMemHandle``/``cudaIpcOpenMemHandle``/
``cudaIpcCloseMemHandle`` (same-host export), ``cuMemGetAddressRange``
(the IPC handle names an allocation's base), ``cudaPointerGetAttributes``.
"""

from __future__ import annotations

import ctypes
import functools
import threading
from typing import Any

from .errors import TransferError

__all__ = [
    "CudaError",
    "PinnedPool",
    "device_count",
    "ipc_close",
    "ipc_export",
    "ipc_open",
    "load",
    "malloc",
    "memcpy",
    "memset",
    "stream_copy",
    "unavailable_reason",
]

IPC_HANDLE_SIZE = 64  # sizeof(cudaIpcMemHandle_t)


class CudaError(TransferError):
    """A CUDA runtime call failed (the message names the call and the CUDA error)."""


class CudaUnavailable(RuntimeError):
    """cuda-python or a device is missing here; ``str()`` is the reason."""


@functools.lru_cache(maxsize=1)
def _bindings() -> tuple[Any, Any]:
    try:
        from cuda.bindings import driver, runtime  # cuda-bindings >= 12.6
    except ImportError:
        try:
            from cuda import cuda as driver  # type: ignore[no-redef]  # older cuda-python
            from cuda import cudart as runtime  # type: ignore[no-redef]
        except ImportError as exc:
            raise CudaUnavailable(f"cuda-python is not installed (pip install 'mpcomm[cuda]'): {exc}") from None
    return runtime, driver


def load() -> Any:
    """The runtime bindings module; raises CudaUnavailable with the reason."""
    return _bindings()[0]


def _check(result: Any, what: str) -> Any:
    """cuda-python returns ``(error, *values)``: raise on error, return the values."""
    err, *values = result if isinstance(result, tuple) else (result,)
    if int(err) != 0:
        name = getattr(err, "name", str(int(err)))
        raise CudaError(f"{what} failed: {name}")
    return values[0] if len(values) == 1 else tuple(values)


@functools.lru_cache(maxsize=1)
def unavailable_reason() -> str | None:
    """None when this process can move CUDA memory; else why not (cached)."""
    try:
        rt = load()
    except CudaUnavailable as exc:
        return str(exc)
    try:
        n = _check(rt.cudaGetDeviceCount(), "cudaGetDeviceCount")
    except CudaError as exc:
        return f"no usable CUDA driver or device ({exc})"
    except Exception as exc:  # noqa: BLE001 - a bindings/driver mismatch raises its own types
        return f"CUDA runtime unusable: {type(exc).__name__}: {exc}"
    if int(n) < 1:
        return "no CUDA device visible (CUDA_VISIBLE_DEVICES?)"
    return None


def device_count() -> int:
    return int(_check(load().cudaGetDeviceCount(), "cudaGetDeviceCount"))


def malloc(size: int, device: int = 0) -> int:
    """``cudaMalloc`` on ``device`` (benchmarks and test targets); release with :func:`free`."""
    rt = load()
    _check(rt.cudaSetDevice(device), "cudaSetDevice")
    return int(_check(rt.cudaMalloc(size), "cudaMalloc"))


def memset(ptr: int, value: int, n: int) -> None:
    """Synchronous ``cudaMemset`` of device memory."""
    rt = load()
    _check(rt.cudaMemset(ptr, value, n), "cudaMemset")
    _check(rt.cudaDeviceSynchronize(), "cudaDeviceSynchronize")


def free(ptr: int) -> None:
    _check(load().cudaFree(ptr), "cudaFree")


def host_alloc(size: int) -> int:
    """Pinned host memory (``cudaHostAlloc``, portable); release with :func:`free_host`."""
    rt = load()
    return int(_check(rt.cudaHostAlloc(size, rt.cudaHostAllocPortable), "cudaHostAlloc"))


def free_host(ptr: int) -> None:
    _check(load().cudaFreeHost(ptr), "cudaFreeHost")


def memcpy(dst: int, src: int, n: int) -> None:
    """Synchronous copy between any two addresses CUDA knows (host, pinned, device)."""
    rt = load()
    _check(rt.cudaMemcpy(dst, src, n, rt.cudaMemcpyKind.cudaMemcpyDefault), "cudaMemcpy")


_tls = threading.local()


def _stream(device: int) -> Any:
    """This thread's non-blocking stream on ``device`` (made once per thread and device)."""
    streams = getattr(_tls, "streams", None)
    if streams is None:
        streams = _tls.streams = {}
    s = streams.get(device)
    if s is None:
        rt = load()
        _check(rt.cudaSetDevice(device), "cudaSetDevice")
        s = streams[device] = _check(rt.cudaStreamCreateWithFlags(rt.cudaStreamNonBlocking),
                                     "cudaStreamCreateWithFlags")
    return s


def stream_copy(dst: int, src: int, n: int, device: int) -> None:
    """``cudaMemcpyAsync`` on this thread's own stream of ``device``, then wait for it.

    Returning means the bytes are in place and visible to any later work on
    the destination's device (docs/contract.md, "Device memory").
    """
    rt = load()
    s = _stream(device)
    _check(rt.cudaMemcpyAsync(dst, src, n, rt.cudaMemcpyKind.cudaMemcpyDefault, s), "cudaMemcpyAsync")
    _check(rt.cudaStreamSynchronize(s), "cudaStreamSynchronize")


def ipc_export(ptr: int, device: int) -> tuple[bytes, int]:
    """``(handle, offset)``: a CUDA IPC handle of the allocation holding ``ptr`` and ``ptr``'s offset in it."""
    rt = load()
    _, driver = _bindings()
    _check(rt.cudaSetDevice(device), "cudaSetDevice")
    base, _size = _check(driver.cuMemGetAddressRange(ptr), "cuMemGetAddressRange")
    handle = _check(rt.cudaIpcGetMemHandle(int(base)), "cudaIpcGetMemHandle")
    return ctypes.string_at(handle.getPtr(), IPC_HANDLE_SIZE), ptr - int(base)


def ipc_open(handle: bytes, device: int) -> int:
    """Map a peer's allocation into this process (``cudaIpcOpenMemHandle``); returns its base."""
    if len(handle) != IPC_HANDLE_SIZE:
        raise CudaError(f"a CUDA IPC handle is {IPC_HANDLE_SIZE} bytes, not {len(handle)}")
    rt = load()
    h = rt.cudaIpcMemHandle_t()
    ctypes.memmove(h.getPtr(), handle, IPC_HANDLE_SIZE)
    _check(rt.cudaSetDevice(device), "cudaSetDevice")
    return int(_check(rt.cudaIpcOpenMemHandle(h, rt.cudaIpcMemLazyEnablePeerAccess), "cudaIpcOpenMemHandle"))


def ipc_close(base: int) -> None:
    """Unmap what :func:`ipc_open` mapped (the peer's memory is not freed)."""
    _check(load().cudaIpcCloseMemHandle(base), "cudaIpcCloseMemHandle")


class PinnedPool:
    """Pinned host bounce buffers of ``size`` bytes each, at most ``limit`` bytes in all.

    ``take()`` blocks while all are in use (the total stays bounded however
    many copies run); ``give()`` returns one. Freed with :meth:`close`.
    """

    def __init__(self, size: int, limit: int) -> None:
        self.size = size
        self.most = max(1, limit // size)
        self._free: list[int] = []
        self._made = 0
        self._cond = threading.Condition()

    def take(self, timeout: float | None = None) -> int:
        with self._cond:
            while not self._free and self._made >= self.most:
                if not self._cond.wait(timeout):
                    raise CudaError(f"no pinned bounce buffer free within {timeout}s")
            if self._free:
                return self._free.pop()
            self._made += 1
        rt = load()
        try:
            return int(_check(rt.cudaHostAlloc(self.size, rt.cudaHostAllocPortable), "cudaHostAlloc"))
        except BaseException:
            with self._cond:
                self._made -= 1
                self._cond.notify()
            raise

    def give(self, ptr: int) -> None:
        with self._cond:
            self._free.append(ptr)
            self._cond.notify()

    def close(self) -> None:
        with self._cond:
            free, self._free = self._free, []
            self._made -= len(free)
        for p in free:
            try:
                _check(load().cudaFreeHost(p), "cudaFreeHost")
            except Exception:  # noqa: BLE001 - closing: nothing to report to
                pass
