"""The copy loop: the helper built at install loads (nothing compiled at run time), falls back cleanly, and both agree."""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import subprocess
import sys
from array import array
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from shm_support import Target

from mpcomm.plugins.shm import _copyloop
from mpcomm.plugins.shm.transport import ShmTransport

PROBE = """
import json, sys
from mpcomm.plugins.shm import _copyloop
loop = _copyloop.get()
print(json.dumps({"native": loop.native, "reason": loop.reason, "path": getattr(loop, "path", "")}))
"""


def _env(**extra: str) -> dict[str, str]:
    base = {k: v for k, v in os.environ.items() if k not in ("MPCOMM_SHM_NATIVE", "CC")}
    return {**base, **extra}


def _probe(env: dict[str, str], pre: str = "") -> dict:
    proc = subprocess.run([sys.executable, "-c", pre + PROBE], capture_output=True, text=True, timeout=180,
                          env=_env(**env))
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _listing(d: Path) -> set[str]:
    return {p.name for p in d.iterdir()}


def test_loads_the_module_built_at_install_and_compiles_nothing(tmp_path: Path) -> None:
    """No compiler on PATH, a fresh HOME: the prebuilt module serves and nothing is written anywhere."""
    pkg = Path(_copyloop.__file__).parent
    before = _listing(pkg)
    home = tmp_path / "home"
    home.mkdir()
    out = _probe({"CC": "/nonexistent/cc", "PATH": "/nonexistent", "HOME": str(home),
                  "XDG_CACHE_HOME": str(home / ".cache"), "PYTHONDONTWRITEBYTECODE": "1"})
    if not out["native"]:
        pytest.skip(f"the copy loop was not built at install: {out['reason']}")
    assert Path(out["path"]).parent == pkg and Path(out["path"]).name.startswith("_mpcomm_copyloop.")
    assert _listing(pkg) == before and not list(home.iterdir())


def test_falls_back_without_the_module() -> None:
    hide = "import sys; sys.modules['mpcomm.plugins.shm._mpcomm_copyloop'] = None\n"  # as if the build had failed
    out = _probe({}, pre=hide)
    assert not out["native"] and "python fallback: not installed" in out["reason"], out
    out = _probe({"MPCOMM_SHM_NATIVE": "0"})
    assert not out["native"] and "MPCOMM_SHM_NATIVE=0" in out["reason"]


def test_availability_names_the_copy_loop() -> None:
    reason = ShmTransport.availability().reason
    assert "copy loop" in reason or "fallback" in reason, reason


def _addr(buf: bytearray) -> int:
    return ctypes.addressof((ctypes.c_char * len(buf)).from_buffer(buf))


LOOPS = {"native": _copyloop.get, "python": lambda: _copyloop.fallback("test")}


@pytest.fixture(params=list(LOOPS))
def loop(request: pytest.FixtureRequest) -> _copyloop.CopyLoop:
    got = LOOPS[request.param]()
    if request.param == "native" and not got.native:
        pytest.skip(got.reason)
    return got


def test_check_is_exact(loop: _copyloop.CopyLoop) -> None:
    offs = array("q", [0, 4096, 8192])
    lens = array("q", [4096, 4096, 4096])
    assert loop.check(offs, lens, 3, 12288) == (-1, 12288)
    assert loop.check(offs, lens, 3, 12287) == (2, 0)
    assert loop.check(array("q", [5, -1]), array("q", [1, 1]), 2, 100) == (1, 0)
    assert loop.check(array("q", [5, 0]), array("q", [1, -1]), 2, 100) == (1, 0)
    big = (1 << 62)
    assert loop.check(array("q", [big]), array("q", [big]), 1, (1 << 63) - 1)[0] == 0  # no overflow
    assert loop.check(array("q"), array("q"), 0, 0) == (-1, 0)


def test_copy_many_respects_the_budget(loop: _copyloop.CopyLoop) -> None:
    n = 100
    src = bytearray(np.random.default_rng(1).integers(0, 256, n * 512, dtype=np.uint8).tobytes())
    dst = bytearray(n * 512)
    soffs = array("q", range(0, n * 512, 512))
    doffs = array("q", reversed(soffs))
    lens = array("q", [512] * n)
    i, calls = 0, 0
    while i < n:
        nxt = loop.copy_many(_addr(dst), len(dst), doffs, _addr(src), len(src), soffs, lens, i, n, 2000, -1)
        assert nxt == min(n, i + 4)  # 4 pieces of 512 reach the 2000-byte budget
        i, calls = nxt, calls + 1
    assert calls == 25
    assert all(dst[doffs[k] : doffs[k] + 512] == src[soffs[k] : soffs[k] + 512] for k in range(n))


@pytest.fixture(scope="module")
def target() -> Iterator[Target]:
    t = Target({"regions": {"buf": [4 << 20, "buffer"]}})
    yield t
    t.close()


def test_cma_many_into_another_process(loop: _copyloop.CopyLoop, target: Target) -> None:
    """Cross-memory attach of a scattered batch into a real second process, in as few calls as the budget allows."""
    import mpcomm

    with mpcomm.Engine(transports=["tcp"]) as e:
        base = e.open(target.address, "buf").base_address
    n = 3000  # more than IOV_MAX pieces, so the helper splits system calls
    rng = np.random.default_rng(7)
    src = bytearray(rng.integers(0, 256, n * 1000, dtype=np.uint8).tobytes())
    lens = array("q", rng.integers(0, 1000, n).tolist())  # zero-length pieces included
    loffs = array("q", range(0, n * 1000, 1000))
    roffs = array("q", range(0, n * 1000, 1000))
    pidfd = os.pidfd_open(target.pid)
    try:
        i = 0
        while i < n:
            i = loop.cma_many(target.pid, 1, _addr(src), len(src), loffs, base, 4 << 20, roffs, lens, i, n, 1 << 20,
                              pidfd)
            assert i > 0, os.strerror(-i)
        want = bytearray(n * 1000)
        for k in range(n):
            want[roffs[k] : roffs[k] + lens[k]] = src[loffs[k] : loffs[k] + lens[k]]
        assert target.cmd("sha", "buf", 0, n * 1000) == hashlib.sha256(want).hexdigest()
        back = bytearray(n * 1000)
        assert loop.cma_many(target.pid, 0, _addr(back), len(back), loffs, base, 4 << 20, roffs, lens, 0, n, 1 << 40,
                             pidfd) == n
        assert back == want
        assert loop.cma(target.pid, 1, _addr(src), 8, 16, pidfd) == -14  # EFAULT: nothing mapped at 8
    finally:
        os.close(pidfd)


def test_check2_names_the_side(loop: _copyloop.CopyLoop) -> None:
    ro = array("q", [0, 8192])
    lo = array("q", [0, 4096])
    ln = array("q", [4096, 4096])
    assert loop.check2(ro, lo, ln, 2, 12288, 8192) == ("", -1, 8192)
    assert loop.check2(ro, lo, ln, 2, 12287, 8192) == ("remote", 1, 0)
    assert loop.check2(ro, lo, ln, 2, 12288, 8191) == ("local", 1, 0)
    assert loop.check2(array("q", [-1]), array("q", [0]), array("q", [1]), 1, 10, 10) == ("remote", 0, 0)


def test_cma_many_stops_at_an_unmapped_piece(loop: _copyloop.CopyLoop, target: Target) -> None:
    import mpcomm

    with mpcomm.Engine(transports=["tcp"]) as e:
        base = e.open(target.address, "buf").base_address
    src = bytearray(b"\x77" * 3 * 4096)
    # piece 1 points at address 8 in the target: nothing is mapped there (the "region" handed to
    # the loop is the whole address space from 0, so the range check lets it through)
    roffs = array("q", [base, 8, base + 8192])
    loffs = array("q", [0, 4096, 8192])
    lens = array("q", [4096, 4096, 4096])
    pidfd = os.pidfd_open(target.pid)
    try:
        assert loop.cma_many(target.pid, 1, _addr(src), len(src), loffs, 0, 1 << 62, roffs, lens, 0, 3, 1 << 40,
                             pidfd) == -14
    finally:
        os.close(pidfd)


def test_single_copies_skip_ctypes(target: Target) -> None:
    """The helper is an extension module: copy/cma are its functions (no ctypes conversion), same results."""
    loop = _copyloop.get()
    if not loop.native:
        pytest.skip(f"no compiled extension here: {loop.reason}")
    assert type(loop.copy).__name__ == "builtin_function_or_method" and "_mpcomm_copyloop" in loop.reason
    src = bytearray(os.urandom(4096))
    dst = bytearray(4096)
    assert loop.copy(_addr(dst), _addr(src), 4096, -1) == 0 and dst == src
    alive = os.pidfd_open(os.getpid())
    try:
        assert loop.copy(_addr(dst), _addr(src), 16, alive) == 0
    finally:
        os.close(alive)
    with pytest.raises(TypeError):
        loop.copy(_addr(dst), _addr(src), 16)
    with pytest.raises(ValueError):
        loop.copy(_addr(dst), _addr(src), -1, -1)
    import mpcomm

    with mpcomm.Engine(transports=["tcp"]) as e:
        base = e.open(target.address, "buf").base_address
    pidfd = os.pidfd_open(target.pid)
    try:
        assert loop.cma(target.pid, True, _addr(src), base, 4096, pidfd) == 0
        back = bytearray(4096)
        assert loop.cma(target.pid, False, _addr(back), base, 4096, pidfd) == 0 and back == src
        assert loop.cma(target.pid, True, _addr(src), 8, 16, pidfd) == -14  # EFAULT, as through ctypes
    finally:
        os.close(pidfd)


def test_batch_calls_skip_ctypes_and_refuse_short_arrays() -> None:
    """check2/copy_many/cma_many are the module's functions too (a ctypes call cost about 1 us, two per
    batch): they hold the arrays' buffers for the call and refuse an ``n`` the arrays do not hold,
    where the ctypes call read past their end."""
    loop = _copyloop.get()
    if not loop.native:
        pytest.skip(f"no compiled extension here: {loop.reason}")
    assert type(loop.copy_many).__name__ == "builtin_function_or_method"
    assert type(loop.cma_many).__name__ == "builtin_function_or_method"
    src = bytearray(os.urandom(8192))
    dst = bytearray(8192)
    offs, lens = array("q", [0, 4096]), array("q", [4096, 4096])
    assert loop.check2(offs, offs, lens, 2, 8192, 8192) == ("", -1, 8192)
    assert loop.copy_many(_addr(dst), 8192, offs, _addr(src), 8192, offs, lens, 0, 2, 1 << 20, -1) == 2
    assert dst == src
    with pytest.raises(ValueError):
        loop.check2(offs, offs, lens, 3, 1 << 20, 1 << 20)
    with pytest.raises(ValueError):
        loop.copy_many(_addr(dst), 8192, offs, _addr(src), 8192, offs, array("q", [1]), 0, 2, 1 << 20, -1)
    with pytest.raises(ValueError):
        loop.cma_many(os.getpid(), True, _addr(src), 8192, offs, _addr(dst), 8192, offs, lens, 0, 5, 1 << 20, -1)
    with pytest.raises(ValueError):
        loop.copy_many(_addr(dst), 8192, offs, _addr(src), 8192, offs, lens, -1, 2, 1 << 20, -1)
