"""Mooncake's own TENT MPCOMM tests, built against mpcomm's provider, run here.

Build Mooncake with ``-DUSE_TENT=ON -DUSE_MPCOMM=ON -DBUILD_UNIT_TESTS=ON
-DMPCOMM_ROOT=<the mpcomm package dir>`` (docs/tent.md) and point
``MOONCAKE_BUILD`` at its build directory. ``tent_mpcomm_boundary_test`` needs
no provider at run time; ``tent_mpcomm_transport_test`` forks a target and
moves a WRITE and a READ through TENT's MPCOMM transport, i.e. through
libmpcomm.so and mpcomm's core. Loopback only: the segments advertise
127.0.0.1 (``MC_TENT_CONF``) and the provider binds it (``MPCOMM_TENT_BIND``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mpcomm.tent.build import native_status

TESTS = Path("mooncake-transfer-engine/tent/tests")
GATES = {name: {"enable": name == "mpcomm"}
         for name in ("mpcomm", "rdma", "tcp", "shm", "nvlink", "mnnvl", "gds", "io_uring")}


def _exe(name: str) -> Path:
    build = os.environ.get("MOONCAKE_BUILD")
    if not build:
        pytest.skip("set MOONCAKE_BUILD to a Mooncake build dir configured with USE_TENT, USE_MPCOMM, BUILD_UNIT_TESTS")
    exe = Path(build) / TESTS / name
    if not exe.exists():
        pytest.skip(f"{exe} is not built (make {name})")
    return exe


def _env() -> dict[str, str]:
    st = native_status()
    env = dict(os.environ, MPCOMM_TENT_BIND="127.0.0.1", GLOG_minloglevel="1", MPCOMM_PYTHON=sys.executable,
               MC_TENT_CONF=json.dumps({"rpc_server_hostname": "127.0.0.1", "transports": GATES}))
    if st["built"]:
        env["LD_LIBRARY_PATH"] = f"{st['root']}/lib:" + env.get("LD_LIBRARY_PATH", "")
    return env


@pytest.mark.parametrize("name", ["tent_mpcomm_boundary_test", "tent_mpcomm_transport_test"])
def test_mooncake_tent_mpcomm_tests(name: str) -> None:
    exe = _exe(name)
    proc = subprocess.run([str(exe)], capture_output=True, text=True, timeout=600, env=_env())
    print(proc.stdout[-4000:])
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "SKIPPED" not in proc.stdout, "Mooncake's test skipped itself: " + proc.stdout[-2000:]
