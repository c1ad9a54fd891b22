"""``mpcomm topology``: this node's hardware, and the routes the policy would choose.

Read-only: the topology comes from sysfs/procfs (:mod:`mpcomm.topology`), the
transports answer ``availability()`` without starting, and the routes are what
:class:`mpcomm.routing.RoutePolicy` (the config's ``[[route]]`` rules, or the
capability-derived default) returns for a few typical peers. Per transport it
shows the declared bandwidth class and, where this node has a calibration
(:mod:`mpcomm.calibration`), the measured one the default route ranks by.

``--calibrate`` first measures every available transport between this
process and a spawned target (:mod:`mpcomm.cli.calibrate`) and writes this
node's calibration file; the topology shown after it uses the new figures.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Optional

import typer

from mpcomm import calibration
from mpcomm import topology as topo
from mpcomm.errors import TransportUnavailable
from mpcomm.registry import load_plugins
from mpcomm.routing import RoutePolicy, RouteQuery
from mpcomm.transport import effective_capabilities

from . import gpus
from ._common import (
    EXIT_USAGE,
    CliError,
    ConfigOption,
    JsonOption,
    build_config,
    format_size,
    handle_errors,
    print_json,
)

app = typer.Typer()

#: A request this large shows whether the policy would split it.
LARGE = 256 << 20


def _available(found: Any) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    installed = {}
    rows = []
    for name, entry in found.transports.items():
        installed[name] = effective_capabilities(entry.cls)[0]  # less the memory kinds unusable here
        try:
            avail = entry.cls.availability()
            ok, reason = bool(avail), avail.reason
        except Exception as exc:  # noqa: BLE001 - reported, not raised
            ok, reason = False, f"availability check failed: {exc}"
        rows.append({"name": name, "available": ok, "reason": reason,
                     "bandwidth_class": entry.cls.capabilities.bandwidth_class,
                     "intra_node": entry.cls.capabilities.intra_node,
                     "inter_node": entry.cls.capabilities.inter_node})
    return installed, rows


def _measured(rows: list[dict[str, Any]], res: calibration.Resolution) -> None:
    """Add each transport's measurement in use (or None) to its row."""
    for r in rows:
        m = res.used.get((r["name"], True)) or res.used.get((r["name"], False))
        r["measured"] = None if m is None else {
            "class": m.bandwidth_class, "gbps": m.gbps, "p50_us": m.p50_us, "same_host": m.same_host,
            "rounds_gbps": list(m.rounds_gbps), "measured_at": m.measured_at}


def routes(config: Any, installed: dict[str, Any], running: list[str],
           measured: dict[bool, dict[str, str]] | None = None) -> list[dict[str, Any]]:
    """The route per typical case (also used by tests)."""
    here = RoutePolicy.for_config(config, installed, running, measured=measured)
    everything = RoutePolicy.for_config(config, installed, list(installed), measured=measured)
    mine, alls = frozenset(running), frozenset(installed)
    cases = [
        ("same host", here, RouteQuery(True, peer_transports=mine)),
        ("other host", here, RouteQuery(False, peer_transports=mine)),
        (f"other host, {format_size(LARGE)} request", here, RouteQuery(False, size=LARGE, peer_transports=mine)),
        ("other host, both sides running every installed transport (e.g. both with RDMA)", everything,
         RouteQuery(False, peer_transports=alls)),
        (f"other host, both sides running every installed transport, {format_size(LARGE)} request", everything,
         RouteQuery(False, size=LARGE, peer_transports=alls)),
        ("same host, device memory", here, RouteQuery(True, local_kind="cuda", remote_kind="cuda",
                                                       peer_transports=mine)),
    ]
    out = []
    for label, policy, q in cases:
        row: dict[str, Any] = {"case": label, "same_host": q.same_host, "size": q.size,
                               "local_kind": q.local_kind, "remote_kind": q.remote_kind}
        try:
            r = policy.choose(q)
            row.update(transports=list(r.transports), rule=r.rule)
            plan = policy.split(q, r)
            if plan is not None:
                row["split"] = [{"offset": s.offset, "length": s.length, "transport": s.transport} for s in plan.stripes]
        except TransportUnavailable as exc:
            row.update(transports=[], rule=None, reason=str(exc))
        out.append(row)
    return out


def _mem(n: int) -> str:
    return "?" if n < 0 else format_size(n)


def _calibration_line(res: calibration.Resolution) -> str:
    if res.classes is not None:
        when = time.strftime("%Y-%m-%d %H:%M", time.localtime(res.calibration.measured_at)) \
            if res.calibration and res.calibration.measured_at else "?"
        return f"calibration: {res.path} (measured {when}, same-host routes)"
    return f"calibration: none in use ({'; '.join(res.notes) or res.path})"


def _text(t: topo.Topology, rows: list[dict[str, Any]], route_rows: list[dict[str, Any]], rules: list[Any],
          res: calibration.Resolution) -> str:
    lines = ["== node ==", f"{t.hostname} ({t.arch}): {t.cpus} CPUs, {t.cpus_usable} usable by this process"]
    lines.append("== numa ==")
    if not t.numa_nodes:
        lines.append("not exposed")
    for n in t.numa_nodes:
        cpus = topo_cpulist(n.cpus)
        lines.append(f"node{n.id}: cpus {cpus or '-'}, memory {_mem(n.mem_total)} ({_mem(n.mem_free)} free)")
    lines.append("== network ==")
    for i in t.interfaces:
        speed = f"{i.speed_mbps} Mb/s" if i.speed_mbps > 0 else "speed ?"
        numa = f"numa {i.numa_node}" if i.numa_node >= 0 else "numa ?"
        kind = "loopback" if i.loopback else ("virtual" if i.virtual else "physical")
        lines.append(f"{i.name:<16} {i.state:<8} mtu {i.mtu:<6} {speed:<12} {numa:<8} {kind}")
    if t.truncated:
        lines.append(f"(+{t.truncated.get('interfaces', 0)} more interfaces not listed)")
    lines.append("== rdma ==")
    if not t.rdma_devices:
        lines.append("no RDMA devices")
    for d in t.rdma_devices:
        ports = "; ".join(f"port {p.port}: {p.link_layer} {p.state} {p.rate}".strip() for p in d.ports) or "no ports"
        lines.append(f"{d.name}: numa {d.numa_node if d.numa_node >= 0 else '?'}; {ports}")
    lines.append("== gpus ==")
    if not t.gpus:
        lines.append("no GPUs")
    for g in t.gpus:
        lines.append(f"{g.pci}: {g.vendor}, numa {g.numa_node if g.numa_node >= 0 else '?'}")
    lines.append("== memory ==")
    huge = ", ".join(f"{format_size(h.size)} pages: {h.total} total, {h.free} free" for h in t.hugepages) or "none"
    lines.append(f"huge pages: {huge}")
    lines.append(f"/dev/shm: {_mem(t.shm_size)} ({_mem(t.shm_free)} free)")
    soft = "unlimited" if t.memlock_soft < 0 else format_size(t.memlock_soft)
    hard = "unlimited" if t.memlock_hard < 0 else format_size(t.memlock_hard)
    lines.append(f"memlock: soft {soft}, hard {hard}")
    lines.append("== transports ==")
    lines.append(_calibration_line(res))
    for r in rows:
        state = "available" if r["available"] else f"unavailable: {r['reason']}"
        reach = "+".join(k for k in ("intra_node", "inter_node") if r[k])
        m = r.get("measured")
        if m:
            where = "same host" if m["same_host"] else "other hosts"
            measured = f"measured {m['class']} ({m['gbps']:.2f} GB/s, p50 {m['p50_us']:.1f} us, {where})"
        else:
            measured = "measured -"
        lines.append(f"{r['name']:<16} declared {r['bandwidth_class']:<7} {measured:<52} {reach:<21} {state}")
    lines.append("== routes ==" + ("" if rules else " (no [[route]] rules: default from capabilities"
                                   + (" and measured classes)" if res.classes else ")")))
    for r in route_rows:
        if r["transports"]:
            chosen = ", ".join(r["transports"]) + f"   (rule: {r['rule']})"
            if "split" in r:
                chosen += f", split into {len(r['split'])} stripes"
        else:
            chosen = f"none: {r.get('reason', '')}"
        lines.append(f"{r['case']}:\n    {chosen}")
    return "\n".join(lines)


def topo_cpulist(cpus: tuple[int, ...]) -> str:
    """(0, 1, 2, 3, 8) → ``0-3,8``."""
    runs: list[list[int]] = []
    for c in sorted(cpus):
        if runs and runs[-1][1] == c - 1:
            runs[-1][1] = c
        else:
            runs.append([c, c])
    return ",".join(f"{a}-{b}" if a != b else str(a) for a, b in runs)


@app.command("topology")
@handle_errors
def topology(
    ctx: typer.Context,
    json_: JsonOption = False,
    config: ConfigOption = None,
    calibrate: Annotated[bool, typer.Option(
        "--calibrate", help="First measure every available transport on this node (4 MiB writes for the "
        "bandwidth class, 4 KiB writes for p50 latency, between this process and a spawned `mpcomm serve`) "
        "and write the classes to the calibration file (transport.calibration_file, else "
        "$MPCOMM_CALIBRATION_FILE, else $XDG_CACHE_HOME/mpcomm/bandwidth.json); engines on this node then "
        "rank their default same-host route by them (transport.bandwidth = \"measured\"). Classes: memory "
        ">= 8 GB/s, high >= 3, medium >= 0.8, else low.")] = False,
    transport: Annotated[Optional[list[str]], typer.Option(
        "--transport", "-t", help="--calibrate: measure only this transport (repeatable; the file keeps the "
        "others' figures).", show_default=False)] = None,
    seconds: Annotated[float, typer.Option(
        "--seconds", min=0.05, max=10.0, help="--calibrate: time budget per transport in seconds "
        "(plus the target's start).")] = 1.5,
    rounds: Annotated[int, typer.Option(
        "--rounds", min=1, max=15, help="--calibrate: throughput rounds per transport; the median "
        "round gives the class.")] = 3,
) -> None:
    """Show this node's CPUs/NUMA, NICs, RDMA devices, GPUs, huge pages, /dev/shm, memlock, each transport's
    declared and measured bandwidth class, and the transport list the route policy would choose for a peer
    on the same host, another host, and so on."""
    cfg = build_config(ctx, config)
    if transport and not calibrate:
        raise CliError("--transport selects what --calibrate measures: add --calibrate", EXIT_USAGE)
    found = load_plugins()
    installed, rows = _available(found)
    running = [r["name"] for r in rows if r["available"]]
    RoutePolicy.for_config(cfg, installed, running)  # a bad [[route]] is an error before anything is measured
    measured_now: list[calibration.Measurement] = []
    skipped: dict[str, str] = {}
    if calibrate:
        from . import calibrate as calib

        _path, measured_now, skipped = calib.run(ctx, config, transport, seconds=seconds, rounds=rounds)
    res = calibration.resolve(cfg, found.transports, running)
    _measured(rows, res)
    policy = RoutePolicy.for_config(cfg, installed, running, measured=res.classes)
    route_rows = routes(cfg, installed, running, res.classes)
    t = topo.discover()
    if json_:
        out: dict[str, Any] = {"topology": t.to_dict(), "transports": rows, "rules": policy.describe(),
                               "routes": route_rows,
                               "calibration": {"path": str(res.path), "in_use": res.classes is not None,
                                               "notes": res.notes}}
        out["gpus"] = gpus.gpu_rows(t.gpus, gpus.nvidia_smi()[0] if t.gpus else None)
        out["device_memory"] = gpus.device_memory()
        if calibrate:
            out["calibration"]["measured"] = [m.to_dict() for m in measured_now]
            out["calibration"]["skipped"] = skipped
        print_json(out)
        return
    if calibrate:
        for name, why in skipped.items():
            typer.echo(f"calibration: {name} not measured: {why}")
    typer.echo(_text(t, rows, route_rows, policy.rules, res))
    typer.echo(gpus.section(t.gpus))  # nvidia-smi's view of each GPU; CUDA memory per transport
