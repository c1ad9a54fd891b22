"""``mpcomm secret``: print a new 256-bit shared secret (hex), or write it to a file only its owner reads.

Give the same secret to every node: ``transport.secret`` in the config file,
the ``MPCOMM_SECRET`` environment variable, or ``mpcomm serve --secret-file``.
Never on a command line, where every user of the machine sees it in the
process list.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path
from typing import Annotated, Optional

import typer

from ._common import EXIT_USAGE, CliError, err_console, handle_errors

app = typer.Typer()


@app.command("secret")
@handle_errors
def secret(
    file: Annotated[
        Optional[Path],
        typer.Option("--file", "-o", help="Write the secret to this new file (mode 0600) instead of stdout.",
                     dir_okay=False, show_default=False),
    ] = None,
) -> None:
    """Print a new random 256-bit shared secret (64 hex digits)."""
    value = secrets.token_hex(32)
    if file is None:
        typer.echo(value)
        return
    try:
        fd = os.open(file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        raise CliError(f"--file {file}: already exists; not overwriting a secret", EXIT_USAGE) from None
    except OSError as exc:
        raise CliError(f"--file {file}: {exc.strerror}", EXIT_USAGE) from exc
    with os.fdopen(fd, "w") as f:
        f.write(value + "\n")
    err_console.print(f"[dim]wrote a new 256-bit secret to {file} (mode 0600)[/]")
