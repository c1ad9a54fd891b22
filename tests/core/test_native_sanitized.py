"""The native helpers built with ``-fsanitize=address,undefined``, and the native-path tests under them.

``mpcomm.native_helper`` builds every helper with ``$CC`` (its extra words are
compiler flags) into ``$MPCOMM_CACHE_DIR``: a child pytest gets a sanitizing
``CC`` and a fresh cache directory, so the engine's C lane (``_fastlane.c``),
the shm copy loop (``_copyloop.c``) and tcp's busy-poll helper are built
instrumented at first use, and the child runs with ``libasan`` preloaded (the
interpreter itself is not instrumented; ``malloc`` then is ASan's, so a byte
outside a Python buffer lands in a red zone). Any report aborts the child.

First a canary proves the sanitizer is live (an unchecked copy one byte past a
buffer must be reported); then the native-path tests run: the C and Python
bound lanes (tests/core/test_fastlane.py), the copy loops
(tests/shm/test_copyloop.py, tests/regressions/test_native_path.py) and the
differential lane test over shm and tcp (tests/core/test_lane_agreement.py).
Bounded at about a minute here; skipped, saying why, without gcc's libasan.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FLAGS = "-fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer -g"

CANARY = """
import ctypes
from mpcomm.plugins.shm import _copyloop
loop = _copyloop.get()
assert loop.native and "copyloop" in loop.reason, loop.reason
src = ctypes.create_string_buffer(4096)
dst = ctypes.create_string_buffer(4096)
print("copying one byte too many", flush=True)
loop.copy(ctypes.addressof(dst), ctypes.addressof(src), 4097, -1)  # mp_copy trusts its caller
print("not reported", flush=True)
"""

TESTS = [
    "tests/core/test_fastlane.py",
    "tests/shm/test_copyloop.py::test_check_is_exact",
    "tests/shm/test_copyloop.py::test_copy_many_respects_the_budget",
    "tests/shm/test_copyloop.py::test_check2_names_the_side",
    "tests/shm/test_copyloop.py::test_cma_many_into_another_process",
    "tests/shm/test_copyloop.py::test_cma_many_stops_at_an_unmapped_piece",
    "tests/regressions/test_native_path.py::test_the_copy_loops_check_every_piece_where_they_copy_it",
    "tests/regressions/test_native_path.py::test_a_batch_value_outside_int64_is_out_of_bounds",
    "tests/core/test_lane_agreement.py",
]


def _asan() -> str:
    cc = shutil.which("gcc")
    if cc is None:
        pytest.skip("no gcc here: the sanitized build needs gcc and its libasan")
    got = subprocess.run([cc, "-print-file-name=libasan.so"], capture_output=True, text=True, timeout=30)
    path = got.stdout.strip()
    if got.returncode != 0 or not os.path.isabs(path) or not os.path.exists(path):
        pytest.skip("gcc has no libasan.so here (install libasan / gcc's sanitizer runtime)")
    return path


def _env(tmp_path: Path, libasan: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MPCOMM_")}
    env.update(CC=f"gcc {FLAGS}", MPCOMM_CACHE_DIR=str(tmp_path / "cache"), LD_PRELOAD=libasan,
               ASAN_OPTIONS="detect_leaks=0:abort_on_error=1:allocator_may_return_null=1",
               UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1")
    return env


def test_native_path_tests_pass_with_the_helpers_sanitized(tmp_path: Path) -> None:
    libasan = _asan()
    env = _env(tmp_path, libasan)
    canary = subprocess.run([sys.executable, "-c", CANARY], capture_output=True, text=True, timeout=120, env=env,
                            cwd=ROOT)
    assert "copying one byte too many" in canary.stdout, canary.stderr[-3000:]
    assert canary.returncode != 0 and "AddressSanitizer" in canary.stderr, (
        "the sanitized build did not report an overflow", canary.returncode, canary.stdout, canary.stderr[-3000:])
    built = sorted(p.name.split("-")[0] for p in (tmp_path / "cache").rglob("*.so"))
    assert "copyloop" in built, built
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x",
                          "-k", "not ucx", *TESTS], capture_output=True, text=True, timeout=240, env=env,
                         cwd=ROOT)
    tail = (run.stdout[-4000:] + run.stderr[-4000:])
    assert run.returncode == 0, tail
    assert "AddressSanitizer" not in tail and "runtime error:" not in tail, tail
    built = sorted({p.name.split("-")[0] for p in (tmp_path / "cache").rglob("*.so")})
    assert {"copyloop", "fastlane"} <= set(built), built
