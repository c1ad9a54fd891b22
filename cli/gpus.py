"""GPUs for ``mpcomm topology`` and ``mpcomm doctor`` (issue 31): where each sits
(PCIe address, NUMA node, from sysfs), what nvidia-smi says of it where it is
installed, and which transports move CUDA memory here, or why not.

Read-only and standard library only (subprocess for nvidia-smi, bounded).
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Sequence
from typing import Any

from mpcomm.topology import Gpu

from .nodecheck import Check, Status

__all__ = ["device_memory", "doctor_checks", "gpu_rows", "nvidia_smi", "section"]

_QUERY = "pci.bus_id,index,name,memory.total,driver_version"


def _pci(addr: str) -> str:
    """nvidia-smi's ``00000000:3B:00.0`` as sysfs writes it: ``0000:3b:00.0``."""
    dom, _, rest = addr.strip().partition(":")
    return f"{int(dom, 16):04x}:{rest.lower()}" if rest else addr.strip().lower()


def nvidia_smi(timeout: float = 10.0) -> tuple[dict[str, dict[str, str]], str]:
    """``({pci: {index, name, memory, driver}}, note)``; note says why nothing came back."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return {}, "nvidia-smi: not installed"
    try:
        out = subprocess.run([exe, f"--query-gpu={_QUERY}", "--format=csv,noheader,nounits"], capture_output=True,
                             text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return {}, f"nvidia-smi: {exc}"
    if out.returncode != 0:
        return {}, f"nvidia-smi: exit {out.returncode}: {(out.stderr or out.stdout).strip()[:200]}"
    found = {}
    for line in out.stdout.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) >= 5:
            found[_pci(parts[0])] = {"index": parts[1], "name": parts[2], "memory": f"{parts[3]} MiB",
                                     "driver": parts[4]}
    return found, ""


def gpu_rows(gpus: Sequence[Gpu], smi: dict[str, dict[str, str]] | None = None) -> list[dict[str, Any]]:
    """One dict per GPU on the PCI bus: ``pci``, ``vendor``, ``numa_node`` (+ nvidia-smi's fields)."""
    smi = smi or {}
    return [{"pci": g.pci, "vendor": g.vendor, "numa_node": g.numa_node, **smi.get(g.pci.lower(), {})}
            for g in gpus]


def device_memory() -> list[dict[str, Any]]:
    """Per installed transport: does it move CUDA memory here, and if not, why."""
    from mpcomm.registry import load_plugins
    from mpcomm.transport import effective_capabilities

    out = []
    for name, entry in sorted(load_plugins().transports.items()):
        caps, missing = effective_capabilities(entry.cls)
        declared = "cuda" in entry.cls.capabilities.memory_kinds
        ok = "cuda" in caps.memory_kinds
        why = missing.get("cuda") or ("" if declared else "not declared by the transport")
        out.append({"transport": name, "cuda": ok, "reason": "" if ok else why})
    return out


def _line(r: dict[str, Any]) -> str:
    numa = r["numa_node"] if r["numa_node"] >= 0 else "?"
    what = f"{r['name']}, {r['memory']}, driver {r['driver']}, cuda:{r['index']}" if "name" in r else r["vendor"]
    return f"{r['pci']}: {what}; numa {numa}"


def section(gpus: Sequence[Gpu]) -> str:
    """The text ``mpcomm topology`` prints after its own sections."""
    smi, note = nvidia_smi() if gpus else ({}, "")
    lines = ["== gpus and device memory =="]
    rows = gpu_rows(gpus, smi)
    if not rows:
        lines.append("none: no GPU on the PCI bus (class 0x0300/0x0302/0x0380 in /sys/bus/pci/devices)")
    lines += [_line(r) for r in rows]
    if note and rows:
        lines.append(note)
    for d in device_memory():
        lines.append(f"{d['transport']:<16} cuda memory: " + ("yes" if d["cuda"] else f"no: {d['reason']}"))
    return "\n".join(lines)


def doctor_checks(gpus: Sequence[Gpu]) -> list[Check]:
    """``gpus`` section of ``mpcomm doctor``: informational (a node without GPUs is fine)."""
    smi, note = nvidia_smi() if gpus else ({}, "")
    checks = [Check("gpus", f"gpu:{r['pci']}", Status.INFO, _line(r)) for r in gpu_rows(gpus, smi)]
    if not checks:
        checks.append(Check("gpus", "gpus", Status.INFO, "none: no GPU on the PCI bus"))
    elif note:
        checks.append(Check("gpus", "nvidia-smi", Status.INFO, note))
    for d in device_memory():
        value = "moves CUDA memory" if d["cuda"] else f"no CUDA memory: {d['reason']}"
        checks.append(Check("gpus", f"cuda:{d['transport']}", Status.INFO, value))
    return checks
