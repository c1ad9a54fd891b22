"""Copies handed to threads run near the destination memory's NUMA node.

This host has one NUMA node, so the two-node case reads a two-node topology
in place of sysfs (node 0 = CPU 0, node 1 = CPU 1); the threads are really
pinned to those CPUs and really do the copies.
"""

from __future__ import annotations

import os
from typing import Any

import pytest

import mpcomm
from mpcomm.plugins.shm import transport as shm_mod
from mpcomm.topology import NumaNode

BIG = 1 << 20
CONFIG = {"plugins": {"shm": {"inline_threshold": 4096}}}  # every copy of BIG goes to the threads


def _allowed(native_id: int) -> str:
    with open(f"/proc/self/task/{native_id}/status") as f:
        return next(line.split(":", 1)[1].strip() for line in f if line.startswith("Cpus_allowed_list"))


def _pair() -> tuple[mpcomm.Engine, mpcomm.Engine, Any, Any, Any]:
    target, ini = mpcomm.Engine(CONFIG, transports=["shm"]), mpcomm.Engine(CONFIG, transports=["shm"])
    kv = target.allocate(4 * BIG, name="kv")
    return target, ini, kv, ini.open(target.address, "kv"), ini.allocate(4 * BIG)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2 or not {0, 1} <= os.sched_getaffinity(0),
                    reason="needs CPUs 0 and 1 to pin the two nodes' copy threads")
def test_copies_run_on_threads_pinned_to_the_destination_node(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shm_mod, "_numa_nodes", lambda: (NumaNode(0, (0,)), NumaNode(1, (1,))))
    target, ini, kv, remote, src = _pair()
    try:
        shm = ini.transports["shm"]
        node = kv.numa_node
        assert node in (0, None)
        src.view[:BIG] = os.urandom(BIG)
        ini.write(src, remote, 0, BIG).result(10)  # attaches (and copies on the attaching worker)
        ini.write(src, remote, 0, BIG).result(10)  # attached: handed to the copy threads
        assert bytes(kv.view[:BIG]) == bytes(src.view[:BIG])
        m = next(iter(shm._maps.values()))
        assert m.numa == (node if node is not None else -1)  # what the target reported at attach
        if m.numa < 0:
            pytest.skip("the kernel did not say which node holds the target's pages")
        # Writes copy on the pool of the target memory's node, pinned to that node's CPU.
        pool = shm._near[m.numa]
        threads = list(pool._threads)
        assert threads and all(t.name.startswith(f"mpcomm-shm-n{m.numa}") for t in threads)
        assert {_allowed(t.native_id) for t in threads} == {str(m.numa)}
        # A pretend far node for the target memory: the copy moves to node 1's threads, bytes still right.
        m.numa = 1
        src.view[:BIG] = os.urandom(BIG)
        ini.write(src, remote, BIG, BIG).result(10)
        assert bytes(kv.view[BIG : 2 * BIG]) == bytes(src.view[:BIG])
        assert {_allowed(t.native_id) for t in shm._near[1]._threads} == {"1"}
        # Reads land in the local region: its node picks the threads.
        dst = ini.allocate(BIG)
        ini.read(dst, remote, BIG, BIG).result(10)
        assert bytes(dst.view) == bytes(src.view[:BIG])
    finally:
        ini.close(timeout=5)
        target.close(timeout=5)


def test_a_single_node_host_uses_the_engine_workers() -> None:
    if len(shm_mod._numa_nodes()) > 1:
        pytest.skip("this host has several NUMA nodes")
    target, ini, kv, remote, src = _pair()
    try:
        ini.write(src, remote, 0, BIG).result(10)
        assert ini.transports["shm"]._near == {}
    finally:
        ini.close(timeout=5)
        target.close(timeout=5)


def test_a_bogus_node_from_the_peer_is_ignored(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shm_mod, "_numa_nodes", lambda: (NumaNode(0, (0,)), NumaNode(1, (1,))))
    target, ini, kv, remote, src = _pair()
    try:
        shm = ini.transports["shm"]
        assert shm._workers(7) is shm.ctx.executor  # a node this host does not have
        assert shm._workers(-1) is shm.ctx.executor
    finally:
        ini.close(timeout=5)
        target.close(timeout=5)
