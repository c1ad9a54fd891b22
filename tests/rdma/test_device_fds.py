"""How ``verbs.Device`` finds its completion-channel and async-event descriptors (issue 13, item 6).

``Device.__init__`` is the real code; the pyverbs classes it instantiates (Context, PD, CompChannel,
CQ) are replaced by stand-ins that create descriptors the way libibverbs does (one async-event
descriptor per context, one per completion channel), because no provider can be opened here.
The descriptors are real pipes; ``verbs._event_fds`` sees the ones the stand-ins created.
"""

from __future__ import annotations

import os
import threading
import types
from collections.abc import Iterator
from typing import Any

import pytest

from mpcomm.plugins.rdma_zerocopy import verbs

LIVE: set[int] = set()  # descriptors that read as anon_inode:[infinibandevent]
OPEN: list[int] = []  # every pipe end to close after the test


def _anon() -> int:
    r, w = os.pipe()
    OPEN.extend((r, w))
    LIVE.add(r)
    return r


class Context:
    def __init__(self, name: str) -> None:
        assert verbs.ctx_lock._is_owned(), "a context was opened outside verbs.ctx_lock"
        self.name = name
        self.async_fd = _anon()

    def query_device(self) -> Any:
        return types.SimpleNamespace(phys_port_cnt=1, max_qp_wr=1024, max_cqe=4096, max_qp_rd_atom=16,
                                     max_qp_init_rd_atom=16)

    def query_port(self, port: int) -> Any:
        return types.SimpleNamespace(state=4, link_layer=1, lid=7, active_mtu=5, max_msg_sz=1 << 31, gid_tbl_len=1)

    def query_gid(self, port: int, index: int) -> Any:
        return types.SimpleNamespace(gid="fe80:0000:0000:0000:0000:0000:0000:0007")

    def close(self) -> None:
        assert verbs.ctx_lock._is_owned(), "a context was closed outside verbs.ctx_lock"
        LIVE.discard(self.async_fd)


class PD:
    def __init__(self, ctx: Context) -> None:
        pass

    def close(self) -> None:
        pass


class CompChannel:
    """pyverbs 44: no ``fd`` attribute."""

    foreign = False  # another library opens a verbs context at the same moment

    def __init__(self, ctx: Context) -> None:
        assert verbs.ctx_lock._is_owned()
        self._fd = _anon()
        if type(self).foreign:
            _anon()

    def close(self) -> None:
        LIVE.discard(self._fd)


class CompChannelWithFd(CompChannel):
    """Newer pyverbs: ``CompChannel.fd``."""

    @property
    def fd(self) -> int:
        return self._fd


class CQ:
    def __init__(self, ctx: Context, depth: int, cq_ctx: Any, channel: Any, vector: int) -> None:
        self.depth = depth

    def close(self) -> None:
        pass


@pytest.fixture
def stand_ins(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    try:
        verbs.load_pyverbs()
    except verbs.PyverbsMissing as exc:
        pytest.skip(f"pyverbs not loadable here: {exc}")
    import pyverbs.cq
    import pyverbs.device
    import pyverbs.pd

    monkeypatch.setattr(pyverbs.device, "Context", Context)
    monkeypatch.setattr(pyverbs.pd, "PD", PD)
    monkeypatch.setattr(pyverbs.cq, "CQ", CQ)
    monkeypatch.setattr(pyverbs.cq, "CompChannel", CompChannel)
    monkeypatch.setattr(verbs, "probe", lambda device="", port=0: verbs.DeviceProbe(True, "", "sim0", 1, "InfiniBand"))
    monkeypatch.setattr(verbs, "_event_fds", lambda: set(LIVE))
    monkeypatch.setattr(CompChannel, "foreign", False)
    yield
    for fd in OPEN:
        try:
            os.close(fd)
        except OSError:
            pass
    OPEN.clear()
    LIVE.clear()


def test_pyverbs_44_descriptors_found_by_an_unambiguous_snapshot(stand_ins: None) -> None:
    dev = verbs.Device()
    try:
        assert dev.event_mode and dev.event_fd_source == "new descriptor"
        assert dev.event_fd == dev.channel._fd
        assert dev.async_fd == dev.ctx.async_fd and dev.async_fd != dev.event_fd
        assert not os.get_blocking(dev.event_fd) and not os.get_blocking(dev.async_fd)
        assert dev.info()["completion_wait"] == "event" and dev.info()["async_events"] is True
    finally:
        dev.close()


def test_channel_fd_is_used_where_pyverbs_has_it(stand_ins: None, monkeypatch: pytest.MonkeyPatch) -> None:
    import pyverbs.cq

    monkeypatch.setattr(pyverbs.cq, "CompChannel", CompChannelWithFd)
    monkeypatch.setattr(CompChannel, "foreign", True)  # would confuse a snapshot; the exact fd does not care
    dev = verbs.Device()
    try:
        assert dev.event_fd_source == "CompChannel.fd" and dev.event_fd == dev.channel.fd
    finally:
        dev.close()


def test_ambiguous_snapshot_means_polling_not_guessing(stand_ins: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(CompChannel, "foreign", True)
    dev = verbs.Device()
    try:
        assert dev.event_fd is None and not dev.event_mode and dev.event_fd_source == "none"
        assert dev.async_fd is not None  # the context's own snapshot was clean
        assert dev.arm() is False  # and the CQ is never armed in this mode
        assert dev.info()["completion_wait"] == "polling"
    finally:
        dev.close()


def test_concurrent_devices_do_not_swap_descriptors(stand_ins: None) -> None:
    """Devices opened from many threads at once: the lock keeps every snapshot unambiguous."""
    devs: list[verbs.Device] = []
    errors: list[BaseException] = []
    lock = threading.Lock()

    def open_one() -> None:
        try:
            d = verbs.Device()
            with lock:
                devs.append(d)
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=open_one) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    try:
        assert not errors and len(devs) == 8
        for d in devs:
            assert d.event_fd == d.channel._fd and d.async_fd == d.ctx.async_fd
    finally:
        for d in devs:
            d.close()
