"""The faulty transport plugin (tests/failover/faulty_plugin), installed for real.

``pip install --target`` (offline, no build isolation) into a temporary site
directory, as tests/plugin_author installs the example plugin. That directory
goes on ``sys.path`` for this directory's tests only (so the registry finds
``faulty`` through its ``mpcomm.transports`` entry point, like any installed
plugin) and on ``PYTHONPATH`` for the target processes they start; it is
removed again afterwards, so other tests never see the plugin.
"""

from __future__ import annotations

import importlib
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
SRC = HERE / "faulty_plugin"


def _offline_build_problem() -> str:
    try:
        import setuptools
    except ImportError:
        return "setuptools is not installed"
    major, minor = (int(x) for x in setuptools.__version__.split(".")[:2])
    if (major, minor) >= (70, 1):
        return ""
    try:
        import wheel  # noqa: F401
    except ImportError:
        return f"setuptools {setuptools.__version__} needs the 'wheel' package to build wheels"
    return ""


@pytest.fixture(scope="session")
def faulty_site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    problem = _offline_build_problem()
    if problem:
        pytest.skip(f"cannot build the faulty plugin offline: {problem}")
    tmp = tmp_path_factory.mktemp("faulty-plugin")
    src = tmp / "src"
    shutil.copytree(SRC, src, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    site = tmp / "site"
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-index",
         "--disable-pip-version-check", "--no-compile", "--target", str(site), str(src)],
        capture_output=True, text=True, timeout=180,
    )
    assert proc.returncode == 0, f"pip install failed:\n{proc.stdout}\n{proc.stderr}"
    sys.path.insert(0, str(site))
    importlib.invalidate_caches()
    try:
        yield site
    finally:
        sys.path.remove(str(site))
        for mod in [m for m in sys.modules if m == "mpcomm_test_faulty" or m.startswith("mpcomm_test_faulty.")]:
            del sys.modules[mod]
        importlib.invalidate_caches()


@pytest.fixture
def faulty(faulty_site: Path) -> object:
    """The installed plugin's transport module (its ``counters`` are this process's)."""
    from mpcomm.registry import load_plugins

    entry = load_plugins().transports.get("faulty")
    assert entry is not None, "the registry did not find the faulty plugin through its entry point"
    assert entry.distribution == "mpcomm-test-faulty"
    mod = sys.modules[entry.cls.__module__]
    assert Path(mod.__file__).is_relative_to(faulty_site), "faulty was not imported from the install"
    for k in mod.counters:
        mod.counters[k] = 0
    return mod


@pytest.fixture
def faulty_env(faulty_site: Path) -> dict[str, str]:
    """Environment for a subprocess that sees the installed plugin."""
    env = {k: v for k, v in os.environ.items() if k not in ("MPCOMM_PLUGINS", "MPCOMM_DISABLE_PLUGIN_AUTOLOAD")}
    env["PYTHONPATH"] = os.pathsep.join([str(faulty_site), *filter(None, [os.environ.get("PYTHONPATH")])])
    return env
