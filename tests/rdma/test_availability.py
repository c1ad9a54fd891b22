"""availability(): cheap, no ImportError, and a reason that names the missing precondition."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
from rdma_support import expected_category

from mpcomm.plugins.rdma_zerocopy import verbs
from mpcomm.plugins.rdma_zerocopy.transport import RdmaZeroCopyTransport, device_memory_availability, memlock_reason

REASONS = (
    "pyverbs is not installed (apt install python3-pyverbs)",
    "no RDMA device (ibv_get_device_list returned none)",
    "RLIMIT_MEMLOCK is ",
)


def test_reason_matches_this_machine() -> None:
    avail = RdmaZeroCopyTransport.availability()
    expected = expected_category()
    if expected == "device-present":
        assert (avail.available or avail.reason.startswith("no usable RDMA port: ")
                or avail.reason.startswith("RLIMIT_MEMLOCK is ")), avail.reason
    else:
        assert not avail.available
        assert avail.reason.startswith(expected), avail.reason


def test_availability_never_raises_and_is_repeatable() -> None:
    first = RdmaZeroCopyTransport.availability()
    assert RdmaZeroCopyTransport.availability() == first
    assert first.reason


def test_not_installed_reason_in_a_clean_interpreter() -> None:
    code = textwrap.dedent("""
        import importlib.util, sys
        if importlib.util.find_spec("pyverbs") is not None:
            print("SKIP pyverbs is importable natively"); sys.exit(0)
        from mpcomm.plugins.rdma_zerocopy.transport import RdmaZeroCopyTransport
        a = RdmaZeroCopyTransport.availability()
        print(a.available, a.reason)
        assert "pyverbs" not in sys.modules
    """)
    env = dict(os.environ, MPCOMM_PYVERBS_PATH="")  # no fallback to the distribution's copy
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    if out.stdout.startswith("SKIP"):
        pytest.skip(out.stdout.strip())
    assert out.stdout.startswith("False pyverbs is not installed (apt install python3-pyverbs)"), out.stdout


def test_no_device_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    try:
        verbs.load_pyverbs()
    except verbs.PyverbsMissing as exc:
        pytest.skip(f"pyverbs not loadable here: {exc}")
    monkeypatch.setattr(verbs, "list_devices", lambda: [])
    avail = RdmaZeroCopyTransport.availability()
    assert not avail.available
    assert avail.reason.startswith("no RDMA device (ibv_get_device_list returned none)")


def test_no_active_port_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    try:
        verbs.load_pyverbs()
    except verbs.PyverbsMissing as exc:
        pytest.skip(f"pyverbs not loadable here: {exc}")
    monkeypatch.setattr(verbs, "probe", lambda device="", port=0: verbs.DeviceProbe(
        False, "no usable RDMA port: mlx5_0 skipped: port 1 not ACTIVE"))
    assert RdmaZeroCopyTransport.availability().reason == "no usable RDMA port: mlx5_0 skipped: port 1 not ACTIVE"


def test_skipped_devices_are_named_when_another_is_used(monkeypatch: pytest.MonkeyPatch) -> None:
    try:
        verbs.load_pyverbs()
    except verbs.PyverbsMissing as exc:
        pytest.skip(f"pyverbs not loadable here: {exc}")
    import mpcomm.plugins.rdma_zerocopy.transport as t

    monkeypatch.setattr(verbs, "probe", lambda device="", port=0: verbs.DeviceProbe(
        True, "", "mlx5_0", 1, "InfiniBand", ("efa_0 skipped: transport type unspecified (EFA and similar): no RC "
                                               "queue pairs",)))
    monkeypatch.setattr(t, "memlock_reason", lambda: "")
    avail = RdmaZeroCopyTransport.availability()
    assert avail.available and avail.reason.startswith("mlx5_0 port 1 (InfiniBand); device memory: ")
    assert avail.reason.endswith("; efa_0 skipped: transport type unspecified (EFA and similar): no RC queue pairs")


def test_memlock_reason() -> None:
    msg = memlock_reason(8 << 20, has_ipc_lock=False)
    assert msg.startswith("RLIMIT_MEMLOCK is 8 MiB; RDMA registration pins memory: raise it")
    assert memlock_reason(64 << 10, has_ipc_lock=False).startswith("RLIMIT_MEMLOCK is 64 KiB;")
    assert memlock_reason(8 << 20, has_ipc_lock=True) == ""  # CAP_IPC_LOCK lifts the limit for ib_umem
    import resource

    assert memlock_reason(resource.RLIM_INFINITY, has_ipc_lock=False) == ""


def test_memlock_checked_after_device(monkeypatch: pytest.MonkeyPatch) -> None:
    try:
        verbs.load_pyverbs()
    except verbs.PyverbsMissing as exc:
        pytest.skip(f"pyverbs not loadable here: {exc}")
    import mpcomm.plugins.rdma_zerocopy.transport as t

    monkeypatch.setattr(verbs, "probe", lambda device="", port=0: verbs.DeviceProbe(True, "", "mlx5_0", 1, "Ethernet"))
    monkeypatch.setattr(t, "memlock_reason", lambda: memlock_reason(8 << 20, has_ipc_lock=False))
    assert RdmaZeroCopyTransport.availability().reason.startswith("RLIMIT_MEMLOCK is 8 MiB")
    monkeypatch.setattr(t, "memlock_reason", lambda: "")
    avail = RdmaZeroCopyTransport.availability()
    assert avail.available and avail.reason.startswith("mlx5_0 port 1 (Ethernet); device memory: ")


def test_device_memory_is_reported_unavailable() -> None:
    gpu = device_memory_availability()
    assert not gpu.available and gpu.reason
    assert RdmaZeroCopyTransport.capabilities.memory_kinds == frozenset({"host"})


def test_capabilities() -> None:
    caps = RdmaZeroCopyTransport.capabilities.to_dict()
    assert caps == {"memory_kinds": ["host"], "remote_memory_kinds": ["host"], "intra_node": True, "inter_node": True, "one_sided": True,
                    "zero_copy": True, "inflight_cancel": True, "modes": ["zero-copy"],
                    "revocation": "key", "bandwidth_class": "high"}


def test_pyverbs_objects_build() -> None:
    try:
        verbs.load_pyverbs()
    except verbs.PyverbsMissing as exc:
        pytest.skip(f"pyverbs not loadable: {exc}")
    import pyverbs.enums as e

    assert verbs.access_flags("rw") == e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_WRITE | e.IBV_ACCESS_REMOTE_READ
    assert verbs.access_flags("r") == e.IBV_ACCESS_REMOTE_READ
