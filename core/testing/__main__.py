"""``python -m mpcomm.testing TRANSPORT [--plugin MODULE ...] [--check NAME ...]``."""

from __future__ import annotations

import argparse
import sys

from .kit import CHECKS, run_conformance


def main() -> int:
    p = argparse.ArgumentParser(prog="python -m mpcomm.testing", description="Run the mpcomm conformance kit.")
    p.add_argument("transport")
    p.add_argument("--plugin", action="append", default=[], help="module with hookimpls (not installed as entry point)")
    p.add_argument("--check", action="append", default=[], help="run only these checks (names without check_)")
    args = p.parse_args()
    checks = [c for c in CHECKS if not args.check or c.__name__.removeprefix("check_") in args.check]
    report = run_conformance(args.transport, plugins=args.plugin, checks=checks)
    print(report.summary())
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
