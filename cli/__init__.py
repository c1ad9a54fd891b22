"""The mpcomm command line (``mpcomm``, ``python -m mpcomm.cli``).

The CLI needs the ``cli`` extra (typer, rich); the library does not. The
console script points here rather than at :mod:`mpcomm.cli.app` so that a
base install says which extra to install instead of a ModuleNotFoundError.
"""

from __future__ import annotations

import sys

__all__ = ["main"]

_CLI_DEPENDENCIES = ("typer", "rich")


def main() -> None:
    """Console-script entry point: run the typer app, or explain what is missing (exit 2)."""
    try:
        from .app import main as app_main
    except ImportError as exc:
        if exc.name not in _CLI_DEPENDENCIES and not any(
                (exc.name or "").startswith(d + ".") for d in _CLI_DEPENDENCIES):
            raise
        sys.stderr.write(
            f"error: the mpcomm command needs the 'cli' extra ({exc.name} is not installed): "
            "pip install 'mpcomm[cli]'\n")
        raise SystemExit(2) from None
    app_main()
