"""Mooncake TENT's own MPComm boundary (mpcomm_adapter.cpp) built against mpcomm's provider.

Compiles ``tent/src/transport/mpcomm/mpcomm_adapter.cpp`` (and the
``tent/common/status.cpp`` it needs) from a Mooncake checkout named by
``MOONCAKE_SRC`` with ``-DUSE_MPCOMM`` against the installed
``include/mpcomm.h``, links it with ``lib/libmpcomm.so`` and drives it against
a target process (tests/tent/mooncake_adapter_driver.cpp). Nothing of
Mooncake's is stored in this project. Skipped, with the reason, without a
checkout, a compiler or glog's headers (status.cpp logs through glog).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from mpcomm.tent.build import native_status
from test_native_host import HERE, SIZE, Target, _env, host_exe  # noqa: F401 - fixture

ADAPTER = "mooncake-transfer-engine/tent/src/transport/mpcomm/mpcomm_adapter.cpp"
STATUS = "mooncake-transfer-engine/tent/src/common/status.cpp"
INCLUDE = "mooncake-transfer-engine/tent/include"


@pytest.fixture(scope="module")
def driver(tmp_path_factory: pytest.TempPathFactory) -> Path:
    src = os.environ.get("MOONCAKE_SRC")
    if not src or not (Path(src) / ADAPTER).is_file():
        pytest.skip("set MOONCAKE_SRC to a Mooncake checkout (git clone https://github.com/kvcache-ai/Mooncake)")
    st = native_status()
    if not st["built"]:
        pytest.skip(st["reason"])
    cxx = shutil.which(os.environ.get("CXX", "c++"))
    if cxx is None:
        pytest.skip("no C++ compiler")
    if not Path("/usr/include/glog/logging.h").exists():
        pytest.skip("glog headers missing (apt-get install libgoogle-glog-dev); Mooncake's status.cpp needs them")
    root = Path(st["root"])
    out = tmp_path_factory.mktemp("mooncake") / "driver"
    cmd = [cxx, "-std=c++17", "-O1", "-DUSE_MPCOMM", f"-I{Path(src) / INCLUDE}", f"-I{root / 'include'}",
           str(HERE / "mooncake_adapter_driver.cpp"), str(Path(src) / ADAPTER), str(Path(src) / STATUS),
           "-o", str(out), f"-L{root / 'lib'}", "-lmpcomm", f"-Wl,-rpath,{root / 'lib'}", "-lglog", "-pthread"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"Mooncake's adapter does not build against include/mpcomm.h:\n{proc.stderr[-4000:]}"
    return out


def test_mooncake_adapter_over_libmpcomm(driver: Path, host_exe: Path) -> None:  # noqa: F811
    a = Target(host_exe, "A", seed=5)
    try:
        proc = subprocess.run([str(driver), "127.0.0.1:A", str(a.port), str(a.addr), str(SIZE)],
                              capture_output=True, text=True, timeout=180, env=_env())
        print(proc.stdout)
        assert proc.returncode == 0 and proc.stdout.strip().endswith("DONE"), proc.stdout + proc.stderr[-3000:]
        # The target holds every byte the adapter wrote (tent_host's pattern, seed 6).
        assert a.ask(f"VERIFY 0 {SIZE} 6 0") == "OK"
    finally:
        a.quit()
