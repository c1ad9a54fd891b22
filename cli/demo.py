"""``mpcomm demo``: two engines in this process move data through every available transport.

Runs on the embedded default (loopback control endpoints on free ports,
peer-to-peer region look-up): no external service.
"""

from __future__ import annotations

import hashlib
import statistics
from typing import Annotated, Any

import typer
from rich.markup import escape
from rich.table import Table

import mpcomm
from mpcomm.telemetry import operation_span

from . import demo_device
from ._common import (
    ConfigOption,
    JsonOption,
    build_config,
    client_engine,
    err_console,
    fail,
    format_rate,
    format_seconds,
    format_size,
    handle_errors,
    out_console,
    parse_size,
    print_json,
)

app = typer.Typer()


def _fill(view: memoryview) -> None:
    pattern = hashlib.sha256(b"mpcomm demo").digest() * 4096  # 128 KiB
    for off in range(0, len(view), len(pattern)):
        n = min(len(pattern), len(view) - off)
        view[off : off + n] = pattern[:n]


def run_pair(cfg: mpcomm.Config, transport: str, size: int, reps: int) -> dict[str, Any]:
    """Write and read ``size`` bytes ``reps`` times between two engines that run only ``transport``."""
    # Both engines live in this process: each listens on a free port, whatever transport.endpoint says.
    with client_engine(cfg, transports=[transport]) as target, client_engine(cfg, transports=[transport]) as initiator:
        target.allocate(size, name="demo")
        remote = initiator.open(target.address, "demo")
        src = initiator.allocate(size)
        dst = initiator.allocate(size)
        _fill(src.view)
        out: dict[str, Any] = {"transport": transport, "message_size": size}
        for op, local in (("write", src), ("read", dst)):
            times = []
            for _ in range(reps):
                t = (initiator.write if op == "write" else initiator.read)(local, remote)
                t.result(timeout=cfg.request_timeout + 5)
                times.append(t.elapsed or 1e-9)
            out[f"{op}_throughput"] = size / statistics.median(times)
        if hashlib.sha256(dst.view).digest() != hashlib.sha256(src.view).digest():
            raise mpcomm.MpcommError(f"{transport}: data read back differs from data written")
        small = initiator.allocate(4096)
        lat = []
        for _ in range(200):
            t = initiator.write(small, remote)
            t.result(timeout=cfg.request_timeout + 5)
            lat.append(t.elapsed or 0.0)
        out["latency_4KiB_p50"] = statistics.median(lat)
        out["carried_by"] = t.transport
        return out


@app.command("demo")
@handle_errors
def demo(
    ctx: typer.Context,
    size: Annotated[str, typer.Option(help="Bytes per transfer (e.g. 64MiB).", envvar="MPCOMM_DEMO_SIZE")] = "64MiB",
    reps: Annotated[int, typer.Option(min=1, max=100, help="Transfers per direction.")] = 5,
    config: ConfigOption = None,
    json_: JsonOption = False,
) -> None:
    """Move data between two engines in this process through the best and every available transport; print throughput."""
    cfg = build_config(ctx, config)
    nbytes = parse_size(size)
    if nbytes <= 0:
        fail("--size must be positive", 2)
    with client_engine(cfg) as probe:
        running = list(probe.transports)
        skipped = {s.name: s.availability.reason for s in probe.transport_status() if not s.running}
    best = running[0]
    results = []
    with err_console.status("moving data...") as status:
        for name in running:
            status.update(f"{name}: {format_size(nbytes)} x {reps} each way")
            try:
                with operation_span("mpcomm.demo.pair", {"mpcomm.transport": name, "mpcomm.size": nbytes,
                                                         "mpcomm.reps": reps}):
                    r = run_pair(cfg, name, nbytes, reps)
                r["best"] = name == best
                results.append(r)
            except mpcomm.MpcommError as exc:
                if name == best:
                    raise
                err_console.print(f"[yellow]{name}: failed: {escape(str(exc))}[/]")
                skipped[name] = f"failed: {exc}"
    device = demo_device.run(running, min(nbytes, 64 << 20))  # GPU memory, where a transport moves it
    if json_:
        print_json({"best": best, "results": results, "skipped": skipped, "device_memory": device})
        return
    table = Table(title=f"mpcomm demo: two engines, {format_size(nbytes)} per transfer", title_justify="left")
    for col in ("transport", "write", "read", "4KiB write p50"):
        table.add_column(col, justify="right" if col != "transport" else "left")
    for r in results:
        table.add_row(r["transport"] + (" (best)" if r["best"] else ""), format_rate(r["write_throughput"]),
                      format_rate(r["read_throughput"]), format_seconds(r["latency_4KiB_p50"]))
    # The result, on stdout (the spinner and warnings above were diagnostics, on stderr).
    out_console.print(table)
    for name, reason in skipped.items():
        out_console.print(f"[dim]{name}: not used ({escape(reason)})[/]")
    for d in device:
        out_console.print(demo_device.line(d), highlight=False)
