/* The shm transport's copy loop: many (dst, src, len) pieces in one call.
 *
 * Compiled at first use by plugins/shm/_copyloop.py with the system `cc` into a
 * per-user cache and loaded with ctypes.CDLL, which releases the GIL for the
 * whole call. Nothing here allocates, keeps state or calls back into Python;
 * the Python fallback in _copyloop.py implements the same functions.
 *
 * Liveness: `pidfd` (or -1) is a pidfd of the process owning the target memory.
 * A pidfd polls readable once that process has exited, so a copy that returns
 * 0 finished while the owner was alive; -ESRCH means the owner is gone and the
 * bytes (if any moved) will never be read.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <poll.h>
#include <stdint.h>
#include <string.h>
#include <sys/types.h>
#include <sys/uio.h>

#define MP_ABI 1
#define MP_IOV 1024 /* IOV_MAX on Linux */

int mp_abi(void) { return MP_ABI; }

/* 0: alive (or unknown, pidfd < 0), -ESRCH: exited, -errno: poll failed. */
int mp_alive(int pidfd) {
    if (pidfd < 0)
        return 0;
    struct pollfd p = {pidfd, POLLIN, 0};
    int r;
    do {
        r = poll(&p, 1, 0);
    } while (r < 0 && errno == EINTR);
    if (r < 0)
        return -errno;
    return r == 0 ? 0 : -ESRCH;
}

/* One contiguous copy, then the owner's liveness. */
int64_t mp_copy(char *dst, const char *src, int64_t n, int pidfd) {
    memcpy(dst, src, (size_t)n);
    return mp_alive(pidfd);
}

/* The first index i in [0, n) with off[i] < 0, len[i] < 0 or off[i] + len[i] > size,
 * or, when every piece lies inside [0, size), -1 - (the sum of len). */
int64_t mp_check(const int64_t *off, const int64_t *len, int64_t n, int64_t size) {
    int64_t sum = 0;
    for (int64_t i = 0; i < n; i++) {
        int64_t o = off[i], l = len[i];
        if (o < 0 || l < 0 || o > size || l > size - o || sum > INT64_MAX - 1 - l)
            return i;
        sum += l;
    }
    return -1 - sum;
}

/* Both sides of a batch in one pass: the first bad remote index i (returned as
 * i), else the first bad local index i (returned as n + i), else -1 - total. */
int64_t mp_check2(const int64_t *roff, const int64_t *loff, const int64_t *len, int64_t n, int64_t rsize,
                  int64_t lsize) {
    int64_t r = mp_check(roff, len, n, rsize);
    if (r >= 0)
        return r;
    int64_t l = mp_check(loff, len, n, lsize);
    return l >= 0 ? n + l : r;
}

/* Copy pieces start.. (dst + doff[i] <- src + soff[i], len[i]) until at least
 * `budget` bytes moved or n is reached; returns the next index, or -ESRCH when
 * the owner died (checked once, after the copies). */
int64_t mp_copy_many(char *dst, const int64_t *doff, const char *src, const int64_t *soff, const int64_t *len,
                     int64_t start, int64_t n, int64_t budget, int pidfd) {
    int64_t moved = 0, i = start;
    while (i < n) {
        memcpy(dst + doff[i], src + soff[i], (size_t)len[i]);
        moved += len[i];
        i++;
        if (moved >= budget)
            break;
    }
    int a = mp_alive(pidfd);
    return a < 0 ? a : i;
}

/* Cross-memory attach for pieces start.. : local + loff[i] <-> remote + roff[i]
 * (len[i] each) in process `pid`, up to MP_IOV pieces per system call, resuming
 * partial transfers, until `budget` bytes moved or n is reached. Returns the
 * next index or -errno (ESRCH: gone, EPERM: ptrace policy, EFAULT: unmapped).
 * The owner's pidfd is checked before the copies, so the pid still names that
 * process (not a reused pid). No check after: a copy that succeeded found the
 * process's memory in place, i.e. it had not exited (unlike a memfd mapping,
 * which outlives its owner). */
int64_t mp_cma_many(int pid, int wr, char *local, const int64_t *loff, char *remote, const int64_t *roff,
                    const int64_t *len, int64_t start, int64_t n, int64_t budget, int pidfd) {
    struct iovec lv[MP_IOV], rv[MP_IOV];
    int64_t i = start, moved = 0;
    int64_t skip = 0; /* bytes of piece i already moved */
    int a = mp_alive(pidfd);
    if (a < 0)
        return a;
    while (i < n && moved < budget) {
        int k = 0;
        int64_t want = 0;
        for (int64_t j = i; j < n && k < MP_IOV && moved + want < budget; j++) {
            int64_t s = j == i ? skip : 0;
            if (len[j] - s == 0)
                continue;
            lv[k].iov_base = local + loff[j] + s;
            rv[k].iov_base = remote + roff[j] + s;
            lv[k].iov_len = rv[k].iov_len = (size_t)(len[j] - s);
            want += len[j] - s;
            k++;
        }
        if (k == 0) { /* only empty pieces are left */
            i = n;
            skip = 0;
            break;
        }
        ssize_t got = wr ? process_vm_writev(pid, lv, (unsigned long)k, rv, (unsigned long)k, 0)
                            : process_vm_readv(pid, lv, (unsigned long)k, rv, (unsigned long)k, 0);
        if (got < 0) {
            if (errno == EINTR)
                continue;
            return -errno;
        }
        if (got == 0)
            return -EFAULT;
        moved += got;
        /* advance over what moved */
        int64_t g = got;
        while (g > 0 && i < n) {
            int64_t rest = len[i] - skip;
            if (g >= rest) {
                g -= rest;
                i++;
                skip = 0;
            } else {
                skip += g;
                g = 0;
            }
        }
        while (skip == 0 && i < n && len[i] == 0)
            i++;
    }
    if (skip != 0) { /* the budget ran out inside a piece: finish it (indices are whole) */
        int64_t rest = len[i] - skip;
        while (rest > 0) {
            struct iovec l1 = {local + loff[i] + len[i] - rest, (size_t)rest};
            struct iovec r1 = {remote + roff[i] + len[i] - rest, (size_t)rest};
            ssize_t got = wr ? process_vm_writev(pid, &l1, 1, &r1, 1, 0) : process_vm_readv(pid, &l1, 1, &r1, 1, 0);
            if (got < 0) {
                if (errno == EINTR)
                    continue;
                return -errno;
            }
            if (got == 0)
                return -EFAULT;
            rest -= got;
        }
        i++;
    }
    return i;
}

/* One contiguous CMA range (the single-request path). 0 or -errno. */
int64_t mp_cma(int pid, int wr, char *local, char *remote, int64_t n, int pidfd) {
    int64_t zero = 0;
    int64_t r = mp_cma_many(pid, wr, local, &zero, remote, &zero, &n, 0, 1, INT64_MAX, pidfd);
    return r < 0 ? r : 0;
}

#ifdef MP_PYMODULE
/* The same helper as a CPython extension module, for the single-request path:
 * a ctypes call costs about 0.7 us of argument conversion, more than the copy
 * of a 4 KiB request. Built only where Python.h is found (see _copyloop.py);
 * the ctypes functions above stay the interface everywhere else. Copies up to
 * MP_KEEP_GIL bytes keep the GIL: releasing and taking it back costs more. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#define MP_KEEP_GIL (64 << 10)

static int mp_args(PyObject *const *args, Py_ssize_t nargs, Py_ssize_t want, const char *sig) {
    if (nargs != want) {
        PyErr_Format(PyExc_TypeError, "%s takes %zd arguments", sig, want);
        return -1;
    }
    return 0;
}

/* copy(dst, src, n, pidfd) -> mp_copy's result */
static PyObject *py_copy(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (mp_args(args, nargs, 4, "copy(dst, src, n, pidfd)") < 0)
        return NULL;
    char *dst = PyLong_AsVoidPtr(args[0]);
    const char *src = PyLong_AsVoidPtr(args[1]);
    long long n = PyLong_AsLongLong(args[2]);
    long pidfd = PyLong_AsLong(args[3]);
    if (PyErr_Occurred())
        return NULL;
    if (n < 0) {
        PyErr_SetString(PyExc_ValueError, "copy: negative length");
        return NULL;
    }
    int64_t r;
    if (n > MP_KEEP_GIL) {
        Py_BEGIN_ALLOW_THREADS
        r = mp_copy(dst, src, (int64_t)n, (int)pidfd);
        Py_END_ALLOW_THREADS
    } else {
        r = mp_copy(dst, src, (int64_t)n, (int)pidfd);
    }
    return PyLong_FromLongLong((long long)r);
}

/* cma(pid, write, local, remote, n, pidfd) -> mp_cma's result */
static PyObject *py_cma(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (mp_args(args, nargs, 6, "cma(pid, write, local, remote, n, pidfd)") < 0)
        return NULL;
    long pid = PyLong_AsLong(args[0]);
    int wr = PyObject_IsTrue(args[1]);
    char *local = PyLong_AsVoidPtr(args[2]);
    char *remote = PyLong_AsVoidPtr(args[3]);
    long long n = PyLong_AsLongLong(args[4]);
    long pidfd = PyLong_AsLong(args[5]);
    if (wr < 0 || PyErr_Occurred())
        return NULL;
    if (n < 0) {
        PyErr_SetString(PyExc_ValueError, "cma: negative length");
        return NULL;
    }
    int64_t r;
    Py_BEGIN_ALLOW_THREADS /* a system call that may fault in the other process's pages */
    r = mp_cma((int)pid, wr, local, remote, (int64_t)n, (int)pidfd);
    Py_END_ALLOW_THREADS
    return PyLong_FromLongLong((long long)r);
}

static PyMethodDef mp_methods[] = {
    {"copy", (PyCFunction)(void (*)(void))py_copy, METH_FASTCALL, "memcpy, then the owner's liveness"},
    {"cma", (PyCFunction)(void (*)(void))py_cma, METH_FASTCALL, "one cross-memory-attach range"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef mp_module = {PyModuleDef_HEAD_INIT, "_mpcomm_copyloop", NULL, -1, mp_methods,
                                       NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__mpcomm_copyloop(void) {
    PyObject *m = PyModule_Create(&mp_module);
    if (m != NULL && PyModule_AddIntConstant(m, "ABI", MP_ABI) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
#endif
