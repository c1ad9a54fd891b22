"""Optional compiled helpers for plugins: build a small C file once, into a private cache, atomically.

A transport whose hot loop costs more in the interpreter than in the kernel
(shm's copy loop, ucx's put-and-flush) ships a C file beside its module and
a pure-Python fallback. This module turns that C file into a shared library
or, where ``Python.h`` is installed, a CPython extension module, and says in
words why it could not when it cannot. Nothing here is required: every
caller keeps working without a compiler.

Rules every helper follows, because a shared library is code we execute:

* It is built with the system compiler (``$CC`` or ``cc``) into a per-user
  cache directory that nobody else can write (``$MPCOMM_CACHE_DIR``, else
  ``$XDG_CACHE_HOME/mpcomm``, else ``~/.cache/mpcomm``, else
  ``$TMPDIR/mpcomm-<uid>``), never into the package directory.
* Its file name holds a hash of the source, the variant (plain or module),
  the helper's ABI number and the interpreter's ABI and machine, so a changed
  source or another Python never loads a stale build.
* It lands under a temporary name and is renamed into place: concurrent
  processes race safely, and none ever loads half a file.
* A file that is not ours or that others can write is never loaded.
"""

from __future__ import annotations

import ctypes
import hashlib
import importlib.machinery
import importlib.util
import logging
import os
import platform
import secrets
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

__all__ = ["Helper", "artifact_name", "build", "cache_dir", "compiler", "load", "load_module", "private_file",
           "python_include"]


def compiler() -> str | None:
    """The C compiler to use (first word of ``$CC``, else ``cc``), or None."""
    cc = os.environ.get("CC", "").split()
    if cc:
        return shutil.which(cc[0])
    return shutil.which("cc")


def python_include() -> str | None:
    """The directory holding Python.h for this interpreter, if it is installed (python3-dev)."""
    inc = sysconfig.get_paths().get("include")
    return inc if inc and Path(inc, "Python.h").is_file() else None


def _private_dir(path: Path) -> bool:
    """Ours and not writable by anyone else (a shared library planted by another user must never load)."""
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = path.stat()
    except OSError:
        return False
    return st.st_uid == os.getuid() and not st.st_mode & 0o022 and os.access(path, os.W_OK | os.X_OK)


def cache_dir(sub: str) -> Path | None:
    """A private, writable directory ``<cache>/<sub>`` for one plugin's helpers, or None."""
    explicit = os.environ.get("MPCOMM_CACHE_DIR")
    candidates = []
    if explicit:
        candidates.append(Path(explicit) / sub)
    xdg = os.environ.get("XDG_CACHE_HOME")
    candidates.append(Path(xdg) / "mpcomm" / sub if xdg else Path.home() / ".cache" / "mpcomm" / sub)
    candidates.append(Path(tempfile.gettempdir()) / f"mpcomm-{os.getuid()}" / sub)
    for d in candidates:
        if _private_dir(d.parent) and _private_dir(d):
            return d
    return None


def artifact_name(stem: str, source: Path, abi: int, module: bool = False) -> str:
    """``<stem>-<hash>.so``: the hash covers the source, the variant, ``abi`` and this interpreter."""
    h = hashlib.sha256()
    h.update(source.read_bytes())
    h.update(b"\0module" if module else b"\0plain")
    for part in (str(abi), sys.implementation.cache_tag or "", str(sysconfig.get_config_var("SOABI")),
                 platform.machine(), sys.platform):
        h.update(b"\0" + part.encode())
    return f"{stem}-{h.hexdigest()[:24]}.so"


def private_file(path: Path) -> bool:
    """True when ``path`` is ours and nobody else can write it (checked before every load)."""
    st = path.stat()
    return st.st_uid == os.getuid() and not st.st_mode & 0o022


def build(path: Path, source: Path, extra: list[str] | None = None) -> Path | str:
    """``path``, compiling ``source`` into it first if it is not there; else the reason, in words.

    ``extra``: more compiler arguments (``-D...``, ``-I...``). The build runs
    at most 120 s and lands by an atomic rename.
    """
    if path.is_file():
        return path
    cc = compiler()
    if not cc:
        return "no C compiler (set CC or install cc)"
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    cmd = [cc, *os.environ.get("CC", "").split()[1:], "-O2", "-shared", "-fPIC", *(extra or []), "-o", str(tmp),
           str(source)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        if proc.returncode != 0:
            why = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
            return f"{Path(cc).name} failed ({why[0][:200]})"
        os.replace(tmp, path)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"building {source.name} failed ({exc})"
    finally:
        try:
            os.unlink(tmp)
        except OSError:
            pass
    return path


def load_module(name: str, path: Path) -> ModuleType:
    """Import the extension module ``name`` from ``path`` (built with ``-DMP_PYMODULE``); raises on failure."""
    loader = importlib.machinery.ExtensionFileLoader(name, str(path))
    spec = importlib.util.spec_from_file_location(name, str(path), loader=loader)
    if spec is None:
        raise ImportError(f"cannot load {path} as {name}")
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


@dataclass
class Helper:
    """A loaded helper: the shared library (ctypes), its extension module if it built as one, the file."""

    lib: ctypes.CDLL
    module: ModuleType | None
    path: Path


def load(source: Path, sub: str, stem: str, abi: int, abi_symbol: str, module_name: str,
         include: str | None) -> Helper | str:
    """Build (once) and load ``source`` as ``<cache>/<sub>/<stem>-<hash>.so``; else the reason, in words.

    With ``include`` (the directory of Python.h, see :func:`python_include`)
    the source is first built with ``-DMP_PYMODULE`` as the extension module
    ``module_name``; without it, or if that build fails, as a plain library.
    The library must answer ``abi_symbol()`` (an ``int`` function) with
    ``abi``, and the module must carry ``ABI == abi``, or neither is used;
    a module that fails to load leaves the library serving through ctypes.
    """
    if not source.is_file():
        return f"{source.name} is not installed beside the plugin"
    d = cache_dir(sub)
    if d is None:
        return "no private writable cache directory"
    built: Path | str = "no Python.h"
    if include is not None:
        built = build(d / artifact_name(stem, source, abi, True), source, ["-DMP_PYMODULE", f"-I{include}"])
    if not isinstance(built, Path):
        built = build(d / artifact_name(stem, source, abi), source)
    if not isinstance(built, Path):
        return built
    if not private_file(built):
        return f"{built} is not private to this user; not loading it"
    lib = ctypes.CDLL(str(built))
    getattr(lib, abi_symbol).restype = ctypes.c_int
    if getattr(lib, abi_symbol)() != abi:
        return f"{built} has another ABI"
    module = None
    if hasattr(lib, f"PyInit_{module_name}"):
        try:
            module = load_module(module_name, built)
            if module.ABI != abi:
                module = None
        except Exception as exc:  # noqa: BLE001 - the ctypes functions of the same library still serve
            logging.getLogger("mpcomm.native").debug("%s did not load as a module (%s); using ctypes", built, exc)
            module = None
    return Helper(lib, module, built)
