#!/usr/bin/env python3
"""Source lines of the engine's request path and its native step, at a git revision and at 0078adb.

What is counted: the *request path*, every room a request goes through from
``Engine.write``/``read``/``submit`` (and ``write_many``, ``prepare``, ...) to its
settling, plus the native step that runs part of it in C. That is every module of
``core/engine/`` that a request passes through, and ``core/engine/_fastlane.c``:

* at 0078adb (issue 28's "today"): ``requests.py`` (the whole ``Pipeline``),
  ``fastlane.py`` and ``_fastlane.c``;
* since the ``Pipeline`` was split into rooms: ``requests.py`` and the rooms
  (:data:`ROOMS`), ``fastlane.py`` and ``_fastlane.c``.

``core/engine/__init__.py`` (the ``Engine`` facade: requests enter there, but it also
holds regions, peers, transports and notifications) is shown on a line of its own and
in a second total. Not counted: the modules the path uses but that are no part of it
(``completions``, ``deadlines``, ``notify``, ``peers``, ``regions`` of ``core/engine``;
``core/transfer.py``, ``core/transport.py``; the plugins), at either revision.

A *source line* is a line with code on it: blank lines, comments and docstrings (a
string literal that is a statement of its own) are not counted. Python is read with
:mod:`tokenize`, so a ``#`` inside a string is code and a multi-line expression counts
every line it spans. C: a line counts unless it is blank, a ``//`` comment, or inside
or wholly a ``/* ... */`` comment.

    python benchmarks/request_path_size.py            # HEAD against 0078adb
    python benchmarks/request_path_size.py main~3     # another revision
"""

from __future__ import annotations

import argparse
import io
import subprocess
import sys
import tokenize

BASELINE = "0078adb"
ENGINE = "core/engine/"
#: The rooms of the Pipeline (the ones that exist at a revision are counted).
ROOMS = ("requests", "units", "admission", "planning", "bound", "posting", "retries", "stripes", "timeouts",
         "notifying", "endings", "cancelling", "checks", "fastlane")
PATH = tuple(f"{ENGINE}{m}.py" for m in ROOMS) + (f"{ENGINE}_fastlane.c",)
FACADE = f"{ENGINE}__init__.py"

_SKIP = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER}
_STATEMENT_START = {tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT}


def python_sloc(src: str) -> int:
    """Lines holding a Python token other than a comment or a docstring."""
    toks = list(tokenize.generate_tokens(io.StringIO(src).readline))
    lines: set[int] = set()
    prev = None  # the last token that ends or opens a statement, or was code
    for i, t in enumerate(toks):
        if t.type in _SKIP:
            if t.type not in (tokenize.NL, tokenize.COMMENT):
                prev = t
            continue
        docstring = (t.type == tokenize.STRING and (prev is None or prev.type in _STATEMENT_START)
                     and toks[i + 1].type == tokenize.NEWLINE)
        if not docstring:
            lines.update(range(t.start[0], t.end[0] + 1))
        prev = t
    return len(lines)


def c_sloc(src: str) -> int:
    """Lines of C with code on them (outside ``/* */`` and ``//`` comments)."""
    n = 0
    in_comment = False
    for line in src.splitlines():
        s = line.strip()
        if in_comment:
            if "*/" not in s:
                continue
            in_comment = False
            s = s.split("*/", 1)[1].strip()
        if s.startswith("/*"):
            in_comment = "*/" not in s
            continue
        if s and not s.startswith("//"):
            n += 1
    return n


def sloc(path: str, src: str) -> int:
    return python_sloc(src) if path.endswith(".py") else c_sloc(src)


def show(rev: str, path: str, cwd: str | None = None) -> str | None:
    """The file at ``rev``, or None where it did not exist."""
    got = subprocess.run(["git", "show", f"{rev}:{path}"], capture_output=True, text=True, cwd=cwd)
    return got.stdout if got.returncode == 0 else None


def count(rev: str, cwd: str | None = None) -> dict[str, int]:
    """SLOC per file of the request path at ``rev`` (the files that exist there), and of the facade."""
    out = {}
    for path in (*PATH, FACADE):
        src = show(rev, path, cwd)
        if src is not None:
            out[path] = sloc(path, src)
    return out


def report(rev: str, counts: dict[str, int]) -> tuple[int, int]:
    print(f"{rev}:")
    path = {p: n for p, n in counts.items() if p != FACADE}
    for p, n in path.items():
        print(f"  {n:6}  {p}")
    total = sum(path.values())
    facade = counts.get(FACADE, 0)
    print(f"  {total:6}  request path + native step")
    print(f"  {facade:6}  {FACADE}")
    print(f"  {total + facade:6}  with {FACADE}")
    return total, total + facade


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("rev", nargs="?", default="HEAD", help="the revision to count (default HEAD)")
    ap.add_argument("--baseline", default=BASELINE, help=f"the revision to compare with (default {BASELINE})")
    args = ap.parse_args(argv)
    now = count(args.rev)
    if not now:
        print(f"no request-path file found at {args.rev}", file=sys.stderr)
        return 1
    before = count(args.baseline)
    b_path, b_all = report(args.baseline, before)
    n_path, n_all = report(args.rev, now)
    if b_path and b_all:
        print(f"ratio {args.rev}/{args.baseline}: {n_path / b_path:.2f} (request path + native step), "
              f"{n_all / b_all:.2f} (with {FACADE})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
