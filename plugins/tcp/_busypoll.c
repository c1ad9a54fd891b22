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

int mpcomm_tcp_abi(void) { return 3; }

static long long now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (long long)t.tv_sec * 1000000000LL + t.tv_nsec;
}

/* 1: fd is readable, closed or failed (the caller's recv says which); 0: still
 * nothing after budget_ns; -errno: poll itself failed. The time spent is compared with
 * the budget (never start + budget, which wraps for a budget near 2^63). */
int mpcomm_tcp_spin_readable(int fd, long long budget_ns) {
    struct pollfd p;
    long long start = now_ns();
    p.fd = fd;
    p.events = POLLIN;
    for (;;) {
        p.revents = 0;
        int r = poll(&p, 1, 0);
        if (r > 0)
            return 1;
        if (r < 0 && errno != EINTR)
            return -errno;
        if (now_ns() - start >= budget_ns)
            return 0;
        /* Let a thread that shares this CPU run: the peer we wait for may be it. */
        sched_yield();
    }
}

#ifdef MP_PYMODULE
/* The same function as a CPython extension module: a ctypes call converts its two
 * arguments and releases the GIL in about 1 us here, twice per small request (the
 * target's wait for the next request, the caller's for its reply). The GIL is
 * released around the poll, as ctypes does. Built only where Python.h is found.
 *
 * The module also counts its pollers itself (at most set_spin_limit()'s number
 * poll at once; busypoll.py's locks do that for the ctypes library), and has the
 * two waits of a small request whole, each one call instead of a handful of
 * Python-level ones: next_request (target: poll, then receive a request header)
 * and next_reply (initiator: poll, then take a reply header only if the whole
 * reply already sits in the socket buffer). Their Python twins stay in
 * server.py and client.py for the library without the module. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <limits.h>
#include <stdint.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <unistd.h>

static int spin_limit = 1;
static int spinners = 0;

/* mpcomm_tcp_spin_readable for at most spin_limit threads at once; 0 (not polled) for the rest. */
static int counted_spin(int fd, long long budget_ns) {
    if (budget_ns <= 0)
        return 0;
    if (__atomic_add_fetch(&spinners, 1, __ATOMIC_ACQ_REL) > spin_limit) {
        __atomic_sub_fetch(&spinners, 1, __ATOMIC_ACQ_REL);
        return 0;
    }
    int r = mpcomm_tcp_spin_readable(fd, budget_ns);
    __atomic_sub_fetch(&spinners, 1, __ATOMIC_ACQ_REL);
    return r;
}

static int writable(PyObject *obj, Py_buffer *view, Py_ssize_t need) {
    if (PyObject_GetBuffer(obj, view, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0)
        return -1;
    if (view->len < need) {
        PyBuffer_Release(view);
        PyErr_Format(PyExc_ValueError, "header buffer of %zd bytes, %zd needed", view->len, need);
        return -1;
    }
    return 0;
}

/* One argument of an entry point: a writable C-contiguous buffer of at least `need` bytes
 * (need > 0), or an int64 that must lie in [lo, hi] (strict: OverflowError outside) or is
 * clamped into it. The bounds are what keeps every later sum and cast in range: a time
 * added to now_ns() or a quiet counter, a poll() timeout, an fd. */
typedef struct {
    long long lo, hi;
    int strict;
    Py_ssize_t need;
} arg_rule;

#define FD_ARG {INT_MIN, INT_MAX, 1, 0}     /* a C int: refused outside, never truncated */
#define NS_ARG {0, 1LL << 62, 0, 0}        /* a spin budget: now_ns() + it cannot wrap (146 years) */
#define MS_ARG {0, 1 << 30, 0, 0}           /* a poll() timeout, or a time added to now_ns() */
#define BUF_ARG(n) {0, 0, 0, (n)}

/* Checks nargs and parses args by rules into ints[i] (integers) and *buf (the one buffer, which
 * the caller releases). -1 with an exception set and nothing held, else 0. */
static int take_args(const char *usage, const arg_rule *rules, Py_ssize_t n, PyObject *const *args,
                     Py_ssize_t nargs, long long *ints, Py_buffer *buf) {
    if (nargs != n) {
        PyErr_Format(PyExc_TypeError, "%s takes %zd argument%s", usage, n, n == 1 ? "" : "s");
        return -1;
    }
    int held = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        const arg_rule *r = &rules[i];
        if (r->need > 0) {
            if (writable(args[i], buf, r->need) < 0)
                goto fail;
            held = 1;
            continue;
        }
        long long v = PyLong_AsLongLong(args[i]);
        if (v == -1 && PyErr_Occurred())
            goto fail;
        if ((v < r->lo || v > r->hi) && r->strict) {
            PyErr_Format(PyExc_OverflowError, "%s: argument %zd (%lld) is out of range", usage, i + 1, v);
            goto fail;
        }
        ints[i] = v < r->lo ? r->lo : (v > r->hi ? r->hi : v);
    }
    return 0;
fail:
    if (held)
        PyBuffer_Release(buf);
    return -1;
}

#define TAKE_ARGS(usage, rules, ints, buf) \
    take_args(usage, rules, (Py_ssize_t)(sizeof(rules) / sizeof(rules[0])), args, nargs, ints, buf)

/* set_spin_limit(n): how many threads of this process may poll at once (n >= 0). */
static PyObject *py_set_spin_limit(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    static const arg_rule rules[] = {{0, 1 << 20, 0, 0}};
    long long n;
    if (TAKE_ARGS("set_spin_limit(n)", rules, &n, NULL) < 0)
        return NULL;
    __atomic_store_n(&spin_limit, (int)n, __ATOMIC_RELEASE);
    Py_RETURN_NONE;
}

/* spin_readable(fd, budget_ns) -> 1 readable (or closed), 0 nothing (or no poller slot), -errno */
static PyObject *py_spin_readable(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    static const arg_rule rules[] = {FD_ARG, NS_ARG};
    long long a[2];
    if (TAKE_ARGS("spin_readable(fd, budget_ns)", rules, a, NULL) < 0)
        return NULL;
    int r;
    Py_BEGIN_ALLOW_THREADS
    r = counted_spin((int)a[0], a[1]);
    Py_END_ALLOW_THREADS
    return PyLong_FromLong(r);
}

/* next_request(fd, spin_ns, head) -> bytes received (0: the end), or -errno
 *
 * Polls up to spin_ns for the next request (when a poller slot is free), then
 * receives up to len(head) bytes with one blocking recv (the socket's
 * SO_RCVTIMEO bounds it: -EAGAIN when it ran out). */
static PyObject *py_next_request(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    static const arg_rule rules[] = {FD_ARG, NS_ARG, BUF_ARG(1)};
    long long a[3];
    Py_buffer head;
    if (TAKE_ARGS("next_request(fd, spin_ns, head)", rules, a, &head) < 0)
        return NULL;
    ssize_t got;
    Py_BEGIN_ALLOW_THREADS
    counted_spin((int)a[0], a[1]);
    do
        got = recv((int)a[0], head.buf, (size_t)head.len, 0);
    while (got < 0 && errno == EINTR);
    if (got < 0)
        got = -errno;
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&head);
    return PyLong_FromSsize_t(got);
}

#define RESP_SIZE 24 /* wire.RESP: "MR" status flags count(4) id(8) length(8), big-endian */

static uint64_t be64(const unsigned char *p) {
    uint64_t v = 0;
    for (int i = 0; i < 8; i++)
        v = v << 8 | p[i];
    return v;
}

/* Peek at up to RESP_SIZE bytes of fd into h without waiting, and while nothing is there keep
 * peeking for up to budget_ns (when a poller slot is free; sched_yield between looks, as
 * mpcomm_tcp_spin_readable). The peek is the look: a spin that found the reply has its header
 * already, one system call less per request than poll() followed by a peek. recv's answer:
 * bytes peeked, 0 the end, -1 with errno (EAGAIN: nothing came). */
static ssize_t peek_spin(int fd, unsigned char *h, long long budget_ns) {
    ssize_t got = recv(fd, h, RESP_SIZE, MSG_PEEK | MSG_DONTWAIT);
    if (got >= 0 || (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) || budget_ns <= 0)
        return got;
    if (__atomic_add_fetch(&spinners, 1, __ATOMIC_ACQ_REL) > spin_limit) {
        __atomic_sub_fetch(&spinners, 1, __ATOMIC_ACQ_REL);
        errno = EAGAIN;
        return -1;
    }
    long long end = now_ns() + budget_ns;
    for (;;) {
        sched_yield(); /* a thread sharing this CPU runs: the peer we wait for may be it */
        got = recv(fd, h, RESP_SIZE, MSG_PEEK | MSG_DONTWAIT);
        if (got >= 0 || (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) || now_ns() >= end)
            break;
    }
    int saved = errno;
    __atomic_sub_fetch(&spinners, 1, __ATOMIC_ACQ_REL);
    errno = saved;
    return got;
}

/* next_reply(fd, spin_ns, wait_ms, max_len, head) -> 1 a reply header is in head (consumed; its
 * body, if any, is whole in the socket buffer), 0 nothing yet, 2 a reply only partly there,
 * 3 not for a driver: the end of the connection, an error, or a header that is not a whole
 * OK/ERR/PARTIAL reply of at most max_len body bytes (the reader thread deals with it).
 *
 * Waits by peeking up to spin_ns (peek_spin, when a poller slot is free), else up to wait_ms in
 * poll() and one peek after it. A write's reply (no body) found by the spin costs the peeks and
 * one recv: no poll. */
static PyObject *py_next_reply(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    static const arg_rule rules[] = {FD_ARG, NS_ARG, MS_ARG, {0, LLONG_MAX, 0, 0}, BUF_ARG(RESP_SIZE)};
    long long a[5];
    Py_buffer head;
    if (TAKE_ARGS("next_reply(fd, spin_ns, wait_ms, max_len, head)", rules, a, &head) < 0)
        return NULL;
    int fd = (int)a[0], r;
    unsigned char *h = head.buf;
    Py_BEGIN_ALLOW_THREADS
    ssize_t got = peek_spin(fd, h, a[1]);
    if (got < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) {
        struct pollfd p = {.fd = fd, .events = POLLIN};
        int n = poll(&p, 1, a[2] < 0 ? 0 : (a[2] > 1 << 30 ? 1 << 30 : (int)a[2]));
        if (n < 0 && errno != EINTR)
            got = -2; /* poll failed: not for a driver */
        else
            got = n > 0 ? recv(fd, h, RESP_SIZE, MSG_PEEK | MSG_DONTWAIT) : -1;
        if (n <= 0 && got == -1)
            errno = EAGAIN;
    }
    if (got == -2)
        r = 3;
    else if (got < 0)
        r = (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) ? 0 : 3;
    else if (got == 0)
        r = 3;
    else if (got < RESP_SIZE)
        r = 2;
    else if (h[0] != 'M' || h[1] != 'R' || h[2] > 2 || be64(h + 16) > (uint64_t)(a[3] < 0 ? 0 : a[3]))
        r = 3;
    else {
        uint64_t length = be64(h + 16);
        int avail = 0;
        /* avail >= RESP_SIZE + length, written so that it cannot wrap (max_len is the caller's) */
        if (length > 0 && (ioctl(fd, FIONREAD, &avail) < 0 || avail < RESP_SIZE
                           || (uint64_t)avail - RESP_SIZE < length))
            r = 2;
        else
            r = recv(fd, h, RESP_SIZE, MSG_DONTWAIT) == RESP_SIZE ? 1 : 3;
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&head);
    return PyLong_FromLong(r);
}

/* await_reply(fd, flags, handoff_ns, look_ns, max_ms[, bell]) -> 1 a reply is there for the reader thread,
 * 0 not yet (max_ms passed: the caller looks at its connection and comes back), 3 the connection
 * ended or failed (the reader meets it).
 *
 * The initiator's reader thread waits here, without the GIL, instead of on a Python condition
 * that every submit would notify: a reply a result() caller reads itself (a driver) then costs
 * no Python on this thread (docs/contract.md, "What a waiter gets"). flags is the connection's
 * array('i') [driving, sticky], written by Python under the connection's lock:
 *   driving: a driver reads replies now;
 *   sticky:  the last replies were read by a driver, so the next ones are left to a driver;
 *   neither: a reply is the reader's at once (it waits in poll() on the socket).
 * With either set this thread does not watch the socket for data (its wake-up at every reply
 * would compete with the driver for a CPU). It looks now and then, and takes a reply it found
 * there, undriven, at two looks handoff_ns apart: the same reply (its request id) both times.
 * Between looks it sleeps in ppoll() for the end of the connection only (POLLRDHUP: no data
 * wakes it). The time between looks doubles from handoff_ns up to look_ns while the looks find
 * a driver at work or nothing at all: a connection whose every reply is driven costs this
 * thread about 1/look_ns wake-ups a second, not one every handoff_ns, each of which took a CPU
 * from the driver or the target's poller on a small machine (the p99 of back-to-back sync
 * requests). The price: a reply nobody drives, after a stretch of driven ones, waits up to
 * look_ns + handoff_ns. bell (an eventfd, or -1) is rung when a driver hands the replies to
 * this thread (it left with requests pending): it ends the sleep between looks, and the wait
 * goes on as the flags say handoff_ns later. Rung with BELL_NOW or more (Conn.hand_to_reader:
 * a request no driver will read, such as one a completion queue or a callback waits for), the
 * wait goes on as the flags say at once, with no handoff_ns first. After 2 * look_ns of looks
 * that found neither a driver nor a reply, it sleeps in poll() until bytes come, and then looks
 * as before. */
#define BELL_NOW (1ULL << 32) /* busypoll.BELL_NOW: an eventfd counter of 1s never reaches it */

static int readable_now(int fd) {
    struct pollfd p = {.fd = fd, .events = POLLIN};
    int n = poll(&p, 1, 0);
    if (n < 0)
        return errno == EINTR ? 0 : -1;
    if (n == 0)
        return 0;
    if (p.revents & (POLLERR | POLLNVAL))
        return -1;
    char c;
    ssize_t got = recv(fd, &c, 1, MSG_PEEK | MSG_DONTWAIT);
    if (got == 0)
        return -1; /* the end of the stream */
    if (got < 0)
        return (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) ? 0 : -1;
    return 1;
}

static int peek_id(int fd, uint64_t *id) {
    unsigned char h[RESP_SIZE];
    ssize_t got = recv(fd, h, RESP_SIZE, MSG_PEEK | MSG_DONTWAIT);
    if (got == 0)
        return -1; /* the end of the stream */
    if (got < 0)
        return (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) ? 0 : -1;
    *id = got == RESP_SIZE ? be64(h + 8) : UINT64_MAX; /* a partial header: matched by length */
    return 1;
}

static PyObject *py_await_reply(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    /* handoff and idle bounded so that quiet (< idle before each += handoff) cannot wrap */
    static const arg_rule rules[] = {FD_ARG, BUF_ARG(2 * sizeof(int)), {1000, 1LL << 40, 0, 0},
                                     {0, 1LL << 62, 0, 0}, MS_ARG};
    long long a[5];
    Py_buffer flags;
    static const arg_rule bell_rule[] = {FD_ARG};
    static const char usage[] = "await_reply(fd, flags, handoff_ns, look_ns, max_ms[, bell])";
    long long bell = -1;
    /* bell (an eventfd a leaving driver rings, or -1) is optional: the first five by the rules */
    if (take_args(usage, rules, 5, args, nargs == 6 ? 5 : nargs, a, &flags) < 0)
        return NULL;
    if (nargs == 6 && take_args(usage, bell_rule, 1, args + 5, 1, &bell, NULL) < 0) {
        PyBuffer_Release(&flags);
        return NULL;
    }
    int fd = (int)a[0], r = 0;
    const int *f = flags.buf;
    long long handoff = a[2] < 1000 ? 1000 : (a[2] > 1000000000LL ? 1000000000LL : a[2]);
    long long look = a[3] < handoff ? handoff : (a[3] > 1000000000LL ? 1000000000LL : a[3]);
    long long max_ms = a[4] < 0 ? 0 : (a[4] > 1 << 30 ? 1 << 30 : a[4]);
    Py_BEGIN_ALLOW_THREADS
    long long end = now_ns() + max_ms * 1000000LL, quiet = 0, period = handoff;
    int seen = 0, hup = 0;
    uint64_t seen_id = 0;
    for (;;) {
        long long t = now_ns();
        if (t >= end)
            break;
        if (!__atomic_load_n(&f[0], __ATOMIC_ACQUIRE) && !__atomic_load_n(&f[1], __ATOMIC_ACQUIRE)) {
            struct pollfd p = {.fd = fd, .events = POLLIN};
            long long ms = (end - t + 999999) / 1000000;
            int n = poll(&p, 1, (int)(ms > 1 << 30 ? 1 << 30 : ms));
            if (n < 0 && errno != EINTR) {
                r = 3;
                break;
            }
            if (n > 0) {
                int k = readable_now(fd);
                if (k < 0) {
                    r = 3;
                    break;
                }
                if (k > 0 && !__atomic_load_n(&f[0], __ATOMIC_ACQUIRE) && !__atomic_load_n(&f[1], __ATOMIC_ACQUIRE)) {
                    r = 1;
                    break;
                }
            }
            period = handoff;
            seen = 0;
            continue;
        }
        if (quiet >= 2 * look) { /* nothing for a while: asleep until bytes come */
            struct pollfd p = {.fd = fd, .events = POLLIN};
            long long ms = (end - t + 999999) / 1000000;
            int n = poll(&p, 1, (int)(ms > 1 << 30 ? 1 << 30 : ms));
            if (n < 0 && errno != EINTR) {
                r = 3;
                break;
            }
            quiet = 0;
            seen = 0;
            period = handoff;
            if (n == 0)
                continue;
        }
        long long wait = period < end - t ? period : end - t;
        struct timespec ts = {wait / 1000000000LL, wait % 1000000000LL};
        if (!hup) {
            struct pollfd p[2] = {{.fd = fd, .events = POLLRDHUP}, {.fd = (int)bell, .events = POLLIN}};
            int n = ppoll(p, bell >= 0 ? 2 : 1, &ts, NULL);
            if (n < 0 && errno != EINTR) {
                r = 3;
                break;
            }
            if (n > 0 && bell >= 0 && p[1].revents) {
                uint64_t rung = 0;
                if (read((int)bell, &rung, sizeof rung) < 0 && errno != EAGAIN && errno != EINTR) {
                    r = 3;
                    break;
                }
                period = handoff;
                seen = 0;
                if (!p[0].revents) {
                    /* Handed the replies: the flags say how to wait now, handoff_ns from now (as the
                     * 1 ms looks did): a caller that drives its next frames at once (a batch of
                     * several groups, driven in turn) takes them itself; the rest are this thread's.
                     * At once when no driver will come (BELL_NOW). */
                    if (rung < BELL_NOW) {
                        struct timespec h = {handoff / 1000000000LL, handoff % 1000000000LL};
                        nanosleep(&h, NULL);
                    }
                    continue;
                }
            }
            if (n > 0 && p[0].revents)
                hup = 1; /* the peer ended its side (replies may still precede the end): look now, and
                            sleep plainly from here on (the condition stays set) */
        } else {
            nanosleep(&ts, NULL);
        }
        if (__atomic_load_n(&f[0], __ATOMIC_ACQUIRE)) {
            seen = 0; /* a driver reads: its replies */
            quiet = 0;
            period = period * 2 > look ? look : period * 2;
            continue;
        }
        uint64_t id = 0;
        int k = peek_id(fd, &id);
        if (k < 0) {
            r = 3;
            break;
        }
        if (k == 0) {
            seen = 0;
            quiet += wait;
            period = period * 2 > look ? look : period * 2;
            continue;
        }
        quiet = 0;
        if (seen && id == seen_id) { /* the same reply at two looks in a row: nobody drove it */
            r = 1;
            break;
        }
        seen = 1; /* look again, handoff_ns from now */
        seen_id = id;
        period = handoff;
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&flags);
    return PyLong_FromLong(r);
}

static PyMethodDef mp_methods[] = {
    {"await_reply", (PyCFunction)(void (*)(void))py_await_reply, METH_FASTCALL,
     "the reader thread's wait for a reply no driver takes"},
    {"spin_readable", (PyCFunction)(void (*)(void))py_spin_readable, METH_FASTCALL,
     "poll fd for readability without sleeping, up to budget_ns"},
    {"set_spin_limit", (PyCFunction)(void (*)(void))py_set_spin_limit, METH_FASTCALL,
     "how many threads may poll at once"},
    {"next_request", (PyCFunction)(void (*)(void))py_next_request, METH_FASTCALL,
     "poll, then receive a request header"},
    {"next_reply", (PyCFunction)(void (*)(void))py_next_reply, METH_FASTCALL,
     "poll, then take a whole reply's header"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef mp_module = {PyModuleDef_HEAD_INIT, "_mpcomm_busypoll", NULL, -1, mp_methods,
                                       NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__mpcomm_busypoll(void) {
    PyObject *m = PyModule_Create(&mp_module);
    if (m != NULL && PyModule_AddIntConstant(m, "ABI", 3) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
#endif
