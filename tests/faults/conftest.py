"""The fault suite: hosts in network namespaces (netns.py), an initiator driver in a namespace
(driver.py), and generated hostile input. The raw control client is shared with tests/core."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1] / "core"))  # rawpeer, core_support
