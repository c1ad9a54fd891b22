"""The logic around the verbs calls, on the simulated adapter (``fake_verbs``) between two real engines:
max_msg_sz exchange, linked work-request lists, local-only registration, option and peer checks,
limits reported as 0, async events, and the unconfirmed fence (issue 8, item 14)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from fake_verbs import FABRIC, FakeDevice

from mpcomm import Availability, Engine, TransferTimeout, hookimpl
from mpcomm.errors import ConfigError, MpcommError, PeerConnectionError, ProtocolError, TransferError
from mpcomm.plugins.rdma_zerocopy import checks
from mpcomm.plugins.rdma_zerocopy.transport import RdmaZeroCopyTransport


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


def _engine(**plugin_opts: Any) -> Engine:
    cfg = {"plugins": {"rdma_fake": {"poll_spin_us": 0, **plugin_opts}}, "runtime": {"abort_grace_ms": 2000}}
    return Engine(cfg, transports=["rdma_fake"], plugins=[FakePlugin()], autoload=False)


def _t(engine: Engine) -> FakeRdma:
    return engine.transports["rdma_fake"]  # type: ignore[return-value]


@pytest.fixture(autouse=True)
def _reset(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(FakeDevice, "delay", 0.0)
    monkeypatch.setattr(FakeDevice, "max_msg_sz", 1 << 30)
    monkeypatch.setattr(FakeDevice, "port_up", True)


@pytest.fixture
def pair() -> Iterator[tuple[Engine, Engine]]:
    target, init = _engine(), _engine()
    try:
        yield target, init
    finally:
        init.close()
        target.close()


# -- 8. max_msg_sz is exchanged ----------------------------------------------------------


def test_work_requests_are_sliced_to_the_smaller_max_msg_sz(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(FakeDevice, "max_msg_sz", 4096)
    target = _engine()  # its port takes at most 4 KiB per message
    monkeypatch.setattr(FakeDevice, "max_msg_sz", 1 << 30)
    init = _engine()
    try:
        region = target.allocate(1 << 20, "kv")
        remote = init.open(target.address, "kv")
        payload = bytes(range(256)) * 64  # 16 KiB
        assert init.write(payload, remote).result(5) == len(payload)
        assert bytes(region.view[: len(payload)]) == payload
        dev = _t(init).dev
        assert [w.length for w in dev.executed] == [4096] * 4
        # Without the exchange the fake responder refuses (IBV_WC_REM_INV_REQ_ERR), like a real one.
    finally:
        init.close()
        target.close()


# -- linked lists signalling the last ----------------------------------------------------------


def test_one_request_in_chunks_is_one_list_signalling_its_last(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(FakeDevice, "max_msg_sz", 4096)
    with _engine() as target, _engine() as init:
        target.allocate(1 << 20, "kv")
        remote = init.open(target.address, "kv")
        assert init.write(b"\x01" * 16384, remote).result(5) == 16384
        calls = _t(init).dev.post_calls
        assert [[s for _, s in c] for c in calls] == [[False, False, False, True]]
        # only one completion was generated, and it completed all four
        assert _t(init)._cq_free == _t(init).dev.cq_depth


def test_lone_requests_queued_together_each_signal(monkeypatch: pytest.MonkeyPatch) -> None:
    with _engine(sq_depth=64) as target, _engine(sq_depth=64) as init:
        region = target.allocate(1 << 16, "kv")
        remote = init.open(target.address, "kv")
        tr = _t(target)
        orig = tr.handle_control

        def slow_connect(peer: Any, body: dict[str, Any]) -> dict[str, Any]:
            if body.get("op") == "connect":
                time.sleep(0.3)  # every request below is queued before the QP exists
            return orig(peer, body)

        tr.handle_control = slow_connect  # type: ignore[method-assign]
        ts = [init.write(bytes([i]) * 100, remote, i * 100) for i in range(20)]
        assert all(t.result(10) == 100 for t in ts)
        assert all(region.view[i * 100] == i for i in range(20))
        calls = _t(init).dev.post_calls
        assert [[s for _, s in c] for c in calls] == [[True] * 20]  # one list; a lone request's WR is signaled


class _Group:
    """The engine side of ``OperationGroup`` as INTERFACE.md specifies it, for this branch's engine
    (which predates it): ``member(i)`` gives request i as an object with the Operation attributes
    the transport uses; reports are recorded per index."""

    def __init__(self, kind: str, local: Any, remote: Any, peer: Any, offs: list[int], roffs: list[int],
                 lens: list[int], timeout: float = 5.0) -> None:
        self.kind, self.local, self.remote, self.peer = kind, local, remote, peer
        self.local_offsets, self.remote_offsets, self.lengths = offs, roffs, lens
        self.count = len(lens)
        self.deadline = time.monotonic() + timeout
        self.abort_exc: BaseException | None = None
        self.state: Any = None
        self._members: list[Any] | None = None
        self.results: dict[int, Any] = {}
        self.all_done = threading.Event()

    def members(self) -> list[Any]:
        if self._members is None:
            self._members = [self.member(i) for i in range(self.count)]
        return self._members

    def member(self, i: int) -> Any:
        group = self

        class Member:
            kind, local, remote, peer = group.kind, group.local, group.remote, group.peer
            local_offset, remote_offset, length = group.local_offsets[i], group.remote_offsets[i], group.lengths[i]
            deadline = group.deadline
            abort_exc = None
            state = None
            before_complete = None

            @property
            def aborted(self) -> bool:
                return self.abort_exc is not None

            def complete(self, n: int | None = None) -> None:
                group._report(i, self.length if n is None else n)

            def fail(self, exc: BaseException) -> None:
                group._report(i, self.abort_exc or exc)

        return Member()

    def _report(self, i: int, what: Any) -> None:
        assert i not in self.results, f"index {i} reported twice"
        self.results[i] = what
        if len(self.results) == self.count:
            self.all_done.set()


def _group_class() -> Any:
    try:
        from mpcomm.transport import OperationGroup  # the engine's own, once merged

        return OperationGroup
    except ImportError:
        return None


def test_post_many_is_one_list_signalling_the_last(pair: tuple[Engine, Engine]) -> None:
    target, init = pair
    region = target.allocate(1 << 20, "kv")
    remote = init.open(target.address, "kv")
    assert init.write(b"warm", remote).result(5) == 4  # connects; gives us the peer
    tr = _t(init)
    peer = next(iter(tr._links.values())).peer
    src = init.allocate(1 << 16)
    src.view[:] = bytes(range(256)) * 256
    n = 32
    group = _Group("write", src, remote, peer, [i * 1024 for i in range(n)], [8192 + i * 2048 for i in range(n)],
                   [1024] * n)
    tr.dev.post_calls.clear()
    tr.post_many(group)
    assert group.all_done.wait(5), group.results
    assert all(group.results[i] == 1024 for i in range(n))
    for i in range(n):
        assert bytes(region.view[8192 + i * 2048 : 8192 + i * 2048 + 1024]) == bytes(src.view[i * 1024 : (i + 1) * 1024])
    assert [[s for _, s in c] for c in tr.dev.post_calls] == [[False] * (n - 1) + [True]]


def test_post_many_error_fails_the_bad_index_and_flushes_the_rest_to_a_repost(pair: tuple[Engine, Engine]) -> None:
    target, init = pair
    region = target.allocate(1 << 16, "kv")
    remote = init.open(target.address, "kv")
    assert init.write(b"warm", remote).result(5) == 4
    tr = _t(init)
    peer = next(iter(tr._links.values())).peer
    src = init.allocate(1 << 16)
    src.view[:] = b"\x42" * (1 << 16)
    # index 2 points outside the target's registration: the adapter refuses it (REM_ACCESS_ERR)
    roffs = [0, 1000, (1 << 16) - 10, 3000]
    group = _Group("write", src, remote, peer, [0, 0, 0, 0], roffs, [100, 100, 100, 100])
    tr.post_many(group)
    assert group.all_done.wait(5), group.results
    assert group.results[0] == 100 and group.results[1] == 100
    assert isinstance(group.results[2], MpcommError) and "IBV_WC_REM_ACCESS_ERR" in str(group.results[2])
    assert group.results[3] == 100  # flushed behind the error, reposted on a new QP
    assert bytes(region.view[3000:3100]) == b"\x42" * 100


@pytest.mark.skipif(_group_class() is None, reason="this branch's engine predates OperationGroup (INTERFACE.md)")
def test_post_many_with_the_engines_operation_group(pair: tuple[Engine, Engine]) -> None:
    target, init = pair
    region = target.allocate(1 << 20, "kv")
    remote = init.open(target.address, "kv")
    assert init.write(b"warm", remote).result(5) == 4
    tr = _t(init)
    peer = next(iter(tr._links.values())).peer
    src = init.allocate(1 << 16)
    src.view[:] = b"\x07" * (1 << 16)
    finished = threading.Event()
    group = _group_class()("write", src, remote, [0] * 8, [i * 100 for i in range(8)], [100] * 8,
                           time.monotonic() + 5, time.time() + 5, peer, sink=lambda g: finished.set())
    group.transport = tr
    tr.post_many(group)
    assert finished.wait(5) and not group.errors
    assert bytes(region.view[:800]) == b"\x07" * 800


# -- 8. per-request buffers get no remote rights ----------------------------------------------------


def _spy_reg_mr(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, bool]]:
    seen: list[tuple[int, bool]] = []
    real = FakeDevice.reg_mr

    def spy(self: FakeDevice, addr: int, length: int, access: str, remote: bool = True) -> Any:
        seen.append((length, remote))
        return real(self, addr, length, access, remote)

    monkeypatch.setattr(FakeDevice, "reg_mr", spy)
    return seen


def test_request_buffers_are_registered_without_remote_access(monkeypatch: pytest.MonkeyPatch) -> None:
    with _engine(staging_bytes=0) as target, _engine(staging_bytes=0) as init:
        region = target.allocate(1 << 16, "kv")
        remote = init.open(target.address, "kv")
        published = init.allocate(4096, "mine")
        assert init.regions()[0].transport_info["rdma_fake"].keys() == {"rkey", "addr", "length"}
        assert _t(init)._mrs[published.id].remote is True
        seen = _spy_reg_mr(monkeypatch)
        assert init.write(bytearray(b"e" * 100), remote).result(5) == 100  # a buffer for this request only
        assert seen == [(100, False)]
        assert bytes(region.view[:100]) == b"e" * 100


def test_small_request_buffers_go_through_the_staging_slab(pair: tuple[Engine, Engine],
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    target, init = pair
    region = target.allocate(1 << 20, "kv")
    remote = init.open(target.address, "kv")
    staging = _t(init)._staging
    assert staging is not None and staging.free == 64 and staging.mr.remote is False
    seen = _spy_reg_mr(monkeypatch)
    assert init.write(b"w" * 5000, remote, 10).result(5) == 5000  # copied into a slot: no ibv_reg_mr
    assert bytes(region.view[10:5010]) == b"w" * 5000
    region.view[100:200] = b"r" * 100
    dst = bytearray(100)
    assert init.read(dst, remote, 100).result(5) == 100  # lands in a slot, copied out before completing
    assert dst == b"r" * 100
    assert seen == [] and staging.free == 64  # every slot is back
    big = bytearray(b"B" * (128 << 10))  # above staging_slot: registered (local access only)
    assert init.write(big, remote).result(5) == len(big)
    assert seen == [(128 << 10, False)]


def test_staging_slots_run_out_and_come_back(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(FakeDevice, "delay", 0.02)
    with _engine() as target, _engine(staging_bytes=4 * 4096, staging_slot=4096) as init:
        region = target.allocate(1 << 16, "kv")
        remote = init.open(target.address, "kv")
        seen = _spy_reg_mr(monkeypatch)
        ts = [init.write(bytes([i]) * 1000, remote, i * 1000) for i in range(10)]  # 4 slots for 10 requests
        assert all(t.result(10) == 1000 for t in ts)
        assert all(region.view[i * 1000] == i for i in range(10))
        assert len(seen) >= 6 and all(not remote for _, remote in seen)  # the rest registered, local-only
        assert _t(init)._staging.free == 4


def test_a_slot_is_not_reused_before_its_request_flushed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(FakeDevice, "delay", 0.3)
    with _engine() as target, _engine(staging_bytes=4096, staging_slot=4096) as init:
        target.allocate(1 << 16, "kv")
        remote = init.open(target.address, "kv")
        t = init.write(b"\x01" * 1000, remote, timeout=30)
        time.sleep(0.05)
        assert _t(init)._staging.free == 0
        assert t.cancel(timeout=5) is True
        assert _t(init)._staging.free == 1  # given back with the (flushed) request, not before


# -- 8. option ranges, peer input, limits of 0 ----------------------------------------------------------


@pytest.mark.parametrize(("key", "value", "msg"), [
    ("ack_timeout", 40, "ack_timeout = 40 is outside [1, 31]"),
    ("ack_timeout", 0, "0 would mean 'never time out'"),
    ("retry_count", 8, "retry_count = 8 is outside [0, 7] (a 3-bit counter)"),
    ("service_level", 16, "service_level = 16 is outside [0, 15]"),
    ("traffic_class", -1, "traffic_class = -1 is outside [0, 255]"),
    ("sq_depth", 0, "sq_depth = 0 is outside [1,"),
    ("chunk", 1 << 32, "InfiniBand allows at most 2 GiB"),
    ("retry_count", "seven", "must be an integer in [0, 7]"),
])
def test_bad_options_are_config_errors(key: str, value: Any, msg: str) -> None:
    opts = dict(RdmaZeroCopyTransport.default_options, **{key: value})
    with pytest.raises(ConfigError) as info:
        checks.check_options(opts, "rdma_zerocopy")
    assert msg in str(info.value) and f"plugins.rdma_zerocopy.{key}" in str(info.value)


def test_engine_with_a_bad_option_says_why() -> None:
    from mpcomm import TransportUnavailable

    with pytest.raises((TransportUnavailable, ConfigError), match=r"ack_timeout = 99 is outside \[1, 31\]"):
        _engine(ack_timeout=99)


def test_limits_reported_as_zero(monkeypatch: pytest.MonkeyPatch) -> None:
    assert checks.device_cap(256, 0) == 256 and checks.device_cap(256, 16) == 16
    assert checks.rd_atomic(0, 0) == 1 and checks.rd_atomic(0, 8) == 8 and checks.rd_atomic(4, 8) == 4
    assert checks.wr_bytes(0, 0, 0) == 1 << 30 and checks.wr_bytes(0, 0, 4096) == 4096
    assert checks.wr_bytes(65536, 1 << 31, 0) == 65536
    monkeypatch.setattr(FakeDevice, "max_msg_sz", 0)
    real_init = FakeDevice.__init__

    def zero_limits(self: FakeDevice, *a: Any, **kw: Any) -> None:
        real_init(self, *a, **kw)
        self.max_qp_wr = 0

    monkeypatch.setattr(FakeDevice, "__init__", zero_limits)
    with _engine(sq_depth=16) as target, _engine(sq_depth=16) as init:
        assert _t(init)._sq_depth == 16 and _t(init)._local_wr_bytes == 1 << 30
        region = target.allocate(1 << 16, "kv")
        remote = init.open(target.address, "kv")
        assert init.write(b"z" * 5000, remote).result(5) == 5000
        assert bytes(region.view[:5000]) == b"z" * 5000


@pytest.mark.parametrize(("patch", "msg"), [
    ({"qpn": 1 << 24}, "qpn must be an integer in [1, 16777215]"),
    ({"psn": -1}, "psn must be"),
    ({"mtu": 9}, "mtu must be"),
    ({"gid": "not-a-gid"}, "is not a GID"),
    ({"link_layer": "Ethernet"}, "link layer is 'Ethernet'"),
    ({"qpn": "12"}, "qpn must be an integer"),
    ({"max_msg_sz": True}, "max_msg_sz must be an integer"),
])
def test_garbage_connect_requests_are_refused_before_any_verbs_call(pair: tuple[Engine, Engine],
                                                                    patch: dict[str, Any], msg: str) -> None:
    target, _init = pair
    tr = _t(target)
    good = {"op": "connect", "conn": 1, "qpn": 5, "psn": 7, "lid": 3, "gid": "fe80::1", "mtu": 5,
            "link_layer": "InfiniBand", "rd_atom": 16, "init_rd_atom": 16, "max_msg_sz": 4096}
    before = len(FABRIC.qps)
    with pytest.raises(ProtocolError, match=msg.replace("[", r"\[").replace("]", r"\]").replace("(", r"\(")):
        tr.handle_control(None, {**good, **patch})
    assert len(FABRIC.qps) == before  # no QP was created for it
    reply = tr.handle_control(None, good)
    assert checks.check_peer_info(reply, "InfiniBand")["qpn"] == reply["qpn"]


# -- 8. async events ------------------------------------------------------------------------------------


def test_device_fatal_fails_in_flight_requests_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(FakeDevice, "delay", 30.0)  # would never finish on its own within the test
    with _engine() as target, _engine() as init:
        target.allocate(1 << 16, "kv")
        remote = init.open(target.address, "kv")
        t = init.write(b"q" * 100, remote, timeout=60)
        time.sleep(0.2)
        _t(init).dev.inject_async("IBV_EVENT_DEVICE_FATAL")
        with pytest.raises(TransferError, match="fatal error"):
            t.result(5)
        assert _t(init).async_events["IBV_EVENT_DEVICE_FATAL"] == 1
        with pytest.raises(MpcommError):
            init.write(b"r", remote).result(5)


def test_port_down_fails_requests_and_recovers_when_active(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(FakeDevice, "delay", 1.0)
    with _engine() as target, _engine() as init:
        region = target.allocate(1 << 16, "kv")
        remote = init.open(target.address, "kv")
        t = init.write(b"q" * 100, remote, timeout=30)
        time.sleep(0.2)
        monkeypatch.setattr(FakeDevice, "port_up", False)
        _t(init).dev.inject_async("IBV_EVENT_PORT_ERR")
        with pytest.raises(PeerConnectionError, match="is down"):
            t.result(5)
        with pytest.raises(PeerConnectionError, match="is down"):
            init.write(b"r", remote).result(5)
        monkeypatch.setattr(FakeDevice, "port_up", True)
        monkeypatch.setattr(FakeDevice, "delay", 0.0)
        _t(init).dev.inject_async("IBV_EVENT_PORT_ACTIVE")
        deadline = time.monotonic() + 5
        while _t(init)._down and time.monotonic() < deadline:
            time.sleep(0.01)
        assert init.write(b"ok", remote, 500).result(5) == 2
        assert bytes(region.view[500:502]) == b"ok"


def test_qp_error_events_are_read_and_counted(pair: tuple[Engine, Engine]) -> None:
    _target, init = pair
    _t(init).dev.inject_async("IBV_EVENT_QP_FATAL", "IBV_EVENT_COMM_EST")
    deadline = time.monotonic() + 5
    while sum(_t(init).async_events.values()) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert _t(init).async_events == {"IBV_EVENT_QP_FATAL": 1, "IBV_EVENT_COMM_EST": 1}
    assert _t(init).dev.async_queue == []


# -- issue 8, item 14: a failed fence is not a confirmed timeout ------------------------------------------


def _flaky_retire(engine: Engine) -> None:
    tr = _t(engine)
    orig = tr.handle_control

    def flaky(peer: Any, body: dict[str, Any]) -> dict[str, Any]:
        if body.get("op") == "retire":
            raise TransferError("control path hiccup")
        return orig(peer, body)

    tr.handle_control = flaky  # type: ignore[method-assign]


def test_failed_fence_reports_an_unconfirmed_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(FakeDevice, "delay", 1.0)
    with _engine() as target, _engine() as init:
        target.allocate(1 << 20, "kv")
        remote = init.open(target.address, "kv")
        _flaky_retire(target)
        t = init.write(init.allocate(1 << 20), remote, 0, 4096, timeout=0.3)
        with pytest.raises(TransferTimeout) as info:
            t.result(10)
        err = info.value
        assert err.confirmed is False
        assert "did not confirm that its queue pair stopped" in str(err) and "may still land" in str(err)
        assert isinstance(err.__cause__, TransferError) and "control path hiccup" in str(err.__cause__)
        assert t.status.value == "timed_out"


def test_confirmed_fence_reports_a_confirmed_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(FakeDevice, "delay", 1.0)
    with _engine() as target, _engine() as init:
        target.allocate(1 << 20, "kv")
        remote = init.open(target.address, "kv")
        t = init.write(init.allocate(1 << 20), remote, 0, 4096, timeout=0.3)
        with pytest.raises(TransferTimeout) as info:
            t.result(10)
        assert info.value.confirmed is True
        assert not _t(target)._passive  # the target retired its QP


def test_failed_fence_on_cancel_is_not_a_clean_cancel(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(FakeDevice, "delay", 1.0)
    with _engine() as target, _engine() as init:
        target.allocate(1 << 20, "kv")
        remote = init.open(target.address, "kv")
        _flaky_retire(target)
        t = init.write(init.allocate(1 << 20), remote, 0, 4096, timeout=30)
        time.sleep(0.2)
        assert t.cancel(timeout=10) is False  # the transport cannot promise nothing lands
        with pytest.raises(TransferError) as info:
            t.result(1)
        assert info.value.confirmed is False and "was cancelled, but" in str(info.value)


def test_adapters_on_this_process_numa_node_are_tried_first(tmp_path: Any) -> None:
    """With ``device`` unset, probe() tries the NIC on the socket we run on before the others."""
    from mpcomm.plugins.rdma_zerocopy import verbs

    for name, node in (("mlx5_0", "1"), ("mlx5_1", "0"), ("mlx5_2", "-1")):
        (tmp_path / name / "device").mkdir(parents=True)
        (tmp_path / name / "device" / "numa_node").write_text(node + "\n")
    names = ["mlx5_0", "mlx5_1", "mlx5_2"]

    def numa_of(n: str) -> int:
        return verbs._device_numa_node(n, str(tmp_path))

    assert numa_of("mlx5_0") == 1 and numa_of("missing") == -1
    assert verbs.nearest_first(names, numa_of, frozenset({0})) == [1, 0, 2]
    assert verbs.nearest_first(names, numa_of, frozenset({1})) == [0, 1, 2]
    assert verbs.nearest_first(names, numa_of, frozenset()) == [0, 1, 2]  # single-node host: as listed
    from mpcomm.topology import discover_numa

    here = verbs._local_nodes()  # this host's real sysfs
    if len(discover_numa()) < 2:
        assert here == frozenset()  # nothing to prefer
    else:
        assert here and here <= {n.id for n in discover_numa()}
