"""tcp and device memory (issue 31): local CUDA memory is staged through pinned bounce buffers,
the target serves host memory only, so tcp moves (cuda, host) and (host, host) and never a
remote CUDA region. The staged copy itself runs in tests/device/ on a GPU."""

from __future__ import annotations

import pytest

import mpcomm
from mpcomm import cuda_runtime
from mpcomm.plugins.tcp.transport import TcpTransport
from mpcomm.routing import RoutePolicy, RouteQuery
from mpcomm.transport import effective_capabilities

FAKE_PTR = 0x7F00_0000_0000


def test_declared_per_side() -> None:
    caps = TcpTransport.capabilities
    assert caps.moves("cuda", "host") and caps.moves("host", "host")
    assert not caps.moves("host", "cuda") and not caps.moves("cuda", "cuda")
    assert caps.to_dict()["remote_memory_kinds"] == ["host"]
    p = RoutePolicy.from_config(None, {"tcp": caps})
    q = RouteQuery(same_host=False, local_kind="cuda", remote_kind="host", peer_transports=frozenset({"tcp"}))
    assert p.choose(q).transports == ("tcp",)
    with pytest.raises(mpcomm.MemoryKindUnsupported, match="tcp moves local cuda,host, remote host"):
        p.choose(RouteQuery(same_host=False, local_kind="host", remote_kind="cuda",
                            peer_transports=frozenset({"tcp"})))


@pytest.mark.skipif(cuda_runtime.unavailable_reason() is None, reason="CUDA works here: see tests/device/")
def test_unavailable_here_says_why() -> None:
    avail = TcpTransport.memory_kind_availability()["cuda"]
    assert not avail and avail.reason == cuda_runtime.unavailable_reason()
    caps, missing = effective_capabilities(TcpTransport)
    assert caps.memory_kinds == {"host"} and "cuda" in missing
    with mpcomm.Engine(transports=["tcp"], endpoint="127.0.0.1:0") as t, \
            mpcomm.Engine(transports=["tcp"], endpoint="127.0.0.1:0") as i:
        buf = bytearray(4096)
        d = t.describe(t.register(buf, "h"))
        with pytest.raises(mpcomm.MemoryKindUnsupported, match="local cuda memory to/from remote host"):
            i.write(mpcomm.DeviceBuffer(FAKE_PTR, 64, 0), d).result(10)
        assert not any(buf)
