"""``mpcomm put`` / ``mpcomm get``: copy a local file into, or out of, a remote region.

The file is mapped (no staging copy) and moved in chunks with a few requests
in flight; a progress bar and the final throughput go to stderr, ``--json``
puts the summary on stdout. ``--verify`` reads the remote range back and
compares sha256 digests (exit 4 on mismatch). Every bad input ends with one
``error:`` line and the documented exit code: a malformed address or an
unreadable file is 2; an unknown peer, a wrong secret or token, an unknown
region, an out-of-bounds range or a timeout is 3.
"""

from __future__ import annotations

import dataclasses
import hashlib
import mmap
import os
import tempfile
import time
from collections import deque
from collections.abc import Callable
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
    err_console,
    format_rate,
    format_size,
    handle_errors,
    parse_size,
    print_json,
    progress_bar,
    stop_clock,
)

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


def move(engine: mpcomm.Engine, op: str, local: mpcomm.Region, remote: mpcomm.RemoteRegion, remote_offset: int,
         length: int, *, chunk: int, inflight: int, timeout: float | None,
         advance: Callable[[int], None] = lambda n: None) -> None:
    """Move ``length`` bytes in ``chunk``-sized requests, ``inflight`` at a time; raise the first error."""
    issue = engine.write if op == "write" else engine.read
    pending: deque[tuple[mpcomm.Transfer, int]] = deque()
    pos = 0
    try:
        while pos < length or pending:
            while pos < length and len(pending) < inflight:
                n = min(chunk, length - pos)
                pending.append((issue(local, remote, remote_offset + pos, n, local_offset=pos, timeout=timeout), n))
                pos += n
            t, n = pending.popleft()
            t.result()
            advance(n)
    except BaseException:
        for t, _ in pending:
            t.cancel(timeout=1.0)
        raise


def _digest_remote(engine: mpcomm.Engine, remote: mpcomm.RemoteRegion, offset: int, length: int, *, chunk: int,
                   inflight: int, timeout: float | None) -> str:
    buf = engine.allocate(length)
    try:
        move(engine, "read", buf, remote, offset, length, chunk=chunk, inflight=inflight, timeout=timeout)
        return hashlib.sha256(buf.view).hexdigest()
    finally:
        engine.unregister(buf, timeout=5.0)


def _summary(what: str, nbytes: int, seconds: float, remote: mpcomm.RemoteRegion, offset: int, file: Path,
             digest: str | None, verified: bool | None, json_: bool) -> None:
    rate = nbytes / seconds if seconds > 0 else 0.0
    data: dict[str, Any] = {
        "op": what, "file": str(file), "address": remote.address, "region": remote.name, "offset": offset,
        "bytes": nbytes, "seconds": round(seconds, 6), "throughput": rate, "sha256": digest, "verified": verified,
    }
    if json_:
        print_json(data)
    arrow = "->" if what == "put" else "<-"
    extra = "" if verified is None else (" verified" if verified else " VERIFY MISMATCH")
    err_console.print(escape(f"{what}: {file} {arrow} {remote.name}@{remote.address}+{offset}: {format_size(nbytes)} in "
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
    try:
        fd = os.open(file, os.O_RDONLY)
    except OSError as exc:
        raise CliError(f"{file}: {exc.strerror}", EXIT_USAGE) from exc
    try:
        size = os.fstat(fd).st_size
        if size == 0:
            raise CliError(f"{file}: the file is empty; nothing to put", EXIT_USAGE)
        mm = mmap.mmap(fd, size, access=mmap.ACCESS_READ)
    finally:
        os.close(fd)
    cfg = build_config(ctx, config)
    with client_engine(cfg, endpoint=endpoint, secret=secret, transports=transport) as engine:
        remote = _remote(engine, address, region, descriptor)
        if not remote.writable:
            raise PermissionDeniedError(f"region {remote.name!r} on {remote.address} is read-only",
                                        region=remote.name, peer=remote.address)
        _check_range(remote, off, size)
        src = engine.register(mm, name=f"put:{file.name}")
        with progress_bar() as progress, operation_span("mpcomm.put", _span_attrs(remote, off, size)):
            task = progress.add_task(f"put {file.name}", total=size, t0=time.perf_counter())
            move(engine, "write", src, remote, off, size, chunk=chunk_n, inflight=inflight, timeout=timeout,
                 advance=lambda n: progress.advance(task, n))
            elapsed = stop_clock(progress, task)
        digest = hashlib.sha256(mm).hexdigest()
        verified = None
        if verify:
            verified = _digest_remote(engine, remote, off, size, chunk=chunk_n, inflight=inflight,
                                      timeout=timeout) == digest
        engine.unregister(src, timeout=5.0)
        _summary("put", size, elapsed, remote, off, file, digest, verified, json_)
    if verified is False:
        raise CliError(f"--verify: the remote range's sha256 differs from {file}'s ({digest})", EXIT_VERIFY)


@app.command("get")
@handle_errors
def get(
    ctx: typer.Context,
    address: Annotated[Optional[str], typer.Argument(help="Peer address host:port.", show_default=False)],
    region: Annotated[Optional[str], typer.Argument(help="Remote region name.", show_default=False)],
    file: Annotated[Path, typer.Argument(help="Local file to write: replaced only once every byte arrived "
                                         "(and --verify passed).", dir_okay=False, show_default=False)],
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

    The bytes land in a temporary file next to FILE, renamed over FILE only on
    success: a failed get leaves an existing FILE as it was. With --descriptor,
    pass "-" for ADDRESS and REGION to take both from it.
    """
    address = None if address == "-" else address
    region = None if region == "-" else region
    off, chunk_n = parse_size(offset), parse_size(chunk)
    if chunk_n <= 0:
        raise CliError("--chunk must be positive", EXIT_USAGE)
    if file.is_dir():
        raise CliError(f"{file}: is a directory", EXIT_USAGE)
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
        tmp = _temp_next_to(file)
        try:
            digest, elapsed, verified = _get_into(engine, remote, tmp, off, n, chunk=chunk_n, inflight=inflight,
                                                  timeout=timeout, verify=verify, label=file.name)
            if verified is False:
                raise CliError(f"--verify: the remote range changed or arrived damaged (sha256 of what arrived: "
                               f"{digest}); {file} was not replaced", EXIT_VERIFY)
            os.replace(tmp, file)
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise
        _summary("get", n, elapsed, remote, off, file, digest, verified, json_)


def _temp_next_to(file: Path) -> Path:
    """A new file in FILE's directory (so the rename is atomic) with FILE's mode, or 0666 & ~umask."""
    parent = file.parent if str(file.parent) else Path(".")
    try:
        fd, name = tempfile.mkstemp(prefix=f".{file.name}.", suffix=".mpcomm-get", dir=parent)
    except OSError as exc:
        raise CliError(f"{file}: cannot create a file in {parent}: {exc.strerror}", EXIT_USAGE) from exc
    try:
        try:
            mode = os.stat(file).st_mode & 0o7777
        except OSError:
            umask = os.umask(0)
            os.umask(umask)
            mode = 0o666 & ~umask
        os.fchmod(fd, mode)
    finally:
        os.close(fd)
    return Path(name)


def _get_into(engine: mpcomm.Engine, remote: mpcomm.RemoteRegion, path: Path, off: int, n: int, *, chunk: int,
              inflight: int, timeout: float | None, verify: bool, label: str) -> tuple[str, float, bool | None]:
    """Read ``n`` bytes into ``path`` (mmapped); returns (sha256, seconds, verified)."""
    fd = os.open(path, os.O_RDWR)
    try:
        os.ftruncate(fd, n)
        mm = mmap.mmap(fd, n, access=mmap.ACCESS_WRITE)
    finally:
        os.close(fd)
    try:
        dst = engine.register(mm, name=f"get:{label}")
        try:
            with progress_bar() as progress, operation_span("mpcomm.get", _span_attrs(remote, off, n)):
                task = progress.add_task(f"get {label}", total=n, t0=time.perf_counter())
                move(engine, "read", dst, remote, off, n, chunk=chunk, inflight=inflight, timeout=timeout,
                     advance=lambda k: progress.advance(task, k))
                elapsed = stop_clock(progress, task)
        finally:
            engine.unregister(dst, timeout=5.0)
        mm.flush()
        digest = hashlib.sha256(mm).hexdigest()
    finally:
        try:
            mm.close()
        except BufferError:  # a transport still holds a view (a failed request): the GC unmaps it
            pass
    verified = None
    if verify:
        verified = _digest_remote(engine, remote, off, n, chunk=chunk, inflight=inflight, timeout=timeout) == digest
    return digest, elapsed, verified
