"""A drop-in for Mooncake's Python ``mooncake.engine.TransferEngine``.

Same methods, arguments, address model (raw virtual addresses on both sides;
peers named by their session name ``"host:rpc_port"``) and return codes
(0 / -1, batch ids with 0 as the failure sentinel, ``transfer_check_status``
1 done / 0 pending / -1 failed / -2 timed out) as the pybind11 class in
``mooncake-integration/transfer_engine/transfer_engine_py.cpp``. It runs on
mpcomm's core: a session name is the peer Engine's control endpoint, and
every buffer given to ``register_memory`` is published to peers.

Deliberate differences (docs/tent.md lists them with the methods left out):
``write_bytes_to_buffer``/``read_bytes_from_buffer`` refuse an address range
outside every registered buffer (Mooncake memcpys anywhere), an unknown batch
id is -1 instead of a crash, and ``get_engine`` returns the mpcomm Engine.
"""

from __future__ import annotations

import ctypes
import enum
import itertools
import json
import logging
import mmap
import os
import threading
from collections.abc import Sequence
from typing import Any

from mpcomm import Transfer
from mpcomm.errors import MpcommError

from . import codes
from .provider import Provider, directory_name_for

__all__ = ["TransferEngine", "TransferNotify", "TransferOpcode"]

log = logging.getLogger("mpcomm.tent.engine")

P2PHANDSHAKE = "P2PHANDSHAKE"

# Mooncake's error.h values for the cases its Python API passes through.
ERR_INVALID_ARGUMENT = -1
ERR_ADDRESS_NOT_REGISTERED = -3
ERR_ADDRESS_OVERLAPPED = -7

_SLAB_KB = (8, 16, 32, 64, 128, 256, 512, 1024, 2 << 10, 4 << 10, 8 << 10, 16 << 10,
            32 << 10, 64 << 10, 128 << 10, 256 << 10)
_ARENA = 16 << 20

_PROTOCOLS = {"tcp": ["tcp"], "rdma": ["rdma_zerocopy"], "shm": ["shm"], "ucx": ["ucx"]}


class TransferOpcode(enum.IntEnum):
    Read = 0
    Write = 1


READ = TransferOpcode.Read
WRITE = TransferOpcode.Write


class TransferNotify:
    """A (name, msg) pair delivered to the target after the data (``get_notifies``)."""

    def __init__(self, name: str = "", msg: str = "") -> None:
        self.name = name
        self.msg = msg

    def __repr__(self) -> str:
        return f"TransferNotify(name={self.name!r}, msg={self.msg!r})"


class _HostBuffer:
    """Anonymous memory with a stable raw address (what Mooncake mallocs)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.mm = mmap.mmap(-1, size)
        self._anchor = ctypes.c_char.from_buffer(self.mm)
        self.addr = ctypes.addressof(self._anchor)

    def close(self) -> None:
        del self._anchor
        self.mm.close()


class TransferEngine:
    """``mooncake.engine.TransferEngine`` on mpcomm (see the module docstring)."""

    TransferOpcode = TransferOpcode

    def __init__(self) -> None:
        self._p = Provider()
        raw = os.environ.get("MC_TRANSFER_TIMEOUT")
        self._timeout = float(max(5, int(raw))) if raw and raw.strip().lstrip("-").isdigit() else 30.0
        self._lock = threading.Lock()
        self._batches: dict[int, list[Transfer]] = {}
        self._batch_ids = itertools.count(1)
        self._free: list[list[int]] = [[] for _ in _SLAB_KB]
        self._arenas: list[_HostBuffer] = []
        self._large: dict[int, _HostBuffer] = {}
        self._etcd = False

    def __del__(self) -> None:
        try:
            self._p.shutdown()
        except Exception:  # noqa: BLE001
            pass

    # -- set-up ------------------------------------------------------------------------

    def initialize(self, local_hostname: str, metadata_server: str, protocol: str, device_name: str) -> int:
        meta_type = ""
        server = metadata_server
        if "://" in metadata_server:
            meta_type, server = metadata_server.split("://", 1)
        elif metadata_server != P2PHANDSHAKE:
            meta_type = "etcd"
        return self.initialize_ext(local_hostname, server, protocol, device_name, meta_type)

    def initialize_ext(self, local_hostname: str, metadata_server: str, protocol: str, device_name: str,
                       metadata_type: str) -> int:
        """``P2PHANDSHAKE``, or an etcd server (``"host:2379"``, metadata_type ``"etcd"``).

        With P2PHANDSHAKE the session name peers use is ``"host:rpc_port"``;
        with etcd it is ``local_hostname`` itself, found through the metadata.
        """
        etcd_url = None
        if metadata_server != P2PHANDSHAKE:
            if (metadata_type or "etcd") != "etcd":
                log.error("mpcomm.tent.TransferEngine: metadata type %r is not supported (P2PHANDSHAKE or etcd)",
                          metadata_type)
                return -1
            etcd_url = metadata_server if metadata_server.startswith("etcd://") else f"etcd://{metadata_server}"
        host, port = local_hostname or "127.0.0.1", 0
        if host.count(":") == 1:  # "host:port" (Mooncake's legacy RPC port binding)
            host, _, p = host.partition(":")
            port = int(p) if p.isdigit() else 0
        try:
            kwargs: dict[str, Any] = {}
            transports = _PROTOCOLS.get((protocol or "").lower())
            if transports and not os.environ.get("MPCOMM_TRANSPORTS"):
                kwargs["transports"] = transports
            if etcd_url is not None:
                kwargs["config"] = {"cluster": {"metadata": etcd_url}}
                self._p.directory_name = directory_name_for(local_hostname)
            self._p.init(local_hostname if etcd_url else f"{host}:{port}", device_name or "", port, bind=host,
                         **kwargs)
            self._etcd = etcd_url is not None
            if not self._etcd:
                self._p.host_id = f"{host}:{self._p.tcp_port}"
            self._p.start_accept()
        except (MpcommError, ValueError, OSError) as exc:
            log.error("mpcomm.tent.TransferEngine: initialize failed: %s", exc)
            self._p.shutdown()
            return -1
        return 0

    def get_rpc_port(self) -> int:
        return self._p.tcp_port

    def get_engine(self) -> Any:
        """The mpcomm Engine underneath (Mooncake returns its C++ engine)."""
        return self._p.engine

    def get_local_topology(self, device_name: str | None = None) -> str:
        eng = self._p.engine
        names = list(eng.transports) if eng is not None else []
        return json.dumps({"mpcomm_transports": names})

    def warmup_efa_segment(self, segment_name: str) -> int:
        return 0  # as Mooncake without an EFA transport

    # -- memory ----------------------------------------------------------------------------

    def register_memory(self, buffer_addr: int, capacity: int, location: str = "*") -> int:
        try:
            self._p.publish(int(buffer_addr), int(capacity))
        except codes.ProviderError as exc:
            return ERR_ADDRESS_OVERLAPPED if "overlap" in str(exc) else ERR_INVALID_ARGUMENT
        except (MpcommError, ValueError, OverflowError):
            return ERR_INVALID_ARGUMENT
        return 0

    def unregister_memory(self, buffer_addr: int) -> int:
        try:
            self._p.unregister_memory(int(buffer_addr), timeout=self._timeout)
        except codes.ProviderError as exc:
            return ERR_ADDRESS_NOT_REGISTERED if exc.code == codes.ERR_OUT_OF_RANGE else ERR_INVALID_ARGUMENT
        except MpcommError:
            return ERR_INVALID_ARGUMENT
        return 0

    def batch_register_memory(self, buffer_addresses: Sequence[int], capacities: Sequence[int],
                              location: str = "*") -> int:
        if len(buffer_addresses) != len(capacities):
            return ERR_INVALID_ARGUMENT
        for i, (a, c) in enumerate(zip(buffer_addresses, capacities)):
            rc = self.register_memory(a, c, location)
            if rc:
                for done in buffer_addresses[:i]:
                    self.unregister_memory(done)
                return rc
        return 0

    def batch_unregister_memory(self, buffer_addresses: Sequence[int]) -> int:
        rc = 0
        for a in buffer_addresses:
            rc = self.unregister_memory(a) or rc
        return rc

    def allocate_managed_buffer(self, length: int) -> int:
        """A registered buffer of at least ``length`` bytes (size classes as Mooncake's); 0 on failure."""
        if length <= 0:
            return 0
        cls = _class_of(length)
        with self._lock:
            try:
                if cls < 0:
                    buf = _HostBuffer(length)
                    if self.register_memory(buf.addr, length):
                        buf.close()
                        return 0
                    self._large[buf.addr] = buf
                    return buf.addr
                if not self._free[cls]:
                    block = _SLAB_KB[cls] << 10
                    arena = _HostBuffer(max(block, _ARENA))
                    if self.register_memory(arena.addr, arena.size):
                        arena.close()
                        return 0
                    self._arenas.append(arena)
                    self._free[cls].extend(range(arena.addr + arena.size - block, arena.addr - 1, -block))
                return self._free[cls].pop()
            except (OSError, ValueError):
                return 0

    def free_managed_buffer(self, buffer_addr: int, length: int) -> int:
        cls = _class_of(length)
        with self._lock:
            if cls < 0:
                buf = self._large.pop(buffer_addr, None)
                if buf is None:
                    return ERR_INVALID_ARGUMENT
                self.unregister_memory(buffer_addr)
                buf.close()
                return 0
            self._free[cls].append(buffer_addr)
        return 0

    def write_bytes_to_buffer(self, dest_address: int, src: bytes, length: int) -> int:
        data = src.encode("latin-1") if isinstance(src, str) else bytes(src)
        if length < 0 or length > len(data):
            return ERR_INVALID_ARGUMENT
        try:
            self._p.local_region(dest_address, max(length, 1))
        except MpcommError:
            return ERR_ADDRESS_NOT_REGISTERED
        ctypes.memmove(dest_address, data, length)
        return 0

    def read_bytes_from_buffer(self, source_address: int, length: int) -> bytes:
        """Bytes of a registered buffer; raises OutOfBoundsError outside every registered one."""
        from mpcomm.errors import OutOfBoundsError

        try:
            self._p.local_region(source_address, max(length, 1))
        except MpcommError as exc:
            raise OutOfBoundsError(str(exc)) from None
        return ctypes.string_at(source_address, length)

    def get_first_buffer_address(self, segment_name: str) -> int:
        try:
            self._open(segment_name)
            bufs = self._p.host_buffers(segment_name)
        except MpcommError:
            return 0
        return bufs[0].addr if bufs else 0

    # -- peers -------------------------------------------------------------------------------

    def _open(self, target: str) -> None:
        """The session named ``target`` ("host:port"): connect and fetch its buffers once."""
        if target in self._p._hosts:  # noqa: SLF001 - same package
            return
        if self._etcd:
            self._p.connect_named(target)
            self._p.query(target)
            return
        host, sep, port = target.rpartition(":")
        if not sep or not port.isdigit():
            raise codes.ProviderError(codes.ERR_INVALID_ARGUMENT, f"session name {target!r} is not host:port")
        self._p.connect(target, host.strip("[]"), int(port))
        self._p.query(target)

    def send_probe(self, peer_server_name: str) -> int:
        try:
            if self._etcd:
                self._p.engine.open(directory_name_for(peer_server_name), timeout=5.0)  # type: ignore[union-attr]
            else:
                host, _, port = peer_server_name.rpartition(":")
                self._p.engine.open(f"{host}:{int(port)}", "mpcomm.tent.directory", timeout=5.0)  # type: ignore[union-attr]
        except (MpcommError, ValueError, AttributeError):
            return -1
        return 0

    # -- transfers ------------------------------------------------------------------------------

    def _deadline(self, total: int) -> float:
        return self._timeout + total / 1e9  # Mooncake: the timeout plus 1 s per GiB

    def _submit(self, target: str, buffers: Sequence[int], peers: Sequence[int], lengths: Sequence[int],
                opcode: int) -> Transfer:
        n = len(buffers)
        if n != len(peers) or n != len(lengths) or n == 0:
            raise codes.ProviderError(codes.ERR_INVALID_ARGUMENT, "buffers, peer addresses and lengths differ in size")
        self._open(target)
        kind = "write" if int(opcode) == WRITE else "read"
        timeout = self._deadline(sum(lengths))
        if n == 1:
            return self._p.issue(kind, int(buffers[0]), target, int(peers[0]), int(lengths[0]), timeout)
        return self._p.issue_vector(kind, target, [int(b) for b in buffers], [int(p) for p in peers],
                                    [int(x) for x in lengths], timeout)

    def _wait(self, t: Transfer) -> int:
        try:
            t.result()  # the engine's own deadline bounds this
        except BaseException:  # noqa: BLE001
            return -1
        return 0

    def _notify(self, target: str, notify: TransferNotify | None) -> int:
        if notify is None:
            return 0
        bufs = self._p.host_buffers(target)
        if not bufs or bufs[0].remote is None:
            return -1
        payload = json.dumps({"name": notify.name, "msg": notify.msg}).encode()
        try:
            self._p.engine.notify(bufs[0].remote, payload)  # type: ignore[union-attr]
        except MpcommError:
            return -1
        return 0

    def transfer_sync(self, target_hostname: str, buffer: int, peer_buffer_address: int, length: int,
                      opcode: int, notify: TransferNotify | None = None, transport_hint: str = "") -> int:
        return self.batch_transfer_sync(target_hostname, [buffer], [peer_buffer_address], [length], opcode,
                                        notify, transport_hint)

    def transfer_sync_write(self, target_hostname: str, buffer: int, peer_buffer_address: int, length: int,
                            transport_hint: str = "") -> int:
        return self.transfer_sync(target_hostname, buffer, peer_buffer_address, length, WRITE, None, transport_hint)

    def transfer_sync_read(self, target_hostname: str, buffer: int, peer_buffer_address: int, length: int,
                           transport_hint: str = "") -> int:
        return self.transfer_sync(target_hostname, buffer, peer_buffer_address, length, READ, None, transport_hint)

    def batch_transfer_sync(self, target_hostname: str, buffers: Sequence[int], peer_buffer_addresses: Sequence[int],
                            lengths: Sequence[int], opcode: int, notify: TransferNotify | None = None,
                            transport_hint: str = "") -> int:
        try:
            t = self._submit(target_hostname, buffers, peer_buffer_addresses, lengths, opcode)
        except (MpcommError, ValueError, TypeError, OverflowError) as exc:
            log.info("transfer to %s refused: %s", target_hostname, exc)
            return -1
        rc = self._wait(t)
        return rc or self._notify(target_hostname, notify)

    def batch_transfer_sync_write(self, target_hostname: str, buffers: Sequence[int],
                                  peer_buffer_addresses: Sequence[int], lengths: Sequence[int],
                                  transport_hint: str = "") -> int:
        return self.batch_transfer_sync(target_hostname, buffers, peer_buffer_addresses, lengths, WRITE)

    def batch_transfer_sync_read(self, target_hostname: str, buffers: Sequence[int],
                                 peer_buffer_addresses: Sequence[int], lengths: Sequence[int],
                                 transport_hint: str = "") -> int:
        return self.batch_transfer_sync(target_hostname, buffers, peer_buffer_addresses, lengths, READ)

    def batch_transfer_async(self, target_hostname: str, buffers: Sequence[int], peer_buffer_addresses: Sequence[int],
                             lengths: Sequence[int], opcode: int, transport_hint: str = "") -> int:
        """A batch id (never 0), or 0 when nothing was submitted."""
        try:
            t = self._submit(target_hostname, buffers, peer_buffer_addresses, lengths, opcode)
        except (MpcommError, ValueError, TypeError, OverflowError) as exc:
            log.info("transfer to %s refused: %s", target_hostname, exc)
            return 0
        bid = next(self._batch_ids)
        self._batches[bid] = [t]
        return bid

    def batch_transfer_async_write(self, target_hostname: str, buffers: Sequence[int],
                                   peer_buffer_addresses: Sequence[int], lengths: Sequence[int],
                                   transport_hint: str = "") -> int:
        return self.batch_transfer_async(target_hostname, buffers, peer_buffer_addresses, lengths, WRITE)

    def batch_transfer_async_read(self, target_hostname: str, buffers: Sequence[int],
                                  peer_buffer_addresses: Sequence[int], lengths: Sequence[int],
                                  transport_hint: str = "") -> int:
        return self.batch_transfer_async(target_hostname, buffers, peer_buffer_addresses, lengths, READ)

    def transfer_submit_write(self, target_hostname: str, buffer: int, peer_buffer_address: int, length: int,
                              transport_hint: str = "") -> int:
        return self.batch_transfer_async(target_hostname, [buffer], [peer_buffer_address], [length], WRITE)

    def transfer_check_status(self, batch_id: int) -> int:
        """1 completed, 0 pending, -1 failed (or unknown id), -2 timed out. Done ids are freed."""
        ts = self._batches.get(batch_id)
        if ts is None:
            return -1
        t = ts[0]
        if not t.done():
            return 0
        exc = None if t.cancelled() else t.exception()
        if isinstance(exc, TimeoutError):
            return -2
        self._batches.pop(batch_id, None)
        return 1 if exc is None and not t.cancelled() else -1

    def get_batch_transfer_status(self, batch_ids: Sequence[int]) -> int:
        """Wait for every batch: 0 if all completed, else -1 (all of them are freed)."""
        rc = 0
        for bid in batch_ids:
            ts = self._batches.pop(bid, None)
            if ts is None or self._wait(ts[0]):
                rc = -1
        return rc

    def get_notifies(self) -> list[TransferNotify]:
        eng = self._p.engine
        out: list[TransferNotify] = []
        if eng is None:
            return out
        while True:
            try:
                note = eng.wait_notification(timeout=0)
            except TimeoutError:
                return out
            try:
                d = json.loads(note.data)
                out.append(TransferNotify(str(d.get("name", "")), str(d.get("msg", ""))))
            except (ValueError, AttributeError):
                out.append(TransferNotify("", note.data.decode("latin-1")))

    def close(self) -> None:
        """Release everything (Mooncake does this in its destructor)."""
        self._p.shutdown()
        for buf in [*self._arenas, *self._large.values()]:
            try:
                buf.close()
            except (BufferError, ValueError):
                pass
        self._arenas.clear()
        self._large.clear()


def _class_of(size: int) -> int:
    for i, kb in enumerate(_SLAB_KB):
        if size <= kb << 10:
            return i
    return -1
