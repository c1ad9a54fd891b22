"""The rdma_zerocopy transport plugin (in progress)."""
