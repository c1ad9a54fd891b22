"""The native helpers built with ``-fsanitize=address,undefined``, and the native-path tests under them.

The helpers are built by setup.py's own ``build_ext`` (the build an install runs) with sanitizing
``CFLAGS``/``LDFLAGS`` into a temporary ``--build-lib``; a child process puts those builds in front
of the installed ones (each helper's package ``__path__``, before any helper is imported) and runs
with ``libasan`` preloaded (the interpreter itself is not instrumented; ``malloc`` then is ASan's,
so a byte outside a Python buffer lands in a red zone). Any report aborts the child.

First a canary proves the sanitizer is live (an unchecked copy one byte past a buffer must be
reported) and that the sanitized builds are the ones loaded; then the native-path tests run: the C
and Python bound lanes (tests/core/test_fastlane.py), the copy loops (tests/shm/test_copyloop.py,
tests/regressions/test_native_path.py), the differential lane test over shm and tcp
(tests/core/test_lane_agreement.py) and tcp's native data port (tests/tcp/test_tcp_native_port.py:
its in-process table and server tests; the in-process notification tests of
tests/tcp/test_tcp_notify_native.py; the targets it starts as subprocesses load the installed
build). Bounded at about a minute here; skipped, saying why, without
gcc's libasan.
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

#: Run first in every child: the sanitized builds under BUILD_LIB shadow the installed helpers.
PRELUDE = """
import os, sys
import mpcomm.engine, mpcomm.plugins.shm, mpcomm.plugins.tcp, mpcomm.plugins.ucx
lib = os.environ["MPCOMM_TEST_SANITIZED_LIB"]
for pkg in (mpcomm.engine, mpcomm.plugins.shm, mpcomm.plugins.tcp, mpcomm.plugins.ucx):
    pkg.__path__.insert(0, os.path.join(lib, *pkg.__name__.split(".")))
"""

CANARY = PRELUDE + """
import ctypes
from mpcomm.plugins.shm import _copyloop
loop = _copyloop.get()
assert loop.native and "copyloop" in loop.reason, loop.reason
built = sys.modules["mpcomm.plugins.shm._mpcomm_copyloop"].__file__
assert built.startswith(lib), ("not the sanitized build", built)
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
    "tests/tcp/test_tcp_native_port.py",
    "tests/tcp/test_tcp_notify_native.py::test_the_native_queue_bounds_count_and_bytes_without_wrapping",
    "tests/tcp/test_tcp_notify_native.py::test_the_native_queue_holds_notes_for_the_callbacks_in_order",
    "tests/tcp/test_tcp_notify_native.py::test_a_full_queue_is_a_retryable_back_pressure_error_and_draining_makes_room",
    "tests/tcp/test_tcp_notify_native.py::test_the_control_channel_and_the_data_port_fill_one_queue",
    "tests/tcp/test_tcp_notify_native.py::test_generated_notify_frames_get_an_answer_or_a_closed_connection",
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


def _build(tmp_path: Path) -> Path:
    """setup.py's build_ext with sanitizing flags into tmp_path/lib; every helper must build."""
    lib = tmp_path / "lib"
    env = {**os.environ, "CC": "gcc", "CFLAGS": FLAGS, "LDFLAGS": FLAGS}
    run = subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--build-lib", str(lib),
                          "--build-temp", str(tmp_path / "tmp")], capture_output=True, text=True, timeout=300,
                         env=env, cwd=ROOT)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    built = sorted(p.name.split(".")[0] for p in lib.rglob("_mpcomm_*.so"))
    assert built == ["_mpcomm_busypoll", "_mpcomm_copyloop", "_mpcomm_dataport", "_mpcomm_fastlane",
                     "_mpcomm_ucxloop"], (
        built, run.stdout[-3000:] + run.stderr[-3000:])
    return lib


def _env(lib: Path, libasan: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MPCOMM_")}
    env.update(MPCOMM_TEST_SANITIZED_LIB=str(lib), LD_PRELOAD=libasan,
               ASAN_OPTIONS="detect_leaks=0:abort_on_error=1:allocator_may_return_null=1",
               UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1")
    return env


def test_native_path_tests_pass_with_the_helpers_sanitized(tmp_path: Path) -> None:
    libasan = _asan()
    lib = _build(tmp_path)
    env = _env(lib, libasan)
    canary = subprocess.run([sys.executable, "-c", CANARY], capture_output=True, text=True, timeout=120, env=env,
                            cwd=ROOT)
    assert "copying one byte too many" in canary.stdout, canary.stderr[-3000:]
    assert canary.returncode != 0 and "AddressSanitizer" in canary.stderr, (
        "the sanitized build did not report an overflow", canary.returncode, canary.stdout, canary.stderr[-3000:])
    script = PRELUDE + "import pytest\nsys.exit(pytest.main(sys.argv[1:]))\n"
    run = subprocess.run([sys.executable, "-c", script, "-q", "-p", "no:cacheprovider", "-x",
                          "-k", "not ucx", *TESTS], capture_output=True, text=True, timeout=240, env=env,
                         cwd=ROOT)
    tail = (run.stdout[-4000:] + run.stderr[-4000:])
    assert run.returncode == 0, tail
    assert "AddressSanitizer" not in tail and "runtime error:" not in tail, tail
    assert " passed" in run.stdout and " failed" not in run.stdout, tail
    print(run.stdout.strip().splitlines()[-1])
