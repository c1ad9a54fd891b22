"""The compiled modules, built when mpcomm was installed; loaded here, never compiled here.

A part whose hot loop costs more in the interpreter than in the kernel (the
engine's inline lane, shm's copy loop, ucx's put-and-flush, tcp's busy-poll)
ships a C file that ``setup.py`` compiles into an ordinary extension module
when the wheel or the editable install is built (see :data:`HELPERS`). At run
time nothing is compiled and nothing is written: :func:`load` imports the
module that the install put beside its package, or says in words why there is
none. The engine's module is required (:mod:`mpcomm.engine.fastlane` raises
ImportError without it); the plugins' helpers are optional: each caller keeps
working without its helper (a pure-Python fallback), at the cost :data:`COST`
records, which :func:`missing` reports to ``mpcomm doctor`` and
:func:`warn_missing_once` logs when an engine starts.

The same file is also used through ``ctypes`` (``ctypes.CDLL(module.__file__)``)
where a caller wants a plain C call that releases the GIL for a whole batch.
"""

from __future__ import annotations

import ctypes
import importlib
import importlib.util
import json
import logging
import threading
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

__all__ = ["COST", "HELPERS", "Helper", "build_record", "load", "missing", "stale", "warn_missing_once"]

log = logging.getLogger("mpcomm.native")

#: Every compiled helper: import name -> (what it accelerates, its C source relative to the mpcomm package).
#: setup.py builds exactly these (it reads the same table from its own copy: keep the two in step,
#: tests/core/test_native_helper.py compares them).
HELPERS = {
    "mpcomm.engine._mpcomm_fastlane": ("engine inline lane", "engine/_fastlane.c"),
    "mpcomm.plugins.shm._mpcomm_copyloop": ("shm copy loop", "plugins/shm/_copyloop.c"),
    "mpcomm.plugins.ucx._mpcomm_ucxloop": ("ucx put/get loop", "plugins/ucx/_ucxloop.c"),
    "mpcomm.plugins.tcp._mpcomm_busypoll": ("tcp busy-poll", "plugins/tcp/_busypoll.c"),
    "mpcomm.plugins.tcp._mpcomm_dataport": ("tcp native data port", "plugins/tcp/_dataport.c"),
}

#: What running without each optional helper costs: measured by scripts/measure_native_cost.py --rounds 3 on
#: this project's development machine (2 CPU cores shared with other work, CPython 3.11.7, gcc -O2 via
#: setuptools, 2026-12-06). Each case times the same operation in a fresh process with the helper
#: turned off by its switch and on, against a target engine in another process; per process the fastest
#: twentieth of the operations counts, and the best of 3 runs:
#: - shm copy loop: Engine.write_many of 256 pieces of 64 B + result() over shm: 52 us with, 200 us without;
#: - ucx loop: the same batch over ucx (UCX shm/tcp lanes of libucx-cu12): 218 us with, 506 us without;
#: - tcp busy-poll: Engine.write(64 B) + result() over loopback tcp: 30 us with, 43 us without.
COST = {
    "mpcomm.plugins.shm._mpcomm_copyloop": "about 3.9x the time of a batch of small shm writes",
    "mpcomm.plugins.ucx._mpcomm_ucxloop": "about 2.3x the time of a batch of small ucx writes",
    "mpcomm.plugins.tcp._mpcomm_busypoll": "about 1.5x the latency of a small tcp write+result()",
    # busy_target.py, tcp, 8 interleaved rounds (branch notes, docs/tcp.md): idle p50 42 vs 31 us, and a
    # target whose application spins in Python answers in 5.1 ms instead of 31 us.
    "mpcomm.plugins.tcp._mpcomm_dataport": ("about 1.35x the latency of a small tcp write, and about 100x "
                                            "(ms instead of us) while the target's application keeps the GIL busy"),
}

#: Written by setup.py's build_ext beside the package: which helpers failed to build and why.
BUILD_RECORD = "native-build.json"


def build_record() -> dict[str, str]:
    """{import name: why it was not built} as recorded at install time ({} when all built or unknown)."""
    try:
        data = json.loads((Path(__file__).resolve().parent / BUILD_RECORD).read_text())
    except (OSError, ValueError):
        return {}
    failed = data.get("failed", {}) if isinstance(data, dict) else {}
    return {str(k): str(v) for k, v in failed.items()} if isinstance(failed, dict) else {}


def _why_absent(name: str, exc: BaseException) -> str:
    recorded = build_record().get(name)
    if recorded:
        return f"not built when mpcomm was installed ({recorded})"
    return f"not installed ({type(exc).__name__}: {exc}); reinstall mpcomm where a C compiler is available"


@dataclass
class Helper:
    """A loaded helper: its extension module, the same file as a ctypes library, and the file."""

    lib: ctypes.CDLL
    module: ModuleType
    path: Path


def load(name: str, abi: int, abi_symbol: str) -> Helper | str:
    """Import the prebuilt helper ``name`` (a key of :data:`HELPERS`); else the reason, in words.

    The module must carry ``ABI == abi`` and its library must answer
    ``abi_symbol()`` (an ``int`` function) with ``abi``: a file from another
    version of the source is refused rather than called with the wrong layout.
    """
    try:
        module = importlib.import_module(name)
    except ImportError as exc:
        return _why_absent(name, exc)
    path = Path(module.__file__ or "")
    if getattr(module, "ABI", None) != abi:
        return f"{path} has ABI {getattr(module, 'ABI', None)}, this mpcomm needs {abi}: reinstall mpcomm"
    lib = ctypes.CDLL(str(path))
    fn = getattr(lib, abi_symbol)
    fn.restype = ctypes.c_int
    if fn() != abi:
        return f"{path} has another ABI: reinstall mpcomm"
    return Helper(lib, module, path)


def missing() -> dict[str, str]:
    """{what it accelerates: why it is missing; what that costs} for every optional helper that does not import."""
    out = {}
    for name in COST:
        what = HELPERS[name][0]
        try:
            importlib.import_module(name)
        except ImportError as exc:
            out[what] = f"{_why_absent(name, exc)}; without it: {COST[name]}"
    return out


def stale(found: dict[str, Path] | None = None) -> list[tuple[Path, Path]]:
    """(built helper, its C source) for each compiled helper older than the source beside it.

    Only a checkout (an editable install) keeps the sources beside the built modules; a wheel
    ships no ``.c``, so nothing is compared there. A source edited since the last build means the
    module in use is not what the source says until it is rebuilt. ``found``: {import name: built
    file} to look at (default: the file each helper of :data:`HELPERS` imports from).
    """
    if found is None:
        found = {}
        for name in HELPERS:
            try:
                spec = importlib.util.find_spec(name)
            except ImportError:
                continue
            if spec is not None and spec.origin:
                found[name] = Path(spec.origin)
    out = []
    for name, built in found.items():
        source = built.parent / Path(HELPERS[name][1]).name
        try:
            if source.stat().st_mtime > built.stat().st_mtime:
                out.append((built, source))
        except OSError:  # no source here (a wheel), or the file went away meanwhile
            continue
    return out


_warned = False
_warn_lock = threading.Lock()


def warn_missing_once() -> None:
    """Log once per process, at WARNING, which accelerations are missing and what they cost."""
    global _warned
    with _warn_lock:
        if _warned:
            return
        _warned = True
    gone = missing()
    if gone:
        log.warning("mpcomm runs without %d compiled helper(s) (the pure-Python fallbacks serve): %s",
                    len(gone), "; ".join(f"{k}: {v}" for k, v in gone.items()))
