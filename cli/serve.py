"""``mpcomm serve``: an engine that exposes named regions until SIGINT/SIGTERM.

Regions are allocated (``--region kv=64MiB``) or backed by a file through
mmap (``--region weights=@model.bin``; writes by peers land in the file
unless ``--readonly``). The first line on stdout is the address peers dial
(with ``--json``: one JSON line with the address and every region's
descriptor), so scripts can read it; everything else goes to stderr.
"""

from __future__ import annotations

import mmap
import os
import signal
import threading
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Annotated, Any, Optional

import typer
from rich.markup import escape

import mpcomm
from mpcomm.errors import AllocationError
from mpcomm.memory import check_allocatable

from ._common import (
    EXIT_USAGE,
    CliError,
    ConfigOption,
    JsonOption,
    build_config,
    err_console,
    format_size,
    handle_errors,
    parse_size,
    print_json,
    start_engine,
)

app = typer.Typer()


class Mode(str, Enum):
    zero_copy = "zero-copy"
    copy = "copy"


@dataclass
class RegionSpec:
    name: str
    size: int = 0
    path: Path | None = None


def parse_region(text: str) -> RegionSpec:
    """``name=SIZE`` or ``name=@path``."""
    name, sep, value = text.partition("=")
    name = name.strip()
    if not sep or not name or not value:
        raise CliError(f"--region {text!r}: expected NAME=SIZE (e.g. kv=64MiB) or NAME=@FILE", EXIT_USAGE)
    if value.startswith("@"):
        return RegionSpec(name, path=Path(value[1:]))
    size = parse_size(value)
    if size <= 0:
        raise CliError(f"--region {text!r}: size must be positive", EXIT_USAGE)
    return RegionSpec(name, size=size)


def check_sizes(specs: list[RegionSpec], transports: list[str] | None) -> None:
    """Refuse, before any engine or memory exists, regions this host cannot hold (exit 2).

    Allocated regions are pre-faulted, so an oversized one would not fail but
    summon the OOM killer; their sizes together must fit (see
    :func:`mpcomm.memory.check_allocatable`). shm backs them with shared memory.
    """
    total = sum(s.size for s in specs if s.path is None)
    if not total:
        return
    shm = transports is None or "shm" in transports
    try:
        check_allocatable(total, shm=shm)
    except AllocationError as exc:
        which = ", ".join(f"{s.name}={format_size(s.size)}" for s in specs if s.path is None)
        raise AllocationError(f"--region {which}: {exc}") from None


def read_secret_file(path: Path) -> str:
    """The secret in ``path`` (surrounding whitespace stripped); warns when others may read the file."""
    try:
        st = os.stat(path)
        text = path.read_text(encoding="utf-8").strip()
    except OSError as exc:
        raise CliError(f"--secret-file {path}: {exc.strerror}", EXIT_USAGE) from exc
    except UnicodeDecodeError:
        raise CliError(f"--secret-file {path}: not UTF-8 text", EXIT_USAGE) from None
    if not text:
        raise CliError(f"--secret-file {path}: the file is empty", EXIT_USAGE)
    if st.st_mode & 0o077:
        err_console.print(f"[yellow]warning: {escape(str(path))} is readable by other users "
                          f"(mode {st.st_mode & 0o777:o}); chmod 600 it[/]")
    return text


def _map_file(path: Path, readonly: bool) -> mmap.mmap:
    try:
        fd = os.open(path, os.O_RDONLY if readonly else os.O_RDWR)
    except OSError as exc:
        raise CliError(f"--region @{path}: {exc.strerror}", EXIT_USAGE) from exc
    try:
        size = os.fstat(fd).st_size
        if size == 0:
            raise CliError(f"--region @{path}: the file is empty; a region needs at least one byte", EXIT_USAGE)
        return mmap.mmap(fd, size, access=mmap.ACCESS_READ if readonly else mmap.ACCESS_WRITE)
    finally:
        os.close(fd)


def open_regions(engine: mpcomm.Engine, specs: list[RegionSpec], readonly: bool) -> list[mmap.mmap]:
    """Register every region; returns the file mappings to flush at shutdown."""
    maps = []
    access = "r" if readonly else "rw"
    for spec in specs:
        if spec.path is not None:
            mm = _map_file(spec.path, readonly)
            maps.append(mm)
            engine.register(mm, name=spec.name, access=access)
        else:
            engine.allocate(spec.size, name=spec.name, access=access)
    return maps


@app.command("serve")
@handle_errors
def serve(
    ctx: typer.Context,
    region: Annotated[
        Optional[list[str]],
        typer.Option("--region", "-r", help="NAME=SIZE (allocated, e.g. kv=64MiB) or NAME=@FILE (mmap of the file). "
                     "Repeatable.", show_default=False),
    ] = None,
    readonly: Annotated[bool, typer.Option("--readonly", help="Peers may only read the regions.")] = False,
    endpoint: Annotated[
        Optional[str],
        typer.Option(help="Control endpoint host:port (port 0 picks a free one); default: transport.endpoint.",
                     envvar="MPCOMM_ENDPOINT", show_default=False),
    ] = None,
    secret: Annotated[
        Optional[str],
        typer.Option(help="Refused: a secret on the command line shows in the process list. "
                     "Use --secret-file or MPCOMM_SECRET.", hidden=True, show_default=False),
    ] = None,
    secret_file: Annotated[
        Optional[Path],
        typer.Option("--secret-file", help="File holding the shared secret peers must prove (make one with "
                     "`mpcomm secret --file`); default: MPCOMM_SECRET, else transport.secret.",
                     dir_okay=False, show_default=False),
    ] = None,
    transport: Annotated[
        Optional[list[str]],
        typer.Option("--transport", "-t", help="Run only these transports (repeatable); default: all available.",
                     show_default=False),
    ] = None,
    mode: Annotated[Optional[Mode], typer.Option(help="transport.mode override.", show_default=False)] = None,
    config: ConfigOption = None,
    json_: JsonOption = False,
) -> None:
    """Expose named regions on an engine until SIGINT/SIGTERM; print the address on stdout."""
    if secret is not None:
        raise CliError("--secret is refused: a secret on the command line shows in the process list; "
                       "use --secret-file FILE (see `mpcomm secret --file`) or the MPCOMM_SECRET environment variable",
                       EXIT_USAGE)
    secret = read_secret_file(secret_file) if secret_file is not None else None
    specs = [parse_region(r) for r in region or []]
    names = [s.name for s in specs]
    dupes = {n for n in names if names.count(n) > 1}
    if dupes:
        raise CliError(f"--region: {sorted(dupes)[0]!r} given twice", EXIT_USAGE)
    cfg = build_config(ctx, config, transport={"mode": mode.value} if mode else {})
    check_sizes(specs, transport)
    stop = threading.Event()
    previous = {}
    for sig in (signal.SIGINT, signal.SIGTERM):
        previous[sig] = signal.signal(sig, lambda *_: stop.set())
    maps: list[mmap.mmap] = []
    try:
        with start_engine(cfg, endpoint=endpoint, secret=secret, transports=transport) as engine:
            maps = open_regions(engine, specs, readonly)
            descriptors = [engine.describe(r).to_dict() for r in engine.regions()]
            if json_:
                print_json({"address": engine.address, "node_id": engine.node_id, "epoch": engine.epoch,
                            "transports": list(engine.transports), "regions": descriptors})
            else:
                typer.echo(engine.address)
            _announce(engine, descriptors)
            while not stop.wait(1.0):
                pass
            err_console.print("[dim]stopping: closing regions and transports[/]")
    finally:
        for mm in maps:
            try:
                mm.flush()
            except (ValueError, OSError):
                pass
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    err_console.print("[dim]stopped[/]")


def _announce(engine: mpcomm.Engine, descriptors: list[dict[str, Any]]) -> None:
    err_console.print(f"serving on [bold]{escape(engine.address)}[/] via {', '.join(engine.transports)} "
                      f"(node {engine.node_id}); SIGINT/SIGTERM to stop", highlight=False)
    for d in descriptors:
        err_console.print(f"  region [bold]{escape(d['name'])}[/]: {format_size(d['size'])} access={d['access']}",
                          highlight=False)
    if not descriptors:
        err_console.print("  [yellow]no regions (add --region NAME=SIZE)[/]")
