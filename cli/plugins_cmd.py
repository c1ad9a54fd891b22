"""``mpcomm plugins``: every transport the plugins provide, and the plugins that broke.

Nothing is started: the plugins are loaded and each transport class answers
``availability()``, ``version()`` and its ``capabilities``.
"""

from __future__ import annotations

from typing import Any

import typer
from rich.markup import escape
from rich.table import Table

from mpcomm.registry import load_plugins

from ._common import JsonOption, handle_errors, out_console, print_json

app = typer.Typer()


def collect() -> dict[str, Any]:
    """Transports and failures as plain data (also used by ``doctor`` and ``--manifest``)."""
    found = load_plugins()
    transports = []
    for name, entry in sorted(found.transports.items()):
        try:
            avail = entry.cls.availability()
            available, reason = bool(avail), avail.reason
        except Exception as exc:  # noqa: BLE001 - a broken check is reported, not raised
            available, reason = False, f"availability check failed: {type(exc).__name__}: {exc}"
        try:
            native = entry.cls.version() or ""
        except Exception as exc:  # noqa: BLE001
            native = f"unknown ({type(exc).__name__}: {exc})"
        transports.append({
            "name": name,
            "plugin": entry.plugin,
            "distribution": entry.distribution,
            "version": entry.version,
            "native_version": native,
            "available": available,
            "reason": reason,
            "capabilities": entry.cls.capabilities.to_dict(),
        })
    failures = [{"name": f.name, "distribution": f.distribution, "reason": f.reason} for f in found.failures]
    return {"transports": transports, "failures": failures}


def _caps(c: dict[str, Any]) -> str:
    flags = [k for k in ("one_sided", "zero_copy", "inflight_cancel", "intra_node", "inter_node") if c.get(k)]
    return f"memory={','.join(c['memory_kinds'])} modes={','.join(c['modes'])} " + " ".join(flags)


@app.command("plugins")
@handle_errors
def plugins(json_: JsonOption = False) -> None:
    """List every transport found (distribution, version, availability and why, capabilities) and broken plugins."""
    data = collect()
    if json_:
        print_json(data)
        return
    table = Table(title="mpcomm transports", title_justify="left")
    for col in ("transport", "distribution", "version", "native", "available", "reason", "capabilities"):
        table.add_column(col, overflow="fold")
    for t in data["transports"]:
        table.add_row(
            *(escape(str(v)) for v in (t["name"], t["distribution"], t["version"], t["native_version"] or "-")),
            "[green]yes[/]" if t["available"] else "[red]no[/]", escape(t["reason"]), escape(_caps(t["capabilities"])),
        )
    # The result: stdout, at the terminal's width (rich folds the cells).
    out_console.print(table)
    if not data["transports"]:
        out_console.print("no transport plugins found (MPCOMM_PLUGINS / MPCOMM_DISABLE_PLUGIN_AUTOLOAD?)")
    if data["failures"]:
        broken = Table(title="broken plugins (skipped)", title_justify="left")
        for col in ("plugin", "distribution", "reason"):
            broken.add_column(col, overflow="fold")
        for f in data["failures"]:
            broken.add_row(*(escape(str(f[k])) for k in ("name", "distribution", "reason")))
        out_console.print(broken)
