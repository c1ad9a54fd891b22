"""Build the native MPComm provider into an ``mpcomm`` package directory.

The result is a valid ``MPCOMM_ROOT``::

    <pkg>/include/mpcomm.h
    <pkg>/lib/libmpcomm.so.1          (soname libmpcomm.so.1)
    <pkg>/lib/libmpcomm.so -> libmpcomm.so.1
    <pkg>/lib/cmake/mpcomm/mpcommConfig.cmake, mpcommConfigVersion.cmake (1.4.0, SameMajorVersion)
    <pkg>/native-status.json          (what was built, or why not)

``setup.py`` runs it at install time (into ``core/`` for an editable install,
where ``mpcomm.__file__`` lives); ``python -m mpcomm.tent.build`` reruns it.
It never raises for a missing compiler or missing Python headers: it records
the reason, which ``mpcomm doctor`` reports. Standard library only, because
setup.py loads this file before mpcomm is importable.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import time
from pathlib import Path
from typing import Any

PROVIDER_VERSION = "1.4.0"
SONAME = "libmpcomm.so.1"
STATUS_FILE = "native-status.json"
NATIVE_SRC = Path(__file__).resolve().parent / "native"


def _fail(dest: Path, reason: str) -> dict[str, Any]:
    status = {"built": False, "reason": reason, "time": time.strftime("%Y-%m-%dT%H:%M:%S")}
    try:
        (dest / STATUS_FILE).write_text(json.dumps(status, indent=1) + "\n")
    except OSError:
        pass
    return status


def _compiler() -> str | None:
    for cand in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if cand and shutil.which(cand):
            return shutil.which(cand)
    return None


def python_link_info() -> tuple[list[str], str | None]:
    """(link flags, reason they are unusable) for the running interpreter's libpython."""
    if not sysconfig.get_config_var("Py_ENABLE_SHARED"):
        return [], (f"{sys.executable} was built without --enable-shared: there is no libpython "
                    "to embed (a statically linked interpreter cannot host libmpcomm.so)")
    libdir = sysconfig.get_config_var("LIBDIR") or ""
    ldlib = sysconfig.get_config_var("LDLIBRARY") or ""
    if not ldlib.startswith("lib") or not (Path(libdir) / ldlib).exists():
        return [], f"libpython ({ldlib!r}) not found in {libdir!r}"
    name = ldlib[3:].split(".so")[0]
    return [f"-L{libdir}", f"-l{name}", f"-Wl,-rpath,{libdir}"], None


def editable_root(checkout: str | os.PathLike[str]) -> Path:
    """The MPCOMM_ROOT of an editable install of ``checkout``: in its git-ignored build/, not its source."""
    return Path(checkout) / "build" / "native"


def native_root(pkg_dir: str | os.PathLike[str] | None = None) -> Path:
    """Where the provider of this mpcomm lives: the package dir (a wheel install), else, for an
    editable install of a checkout, :func:`editable_root` beside it (if it was built there)."""
    if pkg_dir is None:
        import mpcomm

        pkg_dir = Path(mpcomm.__file__).resolve().parent
    pkg = Path(pkg_dir)
    if (pkg / "lib" / SONAME).exists() or (pkg / STATUS_FILE).exists():
        return pkg
    checkout = pkg.parent
    if (checkout / "pyproject.toml").is_file() and (editable_root(checkout) / STATUS_FILE).exists():
        return editable_root(checkout)
    return pkg


def build_native(dest: str | os.PathLike[str], src: str | os.PathLike[str] = NATIVE_SRC, *,
                 python: str | None = None, quiet: bool = True, for_wheel: bool = False) -> dict[str, Any]:
    """Compile libmpcomm.so and lay out the MPCOMM_ROOT under ``dest``; returns the status."""
    dest, src = Path(dest), Path(src)
    dest.mkdir(parents=True, exist_ok=True)
    if sys.platform != "linux":
        return _fail(dest, f"the native provider is built on Linux only (this is {sys.platform})")
    cxx = _compiler()
    if cxx is None:
        return _fail(dest, "no C++ compiler (set CXX, or install g++)")
    include = sysconfig.get_paths().get("include") or ""
    if not (Path(include) / "Python.h").exists():
        return _fail(dest, f"Python headers missing ({include}/Python.h); install the python3-dev package")
    link, why = python_link_info()
    if why:
        return _fail(dest, why)
    python = python or os.environ.get("MPCOMM_PYTHON") or sys.executable
    inc, lib = dest / "include", dest / "lib"
    cmake = lib / "cmake" / "mpcomm"
    for d in (inc, cmake):
        d.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(src / "mpcomm.h", inc / "mpcomm.h")
    out = lib / SONAME
    tmp = lib / (SONAME + ".tmp")
    cmd = [cxx, "-std=c++17", "-O2", "-g", "-fPIC", "-shared", "-fvisibility=hidden", "-Wall",
           f"-I{inc}", f"-I{include}", f'-DMPCOMM_DEFAULT_PYTHON="{python}"',
           str(src / "mpcomm.cpp"), "-o", str(tmp), f"-Wl,-soname,{SONAME}", *link, "-ldl", "-pthread"]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return _fail(dest, f"compiler failed to run: {exc}")
    if proc.returncode != 0:
        return _fail(dest, f"compiling libmpcomm.so failed: {proc.stderr.strip()[-2000:]}")
    os.replace(tmp, out)
    link_path = lib / "libmpcomm.so"
    if link_path.is_symlink() or link_path.exists():
        link_path.unlink()
    try:
        link_path.symlink_to(SONAME)
    except OSError:
        shutil.copyfile(out, link_path)
    for name in ("mpcommConfig.cmake", "mpcommConfigVersion.cmake"):
        shutil.copyfile(src / name, cmake / name)
    status = {"built": True, "version": PROVIDER_VERSION, "library": str(out), "python": python,
              "compiler": cxx, "time": time.strftime("%Y-%m-%dT%H:%M:%S")}
    (dest / STATUS_FILE).write_text(json.dumps(status, indent=1) + "\n")
    if not quiet:
        print(f"mpcomm: built {out} (embeds {python})")
    return status


def native_status(pkg_dir: str | os.PathLike[str] | None = None) -> dict[str, Any]:
    """What is installed under the mpcomm package dir: built, or the recorded reason."""
    pkg = native_root(pkg_dir)
    lib = pkg / "lib" / SONAME
    recorded: dict[str, Any] = {}
    try:
        recorded = json.loads((pkg / STATUS_FILE).read_text())
    except (OSError, ValueError):
        pass
    if lib.exists() and (pkg / "include" / "mpcomm.h").exists():
        out = {**recorded, "built": True, "root": str(pkg), "library": str(lib),
               "version": recorded.get("version", PROVIDER_VERSION)}
        py = recorded.get("python")
        if py and "site-packages" not in str(pkg) and not os.path.exists(py):
            out["warning"] = (f"it embeds {py}, which no longer exists: set MPCOMM_PYTHON or rebuild "
                              "(python -m mpcomm.tent.build)")
        return out
    reason = recorded.get("reason") if not recorded.get("built", False) else None
    return {"built": False, "root": str(pkg),
            "reason": reason or f"{lib} is missing (not built at install time; run `python -m mpcomm.tent.build`)"}


def compile_host(source: str | os.PathLike[str], out: str | os.PathLike[str],
                 pkg_dir: str | os.PathLike[str] | None = None, *,
                 embed_python: bool = False) -> tuple[Path | None, str]:
    """Compile a C++ program against the installed include/ and lib/ (tests, benchmarks).

    ``embed_python`` also links the program with libpython and defines
    TENT_HOST_EMBEDS_PYTHON (a host that already runs Python).

    Returns (executable, "") or (None, the reason it could not be built).
    """
    st = native_status(pkg_dir)
    if not st["built"]:
        return None, f"the native provider is not installed: {st['reason']}"
    cxx = _compiler()
    if cxx is None:
        return None, "no C++ compiler (set CXX, or install g++)"
    root = Path(st["root"])
    extra: list[str] = []
    if embed_python:
        link, why = python_link_info()
        if why:
            return None, why
        extra = ["-DTENT_HOST_EMBEDS_PYTHON", f"-I{sysconfig.get_paths()['include']}", *link]
    cmd = [cxx, "-std=c++17", "-O2", "-g", "-Wall", f"-I{root / 'include'}", *extra[:2], str(source), "-o",
           str(out), f"-L{root / 'lib'}", "-lmpcomm", f"-Wl,-rpath,{root / 'lib'}", *extra[2:], "-pthread"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        return None, f"compiling {source} failed: {proc.stderr.strip()[-2000:]}"
    return Path(out), ""


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m mpcomm.tent.build", description=__doc__.split("\n\n")[0])
    ap.add_argument("--dest", help="package directory to build into (default: the installed mpcomm's)")
    args = ap.parse_args(argv)
    dest = args.dest
    if dest is None:
        import mpcomm

        dest = str(Path(mpcomm.__file__).resolve().parent)
    status = build_native(dest, quiet=False)
    if not status["built"]:
        print(f"mpcomm: native provider not built: {status['reason']}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
