/* Busy-poll helper of the tcp transport (see busypoll.py).
 *
 * A thread that blocks in recv() and is woken by the peer's next frame pays the
 * scheduler's cross-CPU wake-up: 25-30 us on a virtual machine, more than the
 * whole round trip of a small request between spinning peers. This function
 * waits for a socket to turn readable by polling it without sleeping, for a
 * bounded time, outside the interpreter (ctypes releases the GIL), so the
 * other threads of the process keep running meanwhile. */
#define _GNU_SOURCE
#include <errno.h>
#include <poll.h>
#include <sched.h>
#include <time.h>

int mpcomm_tcp_abi(void) { return 1; }

static long long now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (long long)t.tv_sec * 1000000000LL + t.tv_nsec;
}

/* 1: fd is readable, closed or failed (the caller's recv says which); 0: still
 * nothing after budget_ns; -errno: poll itself failed. */
int mpcomm_tcp_spin_readable(int fd, long long budget_ns) {
    struct pollfd p;
    long long end = now_ns() + budget_ns;
    p.fd = fd;
    p.events = POLLIN;
    for (;;) {
        p.revents = 0;
        int r = poll(&p, 1, 0);
        if (r > 0)
            return 1;
        if (r < 0 && errno != EINTR)
            return -errno;
        if (now_ns() >= end)
            return 0;
        /* Let a thread that shares this CPU run: the peer we wait for may be it. */
        sched_yield();
    }
}

#ifdef MP_PYMODULE
/* The same function as a CPython extension module: a ctypes call converts its two
 * arguments and releases the GIL in about 1 us here, twice per small request (the
 * target's wait for the next request, the caller's for its reply). The GIL is
 * released around the poll, as ctypes does. Built only where Python.h is found. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

/* spin_readable(fd, budget_ns) -> mpcomm_tcp_spin_readable's result */
static PyObject *py_spin_readable(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "spin_readable(fd, budget_ns) takes 2 arguments");
        return NULL;
    }
    int fd = (int)PyLong_AsLong(args[0]);
    long long budget = PyLong_AsLongLong(args[1]);
    if (PyErr_Occurred())
        return NULL;
    int r;
    Py_BEGIN_ALLOW_THREADS
    r = mpcomm_tcp_spin_readable(fd, budget);
    Py_END_ALLOW_THREADS
    return PyLong_FromLong(r);
}

static PyMethodDef mp_methods[] = {
    {"spin_readable", (PyCFunction)(void (*)(void))py_spin_readable, METH_FASTCALL,
     "poll fd for readability without sleeping, up to budget_ns"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef mp_module = {PyModuleDef_HEAD_INIT, "_mpcomm_busypoll", NULL, -1, mp_methods,
                                       NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__mpcomm_busypoll(void) {
    PyObject *m = PyModule_Create(&mp_module);
    if (m != NULL && PyModule_AddIntConstant(m, "ABI", 1) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
#endif
