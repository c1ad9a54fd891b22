/* The tcp data port's request loop, in C, outside the interpreter (see dataport.py).
 *
 * server.py serves each connection's requests in Python: every request needs
 * the GIL, so a target whose application keeps the interpreter busy answers
 * its peers 50-70x slower. This module serves the same frames (wire.py) with
 * the same checks and replies, on the connection's thread with the GIL
 * released for the connection's whole life: Python keeps the accept, HELLO and
 * authentication (once per connection), then calls Port.run(fd), which returns
 * only when the connection ends.
 *
 * The region table lives here, in native memory: the transport publishes a
 * region at register() (its buffer is exported for as long as the entry
 * exists) and revokes it at unregister(). Revocation unlinks the entry (no new
 * request finds it), then waits until no request holds it; a request holds it
 * only while it moves bytes. Every range is checked overflow-safe on unsigned
 * values (n <= size && off <= size - n) when admitted and again at the point
 * of use, against the entry the thread holds.
 *
 * Built by mpcomm.native_helper: as the extension module _mpcomm_dataport
 * where Python.h is installed; the plain library (no module) is not used. */
#define _GNU_SOURCE
#include <errno.h>
#include <limits.h>
#include <math.h>
#include <poll.h>
#include <pthread.h>
#include <sched.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <time.h>

#define DP_ABI 3
int mpcomm_dataport_abi(void) { return DP_ABI; }

#ifdef MP_PYMODULE
#define PY_SSIZE_T_CLEAN
#include <Python.h>

/* ---- wire (wire.py) ------------------------------------------------------------- */
#define REQ_SIZE 64
#define RESP_SIZE 24
#define OP_WRITE 1
#define OP_READ 2
#define OP_WRITEV 3
#define OP_READV 4
#define OP_NOTIFY 5
#define ST_OK 0
#define ST_ERR 1
#define ST_PARTIAL 2
#define MAX_ERROR_PAYLOAD (64 << 10)
#define MAX_NOTIFY (64 << 10) /* notify.py MAX_NOTIFY: the largest notification any node takes */
#define MAX_NOTE_REGION 1024 /* bytes of the region name a NOTIFY frame (or a noting WRITE) may carry */
#define FLAG_NOTE 0x01 /* a WRITE frame that carries its notification (wire.py FLAG_NOTE) */
#define NOTE_LEN_SIZE 8 /* the note length after such a frame's header (wire.py NOTE_LEN) */
#define ACC_R 1
#define ACC_W 2

/* Refusal messages name the region (repr(region.name)) in full, as server.py's do, up to
 * QNAME_MAX bytes of it (cut at a UTF-8 character boundary beyond); MSG_CAP holds any message
 * with such a name, BODY_CAP its JSON (each byte escaped at most as \uXXXX). With 1024-byte
 * buffers a long name was cut, and cut inside a character it made the reply invalid UTF-8:
 * the initiator took a refusal for a malformed reply (tests/tcp/test_tcp_native_messages.py). */
#define QNAME_MAX 4096
#define MSG_CAP (QNAME_MAX + 512)
#define BODY_CAP (6 * MSG_CAP + 64)

/* Outcomes of run(): how the connection ended (dataport.py logs them as server.py does). */
#define END_CLOSED 0 /* the initiator closed, idle timeout, or transport closed */
#define END_PROTOCOL 1 /* ProtocolError: warning, reset */
#define END_ERROR 2 /* an MpcommError mid-frame (deadline, lost peer): info, reset */
#define END_OS 3 /* a socket error: silent */

/* Error classes a refusal names (their wire codes, errors.py). */
enum { E_NONE = 0, E_TIMEOUT, E_STALE, E_UNKNOWN, E_DENIED, E_BOUNDS, E_LIMIT, E_BACKPRESSURE };
static const char *const CODES[] = {"",
                                    "timeout",
                                    "stale_region",
                                    "unknown_region",
                                    "permission_denied",
                                    "out_of_bounds",
                                    "limit",
                                    "back_pressure"};

static uint64_t get_be64(const unsigned char *p) {
    uint64_t v = 0;
    for (int i = 0; i < 8; i++)
        v = (v << 8) | p[i];
    return v;
}
static uint32_t get_be32(const unsigned char *p) {
    return ((uint32_t)p[0] << 24) | ((uint32_t)p[1] << 16) | ((uint32_t)p[2] << 8) | p[3];
}
static uint64_t get_le64(const unsigned char *p) {
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--)
        v = (v << 8) | p[i];
    return v;
}
static void put_be64(unsigned char *p, uint64_t v) {
    for (int i = 7; i >= 0; i--, v >>= 8)
        p[i] = (unsigned char)v;
}
static void put_be32(unsigned char *p, uint32_t v) {
    for (int i = 3; i >= 0; i--, v >>= 8)
        p[i] = (unsigned char)v;
}

static double mono(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + t.tv_nsec / 1e9;
}
static double wall(void) {
    struct timespec t;
    clock_gettime(CLOCK_REALTIME, &t);
    return (double)t.tv_sec + t.tv_nsec / 1e9;
}

/* A 128-bit unsigned in decimal (offset + length of a refusal, as Python prints it). */
static void u128_str(unsigned __int128 v, char *out) {
    char tmp[48];
    int n = 0;
    do {
        tmp[n++] = (char)('0' + (int)(v % 10));
        v /= 10;
    } while (v);
    for (int i = 0; i < n; i++)
        out[i] = tmp[n - 1 - i];
    out[n] = 0;
}

/* ---- the notification queue (core/engine/notify.py) ---------------------------------------
 *
 * The engine's one bounded queue of received notifications when this transport runs: the
 * engine adopts it (Notifications.adopt), so the control channel's deliveries (Python) and the
 * data port's (here, no GIL) end in the same FIFO with the same limits (count and bytes,
 * limits.max_queued_notifications / max_queued_notify_bytes) and the same refusal.
 *
 * A note is READY (wait_notification may take it) or, when the engine has on_notification
 * callbacks and the note came from a native thread, PENDING until the engine's callback thread
 * has run them (DISPATCHED meanwhile); it then becomes READY or, consumed, leaves. A note counts
 * against the limits from its put until it leaves, so callbacks never widen the bound. get()
 * takes only the head, and only when it is READY: notes leave in the order they came. */
enum { NOTE_READY = 0, NOTE_PENDING, NOTE_DISPATCHED };

typedef struct Note {
    struct Note *next;
    uint64_t seq;
    int state;
    size_t plen, rlen, dlen;
    char *peer, *region; /* UTF-8, not terminated; in the same block as the struct */
    unsigned char *data;
} Note;

/* ---- the notification rate: one token bucket per sender (core/engine/senders.py) -----------
 *
 * limits.notify_rate holds per sender node id, whichever connection or path its notes take
 * (NOTIFY frames, notes carried on WRITE frames, the control channel): the buckets live in the
 * queue, keyed by the sender. The rule is GCRA on integers, exact and the same as senders.py's
 * admit/idle: with R = rate, time in units of ns x R and a note costing 10^9 of them, a sender's
 * bucket is one number, tat (its "theoretical arrival time"); a note at now is admitted when
 * tat <= now*R + (R-1)*10^9 and then tat = max(tat, now*R) + 10^9. That is a bucket of R tokens
 * refilling R a second, starting full. The products are 128-bit: now < 2^64 and R < 2^32 keep
 * every value below 2^97, so nothing wraps. A bucket with tat <= now*R is full again (idle): it
 * says nothing a fresh one would not, so it may be forgotten. The table holds at most
 * max_senders buckets (limits.max_notify_senders); when a new sender finds it full, the idle
 * buckets are evicted, and if none is idle the note is refused (retryable): a hostile peer
 * inventing node ids holds at most max_senders buckets, and each is idle within a second of
 * its sender's last note. */
typedef unsigned __int128 u128;
#define NS_PER_S 1000000000ULL
/* A sender's bucket is keyed by the first 16 bytes of its node id: the width of the tcp HELLO's id
 * field (wire.ident), so the id a data connection proved and the one the control channel names key
 * the same bucket (engine node ids are 16 characters), and a bucket costs a few dozen bytes. */
#define SENDER_KEY_MAX 16
#define MAX_RATE 0xFFFFFFFFULL

/* The bucket rule (senders.py admit): 1 and *tat advanced, or 0 (refused, *tat unchanged). */
static int rate_admit(u128 *tat, uint64_t now_ns, uint64_t rate) {
    u128 v = (u128)now_ns * rate;
    if (*tat > v + (u128)(rate - 1) * NS_PER_S)
        return 0;
    *tat = (*tat > v ? *tat : v) + NS_PER_S;
    return 1;
}

/* senders.py idle: the bucket is full again. */
static int rate_idle(u128 tat, uint64_t now_ns, uint64_t rate) { return tat <= (u128)now_ns * rate; }

static uint64_t mono_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (uint64_t)t.tv_sec * NS_PER_S + (uint64_t)t.tv_nsec;
}

typedef struct Sender {
    struct Sender *next; /* hash chain */
    u128 tat;
    size_t klen;
    char key[]; /* the sender's node id (UTF-8, its first SENDER_KEY_MAX bytes) */
} Sender;

typedef struct {
    PyObject_HEAD
    pthread_mutex_t mu;
    pthread_cond_t cv; /* monotonic clock: a note was put, settled, or the queue closed */
    Note *head, *tail;
    uint64_t count, bytes, max_count, max_bytes, seq;
    int callbacks; /* native deliveries wait for the callbacks (PENDING) */
    int closed; /* no more dispatching: PENDING notes were made READY */
    int ready;
    /* the senders' rate buckets (rate 0: no rate, no table) */
    uint64_t rate, max_senders, nsenders, seed;
    Sender **stab;
    size_t nstab; /* a power of two */
    u128 sweep_at; /* no bucket is idle before now*rate reaches this (<= every tat in the table) */
} Notes;

static uint64_t key_hash(uint64_t seed, const char *key, size_t klen) {
    uint64_t h = seed ^ 0xcbf29ce484222325ULL; /* FNV-1a from a per-queue seed */
    for (size_t i = 0; i < klen; i++) {
        h ^= (unsigned char)key[i];
        h *= 0x100000001b3ULL;
    }
    return h ^ (h >> 29);
}

/* Forget every idle bucket (mutex held), unless none can be idle yet; sweep_at becomes the
 * smallest tat left. */
static void senders_sweep_locked(Notes *q, uint64_t now) {
    if ((u128)now * q->rate < q->sweep_at)
        return;
    u128 next = ~(u128)0;
    for (size_t i = 0; i < q->nstab; i++) {
        for (Sender **pp = &q->stab[i]; *pp;) {
            Sender *s = *pp;
            if (rate_idle(s->tat, now, q->rate)) {
                *pp = s->next;
                free(s);
                q->nsenders--;
            } else {
                if (s->tat < next)
                    next = s->tat;
                pp = &s->next;
            }
        }
    }
    q->sweep_at = next;
}

/* The bucket of sender key (mutex held), made if new; NULL with msg set when the table is full
 * of senders that are not idle (or out of memory). */
static Sender *sender_locked(Notes *q, const char *key, size_t klen, uint64_t now, char *msg, size_t msz) {
    if (klen > SENDER_KEY_MAX)
        klen = SENDER_KEY_MAX;
    Sender **slot = &q->stab[key_hash(q->seed, key, klen) & (q->nstab - 1)];
    for (Sender *s = *slot; s; s = s->next)
        if (s->klen == klen && !memcmp(s->key, key, klen))
            return s;
    if (q->nsenders >= q->max_senders)
        senders_sweep_locked(q, now);
    Sender *s = q->nsenders < q->max_senders ? malloc(sizeof *s + klen) : NULL;
    if (!s) {
        snprintf(msg, msz,
                 "too many notification senders at once (%llu sent within the last second; "
                 "limits.max_notify_senders=%llu); retry later",
                 (unsigned long long)q->nsenders, (unsigned long long)q->max_senders);
        return NULL;
    }
    s->tat = 0;
    s->klen = klen;
    memcpy(s->key, key, klen);
    s->next = *slot;
    *slot = s;
    q->nsenders++;
    q->sweep_at = 0; /* tat 0 is below every other: sweep_at stays <= every tat */
    return s;
}

/* Whether sender key may have a note now (mutex held): 0 with *s its bucket and *tat the bucket
 * once the token is spent (the caller stores it when the note is taken: s->tat = tat, under the
 * same hold of the mutex), or E_BACKPRESSURE with msg set. No rate: 0 and *s NULL. */
static int rate_check_locked(Notes *q, const char *key, size_t klen, Sender **s, u128 *tat, char *msg,
                             size_t msz) {
    *s = NULL;
    if (!q->rate)
        return 0;
    uint64_t now = mono_ns();
    Sender *b = sender_locked(q, key, klen, now, msg, msz);
    if (!b)
        return E_BACKPRESSURE;
    *tat = b->tat;
    if (!rate_admit(tat, now, q->rate)) {
        snprintf(msg, msz,
                 "more than %llu notifications a second from this node (limits.notify_rate, one budget per sender "
                 "across all its connections); retry later",
                 (unsigned long long)q->rate);
        return E_BACKPRESSURE;
    }
    *s = b;
    return 0;
}

static PyTypeObject NotesType;

/* Hold room for one note of dlen bytes from sender peer, or refuse: 0 or E_BACKPRESSURE (msg set).
 * peer NULL: no rate applies (a note moved between queues). The sender's rate is checked first,
 * then the room, under one hold of the mutex, and the token is spent only when both admit. The room counts
 * against the limits at once (count and bytes), so a note whose data must land first (a WRITE
 * frame carrying its notification, wire.py) is refused before anything is written; it is then
 * either committed (notes_commit) or given back (notes_cancel). The limits are checked on
 * unsigned values without a sum that can wrap. */
static int notes_reserve(Notes *q, const char *peer, size_t plen, size_t dlen, char *msg, size_t msz) {
    pthread_mutex_lock(&q->mu);
    Sender *s = NULL;
    u128 tat = 0;
    if (peer && rate_check_locked(q, peer, plen, &s, &tat, msg, msz)) {
        pthread_mutex_unlock(&q->mu);
        return E_BACKPRESSURE;
    }
    if (q->count >= q->max_count || dlen > q->max_bytes || q->bytes > q->max_bytes - dlen) {
        snprintf(msg, msz,
                 "notification queue full (%llu notifications, %llu bytes; limits.max_queued_notifications=%llu, "
                 "limits.max_queued_notify_bytes=%llu): nobody is consuming them",
                 (unsigned long long)q->count, (unsigned long long)q->bytes, (unsigned long long)q->max_count,
                 (unsigned long long)q->max_bytes);
        pthread_mutex_unlock(&q->mu);
        return E_BACKPRESSURE;
    }
    if (s)
        s->tat = tat; /* a token is spent only on a note the queue takes */
    q->count++;
    q->bytes += dlen;
    pthread_mutex_unlock(&q->mu);
    return 0;
}

/* Give back the room of a reservation whose note will not come (its data did not land). */
static void notes_cancel(Notes *q, size_t dlen) {
    pthread_mutex_lock(&q->mu);
    q->count--;
    q->bytes -= dlen;
    pthread_cond_broadcast(&q->cv); /* a waiter for room or for the queue to settle looks again */
    pthread_mutex_unlock(&q->mu);
}

/* Queue a copy of the note into the room reserved for it: 0, or -1 (out of memory; the room is
 * given back). */
static int notes_commit(Notes *q, const char *peer, size_t plen, const char *region, size_t rlen,
                        const unsigned char *data, size_t dlen, int settled) {
    Note *n = plen > 4096 || rlen > 4096 || dlen > MAX_NOTIFY ? NULL : malloc(sizeof *n + plen + rlen + dlen + 1);
    if (!n) {
        notes_cancel(q, dlen);
        return -1;
    }
    n->next = NULL;
    n->plen = plen;
    n->rlen = rlen;
    n->dlen = dlen;
    n->peer = (char *)(n + 1);
    n->region = n->peer + plen;
    n->data = (unsigned char *)n->region + rlen;
    memcpy(n->peer, peer, plen);
    memcpy(n->region, region, rlen);
    if (dlen)
        memcpy(n->data, data, dlen);
    pthread_mutex_lock(&q->mu);
    n->seq = ++q->seq;
    n->state = settled || !q->callbacks || q->closed ? NOTE_READY : NOTE_PENDING;
    if (q->tail)
        q->tail->next = n;
    else
        q->head = n;
    q->tail = n;
    pthread_cond_broadcast(&q->cv);
    pthread_mutex_unlock(&q->mu);
    return 0;
}

/* Queue a copy of the note, or refuse: 0, E_BACKPRESSURE (msg set), or -1 (out of memory). rated:
 * the sender's rate applies (notes_reserve). */
static int notes_put(Notes *q, const char *peer, size_t plen, const char *region, size_t rlen,
                     const unsigned char *data, size_t dlen, int settled, int rated, char *msg, size_t msz) {
    if (plen > 4096 || rlen > 4096 || dlen > MAX_NOTIFY)
        return -1;
    int rc = notes_reserve(q, rated ? peer : NULL, plen, dlen, msg, msz);
    if (rc)
        return rc;
    return notes_commit(q, peer, plen, region, rlen, data, dlen, settled);
}

/* Unlink n (mutex held); prev is the note before it or NULL. */
static void notes_unlink_locked(Notes *q, Note *prev, Note *n) {
    if (prev)
        prev->next = n->next;
    else
        q->head = n->next;
    if (q->tail == n)
        q->tail = prev;
    q->count--;
    q->bytes -= n->dlen;
}

/* A timeout argument: None or +inf waits without end; NaN, 0 or less does not wait. */
static int timeout_arg(PyObject *arg, double *left, int *forever) {
    *forever = 0;
    *left = 0;
    if (arg == Py_None) {
        *forever = 1;
        return 0;
    }
    double t = PyFloat_AsDouble(arg);
    if (t == -1.0 && PyErr_Occurred())
        return -1;
    if (isinf(t) && t > 0)
        *forever = 1;
    else if (t > 0)
        *left = t;
    return 0;
}

static void cond_wait_until(pthread_cond_t *cv, pthread_mutex_t *mu, double until) {
    struct timespec ts;
    double s = floor(until);
    ts.tv_sec = (time_t)s;
    ts.tv_nsec = (long)((until - s) * 1e9);
    if (ts.tv_nsec >= 1000000000L)
        ts.tv_nsec = 999999999L;
    pthread_cond_timedwait(cv, mu, &ts);
}

/* Wait (GIL released, in slices so signals are seen) until pick(q) finds a note, which it
 * returns with the mutex released; NULL at the timeout, once the queue is closed where
 * stop_on_close, or with an exception from a signal (*err). */
typedef Note *(*Pick)(Notes *q, Note **prev);
static Note *notes_wait(Notes *q, PyObject *timeout, Pick pick, int stop_on_close, Note **prev, int *err) {
    double left;
    int forever;
    *err = 0;
    if (timeout_arg(timeout, &left, &forever) < 0) {
        *err = 1;
        return NULL;
    }
    double end = mono() + left;
    for (;;) {
        Note *n;
        int stop;
        Py_BEGIN_ALLOW_THREADS
        pthread_mutex_lock(&q->mu);
        double now = mono(), until = now + 0.5;
        if (!forever && end < until)
            until = end;
        while (!(n = pick(q, prev)) && !(stop = stop_on_close && q->closed) && (now = mono()) < until)
            cond_wait_until(&q->cv, &q->mu, until);
        stop = stop_on_close && q->closed;
        pthread_mutex_unlock(&q->mu);
        Py_END_ALLOW_THREADS
        if (n || stop || (!forever && mono() >= end))
            return n;
        if (PyErr_CheckSignals() < 0) {
            *err = 1;
            return NULL;
        }
    }
}

/* get(): the head when it is READY, unlinked (mutex held by notes_wait). */
static Note *pick_ready(Notes *q, Note **prev) {
    *prev = NULL;
    Note *n = q->head;
    if (!n || n->state != NOTE_READY)
        return NULL;
    notes_unlink_locked(q, NULL, n);
    return n;
}

/* dispatch(): the first PENDING note, now DISPATCHED (it stays queued). */
static Note *pick_pending(Notes *q, Note **prev) {
    *prev = NULL;
    if (q->closed)
        return NULL;
    for (Note *n = q->head; n; n = n->next)
        if (n->state == NOTE_PENDING) {
            n->state = NOTE_DISPATCHED;
            return n;
        }
    return NULL;
}

static PyObject *note_tuple(const Note *n) {
    return Py_BuildValue("(NNy#)", PyUnicode_DecodeUTF8(n->peer, (Py_ssize_t)n->plen, "replace"),
                         PyUnicode_DecodeUTF8(n->region, (Py_ssize_t)n->rlen, "replace"), (const char *)n->data,
                         (Py_ssize_t)n->dlen);
}

static int Notes_init(Notes *self, PyObject *args, PyObject *kw) {
    static char *names[] = {"max_count", "max_bytes", "rate", "max_senders", NULL};
    unsigned long long mc, mb, rate = 0, max_senders = 4096;
    if (self->ready) {
        PyErr_SetString(PyExc_RuntimeError, "Notes is initialised once");
        return -1;
    }
    if (!PyArg_ParseTupleAndKeywords(args, kw, "KK|KK", names, &mc, &mb, &rate, &max_senders))
        return -1;
    if (rate > MAX_RATE || max_senders < 1 || max_senders > (1ULL << 24)) {
        PyErr_SetString(PyExc_ValueError, "rate must be below 2**32 and max_senders within [1, 2**24]");
        return -1;
    }
    if (rate) { /* rate 0: no rate (a queue alone, in tests) */
        size_t n = 16;
        while (n < max_senders && n < (1u << 16))
            n *= 2;
        self->stab = calloc(n, sizeof(Sender *));
        if (!self->stab) {
            PyErr_NoMemory();
            return -1;
        }
        self->nstab = n;
        self->rate = rate;
        self->max_senders = max_senders;
        self->seed = mono_ns() ^ ((uint64_t)(uintptr_t)self * 0x9E3779B97F4A7C15ULL) ^ (uint64_t)(wall() * 1e6);
    }
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_mutex_init(&self->mu, NULL);
    pthread_cond_init(&self->cv, &ca);
    pthread_condattr_destroy(&ca);
    self->max_count = mc;
    self->max_bytes = mb;
    self->ready = 1;
    return 0;
}

static int notes_ready(Notes *q) {
    if (!q->ready)
        PyErr_SetString(PyExc_RuntimeError, "Notes is not initialised");
    return q->ready;
}

/* put(peer, region, data, settled, rated=True) -> None, or the refusal's message (over the sender's
 * rate, queue full). rated=False: no rate (a note moved here from another queue). */
static PyObject *Notes_put(Notes *q, PyObject *args) {
    const char *peer, *region;
    Py_ssize_t plen, rlen;
    Py_buffer data;
    int settled, rated = 1;
    if (!notes_ready(q) ||
        !PyArg_ParseTuple(args, "s#s#y*p|p", &peer, &plen, &region, &rlen, &data, &settled, &rated))
        return NULL;
    char msg[512];
    int rc = -1;
    if (plen <= 4096 && rlen <= 4096 && data.len <= MAX_NOTIFY) {
        Py_BEGIN_ALLOW_THREADS
        rc = notes_put(q, peer, (size_t)plen, region, (size_t)rlen, data.buf, (size_t)data.len, settled, rated,
                       msg, sizeof msg);
        Py_END_ALLOW_THREADS
    } else {
        PyBuffer_Release(&data);
        PyErr_SetString(PyExc_ValueError, "notification too large for the queue");
        return NULL;
    }
    PyBuffer_Release(&data);
    if (rc < 0)
        return PyErr_NoMemory();
    if (rc)
        return PyUnicode_FromString(msg);
    Py_RETURN_NONE;
}

/* reserve(size, peer=None) -> None, or the refusal's message when sender peer is over its rate or
 * the queue has no room for a note of size bytes (then nothing is held). peer None: no rate. The
 * room is held until commit() or cancel(). */
static PyObject *Notes_reserve(Notes *q, PyObject *args) {
    Py_ssize_t size, plen = 0;
    const char *peer = NULL;
    if (!notes_ready(q) || !PyArg_ParseTuple(args, "n|z#", &size, &peer, &plen))
        return NULL;
    if (size < 0 || size > MAX_NOTIFY) {
        PyErr_SetString(PyExc_ValueError, "notification too large for the queue");
        return NULL;
    }
    char msg[512];
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = notes_reserve(q, peer, (size_t)plen, (size_t)size, msg, sizeof msg);
    Py_END_ALLOW_THREADS
    if (rc)
        return PyUnicode_FromString(msg);
    Py_RETURN_NONE;
}

/* take(peer) -> None, or the refusal's message: spend one of sender peer's tokens for a note that is
 * not queued (an on_notification callback consumes it). */
static PyObject *Notes_take(Notes *q, PyObject *args) {
    const char *peer;
    Py_ssize_t plen;
    if (!notes_ready(q) || !PyArg_ParseTuple(args, "s#", &peer, &plen))
        return NULL;
    char msg[512];
    Sender *s;
    u128 tat = 0;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&q->mu);
    rc = rate_check_locked(q, peer, (size_t)plen, &s, &tat, msg, sizeof msg);
    if (s)
        s->tat = tat;
    pthread_mutex_unlock(&q->mu);
    Py_END_ALLOW_THREADS
    if (rc)
        return PyUnicode_FromString(msg);
    Py_RETURN_NONE;
}

/* senders() -> the rate buckets held now (at most max_senders). */
static PyObject *Notes_senders(Notes *q, PyObject *unused) {
    (void)unused;
    if (!notes_ready(q))
        return NULL;
    pthread_mutex_lock(&q->mu);
    unsigned long long n = q->nsenders;
    pthread_mutex_unlock(&q->mu);
    return PyLong_FromUnsignedLongLong(n);
}

/* commit(peer, region, data, settled): queue a note into the room reserve(len(data)) held. */
static PyObject *Notes_commit(Notes *q, PyObject *args) {
    const char *peer, *region;
    Py_ssize_t plen, rlen;
    Py_buffer data;
    int settled;
    if (!notes_ready(q) || !PyArg_ParseTuple(args, "s#s#y*p", &peer, &plen, &region, &rlen, &data, &settled))
        return NULL;
    int rc = notes_commit(q, peer, (size_t)plen, region, (size_t)rlen, data.buf, (size_t)data.len, settled);
    PyBuffer_Release(&data);
    if (rc)
        return PyErr_NoMemory();
    Py_RETURN_NONE;
}

/* cancel(size): give back the room reserve(size) held. */
static PyObject *Notes_cancel(Notes *q, PyObject *arg) {
    Py_ssize_t size = PyLong_AsSsize_t(arg);
    if (!notes_ready(q) || (size == -1 && PyErr_Occurred()))
        return NULL;
    if (size < 0 || size > MAX_NOTIFY) {
        PyErr_SetString(PyExc_ValueError, "no reservation of that size");
        return NULL;
    }
    notes_cancel(q, (size_t)size);
    Py_RETURN_NONE;
}

/* get(timeout) -> (peer, region, data), or None at the timeout. */
static PyObject *Notes_get(Notes *q, PyObject *timeout) {
    if (!notes_ready(q))
        return NULL;
    Note *prev;
    int err;
    Note *n = notes_wait(q, timeout, pick_ready, 0, &prev, &err);
    if (err)
        return NULL;
    if (!n)
        Py_RETURN_NONE;
    PyObject *t = note_tuple(n);
    if (!t) { /* not lost: back at the head, as it was */
        pthread_mutex_lock(&q->mu);
        n->next = q->head;
        q->head = n;
        if (!q->tail)
            q->tail = n;
        q->count++;
        q->bytes += n->dlen;
        pthread_mutex_unlock(&q->mu);
        return NULL;
    }
    free(n);
    return t;
}

/* dispatch(timeout) -> (seq, peer, region, data) of the next note whose callbacks are to run, or None. */
static PyObject *Notes_dispatch(Notes *q, PyObject *timeout) {
    if (!notes_ready(q))
        return NULL;
    Note *prev;
    int err;
    Note *n = notes_wait(q, timeout, pick_pending, 1, &prev, &err);
    if (err)
        return NULL;
    if (!n)
        Py_RETURN_NONE;
    /* n stays queued (DISPATCHED) until settle(): only this thread frees it then */
    PyObject *t = note_tuple(n);
    PyObject *r = t ? Py_BuildValue("(KN)", (unsigned long long)n->seq, t) : NULL;
    if (!r) {
        pthread_mutex_lock(&q->mu);
        n->state = NOTE_READY; /* its callbacks cannot run: wait_notification still gets it */
        pthread_cond_broadcast(&q->cv);
        pthread_mutex_unlock(&q->mu);
    }
    return r;
}

/* settle(seq, consumed): the callbacks of a dispatched note ran; consumed, it leaves, else READY. */
static PyObject *Notes_settle(Notes *q, PyObject *args) {
    unsigned long long seq;
    int consumed;
    if (!notes_ready(q) || !PyArg_ParseTuple(args, "Kp", &seq, &consumed))
        return NULL;
    Note *gone = NULL;
    pthread_mutex_lock(&q->mu);
    for (Note *prev = NULL, *n = q->head; n; prev = n, n = n->next) {
        if (n->seq != seq || n->state != NOTE_DISPATCHED)
            continue;
        if (consumed) {
            notes_unlink_locked(q, prev, n);
            gone = n;
        } else {
            n->state = NOTE_READY;
        }
        break;
    }
    pthread_cond_broadcast(&q->cv);
    pthread_mutex_unlock(&q->mu);
    free(gone);
    Py_RETURN_NONE;
}

/* set_callbacks(on): whether native deliveries wait for the callbacks (PENDING). */
static PyObject *Notes_set_callbacks(Notes *q, PyObject *arg) {
    int on = PyObject_IsTrue(arg);
    if (!notes_ready(q) || on < 0)
        return NULL;
    pthread_mutex_lock(&q->mu);
    q->callbacks = on;
    pthread_mutex_unlock(&q->mu);
    Py_RETURN_NONE;
}

/* close(): dispatching ends; notes still waiting for callbacks become READY (nothing is lost). */
static PyObject *Notes_close(Notes *q, PyObject *unused) {
    (void)unused;
    if (!notes_ready(q))
        return NULL;
    pthread_mutex_lock(&q->mu);
    q->closed = 1;
    for (Note *n = q->head; n; n = n->next)
        if (n->state != NOTE_DISPATCHED)
            n->state = NOTE_READY;
    pthread_cond_broadcast(&q->cv);
    pthread_mutex_unlock(&q->mu);
    Py_RETURN_NONE;
}

static PyObject *Notes_size(Notes *q, PyObject *unused) {
    (void)unused;
    if (!notes_ready(q))
        return NULL;
    pthread_mutex_lock(&q->mu);
    /* What is queued, counted from the list: q->count and q->bytes also hold the room reserved
     * for notes whose data is still landing, which the Python queue's len() does not count. */
    unsigned long long c = 0, b = 0, w = 0;
    for (Note *n = q->head; n; n = n->next) {
        c++;
        b += n->dlen;
        w += n->state != NOTE_READY;
    }
    pthread_mutex_unlock(&q->mu);
    return Py_BuildValue("(KKK)", c, b, w);
}

static void Notes_dealloc(Notes *self) {
    if (self->ready) {
        for (Note *n = self->head; n;) {
            Note *nx = n->next;
            free(n);
            n = nx;
        }
        for (size_t i = 0; i < self->nstab; i++) {
            for (Sender *s = self->stab[i]; s;) {
                Sender *nx = s->next;
                free(s);
                s = nx;
            }
        }
        free(self->stab);
        pthread_mutex_destroy(&self->mu);
        pthread_cond_destroy(&self->cv);
    }
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMethodDef Notes_methods[] = {
    {"put", (PyCFunction)Notes_put, METH_VARARGS,
     "put(peer, region, data, settled, rated=True) -> None | str: queue a note, or the refusal's message "
     "(over the sender's rate, full)"},
    {"reserve", (PyCFunction)Notes_reserve, METH_VARARGS,
     "reserve(size, peer=None) -> None | str: hold room for one note, or the refusal's message"},
    {"take", (PyCFunction)Notes_take, METH_VARARGS,
     "take(peer) -> None | str: spend one of the sender's tokens for a note that is not queued"},
    {"senders", (PyCFunction)Notes_senders, METH_NOARGS, "senders() -> rate buckets held now"},
    {"commit", (PyCFunction)Notes_commit, METH_VARARGS,
     "commit(peer, region, data, settled): queue a note into the room reserve(len(data)) held"},
    {"cancel", (PyCFunction)Notes_cancel, METH_O, "cancel(size): give back the room reserve(size) held"},
    {"get", (PyCFunction)Notes_get, METH_O, "get(timeout) -> (peer, region, data) | None: take the head"},
    {"dispatch", (PyCFunction)Notes_dispatch, METH_O,
     "dispatch(timeout) -> (seq, (peer, region, data)) | None: the next note whose callbacks are to run"},
    {"settle", (PyCFunction)Notes_settle, METH_VARARGS, "settle(seq, consumed): its callbacks ran"},
    {"set_callbacks", (PyCFunction)Notes_set_callbacks, METH_O, "set_callbacks(on)"},
    {"close", (PyCFunction)Notes_close, METH_NOARGS, "close(): stop dispatching"},
    {"size", (PyCFunction)Notes_size, METH_NOARGS, "size() -> (notes, bytes, awaiting callbacks) queued"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject NotesType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "_mpcomm_dataport.Notes",
    .tp_basicsize = sizeof(Notes),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Notes_init,
    .tp_dealloc = (destructor)Notes_dealloc,
    .tp_methods = Notes_methods,
    .tp_doc = "The engine's bounded notification queue, filled by the data port's threads without the GIL.",
};

/* ---- the region table ---------------------------------------------------------------- */
typedef struct Entry {
    struct Entry *next; /* hash chain */
    uint64_t id, token;
    unsigned char *base;
    uint64_t size;
    int rights; /* ACC_R | ACC_W */
    uint64_t inflight; /* requests moving bytes of it now (under the port's mutex) */
    char *qname; /* repr(region.name), UTF-8, for refusals */
    Py_buffer view; /* the export that keeps base valid; released by revoke (GIL held) */
} Entry;

/* One connection being served (on its carrier thread's stack), listed so a revocation can cut it. */
typedef struct Conn {
    struct Conn *next, *prev;
    int fd;
    Entry *holding; /* the entry it moves bytes of now, or NULL */
    int cut; /* revocation shut the socket down */
} Conn;

typedef struct {
    PyObject_HEAD
    pthread_mutex_t mu;
    pthread_cond_t cv; /* a request released an entry */
    Entry **buckets;
    size_t nbuckets, count;
    Conn conns; /* list head */
    uint64_t epoch;
    int epoch_ok;
    double idle, max_request, grace, handshake;
    uint32_t max_batch;
    uint64_t chunk;
    long long busy_ns;
    /* Busy-poll counters (poll_stats()): polls run, those that found the request, those that found
     * themselves preempted, requests waited for by blocking because of a pause. */
    unsigned long long stat_polls, stat_found, stat_preempted, stat_paused;
    Notes *notes; /* the engine's notification queue (a reference), or NULL: no NOTIFY frames */
    uint64_t max_note; /* limits.max_notify_bytes (limits.notify_rate is the queue's, per sender) */
    int closed;
    int ready;
} Port;

static int spin_limit = 1;
static int spinners = 0;
static unsigned char discard_buf[256 << 10]; /* refused payloads land here and are thrown away */

static size_t bucket_of(const Port *p, uint64_t id) {
    uint64_t h = id * 0x9E3779B97F4A7C15ULL;
    return (size_t)(h >> 32) & (p->nbuckets - 1);
}

static Entry *find_locked(Port *p, uint64_t id) {
    for (Entry *e = p->buckets[bucket_of(p, id)]; e; e = e->next)
        if (e->id == id)
            return e;
    return NULL;
}

static int grow_locked(Port *p) {
    size_t nb = p->nbuckets * 2;
    Entry **b = calloc(nb, sizeof(Entry *));
    if (!b)
        return -1;
    Entry **old = p->buckets;
    size_t onb = p->nbuckets;
    p->buckets = b;
    p->nbuckets = nb;
    for (size_t i = 0; i < onb; i++) {
        Entry *e = old[i];
        while (e) {
            Entry *n = e->next;
            size_t k = bucket_of(p, e->id);
            e->next = b[k];
            b[k] = e;
            e = n;
        }
    }
    free(old);
    return 0;
}

static Entry *unlink_locked(Port *p, uint64_t id) {
    Entry **pp = &p->buckets[bucket_of(p, id)];
    for (; *pp; pp = &(*pp)->next) {
        if ((*pp)->id == id) {
            Entry *e = *pp;
            *pp = e->next;
            e->next = NULL;
            p->count--;
            return e;
        }
    }
    return NULL;
}

/* The one range check: n <= size && off <= size - n, on unsigned values (no sum that can wrap). */
static int in_range(uint64_t off, uint64_t n, uint64_t size) { return n <= size && off <= size - n; }

/* Check a peer's access as RegionTable.serve does (same order, codes and messages), after the
 * deadline check of server.py's _check. On success the entry is held (inflight + 1) and *out set;
 * with bounds = 0 the range is not checked (a batch checks its indices itself). */
static int admit(Port *p, Conn *c, uint64_t rid, uint64_t token, uint64_t epoch, uint64_t off, uint64_t n, int access,
                 double end, int bounds, Entry **out, char *msg, size_t msz) {
    *out = NULL;
    if (mono() >= end) {
        snprintf(msg, msz, "request arrived after its deadline; nothing was touched");
        return E_TIMEOUT;
    }
    if (!p->epoch_ok || epoch != p->epoch) {
        snprintf(msg, msz, "descriptor is from an earlier epoch of this node; open the region again");
        return E_STALE;
    }
    pthread_mutex_lock(&p->mu);
    Entry *e = find_locked(p, rid);
    int rc = E_NONE;
    if (!e) {
        snprintf(msg, msz, "no region with id %llu is registered here", (unsigned long long)rid);
        rc = E_UNKNOWN;
    } else if (token != e->token) {
        snprintf(msg, msz, "wrong token for region %s", e->qname);
        rc = E_DENIED;
    } else if (!(e->rights & access)) {
        snprintf(msg, msz, "region %s may not be %s by peers", e->qname, access == ACC_W ? "written" : "read");
        rc = E_DENIED;
    } else if (bounds && !in_range(off, n, e->size)) {
        char a[48], b[48];
        u128_str(off, a);
        u128_str((unsigned __int128)off + n, b);
        snprintf(msg, msz, "[%s, %s) is outside region %s of %llu bytes", a, b, e->qname,
                 (unsigned long long)e->size);
        rc = E_BOUNDS;
    } else {
        e->inflight++;
        *out = e;
        if (c)
            c->holding = e; /* listed under the same lock: a revocation past its grace finds it */
    }
    pthread_mutex_unlock(&p->mu);
    return rc;
}

static void release(Port *p, Conn *c, Entry *e) {
    pthread_mutex_lock(&p->mu);
    if (--e->inflight == 0)
        pthread_cond_broadcast(&p->cv);
    if (c)
        c->holding = NULL;
    pthread_mutex_unlock(&p->mu);
}

/* ---- socket calls bounded by a deadline (monotonic seconds) ------------------------------ */
/* Results of the receive/send helpers. */
#define IO_DEADLINE (-1)
#define IO_EOF (-2)
#define IO_ERR (-3)

static int wait_fd(int fd, short ev, double end) {
    for (;;) {
        double left = end - mono();
        if (left <= 0)
            return IO_DEADLINE;
        struct pollfd q = {fd, ev, 0};
        int ms = left > 3600 ? 3600 * 1000 : (int)(left * 1000.0) + 1; /* no cast of a huge double */
        int r = poll(&q, 1, ms);
        if (r > 0)
            return 0;
        if (r < 0 && errno != EINTR)
            return IO_ERR;
    }
}

/* Bytes the connection's header read took from the socket beyond the header (the start of the
 * frame's payload, or of the next frame): one recv() takes a small write's header and payload
 * together. Every later read of the stream takes from here first (recv_some), so the bytes are
 * consumed in stream order whoever reads them; the payload is copied into a region only by
 * recv_region, after its admission and range check, as a payload read from the socket is. */
#define CARRY_SIZE 16384
typedef struct {
    unsigned char b[CARRY_SIZE];
    size_t at, len; /* b[at..len) not consumed yet */
} Carry;

/* Receive up to n bytes (at least one) from the socket by end: > 0 bytes, or IO_*. */
static long long recv_sock(int fd, unsigned char *buf, size_t n, double end) {
    for (;;) {
        ssize_t r = recv(fd, buf, n, MSG_DONTWAIT);
        if (r > 0)
            return r;
        if (r == 0)
            return IO_EOF;
        if (errno == EINTR)
            continue;
        if (errno != EAGAIN && errno != EWOULDBLOCK)
            return IO_ERR;
        int w = wait_fd(fd, POLLIN, end);
        if (w)
            return w;
    }
}

/* Receive up to n bytes (at least one) by end, from cy's bytes first: > 0 bytes, or IO_*. */
static long long recv_some(int fd, Carry *cy, unsigned char *buf, size_t n, double end) {
    if (cy->at < cy->len) {
        size_t k = cy->len - cy->at < n ? cy->len - cy->at : n;
        memcpy(buf, cy->b + cy->at, k);
        cy->at += k;
        return (long long)k;
    }
    return recv_sock(fd, buf, n, end);
}

/* Receive exactly n bytes by end: 0, or IO_*. */
static int recv_exact(int fd, Carry *cy, unsigned char *buf, size_t n, double end) {
    size_t pos = 0;
    while (pos < n) {
        long long r = recv_some(fd, cy, buf + pos, n - pos, end);
        if (r < 0)
            return (int)r;
        pos += (size_t)r;
    }
    return 0;
}

/* Swallow n payload bytes into the discard buffer by end: 0, or IO_*. */
static int drain(int fd, Carry *cy, uint64_t n, double end) {
    while (n) {
        size_t k = n < sizeof discard_buf ? (size_t)n : sizeof discard_buf;
        long long r = recv_some(fd, cy, discard_buf, k, end);
        if (r < 0)
            return (int)r;
        n -= (uint64_t)r;
    }
    return 0;
}

/* Send every byte of iov[0..cnt) by end (iov is consumed): 0, or IO_*. */
static int send_all(int fd, struct iovec *iov, size_t cnt, double end) {
    size_t i = 0;
    while (i < cnt && iov[i].iov_len == 0)
        i++;
    while (i < cnt) {
        struct msghdr m;
        memset(&m, 0, sizeof m);
        m.msg_iov = iov + i;
        m.msg_iovlen = cnt - i < IOV_MAX ? cnt - i : IOV_MAX;
        ssize_t r = sendmsg(fd, &m, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (r < 0) {
            if (errno == EINTR)
                continue;
            if (errno != EAGAIN && errno != EWOULDBLOCK)
                return IO_ERR;
            int w = wait_fd(fd, POLLOUT, end);
            if (w)
                return w;
            continue;
        }
        size_t s = (size_t)r;
        while (i < cnt && s >= iov[i].iov_len) {
            s -= iov[i].iov_len;
            i++;
        }
        if (s) {
            iov[i].iov_base = (char *)iov[i].iov_base + s;
            iov[i].iov_len -= s;
        }
        while (i < cnt && iov[i].iov_len == 0)
            i++;
    }
    return 0;
}

/* ---- one connection ----------------------------------------------------------------------- */
/* The busy-poll pause of one connection (spin_recv). */
typedef struct {
    unsigned skip;    /* requests still to wait for by blocking */
    unsigned backoff; /* the pause after the next preempted poll, in requests */
} Pause;
typedef struct {
    Port *p;
    Conn *c;
    int fd;
    char why[512]; /* how the connection ended, for the log */
    Pause pause;
    Carry carry;   /* read past the last header (recv_some) */
    char peer[64]; /* the initiator's node id, as HELLO and authentication proved it */
    size_t plen;
} Ctx;

static int fail(Ctx *x, int kind, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static int fail(Ctx *x, int kind, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(x->why, sizeof x->why, fmt, ap);
    va_end(ap);
    return kind;
}

/* An IO_* result mid-frame as the connection's end (server.py: TransferTimeout, PeerConnectionError). */
static int io_end(Ctx *x, int io, const char *what) {
    if (io == IO_DEADLINE)
        return fail(x, END_ERROR, "%s: deadline passed", what);
    if (io == IO_EOF)
        return fail(x, END_ERROR, "%s: the peer closed the connection", what);
    return fail(x, END_OS, "%s: %s", what, strerror(errno));
}

/* The code point of the UTF-8 sequence at s and its length in *len; U+FFFD for a malformed byte
 * (length 1). Stops at a NUL, which is never a continuation byte. */
static uint32_t utf8_next(const unsigned char *s, int *len) {
    uint32_t c = s[0];
    int k = c < 0x80 ? 0 : (c & 0xE0) == 0xC0 ? 1 : (c & 0xF0) == 0xE0 ? 2 : (c & 0xF8) == 0xF0 ? 3 : -1;
    *len = 1;
    if (k < 0)
        return 0xFFFD;
    if (k > 0)
        c &= 0x3Fu >> k;
    for (int i = 1; i <= k; i++) {
        if ((s[i] & 0xC0) != 0x80)
            return 0xFFFD;
        c = c << 6 | (s[i] & 0x3Fu);
    }
    *len = k + 1;
    return c > 0x10FFFF ? 0xFFFD : c;
}

/* {"code": ..., "message": ...} with the message escaped as server.py's json.dumps does (ensure_ascii:
 * the short escapes, \u00XX for other controls and DEL, \uXXXX or a surrogate pair beyond ASCII), so
 * both servers send the same bytes. Returns its length. A message of MSG_CAP bytes fits BODY_CAP: no
 * byte takes more than 6. */
static size_t error_body(char *out, size_t cap, int code, const char *msg) {
    static const char SHORT[] = "btn\0fr"; /* \b \t \n (\v has none) \f \r: json's short escapes */
    size_t n = (size_t)snprintf(out, cap, "{\"code\": \"%s\", \"message\": \"", CODES[code]);
    for (const unsigned char *s = (const unsigned char *)msg; *s && n + 16 < cap;) {
        int len;
        uint32_t c = utf8_next(s, &len);
        s += len;
        if (c == '"' || c == '\\') {
            out[n++] = '\\';
            out[n++] = (char)c;
        } else if (c >= '\b' && c <= '\r' && SHORT[c - '\b']) {
            out[n++] = '\\';
            out[n++] = SHORT[c - '\b'];
        } else if (c >= 0x10000) {
            c -= 0x10000;
            n += (size_t)snprintf(out + n, cap - n, "\\u%04x\\u%04x", 0xD800 | (c >> 10), 0xDC00 | (c & 0x3FF));
        } else if (c < 0x20 || c >= 0x7F) {
            n += (size_t)snprintf(out + n, cap - n, "\\u%04x", c);
        } else {
            out[n++] = (char)c;
        }
    }
    n += (size_t)snprintf(out + n, cap - n, "\"}");
    return n < cap ? n : cap - 1;
}

static void resp_head(unsigned char *h, int status, uint32_t count, uint64_t req_id, uint64_t length) {
    h[0] = 'M';
    h[1] = 'R';
    h[2] = (unsigned char)status;
    h[3] = 0;
    put_be32(h + 4, count);
    put_be64(h + 8, req_id);
    put_be64(h + 16, length);
}

static double reply_end(Ctx *x, double end) {
    double now = mono();
    return (end > now ? end : now) + x->p->grace;
}

static int reply(Ctx *x, int status, uint32_t count, uint64_t req_id, const void *body, size_t blen,
                 double end) {
    unsigned char h[RESP_SIZE];
    resp_head(h, status, count, req_id, blen);
    struct iovec iov[2] = {{h, RESP_SIZE}, {(void *)body, blen}};
    int r = send_all(x->fd, iov, 2, reply_end(x, end));
    return r ? io_end(x, r, "tcp reply") : -1;
}

static int refuse(Ctx *x, uint64_t req_id, int code, const char *msg, double end) {
    static __thread char body[BODY_CAP]; /* per thread: too big for a small thread stack */
    size_t n = error_body(body, sizeof body, code, msg);
    return reply(x, ST_ERR, 0, req_id, body, n, end);
}

/* Receive n bytes into e's [off, off + n) by end; returns the bytes received, or IO_EOF/IO_ERR. */
static long long recv_region(Ctx *x, Entry *e, uint64_t off, uint64_t n, double end) {
    if (!in_range(off, n, e->size)) /* re-checked at the point of use, against the entry held */
        return IO_ERR;
    unsigned char *dst = e->base + off;
    uint64_t pos = 0;
    while (pos < n) {
        uint64_t k = n - pos;
        if (k > x->p->chunk)
            k = x->p->chunk;
        long long r = recv_some(x->fd, &x->carry, dst + pos, (size_t)k, end);
        if (r == IO_DEADLINE)
            return (long long)pos;
        if (r < 0)
            return r;
        pos += (uint64_t)r;
    }
    return (long long)pos;
}

static int do_write(Ctx *x, uint64_t req_id, uint64_t rid, uint64_t token, uint64_t epoch, uint64_t off,
                    uint64_t n, double end) {
    Port *p = x->p;
    char msg[MSG_CAP];
    Entry *e;
    int code = admit(p, x->c, rid, token, epoch, off, n, ACC_W, end, 1, &e, msg, sizeof msg);
    if (code) {
        int r = drain(x->fd, &x->carry, n, end + p->grace);
        if (r)
            return io_end(x, r, "tcp payload");
        return refuse(x, req_id, code, msg, end);
    }
    long long pos = recv_region(x, e, off, n, end);
    release(p, x->c, e);
    if (pos < 0)
        return io_end(x, (int)pos, "tcp payload");
    if ((uint64_t)pos < n) {
        int r = drain(x->fd, &x->carry, n - (uint64_t)pos, end + p->grace);
        if (r)
            return io_end(x, r, "tcp payload");
        snprintf(msg, sizeof msg, "deadline passed after %lld of %llu bytes; the range is partly written", pos,
                 (unsigned long long)n);
        return refuse(x, req_id, E_TIMEOUT, msg, end);
    }
    return reply(x, ST_OK, 0, req_id, NULL, 0, end);
}

static int do_read(Ctx *x, uint64_t req_id, uint64_t rid, uint64_t token, uint64_t epoch, uint64_t off,
                   uint64_t n, double end) {
    Port *p = x->p;
    char msg[MSG_CAP];
    Entry *e;
    int code = admit(p, x->c, rid, token, epoch, off, n, ACC_R, end, 1, &e, msg, sizeof msg);
    if (code)
        return refuse(x, req_id, code, msg, end);
    unsigned char h[RESP_SIZE];
    resp_head(h, ST_OK, 0, req_id, n);
    int r = IO_ERR;
    if (in_range(off, n, e->size)) {
        struct iovec iov[2] = {{h, RESP_SIZE}, {e->base + off, (size_t)n}};
        r = send_all(x->fd, iov, 2, end);
    }
    release(p, x->c, e);
    return r ? io_end(x, r, "tcp read payload") : -1;
}

static int do_batch(Ctx *x, int op, uint32_t count, uint64_t req_id, uint64_t rid, uint64_t token,
                    uint64_t epoch, uint64_t total, double end) {
    Port *p = x->p;
    int write = op == OP_WRITEV;
    int rc = -1;
    unsigned char *desc = malloc((size_t)count * 16);
    uint64_t *offs = malloc((size_t)count * 8), *lens = malloc((size_t)count * 8);
    unsigned char *status = calloc(count, 1);
    struct iovec *iov = malloc(((size_t)count + 2) * sizeof *iov);
    Entry *e = NULL;
    char msg[MSG_CAP], first[MSG_CAP];
    if (!desc || !offs || !lens || !status || !iov) {
        rc = fail(x, END_OS, "out of memory for a batch of %u", count);
        goto out;
    }
    int r = recv_exact(x->fd, &x->carry, desc, (size_t)count * 16, end + p->grace);
    if (r) {
        rc = io_end(x, r, "tcp batch descriptors");
        goto out;
    }
    uint64_t sum = 0, lo = UINT64_MAX, hi = 0;
    int bad = 0;
    for (uint32_t i = 0; i < count; i++) {
        offs[i] = get_le64(desc + 8 * (size_t)i);
        lens[i] = get_le64(desc + 8 * ((size_t)count + i));
        if ((int64_t)offs[i] < 0 || (int64_t)lens[i] < 0 || __builtin_add_overflow(sum, lens[i], &sum))
            bad = 1;
        if (!bad) {
            if (offs[i] < lo)
                lo = offs[i];
            if (offs[i] + lens[i] > hi) /* both < 2^63: the sum does not wrap */
                hi = offs[i] + lens[i];
        }
    }
    if (bad || sum != total) {
        rc = fail(x, END_PROTOCOL,
                  "batch descriptors disagree with the header (negative, or lengths do not add up)");
        goto out;
    }
    int access = write ? ACC_W : ACC_R;
    int refused = 0;
    /* One check for the hull of every range; only if it fails on bounds, one per index. */
    int code = admit(p, x->c, rid, token, epoch, lo, hi - lo, access, end, 1, &e, msg, sizeof msg);
    if (code == E_BOUNDS) {
        code = admit(p, x->c, rid, token, epoch, 0, 0, access, end, 0, &e, msg, sizeof msg);
        if (!code) {
            for (uint32_t i = 0; i < count; i++) {
                if (in_range(offs[i], lens[i], e->size))
                    continue;
                if (!refused) {
                    char a[48], b[48];
                    u128_str(offs[i], a);
                    u128_str((unsigned __int128)offs[i] + lens[i], b);
                    snprintf(first, sizeof first, "index %u of %u: [%s, %s) is outside region %s of %llu bytes", i,
                             count, a, b, e->qname, (unsigned long long)e->size);
                }
                status[i] = 1;
                refused++;
            }
            if ((uint32_t)refused == count) {
                release(p, x->c, e);
                e = NULL;
            }
        }
    }
    if (code) { /* refused as a whole (token, epoch, access, deadline): nothing is touched */
        if (write && (r = drain(x->fd, &x->carry, total, end + p->grace))) {
            rc = io_end(x, r, "tcp payload");
            goto out;
        }
        rc = refuse(x, req_id, code, msg, end);
        goto out;
    }
    static __thread char body[BODY_CAP]; /* per thread: too big for a small thread stack */
    size_t blen = 0;
    unsigned char jl[4];
    if (refused) {
        blen = error_body(body, sizeof body, E_BOUNDS, first);
        put_be32(jl, (uint32_t)blen);
    }
    if (write) {
        for (uint32_t i = 0; i < count; i++) {
            uint64_t n = lens[i];
            if (status[i]) {
                if ((r = drain(x->fd, &x->carry, n, end + p->grace))) {
                    rc = io_end(x, r, "tcp payload");
                    goto out;
                }
                continue;
            }
            long long pos = n ? recv_region(x, e, offs[i], n, end) : 0;
            if (pos < 0) {
                rc = io_end(x, (int)pos, "tcp payload");
                goto out;
            }
            if ((uint64_t)pos < n) {
                uint64_t left = n - (uint64_t)pos;
                for (uint32_t j = i + 1; j < count; j++)
                    left += lens[j];
                release(p, x->c, e);
                e = NULL;
                if ((r = drain(x->fd, &x->carry, left, end + p->grace))) {
                    rc = io_end(x, r, "tcp payload");
                    goto out;
                }
                snprintf(msg, sizeof msg,
                         "deadline passed in index %u of %u; indices from %u on are partly written or not", i,
                         count, i);
                rc = refuse(x, req_id, E_TIMEOUT, msg, end);
                goto out;
            }
        }
        if (e) {
            release(p, x->c, e);
            e = NULL;
        }
        if (!refused) {
            rc = reply(x, ST_OK, count, req_id, NULL, 0, end);
            goto out;
        }
        unsigned char h[RESP_SIZE];
        resp_head(h, ST_PARTIAL, count, req_id, (uint64_t)count + 4 + blen);
        struct iovec v[4] = {{h, RESP_SIZE}, {status, count}, {jl, 4}, {body, blen}};
        r = send_all(x->fd, v, 4, reply_end(x, end));
        rc = r ? io_end(x, r, "tcp reply") : -1;
        goto out;
    }
    /* READV: the header (and the PARTIAL body), then the served indices in order. */
    unsigned char h[RESP_SIZE];
    size_t k = 0;
    uint64_t payload = 0;
    iov[k++] = (struct iovec){h, RESP_SIZE};
    if (refused) {
        /* status, JSON length and JSON as one piece: the iovec array has count + 2 slots */
        unsigned char *pb = malloc((size_t)count + 4 + blen);
        if (!pb) {
            rc = fail(x, END_OS, "out of memory for a batch reply");
            goto out;
        }
        memcpy(pb, status, count);
        memcpy(pb + count, jl, 4);
        memcpy(pb + count + 4, body, blen);
        free(status);
        status = pb; /* freed at out */
        iov[k++] = (struct iovec){pb, (size_t)count + 4 + blen};
    }
    for (uint32_t i = 0; e && i < count; i++) {
        if ((refused && status[i]) || !lens[i])
            continue;
        if (!in_range(offs[i], lens[i], e->size)) { /* cannot happen: admitted above; never send outside */
            rc = fail(x, END_OS, "batch range changed under the request");
            goto out;
        }
        iov[k++] = (struct iovec){e->base + offs[i], (size_t)lens[i]};
        payload += lens[i];
    }
    resp_head(h, refused ? ST_PARTIAL : ST_OK, count, req_id, refused ? (uint64_t)count + 4 + blen + payload : payload);
    r = send_all(x->fd, iov, k, end);
    rc = r ? io_end(x, r, "tcp read payload") : -1;
out:
    if (e)
        release(p, x->c, e);
    free(desc);
    free(offs);
    free(lens);
    free(status);
    free(iov);
    return rc;
}

/* A NOTIFY frame (wire.py): ``count`` region-name bytes and ``length`` notification bytes follow.
 * Both lengths are checked before a byte is read or allocated, so their sum cannot wrap and a
 * hostile length closes the connection instead of being drained. The sender is the node id the
 * connection's HELLO and authentication proved, never a field of the frame. The notification goes
 * into the engine's queue without the GIL; the reply (OK, or the refusal: over the node's
 * max_notify_bytes, over the sender's notify_rate (the queue's bucket for this node id, shared by
 * all its connections), queue full, past the deadline) is sent at once: on_notification
 * callbacks run later, on the engine's callback thread. */
static int do_notify(Ctx *x, uint64_t req_id, uint32_t rlen, uint64_t dlen, double end) {
    Port *p = x->p;
    if (!p->notes)
        return fail(x, END_PROTOCOL, "notification frame, but this port delivers none");
    if (rlen > MAX_NOTE_REGION)
        return fail(x, END_PROTOCOL, "notification region name of %u bytes (the limit is %d)", rlen, MAX_NOTE_REGION);
    if (dlen > MAX_NOTIFY)
        return fail(x, END_PROTOCOL, "notification of %llu bytes (the limit is %d)", (unsigned long long)dlen,
                    MAX_NOTIFY);
    size_t total = (size_t)rlen + (size_t)dlen; /* at most 1 KiB + 64 KiB */
    unsigned char *buf = malloc(total + 1);
    if (!buf)
        return fail(x, END_OS, "out of memory for a notification");
    int r = recv_exact(x->fd, &x->carry, buf, total, end + p->grace);
    if (r) {
        free(buf);
        return io_end(x, r, "tcp notification");
    }
    char msg[512];
    int code;
    if (mono() >= end) {
        snprintf(msg, sizeof msg, "notification arrived after its deadline; it was not delivered");
        code = E_TIMEOUT;
    } else if (dlen > p->max_note) {
        snprintf(msg, sizeof msg,
                 "notification of %llu bytes exceeds this node's limit of %llu (limits.max_notify_bytes)",
                 (unsigned long long)dlen, (unsigned long long)p->max_note);
        code = E_LIMIT;
    } else {
        code = notes_put(p->notes, x->peer, x->plen, (const char *)buf, rlen, buf + rlen, (size_t)dlen, 0, 1, msg,
                         sizeof msg);
    }
    free(buf);
    if (code < 0)
        return fail(x, END_OS, "out of memory for a notification");
    if (code)
        return refuse(x, req_id, code, msg, end);
    return reply(x, ST_OK, 0, req_id, NULL, 0, end);
}

/* The notification checks of note_admit, in server.py's order: over the node's max_notify_bytes,
 * then the sender's notify_rate and room in the queue (notes_reserve: the room stays held). 0 with
 * the room held, else the refusal's code with msg set (nothing held). */
static int note_admit(Ctx *x, uint64_t dlen, char *msg, size_t msz) {
    Port *p = x->p;
    if (dlen > p->max_note) {
        snprintf(msg, msz, "notification of %llu bytes exceeds this node's limit of %llu (limits.max_notify_bytes)",
                 (unsigned long long)dlen, (unsigned long long)p->max_note);
        return E_LIMIT;
    }
    return notes_reserve(p->notes, x->peer, x->plen, (size_t)dlen, msg, msz);
}

/* A WRITE frame that carries its notification (FLAG_NOTE, wire.py): after the header the note's
 * length (NOTE_LEN), then ``count`` region-name bytes and the note, then the ``n`` data bytes.
 * Both note lengths are checked before anything after the header is read (the name's by
 * parse_req), so a hostile length closes the connection and nothing is allocated for it. Then,
 * before a byte of data lands: the region is admitted as for a WRITE, and the note is admitted
 * (note_admit: limits, rate, room in the queue, which stays held). Any refusal drains the data
 * and answers it: the region is untouched and no note is queued, so the sender may retry the
 * whole request. Else the data lands, the note goes into the held room (after its data, and
 * before the reply), and ONE reply answers both. A deadline passing mid-payload gives the room
 * back and answers as for a WRITE (the range is partly written; no note). The sender is the
 * node id the connection's HELLO and authentication proved. */
static int do_write_note(Ctx *x, uint64_t req_id, uint64_t rid, uint64_t token, uint64_t epoch, uint64_t off,
                         uint64_t n, uint32_t rlen, double end) {
    Port *p = x->p;
    if (!p->notes)
        return fail(x, END_PROTOCOL, "notification frame, but this port delivers none");
    unsigned char ext[NOTE_LEN_SIZE];
    int r = recv_exact(x->fd, &x->carry, ext, NOTE_LEN_SIZE, end + p->grace);
    if (r)
        return io_end(x, r, "tcp notification");
    uint64_t dlen = get_be64(ext);
    if (dlen > MAX_NOTIFY)
        return fail(x, END_PROTOCOL, "notification of %llu bytes (the limit is %d)", (unsigned long long)dlen,
                    MAX_NOTIFY);
    size_t total = (size_t)rlen + (size_t)dlen; /* rlen <= MAX_NOTE_REGION (parse_req): at most 1 KiB + 64 KiB */
    unsigned char *buf = malloc(total + 1);
    if (!buf)
        return fail(x, END_OS, "out of memory for a notification");
    r = recv_exact(x->fd, &x->carry, buf, total, end + p->grace);
    if (r) {
        free(buf);
        return io_end(x, r, "tcp notification");
    }
    char msg[MSG_CAP];
    Entry *e;
    int code = admit(p, x->c, rid, token, epoch, off, n, ACC_W, end, 1, &e, msg, sizeof msg);
    if (!code) {
        code = note_admit(x, dlen, msg, sizeof msg);
        if (code) {
            release(p, x->c, e);
            e = NULL;
        }
    }
    if (code) {
        free(buf);
        r = drain(x->fd, &x->carry, n, end + p->grace);
        if (r)
            return io_end(x, r, "tcp payload");
        return refuse(x, req_id, code, msg, end);
    }
    long long pos = recv_region(x, e, off, n, end);
    release(p, x->c, e);
    if (pos < 0 || (uint64_t)pos < n) {
        notes_cancel(p->notes, (size_t)dlen);
        free(buf);
        if (pos < 0)
            return io_end(x, (int)pos, "tcp payload");
        r = drain(x->fd, &x->carry, n - (uint64_t)pos, end + p->grace);
        if (r)
            return io_end(x, r, "tcp payload");
        snprintf(msg, sizeof msg,
                 "deadline passed after %lld of %llu bytes; the range is partly written and the notification "
                 "was not delivered", pos, (unsigned long long)n);
        return refuse(x, req_id, E_TIMEOUT, msg, end);
    }
    int rc = notes_commit(p->notes, x->peer, x->plen, (const char *)buf, rlen, buf + rlen, (size_t)dlen, 0);
    free(buf);
    if (rc)
        return fail(x, END_OS, "out of memory for a notification");
    return reply(x, ST_OK, 0, req_id, NULL, 0, end);
}

/* Look for a request on fd without sleeping for up to budget_ns (busypoll.py's rules: a bounded
 * number of spinners). The look is recv(h, n, MSG_DONTWAIT) itself, so a look that finds the
 * request has (part of) its header already: > 0 bytes received into h, IO_EOF / IO_ERR (errno set)
 * when the connection ended or failed, 0 when nothing came or nobody polled (the caller blocks).
 *
 * A poller that is always runnable loses the scheduler's wake-up preference. Where the CPUs are
 * oversubscribed (the application spins on one, the initiator polls on another) it then waits for
 * its turn like any CPU hog: measured on 2 CPUs, a spinning target answered in 1-7 ms instead of
 * 35 us. So a poll that finds itself preempted (a gap of more than PREEMPTED_S between two looks:
 * a scheduler time slice lost to another runnable thread, not the few tens of us a sched_yield
 * beside the initiator's own poller costs; with 50 us a quiet 2-CPU machine tripped it in some
 * runs) pauses polling on this connection. The gap counts whether or not a request came during
 * it: a request that arrives while the poller waits for its turn is exactly what the pause
 * avoids.
 *
 * The pause is counted in requests, not seconds (issue 28): the next pz->skip requests are
 * waited for by blocking, then one poll tries again. Each preempted try doubles the next pause
 * (PAUSE_MIN .. PAUSE_MAX requests), each poll that was not preempted halves it. Against a
 * target that keeps a CPU competitor (an application spinning in Python) the tries cost one
 * lost time slice (1-7 ms) per PAUSE_MAX requests (about 290 ms of 35 us requests); after one transient
 * preemption on an otherwise idle machine the connection blocks for PAUSE_MIN requests, not for
 * a second (a second was half a 2 s benchmark served at the blocking wait's 66-70 us: the p99
 * of an idle target). */
#define PREEMPTED_S 500e-6
#define PAUSE_MIN 64u
#define PAUSE_MAX 8192u
/* 1 when the next request is one of the pause (waited for by blocking), counting it off. */
static int pause_skips(Pause *pz) {
    if (pz->skip == 0)
        return 0;
    pz->skip--;
    return 1;
}

/* The pause after a poll: a preempted one starts a pause of backoff requests (at least PAUSE_MIN)
 * and doubles the next one up to PAUSE_MAX; a clean one halves it. spin_recv's rule, and
 * pause_trace's (the tests walk it there without a scheduler). */
static void pause_after(Pause *pz, int preempted) {
    if (preempted) {
        pz->backoff = pz->backoff < PAUSE_MIN ? PAUSE_MIN : pz->backoff;
        pz->skip = pz->backoff;
        pz->backoff = pz->backoff >= PAUSE_MAX / 2 ? PAUSE_MAX : pz->backoff * 2;
    } else {
        pz->backoff /= 2;
    }
}

static long long spin_recv(Port *p, int fd, unsigned char *h, size_t n, long long budget_ns, Pause *pz) {
    if (budget_ns <= 0)
        return 0;
    if (pause_skips(pz)) {
        __atomic_add_fetch(&p->stat_paused, 1, __ATOMIC_RELAXED);
        return 0;
    }
    if (__atomic_add_fetch(&spinners, 1, __ATOMIC_ACQ_REL) > spin_limit) {
        __atomic_sub_fetch(&spinners, 1, __ATOMIC_ACQ_REL);
        return 0;
    }
    int preempted = 0;
    long long got = 0;
    double now = mono(), end = now + budget_ns / 1e9, last = now;
    for (;;) {
        ssize_t r = recv(fd, h, n, MSG_DONTWAIT);
        now = mono();
        preempted = now - last > PREEMPTED_S;
        if (r > 0 || r == 0 || (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) {
            got = r > 0 ? r : r == 0 ? IO_EOF : IO_ERR;
            break;
        }
        if (preempted || now >= end)
            break;
        last = now;
        sched_yield();
    }
    int ready = got != 0, saved = errno; /* IO_ERR's errno, for the caller's message */
    __atomic_sub_fetch(&spinners, 1, __ATOMIC_ACQ_REL);
    pause_after(pz, preempted);
    if (preempted)
        __atomic_add_fetch(&p->stat_preempted, 1, __ATOMIC_RELAXED);
    __atomic_add_fetch(&p->stat_polls, 1, __ATOMIC_RELAXED);
    if (ready)
        __atomic_add_fetch(&p->stat_found, 1, __ATOMIC_RELAXED);
    errno = saved;
    return got;
}

/* A request header (wire.py REQ), decoded. */
typedef struct {
    int op, flags;
    uint32_t count;
    uint64_t req_id, rid, token, epoch, off, n;
    double left; /* seconds it may take from now: to its deadline, at most max_request, at least 0 */
} Req;

/* The header parser, as server.py's _one reads a header: the 64 bytes at h, at wall-clock time
 * now. 0 with *q filled, or END_PROTOCOL with why. Pure (no I/O, no table): one() parses every
 * header it receives with it, and the module function parse_head() any bytes (the fuzz tests,
 * tests/fuzz/fuzz_dataport.py, against the Python rule). */
static int parse_req(const unsigned char *h, double now, double max_request, Req *q, char *why, size_t wsz) {
    if (h[0] != 'M' || h[1] != 'Q') {
        snprintf(why, wsz, "bad request magic %02x%02x", h[0], h[1]);
        return END_PROTOCOL;
    }
    q->op = h[2];
    q->flags = h[3];
    q->count = get_be32(h + 4);
    q->req_id = get_be64(h + 8);
    q->rid = get_be64(h + 16);
    q->token = get_be64(h + 24);
    q->epoch = get_be64(h + 32);
    q->off = get_be64(h + 40);
    q->n = get_be64(h + 48);
    uint64_t dbits = get_be64(h + 56);
    double deadline;
    memcpy(&deadline, &dbits, 8);
    if (!isfinite(deadline) || deadline <= 0) {
        snprintf(why, wsz, "request deadline %g is not a finite positive time", deadline);
        return END_PROTOCOL;
    }
    if (q->flags & ~FLAG_NOTE) {
        snprintf(why, wsz, "unknown request flags 0x%02x", q->flags);
        return END_PROTOCOL;
    }
    if (q->flags & FLAG_NOTE) {
        if (q->op != OP_WRITE) {
            snprintf(why, wsz, "a notification rides only on a WRITE frame, not on op %d", q->op);
            return END_PROTOCOL;
        }
        if (q->count > MAX_NOTE_REGION) {
            snprintf(why, wsz, "notification region name of %u bytes (the limit is %d)", q->count, MAX_NOTE_REGION);
            return END_PROTOCOL;
        }
    }
    double left = deadline - now;
    if (left < 0)
        left = 0;
    if (left > max_request)
        left = max_request;
    q->left = left;
    return 0;
}

/* One request (server.py's _one): -1 to go on, else END_*. */
static int one(Ctx *x, int first) {
    Port *p = x->p;
    unsigned char h[REQ_SIZE];
    Carry *cy = &x->carry;
    if (cy->at == cy->len) {
        /* Nothing read ahead: wait for the next frame and read as much of it as there is, up to
         * CARRY_SIZE (a small write's header and payload in one recv). The busy-poll's look is
         * that recv itself: a spin that finds the request has read it already (no poll() first). */
        cy->at = cy->len = 0;
        long long got = first ? 0 : spin_recv(p, x->fd, cy->b, CARRY_SIZE, p->busy_ns, &x->pause);
        if (got == 0) {
            int w = wait_fd(x->fd, POLLIN, mono() + p->idle);
            if (w == IO_DEADLINE)
                return END_CLOSED; /* idle for idle_timeout_ms: it dials again when needed */
            if (w)
                return io_end(x, w, "tcp request header");
            if (__atomic_load_n(&p->closed, __ATOMIC_ACQUIRE))
                return END_CLOSED;
            got = recv_sock(x->fd, cy->b, CARRY_SIZE, mono() + p->handshake);
        } else if (__atomic_load_n(&p->closed, __ATOMIC_ACQUIRE)) {
            return END_CLOSED;
        }
        if (got == IO_EOF)
            return END_CLOSED;
        if (got < 0)
            return io_end(x, (int)got, "tcp request header");
        cy->len = (size_t)got;
    }
    int r = recv_exact(x->fd, cy, h, REQ_SIZE, mono() + p->handshake);
    if (r)
        return io_end(x, r, "tcp request header");
    Req q;
    if (parse_req(h, wall(), p->max_request, &q, x->why, sizeof x->why))
        return END_PROTOCOL;
    int op = q.op;
    uint32_t count = q.count;
    uint64_t req_id = q.req_id, rid = q.rid, token = q.token, epoch = q.epoch, off = q.off, n = q.n;
    double end = mono() + q.left;
    switch (op) {
    case OP_WRITE:
        if (q.flags & FLAG_NOTE)
            return do_write_note(x, req_id, rid, token, epoch, off, n, count, end);
        return do_write(x, req_id, rid, token, epoch, off, n, end);
    case OP_READ:
        return do_read(x, req_id, rid, token, epoch, off, n, end);
    case OP_WRITEV:
    case OP_READV:
        if (count < 1 || count > p->max_batch)
            return fail(x, END_PROTOCOL, "batch of %u descriptors (the limit is %u)", count, p->max_batch);
        return do_batch(x, op, count, req_id, rid, token, epoch, n, end);
    case OP_NOTIFY:
        return do_notify(x, req_id, count, n, end);
    default:
        return fail(x, END_PROTOCOL, "unknown request op %d", op);
    }
}

/* ---- the Python object ----------------------------------------------------------------------- */
static int Port_init(Port *self, PyObject *args, PyObject *kw) {
    static char *names[] = {"epoch", "epoch_ok", "idle_ms", "max_request_ms", "grace_ms", "handshake_ms",
                            "max_batch", "chunk", "busy_ns", "notes", "max_note", NULL};
    PyObject *notes = Py_None;
    unsigned long long max_note = MAX_NOTIFY;
    unsigned long long epoch, chunk;
    int epoch_ok;
    double idle, maxr, grace, hs;
    unsigned int max_batch;
    long long busy;
    if (self->ready) {
        PyErr_SetString(PyExc_RuntimeError, "Port is initialised once");
        return -1;
    }
    if (!PyArg_ParseTupleAndKeywords(args, kw, "KpddddIKL|OK", names, &epoch, &epoch_ok, &idle, &maxr, &grace,
                                     &hs, &max_batch, &chunk, &busy, &notes, &max_note))
        return -1;
    if (notes != Py_None && !PyObject_TypeCheck(notes, &NotesType)) {
        PyErr_SetString(PyExc_TypeError, "notes must be a Notes queue or None");
        return -1;
    }
    if (chunk == 0 || max_batch == 0) {
        PyErr_SetString(PyExc_ValueError, "chunk and max_batch must be positive");
        return -1;
    }
    self->buckets = calloc(64, sizeof(Entry *));
    if (!self->buckets) {
        PyErr_NoMemory();
        return -1;
    }
    self->nbuckets = 64;
    pthread_mutex_init(&self->mu, NULL);
    pthread_cond_init(&self->cv, NULL);
    self->conns.next = self->conns.prev = &self->conns;
    self->epoch = epoch;
    self->epoch_ok = epoch_ok;
    self->idle = idle / 1000.0;
    self->max_request = maxr / 1000.0;
    self->grace = grace / 1000.0;
    self->handshake = hs / 1000.0;
    self->max_batch = max_batch;
    self->chunk = chunk;
    self->busy_ns = busy;
    if (notes != Py_None) {
        Py_INCREF(notes);
        self->notes = (Notes *)notes;
    }
    self->max_note = max_note < MAX_NOTIFY ? max_note : MAX_NOTIFY;
    self->ready = 1;
    return 0;
}

static int ready(Port *self) {
    if (!self->ready)
        PyErr_SetString(PyExc_RuntimeError, "Port is not initialised");
    return self->ready;
}

static void free_entry(Entry *e) {
    PyBuffer_Release(&e->view);
    free(e->qname);
    free(e);
}

static PyObject *Port_publish(Port *self, PyObject *args) {
    unsigned long long id, token;
    const char *rights, *qname;
    PyObject *buffer;
    if (!ready(self) || !PyArg_ParseTuple(args, "KKsOs", &id, &token, &rights, &buffer, &qname))
        return NULL;
    Entry *e = calloc(1, sizeof *e);
    if (!e)
        return PyErr_NoMemory();
    if (PyObject_GetBuffer(buffer, &e->view, PyBUF_SIMPLE) < 0) {
        free(e);
        return NULL;
    }
    e->id = id;
    e->token = token;
    e->base = e->view.buf;
    e->size = (uint64_t)e->view.len;
    e->rights = (strchr(rights, 'r') ? ACC_R : 0) | (strchr(rights, 'w') && !e->view.readonly ? ACC_W : 0);
    size_t qlen = strlen(qname);
    if (qlen > QNAME_MAX) /* cut at a character boundary: never half a UTF-8 sequence */
        for (qlen = QNAME_MAX; qlen > 0 && ((unsigned char)qname[qlen] & 0xC0) == 0x80; qlen--)
            ;
    e->qname = strndup(qname, qlen);
    if (!e->qname) {
        PyBuffer_Release(&e->view);
        free(e);
        return PyErr_NoMemory();
    }
    pthread_mutex_lock(&self->mu);
    int dup = find_locked(self, id) != NULL;
    int err = 0;
    if (!dup && self->count + 1 > self->nbuckets)
        err = grow_locked(self);
    if (!dup && !err) {
        size_t k = bucket_of(self, id);
        e->next = self->buckets[k];
        self->buckets[k] = e;
        self->count++;
    }
    pthread_mutex_unlock(&self->mu);
    if (dup || err) {
        free_entry(e);
        if (dup)
            PyErr_Format(PyExc_ValueError, "region id %llu is already published", id);
        else
            PyErr_NoMemory();
        return NULL;
    }
    Py_RETURN_NONE;
}

/* revoke(region_id, grace_s) -> True if it was published. Unlinks the entry (no new request finds it),
 * waits for the requests holding it to end; past grace_s it shuts down the connections still moving
 * its bytes (their requests fail as a lost connection) and waits for them to let go. */
static PyObject *Port_revoke(Port *self, PyObject *args) {
    unsigned long long id;
    double grace;
    if (!ready(self) || !PyArg_ParseTuple(args, "Kd", &id, &grace))
        return NULL;
    Entry *e;
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&self->mu);
    e = unlink_locked(self, id);
    if (e) {
        double until = mono() + (grace > 0 ? grace : 0);
        int cut = 0;
        while (e->inflight) {
            double left = until - mono();
            if (left <= 0 && !cut) {
                for (Conn *c = self->conns.next; c != &self->conns; c = c->next) {
                    if (c->holding == e && !c->cut) {
                        c->cut = 1;
                        shutdown(c->fd, SHUT_RDWR);
                    }
                }
                cut = 1;
            }
            /* timed slices: a holder admitted but not yet listed is cut on the next pass */
            double slice = cut ? 0.05 : (left < 0.05 ? left : 0.05);
            if (slice <= 0)
                slice = 0.001;
            struct timespec ts;
            clock_gettime(CLOCK_REALTIME, &ts);
            long long ns = ts.tv_nsec + (long long)(slice * 1e9);
            ts.tv_sec += ns / 1000000000LL;
            ts.tv_nsec = ns % 1000000000LL;
            pthread_cond_timedwait(&self->cv, &self->mu, &ts);
            if (cut) {
                for (Conn *c = self->conns.next; c != &self->conns; c = c->next) {
                    if (c->holding == e && !c->cut) {
                        c->cut = 1;
                        shutdown(c->fd, SHUT_RDWR);
                    }
                }
            }
        }
    }
    pthread_mutex_unlock(&self->mu);
    Py_END_ALLOW_THREADS
    if (!e)
        Py_RETURN_FALSE;
    free_entry(e);
    Py_RETURN_TRUE;
}

/* check(region_id, token, epoch, offset, length, access) -> None or (code, message): the table's
 * admission without moving a byte (what a request would be told; for tests and diagnostics). */
static PyObject *Port_check(Port *self, PyObject *args) {
    unsigned long long rid, token, epoch, off, n;
    const char *acc;
    if (!ready(self) || !PyArg_ParseTuple(args, "KKKKKs", &rid, &token, &epoch, &off, &n, &acc))
        return NULL;
    char msg[MSG_CAP];
    Entry *e;
    int code = admit(self, NULL, rid, token, epoch, off, n, acc[0] == 'w' ? ACC_W : ACC_R, INFINITY, 1, &e, msg,
                     sizeof msg);
    if (!code) {
        pthread_mutex_lock(&self->mu);
        if (--e->inflight == 0)
            pthread_cond_broadcast(&self->cv);
        pthread_mutex_unlock(&self->mu);
        Py_RETURN_NONE;
    }
    return Py_BuildValue("(ss)", CODES[code], msg);
}

/* run(fd, peer) -> (END_*, message): serve fd's requests until the connection ends, without the GIL.
 * peer: the node id HELLO and authentication proved (notifications of this connection carry it). */
static PyObject *Port_run(Port *self, PyObject *args) {
    int fd;
    const char *peer = "";
    Py_ssize_t plen = 0;
    if (!ready(self) || !PyArg_ParseTuple(args, "i|s#", &fd, &peer, &plen))
        return NULL;
    Ctx x;
    Conn c;
    memset(&c, 0, sizeof c);
    c.fd = fd;
    x.p = self;
    x.c = &c;
    x.fd = fd;
    x.why[0] = 0;
    memset(&x.pause, 0, sizeof x.pause);
    x.carry.at = x.carry.len = 0;
    x.plen = (size_t)plen < sizeof x.peer ? (size_t)plen : sizeof x.peer;
    memcpy(x.peer, peer, x.plen);
    int rc;
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&self->mu);
    c.next = self->conns.next;
    c.prev = &self->conns;
    self->conns.next->prev = &c;
    self->conns.next = &c;
    pthread_mutex_unlock(&self->mu);
    rc = -1;
    for (int first = 1; rc < 0; first = 0) {
        if (__atomic_load_n(&self->closed, __ATOMIC_ACQUIRE)) {
            rc = END_CLOSED;
            break;
        }
        rc = one(&x, first);
    }
    pthread_mutex_lock(&self->mu);
    c.prev->next = c.next;
    c.next->prev = c.prev;
    if (c.cut && rc != END_PROTOCOL)
        snprintf(x.why, sizeof x.why, "the region it was moving bytes of was unregistered");
    pthread_mutex_unlock(&self->mu);
    Py_END_ALLOW_THREADS
    return Py_BuildValue("(is)", rc, x.why);
}

/* close(): stop serving; every connection's socket is shut down (their run() calls return). */
static PyObject *Port_close(Port *self, PyObject *unused) {
    (void)unused;
    if (!ready(self))
        return NULL;
    __atomic_store_n(&self->closed, 1, __ATOMIC_RELEASE);
    pthread_mutex_lock(&self->mu);
    for (Conn *c = self->conns.next; c != &self->conns; c = c->next)
        shutdown(c->fd, SHUT_RDWR);
    pthread_mutex_unlock(&self->mu);
    Py_RETURN_NONE;
}

static PyObject *Port_published(Port *self, PyObject *unused) {
    (void)unused;
    if (!ready(self))
        return NULL;
    pthread_mutex_lock(&self->mu);
    size_t n = self->count;
    pthread_mutex_unlock(&self->mu);
    return PyLong_FromSize_t(n);
}

static PyObject *Port_poll_stats(Port *self, PyObject *unused) {
    (void)unused;
    if (!ready(self))
        return NULL;
    return Py_BuildValue("{sKsKsKsK}", "polls", __atomic_load_n(&self->stat_polls, __ATOMIC_RELAXED),
                         "found", __atomic_load_n(&self->stat_found, __ATOMIC_RELAXED),
                         "preempted", __atomic_load_n(&self->stat_preempted, __ATOMIC_RELAXED),
                         "paused", __atomic_load_n(&self->stat_paused, __ATOMIC_RELAXED));
}

static void Port_dealloc(Port *self) {
    if (self->ready) {
        /* Only reached with no run() in progress (each holds a reference); entries left are released. */
        for (size_t i = 0; i < self->nbuckets; i++) {
            Entry *e = self->buckets[i];
            while (e) {
                Entry *n = e->next;
                free_entry(e);
                e = n;
            }
        }
        free(self->buckets);
        Py_XDECREF((PyObject *)self->notes);
        pthread_mutex_destroy(&self->mu);
        pthread_cond_destroy(&self->cv);
    }
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMethodDef Port_methods[] = {
    {"publish", (PyCFunction)Port_publish, METH_VARARGS,
     "publish(region_id, token, access, buffer, quoted_name): add a region to the table"},
    {"revoke", (PyCFunction)Port_revoke, METH_VARARGS,
     "revoke(region_id, grace_s) -> bool: remove it; returns once no request moves its bytes"},
    {"check", (PyCFunction)Port_check, METH_VARARGS,
     "check(region_id, token, epoch, offset, length, access) -> None | (code, message)"},
    {"run", (PyCFunction)Port_run, METH_VARARGS, "run(fd) -> (end, message): serve a connection"},
    {"close", (PyCFunction)Port_close, METH_NOARGS, "close(): stop serving, shut every connection down"},
    {"published", (PyCFunction)Port_published, METH_NOARGS, "published() -> number of table entries"},
    {"poll_stats", (PyCFunction)Port_poll_stats, METH_NOARGS,
     "poll_stats() -> {polls, found, preempted, paused}: the busy-poll counters of every connection"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject PortType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "_mpcomm_dataport.Port",
    .tp_basicsize = sizeof(Port),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Port_init,
    .tp_dealloc = (destructor)Port_dealloc,
    .tp_methods = Port_methods,
    .tp_doc = "The tcp data port's native region table and request loop.",
};

static PyObject *set_spin_limit(PyObject *m, PyObject *arg) {
    (void)m;
    long n = PyLong_AsLong(arg);
    if (n == -1 && PyErr_Occurred())
        return NULL;
    __atomic_store_n(&spin_limit, (int)(n < 1 ? 1 : n), __ATOMIC_RELEASE);
    Py_RETURN_NONE;
}

/* parse_head(header, now, max_request_s) -> (op, count, req_id, region_id, token, epoch, offset,
 * length, left_s): the loop's header parser on any 64 bytes; ValueError(why) where the loop would
 * close the connection. */
static PyObject *parse_head(PyObject *m, PyObject *args) {
    (void)m;
    Py_buffer b;
    double now, max_request;
    if (!PyArg_ParseTuple(args, "y*dd", &b, &now, &max_request))
        return NULL;
    if (b.len != REQ_SIZE) {
        PyBuffer_Release(&b);
        PyErr_Format(PyExc_ValueError, "a request header is %d bytes, not %zd", REQ_SIZE, b.len);
        return NULL;
    }
    Req q;
    char why[512];
    int rc = parse_req(b.buf, now, max_request, &q, why, sizeof why);
    PyBuffer_Release(&b);
    if (rc) {
        PyErr_SetString(PyExc_ValueError, why);
        return NULL;
    }
    return Py_BuildValue("(iIKKKKKKdi)", q.op, (unsigned int)q.count, (unsigned long long)q.req_id,
                         (unsigned long long)q.rid, (unsigned long long)q.token, (unsigned long long)q.epoch,
                         (unsigned long long)q.off, (unsigned long long)q.n, q.left, q.flags);
}

/* rate_trace(rate, times) -> [(admitted, idle), ...]: one sender's bucket (rate_admit, rate_idle)
 * offered a note at each of times (ns, any order), from a fresh bucket, for tests to compare with
 * senders.py's rule. */
static PyObject *rate_trace(PyObject *mod, PyObject *args) {
    (void)mod;
    unsigned long long rate;
    PyObject *times;
    if (!PyArg_ParseTuple(args, "KO", &rate, &times))
        return NULL;
    if (rate < 1 || rate > MAX_RATE) {
        PyErr_SetString(PyExc_ValueError, "rate must be within [1, 2**32)");
        return NULL;
    }
    PyObject *seq = PySequence_Fast(times, "times must be a sequence");
    if (!seq)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject *out = PyList_New(n);
    u128 tat = 0;
    for (Py_ssize_t i = 0; out && i < n; i++) {
        unsigned long long now = PyLong_AsUnsignedLongLong(PySequence_Fast_GET_ITEM(seq, i));
        if (now == (unsigned long long)-1 && PyErr_Occurred()) {
            Py_CLEAR(out);
            break;
        }
        int ok = rate_admit(&tat, now, rate);
        PyObject *t = Py_BuildValue("(OO)", ok ? Py_True : Py_False, rate_idle(tat, now, rate) ? Py_True : Py_False);
        if (!t) {
            Py_CLEAR(out);
            break;
        }
        PyList_SET_ITEM(out, i, t);
    }
    Py_DECREF(seq);
    return out;
}

/* pause_trace(polls, requests) -> str: one connection's busy-poll pause over `requests` waits, each
 * 'p' (one of the pause: blocking), 'c' (a clean poll) or 'x' (a preempted poll), where the k-th
 * poll is preempted when polls[k] is true (false past its end). For tests: the rule without a
 * scheduler. */
static PyObject *pause_trace(PyObject *mod, PyObject *args) {
    PyObject *polls;
    Py_ssize_t requests;
    if (!PyArg_ParseTuple(args, "On", &polls, &requests))
        return NULL;
    if (requests < 0 || requests > 1000000) {
        PyErr_SetString(PyExc_ValueError, "requests: 0 .. 1000000");
        return NULL;
    }
    PyObject *seq = PySequence_Fast(polls, "polls: a sequence of booleans");
    if (!seq)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq), k = 0;
    char *out = PyMem_Malloc((size_t)requests + 1);
    if (!out) {
        Py_DECREF(seq);
        return PyErr_NoMemory();
    }
    Pause pz = {0, 0};
    for (Py_ssize_t i = 0; i < requests; i++) {
        if (pause_skips(&pz)) {
            out[i] = 'p';
            continue;
        }
        int preempted = 0;
        if (k < n) {
            preempted = PyObject_IsTrue(PySequence_Fast_GET_ITEM(seq, k++));
            if (preempted < 0) {
                PyMem_Free(out);
                Py_DECREF(seq);
                return NULL;
            }
        }
        pause_after(&pz, preempted);
        out[i] = preempted ? 'x' : 'c';
    }
    Py_DECREF(seq);
    PyObject *r = PyUnicode_FromStringAndSize(out, requests);
    PyMem_Free(out);
    return r;
}

static PyMethodDef module_methods[] = {
    {"pause_trace", pause_trace, METH_VARARGS,
     "pause_trace(polls, requests) -> 'p'/'c'/'x' per request: the busy-poll pause rule, for tests"},
    {"rate_trace", rate_trace, METH_VARARGS,
     "rate_trace(rate, times) -> [(admitted, idle)]: one sender's notification bucket, for tests"},
    {"set_spin_limit", set_spin_limit, METH_O, "How many connections may busy-poll at once."},
    {"parse_head", parse_head, METH_VARARGS,
     "parse_head(header, now, max_request_s) -> the decoded header; ValueError where the loop closes"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef moddef = {PyModuleDef_HEAD_INIT, "_mpcomm_dataport", NULL, -1, module_methods,
                                    NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__mpcomm_dataport(void) {
    if (PyType_Ready(&PortType) < 0 || PyType_Ready(&NotesType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&moddef);
    if (!m)
        return NULL;
    Py_INCREF(&PortType);
    Py_INCREF(&NotesType);
    if (PyModule_AddObject(m, "Port", (PyObject *)&PortType) < 0 ||
        PyModule_AddObject(m, "Notes", (PyObject *)&NotesType) < 0 ||
        PyModule_AddIntConstant(m, "MAX_NOTIFY", MAX_NOTIFY) < 0 || PyModule_AddIntConstant(m, "ABI", DP_ABI) < 0 ||
        PyModule_AddIntConstant(m, "END_CLOSED", END_CLOSED) < 0 ||
        PyModule_AddIntConstant(m, "PAUSE_MIN", PAUSE_MIN) < 0 || PyModule_AddIntConstant(m, "PAUSE_MAX", PAUSE_MAX) < 0 ||
        PyModule_AddIntConstant(m, "END_PROTOCOL", END_PROTOCOL) < 0 ||
        PyModule_AddIntConstant(m, "END_ERROR", END_ERROR) < 0 || PyModule_AddIntConstant(m, "END_OS", END_OS) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
#endif
