"""``mpcomm doctor --rdma``: one verdict line per step; every step SKIPs with the reason where no port
is usable, and the steps' own logic runs against two real engines on the simulated adapter."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest
from fake_verbs import FakeDevice

from mpcomm import Availability, hookimpl
from mpcomm.plugins.rdma_zerocopy import validate
from mpcomm.plugins.rdma_zerocopy.transport import RdmaZeroCopyTransport

AVAIL = RdmaZeroCopyTransport.availability()
NAMES = [name for name, _, _ in validate.STEPS]


def test_the_steps_are_the_issues_list_in_order() -> None:
    assert NAMES == ["device", "conformance", "rss", "stale_rkey", "killed_peer", "cancel", "idle", "register",
                     "bench"]


@pytest.mark.skipif(AVAIL.available, reason="an RDMA port is usable here: run `mpcomm doctor --rdma` by hand "
                    "(it takes minutes)")
def test_doctor_rdma_skips_every_step_with_the_reason() -> None:
    out = subprocess.run([sys.executable, "-m", "mpcomm.cli", "doctor", "--rdma"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    assert len(lines) == len(NAMES), out.stdout
    for i, (line, name) in enumerate(zip(lines, NAMES), 1):
        assert line == f"SKIP {i}. {name}: {AVAIL.reason}", line


def test_only_and_unknown_steps() -> None:
    got = list(validate.run_steps(validate.Validation(reason="no RDMA device here"), only=["cancel", "rss"]))
    assert [(r.index, r.name, r.verdict) for r in got] == [(3, "rss", "SKIP"), (6, "cancel", "SKIP")]
    with pytest.raises(ValueError, match="unknown step"):
        list(validate.run_steps(validate.Validation(reason="x"), only=["nope"]))


class FakeRdma(RdmaZeroCopyTransport):
    name = "rdma_fake"
    device_factory = FakeDevice

    @classmethod
    def availability(cls) -> Availability:
        return Availability.yes("simulated adapter")


class FakePlugin:
    @hookimpl
    def mpcomm_register_transports(self, register: Any) -> None:
        register(FakeRdma)


def test_steps_on_the_simulated_adapter(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(FakeDevice, "delay", 0.0)
    monkeypatch.setattr(FakeDevice, "max_msg_sz", 4096)
    monkeypatch.setattr(FakeDevice, "record", False)
    v = validate.Validation(transport="rdma_fake", plugins=[FakePlugin()], autoload=False, in_process_only=True,
                            options={"poll_spin_us": 0}, posts=20000, register_size=32 << 20, cancel_size=1 << 20,
                            idle_seconds=0.5)
    results = {r.name: r for r in validate.run_steps(v, only=["device", "conformance", "rss", "stale_rkey",
                                                                "killed_peer", "idle", "register", "bench"])}
    lines = "\n".join(r.line() for r in results.values())
    assert results["device"].verdict == "PASS" and "fake0 port 1 (InfiniBand" in results["device"].detail, lines
    for name in ("conformance", "killed_peer", "bench"):
        assert results[name].verdict == "SKIP" and "simulated adapter" in results[name].detail, lines
    assert results["rss"].verdict == "PASS" and "20000 posts of 64 B" in results["rss"].detail, lines
    assert results["stale_rkey"].verdict == "PASS" and "IBV_WC_REM_ACCESS_ERR" in results["stale_rkey"].detail, lines
    assert results["idle"].verdict in ("PASS", "WARN") and "idle CPU" in results["idle"].detail, lines
    assert results["register"].verdict == "PASS" and "mmap+touch baseline" in results["register"].detail, lines


def test_cancel_step_on_the_simulated_adapter(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(FakeDevice, "delay", 0.05)
    monkeypatch.setattr(FakeDevice, "max_msg_sz", 64 << 10)
    v = validate.Validation(transport="rdma_fake", plugins=[FakePlugin()], autoload=False, in_process_only=True,
                            options={"poll_spin_us": 0}, cancel_size=1 << 20)
    (res,) = validate.run_steps(v, only=["cancel"])
    assert res.verdict == "PASS", res.line()
    assert "no late bytes; the next write landed" in res.detail
