"""The ``mpcomm`` command: a Typer app that mounts one module per command.

The root callback takes the options every command shares (``--config``,
``--otel``, ``--log-level``); each command lives in its own module with its
own ``typer.Typer`` merged here with ``add_typer``. Every command's result
(tables, summaries, records; ``--json`` where it applies) goes to stdout,
diagnostics (progress, status lines, logs, errors) to stderr.
"""

from __future__ import annotations

import logging
from enum import Enum
from pathlib import Path
from typing import Annotated, Optional

import typer

from mpcomm import __version__

from . import bench, demo, doctor, plugins_cmd, regions, secret, serve, topology, transfer
from ._common import EXIT_CODES_EPILOG, EXIT_USAGE, State, err_console, handle_errors, print_error
from .otel import setup as setup_otel

__all__ = ["app", "main"]


class OtelMode(str, Enum):
    none = "none"
    console = "console"
    otlp = "otlp"


class LogLevel(str, Enum):
    debug = "debug"
    info = "info"
    warning = "warning"
    error = "error"


app = typer.Typer(
    name="mpcomm",
    help="mpcomm: one-sided transfers between the memory of many machines.",
    epilog=EXIT_CODES_EPILOG,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)
for _module in (plugins_cmd, demo, doctor, serve, transfer, bench, secret):
    app.add_typer(_module.app)
for _module in (topology, regions):  # issue 10
    app.add_typer(_module.app)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"mpcomm {__version__}")
        raise typer.Exit()


@app.callback()
@handle_errors
def root(
    ctx: typer.Context,
    config: Annotated[
        Optional[Path],
        typer.Option("--config", "-c", help="TOML config file for every command.", envvar="MPCOMM_CONFIG",
                     dir_okay=False, show_default=False),
    ] = None,
    otel: Annotated[
        OtelMode,
        typer.Option("--otel", help="Send spans and metrics to the console (stderr) or to OTLP "
                     "(OTEL_EXPORTER_OTLP_* variables); turns on observability.metrics (a span per command, "
                     "operation and batch; per-request spans need observability.trace_transfers).",
                     envvar="MPCOMM_OTEL", case_sensitive=False),
    ] = OtelMode.none,
    log_level: Annotated[
        LogLevel,
        typer.Option("--log-level", help="Library log level (logs go to stderr).", envvar="MPCOMM_LOG_LEVEL",
                     case_sensitive=False),
    ] = LogLevel.warning,
    version: Annotated[
        bool, typer.Option("--version", help="Print the version and exit.", callback=_version, is_eager=True)
    ] = False,
) -> None:
    _configure_logging(log_level.value)
    ctx.obj = State(config_path=config, otel=otel.value)
    if otel is not OtelMode.none:
        shutdown = setup_otel(otel.value)
        ctx.call_on_close(shutdown)
        # One span for the whole command, parent of the operations' spans; it ends
        # before the providers flush (close callbacks run last-in, first-out).
        from mpcomm.telemetry import operation_span

        span = operation_span(f"mpcomm {ctx.invoked_subcommand or ''}".strip(), {"mpcomm.cli.command":
                                                                                  ctx.invoked_subcommand})
        span.__enter__()
        ctx.call_on_close(lambda: span.__exit__(None, None, None))


def _configure_logging(level: str) -> None:
    from rich.logging import RichHandler

    logger = logging.getLogger("mpcomm")
    logger.setLevel(level.upper())
    if not any(getattr(h, "mpcomm_cli", False) for h in logger.handlers):
        handler = RichHandler(console=err_console, show_path=False, rich_tracebacks=False)
        handler.mpcomm_cli = True  # type: ignore[attr-defined]  # marks the handler this CLI added
        logger.addHandler(handler)
        logger.propagate = False


def main() -> None:
    """Console-script entry point: usage errors, like every other error, are one line (exit 2)."""
    # typer >= 0.20 vendors click; BadParameter's bases are the click exception classes either way.
    usage_error, click_exception = typer.BadParameter.__mro__[1], typer.BadParameter.__mro__[2]
    try:
        code = app(standalone_mode=False)
    except usage_error as exc:
        if type(exc).__name__ == "NoArgsIsHelpError":  # bare `mpcomm`: the help, as before
            exc.show()
            raise SystemExit(EXIT_USAGE) from None
        ctx = getattr(exc, "ctx", None)
        command = ctx.command_path if ctx is not None else "mpcomm"
        print_error(f"UsageError: {exc.format_message()} (see {command} --help)")
        raise SystemExit(EXIT_USAGE) from None
    except click_exception as exc:
        print_error(f"{type(exc).__name__}: {exc.format_message()}")
        raise SystemExit(getattr(exc, "exit_code", 1)) from None
    except typer.Abort:
        print_error("Aborted")
        raise SystemExit(130) from None
    except KeyboardInterrupt:
        raise SystemExit(130) from None
    raise SystemExit(code if isinstance(code, int) else 0)


if __name__ == "__main__":  # pragma: no cover
    main()
