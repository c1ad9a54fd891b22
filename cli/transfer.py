"""``mpcomm put`` / ``mpcomm get``: copy a local file into, or out of, a remote region.

The bytes move in chunks with a few requests in flight, through a small
registered ring that the local file is read into or written from (see
:mod:`mpcomm.cli.localfile`: a file that changes while ``put`` reads it is
exit 2; ``get`` replaces a regular file atomically and writes a FIFO or a
device in place). A progress bar goes to stderr; the summary line, or with
``--json`` the summary as JSON, is the result, on stdout. ``--verify`` reads the remote range back and
compares sha256 digests (exit 4 on mismatch). Every bad input ends with one
``error:`` line and the documented exit code: a malformed address or an
unreadable file is 2; an unknown peer, a wrong secret or token, an unknown
region, an out-of-bounds range or a timeout is 3.
"""

from __future__ import annotations

import dataclasses
import hashlib
import time
from pathlib import Path
from typing import Annotated, Any, Optional

import typer
from rich.markup import escape

import mpcomm
from mpcomm.errors import OutOfBoundsError, PermissionDeniedError
from mpcomm.peer import parse_endpoint
from mpcomm.telemetry import operation_span

from ._common import (
    EXIT_USAGE,
    EXIT_VERIFY,
    CliError,
    ConfigOption,
    EndpointOption,
    JsonOption,
    build_config,
    client_engine,
    format_rate,
    format_size,
    handle_errors,
    out_console,
    parse_size,
    print_json,
    progress_bar,
    stop_clock,
)
from .localfile import REPLACE, Sink, SourceFile, move_direct, ring_move, target_kind

app = typer.Typer()

SecretOption = Annotated[
    Optional[str],
    typer.Option(help="Shared secret of the peer (HMAC handshake).", envvar="MPCOMM_SECRET", show_default=False),
]
DescriptorOption = Annotated[
    Optional[Path],
    typer.Option("--descriptor", help="RemoteRegion descriptor (JSON, e.g. from `serve --json`) instead of a "
                 "look-up by name; ADDRESS, if given, overrides its address.", dir_okay=False, show_default=False),
]
ChunkOption = Annotated[str, typer.Option(help="Bytes per request.", envvar="MPCOMM_CHUNK")]
InflightOption = Annotated[int, typer.Option(min=1, max=1024, help="Requests in flight.")]
TimeoutOption = Annotated[
    Optional[float],
    typer.Option(min=0.001, help="Seconds per request (default runtime.request_timeout_ms).", show_default=False),
]
TransportOption = Annotated[
    Optional[list[str]],
    typer.Option("--transport", "-t", help="Use only these transports (repeatable).", show_default=False),
]
VerifyOption = Annotated[bool, typer.Option("--verify", help="Read the range back and compare sha256 (exit 4 on mismatch).")]
OffsetOption = Annotated[str, typer.Option(help="Byte offset in the remote region.")]


def _remote(engine: mpcomm.Engine, address: str | None, region: str | None, descriptor: Path | None) -> mpcomm.RemoteRegion:
    if address is not None:
        try:
            parse_endpoint(address)
        except ValueError as exc:
            raise CliError(f"bad address {address!r}: {exc}", EXIT_USAGE) from exc
    if descriptor is not None:
        try:
            remote = mpcomm.RemoteRegion.from_bytes(descriptor.read_bytes())
        except OSError as exc:
            raise CliError(f"--descriptor {descriptor}: {exc.strerror}", EXIT_USAGE) from exc
        except mpcomm.MpcommError as exc:
            raise CliError(f"--descriptor {descriptor}: {exc}", EXIT_USAGE) from exc
        if region is not None and region != remote.name:
            raise CliError(f"REGION {region!r} does not match the descriptor's region {remote.name!r}", EXIT_USAGE)
        return dataclasses.replace(remote, address=address) if address else remote
    if address is None or region is None:
        raise CliError("give ADDRESS and REGION, or --descriptor FILE", EXIT_USAGE)
    return engine.open(address, region)


def _check_range(remote: mpcomm.RemoteRegion, offset: int, length: int) -> None:
    if offset > remote.size:
        raise OutOfBoundsError(
            f"offset {offset} is past the end of region {remote.name!r} ({remote.size} bytes, "
            f"{format_size(remote.size)}) on {remote.address}; nothing was moved",
            region=remote.name, peer=remote.address,
        )
    if offset < 0 or length < 0 or offset + length > remote.size:
        raise OutOfBoundsError(
            f"[{offset}, {offset + length}) is outside region {remote.name!r} of {remote.size} bytes "
            f"({format_size(remote.size)}) on {remote.address}; nothing was moved",
            region=remote.name, peer=remote.address,
        )


def _span_attrs(remote: mpcomm.RemoteRegion, offset: int, length: int) -> dict[str, Any]:
    return {"mpcomm.peer": remote.address, "mpcomm.region": remote.name, "mpcomm.offset": offset,
            "mpcomm.size": length}


def _digest_remote(engine: mpcomm.Engine, remote: mpcomm.RemoteRegion, offset: int, length: int, *, chunk: int,
                   inflight: int, timeout: float | None) -> str:
    """sha256 of the remote range, read back through a small ring (not a buffer of ``length`` bytes)."""
    digest = hashlib.sha256()
    ring_move(engine, "read", remote, offset, length, chunk=chunk, inflight=inflight, timeout=timeout,
              drain=lambda view, _pos: digest.update(view))
    return digest.hexdigest()


def _summary(what: str, nbytes: int, seconds: float, remote: mpcomm.RemoteRegion, offset: int, file: Path,
             digest: str | None, verified: bool | None, json_: bool) -> None:
    rate = nbytes / seconds if seconds > 0 else 0.0
    data: dict[str, Any] = {
        "op": what, "file": str(file), "address": remote.address, "region": remote.name, "offset": offset,
        "bytes": nbytes, "seconds": round(seconds, 6), "throughput": rate, "sha256": digest, "verified": verified,
    }
    if json_:
        print_json(data)
        return
    arrow = "->" if what == "put" else "<-"
    extra = "" if verified is None else (" verified" if verified else " VERIFY MISMATCH")
    # The result: on stdout (the progress bar before it is a diagnostic, on stderr).
    out_console.print(escape(f"{what}: {file} {arrow} {remote.name}@{remote.address}+{offset}: {format_size(nbytes)} in "
                      f"{seconds:.3f}s ({format_rate(rate)}){extra}"), highlight=False, soft_wrap=True)


@app.command("put")
@handle_errors
def put(
    ctx: typer.Context,
    file: Annotated[Path, typer.Argument(help="Local file to send.", dir_okay=False, show_default=False)],
    address: Annotated[Optional[str], typer.Argument(help="Peer address host:port (printed by `mpcomm serve`).",
                                                     show_default=False)] = None,
    region: Annotated[Optional[str], typer.Argument(help="Remote region name.", show_default=False)] = None,
    offset: OffsetOption = "0",
    verify: VerifyOption = False,
    descriptor: DescriptorOption = None,
    secret: SecretOption = None,
    chunk: ChunkOption = "4MiB",
    inflight: InflightOption = 4,
    timeout: TimeoutOption = None,
    transport: TransportOption = None,
    endpoint: EndpointOption = None,
    config: ConfigOption = None,
    json_: JsonOption = False,
) -> None:
    """Copy FILE into REGION on the peer at ADDRESS (at --offset)."""
    off, chunk_n = parse_size(offset), parse_size(chunk)
    if chunk_n <= 0:
        raise CliError("--chunk must be positive", EXIT_USAGE)
    source = SourceFile.open(file, digest=verify or json_)  # the sha256 is shown only there
    try:
        size = source.size
        cfg = build_config(ctx, config)
        with client_engine(cfg, endpoint=endpoint, secret=secret, transports=transport) as engine:
            remote = _remote(engine, address, region, descriptor)
            if not remote.writable:
                raise PermissionDeniedError(f"region {remote.name!r} on {remote.address} is read-only",
                                            region=remote.name, peer=remote.address)
            _check_range(remote, off, size)
            with progress_bar() as progress, operation_span("mpcomm.put", _span_attrs(remote, off, size)):
                task = progress.add_task(f"put {file.name}", total=size, t0=time.perf_counter())
                ring_move(engine, "write", remote, off, size, chunk=chunk_n, inflight=inflight, timeout=timeout,
                          fill=source.fill, advance=lambda n: progress.advance(task, n))
                elapsed = stop_clock(progress, task)
            source.check_unchanged()  # a file that grew back to its size still has a new mtime
            digest = source.digest.hexdigest() if source.digest is not None else None
            verified = None
            if verify:
                verified = _digest_remote(engine, remote, off, size, chunk=chunk_n, inflight=inflight,
                                          timeout=timeout) == digest
            _summary("put", size, elapsed, remote, off, file, digest, verified, json_)
    finally:
        source.close()
    if verified is False:
        raise CliError(f"--verify: the remote range's sha256 differs from {file}'s ({digest})", EXIT_VERIFY)


@app.command("get")
@handle_errors
def get(
    ctx: typer.Context,
    address: Annotated[Optional[str], typer.Argument(help="Peer address host:port.", show_default=False)],
    region: Annotated[Optional[str], typer.Argument(help="Remote region name.", show_default=False)],
    file: Annotated[Path, typer.Argument(help="Local file to write: a regular file is replaced only once every "
                                         "byte arrived (and --verify passed); a FIFO or device is written in place.", dir_okay=False, show_default=False)],
    offset: OffsetOption = "0",
    length: Annotated[Optional[str], typer.Option(help="Bytes to copy (default: to the end of the region).",
                                                  show_default=False)] = None,
    verify: VerifyOption = False,
    descriptor: DescriptorOption = None,
    secret: SecretOption = None,
    chunk: ChunkOption = "4MiB",
    inflight: InflightOption = 4,
    timeout: TimeoutOption = None,
    transport: TransportOption = None,
    endpoint: EndpointOption = None,
    config: ConfigOption = None,
    json_: JsonOption = False,
) -> None:
    """Copy REGION on the peer at ADDRESS (from --offset, --length bytes) into FILE.

    A regular FILE (or a new one) is written as a temporary file next to it,
    renamed over FILE only on success: a failed get leaves an existing FILE as
    it was. A FIFO or a device (/dev/null) is written in place, never
    replaced; a directory is refused. With --descriptor, pass "-" for ADDRESS
    and REGION to take both from it.
    """
    address = None if address == "-" else address
    region = None if region == "-" else region
    off, chunk_n = parse_size(offset), parse_size(chunk)
    if chunk_n <= 0:
        raise CliError("--chunk must be positive", EXIT_USAGE)
    kind = target_kind(file)
    cfg = build_config(ctx, config)
    with client_engine(cfg, endpoint=endpoint, secret=secret, transports=transport) as engine:
        remote = _remote(engine, address, region, descriptor)
        if not remote.readable:
            raise PermissionDeniedError(f"region {remote.name!r} on {remote.address} may not be read",
                                        region=remote.name, peer=remote.address)
        n = parse_size(length) if length is not None else max(remote.size - off, 0)
        _check_range(remote, off, n)
        if n == 0:
            raise CliError(f"nothing to get: [{off}, {off}) of region {remote.name!r} is empty", EXIT_USAGE)
        sink = Sink(file, kind, n, digest=verify or json_)  # the sha256 is shown only there
        try:
            with progress_bar() as progress, operation_span("mpcomm.get", _span_attrs(remote, off, n)):
                task = progress.add_task(f"get {file.name}", total=n, t0=time.perf_counter())
                advance = lambda k: progress.advance(task, k)  # noqa: E731
                if sink.map is not None:  # our temporary file, mapped: the bytes land in it directly
                    dst = engine.register(sink.map, name=f"get:{file.name}")
                    try:
                        move_direct(engine, "read", dst, remote, off, n, chunk=chunk_n, inflight=inflight,
                                    timeout=timeout, advance=advance)
                    finally:
                        engine.unregister(dst, timeout=5.0)
                else:
                    ring_move(engine, "read", remote, off, n, chunk=chunk_n, inflight=inflight, timeout=timeout,
                              drain=sink.drain, advance=advance)
                elapsed = stop_clock(progress, task)
            digest = sink.hexdigest()
            verified = None
            if verify:
                verified = _digest_remote(engine, remote, off, n, chunk=chunk_n, inflight=inflight,
                                          timeout=timeout) == digest
            if verified is False:
                what = f"{file} was not replaced" if kind == REPLACE else f"{file} already got the bytes (in place)"
                raise CliError(f"--verify: the remote range changed or arrived damaged (sha256 of what arrived: "
                               f"{digest}); {what}", EXIT_VERIFY)
            sink.commit()
        finally:
            sink.close()
        _summary("get", n, elapsed, remote, off, file, digest, verified, json_)
