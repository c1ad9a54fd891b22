"""Every use of pyverbs lives here, imported lazily (never at plugin import time).

The transport (:mod:`.transport`) sees a small interface — :class:`Device`,
:class:`QueuePair`, :class:`MemoryRegistration`, :class:`WorkRequest` — that a
test double can reproduce without an adapter.

**Finding pyverbs.** Debian and Ubuntu ship pyverbs for the distribution's
``/usr/bin/python3`` only (``python3-pyverbs`` installs into
``/usr/lib/python3/dist-packages``). An interpreter of the same version
installed elsewhere (pyenv, a venv without system site-packages) does not see
it. Putting the whole of ``dist-packages`` on ``sys.path`` is unsafe: it holds
the distribution's copies of cryptography, pip, setuptools/pkg_resources,
yaml, ... that would fill gaps in (or mix versions with) the interpreter's own
packages. :func:`load_pyverbs` therefore loads *only* the ``pyverbs`` package
from those directories, and only when its extension modules carry an ABI tag
this interpreter accepts. ``MPCOMM_PYVERBS_PATH`` (``os.pathsep``-separated
directories) replaces the default search list; set it empty to disable the
fallback.

**Waiting without spinning.** ``CompChannel.get_cq_event`` holds the GIL while
it blocks in ``ibv_get_cq_event``, and pyverbs does not expose the channel's
file descriptor. :class:`Device` finds that descriptor (the
``anon_inode:[infinibandevent]`` fd the channel creates), waits on it with
``select`` (which releases the GIL) and calls ``get_cq_event`` only once it is
readable. When the descriptor cannot be identified it falls back to polling
with a capped back-off (``wait()`` sleeps at most 1 ms).
"""

from __future__ import annotations

import contextlib
import errno
import importlib
import importlib.machinery
import importlib.util
import os
import random
import select
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

__all__ = [
    "Device",
    "DeviceProbe",
    "MemoryRegistration",
    "PyverbsMissing",
    "QueuePair",
    "VerbsError",
    "WorkRequest",
    "load_pyverbs",
    "probe",
]

INSTALL_HINT = "apt install python3-pyverbs"
EVENT_FD_NAME = "anon_inode:[infinibandevent]"
_load_lock = threading.Lock()
_channel_lock = threading.Lock()


class PyverbsMissing(Exception):
    """pyverbs (or the libibverbs it links) cannot be imported; ``str()`` says why."""


class VerbsError(Exception):
    """A verbs call failed; ``errno`` is the C error code where pyverbs gave one."""

    def __init__(self, message: str, err: int = 0) -> None:
        super().__init__(message)
        self.errno = err


@contextlib.contextmanager
def _verbs(what: str):  # type: ignore[no-untyped-def]
    """Turn pyverbs' exceptions into VerbsError (keeping the cause)."""
    try:
        yield
    except VerbsError:
        raise
    except Exception as exc:  # PyverbsRDMAError / PyverbsUserError / PyverbsError
        code = getattr(exc, "error_code", 0) or 0
        code = abs(int(code)) if isinstance(code, int) else 0
        detail = f" ({os.strerror(code)})" if code > 0 else ""
        raise VerbsError(f"{what}: {exc}{detail}", code) from exc


# -- loading ------------------------------------------------------------------


def _search_dirs() -> list[str]:
    env = os.environ.get("MPCOMM_PYVERBS_PATH")
    if env is not None:
        return [p for p in env.split(os.pathsep) if p]
    ver = f"python{sys.version_info.major}.{sys.version_info.minor}"
    return [
        "/usr/lib/python3/dist-packages",  # Debian, Ubuntu
        f"/usr/lib64/{ver}/site-packages",  # Fedora, RHEL
        f"/usr/lib/{ver}/site-packages",  # Arch, Fedora (noarch)
    ]


def _forget_pyverbs() -> None:
    for name in [n for n in sys.modules if n == "pyverbs" or n.startswith("pyverbs.")]:
        del sys.modules[name]


def load_pyverbs() -> ModuleType:
    """Import pyverbs (see the module docstring); raises PyverbsMissing with the reason."""
    with _load_lock:
        mod = sys.modules.get("pyverbs")
        if mod is not None and "pyverbs.device" in sys.modules:
            return mod
        try:
            import pyverbs  # noqa: F401
            import pyverbs.device  # noqa: F401

            return sys.modules["pyverbs"]
        except ImportError as exc:
            _forget_pyverbs()
            first = f"import pyverbs: {exc}"
        tried: list[str] = []
        suffixes = tuple(importlib.machinery.EXTENSION_SUFFIXES)
        for d in _search_dirs():
            pkg = Path(d) / "pyverbs"
            init = pkg / "__init__.py"
            if not init.is_file():
                continue
            exts = [p.name for p in pkg.glob("device*.so")]
            if not any(name == f"device{sfx}" for name in exts for sfx in suffixes if sfx != ".so"):
                tried.append(f"{pkg} is built for another Python ({', '.join(exts) or 'no device module'}; "
                             f"this one loads {suffixes[0]})")
                continue
            spec = importlib.util.spec_from_file_location("pyverbs", init, submodule_search_locations=[str(pkg)])
            if spec is None or spec.loader is None:
                continue
            module = importlib.util.module_from_spec(spec)
            sys.modules["pyverbs"] = module
            try:
                spec.loader.exec_module(module)
                importlib.import_module("pyverbs.device")
            except (ImportError, OSError) as exc:
                _forget_pyverbs()
                tried.append(f"{pkg}: {exc}")
                continue
            return module
        raise PyverbsMissing("; ".join([first, *tried]))


# -- probing --------------------------------------------------------------------


@dataclass(frozen=True)
class DeviceProbe:
    """Outcome of :func:`probe`: an active port, or why there is none."""

    ok: bool
    reason: str
    device: str = ""
    port: int = 0
    link_layer: str = ""


def _name(dev: Any) -> str:
    n = dev.name
    return n.decode() if isinstance(n, bytes) else str(n)


def _link_layer(value: int) -> str:
    return {1: "InfiniBand", 2: "Ethernet"}.get(int(value), "InfiniBand")


def list_devices() -> list[str]:
    """Names of the RDMA devices libibverbs sees ([] when none or no kernel support)."""
    load_pyverbs()
    from pyverbs.device import get_device_list

    try:
        return [_name(d) for d in get_device_list()]
    except Exception:  # noqa: BLE001 - pyverbs raises when ibv_get_device_list returns NULL
        return []


def no_device_detail() -> str:
    if not os.path.isdir("/sys/class/infiniband"):
        return ("; the kernel exposes no /sys/class/infiniband (no RDMA driver loaded, or a kernel "
                "built without CONFIG_INFINIBAND)")
    return ""


def probe(device: str = "", port: int = 0) -> DeviceProbe:
    """Find an ACTIVE port (on ``device`` if given). Opens and closes contexts; nothing else."""
    load_pyverbs()
    import pyverbs.enums as e
    from pyverbs.device import Context

    names = list_devices()
    if not names:
        return DeviceProbe(False, "no RDMA device (ibv_get_device_list returned none)" + no_device_detail())
    if device:
        if device not in names:
            return DeviceProbe(False, f"no RDMA device named {device!r} (found: {', '.join(names)})")
        names = [device]
    inactive = []
    for name in names:
        try:
            with _verbs(f"open {name}"):
                ctx = Context(name=name)
        except VerbsError as exc:
            inactive.append(f"{name} cannot be opened: {exc}")
            continue
        try:
            with _verbs(f"query {name}"):
                nports = ctx.query_device().phys_port_cnt
                ports = [port] if port else list(range(1, nports + 1))
                for p in ports:
                    pa = ctx.query_port(p)
                    if pa.state == e.IBV_PORT_ACTIVE:
                        return DeviceProbe(True, "", name, p, _link_layer(pa.link_layer))
        except VerbsError as exc:
            inactive.append(f"{name}: {exc}")
            continue
        finally:
            with contextlib.suppress(Exception):
                ctx.close()
        inactive.append(f"device {name} has no active port" + (f" {port}" if port else ""))
    return DeviceProbe(False, "; ".join(inactive))


# -- the data path ------------------------------------------------------------------


@dataclass(frozen=True)
class WorkRequest:
    """One signaled RDMA WRITE or READ of a contiguous range."""

    wr_id: int
    kind: str  # "write" | "read"
    local_addr: int
    length: int
    lkey: int
    remote_addr: int
    rkey: int


class MemoryRegistration:
    """An ``ibv_reg_mr`` of caller-owned memory; ``close()`` deregisters it."""

    def __init__(self, mr: Any, addr: int, length: int) -> None:
        self._mr = mr
        self.addr = addr
        self.length = length
        self.lkey = int(mr.lkey)
        self.rkey = int(mr.rkey)

    def close(self) -> None:
        mr, self._mr = self._mr, None
        if mr is not None:
            with _verbs("ibv_dereg_mr"):
                mr.close()


def access_flags(access: str) -> int:
    """ibv_access_flags for a region's ``access`` ("rw", "r", "w").

    LOCAL_WRITE is left out of read-only regions: pinning a read-only mapping
    for write fails (EFAULT), and an RDMA WRITE source needs no local write.
    """
    import pyverbs.enums as e

    flags = 0
    if "w" in access:
        flags |= e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_WRITE
    if "r" in access:
        flags |= e.IBV_ACCESS_REMOTE_READ
    return flags


class QueuePair:
    """An RC queue pair: created in RESET, connected by :meth:`connect`."""

    def __init__(self, dev: Device, sq_depth: int) -> None:
        from pyverbs.qp import QP, QPCap, QPInitAttr
        import pyverbs.enums as e

        self.dev = dev
        self.psn = random.getrandbits(24)
        cap = QPCap(max_send_wr=sq_depth, max_recv_wr=1, max_send_sge=1, max_recv_sge=1, max_inline_data=0)
        init = QPInitAttr(qp_type=e.IBV_QPT_RC, scq=dev.cq, rcq=dev.cq, cap=cap, sq_sig_all=0)
        with _verbs("ibv_create_qp"):
            self._qp = QP(dev.pd, init)
        self.qpn = int(self._qp.qp_num)

    def local_info(self) -> dict[str, Any]:
        """What the peer needs to connect to this QP (JSON-able)."""
        d = self.dev
        return {"qpn": self.qpn, "psn": self.psn, "lid": d.lid, "gid": d.gid, "mtu": d.active_mtu,
                "link_layer": d.link_layer, "rd_atom": d.max_qp_rd_atom, "init_rd_atom": d.max_qp_init_rd_atom}

    def connect(self, remote: dict[str, Any], *, timeout: int = 14, retry_cnt: int = 7, rnr_retry: int = 7,
                traffic_class: int = 0, service_level: int = 0) -> None:
        """RESET → INIT → RTR → RTS towards ``remote`` (the peer QP's :meth:`local_info`)."""
        import pyverbs.enums as e
        from pyverbs.addr import GID, AHAttr, GlobalRoute
        from pyverbs.qp import QPAttr

        d = self.dev
        attr = QPAttr()
        attr.qp_access_flags = e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_WRITE | e.IBV_ACCESS_REMOTE_READ
        attr.port_num = d.port
        attr.pkey_index = 0
        attr.path_mtu = min(int(d.active_mtu), int(remote["mtu"]))
        attr.dest_qp_num = int(remote["qpn"])
        attr.rq_psn = int(remote["psn"])
        attr.max_dest_rd_atomic = max(1, min(d.max_qp_rd_atom, int(remote["init_rd_atom"])))
        attr.min_rnr_timer = 12
        gid = str(remote.get("gid") or "")
        use_grh = d.link_layer == "Ethernet" or (gid and not gid.startswith("fe80:"))
        with _verbs("build address vector"):
            if use_grh:
                gr = GlobalRoute(dgid=GID(gid), sgid_index=d.gid_index, hop_limit=64, traffic_class=traffic_class)
                ah = AHAttr(gr=gr, is_global=1, dlid=int(remote.get("lid", 0)), sl=service_level, port_num=d.port)
            else:
                ah = AHAttr(dlid=int(remote["lid"]), sl=service_level, port_num=d.port, is_global=0)
        attr.ah_attr = ah
        attr.timeout = timeout
        attr.retry_cnt = retry_cnt
        attr.rnr_retry = rnr_retry
        attr.sq_psn = self.psn
        attr.max_rd_atomic = max(1, min(d.max_qp_init_rd_atom, int(remote["rd_atom"])))
        with _verbs(f"connect QP {self.qpn} to QP {remote['qpn']}"):
            self._qp.to_rts(attr)

    def post(self, wr: WorkRequest) -> None:
        """``ibv_post_send`` of one signaled RDMA WRITE/READ."""
        import pyverbs.enums as e
        from pyverbs.wr import SGE, SendWR

        opcode = e.IBV_WR_RDMA_WRITE if wr.kind == "write" else e.IBV_WR_RDMA_READ
        with _verbs("ibv_post_send"):
            sge = SGE(wr.local_addr, wr.length, wr.lkey)
            swr = SendWR(wr_id=wr.wr_id, opcode=opcode, num_sge=1, sg=[sge], send_flags=e.IBV_SEND_SIGNALED)
            swr.set_wr_rdma(wr.rkey, wr.remote_addr)
            self._qp.post_send(swr)

    def to_error(self) -> None:
        """Move to ERROR: outstanding work requests complete with IBV_WC_WR_FLUSH_ERR."""
        import pyverbs.enums as e
        from pyverbs.qp import QPAttr

        with _verbs(f"move QP {self.qpn} to ERROR"):
            self._qp.modify(QPAttr(qp_state=e.IBV_QPS_ERR), e.IBV_QP_STATE)

    def close(self) -> None:
        qp, self._qp = self._qp, None
        if qp is not None:
            with _verbs("ibv_destroy_qp"):
                qp.close()


class Device:
    """One opened adapter port: context, PD, completion channel and CQ."""

    def __init__(self, device: str = "", port: int = 0, gid_index: int = -1, cq_depth: int = 4096) -> None:
        load_pyverbs()
        import pyverbs.enums as e
        from pyverbs.cq import CQ, CompChannel
        from pyverbs.device import Context
        from pyverbs.pd import PD

        found = probe(device, port)
        if not found.ok:
            raise VerbsError(found.reason, errno.ENODEV)
        self.name, self.port, self.link_layer = found.device, found.port, found.link_layer
        self._closed = False
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self.event_fd: int | None = None
        with _verbs(f"open {self.name}"):
            self.ctx = Context(name=self.name)
        try:
            with _verbs(f"query {self.name}"):
                dattr = self.ctx.query_device()
                pattr = self.ctx.query_port(self.port)
            self.lid = int(pattr.lid)
            self.active_mtu = int(pattr.active_mtu)
            self.max_msg_sz = int(pattr.max_msg_sz)
            self.max_qp_wr = int(dattr.max_qp_wr)
            self.max_cqe = int(dattr.max_cqe)
            self.max_qp_rd_atom = int(dattr.max_qp_rd_atom)
            self.max_qp_init_rd_atom = int(dattr.max_qp_init_rd_atom)
            self.gid_index = gid_index if gid_index >= 0 else self._pick_gid(int(pattr.gid_tbl_len))
            with _verbs(f"query GID {self.gid_index}"):
                self.gid = str(self.ctx.query_gid(self.port, self.gid_index).gid)
            if self.link_layer == "Ethernet" and set(self.gid.replace(":", "")) <= {"0"}:
                raise VerbsError(f"{self.name} port {self.port}: GID index {self.gid_index} is empty; "
                                 "RoCE needs an IP address on the netdev (set plugins.rdma_zerocopy.gid_index)")
            with _verbs("ibv_alloc_pd"):
                self.pd = PD(self.ctx)
            with _channel_lock:
                before = _event_fds()
                with _verbs("ibv_create_comp_channel"):
                    self.channel = CompChannel(self.ctx)
                new = _event_fds() - before
            if len(new) == 1:
                self.event_fd = new.pop()
                os.set_blocking(self.event_fd, False)
            self.cq_depth = min(cq_depth, self.max_cqe)
            with _verbs("ibv_create_cq"):
                self.cq = CQ(self.ctx, self.cq_depth, None, self.channel, 0)
        except BaseException:
            self.close()
            raise
        self._idle_sleep = 0.0

    def _pick_gid(self, table_len: int) -> int:
        """IB: index 0. RoCE: a RoCE v2 GID, IPv4-mapped first (routable, what most fabrics use)."""
        if self.link_layer != "Ethernet":
            return 0
        best: tuple[int, int] | None = None
        for i in range(table_len):
            try:
                gid = str(self.ctx.query_gid(self.port, i).gid)
                gtype = int(self.ctx.query_gid_type(self.port, i))
            except Exception:  # noqa: BLE001 - empty or unreadable entries
                continue
            if set(gid.replace(":", "")) <= {"0"}:
                continue
            v2 = gtype == 1  # IBV_GID_TYPE_SYSFS_ROCE_V2
            v4 = gid.startswith("0000:0000:0000:0000:0000:ffff:")
            rank = (2 if v2 else 0) + (1 if v4 else 0)
            if best is None or rank > best[0]:
                best = (rank, i)
        return best[1] if best is not None else 0

    # -- resources ---------------------------------------------------------------

    def reg_mr(self, addr: int, length: int, access: str) -> MemoryRegistration:
        from pyverbs.mr import MR

        with _verbs(f"ibv_reg_mr of {length} bytes at {addr:#x}"):
            mr = MR(self.pd, length, access_flags(access), address=addr)
        return MemoryRegistration(mr, addr, length)

    def create_qp(self, sq_depth: int) -> QueuePair:
        return QueuePair(self, min(sq_depth, self.max_qp_wr))

    # -- completions ---------------------------------------------------------------

    def poll(self, max_entries: int = 16) -> list[tuple[int, int, int]]:
        """Up to ``max_entries`` completions as ``(wr_id, status, vendor_err)``."""
        with _verbs("ibv_poll_cq"):
            _n, wcs = self.cq.poll(max_entries)
        return [(int(wc.wr_id), int(wc.status), int(wc.vendor_err)) for wc in wcs]

    def arm(self) -> None:
        """``ibv_req_notify_cq``: the next completion wakes :meth:`wait`."""
        with _verbs("ibv_req_notify_cq"):
            self.cq.req_notify()

    def wait(self, timeout: float | None) -> None:
        """Block until the armed CQ signals, :meth:`wake` is called, or ``timeout``."""
        if self.event_fd is None:
            # No descriptor to select on: bounded back-off instead of blocking with the GIL held.
            self._idle_sleep = min(0.001, max(self._idle_sleep * 2, 50e-6))
            r, _, _ = select.select([self._wake_r], [], [], min(self._idle_sleep, timeout or 1.0))
            if r:
                self._drain_wake()
            return
        r, _, _ = select.select([self.event_fd, self._wake_r], [], [], timeout)
        if self._wake_r in r:
            self._drain_wake()
        if self.event_fd in r:
            try:
                self.channel.get_cq_event(self.cq)
                self.cq.ack_events(1)
            except Exception:  # noqa: BLE001 - EAGAIN on a spurious wake-up
                pass

    def busy(self) -> None:
        """Reset the back-off after completions arrived."""
        self._idle_sleep = 0.0

    def wake(self) -> None:
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"x")

    def _drain_wake(self) -> None:
        with contextlib.suppress(OSError):
            while os.read(self._wake_r, 4096):
                pass

    def info(self) -> dict[str, Any]:
        return {"device": self.name, "port": self.port, "link_layer": self.link_layer, "lid": self.lid,
                "gid": self.gid, "gid_index": self.gid_index, "mtu": self.active_mtu, "max_msg_sz": self.max_msg_sz}

    def close(self) -> None:
        """Destroy CQ, channel, PD and context (QPs and MRs first, by their owners); never raises."""
        if self._closed:
            return
        self._closed = True
        for name in ("cq", "channel", "pd", "ctx"):
            obj = getattr(self, name, None)
            if obj is not None:
                try:
                    obj.close()
                except Exception:  # noqa: BLE001
                    pass
        for fd in (self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)


def _event_fds() -> set[int]:
    out = set()
    try:
        entries = os.listdir("/proc/self/fd")
    except OSError:
        return out
    for entry in entries:
        try:
            if os.readlink(f"/proc/self/fd/{entry}") == EVENT_FD_NAME:
                out.add(int(entry))
        except OSError:
            continue
    return out
