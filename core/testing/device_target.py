"""A target engine with a CUDA region and a pinned host region, in its own process.

    python -m mpcomm.testing.device_target TRANSPORT SIZE

Used by tests/device, ``mpcomm bench --memory`` and benchmarks/bench_device.py
(CUDA IPC maps only another process's memory, so the target must be one).
Memory comes from the CUDA runtime (:mod:`mpcomm.cuda_runtime`: cudaMalloc,
cudaHostAlloc) on the current device, ``$MPCOMM_CUDA_DEVICE`` (default 0).
Prints one JSON line, ``{"dev": descriptor, "host": descriptor}``, then
answers one line per command read from stdin:

    sha NAME OFF LEN     sha256 of the bytes (device bytes copied to the host first)
    sum OFF LEN          sum of the device bytes, by a torch kernel launched right away
                         on torch's current stream, no synchronize first (needs torch)
    fill NAME BYTE       set every byte; "ok" once done
    unregister NAME      Engine.unregister; "ok"
    quit
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import sys

import mpcomm
from mpcomm import cuda_runtime


def _device_bytes(ptr: int, n: int) -> bytes:
    buf = ctypes.create_string_buffer(n)
    cuda_runtime.memcpy(ctypes.addressof(buf), ptr, n)
    return buf.raw


def _sum(ptr: int, n: int, device: int) -> str:
    import torch  # the point is a kernel on the device, ordered after nothing but the transfer

    class _View:
        __cuda_array_interface__ = {"data": (ptr, False), "shape": (n,), "typestr": "|u1", "version": 3}

    t = torch.as_tensor(_View(), device=f"cuda:{device}")
    return str(int(t.to(torch.int64).sum().item()))


class DeviceTarget:
    """This module as a child process: ``.regions`` (``dev``, ``host``), ``.cmd(...)``, ``.close()``."""

    def __init__(self, transport: str, size: int) -> None:
        import subprocess

        self.proc = subprocess.Popen([sys.executable, "-m", "mpcomm.testing.device_target", transport, str(size)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True)
        line = self.proc.stdout.readline()  # type: ignore[union-attr]
        if not line:
            err = self.proc.stderr.read()  # type: ignore[union-attr]
            raise RuntimeError(f"the device target ({transport}) exited with {self.proc.wait(30)}: {err.strip()}")
        self.regions = {n: mpcomm.RemoteRegion.from_dict(d) for n, d in json.loads(line).items()}

    def cmd(self, *words: object) -> str:
        self.proc.stdin.write(" ".join(map(str, words)) + "\n")  # type: ignore[union-attr]
        self.proc.stdin.flush()  # type: ignore[union-attr]
        return self.proc.stdout.readline().strip()  # type: ignore[union-attr]

    def close(self) -> None:
        import subprocess

        if self.proc.poll() is None:
            try:
                self.cmd("quit")
            except (BrokenPipeError, OSError):
                pass
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def main() -> None:
    transport, size = sys.argv[1], int(sys.argv[2])
    why = cuda_runtime.unavailable_reason()
    if why:
        print(f"device_target: no CUDA memory here: {why}", file=sys.stderr)
        sys.exit(2)
    device = int(os.environ.get("MPCOMM_CUDA_DEVICE", "0"))
    dev_ptr = cuda_runtime.malloc(size, device)
    host_ptr = cuda_runtime.host_alloc(size)
    host = memoryview((ctypes.c_char * size).from_address(host_ptr)).cast("B")
    ctypes.memset(host_ptr, 0, size)
    cuda_runtime.memset(dev_ptr, 0, size)
    engine = mpcomm.Engine(transports=[transport], endpoint="127.0.0.1:0")
    regions = {"dev": engine.register(mpcomm.DeviceBuffer(dev_ptr, size, device), "dev"),
               "host": engine.register(host, "host")}
    print(json.dumps({n: json.loads(engine.describe(r).to_bytes()) for n, r in regions.items()}), flush=True)
    for line in sys.stdin:
        cmd, *args = line.split()
        if cmd == "sha":
            off, n = int(args[1]), int(args[2])
            data = _device_bytes(dev_ptr + off, n) if args[0] == "dev" else bytes(host[off : off + n])
            out = hashlib.sha256(data).hexdigest()
        elif cmd == "sum":
            try:
                out = _sum(dev_ptr + int(args[0]), int(args[1]), device)
            except ImportError:
                out = "unsupported: torch is not installed"
        elif cmd == "fill":
            if args[0] == "dev":
                cuda_runtime.memset(dev_ptr, int(args[1]), size)
            else:
                ctypes.memset(host_ptr, int(args[1]), size)
            out = "ok"
        elif cmd == "unregister":
            engine.unregister(regions[args[0]])
            out = "ok"
        else:
            break
        print(out, flush=True)
    engine.close()
    cuda_runtime.free(dev_ptr)
    cuda_runtime.free_host(host_ptr)


if __name__ == "__main__":
    main()
