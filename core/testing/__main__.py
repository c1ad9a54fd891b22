"""``python -m mpcomm.testing TRANSPORT [--plugin MODULE ...] [--check NAME ...]``.

Exit status: 0 when every selected check passed or was skipped, 1 when one
failed, 2 for a usage error: an unknown transport (none of the loaded plugins
provides it) or an unknown check name.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from .kit import CHECKS, run_conformance


def _known_transports(plugins: list[str]) -> list[str]:
    from mpcomm.registry import load_plugins

    return sorted(load_plugins([importlib.import_module(m) for m in plugins]).transports)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m mpcomm.testing", description="Run the mpcomm conformance kit.")
    p.add_argument("transport")
    p.add_argument("--plugin", action="append", default=[], help="module with hookimpls (not installed as entry point)")
    p.add_argument("--check", action="append", default=[], help="run only these checks (names without check_)")
    args = p.parse_args(argv)
    names = [c.__name__.removeprefix("check_") for c in CHECKS]
    unknown_checks = [c for c in args.check if c.removeprefix("check_") not in names]
    if unknown_checks:
        p.error(f"--check {unknown_checks[0]}: no such check (known: {', '.join(names)})")
    try:
        known = _known_transports(args.plugin)
    except ImportError as exc:
        p.error(f"--plugin: cannot import {exc.name or exc}: {exc}")
    if args.transport not in known:
        p.error(f"no such transport {args.transport!r}: the loaded plugins provide {', '.join(known) or 'none'} "
                "(install its plugin, or name its module with --plugin)")
    wanted = {c.removeprefix("check_") for c in args.check}
    checks = [c for c in CHECKS if not wanted or c.__name__.removeprefix("check_") in wanted]
    report = run_conformance(args.transport, plugins=args.plugin, checks=checks)
    print(report.summary())
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
