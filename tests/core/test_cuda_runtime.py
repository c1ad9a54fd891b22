"""mpcomm.cuda_runtime without CUDA (issue 31): importing mpcomm loads no CUDA library, the
reason is said plainly, and the device target refuses to start with that reason."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from mpcomm import cuda_runtime

pytestmark = pytest.mark.skipif(cuda_runtime.unavailable_reason() is None, reason="CUDA works here: see tests/device/")


def test_import_loads_no_cuda() -> None:
    code = ("import json, sys, mpcomm, mpcomm.cuda_runtime, mpcomm.plugins.shm.transport\n"
            "e = mpcomm.Engine(transports=['tcp'], endpoint='127.0.0.1:0'); e.close()\n"
            "maps = open('/proc/self/maps').read()\n"
            "print(json.dumps({'cuda': [m for m in sys.modules if m == 'cuda' or m.startswith('cuda.')],"
            " 'libcuda': 'libcuda' in maps}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {"cuda": [], "libcuda": False}


def test_reason_and_refusals() -> None:
    why = cuda_runtime.unavailable_reason()
    assert why and ("cuda-python is not installed" in why or "CUDA" in why)
    with pytest.raises(cuda_runtime.CudaUnavailable):
        cuda_runtime.malloc(4096)


def test_device_target_exits_with_the_reason() -> None:
    out = subprocess.run([sys.executable, "-m", "mpcomm.testing.device_target", "shm", "4096"],
                         capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert out.returncode == 2 and out.stdout == ""
    assert "no CUDA memory here: " + cuda_runtime.unavailable_reason() in out.stderr
