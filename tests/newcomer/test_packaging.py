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
        ".git", ".venv*", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache", "native-status.json",
        "*.so", "native-build.json"))  # an editable install's in-place helpers (git-ignored)
    for out in ("core/lib", "core/include"):  # the provider's build outputs (git-ignored)
        shutil.rmtree(dest / out, ignore_errors=True)
    return dest


def _venv(path: Path) -> Path:
    subprocess.run([sys.executable, "-m", "venv", str(path)], check=True, capture_output=True, timeout=120)
    return path / "bin" / "python"


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel, built once per module by pip in a fresh venv from a clean copy of the source."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = _source_copy(tmp / "src")
    builder = _venv(tmp / "build-venv")
    built = subprocess.run([str(builder), "-m", "pip", "--disable-pip-version-check", "-q", "wheel", "--no-deps",
                            "-w", str(tmp / "dist"), str(src)], capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    (whl,) = (tmp / "dist").glob("mpcomm-*.whl")
    return whl


def test_wheel_ships_the_license_and_metadata(wheel: Path) -> None:
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
    # The compiled helpers, built with the wheel (nothing is compiled where it is installed).
    for mod in ("engine/_mpcomm_fastlane", "plugins/shm/_mpcomm_copyloop", "plugins/ucx/_mpcomm_ucxloop",
                "plugins/tcp/_mpcomm_busypoll"):
        assert [n for n in names if n.startswith(f"mpcomm/{mod}.") and n.endswith(".so")], (mod, names)
    assert not [n for n in names if n.endswith(".c")]  # their sources are in the sdist, not the wheel
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


def _files(d: Path) -> set[str]:
    return {str(p.relative_to(d)) for p in d.rglob("*") if "__pycache__" not in p.parts}


def test_wheel_installs_and_runs_without_a_compiler(wheel: Path, tmp_path: Path) -> None:
    """The wheel, built in one fresh venv, installed into another whose PATH has no compiler: every compiled
    helper imports, two engines move bytes, nothing is written into site-packages, and a C++ host compiled
    against the installed include/ and lib/ makes the Mooncake adapter's calls between two processes with
    the installed libmpcomm.so.1, which finds that venv's interpreter by itself (no MPCOMM_PYTHON)."""
    from mpcomm.tent.build import compile_host

    assert "-cp3" in wheel.name and "linux" in wheel.name, wheel.name

    py = _venv(tmp_path / "run-venv")
    inst = subprocess.run([str(py), "-m", "pip", "--disable-pip-version-check", "-q", "install", str(wheel)],
                          capture_output=True, text=True, timeout=300)
    assert inst.returncode == 0, inst.stdout[-3000:] + inst.stderr[-3000:]
    site = Path(subprocess.run([str(py), "-c", "import mpcomm, os; print(os.path.dirname(mpcomm.__file__))"],
                               capture_output=True, text=True, check=True, cwd=tmp_path, timeout=60).stdout.strip())
    assert site.is_relative_to(tmp_path / "run-venv"), site

    # No compiler anywhere on PATH; no MPCOMM_PYTHON: the library must find this venv's python itself.
    path = f"{py.parent}:{tmp_path / 'empty'}"
    for cc in ("cc", "gcc", "c++", "g++", "clang"):
        assert shutil.which(cc, path=path) is None, cc
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MPCOMM_", "VIRTUAL_ENV", "PYTHON"))}
    env.update(PATH=path, HOME=str(tmp_path / "home"), MPCOMM_TENT_BIND="127.0.0.1")
    before = _files(site)
    check = subprocess.run([str(py), str(ROOT / "scripts" / "check_installed.py")], cwd=tmp_path, env=env,
                           capture_output=True, text=True, timeout=120)
    assert check.returncode == 0, check.stdout[-3000:] + check.stderr[-3000:]
    assert "WARNING" not in check.stderr, check.stderr  # no missing helper to warn about
    print(check.stdout)

    # The C++ host: compiled here (this process has a compiler), run in the compiler-free environment.
    exe, why = compile_host(ROOT / "tests" / "tent" / "tent_host.cpp", tmp_path / "tent_host", site)
    assert exe is not None, why
    target = subprocess.Popen([str(exe), "target", "127.0.0.1:A", "0", str(1 << 20), "1"], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        assert target.stdout is not None and target.stdin is not None
        ready = target.stdout.readline().split()
        assert ready and ready[0] == "READY", (ready, target.stderr.read() if target.poll() is not None else "")
        port, addr = ready[1], ready[2]
        bench = subprocess.run([str(exe), "bench", "127.0.0.1:A", port, addr, "4096", "200"], env=env,
                               capture_output=True, text=True, timeout=120)
        assert bench.returncode == 0 and "BENCH us_per_op=" in bench.stdout, bench.stdout + bench.stderr
        print(bench.stdout.strip())
        target.stdin.write("QUIT\n")
        target.stdin.flush()
        assert target.wait(30) == 0
    finally:
        if target.poll() is None:
            target.kill()
            target.wait(10)
    assert _files(site) == before, "something was written into site-packages at run time"


def test_editable_install_builds_helpers_in_place_and_the_provider_outside_the_source(tmp_path: Path) -> None:
    """pip install -e: the helpers land beside their packages (git-ignored) where imports find them; the
    MPComm provider goes to build/native/, and nothing of it into core/."""
    src = _source_copy(tmp_path / "src")
    py = _venv(tmp_path / "venv")
    inst = subprocess.run([str(py), "-m", "pip", "--disable-pip-version-check", "-q", "install", "-e",
                           str(src)], capture_output=True, text=True, timeout=300)
    assert inst.returncode == 0, inst.stdout[-3000:] + inst.stderr[-3000:]
    for out in ("core/include", "core/lib", "core/native-status.json"):
        assert not (src / out).exists(), out
    assert (src / "build" / "native" / "lib" / "libmpcomm.so.1").exists()
    helpers = sorted(str(p.relative_to(src)) for p in [*src.glob("core/**/*.so"), *src.glob("plugins/**/*.so")])
    from mpcomm import native_helper

    assert len(helpers) == len(native_helper.HELPERS), helpers
    ignored = subprocess.run(["git", "-C", str(ROOT), "check-ignore", "--no-index", *helpers], capture_output=True,
                             text=True, timeout=60)
    assert ignored.stdout.split() == helpers, ignored.stdout + ignored.stderr  # every one git-ignored
    code = ("import mpcomm.native_helper as n, mpcomm.tent.build as b; assert not n.missing(), n.missing(); "
            "print(b.native_root())")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    run = subprocess.run([str(py), "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == str(src / "build" / "native")
