"""``mpcomm doctor``: the seed's node check, plus what matters to mpcomm.

Read-only: it changes nothing on the system (see :mod:`mpcomm.cli.nodecheck`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer
from rich.markup import escape
from rich.table import Table

from mpcomm import native_helper
from mpcomm.tent.build import stale_artefacts
from mpcomm.tent.doctor import native_provider_check

from mpcomm.topology import discover_gpus

from . import gpus, nodecheck, plugins_cmd
from .nodecheck import Check, Status
from ._common import EXIT_FAILURE, JsonOption, handle_errors, out_console, parse_size, print_json

app = typer.Typer()

_STYLE = {"pass": "green", "info": "cyan", "warn": "yellow", "fail": "bold red"}


def plugin_checks(found: dict[str, Any]) -> list[Check]:
    """One check per transport (available or why not), one per broken plugin."""
    checks = []
    for t in found["transports"]:
        if t["available"]:
            checks.append(Check("plugins", t["name"], Status.PASS, f"available ({t['reason'] or 'ok'})"))
        else:
            hint = "see `mpcomm plugins`; install the plugin's extra or the native library it names"
            checks.append(Check("plugins", t["name"], Status.WARN, f"unavailable: {t['reason']}", hint))
    for f in found["failures"]:
        checks.append(Check("plugins", f"broken:{f['name']}", Status.WARN, f"{f['distribution']}: {f['reason']}",
                            "fix or uninstall the plugin distribution; it is skipped"))
    if not any(t["available"] for t in found["transports"]):
        checks.append(Check("plugins", "usable_transport", Status.FAIL, "no transport is available",
                            "install mpcomm with its tcp plugin (always available) or check MPCOMM_PLUGINS"))
    return checks


def native_helper_checks() -> list[Check]:
    """One WARN per compiled helper the install lacks (with what running without it costs), else one PASS."""
    gone = native_helper.missing()
    if not gone:
        return [Check("plugins", "compiled_helpers", Status.PASS,
                      f"all {len(native_helper.HELPERS)} built at install ({', '.join(w for w, _ in native_helper.HELPERS.values())})")]
    return [Check("plugins", f"compiled:{what}", Status.WARN, f"missing: {why}",
                  "reinstall mpcomm where a C compiler and Python headers are available, or use a binary wheel")
            for what, why in gone.items()]


def stale_native_checks(pkg_dir: str | None = None, helpers: dict[str, Path] | None = None) -> list[Check]:
    """One WARN per stale native build artefact (its path, and what to do), else one PASS.

    Stale: the MPComm provider's files an old build scheme left in an editable install's package
    dir, a provider library older than its source, a compiled helper older than its C source
    (``pkg_dir``/``helpers``: what to look at instead of this install; see the two functions).
    """
    found = stale_artefacts(pkg_dir)
    found += [(built, f"older than its source {source}",
               "rebuild the helpers: pip install -e . again, or python setup.py build_ext --inplace")
              for built, source in native_helper.stale(helpers)]
    if not found:
        return [Check("plugins", "stale_native", Status.PASS, "no stale native build artefacts")]
    return [Check("plugins", f"stale_native:{path.name}", Status.WARN, f"{path}: {why}", todo)
            for path, why, todo in found]


def manifest_extra(found: dict[str, Any]) -> dict[str, str]:
    extra: dict[str, str] = {}
    for t in found["transports"]:
        extra[f"plugin:{t['name']}"] = f"{t['distribution']} {t['version']}".strip()
        # Every transport, so a manifest diff shows one appearing or going away.
        native = t["native_version"] or "none (no native library)"
        extra[f"transport:{t['name']}"] = native if t["available"] else f"{native}; unavailable: {t['reason']}"
    return extra


@app.command("doctor")
@handle_errors
def doctor(
    json_: JsonOption = False,
    manifest: Annotated[bool, typer.Option("--manifest", help="Print component versions (mpcomm, plugins, "
                                           "native libraries) for a reproducible deployment list instead.")] = False,
    min_shm: Annotated[str, typer.Option(help="Warn below this /dev/shm size.", envvar="MPCOMM_DOCTOR_MIN_SHM")] = "1GiB",
    min_memlock: Annotated[str, typer.Option(help="Warn below this locked-memory limit.",
                                             envvar="MPCOMM_DOCTOR_MIN_MEMLOCK")] = "64MiB",
    rdma: Annotated[bool, typer.Option("--rdma", help="Run the rdma_zerocopy hardware validation instead "
                                       "(one verdict line per step; see docs/rdma.md).")] = False,
) -> None:
    """Check this node (CPU, NUMA, NICs, RDMA, huge pages, memlock, /dev/shm, ptrace scope, plugins). Exits 1 only on FAIL."""
    if rdma:
        from mpcomm.plugins.rdma_zerocopy.validate import main as validate_rdma

        code = validate_rdma([], echo=typer.echo)
        if code:
            raise typer.Exit(code)
        return
    found = plugins_cmd.collect()
    if manifest:
        data = nodecheck.manifest(manifest_extra(found))
        if json_:
            print_json(data)
        else:
            width = max(map(len, data))
            for k, v in data.items():
                typer.echo(f"{k:<{width}}  {v}")
        return
    checks = nodecheck.run_checks(min_shm_bytes=parse_size(min_shm), min_memlock_bytes=parse_size(min_memlock))
    checks += plugin_checks(found)
    checks += native_helper_checks()  # accelerations missing from this install, and their measured cost
    checks += stale_native_checks()  # an old build's files, or a build older than its source
    checks += gpus.doctor_checks(discover_gpus())  # where each GPU sits; which transports move CUDA memory
    checks.append(native_provider_check())  # libmpcomm.so for Mooncake TENT (docs/tent.md)
    worst = nodecheck.worst_status(checks)
    if json_:
        print_json({"status": worst.value, "checks": [c.to_dict() for c in checks]})
    else:
        table = Table(title="mpcomm doctor", title_justify="left", show_lines=False)
        for col in ("section", "check", "status", "value", "hint"):
            table.add_column(col, overflow="fold")
        for c in checks:
            st = Status(c.status).value
            table.add_row(c.section, escape(c.name), f"[{_STYLE[st]}]{st.upper()}[/]", escape(c.value), escape(c.hint))
        # The result: stdout, at the terminal's width (rich folds the cells).
        out_console.print(table)
        out_console.print(f"overall: [{_STYLE[worst.value]}]{worst.value.upper()}[/]")
    if worst is Status.FAIL:
        raise typer.Exit(EXIT_FAILURE)
