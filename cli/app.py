"""The ``mpcomm`` command: a Typer app that mounts one module per command.

The root callback takes the options every command shares (``--config``,
``--otel``, ``--log-level``); each command lives in its own module with its
own ``typer.Typer`` merged here with ``add_typer``. Data goes to stdout
(``--json`` where it applies), diagnostics to stderr.
"""

from __future__ import annotations

import logging
from enum import Enum
from pathlib import Path
from typing import Annotated, Optional

import typer

from mpcomm import __version__

from . import bench, demo, doctor, plugins_cmd, serve, transfer
from . import regions, topology  # issue 10
from ._common import EXIT_CODES_EPILOG, State, err_console, handle_errors
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
for _module in (plugins_cmd, demo, doctor, serve, transfer, bench):
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
                     "(OTEL_EXPORTER_OTLP_* variables); turns on observability.trace_transfers and metrics.",
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


def _configure_logging(level: str) -> None:
    from rich.logging import RichHandler

    logger = logging.getLogger("mpcomm")
    logger.setLevel(level.upper())
    if not any(getattr(h, "_mpcomm_cli", False) for h in logger.handlers):
        handler = RichHandler(console=err_console, show_path=False, rich_tracebacks=False)
        handler._mpcomm_cli = True  # type: ignore[attr-defined]
        logger.addHandler(handler)
        logger.propagate = False


def main() -> None:
    """Console-script entry point (``mpcomm = "mpcomm.cli.app:main"``)."""
    app()


if __name__ == "__main__":  # pragma: no cover
    main()
