"""What a new user installs: the test extra covers the tests, the wheel ships the LICENSE,
the console script explains a missing extra, and .ci/run proves it all in a fresh venv."""

from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from importlib import metadata
from pathlib import Path

import pytest
from newcomer_support import ROOT

PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())

#: Imports that no extra provides, with why that is fine.
NOT_FROM_PYPI = {
    "pyverbs": "Debian's python3-pyverbs (scripts/test installs it as root); tests skip with the reason without it",
    "mpcomm_example_loopback": "built and installed by tests/plugin_author from docs/examples",
    # A CUDA build of torch is the GPU machine's own (scripts/gpu-check runs tests/device on top of it,
    # --system-site-packages); tests/device skip with "no CUDA device" without it.
    "torch": "the GPU machine's CUDA build of torch (scripts/gpu-check); tests/device skip without it",
}


def _canon(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _req_name(req: str) -> str:
    return _canon(re.split(r"[\s<>=!~;\[]", req, maxsplit=1)[0])


def _extra_closure(extra: str) -> set[str]:
    """Distributions named by ``mpcomm[extra]``, following ``mpcomm[...]`` self-references, plus the base."""
    extras = PYPROJECT["project"]["optional-dependencies"]
    names = {_req_name(r) for r in PYPROJECT["project"]["dependencies"]}
    todo, seen = [extra], set()
    while todo:
        e = todo.pop()
        if e in seen:
            continue
        seen.add(e)
        for req in extras[e]:
            m = re.match(r"mpcomm\[([^\]]+)\]", req)
            if m:
                todo += [x.strip() for x in m.group(1).split(",")]
            else:
                names.add(_req_name(req))
    return names


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), str(path))
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module.split(".")[0])
    # importlib.import_module("x") / find_spec("x") with a literal name
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", "") in ("import_module", "find_spec") \
                and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
            out.add(node.args[0].value.split(".")[0])
    return out


def test_every_import_in_the_tests_comes_from_the_test_extra() -> None:
    tests = ROOT / "tests"
    local = {p.stem for p in tests.rglob("*.py")} | {p.name for p in tests.rglob("*") if p.is_dir()}
    provided = _extra_closure("test")
    by_module = metadata.packages_distributions()
    missing = {}
    for path in sorted(tests.rglob("*.py")):
        for mod in _imports(path):
            if mod in sys.stdlib_module_names or mod in local or mod in NOT_FROM_PYPI or mod == "mpcomm":
                continue
            if mod.startswith("mpcomm_no_such"):  # names the tests use to prove a missing module is reported
                continue
            dists = {_canon(d) for d in by_module.get(mod, [])}
            if not dists:
                missing[mod] = f"{path.relative_to(ROOT)}: no installed distribution provides it"
            elif not dists & provided:
                missing[mod] = f"{path.relative_to(ROOT)}: from {sorted(dists)}, not in mpcomm[test]"
    assert not missing, "imports the test extra does not install:\n" + "\n".join(f"  {k}: {v}"
                                                                                   for k, v in missing.items())


def test_the_readme_test_command_installs_the_test_extra() -> None:
    readme = (ROOT / "README.md").read_text()
    assert "bash scripts/test" in readme
    script = (ROOT / "scripts" / "test").read_text()
    assert "-e '.[all]'" in script and "test" in PYPROJECT["project"]["optional-dependencies"]["all"][0]
    assert "hypothesis" in {_req_name(r) for r in PYPROJECT["project"]["optional-dependencies"]["test"]}


def test_ucx_extra_is_the_libraries_wheel_only() -> None:
    ucx = [_req_name(r) for r in PYPROJECT["project"]["optional-dependencies"]["ucx"]]
    assert ucx == ["libucx-cu12"]


def _source_copy(dest: Path) -> Path:
    """The source tree copied to ``dest``, without build outputs: a test that installs or builds
    from it writes nothing into this checkout (an editable install would build the native
    provider into core/lib, embedding an interpreter that is gone once the test ends)."""
    if not (ROOT / "pyproject.toml").exists():
        pytest.skip("no source tree")
    shutil.copytree(ROOT, dest, ignore=shutil.ignore_patterns(
        ".git", ".venv*", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache", "native-status.json"))
    for out in ("core/lib", "core/include"):  # the provider's build outputs (git-ignored)
        shutil.rmtree(dest / out, ignore_errors=True)
    return dest


def test_wheel_ships_the_license_and_metadata(tmp_path: Path) -> None:
    src = _source_copy(tmp_path / "src")
    proc = subprocess.run([sys.executable, "-m", "build", "--wheel", "--outdir", str(tmp_path / "dist"), str(src)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (wheel,) = (tmp_path / "dist").glob("mpcomm-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    licenses = [n for n in names if re.search(r"\.dist-info/(licenses/)?LICENSE$", n)]
    assert licenses, names
    text = zipfile.ZipFile(wheel).read(licenses[0]).decode()
    assert "Apache License" in text and "Version 2.0" in text
    meta_name = next(n for n in names if n.endswith(".dist-info/METADATA"))
    meta = zipfile.ZipFile(wheel).read(meta_name).decode()
    assert "License-Expression: Apache-2.0" in meta
    assert "Project-URL: Documentation, README.md" in meta
    assert "mpcomm/cli/records.py" in names and "mpcomm/records.py" not in names
    # The optional helpers' sources: without them an installed copy runs the Python fallbacks only.
    assert "mpcomm/plugins/shm/_copyloop.c" in names and "mpcomm/plugins/ucx/_ucxloop.c" in names
    assert "mpcomm/engine/_fastlane.c" in names
    assert "mpcomm/plugins/tcp/_busypoll.c" in names
    print("\n".join(sorted(n for n in names if "dist-info" in n)))


def test_console_script_without_the_cli_extra_says_what_to_install() -> None:
    """A base install has no typer: the entry point names the extra (exit 2), not a ModuleNotFoundError."""
    code = ("import sys; sys.modules['typer'] = None\n"
            "from importlib.metadata import entry_points\n"
            "(ep,) = [e for e in entry_points(group='console_scripts') if e.name == 'mpcomm']\n"
            "ep.load()()\n")
    proc = subprocess.run([sys.executable, "-c", code, "plugins"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip() == ("error: the mpcomm command needs the 'cli' extra (typer is not installed): "
                                   "pip install 'mpcomm[cli]'")


@pytest.mark.slow
def test_ci_runs_the_test_command_in_a_fresh_venv(tmp_path: Path) -> None:
    """.ci/run makes a new venv, installs into it, and runs pytest from it (collection only here:
    the full run is what CI does)."""
    if os.environ.get("MPCOMM_CI_NESTED"):
        pytest.skip("already inside .ci/run")
    venv = tmp_path / "venv"
    src = _source_copy(tmp_path / "src")  # its editable install must not build into this checkout
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep)
                                  if not p.startswith(str(Path(sys.executable).parent)))
    env.update(MPCOMM_CI_VENV=str(venv), MPCOMM_CI_NESTED="1")
    probe = "tests/newcomer/test_packaging.py::test_every_import_in_the_tests_comes_from_the_test_extra"
    lib = ROOT / "core" / "lib"
    before = {p.name: p.stat().st_mtime_ns for p in lib.iterdir()} if lib.is_dir() else {}
    proc = subprocess.run(["bash", str(src / ".ci" / "run"), probe, "-p", "no:randomly"], cwd=src, env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"ci: fresh venv {venv}" in proc.stderr
    assert "1 passed" in proc.stdout
    assert (venv / "bin" / "mpcomm").exists() and (venv / "bin" / "pytest").exists()
    after = {p.name: p.stat().st_mtime_ns for p in lib.iterdir()} if lib.is_dir() else {}
    assert after == before, "the nested install built into this checkout's core/lib"
