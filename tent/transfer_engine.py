"""A drop-in for Mooncake's Python ``mooncake.engine.TransferEngine``.

Same methods, arguments, address model (raw virtual addresses on both sides;
peers named by their session name ``"host:rpc_port"``) and return codes
(0 / -1, batch ids with 0 as the failure sentinel, ``transfer_check_status``
1 done / 0 pending / -1 failed / -2 timed out) as the pybind11 class in
``mooncake-integration/transfer_engine/transfer_engine_py.cpp``. It runs on
mpcomm's core: a session name is the peer Engine's control endpoint, and
every buffer given to ``register_memory`` is published to peers.

No exception escapes a Mooncake-API method: each one is wrapped by
:func:`_api`, which logs what went wrong and returns the method's documented
error value (-1, 0 for a batch id or an address, ``b""`` for bytes).

Deliberate differences (docs/tent.md lists them with the methods left out):
``write_bytes_to_buffer``/``read_bytes_from_buffer`` refuse an address range
outside every registered buffer (Mooncake memcpys anywhere), an unknown batch
id is -1 instead of a crash, ``free_managed_buffer`` refuses what it did not
hand out, a second ``initialize`` leaves the first engine alone, and
``get_engine`` returns the mpcomm Engine.
"""

from __future__ import annotations

import atexit
import ctypes
import enum
import functools
import itertools
import logging
import mmap
import operator
import os
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from mpcomm import Transfer
from mpcomm.errors import MpcommError
from mpcomm.wire import loads_bounded

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

#: Largest length a sync transfer may take through Provider.issue_bound (larger: the general path refuses it).
_BOUND_MAX = 1 << 62

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


_F = TypeVar("_F", bound=Callable[..., Any])


def _api(error: Any) -> Callable[[_F], _F]:
    """A Mooncake-API method: whatever goes wrong inside is logged and becomes ``error``.

    Mooncake's pybind11 methods answer with codes, so a caller checks a return
    value and never expects a Python exception (a hostile peer's directory, a
    bad argument type, a bug here). KeyboardInterrupt and SystemExit still pass.
    """

    def wrap(fn: _F) -> _F:
        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            try:
                return fn(*args, **kwargs)
            except Exception as exc:  # noqa: BLE001 - the API's contract: a code, never an exception
                _log_failure(fn.__name__, exc)
            return error() if callable(error) else error

        return call  # type: ignore[return-value]

    return wrap


def _log_failure(method: str, exc: Exception) -> None:
    """What :func:`_api` logs for ``exc`` escaping ``method``."""
    if isinstance(exc, MpcommError):  # a refusal (a bad argument, a hostile peer): its reason is enough
        log.error("mpcomm.tent.TransferEngine.%s refused: %s", method, exc)
    else:
        log.error("mpcomm.tent.TransferEngine.%s failed", method, exc_info=exc)


def _index(value: Any, what: str) -> int:
    """An integer argument (an address or a length); floats and strings are refused, not truncated."""
    try:
        return operator.index(value)
    except TypeError:
        raise codes.ProviderError(codes.ERR_INVALID_ARGUMENT, f"{what} must be an integer, not {value!r}") from None


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
        #: Managed buffers handed out and not yet freed: address -> size class (-1: a large buffer).
        self._handed: dict[int, int] = {}
        self._etcd = False
        self._init_lock = threading.Lock()
        self._at_exit: Callable[[], None] | None = None

    def __del__(self) -> None:
        try:
            self._p.shutdown()
        except Exception:  # noqa: BLE001
            pass

    # -- set-up ------------------------------------------------------------------------

    @_api(-1)
    def initialize(self, local_hostname: str, metadata_server: str, protocol: str, device_name: str) -> int:
        meta_type = ""
        server = metadata_server
        if "://" in metadata_server:
            meta_type, server = metadata_server.split("://", 1)
        elif metadata_server != P2PHANDSHAKE:
            meta_type = "etcd"
        return self.initialize_ext(local_hostname, server, protocol, device_name, meta_type)

    @_api(-1)
    def initialize_ext(self, local_hostname: str, metadata_server: str, protocol: str, device_name: str,
                       metadata_type: str) -> int:
        """``P2PHANDSHAKE``, or an etcd server (``"host:2379"``, metadata_type ``"etcd"``).

        With P2PHANDSHAKE the session name peers use is ``"host:rpc_port"``;
        with etcd it is ``local_hostname`` itself, found through the metadata.
        A second call returns -1 and leaves the engine the first one started serving.
        """
        with self._init_lock:
            if self._p.engine is not None:
                log.error("mpcomm.tent.TransferEngine: already initialised (as %r); the running engine is kept",
                          self._p.host_id)
                return -1
            rc = self._initialize(local_hostname, metadata_server, protocol, device_name, metadata_type)
        if rc == 0:
            self._at_exit = _close_at_exit(self)
        return rc

    def _initialize(self, local_hostname: str, metadata_server: str, protocol: str, device_name: str,
                    metadata_type: str) -> int:
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
        except Exception as exc:  # noqa: BLE001 - whatever it was, nothing half-started stays behind
            log.error("mpcomm.tent.TransferEngine: initialize failed: %s", exc)
            self._p.shutdown()  # only what this call started: a running engine was refused above
            return -1
        return 0

    @_api(-1)
    def get_rpc_port(self) -> int:
        return self._p.tcp_port

    @_api(None)
    def get_engine(self) -> Any:
        """The mpcomm Engine underneath (Mooncake returns its C++ engine)."""
        return self._p.engine

    @_api("")
    def get_local_topology(self, device_name: str | None = None) -> str:
        import json

        eng = self._p.engine
        names = list(eng.transports) if eng is not None else []
        return json.dumps({"mpcomm_transports": names})

    @_api(-1)
    def warmup_efa_segment(self, segment_name: str) -> int:
        return 0  # as Mooncake without an EFA transport

    # -- memory ----------------------------------------------------------------------------

    @_api(ERR_INVALID_ARGUMENT)
    def register_memory(self, buffer_addr: int, capacity: int, location: str = "*") -> int:
        try:
            self._p.publish(_index(buffer_addr, "buffer_addr"), _index(capacity, "capacity"))
        except codes.ProviderError as exc:
            return ERR_ADDRESS_OVERLAPPED if "overlap" in str(exc) else ERR_INVALID_ARGUMENT
        except (MpcommError, ValueError, OverflowError):
            return ERR_INVALID_ARGUMENT
        return 0

    @_api(ERR_INVALID_ARGUMENT)
    def unregister_memory(self, buffer_addr: int) -> int:
        try:
            self._p.unregister_memory(_index(buffer_addr, "buffer_addr"), timeout=self._timeout)
        except codes.ProviderError as exc:
            return ERR_ADDRESS_NOT_REGISTERED if exc.code == codes.ERR_OUT_OF_RANGE else ERR_INVALID_ARGUMENT
        except MpcommError:
            return ERR_INVALID_ARGUMENT
        return 0

    @_api(ERR_INVALID_ARGUMENT)
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

    @_api(ERR_INVALID_ARGUMENT)
    def batch_unregister_memory(self, buffer_addresses: Sequence[int]) -> int:
        rc = 0
        for a in buffer_addresses:
            rc = self.unregister_memory(a) or rc
        return rc

    @_api(0)
    def allocate_managed_buffer(self, length: int) -> int:
        """A registered buffer of at least ``length`` bytes (size classes as Mooncake's); 0 on failure."""
        length = _index(length, "length")
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
                    self._handed[buf.addr] = -1
                    return buf.addr
                if not self._free[cls]:
                    block = _SLAB_KB[cls] << 10
                    arena = _HostBuffer(max(block, _ARENA))
                    if self.register_memory(arena.addr, arena.size):
                        arena.close()
                        return 0
                    self._arenas.append(arena)
                    self._free[cls].extend(range(arena.addr + arena.size - block, arena.addr - 1, -block))
                addr = self._free[cls].pop()
                self._handed[addr] = cls
                return addr
            except (OSError, ValueError):
                return 0

    @_api(ERR_INVALID_ARGUMENT)
    def free_managed_buffer(self, buffer_addr: int, length: int) -> int:
        """Give back what :meth:`allocate_managed_buffer` handed out, with a length of the same size class.

        A second free, a length of another class and an address this engine did
        not hand out are refused (-1, logged): accepting them would put one
        block on a free list twice, or a foreign range on one, and hand it to
        two owners.
        """
        buffer_addr, length = _index(buffer_addr, "buffer_addr"), _index(length, "length")
        cls = _class_of(length) if length > 0 else -2
        with self._lock:
            handed = self._handed.get(buffer_addr)
            if handed is None:
                log.error("free_managed_buffer(%#x): not a managed buffer in use (freed already, or never "
                          "allocated here)", buffer_addr)
                return ERR_INVALID_ARGUMENT
            if handed != cls:
                log.error("free_managed_buffer(%#x, %d): the buffer was allocated in another size class",
                          buffer_addr, length)
                return ERR_INVALID_ARGUMENT
            del self._handed[buffer_addr]
            if cls < 0:
                buf = self._large.pop(buffer_addr)
                self.unregister_memory(buffer_addr)
                buf.close()
                return 0
            self._free[cls].append(buffer_addr)
        return 0

    def _local_range(self, address: Any, length: Any) -> tuple[int, int]:
        """(address, length) checked: integers, length >= 0, all inside one registered buffer."""
        address, length = _index(address, "address"), _index(length, "length")
        if length < 0:
            raise codes.ProviderError(codes.ERR_INVALID_ARGUMENT, f"negative length {length}")
        self._p.local_region(address, max(length, 1))  # managed buffers are registered ones too
        return address, length

    @_api(ERR_INVALID_ARGUMENT)
    def write_bytes_to_buffer(self, dest_address: int, src: bytes, length: int) -> int:
        """Copy ``length`` bytes of ``src`` into a registered buffer; -3 outside every one, -1 for a bad length."""
        data = src.encode("latin-1") if isinstance(src, str) else bytes(src)
        length = _index(length, "length")
        if length < 0 or length > len(data):
            log.error("write_bytes_to_buffer: length %d for %d bytes of data", length, len(data))
            return ERR_INVALID_ARGUMENT
        try:
            dest_address, length = self._local_range(dest_address, length)
        except codes.ProviderError as exc:
            log.error("write_bytes_to_buffer refused: %s", exc)
            return ERR_ADDRESS_NOT_REGISTERED if exc.code == codes.ERR_OUT_OF_RANGE else ERR_INVALID_ARGUMENT
        ctypes.memmove(dest_address, data, length)
        return 0

    @_api(b"")
    def read_bytes_from_buffer(self, source_address: int, length: int) -> bytes:
        """``length`` bytes of a registered buffer; ``b""`` (logged) for a bad length or outside every one."""
        source_address, length = self._local_range(source_address, length)
        return ctypes.string_at(source_address, length) if length else b""

    @_api(0)
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
        if self._p.has_host(target):
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

    @_api(-1)
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
                opcode: int, *, waited: bool = False) -> Transfer:
        """Post the transfer. ``waited``: the caller waits for it and then calls ``self._p.settled``
        (no done-callback on the engine's completion thread)."""
        n = len(buffers)
        if n != len(peers) or n != len(lengths) or n == 0:
            raise codes.ProviderError(codes.ERR_INVALID_ARGUMENT, "buffers, peer addresses and lengths differ in size")
        self._open(target)
        kind = "write" if _index(opcode, "opcode") == WRITE else "read"
        local = [_index(b, "buffer") for b in buffers]
        remote = [_index(p, "peer_buffer_address") for p in peers]
        sizes = [_index(x, "length") for x in lengths]
        if min(sizes) <= 0:
            raise codes.ProviderError(codes.ERR_INVALID_ARGUMENT, f"lengths must be positive, not {min(sizes)}")
        timeout = self._deadline(sum(sizes))
        if n == 1:
            return self._p.issue(kind, local[0], target, remote[0], sizes[0], timeout, watch=not waited)
        return self._p.issue_vector(kind, target, local, remote, sizes, timeout, watch=not waited)

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
        import json

        payload = json.dumps({"name": notify.name, "msg": notify.msg}).encode()
        try:
            self._p.engine.notify(bufs[0].remote, payload)  # type: ignore[union-attr]
        except MpcommError:
            return -1
        return 0

    @_api(-1)
    def transfer_sync(self, target_hostname: str, buffer: int, peer_buffer_address: int, length: int,
                      opcode: int, notify: TransferNotify | None = None, transport_hint: str = "") -> int:
        if notify is None and (type(opcode) is int or type(opcode) is TransferOpcode):
            return self._sync_one("transfer_sync", WRITE if opcode == WRITE else READ, target_hostname, buffer,
                                  peer_buffer_address, length)  # as _submit: any opcode other than Write reads
        return self.batch_transfer_sync(target_hostname, [buffer], [peer_buffer_address], [length], opcode,
                                        notify, transport_hint)

    # Not wrapped by _api: _sync_one keeps its promise (a code, never an exception) one call shorter.
    def transfer_sync_write(self, target_hostname: str, buffer: int, peer_buffer_address: int, length: int,
                            transport_hint: str = "") -> int:
        return self._sync_one("transfer_sync_write", WRITE, target_hostname, buffer, peer_buffer_address, length)

    def transfer_sync_read(self, target_hostname: str, buffer: int, peer_buffer_address: int, length: int,
                           transport_hint: str = "") -> int:
        return self._sync_one("transfer_sync_read", READ, target_hostname, buffer, peer_buffer_address, length)

    def _sync_one(self, method: str, opcode: TransferOpcode, target: str, buffer: Any, peer: Any, length: Any) -> int:
        """One transfer, waited for; 0 or -1 as a Mooncake-API method (see :func:`_api`).

        Between the two ranges the peer's last transfer went through it goes
        straight to the engine (:meth:`Provider.issue_bound`); otherwise the
        general path takes it, and its look-ups let the next one go straight.
        """
        try:
            t = None
            if type(length) is int and 0 < length <= _BOUND_MAX:  # the deadline's float cannot overflow
                t = self._p.issue_bound("write" if opcode is WRITE else "read", buffer, target, peer, length,
                                        self._timeout + length / 1e9)
            if t is None:
                return self.batch_transfer_sync(target, [buffer], [peer], [length], opcode)
        except Exception as exc:  # noqa: BLE001 - the API's contract: a code, never an exception
            _log_failure(method, exc)
            return -1
        try:
            t.result()  # the engine's own deadline bounds this
        except BaseException:  # noqa: BLE001 - as _wait: a code, and the peer's keys looked at again if it restarted
            self._p.settled(target, t)
            return -1
        return 0

    @_api(-1)
    def batch_transfer_sync(self, target_hostname: str, buffers: Sequence[int], peer_buffer_addresses: Sequence[int],
                            lengths: Sequence[int], opcode: int, notify: TransferNotify | None = None,
                            transport_hint: str = "") -> int:
        try:
            t = self._submit(target_hostname, buffers, peer_buffer_addresses, lengths, opcode, waited=True)
        except (MpcommError, ValueError, TypeError, OverflowError) as exc:
            log.error("transfer to %s refused: %s", target_hostname, exc)
            return -1
        rc = self._wait(t)
        self._p.settled(target_hostname, t)
        return rc or self._notify(target_hostname, notify)

    @_api(-1)
    def batch_transfer_sync_write(self, target_hostname: str, buffers: Sequence[int],
                                  peer_buffer_addresses: Sequence[int], lengths: Sequence[int],
                                  transport_hint: str = "") -> int:
        return self.batch_transfer_sync(target_hostname, buffers, peer_buffer_addresses, lengths, WRITE)

    @_api(-1)
    def batch_transfer_sync_read(self, target_hostname: str, buffers: Sequence[int],
                                 peer_buffer_addresses: Sequence[int], lengths: Sequence[int],
                                 transport_hint: str = "") -> int:
        return self.batch_transfer_sync(target_hostname, buffers, peer_buffer_addresses, lengths, READ)

    @_api(0)
    def batch_transfer_async(self, target_hostname: str, buffers: Sequence[int], peer_buffer_addresses: Sequence[int],
                             lengths: Sequence[int], opcode: int, transport_hint: str = "") -> int:
        """A batch id (never 0), or 0 when nothing was submitted."""
        try:
            t = self._submit(target_hostname, buffers, peer_buffer_addresses, lengths, opcode)
        except (MpcommError, ValueError, TypeError, OverflowError) as exc:
            log.error("transfer to %s refused: %s", target_hostname, exc)
            return 0
        bid = next(self._batch_ids)
        self._batches[bid] = [t]
        return bid

    @_api(0)
    def batch_transfer_async_write(self, target_hostname: str, buffers: Sequence[int],
                                   peer_buffer_addresses: Sequence[int], lengths: Sequence[int],
                                   transport_hint: str = "") -> int:
        return self.batch_transfer_async(target_hostname, buffers, peer_buffer_addresses, lengths, WRITE)

    @_api(0)
    def batch_transfer_async_read(self, target_hostname: str, buffers: Sequence[int],
                                  peer_buffer_addresses: Sequence[int], lengths: Sequence[int],
                                  transport_hint: str = "") -> int:
        return self.batch_transfer_async(target_hostname, buffers, peer_buffer_addresses, lengths, READ)

    @_api(0)
    def transfer_submit_write(self, target_hostname: str, buffer: int, peer_buffer_address: int, length: int,
                              transport_hint: str = "") -> int:
        return self.batch_transfer_async(target_hostname, [buffer], [peer_buffer_address], [length], WRITE)

    @_api(-1)
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

    @_api(-1)
    def get_batch_transfer_status(self, batch_ids: Sequence[int]) -> int:
        """Wait for every batch: 0 if all completed, else -1 (all of them are freed)."""
        rc = 0
        for bid in batch_ids:
            ts = self._batches.pop(bid, None)
            if ts is None or self._wait(ts[0]):
                rc = -1
        return rc

    @_api(list)
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
            try:  # a peer's bytes: the one bounded parse, as for all JSON from peers
                d = loads_bounded(note.data, what=f"a notification from {note.peer!r}")
                out.append(TransferNotify(str(d.get("name", "")), str(d.get("msg", ""))))
            except (MpcommError, AttributeError):
                out.append(TransferNotify("", note.data.decode("latin-1")))

    @_api(None)
    def close(self) -> None:
        """Release everything (Mooncake does this in its destructor)."""
        hook, self._at_exit = self._at_exit, None
        if hook is not None:
            atexit.unregister(hook)
        self._p.shutdown()
        for buf in [*self._arenas, *self._large.values()]:
            try:
                buf.close()
            except (BufferError, ValueError):
                pass
        self._arenas.clear()
        self._large.clear()
        self._handed.clear()
        self._free = [[] for _ in _SLAB_KB]


def _close_at_exit(engine: TransferEngine) -> Callable[[], None]:
    """Close ``engine`` at interpreter exit if it is still alive then.

    Closing from ``__del__`` during interpreter teardown is too late: the
    metadata client's threads and imports fail once the import system is gone
    (``sys.meta_path is None``) and print a traceback. atexit runs first.
    """
    ref = weakref.ref(engine)

    def close() -> None:
        te = ref()
        if te is not None:
            te.close()

    atexit.register(close)
    return close


def _class_of(size: int) -> int:
    for i, kb in enumerate(_SLAB_KB):
        if size <= kb << 10:
            return i
    return -1
