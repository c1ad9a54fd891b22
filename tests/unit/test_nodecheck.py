"""Tests for cli/nodecheck.py (read-only node acceptance checks, ``mpcomm doctor``)."""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import mpcomm
from mpcomm.cli import nodecheck


@pytest.fixture(scope="module")
def checks() -> list:
    return nodecheck.run_checks()


def _one(checks: list, section: str, name: str):
    found = [c for c in checks if c.section == section and c.name == name]
    assert len(found) == 1, f"expected one {section}/{name} check, got {found}"
    return found[0]


def test_every_section_has_checks(checks: list) -> None:
    contributed = {c.section for c in nodecheck.transport_checks()}
    assert "rdma" in contributed  # rdma_zerocopy's, installed with mpcomm
    sections = {c.section for c in checks}
    assert sections == set(nodecheck.SECTIONS) | contributed
    # the core's sections come out in the documented order, the transports' right after network
    order = [c.section for c in checks]
    firsts = sorted(set(order), key=order.index)
    core = [s for s in firsts if s in nodecheck.SECTIONS]
    assert tuple(core) == nodecheck.SECTIONS
    after_network = firsts[firsts.index("network") + 1 : firsts.index("network") + 1 + len(contributed)]
    assert set(after_network) == contributed


class _Checked(mpcomm.Transport):
    name = "checked"

    @classmethod
    def node_checks(cls) -> list:
        return [nodecheck.Check("checked", "widget", nodecheck.Status.PASS, "present")]


class _Broken(mpcomm.Transport):
    name = "broken"

    @classmethod
    def node_checks(cls) -> list:
        raise OSError("sysfs went away")


class _Wrong(mpcomm.Transport):
    name = "wrong"

    @classmethod
    def node_checks(cls) -> list:
        return [("wrong", "x", "pass", "a tuple")]


def test_transports_contribute_checks_through_the_hook() -> None:
    got = nodecheck.run_checks(transports=[_Checked, mpcomm.Transport, _Broken, _Wrong])
    mine = [c for c in got if c.section in ("checked", "broken", "wrong")]
    assert [(c.section, c.name, c.status) for c in mine] == [
        ("checked", "widget", nodecheck.Status.PASS),
        ("broken", "node_checks", nodecheck.Status.WARN),
        ("wrong", "node_checks", nodecheck.Status.WARN),
    ]
    assert "OSError: sysfs went away" in mine[1].value
    assert "returned tuple, not Check" in mine[2].value
    # the base class contributes nothing; the given transports replace the installed ones
    assert not [c for c in got if c.section == "rdma"]
    order = [c.section for c in got]
    assert order.index("network") < order.index("checked") < order.index("hugepages")


def test_statuses_and_fields_are_valid(checks: list) -> None:
    for c in checks:
        assert isinstance(c.status, nodecheck.Status)
        assert c.status.value in {"pass", "warn", "fail", "info"}
        assert isinstance(c.value, str) and c.value
        assert isinstance(c.hint, str)
        assert not c.value.startswith("check failed:"), c


def test_check_is_frozen() -> None:
    c = nodecheck.Check("cpu", "x", nodecheck.Status.PASS, "1")
    with pytest.raises(Exception):
        c.value = "2"  # type: ignore[misc]


def test_to_dict_is_json_serializable(checks: list) -> None:
    dumped = json.dumps([c.to_dict() for c in checks])
    loaded = json.loads(dumped)
    assert len(loaded) == len(checks)
    for d, c in zip(loaded, checks):
        assert set(d) == {"section", "name", "status", "value", "hint"}
        assert d["status"] == c.status.value
        assert d["section"] == c.section and d["name"] == c.name


def test_expected_core_checks_present(checks: list) -> None:
    for section, name in [
        ("cpu", "model"),
        ("cpu", "logical_cpus"),
        ("cpu", "sockets"),
        ("cpu", "numa_nodes"),
        ("network", "interfaces_up"),
        ("rdma", "devices"),
        ("rdma", "ibv_devinfo"),
        ("rdma", "libibverbs"),
        ("hugepages", "hugepages"),
        ("hugepages", "transparent_hugepage"),
        ("memory", "memlock"),
        ("memory", "shm"),
        ("memory", "total"),
        ("cma", "ptrace_scope"),
        ("cma", "process_vm_readv"),
    ]:
        _one(checks, section, name)


def test_cpu_count_matches_os(checks: list) -> None:
    c = _one(checks, "cpu", "logical_cpus")
    usable = len(os.sched_getaffinity(0))
    assert str(usable) in c.value
    if usable != os.cpu_count():
        assert c.value == f"{usable} usable of {os.cpu_count()}"


def test_network_lists_sysfs_interfaces(checks: list) -> None:
    names = {c.name for c in checks if c.section == "network"}
    if os.path.isdir("/sys/class/net"):
        for iface in os.listdir("/sys/class/net"):
            assert f"iface.{iface}" in names
    lo = [c for c in checks if c.name == "iface.lo"]
    if lo:
        assert lo[0].status is nodecheck.Status.INFO


def test_rdma_reports_absence_with_hint(checks: list) -> None:
    c = _one(checks, "rdma", "devices")
    ib = "/sys/class/infiniband"
    if not (os.path.isdir(ib) and os.listdir(ib)):
        assert c.status is nodecheck.Status.INFO
        assert c.value == "no RDMA devices"
        assert "tcp/shm/ucx" in c.hint


def test_hugepages_match_meminfo(checks: list) -> None:
    meminfo = Path("/proc/meminfo").read_text()
    total = int(next(l.split()[1] for l in meminfo.splitlines() if l.startswith("HugePages_Total:")))
    c = _one(checks, "hugepages", "hugepages")
    assert c.value.startswith(f"{total} total")
    if total == 0:
        assert c.status is nodecheck.Status.INFO
        assert "nr_hugepages" in c.hint


def test_memlock_pass_when_threshold_is_zero() -> None:
    result = nodecheck.run_checks(min_memlock_bytes=0)
    assert _one(result, "memory", "memlock").status is nodecheck.Status.PASS


def test_memlock_warns_with_lowered_limit() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    script = textwrap.dedent(
        f"""
        import json, resource
        soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
        new = 1 << 20
        if hard != resource.RLIM_INFINITY and hard < new:
            new = hard
        resource.setrlimit(resource.RLIMIT_MEMLOCK, (new, hard))
        from mpcomm.cli import nodecheck as m
        out = [c.to_dict() for c in m.run_checks(min_memlock_bytes=64 << 20)
               if c.section == "memory" and c.name == "memlock"]
        print(json.dumps({{"limit": new, "checks": out}}))
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout.strip().splitlines()[-1])
    assert data["limit"] <= 1 << 20
    assert len(data["checks"]) == 1
    check = data["checks"][0]
    assert check["status"] == "warn"
    assert "ulimit -l" in check["hint"]
    # the parent's limit is untouched
    assert resource.getrlimit(resource.RLIMIT_MEMLOCK) == (soft, hard)


def test_shm_missing_path_fails(tmp_path: Path) -> None:
    missing = tmp_path / "does-not-exist"
    result = nodecheck.run_checks(shm_path=str(missing))
    c = _one(result, "memory", "shm")
    assert c.status is nodecheck.Status.FAIL
    assert str(missing) in c.value


def test_shm_threshold(tmp_path: Path) -> None:
    ok = _one(nodecheck.run_checks(shm_path=str(tmp_path), min_shm_bytes=1), "memory", "shm")
    assert ok.status is nodecheck.Status.PASS
    huge = _one(
        nodecheck.run_checks(shm_path=str(tmp_path), min_shm_bytes=1 << 62), "memory", "shm"
    )
    assert huge.status is nodecheck.Status.WARN
    assert huge.hint


def test_cma_probe(checks: list) -> None:
    scope_path = Path("/proc/sys/kernel/yama/ptrace_scope")
    scope = scope_path.read_text().strip() if scope_path.exists() else None
    probe = _one(checks, "cma", "process_vm_readv")
    ptrace = _one(checks, "cma", "ptrace_scope")
    assert isinstance(probe, nodecheck.Check)
    if scope is None or scope == "0":
        assert ptrace.status is nodecheck.Status.PASS
        assert probe.status is nodecheck.Status.PASS, probe
        assert probe.value.startswith("read ")
    if scope is None:
        assert "yama not enabled" in ptrace.value


def _children_of(pid: int) -> list[str]:
    kids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            kids.append(entry)
    return kids


def test_cma_probe_reaps_child() -> None:
    before = set(_children_of(os.getpid()))
    nodecheck.run_checks()
    # neither a live child nor a zombie of the probe is left behind
    assert set(_children_of(os.getpid())) <= before


def test_failing_check_becomes_warn() -> None:
    def broken() -> list:
        raise RuntimeError("boom")

    result = nodecheck.guarded("cpu", "broken", broken)
    assert len(result) == 1
    assert result[0].status is nodecheck.Status.WARN
    assert "RuntimeError: boom" in result[0].value


def test_worst_status_and_report(checks: list) -> None:
    S = nodecheck.Status
    assert nodecheck.worst_status([]) is S.PASS
    mk = lambda s: nodecheck.Check("x", "y", s, "v")  # noqa: E731
    assert nodecheck.worst_status([mk(S.INFO), mk(S.WARN)]) is S.WARN
    assert nodecheck.worst_status([mk(S.FAIL), mk(S.WARN)]) is S.FAIL
    report = nodecheck.format_report(checks)
    for section in nodecheck.SECTIONS:
        assert f"== {section} ==" in report


def test_manifest_keys() -> None:
    m = nodecheck.manifest({"plugin.tcp": "1.2.3"})
    assert m["python"] == ".".join(map(str, sys.version_info[:3]))
    assert os.uname().release in m["kernel"]
    for key in ("platform", "glibc", "mpcomm", "pluggy", "opentelemetry-api", "typer",
                "numpy", "ucxx", "libucx", "rdma-core", "pyverbs"):
        assert key in m and isinstance(m[key], str) and m[key]
    assert m["plugin.tcp"] == "1.2.3"
    json.dumps(m)
