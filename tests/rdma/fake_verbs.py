"""A slow, in-process stand-in for the adapter behind ``verbs.Device``.

It behaves like RC verbs where the transport's logic depends on it: work
requests run in order per device, each taking ``delay`` seconds; bytes move
(``ctypes.memmove``) only when a request executes; the target's registration
(rkey, bounds, rights) is checked then, and a violation completes with
IBV_WC_REM_ACCESS_ERR and puts the QP into ERROR; a QP in ERROR (``to_error``
or after an error) completes everything still queued — including the request
being "transmitted" — with IBV_WC_WR_FLUSH_ERR, and moves no byte of them.
Like RC verbs with ``sq_sig_all=0``, a successful work request produces a
completion only when it was signaled; errors and flushes always do.
``post_list`` posts a linked list (``post_calls`` counts the calls).
Async events are injected with :meth:`FakeDevice.inject_async`.
Slow on purpose, so cancellation has something to cancel.
"""

from __future__ import annotations

import ctypes
import itertools
import random
import threading
from collections import deque
from typing import Any, ClassVar

from mpcomm.plugins.rdma_zerocopy.status import WC_STATUS
from mpcomm.plugins.rdma_zerocopy.verbs import VerbsError, WorkRequest

SUCCESS = WC_STATUS["IBV_WC_SUCCESS"]
FLUSH = WC_STATUS["IBV_WC_WR_FLUSH_ERR"]
REM_ACCESS = WC_STATUS["IBV_WC_REM_ACCESS_ERR"]
RETRY_EXC = WC_STATUS["IBV_WC_RETRY_EXC_ERR"]
LOC_LEN = WC_STATUS["IBV_WC_LOC_LEN_ERR"]
REM_INV_REQ = WC_STATUS["IBV_WC_REM_INV_REQ_ERR"]


class Fabric:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.mrs: dict[int, FakeMR] = {}
        self.qps: dict[int, FakeQP] = {}
        self.qpns = itertools.count(100)


FABRIC = Fabric()


class FakeMR:
    def __init__(self, addr: int, length: int, access: str, remote: bool = True) -> None:
        self.addr, self.length, self.access, self.remote = addr, length, access, remote
        with FABRIC.lock:
            while True:
                self.rkey = random.getrandbits(32)
                if self.rkey not in FABRIC.mrs:
                    break
            FABRIC.mrs[self.rkey] = self
        self.lkey = self.rkey

    def close(self) -> None:
        with FABRIC.lock:
            FABRIC.mrs.pop(self.rkey, None)


class FakeQP:
    def __init__(self, dev: FakeDevice, sq_depth: int) -> None:
        self.dev = dev
        self.sq_depth = sq_depth
        self.state = "reset"
        self.remote_qpn: int | None = None
        self.remote_max_msg = 0
        self.psn = random.getrandbits(24)
        with FABRIC.lock:
            self.qpn = next(FABRIC.qpns)
            FABRIC.qps[self.qpn] = self

    def local_info(self) -> dict[str, Any]:
        return {"qpn": self.qpn, "psn": self.psn, "lid": 1, "gid": "fe80:0000:0000:0000:0000:0000:0000:0001",
                "mtu": 5, "link_layer": "InfiniBand", "rd_atom": 16, "init_rd_atom": 16,
                "max_msg_sz": self.dev.max_msg_sz}

    def connect(self, remote: dict[str, Any], **_kw: Any) -> None:
        self.remote_qpn = int(remote["qpn"])
        self.remote_max_msg = int(remote.get("max_msg_sz", 0))
        self.state = "rts"

    def post(self, wr: WorkRequest) -> None:
        self.post_list([wr])

    def post_list(self, wrs: list[WorkRequest]) -> None:
        if self.state not in ("rts", "err"):
            raise VerbsError(f"post on a QP in state {self.state}", 22)
        if self.dev.record:
            self.dev.post_calls.append([(w.wr_id, w.signaled) for w in wrs])
        for wr in wrs:
            self.dev._submit(self, wr)

    def to_error(self) -> None:
        if self.state != "destroyed":
            self.state = "err"
        with self.dev.cond:
            self.dev.cond.notify_all()

    def close(self) -> None:
        self.state = "destroyed"
        with FABRIC.lock:
            FABRIC.qps.pop(self.qpn, None)
        with self.dev.cond:
            self.dev.sq = deque(x for x in self.dev.sq if x[0] is not self)
            self.dev.cond.notify_all()


class FakeDevice:
    """``verbs.Device`` look-alike; the class attributes tune it per test."""

    delay: ClassVar[float] = 0.0
    max_msg_sz: ClassVar[int] = 1 << 30
    #: ``port_active()`` answers this (a PORT_ERR test turns it off).
    port_up: ClassVar[bool] = True
    #: Keep ``executed`` and ``post_calls`` (off for RSS measurements: they grow per post).
    record: ClassVar[bool] = True
    instances: ClassVar[list[FakeDevice]] = []

    def __init__(self, device: str = "", port: int = 0, gid_index: int = -1, cq_depth: int = 4096) -> None:
        self.name, self.port, self.link_layer = device or "fake0", port or 1, "InfiniBand"
        self.lid, self.gid, self.gid_index, self.active_mtu = 1, "fe80:0000:0000:0000:0000:0000:0000:0001", 0, 5
        self.max_qp_wr, self.cq_depth = 1024, cq_depth
        self.max_msg_sz = type(self).max_msg_sz
        self.cond = threading.Condition()
        self.sq: deque[tuple[FakeQP, WorkRequest]] = deque()
        self.cqes: list[tuple[int, int, int]] = []
        self.cq_cond = threading.Condition()
        self.woken = False
        self.closed = False
        self.bytes_moved = 0
        self.executed: list[WorkRequest] = []
        self.post_calls: list[list[tuple[int, bool]]] = []
        self.async_queue: list[str] = []
        self.armed = 0
        self.event_mode = True
        self.event_fd_source = "simulated"
        self.skipped: tuple[str, ...] = ()
        self.worker = threading.Thread(target=self._run, daemon=True, name="fake-hca")
        self.worker.start()
        FakeDevice.instances.append(self)

    def info(self) -> dict[str, Any]:
        return {"device": self.name, "port": self.port, "link_layer": self.link_layer, "lid": self.lid,
                "gid": self.gid, "gid_index": 0, "mtu": 5, "max_msg_sz": self.max_msg_sz,
                "completion_wait": "event", "async_events": True}

    def reg_mr(self, addr: int, length: int, access: str, remote: bool = True) -> FakeMR:
        return FakeMR(addr, length, access, remote)

    def port_active(self) -> bool:
        return type(self).port_up

    def refresh_addresses(self) -> bool:
        return False

    def inject_async(self, *events: str) -> None:
        with self.cq_cond:
            self.async_queue.extend(events)
            self.cq_cond.notify_all()

    def read_async_events(self) -> list[str]:
        with self.cq_cond:
            out, self.async_queue = self.async_queue, []
        return out

    def create_qp(self, sq_depth: int) -> FakeQP:
        return FakeQP(self, sq_depth)

    # -- the "adapter" ---------------------------------------------------------------

    def _submit(self, qp: FakeQP, wr: WorkRequest) -> None:
        with self.cond:
            self.sq.append((qp, wr))
            self.cond.notify_all()

    def _complete(self, wr: WorkRequest, status: int) -> None:
        if status == SUCCESS and not wr.signaled:
            return  # sq_sig_all=0: an unsignaled success makes no completion
        with self.cq_cond:
            self.cqes.append((wr.wr_id, status, 0))
            self.cq_cond.notify_all()

    def _run(self) -> None:
        while True:
            with self.cond:
                while not self.sq and not self.closed:
                    self.cond.wait()
                if self.closed:
                    return
                qp, wr = self.sq[0]
                if qp.state == "rts" and self.delay:
                    self.cond.wait_for(lambda: qp.state != "rts" or self.closed, timeout=self.delay)
                if self.sq and self.sq[0] == (qp, wr):
                    self.sq.popleft()
                else:
                    continue  # the QP was destroyed meanwhile: no completion
            if qp.state != "rts":
                self._complete(wr, FLUSH)
                continue
            self._complete(wr, self._execute(qp, wr))

    def _execute(self, qp: FakeQP, wr: WorkRequest) -> int:
        with FABRIC.lock:
            target = FABRIC.qps.get(qp.remote_qpn or -1)
            mr = FABRIC.mrs.get(wr.rkey)
        if target is None or target.state != "rts":
            qp.state = "err"
            return RETRY_EXC
        need = "w" if wr.kind == "write" else "r"
        if (mr is None or not mr.remote or need not in mr.access or wr.remote_addr < mr.addr
                or wr.remote_addr + wr.length > mr.addr + mr.length):
            qp.state = "err"
            return REM_ACCESS
        if self.max_msg_sz and wr.length > self.max_msg_sz or qp.remote_max_msg and wr.length > qp.remote_max_msg:
            qp.state = "err"
            return LOC_LEN if wr.length > self.max_msg_sz else REM_INV_REQ
        if wr.kind == "write":
            ctypes.memmove(wr.remote_addr, wr.local_addr, wr.length)
        else:
            ctypes.memmove(wr.local_addr, wr.remote_addr, wr.length)
        self.bytes_moved += wr.length
        if self.record:
            self.executed.append(wr)
        return SUCCESS

    # -- completion queue ------------------------------------------------------------

    def poll(self, max_entries: int = 16) -> list[tuple[int, int, int]]:
        with self.cq_cond:
            out, self.cqes = self.cqes[:max_entries], self.cqes[max_entries:]
        return out

    def arm(self) -> bool:
        self.armed += 1
        return self.event_mode

    def wait(self, timeout: float | None) -> bool:
        with self.cq_cond:
            self.cq_cond.wait_for(lambda: self.cqes or self.woken or self.async_queue, timeout=timeout)
            self.woken = False
            return bool(self.async_queue)

    def busy(self) -> None:
        pass

    def wake(self) -> None:
        with self.cq_cond:
            self.woken = True
            self.cq_cond.notify_all()

    def close(self) -> None:
        with self.cond:
            self.closed = True
            self.cond.notify_all()
        self.wake()
