"""ucx under load (issue 11): the soak benchmark, shortened, must hold."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from mpcomm.plugins.ucx.transport import UcxTransport

AVAIL = UcxTransport.availability()
SOAK = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "benchmarks", "soak_ucx.py")


@pytest.mark.slow
@pytest.mark.skipif(not AVAIL, reason=f"ucx transport unavailable: {AVAIL.reason}")
def test_soak_8_writers_1024_in_flight():
    """8 writers x 1024 in flight x 64 KiB for 8 s: every request done or failed within its deadline,
    only timeouts may fail, completed writes are in the target's memory, the target lives."""
    out = subprocess.run([sys.executable, SOAK, "--seconds", "8"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "# soak held" in out.stdout, out.stdout[-2000:] + out.stderr[-2000:]
    assert "Assertion" not in out.stderr, out.stderr[-2000:]
