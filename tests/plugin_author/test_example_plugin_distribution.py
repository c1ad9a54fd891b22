"""The example plugin distribution (docs/examples/mpcomm-loopback-plugin) works as a plugin author's would.

It is installed for real (``pip install --target``, offline, no build
isolation) into a temporary directory that only subprocesses see on their
``PYTHONPATH``; the main environment never has it. Then, in those
subprocesses: the registry finds ``example_pipe`` through its entry point,
``python -m mpcomm.testing example_pipe`` passes, and so does a plugin
author's one-line pytest file run with ``-p mpcomm --mpcomm-transport``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path

import pytest

import mpcomm

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "docs" / "examples" / "mpcomm-loopback-plugin"
DIST = "mpcomm-example-loopback"
NAME = "example_pipe"



def _offline_build_problem() -> str:
    """Why the example cannot be built here without network access ("" when it can)."""
    try:
        import setuptools
    except ImportError:
        return "setuptools is not installed"
    major, minor = (int(x) for x in setuptools.__version__.split(".")[:2])
    if (major, minor) >= (70, 1):
        return ""  # setuptools has its own bdist_wheel
    try:
        import wheel  # noqa: F401
    except ImportError:
        return f"setuptools {setuptools.__version__} needs the 'wheel' package to build wheels (pip install wheel)"
    return ""


pytestmark = pytest.mark.skipif(bool(_offline_build_problem()), reason=_offline_build_problem() or "-")


def _installed_in_main_env() -> bool:
    try:
        metadata.distribution(DIST)
    except metadata.PackageNotFoundError:
        return False
    return True


@pytest.fixture(scope="module")
def plugin_env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """Environment variables for subprocesses that see the installed example distribution."""
    assert not _installed_in_main_env(), f"{DIST} must not be installed in the main environment"
    tmp = tmp_path_factory.mktemp("example-plugin")
    # Build from a copy: setuptools writes build/ and *.egg-info next to the sources.
    src = tmp / "src"
    shutil.copytree(EXAMPLE, src, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    site = tmp / "site"
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-index",
         "--disable-pip-version-check", "--no-compile", "--target", str(site), str(src)],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, f"pip install failed:\n{proc.stdout}\n{proc.stderr}"
    env = {k: v for k, v in os.environ.items()
           if k not in ("MPCOMM_PLUGINS", "MPCOMM_DISABLE_PLUGIN_AUTOLOAD", "PYTEST_ADDOPTS")}
    env["PYTHONPATH"] = os.pathsep.join([str(site), *filter(None, [os.environ.get("PYTHONPATH")])])
    env["_SITE"] = str(site)
    yield env
    assert not _installed_in_main_env(), f"{DIST} leaked into the main environment"


def _run(args: list[str], env: dict[str, str], cwd: Path | None = None, timeout: float = 80) -> subprocess.CompletedProcess:
    return subprocess.run(args, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)


def test_registry_finds_the_entry_point(plugin_env: dict[str, str]) -> None:
    script = (
        "import json, mpcomm\n"
        "from mpcomm.registry import load_plugins\n"
        "found = load_plugins()\n"
        f"e = found.transports[{NAME!r}]\n"
        "print(json.dumps({'plugin': e.plugin, 'dist': e.distribution, 'version': e.version,"
        " 'module': e.cls.__module__, 'file': __import__(e.cls.__module__, fromlist=['x']).__file__,"
        " 'caps': e.cls.capabilities.to_dict(), 'avail': e.cls.availability().available,"
        " 'failures': [f.name for f in found.failures], 'mpcomm': mpcomm.__file__}))\n"
    )
    proc = _run([sys.executable, "-c", script], plugin_env)
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["plugin"] == NAME
    assert got["dist"] == DIST
    assert got["version"] == "0.1.0"
    assert got["module"] == "mpcomm_example_loopback.transport"
    assert Path(got["file"]).is_relative_to(plugin_env["_SITE"]), "the transport was not imported from the install"
    assert Path(got["mpcomm"]).resolve() == Path(mpcomm.__file__).resolve(), "the subprocess saw another mpcomm"
    assert got["avail"] is True
    assert got["caps"]["inflight_cancel"] is True and got["caps"]["modes"] == ["zero-copy"]
    assert NAME not in got["failures"]
    # ...while this process (the main environment) does not see it.
    from mpcomm.registry import load_plugins

    assert NAME not in load_plugins().transports


def test_conformance_cli(plugin_env: dict[str, str]) -> None:
    proc = _run([sys.executable, "-m", "mpcomm.testing", NAME], plugin_env)
    out = proc.stdout
    assert proc.returncode == 0, f"conformance kit failed:\n{out}\n{proc.stderr[-4000:]}"
    m = re.search(r"(\d+) passed, (\d+) failed, (\d+) skipped", out)
    assert m, out
    passed, failed, skipped = map(int, m.groups())
    assert failed == 0
    # Honest declarations: only the stalled-target fence may be skipped (the
    # transport reports TransferTimeout.confirmed = False there).
    assert passed >= 13, out
    for line in out.splitlines():
        if line.startswith("skipped"):
            assert "check_timeout_stalled_target" in line, line


def test_conformance_pytest_plugin(plugin_env: dict[str, str], tmp_path: Path) -> None:
    (tmp_path / "test_my_transport.py").write_text(
        "def test_conformance(mpcomm_conformance, mpcomm_check):\n"
        "    mpcomm_check(mpcomm_conformance)\n"
    )
    env = dict(plugin_env, PYTEST_DISABLE_PLUGIN_AUTOLOAD="1")  # only -p mpcomm loads our plugin
    proc = _run([sys.executable, "-m", "pytest", "-p", "mpcomm", "--mpcomm-transport", NAME, "-q",
                 "-p", "no:cacheprovider", "-rs", "test_my_transport.py"], env, cwd=tmp_path)
    out = proc.stdout
    assert proc.returncode == 0, f"pytest run failed:\n{out[-6000:]}\n{proc.stderr[-2000:]}"
    m = re.search(r"(\d+) passed", out)
    assert m and int(m.group(1)) >= 13, out
    assert "failed" not in out.splitlines()[-1], out
    skipped = re.search(r"(\d+) skipped", out)
    assert skipped is None or int(skipped.group(1)) <= 1, out
