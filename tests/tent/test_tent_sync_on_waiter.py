"""The Mooncake API's sync calls reach their caller with no other Python thread running (issue 28 item 2).

waiter_check.py runs in a fresh interpreter (the thread watch is installed before the
TransferEngine starts any thread) against a target process: transfer_sync_write/read and
batch_transfer_sync_write/read, over tcp and over shm.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.mark.parametrize("protocol", ["tcp", "shm"])
def test_sync_calls_complete_on_the_calling_thread(protocol: str) -> None:
    p = subprocess.run([sys.executable, os.path.join(HERE, "waiter_check.py"), protocol], capture_output=True,
                       text=True, timeout=240)
    out = p.stdout + p.stderr
    assert p.returncode == 0 and "passed" in p.stdout, out[-4000:]
