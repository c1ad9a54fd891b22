"""benchmarks/request_path_size.py: the request path's source lines, counted the same way at any revision."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "request_path_size.py"

# Loaded from its path: benchmarks/ is not a package.
_spec = importlib.util.spec_from_file_location("request_path_size", SCRIPT)
size = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(size)


def test_python_lines_skip_blank_comments_and_docstrings():
    src = '''"""Module docstring,
over two lines."""

import os  # a comment


def f(a,
      b):
    """Docstring."""
    # a comment line
    s = "# not a comment"
    return """a string that is
an expression, not a docstring"""
'''
    # import, def (2 lines), s =, return (2 lines)
    assert size.python_sloc(src) == 6


def test_c_lines_skip_blank_and_comments():
    src = "/* a\n * comment\n */\nint x;\n\n// line\nint f(void) { /* trailing */\n    return x;\n}\n"
    assert size.c_sloc(src) == 4


def test_it_runs_on_head():
    got = subprocess.run([sys.executable, str(SCRIPT), "HEAD"], capture_output=True, text=True, cwd=ROOT,
                         timeout=60)
    if "no request-path file found" in got.stderr:  # not a git checkout (an sdist): nothing to count
        pytest.skip("not a git checkout")
    assert got.returncode == 0, got.stderr
    assert "HEAD:" in got.stdout and "core/engine/_fastlane.c" in got.stdout
    assert "request path + native step" in got.stdout
    now = size.count("HEAD", cwd=str(ROOT))
    assert now[size.FACADE] > 0 and sum(n for p, n in now.items() if p != size.FACADE) > 0
