"""Discovery against this machine's real sysfs/procfs, and validation of what peers send."""

from __future__ import annotations

import ctypes
import json
import mmap
import os
import resource

import pytest

from mpcomm import topology as topo
from mpcomm.memory import allocate_host, buffer_address


@pytest.fixture(scope="module")
def local() -> topo.Topology:
    return topo.discover()


def test_discovery_matches_the_kernel(local: topo.Topology) -> None:
    assert local.cpus == os.cpu_count()
    assert local.cpus_usable == len(os.sched_getaffinity(0))
    names = {i.name for i in local.interfaces}
    assert names == set(os.listdir("/sys/class/net"))
    lo = next(i for i in local.interfaces if i.name == "lo")
    assert lo.loopback and lo.virtual and lo.state == "up"
    if os.path.isdir("/sys/devices/system/node/node0"):
        ids = sorted(n.id for n in local.numa_nodes)
        assert ids == sorted(int(p[4:]) for p in os.listdir("/sys/devices/system/node") if p[4:].isdigit() and p.startswith("node"))
        online = topo.parse_cpulist(open("/sys/devices/system/cpu/online").read())
        assert sorted(c for n in local.numa_nodes for c in n.cpus) == sorted(online)
        assert all(n.mem_total > 0 for n in local.numa_nodes)
    st = os.statvfs("/dev/shm")
    assert local.shm_size == st.f_blocks * st.f_frsize
    soft, _hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    assert local.memlock_soft == (-1 if soft == resource.RLIM_INFINITY else soft)
    sizes = {int(d.split("-")[1][:-2]) * 1024 for d in os.listdir("/sys/kernel/mm/hugepages")}
    assert {h.size for h in local.hugepages} == sizes
    ib = "/sys/class/infiniband"
    assert len(local.rdma_devices) == (len(os.listdir(ib)) if os.path.isdir(ib) else 0)


def test_physical_interfaces_come_first(local: topo.Topology) -> None:
    flags = [i.virtual for i in local.interfaces]
    assert flags == sorted(flags)


def test_round_trip_through_json(local: topo.Topology) -> None:
    wire = json.loads(local.to_json())
    assert topo.Topology.from_dict(wire) == local
    assert len(local.to_json()) < topo.MAX_ENCODED


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda d: d.update(cpus="two"), "topology.cpus must be an integer"),
        (lambda d: d.update(cpus=True), "topology.cpus must be an integer"),
        (lambda d: d.update(shm_size=-5), "topology.shm_size = -5 is outside"),
        (lambda d: d.update(hostname="x" * 1000), "topology.hostname is longer than"),
        (lambda d: d.update(evil=1), "unknown field 'evil'"),
        (lambda d: d.update(interfaces=[{"name": f"e{i}"} for i in range(topo.MAX_INTERFACES + 1)]),
         f"topology.interfaces has {topo.MAX_INTERFACES + 1} entries"),
        (lambda d: d.update(interfaces="eth0"), "topology.interfaces must be a list"),
        (lambda d: d.update(interfaces=[{"name": ""}]), "topology.interfaces[0].name must not be empty"),
        (lambda d: d.update(interfaces=[{"name": "e", "virtual": "no"}]), "topology.interfaces[0].virtual"),
        (lambda d: d.update(rdma_devices=[{"name": "mlx5_0", "ports": [{"port": 1}] * 9}]), "ports has 9 entries"),
        (lambda d: d.update(rdma_devices=[{"name": "mlx5_0", "ports": [{}]}]), "ports[0].port is missing"),
        (lambda d: d.update(numa_nodes=[{"id": 0, "cpus": list(range(topo.MAX_CPUS_PER_NODE + 1))}]), "cpus must be a list"),
        (lambda d: d.update(hugepages=[{"size": 0}]), "hugepages[0].size = 0"),
        (lambda d: d.update(gpus=[["0000:00:01.0"]]), "gpus[0] must be an object"),
        (lambda d: d.update(truncated={"interfaces": "many"}), "topology.truncated.interfaces"),
    ],
)
def test_from_dict_rejects_garbage(local: topo.Topology, mutate, message: str) -> None:
    d = local.to_dict()
    mutate(d)
    with pytest.raises(topo.TopologyError, match=message.replace("[", r"\[").replace("]", r"\]")):
        topo.Topology.from_dict(d)


def test_from_dict_rejects_non_objects_and_oversize() -> None:
    for bad in (None, [], "x", 3):
        with pytest.raises(topo.TopologyError, match="must be an object"):
            topo.Topology.from_dict(bad)
    huge = {"hostname": "h", "truncated": {}, "numa_nodes": [{"id": i, "cpus": list(range(100000, 101000))} for i in range(60)]}
    with pytest.raises(topo.TopologyError, match="exceeds"):
        topo.Topology.from_dict(huge)
    deep: dict = {}
    cur = deep
    for _ in range(100_000):
        cur["x"] = {}
        cur = cur["x"]
    with pytest.raises(topo.TopologyError, match="not JSON-able"):
        topo.Topology.from_dict({"gpus": [deep]})
    assert issubclass(topo.TopologyError, ValueError)  # the handshake maps ValueError to ProtocolError


def test_from_dict_fills_defaults_for_missing_fields() -> None:
    t = topo.Topology.from_dict({"hostname": "peer"})
    assert t.hostname == "peer" and t.interfaces == () and t.memlock_soft == -1


def test_numa_node_of_a_faulted_buffer(local: topo.Topology) -> None:
    view, mm = allocate_host(1 << 20, 4096)  # MAP_POPULATE: pages are faulted in
    node = topo.numa_node_of(buffer_address(view))
    if local.numa_nodes:
        assert node in {n.id for n in local.numa_nodes}
    else:
        assert node is None
    view.release()
    mm.close()


def test_numa_node_of_unfaulted_or_bad_address_is_unknown() -> None:
    mm = mmap.mmap(-1, 1 << 20)  # never touched: no page yet
    addr = ctypes.addressof(ctypes.c_char.from_buffer(mm))
    assert topo.numa_node_of(addr) is None
    assert topo.numa_node_of(0) is None
    assert topo.numa_node_of(-4096) is None
    del addr
    mm.close()


def test_parse_cpulist() -> None:
    assert topo.parse_cpulist("0-3,8,10-11") == (0, 1, 2, 3, 8, 10, 11)
    assert topo.parse_cpulist("") == ()
    assert topo.parse_cpulist("x,2,5-3") == (2,)


def test_rdma_and_gpu_parsing_on_a_sysfs_shaped_tree(tmp_path) -> None:
    """No RDMA NIC or GPU here: the parsers read a tree laid out like sysfs."""
    ib = tmp_path / "infiniband" / "mlx5_0"
    (ib / "device").mkdir(parents=True)
    (ib / "device" / "numa_node").write_text("1\n")
    port = ib / "ports" / "1"
    port.mkdir(parents=True)
    (port / "state").write_text("4: ACTIVE\n")
    (port / "link_layer").write_text("Ethernet\n")
    (port / "rate").write_text("100 Gb/sec (4X EDR)\n")
    devs = topo.discover_rdma(str(tmp_path / "infiniband"))
    assert devs == (topo.RdmaDevice("mlx5_0", 1, (topo.RdmaPort(1, "ACTIVE", "Ethernet", "100 Gb/sec (4X EDR)"),)),)
    assert devs[0].active
    pci = tmp_path / "pci"
    gpu = pci / "0000:3b:00.0"
    gpu.mkdir(parents=True)
    (gpu / "class").write_text("0x030200\n")
    (gpu / "vendor").write_text("0x10de\n")
    (gpu / "numa_node").write_text("0\n")
    vga = pci / "0000:00:02.0"
    vga.mkdir()
    (vga / "class").write_text("0x030000\n")
    (vga / "vendor").write_text("0x1234\n")  # QEMU's emulated VGA: not a GPU
    assert topo.discover_gpus(str(pci)) == (topo.Gpu("0000:3b:00.0", "nvidia", 0),)
    t = topo.Topology(rdma_devices=devs)
    assert t.has_rdma and t.nearest_node() == 1
