"""``mpcomm regions``: what the cluster metadata service has published.

Read-only: it lists node and region records (no lease is taken, nothing is
written). The records hold no access token; opening a region still goes
through its owner's handshake. Records that fail the reader's checks (no
lease, too big or too deep, malformed, unsigned with a cluster secret set:
see mpcomm.metadata) are skipped with a warning on stderr naming their key,
and the good ones are listed.
"""

from __future__ import annotations

import os
import time
from typing import Annotated, Optional

import typer
from rich.markup import escape
from rich.table import Table

from mpcomm.metadata import PeerToPeerMetadata, open_metadata

from ._common import EXIT_USAGE, CliError, ConfigOption, JsonOption, build_config, format_size, handle_errors, print_json

app = typer.Typer()


@app.command("regions")
@handle_errors
def regions(
    ctx: typer.Context,
    metadata: Annotated[Optional[str], typer.Option("--metadata", "-m", help="etcd://host:port[/prefix] "
                                                    "(default: cluster.metadata from the config).",
                                                    envvar="MPCOMM_METADATA", show_default=False)] = None,
    name: Annotated[Optional[str], typer.Option("--name", help="Only records of this region name.")] = None,
    json_: JsonOption = False,
    config: ConfigOption = None,
) -> None:
    """List the nodes and regions published to the cluster metadata service (etcd)."""
    cfg = build_config(ctx, config)
    url = metadata if metadata is not None else cfg.cluster.metadata
    # With a cluster secret, only records signed with it are listed (as engines read them).
    secret = cfg.transport.secret or os.environ.get("MPCOMM_SECRET", "")
    store = open_metadata(url, secret=secret)
    if isinstance(store, PeerToPeerMetadata):
        raise CliError("no metadata service: pass --metadata etcd://host:2379 or set cluster.metadata; "
                       "with the peer-to-peer default regions are found by asking their owner", EXIT_USAGE)
    try:
        regs = store.lookup(name) if name is not None else store.list_regions()
        nodes = store.list_nodes()
    finally:
        store.close()
    if json_:
        print_json({"metadata": store.url, "nodes": [n.__dict__ | {"transports": list(n.transports)} for n in nodes],
                    "regions": [r.to_dict() for r in regs]})
        return
    from rich.console import Console

    out = Console(width=max(Console().width, 140))
    nt = Table(title=f"nodes in {store.url}", title_justify="left")
    for col in ("node", "address", "epoch", "host", "transports", "published"):
        nt.add_column(col, overflow="fold")
    for n in nodes:
        nt.add_row(*(escape(v) for v in (n.node_id, n.address, n.epoch, n.hostname, ",".join(n.transports),
                                         _ago(n.published_at))))
    out.print(nt)
    rt = Table(title="regions", title_justify="left")
    for col in ("name", "size", "access", "kind", "numa", "owner", "node", "epoch", "published"):
        rt.add_column(col, overflow="fold")
    for r in regs:
        numa = str(r.numa_node) if r.numa_node >= 0 else "?"
        rt.add_row(*(escape(v) for v in (r.name, format_size(r.size), r.access, r.kind, numa, r.address, r.node_id,
                                         r.epoch, _ago(r.published_at))))
    out.print(rt)
    if not regs:
        out.print("no regions published" + (f" under the name {name!r}" if name else ""))


def _ago(ts: float) -> str:
    if ts <= 0:
        return "?"
    return f"{max(0.0, time.time() - ts):.0f}s ago"
