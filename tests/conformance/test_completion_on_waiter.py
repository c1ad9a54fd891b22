"""Completion without another Python thread (issue 28 item 2), for each transport between two processes.

Each case runs :func:`mpcomm.testing.completion.check_completion_on_waiter` in a fresh
interpreter, so the profile that watches every Python thread is installed before the
engine starts any: single requests, write_many/read_many and submit of several, each
waited on with result(), must run Python on the waiting thread only.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

CASES = [
    pytest.param("shm", "alloc", 0, None, id="shm-memfd"),
    pytest.param("shm", "buf", 0, None, id="shm-cma"),
    # Past inline_threshold (here 1 MiB singles and the 8x4 KiB batches) copies are posted: the
    # waiter claims them and copies on its own thread.
    pytest.param("shm", "alloc", 1 << 20, {"plugins": {"shm": {"inline_threshold": 16 << 10}}}, id="shm-posted-memfd"),
    pytest.param("shm", "buf", 1 << 20, {"plugins": {"shm": {"inline_threshold": 16 << 10}}}, id="shm-posted-cma"),
    pytest.param("tcp", "buf", 0, None, id="tcp"),
    # A notifying write: the note rides on the WRITE frame (Transport.carries_notification), so
    # no notify worker runs for it.
    pytest.param("tcp", "buf", 0, {"notify": True}, id="tcp-notify"),
    # A striped request (two frames on two connections) and a batch of several frames.
    pytest.param("tcp", "buf", 256 << 10,
                 {"plugins": {"tcp": {"stripe_threshold": 128 << 10, "connections": 2, "max_batch": 4}}},
                 id="tcp-striped"),
    pytest.param("ucx", "alloc", 0, None, id="ucx"),
    # UCX over tcp needs the target's progress (its native loop) and reports through drive().
    pytest.param("ucx", "buf", 0, {"env": {"UCX_TLS": "tcp,self"}}, id="ucx-tcp"),
]


@pytest.mark.parametrize(("transport", "region", "large", "config"), CASES)
def test_the_outcome_reaches_the_waiter_with_no_other_python_thread(transport, region, large, config) -> None:
    args = [sys.executable, "-m", "mpcomm.testing.completion", transport, region, str(large)]
    env = dict(os.environ)
    if config is not None:
        config = dict(config)
        env.update(config.pop("env", {}))
        if config.pop("notify", False):
            args.append("--notify")
        if config:
            args.append(json.dumps(config))
    p = subprocess.run(args, capture_output=True, text=True, timeout=240, env=env)
    out = p.stdout + p.stderr
    if "is not available here" in out:
        pytest.skip(out.strip().splitlines()[-1])
    assert p.returncode == 0, out[-4000:]
