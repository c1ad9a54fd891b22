"""Shared pieces of the command line: options, exit codes, errors, sizes.

Every command is a thin shell over the library; what they share lives here:
the global state the root callback fills in (config path, ``--otel``), the
exit-code policy, and the decorator that turns library errors into a clear
message on stderr plus the documented exit code.
"""

from __future__ import annotations

import errno
import functools
import json
import logging
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, NoReturn, TypeVar

import typer
from rich.console import Console
from rich.markup import escape

import mpcomm
from mpcomm import Config, load_config
from mpcomm.errors import (
    AccessError,
    AllocationError,
    ConfigError,
    MpcommError,
    TransferError,
    TransportUnavailable,
)
from mpcomm.peer import format_endpoint, parse_endpoint

from . import records

#: Results (tables, summaries, records: what the command was asked for) go to stdout,
#: diagnostics (progress bars, status lines, warnings, logs, errors) to stderr, so that
#: ``mpcomm demo > out.txt`` keeps the result and the terminal keeps the chatter.
out_console = Console()
err_console = Console(stderr=True)

# -- exit codes ------------------------------------------------------------------

EXIT_OK = 0
EXIT_FAILURE = 1  #: anything else that went wrong (a doctor FAIL, an internal error)
EXIT_USAGE = 2  #: bad command line, bad config file, unreadable local file
EXIT_PEER = 3  #: the peer or the transfer failed: unreachable, refused (unknown region, bounds, token), timeout
EXIT_VERIFY = 4  #: --verify found different bytes

EXIT_CODES_EPILOG = (
    "Exit codes: 0 ok; 1 failure (doctor FAIL, internal error); "
    "2 usage or config error (bad option or size, bad TOML, unreadable or empty local file, "
    "malformed address or descriptor, endpoint in use, size larger than this host can hold); "
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
    if isinstance(exc, (ConfigError, AllocationError)):
        return EXIT_USAGE
    if isinstance(exc, (TransferError, AccessError, TransportUnavailable, ConnectionError, TimeoutError)):
        return EXIT_PEER
    return EXIT_FAILURE


#: How a CliError is named in its error line, by exit code.
_CLI_ERROR_NAMES = {EXIT_USAGE: "UsageError", EXIT_PEER: "PeerError", EXIT_VERIFY: "VerifyError"}


def describe_error(exc: BaseException) -> str:
    """``<ErrorClass>: <message>`` for the one error line."""
    if isinstance(exc, MpcommError):
        kind = type(exc).__name__
        hint = " (retrying may help)" if exc.retryable else ""
        return f"{kind}: {exc}{hint}"
    if isinstance(exc, CliError):
        return f"{_CLI_ERROR_NAMES.get(exc.code, 'Error')}: {exc}"
    return f"{type(exc).__name__}: {exc}"


F = TypeVar("F", bound=Callable[..., Any])


def print_error(text: str) -> None:
    """The one ``error: …`` line on stderr (folded only by the terminal, never by rich)."""
    err_console.print(f"[bold red]error:[/] {escape(text)}", highlight=False, soft_wrap=True)


def handle_errors(fn: F) -> F:
    """Turn every error into one ``error: <Class>: <message>`` line on stderr and the documented exit code.

    Unexpected exceptions (a bug) are one line too, exit 1; ``--log-level debug``
    adds the traceback.
    """

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except (typer.Exit, typer.Abort, KeyboardInterrupt):
            raise
        except (MpcommError, CliError) as exc:
            print_error(describe_error(exc))
            raise typer.Exit(exit_code_for(exc)) from exc
        except BrokenPipeError as exc:
            # stdout's reader left (`mpcomm bench --json | head -1`): stop quietly, as `yes | head` does.
            try:
                os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            except (OSError, ValueError):
                pass
            raise typer.Exit(128 + 13) from exc
        except OSError as exc:
            print_error(f"{type(exc).__name__}: {exc}")
            raise typer.Exit(EXIT_PEER if isinstance(exc, (ConnectionError, TimeoutError)) else EXIT_USAGE) from exc
        except Exception as exc:  # noqa: BLE001 - a bug still gets one line and exit 1
            logging.getLogger("mpcomm.cli").debug("unexpected error", exc_info=True)
            print_error(f"{type(exc).__name__}: {exc} (an internal error; --log-level debug shows the traceback)")
            raise typer.Exit(EXIT_FAILURE) from exc

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
        # Metrics, plus a span per operation and batch (mpcomm.telemetry); per-request
        # spans stay off unless the config asks for them (observability.trace_transfers).
        cfg = cfg.with_overrides(observability={"metrics": True})
    for section, values in overrides.items():
        if values:
            cfg = cfg.with_overrides(**{section: values})
    return cfg


def print_json(data: Any) -> None:
    """One JSON document on one line (JSON Lines: commands that emit many print many lines)."""
    sys.stdout.write(json.dumps(data, indent=None, sort_keys=False, default=str) + "\n")
    sys.stdout.flush()


# -- engines ------------------------------------------------------------------------


def start_engine(cfg: Config, *, endpoint: str | None = None, secret: str | None = None,
                 transports: list[str] | None = None) -> mpcomm.Engine:
    """An Engine, with a listen failure ("Address already in use") naming the address (exit 2)."""
    try:
        return mpcomm.Engine(cfg, endpoint=endpoint, secret=secret, transports=transports or None)
    except OSError as exc:
        if exc.errno not in (errno.EADDRINUSE, errno.EADDRNOTAVAIL, errno.EACCES):
            raise
        where = endpoint or cfg.transport.endpoint
        source = "--endpoint" if endpoint else "transport.endpoint"
        raise CliError(f"cannot listen on {where} ({source}): {exc.strerror or exc}; choose another "
                       "address, or port 0 for a free one", EXIT_USAGE) from exc


def client_endpoint(cfg: Config, endpoint: str | None) -> str:
    """Where an initiator's engine listens: ``endpoint`` if given, else the configured
    host on a free port, so a fixed ``transport.endpoint`` (meant for ``serve``)
    does not collide with the server on the same host or with a second client."""
    if endpoint:
        return endpoint
    host, _port = parse_endpoint(cfg.transport.endpoint)
    return format_endpoint(host, 0)


def client_engine(cfg: Config, *, endpoint: str | None = None, secret: str | None = None,
                  transports: list[str] | None = None) -> mpcomm.Engine:
    """The engine of a command that only initiates (demo, put, get, bench)."""
    return start_engine(cfg, endpoint=client_endpoint(cfg, endpoint), secret=secret, transports=transports)


EndpointOption = Annotated[
    str | None,
    typer.Option("--endpoint", help="This side's control endpoint host:port (default: transport.endpoint's "
                 "host, on a free port).", show_default=False),
]


# -- sizes ----------------------------------------------------------------------


format_size = records.format_size
format_rate = records.format_rate
format_seconds = records.format_seconds


def parse_size(text: str) -> int:
    """``"64MiB"`` → 67108864 (see :func:`mpcomm.cli.records.parse_size`); a usage error otherwise."""
    try:
        return records.parse_size(text)
    except ValueError as exc:
        raise CliError(str(exc), EXIT_USAGE) from None


def fail(message: str, code: int = EXIT_FAILURE) -> NoReturn:
    raise CliError(message, code)


def env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes")


# -- progress -------------------------------------------------------------------------


def stop_clock(progress: Any, task: Any) -> float:
    """Stop a task's clock (its ``t0`` field); returns the seconds that the bar's rate and the summary share."""
    t1 = time.perf_counter()
    fields = progress.tasks[[t.id for t in progress.tasks].index(task)].fields
    progress.update(task, t1=t1)
    return t1 - fields["t0"]


def progress_bar(*, transient: bool = False) -> Any:
    """A progress bar on stderr whose sizes and rate use the CLI's units (see records):
    the rate is bytes so far over time so far, the same figure the summary prints."""
    from rich.progress import BarColumn, Progress, ProgressColumn, TextColumn, TimeRemainingColumn
    from rich.text import Text

    class _Bytes(ProgressColumn):
        def render(self, task: Any) -> Text:
            total = format_size(task.total) if task.total is not None else "?"
            return Text(f"{format_size(task.completed)}/{total}", style="progress.download")

    class _Rate(ProgressColumn):
        def render(self, task: Any) -> Text:
            t0 = task.fields.get("t0")
            if t0 is None:
                elapsed = task.elapsed or 0.0
            else:
                elapsed = task.fields.get("t1", time.perf_counter()) - t0
            return Text(format_rate(task.completed / elapsed) if elapsed > 0 else "-", style="progress.data.speed")

    return Progress(TextColumn("{task.description}"), BarColumn(), _Bytes(), _Rate(), TimeRemainingColumn(),
                    console=err_console, transient=transient)
