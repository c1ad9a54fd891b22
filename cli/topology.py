"""``mpcomm topology``: this node's hardware, and the routes the policy would choose.

Read-only: the topology comes from sysfs/procfs (:mod:`mpcomm.topology`), the
transports answer ``availability()`` without starting, and the routes are what
:class:`mpcomm.routing.RoutePolicy` (the config's ``[[route]]`` rules, or the
capability-derived default) returns for a few typical peers.
"""

from __future__ import annotations

from typing import Any

import typer

from mpcomm import topology as topo
from mpcomm.errors import TransportUnavailable
from mpcomm.registry import load_plugins
from mpcomm.routing import RoutePolicy, RouteQuery

from ._common import ConfigOption, JsonOption, build_config, format_size, handle_errors, print_json

app = typer.Typer()

#: A request this large shows whether the policy would split it.
LARGE = 256 << 20


def _available(found: Any) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    installed = {}
    rows = []
    for name, entry in found.transports.items():
        installed[name] = entry.cls.capabilities
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


def routes(config: Any, installed: dict[str, Any], running: list[str]) -> list[dict[str, Any]]:
    """The route per typical case (also used by tests)."""
    here = RoutePolicy.for_config(config, installed, running)
    everything = RoutePolicy.for_config(config, installed, list(installed))
    mine, alls = frozenset(running), frozenset(installed)
    cases = [
        ("same host", here, RouteQuery(True, peer_transports=mine)),
        ("other host", here, RouteQuery(False, peer_transports=mine)),
        (f"other host, {format_size(LARGE)} request", here, RouteQuery(False, size=LARGE, peer_transports=mine)),
        ("other host, both sides running every installed transport (e.g. both with RDMA)", everything,
         RouteQuery(False, peer_transports=alls)),
        (f"other host, both sides running every installed transport, {format_size(LARGE)} request", everything,
         RouteQuery(False, size=LARGE, peer_transports=alls)),
        ("same host, device memory", here, RouteQuery(True, local_kind="device", remote_kind="device",
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


def _text(t: topo.Topology, rows: list[dict[str, Any]], route_rows: list[dict[str, Any]], rules: list[Any]) -> str:
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
    for r in rows:
        state = "available" if r["available"] else f"unavailable: {r['reason']}"
        reach = "+".join(k for k in ("intra_node", "inter_node") if r[k])
        lines.append(f"{r['name']:<16} bandwidth {r['bandwidth_class']:<7} {reach:<21} {state}")
    lines.append("== routes ==" + ("" if rules else " (no [[route]] rules: default from capabilities)"))
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
def topology(ctx: typer.Context, json_: JsonOption = False, config: ConfigOption = None) -> None:
    """Show this node's CPUs/NUMA, NICs, RDMA devices, GPUs, huge pages, /dev/shm, memlock, and the transport
    list the route policy would choose for a peer on the same host, another host, and so on."""
    cfg = build_config(ctx, config)
    t = topo.discover()
    installed, rows = _available(load_plugins())
    running = [r["name"] for r in rows if r["available"]]
    policy = RoutePolicy.for_config(cfg, installed, running)  # validates [[route]] against the plugins
    route_rows = routes(cfg, installed, running)
    if json_:
        print_json({"topology": t.to_dict(), "transports": rows, "rules": policy.describe(), "routes": route_rows})
        return
    typer.echo(_text(t, rows, route_rows, policy.rules))
