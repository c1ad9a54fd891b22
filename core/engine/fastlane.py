"""A bound pair's inline step in C: ``_fastlane.c``, built when mpcomm was installed.

``Engine.write``/``read`` run each plain request of a bound pair through
the C ``lane`` callable :func:`mpcomm.engine.bound.native_step` makes for
the pair's binding when this module is available; when it declines, or is
not in use, the request takes the one Python path (``Pipeline.single``) with
the same binding. The extension module
``mpcomm.engine._mpcomm_fastlane`` is built by setup.py and loaded by
:mod:`mpcomm.native_helper`, like the plugins' helpers; nothing is compiled
at run time. ``MPCOMM_FASTLANE=0`` turns it off (read at each binding, so a
test or an operator can compare the two in one process).
"""

from __future__ import annotations

import logging
import os
import threading
from types import MethodType, ModuleType
from typing import Any

from .. import native_helper

log = logging.getLogger("mpcomm.engine")

ABI = 4  # 4: go (Engine.write/read's lookup); 3: scan (planning); 2: what the lane reads comes as probes
#          and descriptors, not attribute names
MODULE = "mpcomm.engine._mpcomm_fastlane"

_lock = threading.Lock()
_module: ModuleType | None = None
_tried = False
#: Why the C lane is or is not in use, in words (see :func:`status`).
reason = "not loaded yet"


def module() -> ModuleType | None:
    """The extension module, or None (disabled, or not built when mpcomm was installed)."""
    global _module, _tried, reason
    if os.environ.get("MPCOMM_FASTLANE", "1") == "0":
        reason = "disabled by MPCOMM_FASTLANE=0"
        return None
    with _lock:
        if not _tried:
            _tried = True
            try:
                h = native_helper.load(MODULE, ABI, "mpcomm_fastlane_abi")
            except Exception as exc:  # noqa: BLE001 - optional: any failure leaves the Python lane
                h = f"loading it failed ({exc})"
            if isinstance(h, str):
                reason = h
            else:
                _module, reason = h.module, "in use"
            if _module is None:
                log.debug("engine: C inline lane not used: %s", reason)
        elif _module is not None:
            reason = "in use"
        return _module


def native(name: str) -> Any:
    """The module's C function ``name``, or False where the module is not in use."""
    mod = module()
    return getattr(mod, name, False) if mod is not None else False


def status() -> str:
    """``"in use"``, or why not (loads the module first): what ``Engine.stats()["inline_lane"]`` shows."""
    module()
    return reason


def step(table: dict[Any, Any], kind: str) -> Any:
    """``go(src, remote, lo, ro, length, timeout) -> handle | None``: ``Engine.write`` (``kind``
    "write") or ``read`` looks up a bound pair's C step in ``table`` (keyed ``(id(local), id(remote),
    kind)``) and runs it; the module's ``go`` bound to its state where in use, else the same lookup
    in Python."""
    mod = module()
    if mod is not None:
        return MethodType(mod.go, [table, kind, None])

    def go(src: Any, remote: Any, lo: Any, ro: Any, length: Any, timeout: Any) -> Any:
        run = table.get((id(src), id(remote), kind))
        return None if run is None else run(lo, ro, length, timeout)
    return go
