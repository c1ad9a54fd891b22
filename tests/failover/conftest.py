"""The faulty transport plugin (tests/failover/faulty_plugin), installed for real.

``pip install --target`` (offline, no build isolation) into a temporary site
directory, as tests/plugin_author installs the example plugin (once per
session). That directory goes on ``sys.path`` for the test modules that use
the ``faulty`` fixture, one module at a time (so the registry finds ``faulty``
through its ``mpcomm.transports`` entry point, like any installed plugin); it
is removed again after each such module, so no other test sees the plugin.
"""

from __future__ import annotations

import importlib
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
def faulty_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
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
    return site


@pytest.fixture(scope="module")
def faulty_on_path(faulty_site: Path) -> Iterator[Path]:
    """The install on sys.path for one test module only (other modules never see the plugin)."""
    sys.path.insert(0, str(faulty_site))
    importlib.invalidate_caches()
    try:
        yield faulty_site
    finally:
        sys.path.remove(str(faulty_site))
        for mod in [m for m in sys.modules if m == "mpcomm_test_faulty" or m.startswith("mpcomm_test_faulty.")]:
            del sys.modules[mod]
        importlib.invalidate_caches()


@pytest.fixture
def faulty(faulty_on_path: Path) -> object:
    """The installed plugin's transport module (its ``counters`` are this process's)."""
    from mpcomm.registry import load_plugins

    entry = load_plugins().transports.get("faulty")
    assert entry is not None, "the registry did not find the faulty plugin through its entry point"
    assert entry.distribution == "mpcomm-test-faulty"
    mod = sys.modules[entry.cls.__module__]
    assert Path(mod.__file__).is_relative_to(faulty_on_path), "faulty was not imported from the install"
    for k in mod.counters:
        mod.counters[k] = 0
    return mod
