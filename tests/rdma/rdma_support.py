"""Helpers shared by the rdma tests (a module of its own: every conftest is named conftest)."""

from __future__ import annotations

import importlib.machinery
import os
import sys
from pathlib import Path


def expected_category() -> str:
    """Which availability reason this machine should produce, worked out without the plugin."""
    import importlib.util

    native = importlib.util.find_spec("pyverbs") is not None
    suffixes = [s for s in importlib.machinery.EXTENSION_SUFFIXES if s != ".so"]
    env = os.environ.get("MPCOMM_PYVERBS_PATH")
    dirs = [p for p in env.split(os.pathsep) if p] if env is not None else [
        "/usr/lib/python3/dist-packages",
        f"/usr/lib64/python{sys.version_info.major}.{sys.version_info.minor}/site-packages",
        f"/usr/lib/python{sys.version_info.major}.{sys.version_info.minor}/site-packages",
    ]
    system = any((Path(d) / "pyverbs" / f"device{s}").exists() for d in dirs for s in suffixes)
    if not (native or system):
        return "pyverbs is not installed (apt install python3-pyverbs)"
    sysfs = Path("/sys/class/infiniband")
    if not sysfs.is_dir() or not any(sysfs.iterdir()):
        return "no RDMA device (ibv_get_device_list returned none)"
    return "device-present"
