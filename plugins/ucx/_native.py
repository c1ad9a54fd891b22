"""Optional compiled helper for batches: N puts/gets in one call outside the interpreter.

A batch of N small puts costs two ctypes calls per put from Python (issue, and the
progress call that completes it) -- about 3 µs each here, against 0.7 µs in C. This
module compiles (once, with the system C compiler, into a private cache directory)
a 30-line loop that calls UCX through the function pointers the ctypes binding
already resolved, so it needs neither UCX headers nor linking. Where no compiler is
available, or ``MPCOMM_UCX_NATIVE=0``, :func:`load` returns None and the binding
falls back to the same loop in Python.
"""

from __future__ import annotations

import ctypes as C
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading

SOURCE = r"""
#include <stdint.h>
#include <stddef.h>
typedef void *(*rma_fn)(void *, void *, size_t, uint64_t, void *, const void *);
typedef void (*free_fn)(void *);
typedef unsigned (*progress_fn)(void *);

/* Issue n puts (or gets); release every request UCX returns (it frees it once done);
   status[i] = 0 when issued, the ucs_status_t when refused at once. Then progress
   the worker while it reports work (local completions). Returns the refused count. */
int64_t mpcomm_ucx_rma_many(rma_fn fn, free_fn rfree, progress_fn progress, void *ep, void *worker,
                            const int64_t *loff, int64_t lbase, const int64_t *roff, int64_t rbase,
                            const int64_t *len, int64_t n, void *rkey, const void *param, int8_t *status)
{
    int64_t refused = 0;
    for (int64_t i = 0; i < n; i++) {
        void *r = fn(ep, (void *)(intptr_t)(lbase + loff[i]), (size_t)len[i],
                     (uint64_t)(rbase + roff[i]), rkey, param);
        if ((uintptr_t)r >= (uintptr_t)(intptr_t)-100) {   /* UCS_PTR_IS_ERR */
            status[i] = (int8_t)(intptr_t)r;
            refused++;
        } else {
            status[i] = 0;
            if (r != NULL)
                rfree(r);
        }
    }
    while (progress(worker))
        ;
    return refused;
}

typedef int (*check_fn)(void *);
typedef void *(*flush_fn)(void *, const void *);

/* What UCX returned for an operation, settled while the worker makes local progress:
   0 done, a negative status on failure, or `code` with *pending = r still in flight. */
static int64_t settle(void *r, int64_t code, check_fn check, free_fn rfree, progress_fn progress, void *worker,
                      void **pending)
{
    if ((uintptr_t)r >= (uintptr_t)(intptr_t)-100)   /* UCS_PTR_IS_ERR */
        return (int64_t)(intptr_t)r;
    if (r == NULL)
        return 0;
    int st = check(r);
    while (st == 1 && progress(worker))
        st = check(r);
    if (st == 1) {
        *pending = r;
        return code;
    }
    rfree(r);
    return st;
}

/* The small-request path in one call: a put (then the endpoint flush, for remote completion)
   or a get, progressing the worker while it reports work -- local work only, never a wait on
   the peer. Returns 0 when done, a negative ucs_status_t on failure, or 1 (the put/get) / 2
   (the flush) with *pending set to the request still in flight. */
int64_t mpcomm_ucx_rma_one(rma_fn fn, check_fn check, free_fn rfree, progress_fn progress, flush_fn flush,
                           void *ep, void *worker, int64_t laddr, int64_t n, int64_t raddr, void *rkey,
                           const void *param, const void *fparam, int64_t write, void **pending)
{
    int64_t st = settle(fn(ep, (void *)(intptr_t)laddr, (size_t)n, (uint64_t)raddr, rkey, param), 1, check,
                        rfree, progress, worker, pending);
    if (st != 0 || !write)
        return st;
    return settle(flush(ep, fparam), 2, check, rfree, progress, worker, pending);
}
"""

_lock = threading.Lock()
_lib: C.CDLL | None = None
_tried = False


def _cache_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    d = os.path.join(base, "mpcomm")
    os.makedirs(d, mode=0o700, exist_ok=True)
    st = os.stat(d)
    if st.st_uid != os.getuid() or st.st_mode & 0o022:
        raise OSError(f"{d} is not private to this user")  # someone else could swap the library
    return d


def load() -> C.CDLL | None:
    """The compiled helper, or None (no compiler, disabled, or it failed: the Python loop is used)."""
    global _lib, _tried
    with _lock:
        if _tried:
            return _lib
        _tried = True
        if os.environ.get("MPCOMM_UCX_NATIVE", "1") == "0":
            return None
        try:
            _lib = _build()
        except Exception:  # noqa: BLE001 - optional: any failure means the Python fallback
            _lib = None
        return _lib


def _build() -> C.CDLL | None:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        return None
    tag = hashlib.sha256(SOURCE.encode()).hexdigest()[:16]
    d = _cache_dir()
    so = os.path.join(d, f"ucx_many-{tag}.so")
    if not os.path.exists(so):
        with tempfile.TemporaryDirectory(dir=d) as tmp:
            src = os.path.join(tmp, "ucx_many.c")
            with open(src, "w") as f:
                f.write(SOURCE)
            out = os.path.join(tmp, "ucx_many.so")
            subprocess.run([cc, "-O2", "-shared", "-fPIC", "-o", out, src], check=True, timeout=60,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            os.replace(out, so)  # atomic: a concurrent builder sees the old or the new file, never half
    lib = C.CDLL(so)
    f = lib.mpcomm_ucx_rma_many
    f.restype = C.c_int64
    f.argtypes = [C.c_void_p] * 5 + [C.c_void_p, C.c_int64, C.c_void_p, C.c_int64, C.c_void_p, C.c_int64,
                                     C.c_void_p, C.c_void_p, C.c_void_p]
    g = lib.mpcomm_ucx_rma_one
    g.restype = C.c_int64
    g.argtypes = [C.c_void_p] * 7 + [C.c_int64, C.c_int64, C.c_int64, C.c_void_p, C.c_void_p, C.c_void_p,
                                     C.c_int64, C.c_void_p]
    return lib
