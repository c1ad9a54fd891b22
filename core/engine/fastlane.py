"""The engine's native module (``_fastlane.c``): required, built when mpcomm is installed.

It holds the one implementation of the rules it runs (a bound pair's inline
step, the batch scan, the batch bounds check), so there is no Python twin to
fall back to: setup.py fails the install when it cannot build it, and a
missing or stale module (another ABI) makes ``import mpcomm`` raise
ImportError saying how to rebuild it. :mod:`mpcomm.native_helper` loads it,
with its ABI check; nothing is compiled at run time.

``MPCOMM_FASTLANE=0`` only turns the *inline lane* off: no binding uses a
transport's inline move, and those pairs take the posted binding or the full
path. It is read at each binding (:func:`inline_enabled`), so a test or an
operator can compare the two in one process.
"""

from __future__ import annotations

import os
from typing import Any

from .. import native_helper

ABI = 7  # 7: no go (Engine.write/read's lookup is Python's dict); 6: scan from a start index; 5: a region's lease state read from its slots; 4: go; 3: scan; 2: probes and descriptors
MODULE = "mpcomm.engine._mpcomm_fastlane"


def _load() -> Any:
    h = native_helper.load(MODULE, ABI, "mpcomm_fastlane_abi")
    if isinstance(h, str):
        raise ImportError(f"mpcomm needs its engine module {MODULE}: {h}. Rebuild it: `pip install -e .` in a "
                          "checkout, or reinstall mpcomm where a C compiler and Python's headers are available",
                          name=MODULE)
    return h.module


mod = _load()


def native(name: str) -> Any:
    """The module's C function ``name`` (checks.py and planning.py look theirs up through this)."""
    return getattr(mod, name)


def inline_enabled() -> bool:
    """Whether bindings may use a transport's inline move (``MPCOMM_FASTLANE`` is not ``0``)."""
    return os.environ.get("MPCOMM_FASTLANE", "1") != "0"
