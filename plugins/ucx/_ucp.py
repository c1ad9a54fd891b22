"""Minimal ctypes binding to UCX's UCP API for one-sided RMA (put/get).

ucxx does not wrap RMA, so we talk to libucp directly.  Struct layouts below
were checked with offsetof() against the headers shipped in libucx-cu12 1.21.0
(site-packages/libucx/include/ucp/api/ucp.h).  UCP structs only grow at the
end and every field is gated by a field_mask bit, so these layouts stay valid
for later 1.x releases; we refuse major versions other than 1.

Importing this module never touches UCX; call load() (done implicitly by
Context) which raises UcxUnavailable with a reason when UCX can't be used.
"""
from __future__ import annotations

import ctypes as C
import os
import select
import tempfile
import time
from typing import Any

# --- constants (values verified against UCX 1.21 headers) -------------------
UCS_OK, UCS_INPROGRESS = 0, 1
UCS_ERR_BUSY, UCS_ERR_TIMED_OUT, UCS_ERR_LAST = -15, -20, -100
UCS_ERR_CANCELED, UCS_ERR_CONNECTION_RESET, UCS_ERR_ENDPOINT_TIMEOUT = -16, -25, -80
UCS_ERR_OUT_OF_RANGE = -19  # also what rma_group reports for a piece outside its region (never issued)

FEATURE_TAG, FEATURE_RMA, FEATURE_AMO32, FEATURE_AMO64, FEATURE_WAKEUP = 1, 2, 4, 8, 16
THREAD_SINGLE, THREAD_SERIALIZED, THREAD_MULTI = 0, 1, 2

_PARAM_FIELD_FEATURES, _PARAM_FIELD_MT_WORKERS_SHARED = 1 << 0, 1 << 5
_WORKER_PARAM_FIELD_THREAD_MODE = 1 << 0
_WORKER_ATTR_FIELD_THREAD_MODE = 1 << 0
_EP_FIELD_REMOTE_ADDRESS, _EP_FIELD_ERR_MODE, _EP_FIELD_ERR_HANDLER = 1, 2, 4
_ERR_MODE_NONE, _ERR_MODE_PEER = 0, 1
_MM_FIELD_ADDRESS, _MM_FIELD_LENGTH, _MM_FIELD_FLAGS, _MM_FIELD_PROT, _MM_FIELD_MEMORY_TYPE = 1, 2, 4, 8, 16
#: ucs_memory_type_t values mem_map takes (ucs/memory/memory_type.h).
MEMORY_TYPE_HOST, MEMORY_TYPE_CUDA = 0, 1
PROT_LOCAL_READ, PROT_LOCAL_WRITE, PROT_REMOTE_READ, PROT_REMOTE_WRITE = 1, 2, 1 << 8, 1 << 9
_MM_ALLOCATE = 1 << 1
_MEM_ATTR_ADDRESS, _MEM_ATTR_LENGTH = 1, 2
_OP_ATTR_FIELD_FLAGS, _OP_ATTR_FIELD_MEMH = 1 << 4, 1 << 8
_OP_ATTR_FLAG_MULTI_SEND = 1 << 19
_EP_CLOSE_FLAG_FORCE = 1 << 0

_API_MAJOR, _API_MINOR = 1, 21  # header version the layouts were checked against


class UcxUnavailable(RuntimeError):
    """UCX cannot be loaded here; str(exc) is the reason."""


class UcxError(RuntimeError):
    def __init__(self, status: int, message: str = "", where: str = ""):
        self.status = status
        self.message = message or status_string(status)
        super().__init__(f"{where + ': ' if where else ''}{self.message} (ucs_status {status})")


# --- structs ------------------------------------------------------------------
class _Params(C.Structure):
    _fields_ = [("field_mask", C.c_uint64), ("features", C.c_uint64),
                ("request_size", C.c_size_t), ("request_init", C.c_void_p),
                ("request_cleanup", C.c_void_p), ("tag_sender_mask", C.c_uint64),
                ("mt_workers_shared", C.c_int), ("estimated_num_eps", C.c_size_t),
                ("estimated_num_ppn", C.c_size_t), ("name", C.c_char_p),
                ("node_local_id", C.c_size_t)]                            # 88 bytes


class _WorkerParams(C.Structure):
    _fields_ = [("field_mask", C.c_uint64), ("thread_mode", C.c_int),
                ("cpu_mask", C.c_uint64 * 16), ("events", C.c_uint),
                ("user_data", C.c_void_p), ("event_fd", C.c_int),
                ("flags", C.c_uint64), ("name", C.c_char_p),
                ("am_alignment", C.c_size_t), ("client_id", C.c_uint64)]  # 200 bytes


class _WorkerAttr(C.Structure):
    # Only the prefix we read; the padding covers the rest (80 bytes total).
    _fields_ = [("field_mask", C.c_uint64), ("thread_mode", C.c_int),
                ("_rest", C.c_uint8 * 68)]


# ucs_status_t is declared UCS_S_PACKED: a 1-byte enum. Declaring it c_int
# reads garbage/zero-extended upper bits (-25 came back as 231), so every
# status in/out of UCX is c_int8.
_STATUS = C.c_int8
_ERR_CB = C.CFUNCTYPE(None, C.c_void_p, C.c_void_p, _STATUS)


class _EpParams(C.Structure):
    _fields_ = [("field_mask", C.c_uint64), ("address", C.c_void_p),
                ("err_mode", C.c_int), ("err_cb", _ERR_CB), ("err_arg", C.c_void_p),
                ("user_data", C.c_void_p), ("flags", C.c_uint),
                ("sockaddr", C.c_uint8 * 16), ("conn_request", C.c_void_p),
                ("name", C.c_char_p), ("local_sockaddr", C.c_uint8 * 16)]  # 104 bytes


class _MemMapParams(C.Structure):
    _fields_ = [("field_mask", C.c_uint64), ("address", C.c_void_p),
                ("length", C.c_size_t), ("flags", C.c_uint), ("prot", C.c_uint),
                ("memory_type", C.c_int), ("exported_memh_buffer", C.c_void_p)]  # 48


class _MemAttr(C.Structure):
    _fields_ = [("field_mask", C.c_uint64), ("address", C.c_void_p),
                ("length", C.c_size_t), ("mem_type", C.c_int)]            # 32 bytes


class _RequestParam(C.Structure):
    _fields_ = [("op_attr_mask", C.c_uint32), ("flags", C.c_uint32),
                ("request", C.c_void_p), ("cb", C.c_void_p), ("datatype", C.c_uint64),
                ("user_data", C.c_void_p), ("reply_buffer", C.c_void_p),
                ("memory_type", C.c_int), ("recv_info", C.c_void_p),
                ("memh", C.c_void_p)]                                     # 72 bytes


for _s, _n in ((_Params, 88), (_WorkerParams, 200), (_WorkerAttr, 80), (_EpParams, 104),
               (_MemMapParams, 48), (_MemAttr, 32), (_RequestParam, 72)):
    assert C.sizeof(_s) == _n, (_s.__name__, C.sizeof(_s))

# --- library loading ----------------------------------------------------------
_lib = None      # libucp handle once load() succeeded
_ucs = None      # libucs handle (ucs_status_string)
_libc = C.CDLL(None)
_libc.fopen.restype = C.c_void_p
_libc.fopen.argtypes = [C.c_char_p, C.c_char_p]
_libc.fclose.argtypes = [C.c_void_p]

_P, _PP, _S, _SZ, _U64 = C.c_void_p, C.POINTER(C.c_void_p), _STATUS, C.c_size_t, C.c_uint64
_SIGS = {
    "ucp_get_version": (None, [C.POINTER(C.c_uint)] * 3),
    "ucp_config_read": (_S, [C.c_char_p, C.c_char_p, _PP]),
    "ucp_config_modify": (_S, [_P, C.c_char_p, C.c_char_p]),
    "ucp_config_release": (None, [_P]),
    "ucp_init_version": (_S, [C.c_uint, C.c_uint, C.POINTER(_Params), _P, _PP]),
    "ucp_cleanup": (None, [_P]),
    "ucp_worker_create": (_S, [_P, C.POINTER(_WorkerParams), _PP]),
    "ucp_worker_query": (_S, [_P, C.POINTER(_WorkerAttr)]),
    "ucp_worker_destroy": (None, [_P]),
    "ucp_worker_get_address": (_S, [_P, _PP, C.POINTER(_SZ)]),
    "ucp_worker_release_address": (None, [_P, _P]),
    "ucp_worker_progress": (C.c_uint, [_P]),
    "ucp_worker_get_efd": (_S, [_P, C.POINTER(C.c_int)]),
    "ucp_worker_arm": (_S, [_P]),
    "ucp_worker_signal": (_S, [_P]),
    "ucp_worker_print_info": (None, [_P, _P]),
    "ucp_ep_create": (_S, [_P, C.POINTER(_EpParams), _PP]),
    "ucp_ep_close_nbx": (_P, [_P, C.POINTER(_RequestParam)]),
    "ucp_ep_flush_nbx": (_P, [_P, C.POINTER(_RequestParam)]),
    "ucp_ep_print_info": (None, [_P, _P]),
    "ucp_mem_map": (_S, [_P, C.POINTER(_MemMapParams), _PP]),
    "ucp_mem_unmap": (_S, [_P, _P]),
    "ucp_mem_query": (_S, [_P, C.POINTER(_MemAttr)]),
    "ucp_rkey_pack": (_S, [_P, _P, _PP, C.POINTER(_SZ)]),
    "ucp_rkey_buffer_release": (None, [_P]),
    "ucp_ep_rkey_unpack": (_S, [_P, _P, _PP]),
    "ucp_rkey_destroy": (None, [_P]),
    "ucp_put_nbx": (_P, [_P, _P, _SZ, _U64, _P, C.POINTER(_RequestParam)]),
    "ucp_get_nbx": (_P, [_P, _P, _SZ, _U64, _P, C.POINTER(_RequestParam)]),
    "ucp_request_check_status": (_S, [_P]),
    "ucp_request_cancel": (None, [_P, _P]),
    "ucp_request_free": (None, [_P]),
}


def libucx_dir() -> str:
    """Directory of the libucx wheel package (holds lib/, bin/, include/)."""
    try:
        import libucx  # the libucx-cu12 wheel (mpcomm[ucx]); ucxx-cu12 is not needed
    except ImportError as exc:
        raise UcxUnavailable(f"libucx (the libucx-cu12 wheel) is not installed ({exc})") from None
    return os.path.dirname(os.path.abspath(libucx.__file__))


def tool(name: str = "ucx_perftest"):
    """(path, env) to run a bundled UCX binary such as ucx_perftest/ucx_info.
    The wheel's binaries have no RPATH to libucx/lib, so LD_LIBRARY_PATH is needed."""
    d = libucx_dir()
    env = dict(os.environ)
    env["LD_LIBRARY_PATH"] = os.pathsep.join(
        p for p in (os.path.join(d, "lib"), env.get("LD_LIBRARY_PATH")) if p)
    return os.path.join(d, "bin", name), env


def load(path: str | None = None):
    """Load libucp (idempotent). Order: explicit path, $MPCOMM_LIBUCP, libucx wheel."""
    global _lib, _ucs
    if _lib is not None:
        return _lib
    path = path or os.environ.get("MPCOMM_LIBUCP")
    if not path:
        path = os.path.join(libucx_dir(), "lib", "libucp.so")
    if not os.path.exists(path):
        raise UcxUnavailable(f"libucp.so not found at {path}")
    try:
        # libucp's RPATH has $ORIGIN so libucs/libuct/libucm resolve next to it;
        # RTLD_LOCAL mirrors libucx.load_library() so we share instances with ucxx.
        lib = C.CDLL(path, C.RTLD_LOCAL)
        ucs = C.CDLL(os.path.join(os.path.dirname(path), "libucs.so.0"), C.RTLD_LOCAL)
    except OSError as exc:
        raise UcxUnavailable(f"cannot load {path}: {exc}") from None
    for name, (res, args) in _SIGS.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = res, args
    ucs.ucs_status_string.restype = C.c_char_p
    ucs.ucs_status_string.argtypes = [_STATUS]
    major, minor, rel = C.c_uint(), C.c_uint(), C.c_uint()
    lib.ucp_get_version(C.byref(major), C.byref(minor), C.byref(rel))
    if major.value != _API_MAJOR:
        raise UcxUnavailable(f"unsupported UCX version {major.value}.{minor.value}")
    lib.version = (major.value, minor.value, rel.value)
    _lib, _ucs = lib, ucs
    return lib


def version() -> tuple:
    return load().version


def status_string(status: int) -> str:
    if _ucs is None:
        return f"ucs_status {status}"
    return _ucs.ucs_status_string(status).decode()


def _check(status: int, where: str):
    if status != UCS_OK:
        raise UcxError(status, where=where)


def _dump(printer, handle) -> str:
    """ucp_*_print_info only writes to a FILE*, so go through a temp file."""
    with tempfile.NamedTemporaryFile("r", suffix=".ucxinfo") as tmp:
        fp = _libc.fopen(tmp.name.encode(), b"w")
        printer(handle, fp)
        _libc.fclose(fp)
        return tmp.read()


def _req_param(memh=None) -> _RequestParam:
    p = _RequestParam()
    if memh is not None:
        # Lets UCX skip its registration-cache lookup for the local buffer.
        p.op_attr_mask |= _OP_ATTR_FIELD_MEMH
        p.memh = memh._h
    return p


# --- objects ------------------------------------------------------------------
class Context:
    """ucp_context: owns transport resources and memory registrations.

    features: FEATURE_* bits; WAKEUP is included by default for Worker.wait().
    env: UCX settings without the UCX_ prefix (e.g. {"TLS": "tcp"}) applied on top
         of what ucp_config_read took from the environment (UCX_TLS etc. are honoured)."""

    def __init__(self, features: int = FEATURE_RMA | FEATURE_WAKEUP, env: dict | None = None,
                 shared_workers: bool = True):
        lib = load()
        cfg = C.c_void_p()
        _check(lib.ucp_config_read(None, None, C.byref(cfg)), "ucp_config_read")
        try:
            for k, v in (env or {}).items():
                _check(lib.ucp_config_modify(cfg, k.encode(), str(v).encode()),
                       f"ucp_config_modify({k})")
            p = _Params(field_mask=_PARAM_FIELD_FEATURES | _PARAM_FIELD_MT_WORKERS_SHARED,
                        features=features, mt_workers_shared=int(shared_workers))
            # Ask for the lowest of (library, our checked layouts) so neither side
            # assumes fields the other does not know.
            minor = min(lib.version[1], _API_MINOR)
            h = C.c_void_p()
            _check(lib.ucp_init_version(_API_MAJOR, minor, C.byref(p), cfg, C.byref(h)), "ucp_init")
        finally:
            lib.ucp_config_release(cfg)
        self._h, self._lib = h, lib
        self._workers: list[Worker] = []
        #: Memory handles mapped through this context (the transport removes one it unmaps).
        self.memhs: list[MemHandle] = []

    def create_worker(self, thread_mode: int = THREAD_MULTI) -> "Worker":
        w = Worker(self, thread_mode)
        self._workers.append(w)
        return w

    def mem_map(self, addr: int | None, length: int, prot: int | None = None,
                memory_type: int | None = None) -> "MemHandle":
        """Register [addr, addr+length). addr=None: UCX allocates (see .address).
        prot: PROT_* bits (UCX's default is all four). Only hardware transports
        (InfiniBand) enforce remote bits; tcp, shm and cma ignore them.
        memory_type: MEMORY_TYPE_* (device memory: MEMORY_TYPE_CUDA); None lets
        UCX detect it."""
        p = _MemMapParams(field_mask=_MM_FIELD_ADDRESS | _MM_FIELD_LENGTH | _MM_FIELD_FLAGS,
                          address=addr, length=length, flags=0 if addr else _MM_ALLOCATE)
        if prot is not None:
            p.field_mask |= _MM_FIELD_PROT
            p.prot = prot
        if memory_type is not None:
            p.field_mask |= _MM_FIELD_MEMORY_TYPE
            p.memory_type = memory_type
        h = C.c_void_p()
        _check(self._lib.ucp_mem_map(self._h, C.byref(p), C.byref(h)), "ucp_mem_map")
        a = _MemAttr(field_mask=_MEM_ATTR_ADDRESS | _MEM_ATTR_LENGTH)
        _check(self._lib.ucp_mem_query(h, C.byref(a)), "ucp_mem_query")
        m = MemHandle(self, h, a.address, a.length)
        self.memhs.append(m)
        return m

    def close(self):
        """Tear down in dependency order: workers (and their eps), memhs, context."""
        if self._h is None:
            return
        for w in self._workers:
            w.close()
        for m in self.memhs:
            m.unmap()
        self._lib.ucp_cleanup(self._h)
        self._h = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class MemHandle:
    def __init__(self, ctx, h, address, length):
        self._ctx, self._h, self.address, self.length = ctx, h, address, length

    def pack_rkey(self) -> bytes:
        buf, size = C.c_void_p(), C.c_size_t()
        _check(self._ctx._lib.ucp_rkey_pack(self._ctx._h, self._h, C.byref(buf), C.byref(size)),
               "ucp_rkey_pack")
        try:
            return C.string_at(buf, size.value)
        finally:
            self._ctx._lib.ucp_rkey_buffer_release(buf)

    def unmap(self):
        if self._h is not None:
            _check(self._ctx._lib.ucp_mem_unmap(self._ctx._h, self._h), "ucp_mem_unmap")
            self._h = None


class Worker:
    """ucp_worker. Default THREAD_MULTI: ctypes drops the GIL during every call, so
    Python code cannot cheaply guarantee the serialization SERIALIZED demands
    (e.g. a progress thread plus issuing threads); UCX's own worker lock costs
    ~tens of ns, noise next to ~1us of ctypes overhead per call."""

    def __init__(self, ctx: Context, thread_mode: int):
        self._ctx, self._lib = ctx, ctx._lib
        p = _WorkerParams(field_mask=_WORKER_PARAM_FIELD_THREAD_MODE, thread_mode=thread_mode)
        h = C.c_void_p()
        _check(self._lib.ucp_worker_create(ctx._h, C.byref(p), C.byref(h)), "ucp_worker_create")
        self._h = h
        attr = _WorkerAttr(field_mask=_WORKER_ATTR_FIELD_THREAD_MODE)
        _check(self._lib.ucp_worker_query(h, C.byref(attr)), "ucp_worker_query")
        self.thread_mode = attr.thread_mode  # what UCX actually granted
        self._endpoints: list[Endpoint] = []
        self._efd = None

    @property
    def address(self) -> bytes:
        addr, size = C.c_void_p(), C.c_size_t()
        _check(self._lib.ucp_worker_get_address(self._h, C.byref(addr), C.byref(size)),
               "ucp_worker_get_address")
        try:
            return C.string_at(addr, size.value)
        finally:
            self._lib.ucp_worker_release_address(self._h, addr)

    def progress(self) -> int:
        return self._lib.ucp_worker_progress(self._h)

    def fileno(self) -> int:
        if self._efd is None:
            fd = C.c_int()
            _check(self._lib.ucp_worker_get_efd(self._h, C.byref(fd)), "ucp_worker_get_efd")
            self._efd = fd.value
        return self._efd

    def arm(self) -> bool:
        """Arm the efd. False means there is work (a progress call just did some, or
        UCS_ERR_BUSY): look at your requests and progress again instead of sleeping, or
        completions that progress call produced are never looked at.
        Use with fileno() to sleep in your own select/poll/epoll loop."""
        if self.progress():
            return False
        st = self._lib.ucp_worker_arm(self._h)
        if st == UCS_ERR_BUSY:
            return False
        _check(st, "ucp_worker_arm")
        return True

    def wait(self, timeout: float | None = None) -> bool:
        """Sleep until the worker has events (or timeout); True if woken.
        Needs FEATURE_WAKEUP."""
        fd = self.fileno()
        if not self.arm():
            return True
        r, _, _ = select.select([fd], [], [], timeout)
        return bool(r)

    def progress_loop(self, spin: float = 0.0, claim: float = 0.0, linger: float = 0.0):
        """This worker's progress in a native loop that never takes the GIL, or None without the helper.

        A ``_native.ProgressLoop`` (not started): it progresses the worker and sleeps on its
        event fd (``ucp_worker_arm`` + ``poll``) until stopped; ``spin`` seconds of polling after
        the last work; a request handed off gets ``claim`` seconds in which a result() waiter may
        claim it before the loop wakes the bookkeeping thread for it; a result() waiter polls the
        worker itself while the loop parks, and ``linger`` seconds after the last one left (0: never
        parks, waiters wait on the loop). Stop it before :meth:`close`."""
        if _native_helper() is None or self._h is None:
            return None
        fns = _fn_pointers(self._lib)
        return _native_state[1].ProgressLoop(_native_state[0], fns[3], fns[6], fns[7], fns[4], self._h.value,
                                             self.fileno(), int(spin * 1e9), int(claim * 1e9), int(linger * 1e9))

    def signal(self):
        """Wake a thread blocked in wait()."""
        _check(self._lib.ucp_worker_signal(self._h), "ucp_worker_signal")

    def connect(self, address: bytes, error_handling: bool = True, on_error=None) -> "Endpoint":
        ep = Endpoint(self, address, error_handling, on_error)
        self._endpoints.append(ep)
        return ep

    def info(self) -> str:
        return _dump(self._lib.ucp_worker_print_info, self._h)

    def close(self):
        if self._h is None:
            return
        for ep in list(self._endpoints):
            try:
                ep.close(force=True, timeout=2.0)
            except UcxError:
                pass
        self._lib.ucp_worker_destroy(self._h)
        self._h = None


class Endpoint:
    def __init__(self, worker: Worker, address: bytes, error_handling: bool, on_error):
        self.worker, self._lib = worker, worker._lib
        self.error_status = None  # set (from inside progress) when the peer fails
        self._on_error = on_error
        #: Remote keys unpacked on this endpoint (the transport removes one it destroys).
        self.rkeys: list[RemoteKey] = []
        self._params: dict = {}
        self._flush_param = _req_param()
        addr_buf = C.create_string_buffer(address, len(address))
        p = _EpParams(field_mask=_EP_FIELD_REMOTE_ADDRESS | _EP_FIELD_ERR_MODE, address=C.addressof(addr_buf),
                      err_mode=_ERR_MODE_PEER if error_handling else _ERR_MODE_NONE)
        if error_handling:
            # The CFUNCTYPE object must outlive the ep or UCX calls freed memory.
            self._cb = _ERR_CB(self._handle_error)
            p.field_mask |= _EP_FIELD_ERR_HANDLER
            p.err_cb = self._cb
        h = C.c_void_p()
        _check(self._lib.ucp_ep_create(worker._h, C.byref(p), C.byref(h)), "ucp_ep_create")
        self._h = h

    def _handle_error(self, arg, ep, status):
        # Runs inside ucp_worker_progress; keep it to bookkeeping.
        self.error_status = status
        if self._on_error is not None:
            self._on_error(self, UcxError(status, where="peer failure"))

    def unpack_rkey(self, packed: bytes) -> "RemoteKey":
        h = C.c_void_p()
        _check(self._lib.ucp_ep_rkey_unpack(self._h, packed, C.byref(h)), "ucp_ep_rkey_unpack")
        rk = RemoteKey(self._lib, h)
        self.rkeys.append(rk)
        return rk

    def _issue(self, fn, name, local_addr, length, remote_addr, rkey, memh):
        if self.error_status is not None:
            raise UcxError(self.error_status, where=name)
        p = _req_param(memh)
        r = fn(self._h, local_addr, length, remote_addr, rkey._h, C.byref(p))
        return Request._wrap(self.worker, r, name)

    def _param(self, memh: MemHandle | None) -> "_RequestParam":
        """The request parameters for ``memh``, built once and reused (UCX reads them only during a call)."""
        p = self._params.get(memh)
        if p is None:
            p = self._params[memh] = _req_param(memh)
        return p

    def _multi_param(self, memh: MemHandle | None) -> "_RequestParam":
        """The request parameters of a group's pieces for ``memh`` (UCP_OP_ATTR_FLAG_MULTI_SEND), built once."""
        key = ("many", memh)
        p = self._params.get(key)
        if p is None:
            p = self._params[key] = _req_param(memh)
            p.op_attr_mask |= _OP_ATTR_FIELD_FLAGS
            p.flags = _OP_ATTR_FLAG_MULTI_SEND
        return p

    def rma_lane(self, write: bool, rkey: "RemoteKey", memh: MemHandle | None, gates: tuple, local: tuple,
                 remote: tuple, limit: int, merge: int, active: set, signal, on_pending) -> tuple | None:
        """A bound lane, the fast path's one native entry: ``(move, raw)``, two callables over it.

        Each takes ``(lo, ro, n)`` (one request: a group of one) or ``(loffs, roffs, lens)``
        (int64 arrays of a group) and is issued without any lock: every piece checked against
        ``local``/``remote`` ((address, size) of the two regions) where it is issued, then, for
        a write or a get UCX left in flight, the endpoint flush that completes them (see
        ``mp_move`` in _ucxloop.c). Both answer False when they declined (nothing issued: more
        than ``limit`` bytes in all, no byte, the one piece of a group of one out of bounds, a
        gate shut) and True when everything landed. Otherwise ``move`` answers
        ``on_pending(code, flush, statuses)`` and ``raw`` returns that tuple: ``code`` 0 done, a
        negative status (the flush failed) or 2 with ``flush`` the :class:`Request` still in
        flight (else None); ``statuses`` maps each refused index to its status (empty if none).
        ``signal()`` is called after an issue while ``active`` is not empty.

        ``gates`` is (this endpoint's gate, the attachment's gate) from :func:`_native.gate`.
        The caller's promise: before it closes this endpoint or destroys ``rkey`` (or revokes
        what the lane reaches) it shuts a gate and waits until the endpoint gate's in-flight
        count is 0; ``on_pending`` runs before that count drops. None without the extension
        module (or an endpoint or rkey already closed).
        """
        nat = _native_module()
        if nat is None or self._h is None or rkey._h is None:
            return None
        mod, _ = nat
        Lane = _native_state[1].Lane
        p, mp = self._param(memh), self._multi_param(memh)
        fns = _fn_pointers(self._lib)
        lane = Lane()
        c = lane.call
        c.fn, c.check, c.rfree, c.progress, c.flush = fns[0] if write else fns[1], fns[4], fns[2], fns[3], fns[5]
        c.ep, c.worker, c.rkey = self._h.value, self.worker._h.value, rkey._h.value
        c.param, c.fparam, c.write = C.addressof(p), C.addressof(self._flush_param), int(write)
        lane.ep_gate, lane.att_gate = C.addressof(gates[0]), C.addressof(gates[1])
        lane.laddr, lane.lsize = local
        lane.rbase, lane.rsize = remote
        lane.limit, lane.merge, lane.mparam = limit, merge, C.addressof(mp)
        worker = self.worker

        def answer(code: int, ptr: int, statuses: bytes | None) -> tuple:
            flush = Request(worker, ptr, "ucp_ep_flush_nbx") if code == 2 else None
            failed = {i: st - 256 if st > 127 else st for i, st in enumerate(statuses) if st} if statuses else {}
            return code, flush, failed

        def pending(code: int, ptr: int, statuses: bytes | None) -> Any:
            return on_pending(*answer(code, ptr, statuses))

        def raw(*args: Any) -> Any:
            got = one(*args)
            return got if isinstance(got, bool) else answer(*got)

        keep = (lane, p, mp, rkey, gates, self)  # what the lane's pointers point into stays alive with it
        one = mod.lane(C.addressof(lane), active, signal, None, keep)
        return mod.lane(C.addressof(lane), active, signal, pending, keep), raw

    def rma_many(self, write: bool, local_addrs, remote_addrs, lengths, rkey: "RemoteKey",
                 memh: MemHandle | None = None) -> dict:
        """Issue N puts/gets (sequences of addresses and lengths) without tracking each request.

        Every request UCX returns is released at once (``ucp_request_free`` on a pending
        request lets UCX free it when it completes); completion of all of them, and of their
        remote side, is what a following endpoint flush reports. Returns {index: status} of
        the ones UCX refused immediately (nothing of those was issued)."""
        if self.error_status is not None:
            return {i: self.error_status for i in range(len(lengths))}
        p = self._multi_param(memh)
        lib = self._lib
        fn = lib.ucp_put_nbx if write else lib.ucp_get_nbx
        free, h, rk, ref = lib.ucp_request_free, self._h, rkey._h, C.byref(p)
        last = UCS_ERR_LAST & 0xFFFFFFFFFFFFFFFF
        failed = {}
        i = 0
        for la, ra, n in zip(local_addrs, remote_addrs, lengths):
            r = fn(h, la, n, ra, rk, ref)
            if r:
                if r >= last:
                    failed[i] = r - (1 << 64)
                else:
                    free(r)
            i += 1
        return failed

    def rma_group(self, write: bool, lbase: int, lsize: int, local_offsets, rbase: int, rsize: int, remote_offsets,
                  lengths, rkey: "RemoteKey", memh: MemHandle | None = None, merge: int = 0) -> dict:
        """rma_many over ``base + offset`` arrays (``array('q')``), in the compiled helper when
        there is one (issue, release and progress without the interpreter), else in Python.
        The worker is progressed while it reports work afterwards either way. With the helper,
        pieces adjacent on both sides go as one operation of up to ``merge`` bytes (0: never);
        a refusal then names every index that operation covered. Every piece is checked where
        it is issued against ``lsize`` and ``rsize`` (the rule of ``mpcomm.engine.checks.fits``):
        one outside its region is never issued and reported as ``UCS_ERR_OUT_OF_RANGE``."""
        native = _native_helper()
        n = len(lengths)
        if native is None or self.error_status is not None or n == 0:
            pieces = [(lo, ro, k) for lo, ro, k in zip(local_offsets, remote_offsets, lengths)]
            ok = [i for i, (lo, ro, k) in enumerate(pieces)
                  if 0 <= k <= lsize and k <= rsize and 0 <= lo <= lsize - k and 0 <= ro <= rsize - k]
            got = self.rma_many(write, [lbase + pieces[i][0] for i in ok], [rbase + pieces[i][1] for i in ok],
                                [pieces[i][2] for i in ok], rkey, memh)
            failed = {ok[i]: st for i, st in got.items()}
            if len(ok) != n:
                good = set(ok)
                failed.update((i, UCS_ERR_OUT_OF_RANGE) for i in range(n) if i not in good)
            self.progress_all()
            return failed
        p = self._multi_param(memh)
        lib = self._lib
        fns = _fn_pointers(lib)
        arr = C.c_int64 * n
        status = (C.c_int8 * n)()
        refused = native.mpcomm_ucx_rma_many(
            fns[0] if write else fns[1], fns[2], fns[3], self._h, self.worker._h,
            arr.from_buffer(local_offsets), lbase, lsize, arr.from_buffer(remote_offsets), rbase, rsize,
            arr.from_buffer(lengths), n, rkey._h, C.byref(p), status, merge)
        if not refused:
            return {}
        return {i: status[i] for i in range(n) if status[i]}

    def progress_all(self) -> None:
        """ucp_worker_progress until it reports nothing more (local work only)."""
        progress, wh = self._lib.ucp_worker_progress, self.worker._h
        while progress(wh):
            pass

    def flush_now(self) -> "Request | int":
        """ucp_ep_flush_nbx: UCS_OK when nothing was outstanding, a status, or the pending Request."""
        r = self._lib.ucp_ep_flush_nbx(self._h, C.byref(self._flush_param))
        if not r:
            return UCS_OK
        if r >= (UCS_ERR_LAST & 0xFFFFFFFFFFFFFFFF):
            return r - (1 << 64)
        return Request(self.worker, r, "ucp_ep_flush_nbx")

    def put(self, local_addr: int, length: int, remote_addr: int, rkey: "RemoteKey",
            memh: MemHandle | None = None) -> "Request | None":
        """Local completion only (buffer reusable); use flush() for remote completion."""
        return self._issue(self._lib.ucp_put_nbx, "ucp_put_nbx", local_addr, length,
                           remote_addr, rkey, memh)

    def get(self, local_addr: int, length: int, remote_addr: int, rkey: "RemoteKey",
            memh: MemHandle | None = None) -> "Request | None":
        return self._issue(self._lib.ucp_get_nbx, "ucp_get_nbx", local_addr, length,
                           remote_addr, rkey, memh)

    def flush(self) -> "Request | None":
        return Request._wrap(self.worker, self._lib.ucp_ep_flush_nbx(self._h, C.byref(_req_param())),
                             "ucp_ep_flush_nbx")

    def info(self) -> str:
        """ucp_ep_print_info: lanes/transports chosen for this endpoint."""
        return _dump(self._lib.ucp_ep_print_info, self._h)

    def close(self, force: bool = False, timeout: float | None = 10.0):
        """Flush-close (default) needs the peer alive and progressing; force=True
        just releases local resources and is the only option after a peer failure."""
        if self._h is None:
            return
        for rk in self.rkeys:
            rk.destroy()
        p = _RequestParam(op_attr_mask=_OP_ATTR_FIELD_FLAGS,
                          flags=_EP_CLOSE_FLAG_FORCE if force else 0)
        h, self._h = self._h, None
        try:
            self.worker._endpoints.remove(self)
        except ValueError:
            pass
        req = Request._wrap(self.worker, self._lib.ucp_ep_close_nbx(h, C.byref(p)),
                            "ucp_ep_close_nbx", raise_now=False)
        if isinstance(req, Request):
            req.wait(timeout)


class RemoteKey:
    def __init__(self, lib, h):
        self._lib, self._h = lib, h

    def destroy(self):
        if self._h is not None:
            self._lib.ucp_rkey_destroy(self._h)
            self._h = None


class Request:
    """A pending UCP operation. UCX owns the memory; free() exactly once (wait()
    and the error paths do it for you)."""

    def __init__(self, worker, ptr, name):
        self.worker, self._ptr, self.name = worker, ptr, name
        #: The request's last status, kept when it is freed (None until then).
        self.final_status = None

    @staticmethod
    def _wrap(worker, r, name, raise_now=True):
        # ucs_status_ptr_t: NULL = done, small negative = error, else a request.
        if not r:
            return None
        if r >= (UCS_ERR_LAST & 0xFFFFFFFFFFFFFFFF):
            st = r - (1 << 64)
            if raise_now:
                raise UcxError(st, where=name)
            return st
        return Request(worker, r, name)

    def status(self) -> int:
        """UCS_INPROGRESS (1), UCS_OK (0) or a negative ucs_status_t."""
        if self._ptr is None:
            return self.final_status
        return self.worker._lib.ucp_request_check_status(self._ptr)

    @property
    def address(self) -> int:
        """The UCX request's address (0 once freed): for a native wait on it by its only freer."""
        return self._ptr or 0

    @property
    def done(self) -> bool:
        return self.status() != UCS_INPROGRESS

    def cancel(self):
        # Only receive-type requests are truly cancellable in UCP; RMA ops ignore it.
        if self._ptr is not None:
            self.worker._lib.ucp_request_cancel(self.worker._h, self._ptr)

    def free(self):
        if self._ptr is not None:
            self.final_status = self.status()
            self.worker._lib.ucp_request_free(self._ptr)
            self._ptr = None

    def wait(self, timeout: float | None = None, blocking: bool = False):
        """Progress until complete; raise UcxError on failure or after timeout
        (UCS_ERR_TIMED_OUT, request freed so UCX reclaims it on completion).
        blocking=True sleeps on the worker efd instead of spinning."""
        deadline = None if timeout is None else time.monotonic() + timeout
        w = self.worker
        while True:
            st = self.status()
            if st != UCS_INPROGRESS:
                self.free()
                if st != UCS_OK:
                    raise UcxError(st, where=self.name)
                return
            if deadline is not None and time.monotonic() >= deadline:
                self.free()
                raise UcxError(UCS_ERR_TIMED_OUT, where=self.name + " (deadline)")
            if not w.progress() and blocking:
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                w.wait(min(left, 0.1) if left is not None else 0.1)


_native_state: list = []
_fn_cache: dict = {}


def _native_helper():
    """The compiled batch helper (plugins/ucx/_native.py) or None; loaded once."""
    if not _native_state:
        try:
            from . import _native  # absent when this file is loaded by path (tests' peers)
            _native_state.extend((_native.load(), _native))
        except ImportError:
            _native_state.extend((None, None))
    return _native_state[0]


def _native_module():
    """(the helper's extension module, its RmaCall struct) or None."""
    if _native_helper() is None:  # no helper (or disabled): no module either
        return None
    nat = _native_state[1]
    mod = nat.module() if nat is not None else None
    return None if mod is None else (mod, nat.RmaCall)


def _fn_pointers(lib):
    fns = _fn_cache.get(id(lib))
    if fns is None:
        fns = _fn_cache[id(lib)] = tuple(C.cast(getattr(lib, name), C.c_void_p).value for name in (
            "ucp_put_nbx", "ucp_get_nbx", "ucp_request_free", "ucp_worker_progress", "ucp_request_check_status",
            "ucp_ep_flush_nbx", "ucp_worker_arm", "ucp_worker_signal"))
    return fns


def wait_all(reqs, timeout: float | None = None, blocking: bool = False):
    for r in reqs:
        if r is not None:
            r.wait(timeout, blocking)


def buffer_address(buf) -> int:
    """Address of a writable buffer-protocol object (bytearray, mmap, numpy)."""
    return C.addressof(C.c_char.from_buffer(buf))


def cuda_unavailable_reason() -> str | None:
    """None when device (CUDA) buffers can go through UCX here, else why not.

    Needs UCX built with CUDA (the libucx wheel ships lib/ucx/libuct_cuda.so),
    a loadable driver (libcuda.so.1) and at least one visible GPU."""
    try:
        d = libucx_dir()
    except UcxUnavailable as exc:
        return str(exc)
    if not os.path.exists(os.path.join(d, "lib", "ucx", "libuct_cuda.so")):
        return "this UCX build has no CUDA transport (lib/ucx/libuct_cuda.so missing)"
    try:
        cuda = C.CDLL("libcuda.so.1")
    except OSError:
        return "no CUDA driver (libcuda.so.1 not loadable)"
    if cuda.cuInit(0) != 0:
        return "cuInit failed (no usable GPU)"
    n = C.c_int()
    if cuda.cuDeviceGetCount(C.byref(n)) != 0 or n.value < 1:
        return "no CUDA device visible"
    return None
