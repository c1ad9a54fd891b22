"""The plugin loads through its entry point without pyverbs; the engine skips it and uses tcp."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from mpcomm import Engine
from mpcomm.plugins.rdma_zerocopy.transport import RdmaZeroCopyTransport


def test_entry_point_import_does_not_import_pyverbs() -> None:
    code = textwrap.dedent("""
        import sys
        from importlib.metadata import entry_points
        (ep,) = [e for e in entry_points(group="mpcomm.transports") if e.name == "rdma_zerocopy"]
        plugin = ep.load()
        got = []
        plugin.mpcomm_register_transports(register=got.append)
        assert [c.name for c in got] == ["rdma_zerocopy"], got
        assert not [m for m in sys.modules if m == "pyverbs" or m.startswith("pyverbs.")], "pyverbs imported"
        assert "mpcomm.plugins.rdma_zerocopy.verbs" not in sys.modules
        from mpcomm.registry import load_plugins
        ps = load_plugins()
        assert "rdma_zerocopy" in ps.transports, ps.transports
        assert not [f for f in ps.failures if f.name == "rdma_zerocopy"], ps.failures
        assert "pyverbs" not in sys.modules
        print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr + out.stdout


def test_engine_skips_it_with_its_reason_and_works_over_tcp() -> None:
    avail = RdmaZeroCopyTransport.availability()
    if avail.available:
        import pytest

        pytest.skip("an RDMA port is usable here")
    with Engine(transports=["rdma_zerocopy", "tcp"]) as target, Engine(transports=["rdma_zerocopy", "tcp"]) as init:
        assert list(init.transports)[0] == "tcp" and "rdma_zerocopy" not in init.transports
        status = {s.name: s for s in init.transport_status()}
        assert not status["rdma_zerocopy"].running
        assert status["rdma_zerocopy"].availability.reason == avail.reason
        assert status["rdma_zerocopy"].capabilities["inflight_cancel"] is True
        region = target.allocate(1 << 16, "dst")
        remote = init.open(target.address, "dst")
        t = init.write(b"\x5a" * 4096, remote, 100)
        assert t.result(5) == 4096 and t.transport == "tcp"
        assert bytes(region.view[100:4196]) == b"\x5a" * 4096


def test_engine_with_only_rdma_says_why() -> None:
    avail = RdmaZeroCopyTransport.availability()
    if avail.available:
        import pytest

        pytest.skip("an RDMA port is usable here")
    import pytest

    from mpcomm import TransportUnavailable

    with pytest.raises(TransportUnavailable, match="rdma_zerocopy: "):
        Engine({"transport": {"name": "rdma_zerocopy"}})
