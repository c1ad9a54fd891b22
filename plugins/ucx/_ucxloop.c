/* The ucx transport's native helper: UCX calls in a loop outside the interpreter.
 *
 * Built at install (setup.py) into the extension module mpcomm.plugins.ucx._mpcomm_ucxloop
 * and loaded by plugins/ucx/_native.py (through mpcomm.native_helper). It calls UCX only through the
 * function pointers the ctypes binding already resolved, so it needs neither
 * UCX headers nor linking against UCX. Without a compiler the binding runs the
 * same loops in Python.
 */
#define _GNU_SOURCE /* ppoll: the claim window's deadline in ns, not whole ms */
#include <stdint.h>
#include <stddef.h>
#include <errno.h>
#include <limits.h>
#include <poll.h>
#include <time.h>
#include <unistd.h>
#include <linux/futex.h>
#include <sys/syscall.h>

#define MP_ABI 10

int mpcomm_ucx_abi(void) { return MP_ABI; }

typedef void *(*rma_fn)(void *, void *, size_t, uint64_t, void *, const void *);

#define MP_OUT_OF_RANGE (-19) /* UCS_ERR_OUT_OF_RANGE: a piece outside its region, never issued */

/* [off, off + len) inside [0, size): the one bounds rule (mpcomm.engine.checks.fits), in
 * unsigned arithmetic that cannot wrap. */
static inline int mp_fits(int64_t off, int64_t len, int64_t size) {
    return off >= 0 && len >= 0 && size >= 0 && (uint64_t)len <= (uint64_t)size
           && (uint64_t)off <= (uint64_t)size - (uint64_t)len;
}
typedef void (*free_fn)(void *);
typedef unsigned (*progress_fn)(void *);

/* ucs_status_t is a packed enum: one signed byte. Read as an int, a failure such as -3
   (UCS_ERR_IO_ERROR) comes back as 253 and looks like neither done nor failed. */
typedef int8_t (*check_fn)(void *);

/* Issue n puts (or gets); release every request UCX returns (it frees it once done);
   status[i] = 0 when issued, the ucs_status_t when refused. *left counts the operations UCX
   left in flight and not known done since. Then local progress: with `check`, the last one
   left in flight is settled as in one request -- progress while it is in flight and progress
   does work, then its outcome counts (a failure marks every piece it covered, as refused) --
   so a single cma put costs the progress calls its copy needs and no more (each one also polls
   the tcp lane: a system call); without, the worker is progressed while it reports work.
   Returns the refused count.
   Pieces that continue each other on both sides (loff[i] + len[i] == loff[i + 1] and
   the same remotely) go as one put/get of up to `merge` bytes (0: never merged): on a
   cma lane each put is one system call, so 64 adjacent 4 KiB pieces cost one call,
   not 64. A refused merged operation marks every piece it covered. Every piece is read
   once and checked (mp_fits) against the local region's `lsize` and the remote one's
   `rsize` bytes where it is issued: one that does not fit is never issued, and its
   status is MP_OUT_OF_RANGE (counted as refused). This is the one loop that issues
   pieces: the fast path (mp_move) and the general path's groups (mpcomm_ucx_rma_many). */
static int64_t mp_issue(rma_fn fn, check_fn check, free_fn rfree, progress_fn progress, void *ep, void *worker,
                        const int64_t *loff, int64_t lbase, int64_t lsize, const int64_t *roff, int64_t rbase,
                        int64_t rsize, const int64_t *len, int64_t n, void *rkey, const void *param,
                        int8_t *status, int64_t merge, int64_t *left)
{
    int64_t refused = 0, li = 0, lj = 0;
    void *last = NULL;
    *left = 0;
    for (int64_t i = 0; i < n;) {
        int64_t lo = loff[i], ro = roff[i], total = len[i]; /* read once: what is checked is what is used */
        if (!mp_fits(lo, total, lsize) || !mp_fits(ro, total, rsize)) {
            status[i++] = MP_OUT_OF_RANGE;
            refused++;
            continue;
        }
        int64_t j = i + 1;
        while (j < n && merge > 0) {
            int64_t l2 = loff[j], r2 = roff[j], k = len[j];
            /* adjacent on both sides, each piece in bounds (so the merged range is too) */
            if (l2 != lo + total || r2 != ro + total || !mp_fits(l2, k, lsize) || !mp_fits(r2, k, rsize)
                || k > merge - total)
                break;
            total += k;
            j++;
        }
        void *r = fn(ep, (void *)(intptr_t)(lbase + lo), (size_t)total, (uint64_t)(rbase + ro), rkey, param);
        int8_t st = 0;
        if ((uintptr_t)r >= (uintptr_t)(intptr_t)-100) {   /* UCS_PTR_IS_ERR */
            st = (int8_t)(intptr_t)r;
            refused += j - i;
        } else if (r != NULL) {
            (*left)++;
            if (check == NULL) {
                rfree(r);
            } else {
                if (last != NULL)
                    rfree(last);
                last = r, li = i, lj = j;
            }
        }
        for (; i < j; i++)
            status[i] = st;
    }
    if (last != NULL) {
        int8_t st = check(last);
        while (st == 1 && progress(worker))
            st = check(last);
        rfree(last);
        if (st != 1) {
            (*left)--;
            if (st < 0) {
                for (int64_t k = li; k < lj; k++)
                    status[k] = st;
                refused += lj - li;
            }
        }
    } else if (*left) {
        while (progress(worker))
            ;
    }
    return refused;
}

/* The general path's group issue (Endpoint.rma_group, through ctypes): mp_issue, and the worker
   progressed while it reports work. The flush that completes the pieces is the caller's. */
int64_t mpcomm_ucx_rma_many(rma_fn fn, free_fn rfree, progress_fn progress, void *ep, void *worker,
                            const int64_t *loff, int64_t lbase, int64_t lsize, const int64_t *roff, int64_t rbase,
                            int64_t rsize, const int64_t *len, int64_t n, void *rkey, const void *param,
                            int8_t *status, int64_t merge)
{
    int64_t left;
    int64_t refused = mp_issue(fn, NULL, rfree, progress, ep, worker, loff, lbase, lsize, roff, rbase, rsize, len, n,
                               rkey, param, status, merge, &left);
    while (progress(worker))
        ;
    return refused;
}

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
    int8_t st = check(r);
    while (st == 1 && progress(worker))
        st = check(r);
    if (st == 1) {
        *pending = r;
        return code;
    }
    rfree(r);
    return st;
}

/* -- The worker's progress loop: a native thread that never takes the GIL ----------------------
 *
 * A Python thread parks in one ctypes call (mpcomm_ucx_loop_run; ctypes releases the GIL) and
 * progresses the worker until told to stop: progress while it does work, spin `spin_ns` after the
 * last work, then ucp_worker_arm + poll on the worker's event fd. So UCX's two-sided work for this
 * process -- a peer's put or get emulated over active messages on tcp, wire-up, keepalive -- is done
 * however busy the interpreter is. Python is told only what it asked for:
 *   - the transport's bookkeeping thread (it steps this process's own requests) sleeps on the
 *     eventfd `nfd`. `want` says whether it has requests no result() waiter drives (the transport
 *     keeps it, under its lock); `asked` is set by that thread before it checks its requests'
 *     statuses. The loop writes `nfd` after a progress call that did work when both are set, and
 *     clears `asked` (one wake-up per look): a process with nothing of its own in flight -- a pure
 *     target -- is never woken;
 *   - a thread waiting in result() (Transport.drive) reads `kicks` and `events`, steps its request,
 *     then waits on `events` (a futex word the loop bumps after every progress call that did work)
 *     until its own request is no longer in progress (checked here, without the GIL) or Python
 *     kicks; so eight waiters do not all take the GIL for each event.
 * Stop: `stop` = 1, then ucp_worker_signal: either the signal comes after ucp_worker_arm (the poll
 * wakes) or before it (arm answers BUSY), and `stop` is read after arm. The loop calls UCX only
 * through the function pointers the ctypes binding resolved. An endpoint's error callback (a ctypes
 * callback) would take the GIL inside progress: a pure target has none (see docs/ucx.md). */
typedef int8_t (*arm_fn)(void *);
typedef int8_t (*signal_fn)(void *);

struct mp_loop {
    progress_fn progress; /* ucp_worker_progress */
    arm_fn arm;           /* ucp_worker_arm */
    signal_fn signal;     /* ucp_worker_signal */
    void *worker;
    int64_t efd;          /* the worker's event fd */
    int64_t nfd;          /* eventfd the bookkeeping thread sleeps on */
    int64_t spin_ns;      /* keep progressing this long after the last work before sleeping */
    int32_t stop;
    int32_t want;         /* the bookkeeping thread has requests to step that nobody drives */
    uint32_t events;      /* futex word: bumped after every progress call that did work, and by bump() */
    int32_t drivers;      /* threads inside mpcomm_ucx_loop_wait */
    int32_t asked;        /* the bookkeeping thread looks (or sleeps) and wants to hear of new work */
    uint32_t kicks;       /* bumped (with `events`) by Python: reports made, aborts, revocations, close */
    check_fn check;       /* ucp_request_check_status: a driver's request, checked without the GIL */
    int64_t sleeps;       /* polls that ended (observability) */
    int64_t notified;     /* writes to nfd */
    int64_t claim_ns;     /* the claim window after a hand-off (0: none) */
    int64_t handoff_at;   /* when the last request was handed off (mp_now_ns) */
    int64_t held_until;   /* a wake-up of the bookkeeping thread held until then (0: none held) */
    int64_t held;         /* wake-ups held (observability) */
    int32_t poller;       /* 1 while a driver polls the worker itself (mpcomm_ucx_loop_wait) */
    int32_t polling;      /* that driver is between its arm and the end of its poll: signal to wake it */
    uint32_t park;        /* futex word the loop thread parks on while drivers poll; bumped to wake it */
    int32_t parked;       /* the loop thread is parked (it does not poll the event fd) */
    int64_t poller_left;  /* when the last polling driver left (mp_now_ns) */
    int64_t parks;        /* times the loop thread parked (observability) */
    int64_t polls;        /* polls a driver made on the event fd itself (observability) */
    int64_t linger_ns;    /* park window (park_us), see mp_park */
};

/* One step of a short busy wait. Not sched_yield(): against a thread that never sleeps (a Python
   loop on the same CPU) a yield hands it the CPU until the next scheduler tick (4 ms here), and a
   request arriving meanwhile waits for it; a thread that spins briefly and then sleeps in poll is
   woken, and preempts, as soon as its event comes. */
static inline void mp_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

static int64_t mp_now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

static void mp_notify(int64_t fd) {
    uint64_t one = 1;
    ssize_t r;
    do
        r = write((int)fd, &one, sizeof one); /* an eventfd adds: no write is lost */
    while (r < 0 && errno == EINTR);
}

/* events++ (seq_cst), then wake the drivers that may be waiting on the old value. A driver counts
   itself in `drivers` before it compares `events`: one of the two sees the other's store. */
static void mp_events(struct mp_loop *l) {
    __atomic_add_fetch(&l->events, 1, __ATOMIC_SEQ_CST);
    if (__atomic_load_n(&l->drivers, __ATOMIC_SEQ_CST) > 0)
        syscall(SYS_futex, &l->events, FUTEX_WAKE_PRIVATE, INT_MAX, NULL, NULL, 0);
}

/* As mp_events, from a thread other than the polling driver: that driver sleeps in poll on the
   event fd, not on `events`, so it is signalled. It sets `polling` before it reads `events` and
   arms; one of the two sees the other's store (a signal before its arm makes arm answer BUSY). */
static void mp_events_all(struct mp_loop *l) {
    mp_events(l);
    if (__atomic_load_n(&l->polling, __ATOMIC_SEQ_CST))
        l->signal(l->worker);
}

/* Wake the loop thread if it is parked (stop, kicks, a new hold). */
static void mp_unpark(struct mp_loop *l) {
    __atomic_add_fetch(&l->park, 1, __ATOMIC_SEQ_CST);
    if (__atomic_load_n(&l->parked, __ATOMIC_SEQ_CST))
        syscall(SYS_futex, &l->park, FUTEX_WAKE_PRIVATE, 1, NULL, NULL, 0);
}

/* A Python thread's progress did work that only drivers may be waiting for (the bookkeeping
   thread's own, which looks at its requests again itself): `events`, so each driver checks its
   request natively. */
void mpcomm_ucx_loop_events(struct mp_loop *l) { mp_events_all(l); }

/* Python's wake-up of every driver (whatever it waits for): `kicks`, then `events`. */
void mpcomm_ucx_loop_bump(struct mp_loop *l) {
    __atomic_add_fetch(&l->kicks, 1, __ATOMIC_SEQ_CST);
    mp_events_all(l);
}

/* Wake the bookkeeping thread if it has undriven requests and asked (once per ask). */
static void mp_tell(struct mp_loop *l) {
    if (__atomic_load_n(&l->want, __ATOMIC_SEQ_CST) && __atomic_load_n(&l->asked, __ATOMIC_SEQ_CST)
        && __atomic_exchange_n(&l->asked, 0, __ATOMIC_SEQ_CST)) {
        mp_notify(l->nfd);
        __atomic_add_fetch(&l->notified, 1, __ATOMIC_RELAXED);
    }
}

/* Progress did work: tell whoever asked. `asked` (and `want`) are set before the asker checks its
   requests, and read here after the work that may have completed them: no lost wake-up.
 *
 * The claim window. A request handed off (mpcomm_ucx_loop_handoff) whose answer comes before its
 * caller reaches result() would wake the bookkeeping thread, which then reports it: another
 * Python thread runs for a request whose caller was about to wait for it. So within `claim_ns`
 * of the last hand-off, the wake-up is held until handoff_at + claim_ns (`held_until`), and
 * released then by mp_release -- by when a waiter has claimed the request (drive(): `want` falls
 * to 0 if it was the only one) or has not, and the bookkeeping thread is woken as before
 * (callback-only users pay at most the window). Why no wake-up is lost:
 *   - a hold only delays: every hold has a release. The loop thread calls mp_release after each
 *     progress call that did no work and once more after ucp_worker_arm, and it never sleeps past
 *     `held_until` (ppoll's timeout). A hold made on the loop thread is seen at its next
 *     iteration. One made on another thread (a Python thread's own progress did work) signals
 *     the worker after the CAS: the loop either read `held_until` after that CAS, or the signal
 *     comes after its arm (the poll wakes) or before it (arm answers BUSY) -- as for `stop`;
 *   - a hold that exists already is not extended (CAS from 0): its release, no later than its
 *     own deadline, tells about this work too. A deadline is some hand-off's + claim_ns, so no
 *     stream of hand-offs postpones a wake-up by more than the window;
 *   - the release re-reads `want` and `asked` (mp_tell): `want` 0 means every request is driven
 *     by a waiter, which checks its own natively (a waiter that gives up kicks the thread);
 *     `asked` 0 means the thread was woken since and checks every status before it sleeps again.
 * Work with no hand-off in the last claim_ns (further chunks of a request the thread steps)
 * tells at once, as before. */
static void mp_worked_on(struct mp_loop *l, int on_loop, int polling_driver) {
    /* Work done by anyone but the polling driver may have consumed the very event that driver
       polls for: it is signalled (mp_events_all), or it would sleep out its wait step. */
    if (polling_driver)
        mp_events(l);
    else
        mp_events_all(l);
    if (!__atomic_load_n(&l->want, __ATOMIC_SEQ_CST) || !__atomic_load_n(&l->asked, __ATOMIC_SEQ_CST))
        return;
    int64_t claim = l->claim_ns;
    if (claim > 0) {
        int64_t until = __atomic_load_n(&l->handoff_at, __ATOMIC_SEQ_CST) + claim, now = mp_now_ns();
        if (now < until) {
            int64_t none = 0;
            if (__atomic_compare_exchange_n(&l->held_until, &none, until, 0, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)) {
                __atomic_add_fetch(&l->held, 1, __ATOMIC_RELAXED);
                if (!on_loop) {
                    l->signal(l->worker);
                    mp_unpark(l); /* parked, it releases the hold at its deadline all the same */
                }
            }
            return;
        }
    }
    mp_tell(l);
}

static void mp_worked(struct mp_loop *l) { mp_worked_on(l, 1, 0); }

/* The loop thread: release a held wake-up whose window is over (mp_tell). Returns the ns until
   the held one's deadline, or -1 when none is held. */
static int64_t mp_release(struct mp_loop *l, int64_t now) {
    int64_t until = __atomic_load_n(&l->held_until, __ATOMIC_SEQ_CST);
    if (until == 0)
        return -1;
    if (now < until)
        return until - now;
    if (__atomic_compare_exchange_n(&l->held_until, &until, 0, 0, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST))
        mp_tell(l);
    return -1; /* (a failed CAS: a newer hold, seen at the next call) */
}

/* A Python thread's own progress call did work: tell whoever asked, as after the loop's own. */
void mpcomm_ucx_loop_worked(struct mp_loop *l) { mp_worked_on(l, 0, 0); }

/* Whether the bookkeeping thread has requests nobody drives (the transport, under its lock). */
void mpcomm_ucx_loop_want(struct mp_loop *l, int64_t want) {
    __atomic_store_n(&l->want, want ? 1 : 0, __ATOMIC_SEQ_CST);
}

/* The bookkeeping thread is about to check its requests: wake it after the next work. */
void mpcomm_ucx_loop_ask(struct mp_loop *l) { __atomic_store_n(&l->asked, 1, __ATOMIC_SEQ_CST); }

/* A posting thread handed a request in flight to the progress side: the bookkeeping thread must
   hear of its completion (unless a result() waiter claims it first), and the loop progresses. */
int64_t mpcomm_ucx_loop_handoff(struct mp_loop *l) {
    __atomic_store_n(&l->handoff_at, mp_now_ns(), __ATOMIC_SEQ_CST); /* its claim window starts */
    __atomic_store_n(&l->want, 1, __ATOMIC_SEQ_CST);
    /* A parked loop thread is not woken: a driver polls (its poll sees the request's events), or
       the loop polls again within linger_ns. The signal woke a sleeping loop once per request. */
    if (__atomic_load_n(&l->parked, __ATOMIC_SEQ_CST))
        return 0;
    return l->signal(l->worker);
}

/* Wake the bookkeeping thread (new work, an abort, a revocation), the drivers, and the loop itself
   (it progresses what was just issued). */
int64_t mpcomm_ucx_loop_kick(struct mp_loop *l) {
    mp_notify(l->nfd);
    mpcomm_ucx_loop_bump(l);
    mp_unpark(l);
    return l->signal(l->worker);
}

/* Tell the loop to end (it returns from mpcomm_ucx_loop_run soon after; join its thread). */
void mpcomm_ucx_loop_stop(struct mp_loop *l) {
    __atomic_store_n(&l->stop, 1, __ATOMIC_SEQ_CST);
    mp_unpark(l);
    l->signal(l->worker);
}

/* The loop thread, about to sleep: while a driver polls the worker, or one left less than
   linger_ns ago, park on `park` instead of polling the event fd -- two threads asleep on it
   would both wake for every answer and take the worker's lock in turn. The window: a caller that
   writes and waits in a loop leaves result() and is back within microseconds, and each return of
   the loop thread to the event fd would wake it once more per request. Meanwhile nobody polls: a
   peer's request, or one of ours nobody waits for, waits at most linger_ns (the claim window is
   1 ms); while drivers poll, the loop looks once per linger_ns. Never past a held wake-up's
   deadline (`left`, -1: none). 0 turns parking off. Returns 1 when it parked. */
static int mp_park(struct mp_loop *l, int64_t now, int64_t left) {
    uint32_t p = __atomic_load_n(&l->park, __ATOMIC_SEQ_CST);
    int64_t since = now - __atomic_load_n(&l->poller_left, __ATOMIC_SEQ_CST), linger = l->linger_ns;
    if (linger <= 0 || (!__atomic_load_n(&l->poller, __ATOMIC_SEQ_CST) && since >= linger))
        return 0;
    int64_t t = linger;
    if (left >= 0 && left < t)
        t = left;
    __atomic_store_n(&l->parked, 1, __ATOMIC_SEQ_CST);
    if (!__atomic_load_n(&l->stop, __ATOMIC_SEQ_CST)) {
        struct timespec ts = {t / 1000000000, t % 1000000000};
        syscall(SYS_futex, &l->park, FUTEX_WAIT_PRIVATE, p, &ts, NULL, 0);
    }
    __atomic_store_n(&l->parked, 0, __ATOMIC_SEQ_CST);
    __atomic_add_fetch(&l->parks, 1, __ATOMIC_RELAXED);
    return 1;
}

/* Runs until stop: the progress thread's whole life, outside the interpreter. Returns 0. */
int64_t mpcomm_ucx_loop_run(struct mp_loop *l) {
    int64_t last = mp_now_ns();
    while (!__atomic_load_n(&l->stop, __ATOMIC_SEQ_CST)) {
        if (l->progress(l->worker)) {
            mp_worked(l);
            last = mp_now_ns();
            mp_release(l, last); /* a long run of work does not postpone a held wake-up */
            continue;
        }
        int64_t now = mp_now_ns();
        mp_release(l, now);
        if (now - last < l->spin_ns) {
            mp_relax();
            continue;
        }
        if (mp_park(l, now, mp_release(l, now))) {
            last = mp_now_ns();
            continue;
        }
        int8_t st = l->arm(l->worker);
        if (st == -15) /* UCS_ERR_BUSY: events (or a signal) are pending: progress them */
            continue;
        if (__atomic_load_n(&l->stop, __ATOMIC_SEQ_CST))
            break;
        /* After arm: a hold made on another thread before this read is seen here; one made after
           it signals, and the poll wakes. Never sleep past a held wake-up's deadline. */
        int64_t left = mp_release(l, mp_now_ns());
        if (st != 0 && (left < 0 || left > 1000000))
            left = 1000000; /* a failed arm polls in 1 ms steps */
        struct timespec t = {left / 1000000000, left % 1000000000};
        struct pollfd p = {(int)l->efd, POLLIN, 0};
        /* armed: sleep until UCX has an event, someone signals, or a held wake-up is due */
        ppoll(&p, 1, left < 0 ? NULL : &t, NULL);
        __atomic_add_fetch(&l->sleeps, 1, __ATOMIC_RELAXED);
        last = mp_now_ns();
    }
    return 0;
}

/* A driver (a result() waiter, GIL released): wait until Python kicks (`kicks` moves past
   `seen_kicks`), or work was done (`events` moves past `seen`) and `req` -- the request the
   driver waits for, NULL for any work -- is no longer in progress; at most timeout_ns (spinning
   spin_ns first). Returns 1 when woken so, 0 on timeout. Only the driver frees `req` (the
   transport's Python thread does not step a driven request), and close() waits until no driver
   is in here (`drivers`) before it releases requests.
 * One driver at a time polls the worker itself (`poller`): it progresses, arms and polls the
   worker's event fd, doing what the loop thread does (mp_worked: other drivers, the bookkeeping
   thread, holds), while the loop thread parks (mp_park). So the answer to a request wakes its
   waiter, not the loop thread and then, through `events`, the waiter: one wake-up less per
   request, and no two threads taking the worker's lock in turn for every answer. The other
   drivers sleep on `events`; when the poller leaves it bumps `events`, and one of them takes the
   poll over. Work another thread's progress call did signals a polling driver (mp_events_all). */
int64_t mpcomm_ucx_loop_wait(struct mp_loop *l, int64_t seen, int64_t seen_kicks, void *req, int64_t timeout_ns,
                             int64_t spin_ns) {
    uint32_t s = (uint32_t)seen, k = (uint32_t)seen_kicks;
    int64_t start = mp_now_ns(), end = start + (timeout_ns < 0 ? 0 : timeout_ns), now;
    int64_t r = 0;
    int poller = 0;
    __atomic_add_fetch(&l->drivers, 1, __ATOMIC_SEQ_CST);
    for (;;) {
        if (__atomic_load_n(&l->kicks, __ATOMIC_SEQ_CST) != k) {
            r = 1;
            break;
        }
        uint32_t e = __atomic_load_n(&l->events, __ATOMIC_SEQ_CST);
        if (e != s) {
            if (req == NULL || l->check(req) != 1) { /* 1: UCS_INPROGRESS */
                r = 1;
                break;
            }
            s = e; /* work, but not ours: wait on, without the GIL */
            continue;
        }
        now = mp_now_ns();
        if (now >= end)
            break;
        if (!poller && l->linger_ns > 0 && !__atomic_load_n(&l->poller, __ATOMIC_SEQ_CST)) {
            int32_t none = 0;
            poller = __atomic_compare_exchange_n(&l->poller, &none, 1, 0, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
            /* A loop thread asleep in poll would wake with this driver for the answer and take
               the worker's lock as it comes: wake it now, while the request is in flight, to park. */
            if (poller && !__atomic_load_n(&l->parked, __ATOMIC_SEQ_CST))
                l->signal(l->worker);
        }
        if (poller) {
            if (l->progress(l->worker)) {
                mp_worked_on(l, 1, 1); /* as the loop's own; this driver's check comes at the top */
                mp_release(l, mp_now_ns());
                continue;
            }
            if (now - start < spin_ns) {
                mp_relax();
                continue;
            }
            __atomic_store_n(&l->polling, 1, __ATOMIC_SEQ_CST);
            if (__atomic_load_n(&l->kicks, __ATOMIC_SEQ_CST) != k || __atomic_load_n(&l->events, __ATOMIC_SEQ_CST) != s) {
                __atomic_store_n(&l->polling, 0, __ATOMIC_SEQ_CST);
                continue;
            }
            int8_t st = l->arm(l->worker);
            if (st == -15) { /* UCS_ERR_BUSY: events (or a signal) are pending: progress them */
                __atomic_store_n(&l->polling, 0, __ATOMIC_SEQ_CST);
                continue;
            }
            int64_t t = end - mp_now_ns(), left = mp_release(l, mp_now_ns());
            if (left >= 0 && left < t)
                t = left;
            if (st != 0 && t > 1000000)
                t = 1000000; /* a failed arm polls in 1 ms steps */
            if (t < 0)
                t = 0;
            struct timespec ts = {t / 1000000000, t % 1000000000};
            struct pollfd pfd = {(int)l->efd, POLLIN, 0};
            ppoll(&pfd, 1, &ts, NULL);
            __atomic_store_n(&l->polling, 0, __ATOMIC_SEQ_CST);
            __atomic_add_fetch(&l->polls, 1, __ATOMIC_RELAXED);
            continue;
        }
        if (now - start < spin_ns) {
            mp_relax();
            continue;
        }
        struct timespec t = {(end - now) / 1000000000, (end - now) % 1000000000};
        syscall(SYS_futex, &l->events, FUTEX_WAIT_PRIVATE, s, &t, NULL, 0);
    }
    if (poller) {
        __atomic_store_n(&l->poller_left, mp_now_ns(), __ATOMIC_SEQ_CST);
        __atomic_store_n(&l->poller, 0, __ATOMIC_SEQ_CST);
        /* A held wake-up is the loop thread's to release. Its signal may have been read by this
           driver's arm while the loop slept in poll (it went there before this driver polled):
           wake it, so it sleeps again no longer than the hold's deadline. */
        if (mp_release(l, mp_now_ns()) >= 0) {
            mp_unpark(l);
            l->signal(l->worker);
        }
    }
    if (__atomic_sub_fetch(&l->drivers, 1, __ATOMIC_SEQ_CST) > 0 && poller)
        mp_events(l); /* the others: one of them polls now */
    return r;
}

#ifdef MP_PYMODULE
/* The fast path as a CPython extension module: one entry, a bound lane's move(), for a single
 * request and for a group alike. A ctypes call of 15 arguments costs about 2 us here, as much as
 * a put and its flush; the binding packs the handles and function pointers of one (endpoint,
 * rkey, memh, local region, remote region, direction) once into a struct mp_lane and per call
 * only the offsets and lengths cross. The GIL is always released around the UCX calls, as ctypes
 * does: in multi-thread mode another thread (the progress thread) can hold the worker's lock while
 * UCX runs our error callback, which needs the GIL; keeping it here while UCX spins on that lock
 * would deadlock. Built only where Python.h is found. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

struct mp_rma_call {
    rma_fn fn;            /* ucp_put_nbx or ucp_get_nbx */
    check_fn check;       /* ucp_request_check_status */
    free_fn rfree;        /* ucp_request_free */
    progress_fn progress; /* ucp_worker_progress */
    flush_fn flush;       /* ucp_ep_flush_nbx */
    void *ep, *worker, *rkey;
    const void *param, *fparam;
    int64_t write;
    void *pending;        /* unused: concurrent calls keep their own */
};

/* A bound lane: one (endpoint, rkey, local region, remote attachment, direction) whose
 * requests are issued without the transport's lock. What the lock used to
 * guarantee -- that the endpoint, the rkey and the attachment stay valid while a put is
 * issued -- comes from two gates instead: the endpoint's and the attachment's, words the
 * transport shuts (open = 0) before it closes, destroys or revokes anything, after which
 * it waits until the endpoint gate's in-flight count is 0. The count goes up before the
 * gates are read, so a closer that saw it at 0 after shutting knows no call can still be
 * issuing. Nothing in a lane call takes a Python lock: a closer may wait while holding
 * the transport's. */
struct mp_lane {
    struct mp_rma_call call;
    int64_t *ep_gate;         /* [open, in flight] of the endpoint's generation */
    int64_t *att_gate;        /* [open] of the attachment's current state */
    int64_t laddr, lsize, rbase, rsize; /* the two regions' snapshot: every piece is checked against it */
    int64_t limit;            /* at most this many bytes in all per call (else declined) */
    int64_t merge;            /* adjacent pieces go as one operation of up to this many bytes */
    const void *mparam;       /* request parameters of a group (UCP_OP_ATTR_FLAG_MULTI_SEND) */
};

#define MP_DECLINE 3 /* mp_move issued nothing */

static int64_t mp_moves; /* calls of mp_move that issued (observability: the one fast path) */

/* The fast path's one entry: n >= 1 pieces (a single request is a group of one) on a bound
   lane, with its gate counted in flight by the caller. Declines (MP_DECLINE, nothing issued)
   when there is no piece, a negative length, more than `limit` bytes in all or none at all, or
   when the one piece of a group of one does not fit (the general path then reports it).
   Otherwise every piece is checked where it is issued (mp_issue: a piece outside its region
   fails alone, MP_OUT_OF_RANGE), then -- where something was issued, for a write, or when UCX
   left a get in flight -- the
   endpoint flush that completes them all at both ends goes out at once (over tcp one round trip
   answers the puts and the flush, not two in turn), settled while the worker makes local
   progress. Returns 0 done, a negative status (the flush failed), or 2 with *pending the
   flush still in flight; *refused counts the pieces refused (status[i] says why). */
static int64_t mp_move(struct mp_lane *l, const int64_t *loff, const int64_t *roff, const int64_t *len, int64_t n,
                       int8_t *status, int64_t *refused, void **pending)
{
    uint64_t total = 0;
    if (n <= 0 || l->limit < 0)
        return MP_DECLINE;
    for (int64_t i = 0; i < n; i++) {
        int64_t k = len[i];
        if (k < 0 || (uint64_t)k > (uint64_t)l->limit - total) /* unsigned: no overflow for any int64 */
            return MP_DECLINE;
        total += (uint64_t)k;
    }
    if (total == 0 || (n == 1 && (!mp_fits(loff[0], len[0], l->lsize) || !mp_fits(roff[0], len[0], l->rsize))))
        return MP_DECLINE;
    __atomic_add_fetch(&mp_moves, 1, __ATOMIC_RELAXED);
    struct mp_rma_call *c = &l->call;
    int64_t left;
    *refused = mp_issue(c->fn, c->check, c->rfree, c->progress, c->ep, c->worker, loff, l->laddr, l->lsize, roff, l->rbase,
                        l->rsize, len, n, c->rkey, n == 1 ? c->param : l->mparam, status, l->merge, &left);
    if (*refused == n || (!c->write && !left))
        return 0; /* nothing was issued, or every get landed inside its call: nothing to flush */
    return settle(c->flush(c->ep, c->fparam), 2, c->check, c->rfree, c->progress, c->worker, pending);
}

/* One int64 array argument: a 1-d, C-contiguous buffer of 8-byte signed integers ("q", or "l"
   where long is 8 bytes). Held (exported) until released, so an array('q') cannot be resized
   under the call; its values are read once each where they are issued, and checked there. */
static int mp_int64_buffer(PyObject *o, Py_buffer *b) {
    if (PyObject_GetBuffer(o, b, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0)
        return -1;
    const char *f = b->format;
    if (f != NULL && (*f == '@' || *f == '='))
        f++;
    if (b->ndim != 1 || b->itemsize != 8 || f == NULL || !((f[0] == 'q' || f[0] == 'l') && f[1] == 0)) {
        PyBuffer_Release(b);
        PyErr_SetString(PyExc_TypeError, "move: offsets and lengths must be int64 arrays");
        return -1;
    }
    return 0;
}

/* An integer argument of a single move: one outside int64 fits no region (declined, *ok = 0). */
static int mp_int64_arg(PyObject *o, int64_t *v, int *ok) {
    int over = 0;
    long long x = PyLong_AsLongLongAndOverflow(o, &over);
    if (x == -1 && PyErr_Occurred())
        return -1;
    if (over)
        *ok = 0;
    *v = (int64_t)x;
    return 0;
}

/* move(lo, ro, n) or move(loffs, roffs, lens) (three int64 arrays of one length): mp_move.
 *   - False: declined, nothing issued (see mp_move; or a gate shut);
 *   - True: every piece landed (and, for a write, was flushed);
 *   - else on_pending(code, pending, statuses)'s answer, or, where the lane has no on_pending,
 *     that tuple itself: code 0 done, negative (the flush failed) or 2 (the flush still in
 *     flight at the address `pending`, the caller's to free); statuses: bytes of one signed
 *     status per piece when some were refused, else None.
 * After anything was issued signal() is called while the `active` set is not empty (our progress
 * calls may have completed the progress thread's work). self: (lane address, active, signal,
 * on_pending or None, what the lane's pointers point into). */
static PyObject *py_lane_move(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "move(lo, ro, n) or move(loffs, roffs, lens) takes 3 arguments");
        return NULL;
    }
    struct mp_lane *l = PyLong_AsVoidPtr(PyTuple_GET_ITEM(self, 0));
    if (l == NULL) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_ValueError, "move: no lane");
        return NULL;
    }
    int64_t one[3];
    const int64_t *loff = one, *roff = one + 1, *len = one + 2;
    Py_ssize_t n = 1;
    Py_buffer b[3];
    int held = 0, ok = 1;
    if (PyLong_Check(args[0])) {
        for (int i = 0; i < 3; i++)
            if (mp_int64_arg(args[i], &one[i], &ok) < 0)
                return NULL;
    } else {
        for (; held < 3; held++)
            if (mp_int64_buffer(args[held], &b[held]) < 0)
                goto fail;
        n = b[2].len / 8;
        if (b[0].len != b[2].len || b[1].len != b[2].len) {
            PyErr_SetString(PyExc_ValueError, "move: offsets and lengths differ in length");
            goto fail;
        }
        loff = b[0].buf, roff = b[1].buf, len = b[2].buf;
    }
    PyObject *res = NULL;
    int8_t small[256];
    int8_t *status = n <= 256 ? small : PyMem_Malloc((size_t)n);
    if (status == NULL) {
        PyErr_NoMemory();
        goto fail;
    }
    int64_t r = MP_DECLINE, refused = 0;
    void *pending = NULL;
    __atomic_add_fetch(&l->ep_gate[1], 1, __ATOMIC_SEQ_CST);
    if (ok && __atomic_load_n(&l->ep_gate[0], __ATOMIC_SEQ_CST) && __atomic_load_n(&l->att_gate[0], __ATOMIC_SEQ_CST)) {
        Py_BEGIN_ALLOW_THREADS
        r = mp_move(l, loff, roff, len, n, status, &refused, &pending);
        Py_END_ALLOW_THREADS
    }
    if (r == MP_DECLINE) {
        res = Py_False;
        Py_INCREF(res);
    } else {
        if (PySet_GET_SIZE(PyTuple_GET_ITEM(self, 1)) > 0) {
            PyObject *x = PyObject_CallNoArgs(PyTuple_GET_ITEM(self, 2));
            if (x == NULL)
                PyErr_Clear(); /* a wake-up that failed loses nothing the caller must know */
            Py_XDECREF(x);
        }
        if (r == 0 && refused == 0) {
            res = Py_True;
            Py_INCREF(res);
        } else {
            PyObject *st = refused ? PyBytes_FromStringAndSize((const char *)status, n) : Py_NewRef(Py_None);
            PyObject *answer = PyTuple_GET_ITEM(self, 3);
            if (st != NULL) {
                if (answer == Py_None)
                    res = Py_BuildValue("LKO", (long long)r, (unsigned long long)(uintptr_t)pending, st);
                else
                    res = PyObject_CallFunction(answer, "LKO", (long long)r, (unsigned long long)(uintptr_t)pending,
                                                st);
                Py_DECREF(st);
            }
        }
    }
    /* Only now: a pending request is registered (on_pending) before a closer can go on. */
    __atomic_sub_fetch(&l->ep_gate[1], 1, __ATOMIC_SEQ_CST);
    if (status != small)
        PyMem_Free(status);
    for (int i = 0; i < held; i++)
        PyBuffer_Release(&b[i]);
    return res;
fail:
    for (int i = 0; i < held; i++)
        PyBuffer_Release(&b[i]);
    return NULL;
}

static PyMethodDef lane_def = {"move", (PyCFunction)(void (*)(void))py_lane_move, METH_FASTCALL,
                               "move(lo, ro, n) or move(loffs, roffs, lens): the lane's one fast-path entry"};

/* lane(address, active, signal, on_pending or None, keep) -> the lane's move callable */
static PyObject *py_lane(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 5 || !PyLong_Check(args[0]) || !PyAnySet_Check(args[1]) || !PyCallable_Check(args[2])
        || !(args[3] == Py_None || PyCallable_Check(args[3]))) {
        PyErr_SetString(PyExc_TypeError, "lane(address, active set, signal, on_pending or None, keep)");
        return NULL;
    }
    PyObject *t = PyTuple_New(5);
    if (t == NULL)
        return NULL;
    for (int i = 0; i < 5; i++) {
        Py_INCREF(args[i]);
        PyTuple_SET_ITEM(t, i, args[i]);
    }
    PyObject *f = PyCFunction_New(&lane_def, t);
    Py_DECREF(t);
    return f;
}

/* moves() -> how many lane moves issued something, in this process (every fast-path request) */
static PyObject *py_moves(PyObject *self, PyObject *unused) {
    (void)self, (void)unused;
    return PyLong_FromLongLong((long long)__atomic_load_n(&mp_moves, __ATOMIC_RELAXED));
}

static PyMethodDef mp_methods[] = {
    {"lane", (PyCFunction)(void (*)(void))py_lane, METH_FASTCALL, "a bound lane's move callable"},
    {"moves", py_moves, METH_NOARGS, "how many lane moves issued something"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef mp_module = {PyModuleDef_HEAD_INIT, "_mpcomm_ucxloop", NULL, -1, mp_methods,
                                       NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__mpcomm_ucxloop(void) {
    PyObject *m = PyModule_Create(&mp_module);
    if (m != NULL && (PyModule_AddIntConstant(m, "ABI", MP_ABI) < 0 ||
                      PyModule_AddIntConstant(m, "CALL_SIZE", (long)sizeof(struct mp_rma_call)) < 0 ||
                      PyModule_AddIntConstant(m, "LANE_SIZE", (long)sizeof(struct mp_lane)) < 0 ||
                      PyModule_AddIntConstant(m, "LOOP_SIZE", (long)sizeof(struct mp_loop)) < 0)) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
#endif
