"""What the real pyverbs (Debian rdma-core 44 here) does to us without a device: logging, the WR leak,
error text, device filtering, the polling fallback, and the version string.

These use the installed pyverbs wherever it loads; objects that need no device (SGE, SendWR,
exceptions) are the real classes. Tests that need pyverbs skip with the loader's reason.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
import types
from typing import Any

import pytest

from mpcomm.plugins.rdma_zerocopy import verbs
from mpcomm.plugins.rdma_zerocopy.verbs import WorkRequest, error_text, judge_device, judge_port, one_new_fd


def _need_pyverbs() -> None:
    try:
        verbs.load_pyverbs()
    except verbs.PyverbsMissing as exc:
        pytest.skip(f"pyverbs not loadable here: {exc}")


def _run(code: str, timeout: float = 120) -> str:
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                         timeout=timeout)
    assert out.returncode == 0, out.stderr + out.stdout
    return out.stdout.strip()


# -- 2. logging -------------------------------------------------------------------------


def test_loading_pyverbs_leaves_root_logging_alone() -> None:
    _need_pyverbs()
    got = _run("""
        import logging
        root = logging.getLogger()
        before = (list(root.handlers), root.level)
        from mpcomm.plugins.rdma_zerocopy import verbs
        verbs.load_pyverbs()
        import pyverbs.base, pyverbs.qp, pyverbs.wr, pyverbs.mr  # later imports are no-ops
        assert (list(root.handlers), root.level) == before, (root.handlers, root.level, before)
        # and an application's own configuration survives too
        print("ok", len(before[0]), before[1])
    """)
    assert got == "ok 0 30"  # no handler, WARNING: exactly as an unconfigured application has it


def test_loading_pyverbs_keeps_an_applications_handler_and_level() -> None:
    _need_pyverbs()
    got = _run("""
        import logging, io
        buf = io.StringIO()
        logging.basicConfig(stream=buf, level=logging.ERROR, format="%(message)s")
        root = logging.getLogger()
        before = (list(root.handlers), root.level)
        from mpcomm.plugins.rdma_zerocopy import verbs
        verbs.load_pyverbs()
        assert (list(root.handlers), root.level) == before
        logging.getLogger("x").warning("hidden")
        print("ok", repr(buf.getvalue()))
    """)
    assert got == "ok ''"


def test_bare_pyverbs_import_does_reconfigure_logging() -> None:
    """The reason for the guard: importing pyverbs' base module itself adds a root handler at INFO."""
    _need_pyverbs()
    got = _run("""
        import logging
        from mpcomm.plugins.rdma_zerocopy import verbs
        root = logging.getLogger()
        verbs._load_locked()  # the same import, without keep_root_logging()
        print(len(root.handlers), root.level)
    """)
    assert got == "1 20", got


# -- 1. the SGE/SendWR leak ------------------------------------------------------------------

RSS_CODE = """
import gc, os, sys
from mpcomm.plugins.rdma_zerocopy import verbs
verbs.load_pyverbs()
import pyverbs.enums as e
from pyverbs.wr import SGE, SendWR
N = int(sys.argv[1])
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
def fresh(i):  # what verbs.QueuePair.post used to do per post
    sge = SGE(0x10000 + i, 4096, 7)
    w = SendWR(wr_id=i, opcode=e.IBV_WR_RDMA_WRITE, num_sge=1, sg=[sge], send_flags=e.IBV_SEND_SIGNALED)
    w.set_wr_rdma(9, 0x20000 + i)
slot = verbs._WrSlot()
def reuse(i):  # what it does now
    slot.fill(verbs.WorkRequest(i, "write" if i & 1 else "read", 0x10000 + i, 4096, 7, 0x20000 + i, 9, bool(i & 2)))
class Q:  # post_send needs a device; the chain's own work is what is measured
    def post_send(self, wr, bad=None):
        pass
chain, q = verbs._Chain(), Q()
def chained(i):  # a list of four through one QP's chain, as QueuePair.post_list does
    chain.post(q, [verbs.WorkRequest(4 * i + k, "write", 0x10000 + k, 4096, 7, 0x20000 + i, 9, k == 3)
                   for k in range(4)])
out = []
for f in (reuse, chained, fresh):
    for i in range(5000):
        f(i)
    gc.collect()
    a = rss()
    for i in range(N):
        f(i)
    gc.collect()
    out.append((rss() - a) / N)
broken = "__dealloc" in SendWR.__dict__
print(out[0], out[1], out[2], broken)
"""


def test_rss_is_flat_when_work_requests_are_reused() -> None:
    _need_pyverbs()
    n = 200_000
    reuse, chained, fresh, broken = _run(f"import sys; sys.argv = ['x', '{n}']\n" + RSS_CODE, timeout=300).split()
    reuse_b, chained_b, fresh_b = float(reuse), float(chained), float(fresh)
    # The reuse path must not grow: < 0.05 bytes per post is < 10 KiB over 200k posts (page noise).
    assert reuse_b < 0.05, f"reusing one SGE/SendWR grew RSS by {reuse_b:.2f} bytes per post"
    assert chained_b < 0.05, f"posting lists through a chain grew RSS by {chained_b:.2f} bytes per post"
    if broken == "True":  # pyverbs 44: the destructor is misspelled, every fresh pair leaks its buffers
        assert fresh_b > 32, f"expected the known leak of a fresh SGE+SendWR per post, measured {fresh_b:.1f} B"


def test_slot_fill_writes_every_field() -> None:
    _need_pyverbs()
    import pyverbs.enums as e

    slot = verbs._WrSlot()
    swr = slot.fill(WorkRequest(77, "read", 0xABC000, 12345, 0x11, 0xDEF000, 0x22, signaled=False))
    assert (slot.sge.addr, slot.sge.length, slot.sge.lkey) == (0xABC000, 12345, 0x11)
    assert swr.wr_id == 77 and swr.opcode == e.IBV_WR_RDMA_READ and swr.send_flags == 0
    swr = slot.fill(WorkRequest(78, "write", 0x1000, 1, 0x33, 0x2000, 0x44))
    assert swr.wr_id == 78 and swr.opcode == e.IBV_WR_RDMA_WRITE and swr.send_flags == e.IBV_SEND_SIGNALED
    assert slot.sge.lkey == 0x33
    pointer = getattr(type(swr), "sg_list", None)
    if pointer is not None and getattr(pointer, "__get__", None) is not None:
        try:
            addr = swr.sg_list  # newer pyverbs has a getter: the SendWR reads the SGE's own struct
        except AttributeError:
            return
        import ctypes

        assert ctypes.c_uint64.from_address(addr).value == 0x1000


def test_slots_are_pooled_not_recreated() -> None:
    _need_pyverbs()
    a = verbs._SLOTS.take()
    verbs._SLOTS.give(a)
    created = verbs._SLOTS.created
    b = verbs._SLOTS.take()
    assert b is a and verbs._SLOTS.created == created  # a closed QP's chain serves the next QP
    verbs._SLOTS.give(b)


# -- 4. error text --------------------------------------------------------------------------


def test_error_text_with_pyverbs_exceptions() -> None:
    _need_pyverbs()
    from pyverbs.pyverbs_error import PyverbsError, PyverbsRDMAError, PyverbsUserError

    text, code = error_text("ibv_get_async_event", PyverbsRDMAError("Failed to get async event"))  # code -1
    assert code == 0 and "Operation not permitted" not in text
    assert text == "ibv_get_async_event: Failed to get async event"
    text, code = error_text("ibv_post_send", PyverbsRDMAError("Failed to post send", 22))
    assert code == 22 and text.count("Invalid argument") == 1, text
    text, code = error_text("x", PyverbsRDMAError("Failed", -12))  # a -errno return
    assert code == 12 and text.count("Cannot allocate memory") == 1, text
    text, code = error_text("open", PyverbsUserError("no such device"))
    assert (text, code) == ("open: no such device", 0)
    assert error_text("y", PyverbsError("plain"))[1] == 0


def test_verbs_context_raises_verbs_error() -> None:
    _need_pyverbs()
    from pyverbs.pyverbs_error import PyverbsRDMAError

    with pytest.raises(verbs.VerbsError) as info:
        with verbs._verbs("ibv_reg_mr of 4096 bytes"):
            raise PyverbsRDMAError("Failed to register a MR", 14)
    assert info.value.errno == 14 and str(info.value).count("Bad address") == 1
    assert isinstance(info.value.__cause__, PyverbsRDMAError)


# -- 3. device filtering ------------------------------------------------------------------------


def test_judging_devices_and_ports() -> None:
    assert judge_device(0) == ""
    assert "rdma_cm" in judge_device(1)
    assert "EFA" in judge_device(4)
    assert judge_device(99).startswith("transport type 99")
    assert judge_port(4, 1) == "" and judge_port(4, 2) == ""
    assert judge_port(1, 1) == "not ACTIVE"
    assert "neither InfiniBand nor Ethernet" in judge_port(4, 0)


def test_probe_names_every_skipped_device(monkeypatch: pytest.MonkeyPatch) -> None:
    _need_pyverbs()
    devs = [types.SimpleNamespace(name=b"efa_0", transport_type=4),
            types.SimpleNamespace(name=b"iwp3s0", transport_type=1),
            types.SimpleNamespace(name=b"mlx5_9", transport_type=0)]
    monkeypatch.setattr(verbs, "list_devices", lambda: devs)
    found = verbs.probe()
    assert not found.ok
    assert "efa_0 skipped: transport type unspecified (EFA" in found.reason
    assert "iwp3s0 skipped: iWARP: it connects through rdma_cm" in found.reason
    assert "mlx5_9 skipped: cannot be opened" in found.reason  # no such device on this machine
    assert len(found.skipped) == 3


# -- 5./6. completion waiting -----------------------------------------------------------------


class _RecordingCQ:
    def __init__(self) -> None:
        self.armed = 0

    def req_notify(self) -> None:
        self.armed += 1


def _bare_device(event_fd: int | None) -> verbs.Device:
    dev = object.__new__(verbs.Device)
    dev.event_fd, dev.async_fd, dev._idle_sleep = event_fd, None, 0.0
    dev._wake_r, dev._wake_w = os.pipe()
    os.set_blocking(dev._wake_r, False)
    dev.cq = _RecordingCQ()
    return dev


def test_polling_fallback_never_arms_and_backs_off_at_most_1ms() -> None:
    dev = _bare_device(None)
    try:
        assert dev.arm() is False and dev.cq.armed == 0
        assert not dev.event_mode
        t0 = time.monotonic()
        for _ in range(20):
            assert dev.wait(5.0) is False
        assert time.monotonic() - t0 < 20 * 0.05  # each wait is the capped back-off, not the timeout
        dev.wake()
        dev.wait(5.0)  # the wake-up is consumed
    finally:
        os.close(dev._wake_r)
        os.close(dev._wake_w)


def test_event_mode_arms() -> None:
    r, w = os.pipe()
    dev = _bare_device(r)
    try:
        assert dev.arm() is True and dev.cq.armed == 1
    finally:
        for fd in (r, w, dev._wake_r, dev._wake_w):
            os.close(fd)


def test_new_descriptor_only_when_unambiguous() -> None:
    assert one_new_fd({3, 5}, {3, 5, 9}) == 9
    assert one_new_fd({3, 5}, {3, 5, 9, 10}) is None  # two appeared: someone else opened one
    assert one_new_fd({3, 5}, {3, 9}) is None  # one vanished: its number may be the one that appeared
    assert one_new_fd({3}, {3}) is None
    assert verbs._event_fds() == set() or all(isinstance(x, int) for x in verbs._event_fds())


# -- 9. version ------------------------------------------------------------------------------


def test_rdma_core_version_from_files(tmp_path: "os.PathLike[str]") -> None:
    lib = tmp_path / "lib"
    lib.mkdir()
    (lib / "libibverbs.so.1.14.44.0").write_bytes(b"")
    (lib / "libibverbs.so.1").write_bytes(b"")
    status = tmp_path / "status"
    status.write_text("Package: rdma-core\nStatus: install ok installed\nVersion: 44.0-2\n\n"
                      "Package: python3-pyverbs\nStatus: deinstall ok config-files\nVersion: 43.0-1\n")
    got = verbs.rdma_core_version(lib_dirs=(str(lib),), dpkg_status=str(status))
    if "libibverbs.so.1." in open("/proc/self/maps").read():
        assert got.startswith("rdma-core "), got  # this process mapped the real library: it wins
    else:
        assert got == "rdma-core 44.0 (libibverbs.so.1.14.44.0; rdma-core 44.0-2)", got
    assert verbs.rdma_core_version(lib_dirs=(str(tmp_path / "none"),), dpkg_status=str(tmp_path / "x")) in (
        "", got) or "libibverbs.so.1." in open("/proc/self/maps").read()


def test_transport_version_on_this_machine() -> None:
    from mpcomm.plugins.rdma_zerocopy.transport import RdmaZeroCopyTransport

    v = RdmaZeroCopyTransport.version()
    have = os.path.exists("/var/lib/dpkg/status") and "Package: libibverbs1" in open("/var/lib/dpkg/status").read()
    if not have:
        pytest.skip("libibverbs1 is not installed here")
    assert v.startswith("rdma-core 4") or v.startswith("rdma-core 5") or v.startswith("rdma-core 6"), v


def test_a_list_is_posted_from_the_chain_head_with_the_tail_filled() -> None:
    """The real SendWR/SGE classes; a stand-in for the QP (post_send needs a device)."""
    _need_pyverbs()
    import pyverbs.enums as e

    class QP:
        def __init__(self) -> None:
            self.calls: list[tuple[int, Any]] = []

        def post_send(self, wr: Any, bad: Any = None) -> None:
            self.calls.append((wr.wr_id, bad))

    chain = verbs._Chain()
    qp = QP()
    chain.post(qp, [WorkRequest(1, "write", 0x1000, 10, 5, 0x2000, 6, False)])
    tail = chain.slots[-1]
    chain.post(qp, [WorkRequest(10 + i, "read", 0x1000 * i, 10, 5, 0x2000, 6, i == 2) for i in range(3)])
    assert len(chain.slots) == 3 and chain.slots[-1] is tail  # grew at the head: the NULL-terminated tail stays
    assert [c[0] for c in qp.calls] == [1, 10]
    assert qp.calls[1][1] is chain.bad
    assert [s.swr.wr_id for s in chain.slots] == [10, 11, 12]
    assert [s.swr.send_flags for s in chain.slots] == [0, 0, e.IBV_SEND_SIGNALED]
    assert [s.sge.addr for s in chain.slots] == [0, 0x1000, 0x2000]
    chain.post(qp, [WorkRequest(20, "write", 0x9000, 1, 1, 1, 1)])
    assert qp.calls[-1][0] == 20 and chain.slots[-1].sge.addr == 0x9000


def test_a_failed_list_post_says_how_many_went_out() -> None:
    _need_pyverbs()
    from pyverbs.pyverbs_error import PyverbsRDMAError

    chain = verbs._Chain()

    class QP:
        def post_send(self, wr: Any, bad: Any) -> None:
            bad.wr_id = 12  # what ibv_post_send's bad_wr copy would say
            raise PyverbsRDMAError("Failed to post send", 12)

    with pytest.raises(PyverbsRDMAError) as info:
        chain.post(QP(), [WorkRequest(10 + i, "write", 1, 1, 1, 1, 1) for i in range(4)])
    assert info.value.posted == 2


def test_a_broken_async_descriptor_is_dropped_not_spun_on(caplog: pytest.LogCaptureFixture) -> None:
    r, w = os.pipe()
    dev = _bare_device(r)
    os.close(w)
    os.close(r)
    dev.async_fd = 10_000 + r  # not an open descriptor: select() raises EBADF
    try:
        assert dev.read_async_events() == [] and dev.async_fd is None
        dev.async_fd = 10_001 + r
        dev.event_fd = None
        assert dev.wait(0.01) is False and dev.async_fd is None
        assert "async events are not read" in caplog.text
    finally:
        os.close(dev._wake_r)
        os.close(dev._wake_w)
