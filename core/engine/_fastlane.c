/* The engine's native module: a bound pair's inline step, per request, outside the interpreter's frames.
 *
 * Built when mpcomm is installed (setup.py; the install fails without it) as the
 * extension module _mpcomm_fastlane and loaded by core/engine/fastlane.py
 * (import mpcomm fails without it). lane_run is the only inline step of the
 * engine's one request path (Pipeline.single in core/engine/requests.py, with
 * bound.Binding): what it declines, that path takes on, through the binding's
 * posted step or the full routing. It must land only what the full path lands:
 * tests/core/test_fastlane.py drives both with the same arguments.
 *
 * Why C: once a (local region, remote region, kind) pair is bound, a small
 * request is a handful of checks, a lease, the transport's move (itself
 * native for shm and ucx) and a handle born done. In Python that costs about
 * as much as the UCX put and flush themselves (1.2-1.4 us here); this is the
 * same sequence without a Python frame. Two things are written here a second
 * time, for speed, and must stay in step with their Python definitions: the
 * lease protocol of Region.acquire/release (core/memory.py, see lease()) and
 * the five attributes Landed.__init__ sets (core/transfer.py, see landed());
 * each of those places names this file, and the tests compare them.
 */
#define MP_ABI 7

int mpcomm_fastlane_abi(void) { return MP_ABI; }

#ifdef MP_PYMODULE  /* setup.py always builds it so; without it only the ABI function above is built */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <structmember.h> /* T_OBJECT_EX: the slots of Request.FIELDS and Landed.FIELDS */
#include <time.h>

/* What lane(...) binds, in this order (a tuple: the callable's self). No name of a Python
 * attribute appears in this file: what it reads or calls on the engine's objects is handed
 * to lane() as an object (a probe is a callable taking the object it reads; bound.py's native_step
 * names where each comes from), so a renamed attribute is renamed beside its probe. */
enum {
    S_LOCAL,      /* the local Region (see lease() below) */
    S_HELD,       /* local._held: one entry per lease */
    S_LEASE,      /* memory.LEASE_SLOTS: the slots of local's "refusing" (a bool) and "closers" (an int) */
    S_WAKE,       /* wake(local): wake the close() calls waiting for the leases to end */
    S_MOVE,       /* the transport's move(lo, ro, n) -> truthy once landed */
    S_LINK,       /* the PeerLink */
    S_ALIVE,      /* probe(link) -> truthy while the peer is reachable */
    S_FAILED_PATHS, /* the health tracker's failure tables (HealthTracker.failure_tables()): */
    S_FAILED_PEERS, /* while both are empty nothing has failed and admission is skipped */
    S_LANDED,     /* the handle class, Landed: made here with the attributes its __init__ sets */
    S_FIELDS,     /* Landed.FIELDS: the descriptors of those five attributes, in FIELD_* order */
    S_ORIGIN,     /* what the handles name as their transport and route */
    S_KIND,       /* "write" / "read" */
    S_REMOTE,     /* the RemoteRegion */
    S_LSIZE,      /* int: local region size */
    S_RSIZE,      /* int: remote region size */
    S_UNBIND,     /* unbind(): drop this pair from the engine's table */
    S_MOVE_FAILED,/* move_failed(type, exc, traceback): a plugin bug, logged; the request declines */
    S_COUNT
};

/* The order of Landed.FIELDS (core/transfer.py). */
enum { FIELD_BYTES_MOVED, FIELD_ORIGIN, FIELD_REQUEST_ARGS, FIELD_SUBMITTED_AT, FIELD_FINISHED_AT, FIELD_COUNT };

static PyObject *s_empty;

static double monotonic(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);  /* the clock of time.monotonic() on Linux */
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

/* An exact int in int64 into *v: 1; anything else (bool, float, huge, an unset slot): 0, no error set. */
static int exact_i64(PyObject *o, long long *v) {
    int overflow = 0;
    if (o == NULL || !PyLong_CheckExact(o))
        return 0;
    *v = PyLong_AsLongLongAndOverflow(o, &overflow);  /* an exact int: no error, only overflow */
    return !overflow;
}

/* A request's timeout as the one path takes it at once: None, or an exact float or int in (0, inf)
 * (NaN fails too). Anything else declines to that path, which accepts or refuses it. */
static int timeout_ok(PyObject *o) {
    if (o == Py_None)
        return 1;
    if (!PyFloat_CheckExact(o) && !PyLong_CheckExact(o))
        return 0;
    double t = PyFloat_AsDouble(o);  /* an int beyond the largest float: OverflowError */
    if (t == -1.0 && PyErr_Occurred()) {
        PyErr_Clear();
        return 0;
    }
    return t > 0 && t < INFINITY;
}

/* [off, off + n) inside [0, size): the one bounds rule (core/engine/checks.py, fits), in
 * unsigned arithmetic that cannot wrap. Callers pass values they know are >= 0;
 * tests/core/test_lane_agreement.py holds the two lanes together at the int64 limits. */
static inline int fits(unsigned long long off, unsigned long long n, unsigned long long size) {
    return n <= size && off <= size - n;
}

/* A call's result dropped: 0, or -1 when the call failed (its error set). */
static int discard(PyObject *x) {
    if (x == NULL)
        return -1;
    Py_DECREF(x);
    return 0;
}

/* The object slot of `o` that the member descriptor d describes (lane() checked d's kind). */
static PyObject **slot(PyObject *d, PyObject *o) {
    return (PyObject **)((char *)o + ((PyMemberDescrObject *)d)->d_member->offset);
}

/* The lease protocol of Region.acquire/release (core/memory.py), without the two method
 * calls: append one entry, then look at "refusing" (close() sets it, then looks at the list,
 * so one of the two always sees the other); release pops it and wakes a waiting close()
 * once the list is empty. Both run under the GIL, as list.append/pop do there, and read
 * the region's slots directly (an unset one counts as refusing, and as a close waiting). */
static int unlease(PyObject *const *s) {
    PyObject *held = s[S_HELD], *closers = *slot(PyTuple_GET_ITEM(s[S_LEASE], 1), s[S_LOCAL]);
    Py_ssize_t n = PyList_GET_SIZE(held);
    if (n > 0 && PyList_SetSlice(held, n - 1, n, NULL) < 0)
        return -1;
    /* the protocol keeps an int there, whose truth runs no Python code (anything else: woken) */
    if (PyList_GET_SIZE(held) == 0 && (closers == NULL || !PyLong_CheckExact(closers) || PyObject_IsTrue(closers)))
        return discard(PyObject_CallOneArg(s[S_WAKE], s[S_LOCAL]));
    return 0;
}

/* 1 leased, 0 refused (the region is being unregistered; nothing held), -1 error */
static int lease(PyObject *const *s) {
    if (PyList_Append(s[S_HELD], Py_None) < 0)
        return -1;
    if (*slot(PyTuple_GET_ITEM(s[S_LEASE], 0), s[S_LOCAL]) == Py_False)
        return 1;
    return unlease(s) < 0 ? -1 : 0;
}

/* A handle born COMPLETED: Landed.__init__'s five attributes, set here without its frame
 * (tests/core/test_fastlane.py checks both make the same handle). */
static PyObject *landed(PyObject *const *s, PyObject *nobj, PyObject *req, double t0) {
    PyTypeObject *tp = (PyTypeObject *)s[S_LANDED];
    PyObject *h = tp->tp_new(tp, s_empty, NULL);
    PyObject *t0obj = PyFloat_FromDouble(t0), *t1obj = PyFloat_FromDouble(monotonic());
    PyObject *value[FIELD_COUNT] = {nobj, s[S_ORIGIN], req, t0obj, t1obj};
    if (h == NULL || t0obj == NULL || t1obj == NULL)
        Py_CLEAR(h);
    else  /* each stored in the slot whose descriptor Landed.FIELDS hands (no name, no lookup): lane()
           * checked each is an object slot of the handle class, so a fresh handle holds it empty */
        for (int f = 0; f < FIELD_COUNT; f++)
            *slot(PyTuple_GET_ITEM(s[S_FIELDS], f), h) = Py_NewRef(value[f]);
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
    /* lane() took two exact ints in [0, 2**63): no error here */
    long long lsize = PyLong_AsLongLong(s[S_LSIZE]), rsize = PyLong_AsLongLong(s[S_RSIZE]), lo, ro, n;
    PyObject *length = args[2];
    if (!exact_i64(args[0], &lo) || !exact_i64(args[1], &ro) || lo < 0 || ro < 0)
        Py_RETURN_NONE;
    if (length == Py_None)
        n = lsize - lo;
    else if (!exact_i64(length, &n))
        Py_RETURN_NONE;
    if (n < 0 || !fits((unsigned long long)lo, (unsigned long long)n, (unsigned long long)lsize)
        || !fits((unsigned long long)ro, (unsigned long long)n, (unsigned long long)rsize) || !timeout_ok(args[3]))
        Py_RETURN_NONE;
    if (PyDict_GET_SIZE(s[S_FAILED_PATHS]) || PyDict_GET_SIZE(s[S_FAILED_PEERS]))
        Py_RETURN_NONE;
    PyObject *alive = PyObject_CallOneArg(s[S_ALIVE], s[S_LINK]);
    int r = alive == NULL ? -1 : PyObject_IsTrue(alive);
    Py_XDECREF(alive);
    if (r <= 0)
        return r < 0 ? NULL : Py_NewRef(Py_None);

    double t0 = monotonic();
    PyObject *et, *ev, *tb;
    r = lease(s);
    if (r <= 0) {  /* refused (unregistered): the table lets go of the pair */
        if (r < 0 || discard(PyObject_CallNoArgs(s[S_UNBIND])) < 0)
            return NULL;
        Py_RETURN_NONE;
    }

    /* The caller's exact int when it gave one (no new int object per request). */
    PyObject *nobj = length != Py_None ? Py_NewRef(length) : PyLong_FromLongLong(n);
    if (nobj == NULL)
        goto release_fail;
    PyObject *margs[3] = {args[0], args[1], nobj};
    PyObject *moved = PyObject_Vectorcall(s[S_MOVE], margs, 3, NULL);
    int done = moved == NULL ? -1 : PyObject_IsTrue(moved);
    Py_XDECREF(moved);
    if (done < 0) {
        if (!PyErr_ExceptionMatches(PyExc_Exception))
            goto release_fail_n;  /* KeyboardInterrupt and the like go on up, the lease released */
        /* A plugin bug declines; the full path reports what post() says. */
        PyErr_Fetch(&et, &ev, &tb);
        PyErr_NormalizeException(&et, &ev, &tb);
        PyObject *x = PyObject_CallFunctionObjArgs(s[S_MOVE_FAILED], et, ev ? ev : Py_None, tb ? tb : Py_None, NULL);
        Py_XDECREF(et);
        Py_XDECREF(ev);
        Py_XDECREF(tb);
        if (discard(x) < 0)
            goto release_fail_n;
        done = 0;
    }
    if (unlease(s) < 0 || !done) {  /* an error, or declined (no error pending) */
        Py_DECREF(nobj);
        return PyErr_Occurred() ? NULL : Py_NewRef(Py_None);
    }
    PyObject *req = PyTuple_Pack(6, s[S_KIND], s[S_LOCAL], s[S_REMOTE], args[1], nobj, args[0]);
    PyObject *h = req == NULL ? NULL : landed(s, nobj, req, t0);
    Py_XDECREF(req);
    Py_DECREF(nobj);
    return h;

release_fail_n:
    Py_DECREF(nobj);
release_fail:  /* the lease released with the pending exception set aside (no call into Python with one
                * pending): that exception goes on up, and an error of the release is reported unraisable */
    PyErr_Fetch(&et, &ev, &tb);
    if (unlease(s) < 0)
        PyErr_WriteUnraisable(s[S_LOCAL]);
    PyErr_Restore(et, ev, tb);
    return NULL;
}

static PyMethodDef run_def = {"run", (PyCFunction)(void (*)(void))lane_run, METH_FASTCALL,
                              "run(lo, ro, length, timeout): one request on a bound pair, or None"};

/* Whether t is a tuple of n descriptors of writable object slots tp defines (Landed.FIELDS, what
 * set_field stores into; Request.FIELDS, what scan reads). */
static int is_slot_tuple(PyObject *t, PyTypeObject *tp, Py_ssize_t n) {
    if (!PyTuple_CheckExact(t) || PyTuple_GET_SIZE(t) != n)
        return 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *d = PyTuple_GET_ITEM(t, i);
        if (!Py_IS_TYPE(d, &PyMemberDescr_Type) || PyDescr_TYPE(d) != tp
            || ((PyMemberDescrObject *)d)->d_member->type != T_OBJECT_EX
            || (((PyMemberDescrObject *)d)->d_member->flags & READONLY))
            return 0;
    }
    return 1;
}

/* Whether t is a tuple of n such descriptors of o's class or of a base of it (memory.LEASE_SLOTS,
 * what lease() reads, for a Region or a subclass's instance). */
static int has_slots(PyObject *t, PyObject *o, Py_ssize_t n) {
    for (PyTypeObject *tp = Py_TYPE(o); tp != NULL; tp = tp->tp_base)
        if (is_slot_tuple(t, tp, n))
            return 1;
    return 0;
}

/* lane(local, held, lease, wake, move, link, alive, failed_paths,
 *      failed_peers, landed, fields, origin, kind, remote, lsize, rsize, unbind, move_failed)
 * -> the pair's run callable, whose self is this very tuple of arguments */
static PyObject *py_lane(PyObject *self, PyObject *argt) {
    (void)self;
    PyObject *const *args = &PyTuple_GET_ITEM(argt, 0);
    long long lsize, rsize;
    if (PyTuple_GET_SIZE(argt) != S_COUNT || !exact_i64(args[S_LSIZE], &lsize) || !exact_i64(args[S_RSIZE], &rsize) || lsize < 0
        || rsize < 0 || !PyList_CheckExact(args[S_HELD]) || !PyDict_CheckExact(args[S_FAILED_PATHS])
        || !PyDict_CheckExact(args[S_FAILED_PEERS]) || !PyType_Check(args[S_LANDED])
        || !is_slot_tuple(args[S_FIELDS], (PyTypeObject *)args[S_LANDED], FIELD_COUNT)
        || !has_slots(args[S_LEASE], args[S_LOCAL], 2) || !PyCallable_Check(args[S_WAKE])
        || !PyCallable_Check(args[S_ALIVE])) {
        PyErr_Format(PyExc_TypeError, "lane() takes %d arguments (see _fastlane.c)", S_COUNT);
        return NULL;
    }
    return PyCFunction_New(&run_def, argt);
}

/* first_bad(lo, ro, ln, lsize, rsize): the one batch bounds check (checks.first_bad), over
 * the first len(ln) entries of the engine's three array('q') buffers, in one pass without an
 * int object per entry. The rule is fits() above, per entry: a negative value is out of bounds.
 * -1 when every entry fits; TypeError unless the buffers are C-contiguous int64 arrays of
 * len(ln) entries at least and the sizes ints >= 0. */
static void release3(Py_buffer *b, int got) {
    while (got-- > 0)
        PyBuffer_Release(&b[got]);
}

/* The three C-contiguous int64 buffers o[0..2] (writable with `flags`, of at least min_n entries
 * each), or -1 with TypeError set and none held. */
static int int64_buffers(PyObject *const *o, Py_buffer *b, int flags, Py_ssize_t min_n) {
    for (int got = 0; got < 3; got++) {
        if (PyObject_GetBuffer(o[got], &b[got], PyBUF_FORMAT | PyBUF_C_CONTIGUOUS | flags) < 0) {
            release3(b, got);
            return -1;
        }
        if (b[got].itemsize != 8 || b[got].format == NULL || strcmp(b[got].format, "q") != 0
            || b[got].len / 8 < min_n) {
            release3(b, got + 1);
            PyErr_SetString(PyExc_TypeError, "takes array('q') buffers of len(requests) entries at least");
            return -1;
        }
    }
    return 0;
}

/* A region size into *v: an int >= 0 (else -1, an error set); one of 2**64 or more is read as
 * 2**64-1 (what PyLong_AsUnsignedLongLong returns for it), which decides every entry alike: an
 * entry's off + n is below 2**64. */
static int size_arg(PyObject *o, unsigned long long *v) {
    int over = 0;
    long long s = PyLong_AsLongLongAndOverflow(o, &over);
    if (s == -1 && PyErr_Occurred())
        return -1;
    if (over < 0 || (over == 0 && s < 0)) {
        PyErr_SetString(PyExc_TypeError, "first_bad takes sizes >= 0");
        return -1;
    }
    *v = over ? PyLong_AsUnsignedLongLong(o) : (unsigned long long)s;
    PyErr_Clear(); /* 2**64 or more: ULLONG_MAX */
    return 0;
}

static PyObject *py_first_bad(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    unsigned long long lsize, rsize;
    Py_ssize_t n = nargs == 5 ? PyObject_Length(args[2]) : -1; /* before any buffer is held */
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "first_bad(lo, ro, ln, lsize, rsize)");
        return NULL;
    }
    Py_buffer b[3];
    if (n < 0 || size_arg(args[3], &lsize) < 0 || size_arg(args[4], &rsize) < 0 || int64_buffers(args, b, 0, n) < 0)
        return NULL;
    const long long *lo = b[0].buf, *ro = b[1].buf, *ln = b[2].buf;
    Py_ssize_t bad = -1;
    for (Py_ssize_t i = 0; i < n && bad < 0; i++)
        if (ln[i] < 0 || lo[i] < 0 || ro[i] < 0 || !fits((unsigned long long)lo[i], (unsigned long long)ln[i], lsize)
            || !fits((unsigned long long)ro[i], (unsigned long long)ln[i], rsize))
            bad = i;
    release3(b, 3);
    return PyLong_FromSsize_t(bad);
}

/* scan(requests, start, type, fields, lo, ro, ln) -> j: the end of the run of requests (a list
 * or tuple) from `start` on that planning.py plans as one vectorised group, read through their
 * slots, their offsets and lengths copied into the engine's arrays lo, ro, ln (array('q') of at
 * least len(requests) entries each) at their own indices.
 *
 * A request joins while it is exactly `type` (Request), its op, local, remote, timeout and
 * route are the very objects of requests[start]'s, its notify is None and its three integers
 * are exact ints in int64 (negative ones too: first_bad checks the bounds next, over these
 * arrays). j == start: requests[start] is none of that, and planning.py reads the run from it
 * in Python (or plans a notifying request alone). `fields` is Request.FIELDS: the slot
 * descriptors of op, local, remote, remote_offset, length, local_offset, notify, timeout and
 * route, in that order (no attribute name here). */
enum { R_OP, R_LOCAL, R_REMOTE, R_RO, R_LEN, R_LO, R_NOTIFY, R_TIMEOUT, R_ROUTE, R_COUNT };

static PyObject *py_scan(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    Py_ssize_t j = nargs == 7 ? PyLong_AsSsize_t(args[1]) : -1;
    if (j < 0 || !PyType_Check(args[2]) || !is_slot_tuple(args[3], (PyTypeObject *)args[2], R_COUNT)
        || (!PyList_CheckExact(args[0]) && !PyTuple_CheckExact(args[0]))) {
        PyErr_SetString(PyExc_TypeError, "scan(requests: list | tuple, start >= 0, type, fields: the type's slot "
                                         "descriptors, lo, ro, ln)");
        return NULL;
    }
    PyTypeObject *tp = (PyTypeObject *)args[2];
    Py_ssize_t off[R_COUNT];
    for (int f = 0; f < R_COUNT; f++)
        off[f] = ((PyMemberDescrObject *)PyTuple_GET_ITEM(args[3], f))->d_member->offset;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(args[0]), start = j;
    PyObject **items = PySequence_Fast_ITEMS(args[0]); /* no Python code runs below: the list stays put */
    Py_buffer b[3];
    if (int64_buffers(args + 4, b, PyBUF_WRITABLE, n) < 0)
        return NULL;
    long long *lo = b[0].buf, *ro = b[1].buf, *ln = b[2].buf;
    PyObject *first[R_COUNT] = {NULL};
    for (; j < n; j++) {
        PyObject *r = items[j];
        if (!Py_IS_TYPE(r, tp))
            break;
        PyObject *v[R_COUNT];
        for (int f = 0; f < R_COUNT; f++)
            v[f] = *(PyObject **)((char *)r + off[f]); /* borrowed; NULL: an unset slot */
        if (j == start)
            memcpy(first, v, sizeof v);
        if (v[R_OP] == NULL || v[R_LOCAL] == NULL || v[R_REMOTE] == NULL || v[R_TIMEOUT] == NULL
            || v[R_ROUTE] == NULL || v[R_OP] != first[R_OP] || v[R_LOCAL] != first[R_LOCAL]
            || v[R_REMOTE] != first[R_REMOTE] || v[R_TIMEOUT] != first[R_TIMEOUT]
            || v[R_ROUTE] != first[R_ROUTE] || v[R_NOTIFY] != Py_None)
            break;
        long long a, c, k;
        if (!exact_i64(v[R_LO], &a) || !exact_i64(v[R_RO], &c) || !exact_i64(v[R_LEN], &k))
            break;
        lo[j] = a;
        ro[j] = c;
        ln[j] = k;
    }
    release3(b, 3);
    return PyLong_FromSsize_t(j);
}

static PyMethodDef mp_methods[] = {
    {"scan", (PyCFunction)(void (*)(void))py_scan, METH_FASTCALL,
     "the run of a batch's requests from start on that forms one group, their integers copied"},
    {"lane", py_lane, METH_VARARGS, "a bound pair's run callable"},
    {"first_bad", (PyCFunction)(void (*)(void))py_first_bad, METH_FASTCALL,
     "the first entry of three array('q') buffers out of bounds, or -1"},
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
