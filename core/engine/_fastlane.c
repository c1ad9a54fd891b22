/* The engine's bound inline lane, per request, outside the interpreter's frames.
 *
 * Built at first use by core/engine/fastlane.py (through mpcomm.native_helper)
 * as the extension module _mpcomm_fastlane, where a C compiler and Python.h
 * exist; elsewhere _FastPath._run (core/engine/requests.py) does the same in
 * Python. Both must decide alike: tests/core/test_fastlane.py drives the two
 * with the same arguments.
 *
 * Why C: once a (local region, remote region, kind) pair is bound, a small
 * request is a handful of checks, a lease, the transport's move (itself
 * native for shm and ucx) and a handle born done. In Python that costs about
 * as much as the UCX put and flush themselves (1.2-1.4 us here); this is the
 * same sequence without a Python frame. Two things are written here a second
 * time, for speed, and must stay in step with their Python definitions: the
 * lease protocol of Region.acquire/release (core/memory.py, see lease()) and
 * the five attributes _Landed.__init__ sets (core/transfer.py, see landed());
 * each of those places names this file, and the tests compare the two lanes.
 */
#define MP_ABI 2

int mpcomm_fastlane_abi(void) { return MP_ABI; }

#ifdef MP_PYMODULE  /* the plain build (no Python.h) has nothing else: the Python lane serves */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <time.h>

/* What lane(...) binds, in this order (a tuple: the callable's self). No name of a Python
 * attribute appears in this file: what it reads or calls on the engine's objects is handed
 * to lane() as an object (a probe is a callable taking the object it reads; fastlane.py
 * names where each comes from), so a renamed attribute is renamed beside its probe. */
enum {
    S_LOCAL,      /* the local Region (see lease() below) */
    S_HELD,       /* local._held: one entry per lease */
    S_REFUSING,   /* probe(local) -> truthy while the region refuses new leases */
    S_CLOSERS,    /* probe(local) -> how many close() calls wait for the leases to end */
    S_WAKE,       /* probe(local): wake them */
    S_MOVE,       /* the transport's move(lo, ro, n) -> truthy once landed */
    S_LINK,       /* the PeerLink */
    S_ALIVE,      /* probe(link) -> truthy while the peer is reachable */
    S_ENGINE,     /* the Engine */
    S_CLOSED,     /* probe(engine) -> truthy once it is closed */
    S_FAILED_PATHS, /* the health tracker's failure tables (HealthTracker.failure_tables()): */
    S_FAILED_PEERS, /* while both are empty nothing has failed and admission is skipped */
    S_LANDED,     /* the handle class, _Landed: made here with the attributes its __init__ sets */
    S_FIELDS,     /* _Landed.FIELDS: the descriptors of those five attributes, in FIELD_* order */
    S_ORIGIN,     /* what the handles name as their transport and route */
    S_KIND,       /* "write" / "read" */
    S_REMOTE,     /* the RemoteRegion */
    S_LSIZE,      /* int: local region size */
    S_RSIZE,      /* int: remote region size */
    S_UNBIND,     /* unbind(): drop this pair from the engine's table */
    S_MOVE_FAILED,/* move_failed(exc): a plugin bug, logged; the request declines */
    S_COUNT
};

/* The order of _Landed.FIELDS (core/transfer.py). */
enum { FIELD_BYTES_MOVED, FIELD_ORIGIN, FIELD_REQUEST_ARGS, FIELD_SUBMITTED_AT, FIELD_FINISHED_AT, FIELD_COUNT };

static PyObject *s_empty;

static double monotonic(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);  /* the clock of time.monotonic() on Linux */
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

/* An exact int that fits in 63 bits, else -1 (and no error set): bool, float, huge -> decline. */
static long long exact_int(PyObject *o) {
    if (!PyLong_CheckExact(o))
        return -1;
    int overflow = 0;
    long long v = PyLong_AsLongLongAndOverflow(o, &overflow);
    if (overflow || (v == -1 && PyErr_Occurred())) {
        PyErr_Clear();
        return -1;
    }
    return v;
}

/* [off, off + n) inside [0, size): the one bounds rule (core/engine/checks.py, fits), in
 * unsigned arithmetic that cannot wrap. Callers pass values they know are >= 0;
 * tests/core/test_lane_agreement.py holds the two lanes together at the int64 limits. */
static inline int fits(unsigned long long off, unsigned long long n, unsigned long long size) {
    return n <= size && off <= size - n;
}

/* probe(o) as a truth value: 1 true, 0 false, -1 error (set) */
static int probe_true(PyObject *probe, PyObject *o) {
    PyObject *v = PyObject_CallOneArg(probe, o);
    if (v == NULL)
        return -1;
    int r = PyObject_IsTrue(v);
    Py_DECREF(v);
    return r;
}

/* The lease protocol of Region.acquire/release (core/memory.py), without the two method
 * calls: append one entry, then probe "refusing" (close() sets it, then looks at the list,
 * so one of the two always sees the other); release pops it and wakes a waiting close()
 * once the list is empty. Both run under the GIL, as list.append/pop do there. */
static int wake_closers(PyObject *const *s) {
    PyObject *x = PyObject_CallOneArg(s[S_WAKE], s[S_LOCAL]);
    if (x == NULL)
        return -1;
    Py_DECREF(x);
    return 0;
}

/* 1 leased, 0 refused (the region is being unregistered; nothing held), -1 error */
static int lease(PyObject *const *s) {
    PyObject *held = s[S_HELD];
    if (PyList_Append(held, Py_None) < 0)
        return -1;
    int refusing = probe_true(s[S_REFUSING], s[S_LOCAL]);
    if (refusing == 0)
        return 1;
    /* Refused, or the lookup failed: take the entry back. A failed lookup's exception is
     * set aside while that runs (no call into Python with an exception pending), and is
     * what the caller sees; an error of the cleanup itself replaces it. */
    PyObject *et = NULL, *ev = NULL, *tb = NULL;
    if (refusing < 0)
        PyErr_Fetch(&et, &ev, &tb);
    Py_ssize_t n = PyList_GET_SIZE(held);
    if (PyList_SetSlice(held, n - 1, n, NULL) < 0 || wake_closers(s) < 0) {
        Py_XDECREF(et);
        Py_XDECREF(ev);
        Py_XDECREF(tb);
        return -1;
    }
    if (refusing < 0) {
        PyErr_Restore(et, ev, tb);
        return -1;
    }
    return 0;
}

static int unlease(PyObject *const *s) {
    PyObject *held = s[S_HELD];
    Py_ssize_t n = PyList_GET_SIZE(held);
    if (n > 0 && PyList_SetSlice(held, n - 1, n, NULL) < 0)
        return -1;
    if (PyList_GET_SIZE(held) == 0) {
        int closers = probe_true(s[S_CLOSERS], s[S_LOCAL]);
        if (closers < 0 || (closers && wake_closers(s) < 0))
            return -1;
    }
    return 0;
}

/* field = value through the descriptor _Landed.FIELDS hands (a slot: no name, no lookup). */
static int set_field(PyObject *const *s, int field, PyObject *h, PyObject *value) {
    PyObject *d = PyTuple_GET_ITEM(s[S_FIELDS], field);
    return Py_TYPE(d)->tp_descr_set(d, h, value);
}

/* A handle born COMPLETED: _Landed.__init__'s five attributes, set here without its frame
 * (tests/core/test_fastlane.py checks both make the same handle). */
static PyObject *landed(PyObject *const *s, PyObject *nobj, PyObject *req, double t0) {
    PyTypeObject *tp = (PyTypeObject *)s[S_LANDED];
    PyObject *h = tp->tp_new(tp, s_empty, NULL);
    if (h == NULL)
        return NULL;
    PyObject *t0obj = PyFloat_FromDouble(t0), *t1obj = PyFloat_FromDouble(monotonic());
    if (t0obj == NULL || t1obj == NULL || set_field(s, FIELD_BYTES_MOVED, h, nobj) < 0
        || set_field(s, FIELD_ORIGIN, h, s[S_ORIGIN]) < 0 || set_field(s, FIELD_REQUEST_ARGS, h, req) < 0
        || set_field(s, FIELD_SUBMITTED_AT, h, t0obj) < 0 || set_field(s, FIELD_FINISHED_AT, h, t1obj) < 0)
        Py_CLEAR(h);
    Py_XDECREF(t0obj);
    Py_XDECREF(t1obj);
    return h;
}

/* run(lo, ro, length, timeout) -> a handle born COMPLETED, or None: take the slower lanes. */
static PyObject *lane_run(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "run(lo, ro, length, timeout) takes 4 arguments");
        return NULL;
    }
    PyObject *const *s = &PyTuple_GET_ITEM(self, 0);
    long long lsize = PyLong_AsLongLong(s[S_LSIZE]), rsize = PyLong_AsLongLong(s[S_RSIZE]);
    if (PyErr_Occurred())
        return NULL;
    if (lsize < 0 || rsize < 0)
        Py_RETURN_NONE;
    long long lo = exact_int(args[0]), ro = exact_int(args[1]), n;
    if (lo < 0 || ro < 0)
        Py_RETURN_NONE;
    PyObject *length = args[2];
    if (length == Py_None) {
        n = lsize - lo;
        if (n < 0)
            Py_RETURN_NONE;
    } else if ((n = exact_int(length)) < 0) {
        Py_RETURN_NONE;
    }
    if (!fits((unsigned long long)lo, (unsigned long long)n, (unsigned long long)lsize)
        || !fits((unsigned long long)ro, (unsigned long long)n, (unsigned long long)rsize))
        Py_RETURN_NONE;
    PyObject *timeout = args[3];
    if (timeout != Py_None) {
        double t;
        if (PyFloat_CheckExact(timeout)) {
            t = PyFloat_AS_DOUBLE(timeout);
        } else if (PyLong_CheckExact(timeout)) {
            t = PyLong_AsDouble(timeout);
            if (t == -1.0 && PyErr_Occurred()) {
                PyErr_Clear();
                Py_RETURN_NONE;
            }
        } else {
            Py_RETURN_NONE;
        }
        if (!(t > 0 && t < INFINITY))  /* NaN fails too */
            Py_RETURN_NONE;
    }
    if (PyDict_GET_SIZE(s[S_FAILED_PATHS]) || PyDict_GET_SIZE(s[S_FAILED_PEERS]))
        Py_RETURN_NONE;
    int r = probe_true(s[S_ALIVE], s[S_LINK]);
    if (r <= 0)
        return r < 0 ? NULL : Py_NewRef(Py_None);
    r = probe_true(s[S_CLOSED], s[S_ENGINE]);
    if (r != 0)
        return r < 0 ? NULL : Py_NewRef(Py_None);

    double t0 = monotonic();
    PyObject *local = s[S_LOCAL], *x;
    r = lease(s);
    if (r <= 0) {
        if (r < 0)
            return NULL;
        x = PyObject_CallNoArgs(s[S_UNBIND]);  /* unregistered: the table lets go of the pair */
        if (x == NULL)
            return NULL;
        Py_DECREF(x);
        Py_RETURN_NONE;
    }

    PyObject *nobj = PyLong_FromLongLong(n);
    if (nobj == NULL)
        goto release_fail;
    PyObject *margs[3] = {args[0], args[1], nobj};
    PyObject *moved = PyObject_Vectorcall(s[S_MOVE], margs, 3, NULL);
    int done = 0;
    if (moved != NULL) {
        done = PyObject_IsTrue(moved);
        Py_DECREF(moved);
    }
    if (moved == NULL || done < 0) {
        if (!PyErr_ExceptionMatches(PyExc_Exception))
            goto release_fail_n;  /* KeyboardInterrupt and the like go on up, the lease released */
        /* A plugin bug declines; the full path reports what post() says. */
        PyObject *et, *ev, *tb;
        PyErr_Fetch(&et, &ev, &tb);
        PyErr_NormalizeException(&et, &ev, &tb);
        if (tb != NULL && ev != NULL)
            PyException_SetTraceback(ev, tb);
        x = PyObject_CallOneArg(s[S_MOVE_FAILED], ev != NULL ? ev : Py_None);
        Py_XDECREF(et);
        Py_XDECREF(ev);
        Py_XDECREF(tb);
        if (x == NULL)
            goto release_fail_n;
        Py_DECREF(x);
        done = 0;
    }
    if (unlease(s) < 0) {
        Py_DECREF(nobj);
        return NULL;
    }
    if (!done) {
        Py_DECREF(nobj);
        Py_RETURN_NONE;
    }
    PyObject *req = PyTuple_Pack(6, s[S_KIND], local, s[S_REMOTE], args[1], nobj, args[0]);
    PyObject *h = req == NULL ? NULL : landed(s, nobj, req, t0);
    Py_XDECREF(req);
    Py_DECREF(nobj);
    return h;

release_fail_n:
    Py_DECREF(nobj);
release_fail: {
        /* Release the lease with the pending exception kept aside. */
        PyObject *et, *ev, *tb;
        PyErr_Fetch(&et, &ev, &tb);
        if (unlease(s) < 0) {
            Py_XDECREF(et);
            Py_XDECREF(ev);
            Py_XDECREF(tb);
            return NULL;
        }
        PyErr_Restore(et, ev, tb);
        return NULL;
    }
}

static PyMethodDef run_def = {"run", (PyCFunction)(void (*)(void))lane_run, METH_FASTCALL,
                              "run(lo, ro, length, timeout): one request on a bound pair, or None"};

static int is_field_tuple(PyObject *t) {
    if (!PyTuple_CheckExact(t) || PyTuple_GET_SIZE(t) != FIELD_COUNT)
        return 0;
    for (Py_ssize_t i = 0; i < FIELD_COUNT; i++)
        if (Py_TYPE(PyTuple_GET_ITEM(t, i))->tp_descr_set == NULL)
            return 0;
    return 1;
}

/* lane(local, held, refusing, closers, wake, move, link, alive, engine, closed, failed_paths,
 *      failed_peers, landed, fields, origin, kind, remote, lsize, rsize, unbind, move_failed)
 * -> the pair's run callable */
static PyObject *py_lane(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != S_COUNT || !PyLong_CheckExact(args[S_LSIZE]) || !PyLong_CheckExact(args[S_RSIZE])
        || !PyList_CheckExact(args[S_HELD]) || !PyDict_CheckExact(args[S_FAILED_PATHS])
        || !PyDict_CheckExact(args[S_FAILED_PEERS]) || !PyType_Check(args[S_LANDED])
        || !is_field_tuple(args[S_FIELDS]) || !PyCallable_Check(args[S_REFUSING])
        || !PyCallable_Check(args[S_CLOSERS]) || !PyCallable_Check(args[S_WAKE])
        || !PyCallable_Check(args[S_ALIVE]) || !PyCallable_Check(args[S_CLOSED])) {
        PyErr_Format(PyExc_TypeError, "lane() takes %d arguments (see _fastlane.c)", S_COUNT);
        return NULL;
    }
    PyObject *t = PyTuple_New(S_COUNT);
    if (t == NULL)
        return NULL;
    for (int i = 0; i < S_COUNT; i++)
        PyTuple_SET_ITEM(t, i, Py_NewRef(args[i]));
    PyObject *f = PyCFunction_New(&run_def, t);
    Py_DECREF(t);
    return f;
}

static PyMethodDef mp_methods[] = {
    {"lane", (PyCFunction)(void (*)(void))py_lane, METH_FASTCALL, "a bound pair's run callable"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef mp_module = {PyModuleDef_HEAD_INIT, "_mpcomm_fastlane", NULL, -1, mp_methods,
                                       NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__mpcomm_fastlane(void) {
    if ((s_empty = PyTuple_New(0)) == NULL)
        return NULL;
    PyObject *m = PyModule_Create(&mp_module);
    if (m != NULL && PyModule_AddIntConstant(m, "ABI", MP_ABI) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
#endif
