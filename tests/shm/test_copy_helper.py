"""The copy loop's helper thread (_copyloop.c, copy_shared): large copies shared by two threads.

What must hold: every byte lands, whatever the size and however many threads
copy at once; nothing is touched after the call returns (a buffer unmapped right
after its copy never faults); a fork child gets a helper of its own; one CPU
means no sharing; the option is range-checked; a shm write through the engine
lands alike with and without it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import numpy as np
import pytest

import mpcomm
from mpcomm.errors import ConfigError
from mpcomm.plugins.shm import _copyloop

MiB = 1 << 20


@pytest.fixture
def loop() -> _copyloop.CopyLoop:
    lp = _copyloop.get()
    if not lp.native:
        pytest.skip(f"no compiled copy loop here: {lp.reason}")
    if lp.share(MiB, 50) == 0:
        pytest.skip("one CPU: copies are never shared")
    yield lp
    lp.share(MiB, 50)  # the transport's default, for the tests that follow


def _addr(a: np.ndarray) -> int:
    return a.ctypes.data


@pytest.mark.parametrize("n", [MiB, MiB + 1, 4 * MiB + 12345, 7 * MiB, 256 << 10])
def test_every_byte_lands(loop: _copyloop.CopyLoop, n: int) -> None:
    rng = np.random.default_rng(n)
    src = rng.integers(0, 256, n + 64, dtype=np.uint8)
    dst = np.zeros(n + 64, dtype=np.uint8)
    for off in (0, 3):
        dst[:] = 0
        assert loop.copy(_addr(dst) + off, _addr(src) + off, n, -1) == 0
        assert np.array_equal(dst[off:off + n], src[off:off + n])
        assert not dst[:off].any() and not dst[off + n:].any()  # nothing outside the range


def test_concurrent_copies_each_land_whole(loop: _copyloop.CopyLoop) -> None:
    """Several threads copy at once: one shares the helper, the others copy alone; all land."""
    n = 3 * MiB + 777
    bufs = [(np.random.default_rng(i).integers(0, 256, n, dtype=np.uint8), np.zeros(n, np.uint8))
            for i in range(4)]
    errors: list[str] = []

    def run(i: int) -> None:
        src, dst = bufs[i]
        for r in range(20):
            dst[:] = r
            if loop.copy(_addr(dst), _addr(src), n, -1) != 0 or not np.array_equal(dst, src):
                errors.append(f"thread {i} round {r}")
                return

    ts = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    assert errors == [] and not any(t.is_alive() for t in ts)


CHILD = r"""
import ctypes, mmap, os, sys
from mpcomm.plugins.shm import _copyloop
lp = _copyloop.get()
assert lp.native and lp.share(1 << 20, 50) > 0
n = 4 << 20
def roundtrip(i):
    src = mmap.mmap(-1, n); dst = mmap.mmap(-1, n)
    src[:] = bytes([i % 251]) * n
    s = ctypes.addressof(ctypes.c_char.from_buffer(src)); d = ctypes.addressof(ctypes.c_char.from_buffer(dst))
    assert lp.copy(d, s, n, -1) == 0
    ok = dst[:] == src[:]
    # Unmapped right after the copy: a helper still copying would fault here (SIGSEGV).
    del s, d
    src.close(); dst.close()
    return ok
for i in range(150):
    assert roundtrip(i), i
pid = os.fork()
if pid == 0:  # the child gets a helper of its own
    os._exit(0 if all(roundtrip(i) for i in range(20)) else 3)
_, status = os.waitpid(pid, 0)
assert os.waitstatus_to_exitcode(status) == 0, status
for i in range(20):
    assert roundtrip(i)
print("ok")
"""


def test_buffers_unmapped_right_after_the_copy_and_a_fork_child(loop: _copyloop.CopyLoop) -> None:
    proc = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", (proc.returncode, proc.stderr[-2000:])


def test_one_cpu_never_shares(loop: _copyloop.CopyLoop) -> None:
    code = ("import os; os.sched_setaffinity(0, {min(os.sched_getaffinity(0))});"
            "from mpcomm.plugins.shm import _copyloop; print(_copyloop.get().share(1 << 20, 50))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "0", proc.stderr


def test_the_python_fallback_never_shares() -> None:
    assert _copyloop.fallback().share(MiB, 50) == 0


@pytest.mark.parametrize("bad", [{"copy_helper_min": -1}, {"copy_helper_spin_us": 10_001},
                                 {"copy_helper_min": "1MiB"}, {"copy_helper_spin_us": True}])
def test_bad_helper_options_are_config_errors(bad: dict) -> None:
    with pytest.raises(ConfigError, match="plugins.shm.copy_helper"):
        mpcomm.Engine({"plugins": {"shm": bad}}, transports=["shm"]).close()


@pytest.mark.parametrize("helper_min", [0, MiB], ids=["alone", "shared"])
def test_large_shm_writes_and_reads_land_with_and_without_the_helper(helper_min: int) -> None:
    cfg = {"plugins": {"shm": {"copy_helper_min": helper_min}}}
    n = 4 * MiB
    with mpcomm.Engine(transports=["shm"]) as target, mpcomm.Engine(cfg, transports=["shm"]) as ini:
        kv = target.allocate(2 * n, name="kv")
        remote = ini.open(target.address, "kv")
        src = ini.allocate(n, name="src")
        dst = ini.allocate(n, name="dst")
        data = np.random.default_rng(7).integers(0, 256, n, dtype=np.uint8).tobytes()
        src.view[:] = data
        for i in range(8):
            assert ini.write(src, remote, (i % 2) * n + 4096 * i, n - 4096 * i).result(10) == n - 4096 * i
        assert bytes(kv.view[n + 4096 * 7:2 * n]) == data[:n - 4096 * 7]
        assert ini.read(dst, remote, n + 4096 * 7, n - 4096 * 7).result(10) == n - 4096 * 7
        assert bytes(dst.view[:n - 4096 * 7]) == data[:n - 4096 * 7]
        expect = helper_min if (os.cpu_count() or 1) >= 2 and len(os.sched_getaffinity(0)) >= 2 else 0
        assert ini.transports["shm"]._helper_min == expect
