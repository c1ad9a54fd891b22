"""rdma_zerocopy's contribution to ``mpcomm doctor`` (``RdmaZeroCopyTransport.node_checks``), on sysfs-shaped trees.

No adapter is needed: the checks read sysfs (through mpcomm.topology), so a
directory laid out like ``/sys/class/infiniband`` drives them.
"""

from __future__ import annotations

import glob
from pathlib import Path

from mpcomm.cli.nodecheck import Check, Status, run_checks
from mpcomm.plugins.rdma_zerocopy import nodecheck
from mpcomm.plugins.rdma_zerocopy.transport import RdmaZeroCopyTransport


def _device(root: Path, name: str, state: str, fw: str = "") -> None:
    port = root / name / "ports" / "1"
    port.mkdir(parents=True)
    (port / "state").write_text(state + "\n")
    (port / "link_layer").write_text("Ethernet\n")
    (port / "rate").write_text("100 Gb/sec (4X EDR)\n")
    if fw:
        (root / name / "fw_ver").write_text(fw + "\n")


def _by_name(checks: list[Check]) -> dict[str, Check]:
    assert all(c.section == "rdma" for c in checks)
    return {c.name: c for c in checks}


def test_no_devices_is_info_with_the_fallback_hint(tmp_path: Path) -> None:
    got = _by_name(nodecheck.node_checks(str(tmp_path / "absent")))
    assert list(got) == ["devices", "ibv_devinfo", "libibverbs"]
    assert got["devices"].status is Status.INFO and got["devices"].value == "no RDMA devices"
    assert "tcp/shm/ucx" in got["devices"].hint
    assert got["libibverbs"].status in (Status.PASS, Status.INFO)  # no devices: never a WARN


def test_devices_ports_and_firmware(tmp_path: Path) -> None:
    _device(tmp_path, "mlx5_0", "4: ACTIVE", fw="22.31.1014")
    _device(tmp_path, "mlx5_1", "1: DOWN")
    checks = nodecheck.node_checks(str(tmp_path))
    got = _by_name(checks)
    assert checks[0].name == "devices"  # the summary first
    assert got["devices"].status is Status.PASS and got["devices"].value == "2 device(s): mlx5_0, mlx5_1"
    up, down = got["device.mlx5_0"], got["device.mlx5_1"]
    assert up.status is Status.PASS and "fw 22.31.1014" in up.value and "port 1: Ethernet ACTIVE" in up.value
    assert down.status is Status.WARN and "subnet manager" in down.hint
    uverbs = got["uverbs"]
    assert uverbs.status is (Status.PASS if glob.glob("/dev/infiniband/uverbs*") else Status.WARN)
    # devices present: a missing libibverbs is now a WARN
    lib = got["libibverbs"]
    assert (lib.status is Status.WARN) == (lib.value == "libibverbs.so.1 not found")


def test_doctor_gathers_them_from_the_transport() -> None:
    """The transport's hook is what ``run_checks`` calls: the same checks as the module's, after network."""
    assert [c.name for c in RdmaZeroCopyTransport.node_checks()] == [c.name for c in nodecheck.node_checks()]
    order = [c.section for c in run_checks(transports=[RdmaZeroCopyTransport])]
    assert "rdma" in order and order.index("network") < order.index("rdma") < order.index("hugepages")
