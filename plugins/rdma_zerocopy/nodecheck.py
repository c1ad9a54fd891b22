"""rdma_zerocopy's node checks for ``mpcomm doctor`` (section ``rdma``): adapters, ports, uverbs, libibverbs.

Returned by :meth:`RdmaZeroCopyTransport.node_checks` (the transport hook
``mpcomm doctor`` gathers from every installed transport). Read-only, and
without pyverbs: the devices come from sysfs through :mod:`mpcomm.topology`
(the data a node also sends peers in its handshake), the library from
``ctypes.util.find_library``. So the checks say what is missing exactly where
the transport is unavailable.
"""

from __future__ import annotations

import ctypes.util
import glob
import os
import shutil

from mpcomm import topology
from mpcomm.cli.nodecheck import Check, Status, guarded, read_text

__all__ = ["SECTION", "node_checks"]

SECTION = "rdma"
_SYS_IB = "/sys/class/infiniband"

_NO_RDMA_HINT = (
    "mpcomm will use tcp/shm/ucx; load the rdma drivers (ib_core, mlx5_ib) "
    "for zero-copy RDMA"
)


def node_checks(sys_ib: str = _SYS_IB) -> list[Check]:
    """The devices (with their ports and the uverbs nodes), then the user-space tools and library.

    Each half is guarded on its own: a probe that raises is one WARN, and the other half still runs.
    """
    return [*guarded(SECTION, "devices", lambda: device_checks(sys_ib)),
            *guarded(SECTION, "userspace", lambda: userspace_checks(sys_ib))]


def device_checks(sys_ib: str = _SYS_IB) -> list[Check]:
    """One check per adapter (PASS with an ACTIVE port), the uverbs device nodes, and a summary first."""
    devices = topology.discover_rdma(sys_ib)
    if not devices:
        return [Check(SECTION, "devices", Status.INFO, "no RDMA devices", _NO_RDMA_HINT)]
    checks: list[Check] = []
    any_active = False
    for dev in devices:
        port_desc: list[str] = []
        for port in dev.ports:
            desc = f"port {port.port}: {port.link_layer} {port.state}"
            if port.rate:
                desc += f" ({port.rate})"
            port_desc.append(desc)
        fw = read_text(os.path.join(sys_ib, dev.name, "fw_ver"))
        value = f"hca_id {dev.name}"
        if fw:
            value += f", fw {fw}"
        if dev.numa_node >= 0:
            value += f", numa node {dev.numa_node}"
        value += "; " + ("; ".join(port_desc) if port_desc else "no ports")
        any_active = any_active or dev.active
        checks.append(Check(SECTION, f"device.{dev.name}", Status.PASS if dev.active else Status.WARN, value,
                            "" if dev.active else "no ACTIVE port: check cabling / subnet manager"))
    uverbs = glob.glob("/dev/infiniband/uverbs*")
    if uverbs:
        checks.append(Check(SECTION, "uverbs", Status.PASS, f"{len(uverbs)} /dev/infiniband/uverbs* nodes"))
    else:
        checks.append(Check(SECTION, "uverbs", Status.WARN, "RDMA devices present but no /dev/infiniband/uverbs*",
                            "load ib_uverbs, or pass --device=/dev/infiniband into the container"))
    checks.insert(0, Check(SECTION, "devices", Status.PASS if any_active else Status.WARN,
                           f"{len(devices)} device(s): {', '.join(d.name for d in devices)}"))
    return checks


def userspace_checks(sys_ib: str = _SYS_IB) -> list[Check]:
    """``ibv_devinfo`` (for a human's inspection) and libibverbs (a WARN only where there are devices)."""
    have_devices = os.path.isdir(sys_ib) and bool(os.listdir(sys_ib))
    checks: list[Check] = []
    tool = shutil.which("ibv_devinfo")
    checks.append(Check(SECTION, "ibv_devinfo", Status.INFO, tool if tool else "ibv_devinfo is not installed",
                        "" if tool else "install ibverbs-utils (rdma-core) for manual RDMA inspection"))
    lib = ctypes.util.find_library("ibverbs")
    if lib:
        checks.append(Check(SECTION, "libibverbs", Status.PASS if have_devices else Status.INFO, lib))
    else:
        checks.append(Check(SECTION, "libibverbs", Status.WARN if have_devices else Status.INFO,
                            "libibverbs.so.1 not found",
                            "install libibverbs1 / rdma-core to use the rdma_zerocopy transport"))
    return checks
