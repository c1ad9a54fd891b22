"""Shared helpers for the rdma_zerocopy tests."""

from __future__ import annotations

import importlib.machinery
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from rdma_support import expected_category  # noqa: E402,F401 (re-exported)


