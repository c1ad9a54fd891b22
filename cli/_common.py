"""Shared pieces of the command line: options, exit codes, errors, sizes.

Every command is a thin shell over the library; what they share lives here:
the global state the root callback fills in (config path, ``--otel``), the
exit-code policy, and the decorator that turns library errors into a clear
message on stderr plus the documented exit code.
"""

from __future__ import annotations

import functools
import json
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, NoReturn, TypeVar

import typer
from rich.console import Console
from rich.markup import escape

from mpcomm import Config, load_config, records
from mpcomm.errors import (
    AccessError,
    ConfigError,
    MpcommError,
    TransferError,
    TransportUnavailable,
)

#: Diagnostics (progress bars, tables for humans, errors) go here; data goes to stdout.
err_console = Console(stderr=True)

# -- exit codes ------------------------------------------------------------------

EXIT_OK = 0
EXIT_FAILURE = 1  #: anything else that went wrong (a doctor FAIL, an internal error)
EXIT_USAGE = 2  #: bad command line, bad config file, unreadable local file
EXIT_PEER = 3  #: the peer or the transfer failed: unreachable, refused (unknown region, bounds, token), timeout
EXIT_VERIFY = 4  #: --verify found different bytes

EXIT_CODES_EPILOG = (
    "Exit codes: 0 ok; 1 failure (doctor FAIL, internal error); "
    "2 usage or config error (bad option, bad TOML, unreadable local file); "
    "3 peer or transfer error (unreachable peer, wrong secret or token, unknown region, "
    "out of bounds, timeout, no usable transport); 4 --verify checksum mismatch."
)


class CliError(Exception):
    """An error the CLI reports as one line on stderr, with its exit code."""

    def __init__(self, message: str, code: int = EXIT_FAILURE) -> None:
        super().__init__(message)
        self.code = code


def exit_code_for(exc: BaseException) -> int:
    """The documented exit code for a library error."""
    if isinstance(exc, CliError):
        return exc.code
    if isinstance(exc, ConfigError):
        return EXIT_USAGE
    if isinstance(exc, (TransferError, AccessError, TransportUnavailable, ConnectionError, TimeoutError)):
        return EXIT_PEER
    return EXIT_FAILURE


def describe_error(exc: BaseException) -> str:
    if isinstance(exc, MpcommError):
        kind = type(exc).__name__
        hint = " (retrying may help)" if exc.retryable else ""
        return f"{kind}: {exc}{hint}"
    return str(exc) or type(exc).__name__


F = TypeVar("F", bound=Callable[..., Any])


def handle_errors(fn: F) -> F:
    """Turn MpcommError / CliError / OSError into ``error: …`` on stderr and the exit code."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except (typer.Exit, typer.Abort, KeyboardInterrupt):
            raise
        except (MpcommError, CliError) as exc:
            err_console.print(f"[bold red]error:[/] {escape(describe_error(exc))}", highlight=False)
            raise typer.Exit(exit_code_for(exc)) from exc
        except OSError as exc:
            err_console.print(f"[bold red]error:[/] {escape(str(exc))}", highlight=False)
            raise typer.Exit(EXIT_PEER if isinstance(exc, (ConnectionError, TimeoutError)) else EXIT_USAGE) from exc

    return wrapper  # type: ignore[return-value]


# -- global state -----------------------------------------------------------------


@dataclass
class State:
    """What the root callback parsed; commands read it from ``ctx.obj``."""

    config_path: Path | None = None
    otel: str = "none"


def get_state(ctx: typer.Context) -> State:
    obj = ctx.find_root().obj
    return obj if isinstance(obj, State) else State()


ConfigOption = Annotated[
    Path | None,
    typer.Option(
        "--config",
        "-c",
        help="TOML config file (overrides the global --config).",
        envvar="MPCOMM_CONFIG",
        dir_okay=False,
        show_default=False,
    ),
]
JsonOption = Annotated[bool, typer.Option("--json", help="Print machine-readable JSON on stdout.")]


def build_config(ctx: typer.Context, config_path: Path | None = None, **overrides: dict[str, Any]) -> Config:
    """The config for this command: ``--config`` (command, then global), then ``--otel``, then overrides."""
    state = get_state(ctx)
    path = config_path or state.config_path
    cfg = load_config(str(path) if path is not None else None)
    if state.otel != "none":
        cfg = cfg.with_overrides(observability={"trace_transfers": True, "metrics": True})
    for section, values in overrides.items():
        if values:
            cfg = cfg.with_overrides(**{section: values})
    return cfg


def print_json(data: Any) -> None:
    sys.stdout.write(json.dumps(data, indent=None, sort_keys=False, default=str) + "\n")
    sys.stdout.flush()


# -- sizes ----------------------------------------------------------------------


format_size = records.format_size
format_rate = records.format_rate
format_seconds = records.format_seconds


def parse_size(text: str) -> int:
    """``"64MiB"`` → 67108864 (see :func:`mpcomm.records.parse_size`); a usage error otherwise."""
    try:
        return records.parse_size(text)
    except ValueError as exc:
        raise CliError(str(exc), EXIT_USAGE) from None


def fail(message: str, code: int = EXIT_FAILURE) -> NoReturn:
    raise CliError(message, code)


def env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes")
