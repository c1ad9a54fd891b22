"""GPUs in ``mpcomm topology`` and ``mpcomm doctor`` (issue 31): PCIe address and NUMA node
from sysfs (a real directory tree shaped like /sys/bus/pci/devices), nvidia-smi's fields when
it is on PATH (a real executable printing what nvidia-smi prints), and each transport's CUDA
memory support or the reason it has none. This machine has no GPU: the commands say so."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any

import pytest

from mpcomm.cli import gpus
from mpcomm.topology import discover_gpus


def _pci_tree(root: Path) -> None:
    for addr, vendor, cls, numa in (("0000:3b:00.0", "0x10de", "0x030200", "1"),   # NVIDIA 3D controller
                                    ("0000:00:02.0", "0x1234", "0x030000", "-1"),  # QEMU VGA: not a GPU
                                    ("0000:5e:00.0", "0x15b3", "0x020000", "0")):  # a NIC
        d = root / addr
        d.mkdir(parents=True)
        (d / "vendor").write_text(vendor + "\n")
        (d / "class").write_text(cls + "\n")
        (d / "numa_node").write_text(numa + "\n")


def _fake_smi(bindir: Path) -> None:
    exe = bindir / "nvidia-smi"
    exe.write_text("#!/bin/sh\necho '00000000:3B:00.0, 0, NVIDIA H100 80GB HBM3, 81559, 550.54.15'\n")
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)


def test_gpu_rows_from_sysfs_and_nvidia_smi(tmp_path: Path, monkeypatch: Any) -> None:
    _pci_tree(tmp_path / "pci")
    found = discover_gpus(str(tmp_path / "pci"))
    assert [(g.pci, g.vendor, g.numa_node) for g in found] == [("0000:3b:00.0", "nvidia", 1)]
    (tmp_path / "bin").mkdir()
    _fake_smi(tmp_path / "bin")
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")
    smi, note = gpus.nvidia_smi()
    assert note == "" and smi["0000:3b:00.0"]["name"] == "NVIDIA H100 80GB HBM3"
    rows = gpus.gpu_rows(found, smi)
    assert rows == [{"pci": "0000:3b:00.0", "vendor": "nvidia", "numa_node": 1, "index": "0",
                     "name": "NVIDIA H100 80GB HBM3", "memory": "81559 MiB", "driver": "550.54.15"}]
    text = gpus.section(found)
    assert "0000:3b:00.0: NVIDIA H100 80GB HBM3, 81559 MiB, driver 550.54.15, cuda:0; numa 1" in text
    checks = gpus.doctor_checks(found)
    assert checks[0].name == "gpu:0000:3b:00.0" and "numa 1" in checks[0].value


def test_nvidia_smi_absent_or_failing(tmp_path: Path, monkeypatch: Any) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    assert gpus.nvidia_smi() == ({}, "nvidia-smi: not installed")
    exe = tmp_path / "nvidia-smi"
    exe.write_text("#!/bin/sh\necho 'NVIDIA-SMI has failed' >&2\nexit 9\n")
    exe.chmod(0o755)
    smi, note = gpus.nvidia_smi()
    assert smi == {} and "exit 9" in note and "NVIDIA-SMI has failed" in note


def test_device_memory_per_transport() -> None:
    rows = {r["transport"]: r for r in gpus.device_memory()}
    assert {"shm", "tcp"} <= set(rows)
    for r in rows.values():
        assert r["cuda"] or r["reason"]  # yes, or why not


def test_topology_and_doctor_say_none_here(invoke: Any) -> None:
    if discover_gpus():
        return  # a machine with a GPU: tests/device covers it
    res = invoke("topology")
    assert res.exit_code == 0, res.output
    assert "== gpus and device memory ==" in res.stdout and "none: no GPU on the PCI bus" in res.stdout
    assert "shm              cuda memory:" in res.stdout
    data = json.loads(invoke("topology", "--json").stdout)
    assert data["gpus"] == [] and {r["transport"] for r in data["device_memory"]} >= {"shm", "tcp"}
    same_dev = next(r for r in data["routes"] if r["case"] == "same host, device memory")
    assert same_dev["local_kind"] == "cuda" and same_dev["transports"] == []
    doc = json.loads(invoke("doctor", "--json").stdout)
    mine = [c for c in doc["checks"] if c["section"] == "gpus"]
    assert mine[0]["value"] == "none: no GPU on the PCI bus" and all(c["status"] == "info" for c in mine)


def test_demo_reports_device_memory(invoke: Any) -> None:
    res = invoke("demo", "--size", "64KiB", "--reps", "1", "--json")
    assert res.exit_code == 0, res.output
    device = {d["transport"]: d for d in json.loads(res.stdout)["device_memory"]}
    assert "tcp" in device
    for d in device.values():
        assert d["status"] == "ok" or (d["status"] == "skipped" and d["reason"])
    if not discover_gpus():
        assert all(d["status"] == "skipped" for d in device.values())


def test_demo_table_names_the_cuda_extra_in_full(invoke: Any) -> None:
    """The human lines are rich markup: a reason naming ``mpcomm[cuda]`` must not lose ``[cuda]`` as a tag."""
    res = invoke("demo", "--size", "64KiB", "--reps", "1")
    assert res.exit_code == 0, res.output
    skipped = [ln for ln in res.stdout.splitlines() if ln.startswith("device memory over") and "pip install" in ln]
    if not skipped and "cuda-python is not installed" not in res.stdout:
        pytest.skip("cuda-python is installed here: no reason names the extra")
    assert "mpcomm[cuda]" in res.stdout.replace("\n", ""), res.stdout
