"""rdma_zerocopy and device memory (issue 31): not declared, and the reason is reported."""

from __future__ import annotations

from mpcomm.plugins.rdma_zerocopy.transport import RdmaZeroCopyTransport
from mpcomm.transport import effective_capabilities


def test_cuda_not_declared_with_the_reason() -> None:
    assert "cuda" not in RdmaZeroCopyTransport.capabilities.memory_kinds
    avail = RdmaZeroCopyTransport.memory_kind_availability()["cuda"]
    assert not avail and avail.reason
    caps, missing = effective_capabilities(RdmaZeroCopyTransport)
    assert caps.memory_kinds == {"host"} and missing["cuda"] == avail.reason
