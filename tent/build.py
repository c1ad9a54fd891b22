"""Build the native MPComm provider into an ``mpcomm`` package directory.

The result is a valid ``MPCOMM_ROOT``::

    <pkg>/include/mpcomm.h
    <pkg>/lib/libmpcomm.so.1          (soname libmpcomm.so.1; links no libpython)
    <pkg>/lib/libmpcomm_pythonX.Y.so  (the implementation it loads at init, after libpython)
    <pkg>/lib/libmpcomm.so -> libmpcomm.so.1 (in a wheel: a one-line ld script naming it)
    <pkg>/lib/cmake/mpcomm/mpcommConfig.cmake, mpcommConfigVersion.cmake (1.4.0, SameMajorVersion)
    <pkg>/native-status.json          (what was built, or why not)

``setup.py`` runs it at install time (into the wheel's ``mpcomm/``; for an
editable install into the checkout's ``build/native/``, never the source tree);
``python -m mpcomm.tent.build`` reruns it.
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
#: The implementation libmpcomm.so.1 loads at init (beside it): per Python X.Y, like an extension module.
IMPL_NAME = "libmpcomm_python{pyver}.so"
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


def _checkout_of(pkg: Path) -> Path | None:
    """The source checkout an editable install imports ``pkg`` (its core/) from, else None."""
    top = pkg.parent
    return top if (top / "pyproject.toml").is_file() and (top / "tent" / "native").is_dir() else None


def native_root(pkg_dir: str | os.PathLike[str] | None = None) -> Path:
    """Where the provider of this mpcomm lives (its MPCOMM_ROOT): the package dir of a wheel
    install, or :func:`editable_root` of the checkout an editable install imports from.

    A checkout's package dir is never its provider root, whatever files stand there: setup.py
    and :func:`main` build an editable install's provider into build/native/ only, so a
    lib/libmpcomm.so.1 or native-status.json in core/ can only be an old scheme's leftover
    (:data:`OLD_LAYOUT`; ``mpcomm doctor`` names them). Preferring them loaded an old library.
    The rule is the layout, not file times: a git checkout or a copy resets those, so an old
    build can look newer than the sources, and a wheel's times say nothing at all.
    """
    pkg = _package_dir(pkg_dir)
    checkout = _checkout_of(pkg)
    return editable_root(checkout) if checkout is not None else pkg


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
    python = python or os.environ.get("MPCOMM_PYTHON") or sys.executable
    pyver = f"{sys.version_info[0]}.{sys.version_info[1]}"
    inc, lib = dest / "include", dest / "lib"
    cmake = lib / "cmake" / "mpcomm"
    for d in (inc, cmake):
        d.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(src / "mpcomm.h", inc / "mpcomm.h")
    # A wheel finds its interpreter from where it is installed (site-packages); an editable
    # install's build/native/lib records its own, relative to the library, so moving the
    # checkout with its venv keeps working. Never an absolute path, never a link to libpython.
    rel = "" if for_wheel else os.path.relpath(python, lib)
    impl_name = IMPL_NAME.format(pyver=pyver)
    common = [cxx, "-std=c++17", "-O2", "-g", "-fPIC", "-shared", "-fvisibility=hidden", "-Wall", f"-I{src}"]
    steps = [
        # The implementation: mpcomm.cpp over the Python C API, its Python symbols left for the
        # libpython that libmpcomm.so.1 loads (RTLD_GLOBAL) or the host already runs.
        (impl_name, [*common, f"-I{include}", "-Dmpcomm=mpcomm_impl", str(src / "mpcomm.cpp"),
                     str(src / "mpcomm_impl_entry.cpp"), "-ldl", "-pthread"]),
        # The library hosts link: no Python at all until init().
        (SONAME, [*common, f'-DMPCOMM_PY_VERSION="{pyver}"', f'-DMPCOMM_PYTHON_REL="{rel}"',
                  str(src / "mpcomm_front.cpp"), f"-Wl,-soname,{SONAME}", "-ldl", "-pthread"]),
    ]
    for name, cmd in steps:
        tmp = lib / (name + ".tmp")
        try:
            proc = subprocess.run([*cmd, "-o", str(tmp)], capture_output=True, text=True, timeout=600)
        except (OSError, subprocess.TimeoutExpired) as exc:
            return _fail(dest, f"compiler failed to run: {exc}")
        if proc.returncode != 0:
            return _fail(dest, f"compiling {name} failed: {proc.stderr.strip()[-2000:]}")
        os.replace(tmp, lib / name)
    out = lib / SONAME
    link_path = lib / "libmpcomm.so"
    if link_path.is_symlink() or link_path.exists():
        link_path.unlink()
    if for_wheel:
        # A wheel (a zip) cannot hold a symlink: the link-time name is a one-line GNU ld script
        # naming the versioned file (ld looks beside the script), not a second copy of the library.
        link_path.write_text(f"/* the link-time name of {SONAME} (a wheel cannot hold a symlink) */\n"
                             f"INPUT({SONAME})\n")
    else:
        link_path.symlink_to(SONAME)
    for name in ("mpcommConfig.cmake", "mpcommConfigVersion.cmake"):
        shutil.copyfile(src / name, cmake / name)
    status = {"built": True, "version": PROVIDER_VERSION, "library": str(out), "implementation": impl_name,
              "python_version": pyver, "time": time.strftime("%Y-%m-%dT%H:%M:%S")}
    if not for_wheel:
        status.update(python=python, python_relative=rel, compiler=cxx)
    (dest / STATUS_FILE).write_text(json.dumps(status, indent=1) + "\n")
    if not quiet:
        print(f"mpcomm: built {out} (Python {pyver}, loaded at init)")
    return status


#: What an older build scheme wrote into the package dir itself. An editable install now builds the
#: provider into the checkout's build/native/; left in the package dir (core/), they are ignored by
#: native_root() but waste space and confuse a reader (and older mpcomm versions loaded them).
OLD_LAYOUT = (STATUS_FILE, "lib", "include")


def _package_dir(pkg_dir: str | os.PathLike[str] | None) -> Path:
    if pkg_dir is None:
        import mpcomm

        return Path(mpcomm.__file__).resolve().parent
    return Path(pkg_dir)


def stale_artefacts(pkg_dir: str | os.PathLike[str] | None = None) -> list[tuple[Path, str, str]]:
    """[(path, why it is stale, what to do)] for the provider of an editable install; [] for a wheel.

    * the package dir's own native-status.json, lib/ and include/ (:data:`OLD_LAYOUT`);
    * the library :func:`native_status` resolves, when a source under the checkout's tent/native/
      is newer than it (edited since the last build).

    A wheel is left alone: its package dir is its MPCOMM_ROOT, and an installer's file times say
    nothing about which file was built from which.
    """
    pkg = _package_dir(pkg_dir)
    checkout = _checkout_of(pkg)
    if checkout is None:
        return []
    out: list[tuple[Path, str, str]] = []
    for name in OLD_LAYOUT:
        path = pkg / name
        if path.is_symlink() or path.exists():
            out.append((path, f"left by an old build scheme; the provider is {editable_root(checkout)}, this "
                              "copy is never loaded (older mpcomm versions loaded it instead)", f"remove it (rm -r {path})"))
    st = native_status(pkg)
    if st["built"]:
        lib = Path(st["library"])
        sources = [f for f in (checkout / "tent" / "native").iterdir() if f.is_file()]
        newer = [f for f in sources if f.stat().st_mtime > lib.stat().st_mtime]
        if newer:
            out.append((lib, f"older than its source {max(newer, key=lambda f: f.stat().st_mtime)}",
                        "rebuild it: python -m mpcomm.tent.build"))
    return out


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
    ap.add_argument("--dest", help="MPCOMM_ROOT to build into (default: the installed mpcomm's package dir, "
                                   "or build/native/ of the checkout an editable install uses)")
    args = ap.parse_args(argv)
    dest = args.dest
    if dest is None:
        import mpcomm

        pkg = Path(mpcomm.__file__).resolve().parent
        checkout = _checkout_of(pkg)
        dest = str(editable_root(checkout) if checkout is not None else pkg)
    status = build_native(dest, quiet=False, for_wheel=False)
    if not status["built"]:
        print(f"mpcomm: native provider not built: {status['reason']}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
