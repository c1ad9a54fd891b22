/* The shm transport's copy loop: many (dst, src, len) pieces in one call.
 *
 * Compiled at first use by plugins/shm/_copyloop.py with the system `cc` into a
 * per-user cache and loaded with ctypes.CDLL, which releases the GIL for the
 * whole call. Nothing here allocates or calls back into Python; the only state
 * is the helper thread of large copies (copy_shared below). The Python fallback
 * in _copyloop.py implements the same functions, with one thread.
 *
 * Liveness: `pidfd` (or -1) is a pidfd of the process owning the target memory.
 * A pidfd polls readable once that process has exited, so a copy that returns
 * 0 finished while the owner was alive; -ESRCH means the owner is gone and the
 * bytes (if any moved) will never be read. Where the owner handed its alive page
 * (mp_alive_page below) with the region's memfd, the same answer comes from one
 * word of shared memory instead of a poll (a system call of 0.2-0.6 us per copy).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <linux/futex.h>
#include <poll.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/types.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#define MP_ABI 6
#define MP_IOV 1024 /* IOV_MAX on Linux */

int mp_abi(void) { return MP_ABI; }

/* Owner liveness from shared memory (the owner's "alive page").
 *
 * The owner (the target process) makes one memfd page per process holding a robust,
 * process-shared mutex that one of its threads locks and then holds for the life of the
 * process (mp_alive_page). The mutex's futex word holds that thread's id. When the thread
 * exits -- the process exits, is killed or execs -- the kernel walks its robust list and
 * sets FUTEX_OWNER_DIED in the word, before the process counts as exited (before its pidfd
 * polls readable). So "the word shows no FUTEX_OWNER_DIED after the copy" says what
 * "the pidfd is not readable after the copy" says, without a system call.
 *
 * An initiator maps the page read-only (it is sealed against writes through new mappings,
 * shrinking and growing) and files it under the pidfd of that owner (mp_watch, once per
 * attach, after checking the holder is a thread of that pid); mp_alive(pidfd) then reads
 * the word. A pidfd with no page filed (no page handed, another pid namespace, a CMA
 * mapping, a descriptor past MP_WATCH) is polled as before. Filing and unfiling happen
 * while no copy uses that pidfd (at attach, and at release with nothing in flight). */
#define MP_WATCH 4096
static int *watched[MP_WATCH]; /* pidfd -> the owner's futex word, read-only mapping; NULL: poll */

/* 0: the word's holder lives, -ESRCH: it died (or the word holds no holder). */
static int word_alive(const int *w) {
    __atomic_thread_fence(__ATOMIC_SEQ_CST); /* the copy's stores and loads before the look */
    int v = __atomic_load_n(w, __ATOMIC_SEQ_CST);
    return (v & FUTEX_OWNER_DIED) || (v & FUTEX_TID_MASK) == 0 ? -ESRCH : 0;
}

/* 0: alive (or unknown, pidfd < 0), -ESRCH: exited, -errno: poll failed. */
int mp_alive(int pidfd) {
    if (pidfd < 0)
        return 0;
    if (pidfd < MP_WATCH) {
        const int *w = __atomic_load_n(&watched[pidfd], __ATOMIC_ACQUIRE);
        if (w != NULL)
            return word_alive(w);
    }
    struct pollfd p = {pidfd, POLLIN, 0};
    int r;
    do {
        r = poll(&p, 1, 0);
    } while (r < 0 && errno == EINTR);
    if (r < 0)
        return -errno;
    return r == 0 ? 0 : -ESRCH;
}

/* File the alive page `fd` (an owner's, received with its region) under `pidfd`, a pidfd of
 * process `pid`: 1 filed; 0 not usable (not sealed, too short, its holder not a live thread
 * of `pid` as seen here): the pidfd stays polled; -errno on a failed mmap. `fd` stays the
 * caller's to close. */
int64_t mp_watch(int pidfd, int fd, int64_t pid) {
    if (pidfd < 0 || pidfd >= MP_WATCH || fd < 0 || pid <= 0 || __atomic_load_n(&watched[pidfd], __ATOMIC_ACQUIRE))
        return 0;
    int seals = fcntl(fd, F_GET_SEALS);
    int need = F_SEAL_SHRINK | F_SEAL_FUTURE_WRITE | F_SEAL_SEAL;
    struct stat st;
    if (seals < 0 || (seals & need) != need || fstat(fd, &st) != 0 || st.st_size < 4096)
        return 0;
    int *w = mmap(NULL, 4096, PROT_READ, MAP_SHARED, fd, 0);
    if (w == MAP_FAILED)
        return -errno;
    int tid = __atomic_load_n(w, __ATOMIC_SEQ_CST) & FUTEX_TID_MASK;
    char path[64];
    snprintf(path, sizeof path, "/proc/%lld/task/%d", (long long)pid, tid);
    if (word_alive(w) != 0 || access(path, F_OK) != 0) {
        munmap(w, 4096);
        return 0;
    }
    __atomic_store_n(&watched[pidfd], w, __ATOMIC_RELEASE);
    return 1;
}

/* Unfile `pidfd` (before it is closed): its copies are over. */
int64_t mp_unwatch(int pidfd) {
    if (pidfd < 0 || pidfd >= MP_WATCH)
        return 0;
    int *w = __atomic_exchange_n(&watched[pidfd], NULL, __ATOMIC_ACQ_REL);
    if (w != NULL)
        munmap(w, 4096);
    return w != NULL;
}

/* The owner's side: this process's alive page (made once; a fork child makes its own). */
static struct {
    pthread_mutex_t lock;
    int fd;
    int ready; /* futex word: the holder locked the mutex */
    int never; /* the holder waits on it for ever */
} P = {PTHREAD_MUTEX_INITIALIZER, -1, 0, 0};

static void *alive_holder(void *m) {
    int r = pthread_mutex_lock(m);
    __atomic_store_n(&P.ready, r == 0 ? 1 : -1, __ATOMIC_SEQ_CST);
    syscall(SYS_futex, &P.ready, FUTEX_WAKE_PRIVATE, 1, NULL, NULL, 0);
    for (;;)
        syscall(SYS_futex, &P.never, FUTEX_WAIT_PRIVATE, 0, NULL, NULL, 0);
    return NULL;
}

static void alive_prepare(void) { pthread_mutex_lock(&P.lock); }
static void alive_parent(void) { pthread_mutex_unlock(&P.lock); }
static void alive_child(void) {
    P.fd = -1; /* the parent's page names the parent's thread; this process has none yet */
    P.ready = 0;
    pthread_mutex_unlock(&P.lock);
}

static int64_t alive_make(void) {
    static int atfork = 0;
    if (!atfork) {
        if (pthread_atfork(alive_prepare, alive_parent, alive_child) != 0)
            return -EAGAIN;
        atfork = 1;
    }
    int fd = memfd_create("mpcomm-shm-alive", MFD_CLOEXEC | MFD_ALLOW_SEALING);
    if (fd < 0)
        return -errno;
    pthread_mutex_t *m = MAP_FAILED;
    pthread_mutexattr_t a;
    int err = 0, attr = 0;
    if (ftruncate(fd, 4096) != 0 || (m = mmap(NULL, 4096, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0)) == MAP_FAILED)
        err = errno;
    if (!err && ((err = pthread_mutexattr_init(&a)) == 0)) {
        attr = 1;
        if ((err = pthread_mutexattr_setpshared(&a, PTHREAD_PROCESS_SHARED)) == 0
            && (err = pthread_mutexattr_setrobust(&a, PTHREAD_MUTEX_ROBUST)) == 0)
            err = pthread_mutex_init(m, &a);
    }
    if (attr)
        pthread_mutexattr_destroy(&a);
    if (!err) {
        pthread_attr_t ta;
        sigset_t all, old;
        pthread_t t;
        if ((err = pthread_attr_init(&ta)) == 0) {
            pthread_attr_setdetachstate(&ta, PTHREAD_CREATE_DETACHED);
            pthread_attr_setstacksize(&ta, 64 << 10);
            sigfillset(&all);
            pthread_sigmask(SIG_SETMASK, &all, &old); /* signals stay with the process's own threads */
            err = pthread_create(&t, &ta, alive_holder, m);
            pthread_sigmask(SIG_SETMASK, &old, NULL);
            pthread_attr_destroy(&ta);
        }
        /* The mapping stays: the holder's robust list points into it for the life of the process. */
        if (!err) {
            int r;
            while ((r = __atomic_load_n(&P.ready, __ATOMIC_SEQ_CST)) == 0)
                syscall(SYS_futex, &P.ready, FUTEX_WAIT_PRIVATE, 0, NULL, NULL, 0);
            if (r < 0)
                err = EAGAIN;
        } else {
            munmap(m, 4096);
        }
    } else if (m != MAP_FAILED) {
        munmap(m, 4096);
    }
    if (!err && fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_FUTURE_WRITE | F_SEAL_SEAL) != 0)
        err = errno;
    if (err) {
        close(fd);
        return -err;
    }
    return fd;
}

/* This process's alive page: its fd (kept open for the life of the process; send it, never
 * close it), or -errno where it cannot be made. */
int64_t mp_alive_page(void) {
    pthread_mutex_lock(&P.lock);
    if (P.fd < 0) {
        int64_t r = alive_make();
        if (r >= 0)
            P.fd = (int)r;
        pthread_mutex_unlock(&P.lock);
        return r;
    }
    int64_t fd = P.fd;
    pthread_mutex_unlock(&P.lock);
    return fd;
}

/* A second copier for large contiguous copies.
 *
 * One memcpy thread does not saturate memory: a 4 MiB copy runs at about the
 * same speed as a single-thread memcpy, whatever else is idle. Copies of at
 * least `share_min` bytes are cut into MP_PIECE pieces that the caller and one
 * helper thread (a plain pthread, started at first use, never in Python) claim
 * from the same counter. The caller never waits for the helper to show up: a
 * helper that is asleep or has no CPU claims nothing and the caller copies
 * everything; the caller only waits for a piece the helper already claimed.
 * After a job the helper polls `share_spin_ns` for the next one (yielding the
 * CPU between looks), then sleeps on a futex. One shared copy at a time per
 * process; a copy that finds the helper busy runs alone.
 *
 * Lifetime: the call returns only once no piece of it is being copied (the
 * caller shuts `running`, then waits until the helper left the job), so the
 * memory guarantees of a plain memcpy call hold: nothing touches dst or src
 * after it returns. `running` and `users` form a Dekker pair (sequentially
 * consistent on both sides): a helper either counted itself in before the
 * caller shut the job, and the caller waits for it, or it sees the job shut
 * and leaves without touching anything. */
#define MP_PIECE ((int64_t)256 << 10)

static struct {
    pthread_mutex_t job; /* held by the caller of the current shared copy */
    int started;         /* the helper thread runs (in this process: reset in a fork child) */
    int seq;             /* futex word: bumped once per job */
    int sleeping;        /* the helper is (about to be) in futex_wait */
    int running;         /* the current job's pieces may be claimed */
    int users;           /* helpers inside the current job */
    char *dst;
    const char *src;
    int64_t n, next, done;
} S = {.job = PTHREAD_MUTEX_INITIALIZER};

static int64_t share_min = 0;        /* 0: never shared */
static int64_t share_spin_ns = 50000;

#define LOAD(x) __atomic_load_n(&(x), __ATOMIC_SEQ_CST)
#define STORE(x, v) __atomic_store_n(&(x), (v), __ATOMIC_SEQ_CST)

static long long mono_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (long long)t.tv_sec * 1000000000LL + t.tv_nsec;
}

static inline void relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

/* Claim and copy pieces of the current job until none is left. */
static void claim(char *dst, const char *src, int64_t n) {
    for (;;) {
        int64_t off = __atomic_fetch_add(&S.next, MP_PIECE, __ATOMIC_SEQ_CST);
        if (off >= n)
            return;
        int64_t k = n - off < MP_PIECE ? n - off : MP_PIECE;
        memcpy(dst + off, src + off, (size_t)k);
        __atomic_add_fetch(&S.done, k, __ATOMIC_SEQ_CST);
    }
}

static void *helper(void *arg) {
    (void)arg;
    int seen = LOAD(S.seq);
    for (;;) {
        long long until = mono_ns() + LOAD(share_spin_ns);
        int cur;
        while ((cur = LOAD(S.seq)) == seen) {
            if (mono_ns() < until) {
                sched_yield();
                continue;
            }
            STORE(S.sleeping, 1);
            if (LOAD(S.seq) == seen)
                syscall(SYS_futex, &S.seq, FUTEX_WAIT_PRIVATE, seen, NULL, NULL, 0);
            STORE(S.sleeping, 0);
            until = mono_ns() + LOAD(share_spin_ns);
        }
        seen = cur;
        __atomic_add_fetch(&S.users, 1, __ATOMIC_SEQ_CST);
        if (LOAD(S.running))
            claim(S.dst, S.src, S.n); /* the fields stay put while running and users > 0 */
        __atomic_sub_fetch(&S.users, 1, __ATOMIC_SEQ_CST);
    }
    return NULL;
}

/* Fork: the job lock is held across it (prepare takes it, waiting for a shared copy in
 * progress to end, which is bounded), so the child inherits it in a known state, held by
 * the forking thread, and simply unlocks it: re-initialising a mutex another thread may
 * hold is undefined behaviour. Only the forking thread survives: no helper, no job. */
static void fork_prepare(void) { pthread_mutex_lock(&S.job); }

static void fork_parent(void) { pthread_mutex_unlock(&S.job); }

static void forked_child(void) {
    S.started = S.sleeping = S.running = S.users = 0;
    pthread_mutex_unlock(&S.job);
}

/* Caller holds S.job. 1 when the helper runs. */
static int helper_up(void) {
    if (S.started)
        return 1;
    static int atfork = 0;
    if (!atfork) {
        if (pthread_atfork(fork_prepare, fork_parent, forked_child) != 0)
            return 0;
        atfork = 1;
    }
    pthread_attr_t a;
    sigset_t all, old;
    pthread_t t;
    if (pthread_attr_init(&a) != 0)
        return 0;
    pthread_attr_setdetachstate(&a, PTHREAD_CREATE_DETACHED);
    pthread_attr_setstacksize(&a, 64 << 10);
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old); /* signals stay with the process's own threads */
    int r = pthread_create(&t, &a, helper, NULL);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    pthread_attr_destroy(&a);
    if (r != 0)
        return 0;
    S.started = 1;
    return 1;
}

/* Copy n bytes with the helper's help when it is free; a plain memcpy otherwise. */
static void copy_shared(char *dst, const char *src, int64_t n) {
    if (pthread_mutex_trylock(&S.job) != 0) {
        memcpy(dst, src, (size_t)n);
        return;
    }
    if (!helper_up()) {
        pthread_mutex_unlock(&S.job);
        memcpy(dst, src, (size_t)n);
        return;
    }
    S.dst = dst;
    S.src = src;
    S.n = n;
    STORE(S.next, 0);
    STORE(S.done, 0);
    STORE(S.running, 1);
    __atomic_add_fetch(&S.seq, 1, __ATOMIC_SEQ_CST);
    if (LOAD(S.sleeping))
        syscall(SYS_futex, &S.seq, FUTEX_WAKE_PRIVATE, 1, NULL, NULL, 0);
    claim(dst, src, n);
    STORE(S.running, 0);
    while (LOAD(S.users) != 0 || LOAD(S.done) != n)
        relax(); /* at most one piece the helper claimed: a few microseconds */
    pthread_mutex_unlock(&S.job);
}

/* Copies of at least min_bytes share the work with the helper (0: never; needs 2 CPUs);
 * spin_ns: how long the helper looks for the next job before it sleeps. Per process. */
int64_t mp_share_config(int64_t min_bytes, int64_t spin_ns) {
    cpu_set_t set;
    if (min_bytes > 0 && (sched_getaffinity(0, sizeof set, &set) != 0 || CPU_COUNT(&set) < 2))
        min_bytes = 0;
    STORE(share_min, min_bytes < 0 ? 0 : min_bytes);
    STORE(share_spin_ns, spin_ns < 0 ? 0 : spin_ns);
    return LOAD(share_min);
}

/* Posted copies a result() caller may claim (plugins/shm/_posted.py).
 *
 * A copy the shm transport hands off (past inline_threshold) waits in a slot of a ring
 * the Python side owns: states[k] (0 free, the job's id > 0 while it waits, < 0 once
 * claimed) and dues[k] (CLOCK_MONOTONIC ns from which a worker may take it). A thread that
 * waits in result() claims it (mp_posted_claim) and copies on its own thread; otherwise a
 * worker blocked here without the GIL takes it once due. A claim is a compare-and-swap of
 * the job's own id, so each job runs exactly once, and a slot reused by a later job is never
 * claimed by an earlier job's waiter. Nothing here allocates. */
static inline int64_t cas64(int64_t *p, int64_t expect, int64_t to) {
    return __atomic_compare_exchange_n(p, &expect, to, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE);
}

/* A waiter's claim: 1 when it took job `id` (which then runs on the caller's thread). */
int64_t mp_posted_claim(int64_t *state, int64_t id) { return id > 0 && cas64(state, id, -1); }

/* A new job was published (or the ring is closing): wake one sleeping worker. */
int64_t mp_posted_kick(int32_t *seq) {
    __atomic_add_fetch(seq, 1, __ATOMIC_SEQ_CST);
    syscall(SYS_futex, seq, FUTEX_WAKE_PRIVATE, 1, NULL, NULL, 0);
    return 0;
}

/* A worker: the slot of a due job it took (marked -2), or -1 after max_ns with none. */
int64_t mp_posted_take(int64_t *states, int64_t *dues, int64_t k, int32_t *seq, int64_t max_ns) {
    long long end = mono_ns() + (max_ns < 0 ? 0 : max_ns);
    for (;;) {
        int32_t s = __atomic_load_n(seq, __ATOMIC_SEQ_CST);
        long long now = mono_ns(), next = end;
        for (int64_t i = 0; i < k; i++) {
            int64_t id = __atomic_load_n(&states[i], __ATOMIC_ACQUIRE);
            if (id <= 0)
                continue;
            int64_t due = __atomic_load_n(&dues[i], __ATOMIC_ACQUIRE);
            if (due <= now) {
                if (cas64(&states[i], id, -2))
                    return i;
            } else if (due < next) {
                next = due;
            }
        }
        if (now >= end)
            return -1;
        long long rel = next - now;
        struct timespec ts = {rel / 1000000000LL, rel % 1000000000LL};
        syscall(SYS_futex, seq, FUTEX_WAIT_PRIVATE, s, &ts, NULL, 0);
    }
}

/* One contiguous copy, then the owner's liveness. */
int64_t mp_copy(char *dst, const char *src, int64_t n, int pidfd) {
    int64_t m = LOAD(share_min);
    if (m > 0 && n >= m)
        copy_shared(dst, src, n);
    else
        memcpy(dst, src, (size_t)n);
    return mp_alive(pidfd);
}

/* [off, off + len) inside [0, size): the one bounds rule (mpcomm.engine.checks.fits), in
 * unsigned arithmetic that cannot wrap. Every loop below that moves bytes asks it again
 * for each piece at the point of use, against the region sizes it was handed: whatever
 * the arrays hold by then, no piece moves a byte outside either region. */
static inline int mp_fits(int64_t off, int64_t len, int64_t size) {
    return off >= 0 && len >= 0 && size >= 0 && (uint64_t)len <= (uint64_t)size
           && (uint64_t)off <= (uint64_t)size - (uint64_t)len;
}

/* The first index i in [0, n) whose piece does not fit (mp_fits), or, when every piece
 * lies inside [0, size), -1 - (the sum of len). */
int64_t mp_check(const int64_t *off, const int64_t *len, int64_t n, int64_t size) {
    int64_t sum = 0;
    for (int64_t i = 0; i < n; i++) {
        int64_t o = off[i], l = len[i];
        if (!mp_fits(o, l, size) || sum > INT64_MAX - 1 - l)
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
 * the owner died (checked once, after the copies). A piece outside dst's `dsize`
 * or src's `ssize` bytes is not copied: the call stops before it (returning its
 * index), or returns -ERANGE when it is the first piece. */
int64_t mp_copy_many(char *dst, int64_t dsize, const int64_t *doff, const char *src, int64_t ssize,
                     const int64_t *soff, const int64_t *len, int64_t start, int64_t n, int64_t budget, int pidfd) {
    int64_t moved = 0, i = start;
    while (i < n) {
        int64_t d = doff[i], s = soff[i], k = len[i]; /* read once: what is checked is what is used */
        if (!mp_fits(d, k, dsize) || !mp_fits(s, k, ssize)) {
            if (i == start)
                return -ERANGE;
            break;
        }
        memcpy(dst + d, src + s, (size_t)k);
        moved += k;
        i++;
        if (moved >= budget)
            break;
    }
    int a = mp_alive(pidfd);
    return a < 0 ? a : i;
}

/* Cross-memory attach for pieces start.. : local + loff[i] <-> remote + roff[i]
 * (len[i] each) in process `pid`, up to MP_IOV pieces per system call, resuming
 * partial transfers, until `budget` bytes moved or n is reached (pieces are moved
 * whole). Returns the next index or -errno (ESRCH: gone, EPERM: ptrace policy,
 * EFAULT: unmapped). The owner's pidfd is checked before the copies, so the pid
 * still names that process (not a reused pid). No check after: a copy that
 * succeeded found the process's memory in place, i.e. it had not exited (unlike a
 * memfd mapping, which outlives its owner). Each piece is read from the arrays
 * once and checked (mp_fits) against the local region's `lsize` and the remote
 * one's `rsize` bytes before it goes into an iovec; a piece that does not fit is
 * not moved: the call stops before it (returning its index), or returns -ERANGE
 * when it is the first piece. */
int64_t mp_cma_many(int pid, int wr, char *local, int64_t lsize, const int64_t *loff, char *remote, int64_t rsize,
                    const int64_t *roff, const int64_t *len, int64_t start, int64_t n, int64_t budget, int pidfd) {
    struct iovec lv[MP_IOV], rv[MP_IOV];
    int a = mp_alive(pidfd);
    if (a < 0)
        return a;
    int64_t i = start, moved = 0;
    while (i < n && moved < budget) {
        int k = 0, bad = 0;
        int64_t want = 0, j = i;
        for (; j < n && k < MP_IOV && moved + want < budget; j++) {
            int64_t lo = loff[j], ro = roff[j], l = len[j]; /* read once: what is checked is what is used */
            if (!mp_fits(lo, l, lsize) || !mp_fits(ro, l, rsize)) {
                bad = 1;
                break;
            }
            if (l == 0)
                continue;
            lv[k].iov_base = local + lo;
            rv[k].iov_base = remote + ro;
            lv[k].iov_len = rv[k].iov_len = (size_t)l;
            want += l;
            k++;
        }
        if (k == 0) {
            if (bad)
                return j == start ? -ERANGE : j;
            return n; /* only empty pieces were left */
        }
        /* Move the k gathered iovecs completely, resuming a partial transfer. */
        int first = 0;
        while (first < k) {
            ssize_t got = wr ? process_vm_writev(pid, lv + first, (unsigned long)(k - first), rv + first,
                                                 (unsigned long)(k - first), 0)
                             : process_vm_readv(pid, lv + first, (unsigned long)(k - first), rv + first,
                                                (unsigned long)(k - first), 0);
            if (got < 0) {
                if (errno == EINTR)
                    continue;
                return -errno;
            }
            if (got == 0)
                return -EFAULT;
            moved += got;
            size_t g = (size_t)got;
            while (g > 0 && first < k) {
                if (g >= lv[first].iov_len) {
                    g -= lv[first].iov_len;
                    first++;
                } else {
                    lv[first].iov_base = (char *)lv[first].iov_base + g;
                    rv[first].iov_base = (char *)rv[first].iov_base + g;
                    lv[first].iov_len -= g;
                    rv[first].iov_len -= g;
                    g = 0;
                }
            }
        }
        i = j;
        if (bad)
            break; /* the next call starts at the piece that does not fit, and refuses it */
    }
    return i;
}

/* One contiguous CMA range (the single-request path). 0 or -errno. */
int64_t mp_cma(int pid, int wr, char *local, char *remote, int64_t n, int pidfd) {
    int64_t zero = 0;
    int64_t r = mp_cma_many(pid, wr, local, n, &zero, remote, n, &zero, &n, 0, 1, INT64_MAX, pidfd);
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
#include <stddef.h> /* offsetof */
#include <structmember.h> /* T_OBJECT_EX: the mapping's error slot */

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

/* The int64 array `o` as a buffer of at least `n` entries (held until release: the array
 * cannot be resized under the loop), or -1 with ValueError/TypeError set. */
static int mp_i64s(PyObject *o, long long n, Py_buffer *b) {
    if (PyObject_GetBuffer(o, b, PyBUF_SIMPLE) < 0)
        return -1;
    if (n < 0 || b->len / 8 < n) {
        PyBuffer_Release(b);
        PyErr_Format(PyExc_ValueError, "an offset or length array holds fewer than %lld int64 entries", n);
        return -1;
    }
    return 0;
}

/* The three int64 arrays of a batch call (offsets, offsets, lengths), each holding n entries:
 * 0 with all three buffers held (release them with mp_release3), -1 with none held. */
static int mp_hold3(PyObject *a0, PyObject *a1, PyObject *a2, long long n, Py_buffer b[3]) {
    PyObject *arr[3] = {a0, a1, a2};
    for (int got = 0; got < 3; got++)
        if (mp_i64s(arr[got], n, &b[got]) < 0) {
            while (got-- > 0)
                PyBuffer_Release(&b[got]);
            return -1;
        }
    return 0;
}

static void mp_release3(Py_buffer b[3]) {
    for (int i = 0; i < 3; i++)
        PyBuffer_Release(&b[i]);
}

/* check2(roffs, loffs, lens, n, rsize, lsize) -> mp_check2's result: the batch check of
 * shm's transport without ctypes' argument conversion (about 1 us a call, a 64-piece batch
 * made two). */
static PyObject *py_check2(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (mp_args(args, nargs, 6, "check2(roffs, loffs, lens, n, rsize, lsize)") < 0)
        return NULL;
    long long n = PyLong_AsLongLong(args[3]), rsize = PyLong_AsLongLong(args[4]),
              lsize = PyLong_AsLongLong(args[5]);
    if (PyErr_Occurred())
        return NULL;
    Py_buffer b[3];
    if (mp_hold3(args[0], args[1], args[2], n, b) < 0)
        return NULL;
    PyObject *res = PyLong_FromLongLong((long long)mp_check2(b[0].buf, b[1].buf, b[2].buf, n, rsize, lsize));
    mp_release3(b);
    return res;
}

/* copy_many(dst, dsize, doffs, src, ssize, soffs, lens, start, n, budget, pidfd) ->
 * mp_copy_many's result, the GIL released for the copies (as the ctypes call did). */
static PyObject *py_copy_many(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (mp_args(args, nargs, 11, "copy_many(dst, dsize, doffs, src, ssize, soffs, lens, start, n, budget, pidfd)") < 0)
        return NULL;
    char *dst = PyLong_AsVoidPtr(args[0]);
    const char *src = PyLong_AsVoidPtr(args[3]);
    long long dsize = PyLong_AsLongLong(args[1]), ssize = PyLong_AsLongLong(args[4]),
              start = PyLong_AsLongLong(args[7]), n = PyLong_AsLongLong(args[8]),
              budget = PyLong_AsLongLong(args[9]);
    long pidfd = PyLong_AsLong(args[10]);
    if (PyErr_Occurred())
        return NULL;
    if (start < 0) {
        PyErr_SetString(PyExc_ValueError, "copy_many: negative start");
        return NULL;
    }
    Py_buffer b[3];
    if (mp_hold3(args[2], args[5], args[6], n, b) < 0)
        return NULL;
    int64_t r;
    Py_BEGIN_ALLOW_THREADS
    r = mp_copy_many(dst, dsize, b[0].buf, src, ssize, b[1].buf, b[2].buf, start, n, budget, (int)pidfd);
    Py_END_ALLOW_THREADS
    mp_release3(b);
    return PyLong_FromLongLong((long long)r);
}

/* cma_many(pid, write, local, lsize, loffs, remote, rsize, roffs, lens, start, n, budget, pidfd)
 * -> mp_cma_many's result, the GIL released. */
static PyObject *py_cma_many(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (mp_args(args, nargs, 13,
                "cma_many(pid, write, local, lsize, loffs, remote, rsize, roffs, lens, start, n, budget, pidfd)") < 0)
        return NULL;
    long pid = PyLong_AsLong(args[0]);
    int wr = PyObject_IsTrue(args[1]);
    char *local = PyLong_AsVoidPtr(args[2]);
    char *remote = PyLong_AsVoidPtr(args[5]);
    long long lsize = PyLong_AsLongLong(args[3]), rsize = PyLong_AsLongLong(args[6]),
              start = PyLong_AsLongLong(args[9]), n = PyLong_AsLongLong(args[10]),
              budget = PyLong_AsLongLong(args[11]);
    long pidfd = PyLong_AsLong(args[12]);
    if (wr < 0 || PyErr_Occurred())
        return NULL;
    if (start < 0) {
        PyErr_SetString(PyExc_ValueError, "cma_many: negative start");
        return NULL;
    }
    Py_buffer b[3];
    if (mp_hold3(args[4], args[7], args[8], n, b) < 0)
        return NULL;
    int64_t r;
    Py_BEGIN_ALLOW_THREADS
    r = mp_cma_many((int)pid, wr, local, lsize, b[0].buf, remote, rsize, b[1].buf, b[2].buf, start, n, budget,
                    (int)pidfd);
    Py_END_ALLOW_THREADS
    mp_release3(b);
    return PyLong_FromLongLong((long long)r);
}

/* mover(acquire, release, error, enter, exit, mapping, size, base, laddr, lsize, pidfd, limit, small,
 *       write, cma, pid) -> move(lo, ro, n) -> bool: the shm transport's one fast path,
 * ShmTransport.inline_path's move (plugins/shm/transport.py builds it; without this module
 * there is no fast path and requests take the general path). In order: both ranges against
 * the sizes held here (mp_fits), then a copy
 * up to `small` bytes under the mapping's lock after error(mapping) said None (the
 * revocation sets it under that lock), a longer one between enter() (None: admitted) and
 * exit(); True once the bytes landed and the owner is alive. What it calls on the mapping
 * comes as objects, and `error` as the descriptor of the mapping's slot (read at its offset,
 * no call): no attribute name is read here. Anything but exact ints declines
 * (False), as a range that does not fit: the general path decides. */
typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    PyObject *acquire, *release, *enter, *exit, *mapping;
    Py_ssize_t error; /* the offset of the mapping's error slot */
    char *base, *laddr;
    long long size, lsize, limit, small;
    int pidfd, write, cma, pid;
} Mover;

static void mover_dealloc(PyObject *o) {
    Mover *m = (Mover *)o;
    Py_XDECREF(m->acquire);
    Py_XDECREF(m->release);
    Py_XDECREF(m->enter);
    Py_XDECREF(m->exit);
    Py_XDECREF(m->mapping);
    PyObject_Free(o);
}

/* call(f), dropping its result: 0, or -1 with its exception set */
static int mp_call0(PyObject *f) {
    PyObject *x = PyObject_CallNoArgs(f);
    if (x == NULL)
        return -1;
    Py_DECREF(x);
    return 0;
}

/* An exact int in [0, 2**63) into *v: 1; anything else (bool, float, negative, huge): 0. */
static int mp_exact(PyObject *o, long long *v) {
    if (!PyLong_CheckExact(o))
        return 0;
    int over = 0;
    *v = PyLong_AsLongLongAndOverflow(o, &over);
    if (*v == -1 && PyErr_Occurred()) {
        PyErr_Clear();
        return 0;
    }
    return !over && *v >= 0;
}

static PyObject *mover_call(PyObject *self, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    Mover *m = (Mover *)self;
    if (PyVectorcall_NARGS(nargsf) != 3 || (kwnames != NULL && PyTuple_GET_SIZE(kwnames))) {
        PyErr_SetString(PyExc_TypeError, "move(lo, ro, n) takes 3 positional arguments");
        return NULL;
    }
    long long lo, ro, n;
    if (!mp_exact(args[0], &lo) || !mp_exact(args[1], &ro) || !mp_exact(args[2], &n) || n > m->limit
        || !mp_fits(ro, n, m->size) || !mp_fits(lo, n, m->lsize))
        Py_RETURN_FALSE;
    int lng = n > m->small;
    if (lng) {
        PyObject *x = PyObject_CallNoArgs(m->enter);
        if (x == NULL)
            return NULL;
        int refused = x != Py_None;
        Py_DECREF(x);
        if (refused)
            Py_RETURN_FALSE;
    } else {
        if (mp_call0(m->acquire) < 0)
            return NULL;
        if (*(PyObject **)((char *)m->mapping + m->error) != Py_None) { /* revoked (or unset) */
            if (mp_call0(m->release) < 0)
                return NULL;
            Py_RETURN_FALSE;
        }
    }
    int64_t rc;
    if (m->cma) {
        Py_BEGIN_ALLOW_THREADS /* a system call that may fault in the other process's pages */
        rc = mp_cma(m->pid, m->write, m->laddr + lo, m->base + ro, (int64_t)n, m->pidfd);
        Py_END_ALLOW_THREADS
    } else {
        char *dst = m->write ? m->base + ro : m->laddr + lo;
        const char *src = m->write ? m->laddr + lo : m->base + ro;
        if (n > MP_KEEP_GIL) {
            Py_BEGIN_ALLOW_THREADS
            rc = mp_copy(dst, src, (int64_t)n, m->pidfd);
            Py_END_ALLOW_THREADS
        } else {
            rc = mp_copy(dst, src, (int64_t)n, m->pidfd);
        }
    }
    if (mp_call0(lng ? m->exit : m->release) < 0)
        return NULL;
    return PyBool_FromLong(rc == 0);
}

static PyTypeObject MoverType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "_mpcomm_copyloop.Mover",
    .tp_basicsize = sizeof(Mover),
    .tp_dealloc = mover_dealloc,
    .tp_vectorcall_offset = offsetof(Mover, vectorcall),
    .tp_call = PyVectorcall_Call,
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_doc = "move(lo, ro, n) -> bool: a bound pair's inline shm copy",
};

static PyObject *py_mover(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (mp_args(args, nargs, 16, "mover(acquire, release, error, enter, exit, mapping, size, base, laddr, lsize, "
                                 "pidfd, limit, small, write, cma, pid)") < 0)
        return NULL;
    long long size = PyLong_AsLongLong(args[6]), lsize = PyLong_AsLongLong(args[9]),
              limit = PyLong_AsLongLong(args[11]), small = PyLong_AsLongLong(args[12]);
    char *base = PyLong_AsVoidPtr(args[7]), *laddr = PyLong_AsVoidPtr(args[8]);
    long pidfd = PyLong_AsLong(args[10]), pid = PyLong_AsLong(args[15]);
    int wr = PyObject_IsTrue(args[13]), cma = PyObject_IsTrue(args[14]);
    if (wr < 0 || cma < 0 || PyErr_Occurred())
        return NULL;
    if (size < 0 || lsize < 0 || limit < 0 || small < 0) {
        PyErr_SetString(PyExc_ValueError, "mover: negative size");
        return NULL;
    }
    PyMemberDescrObject *err = (PyMemberDescrObject *)args[2];
    if (!Py_IS_TYPE(args[2], &PyMemberDescr_Type) || !PyObject_TypeCheck(args[5], PyDescr_TYPE(err))
        || err->d_member->type != T_OBJECT_EX) {
        PyErr_SetString(PyExc_TypeError, "mover: error is the descriptor of an object slot of the mapping");
        return NULL;
    }
    Mover *m = PyObject_New(Mover, &MoverType);
    if (m == NULL)
        return NULL;
    m->vectorcall = mover_call;
    m->acquire = Py_NewRef(args[0]);
    m->release = Py_NewRef(args[1]);
    m->error = err->d_member->offset;
    m->enter = Py_NewRef(args[3]);
    m->exit = Py_NewRef(args[4]);
    m->mapping = Py_NewRef(args[5]);
    m->size = size;
    m->base = base;
    m->laddr = laddr;
    m->lsize = lsize;
    m->pidfd = (int)pidfd;
    m->limit = limit;
    m->small = small;
    m->write = wr;
    m->cma = cma;
    m->pid = (int)pid;
    return (PyObject *)m;
}

/* alive_page() -> fd; watch(pidfd, fd, pid) -> 1/0; unwatch(pidfd) -> 1/0 (see "Owner liveness") */
static PyObject *py_alive_page(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    (void)args;
    if (mp_args(args, nargs, 0, "alive_page()") < 0)
        return NULL;
    int64_t r;
    Py_BEGIN_ALLOW_THREADS /* at most a thread start */
    r = mp_alive_page();
    Py_END_ALLOW_THREADS
    if (r < 0) {
        errno = (int)-r;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    return PyLong_FromLongLong((long long)r);
}

static PyObject *py_watch(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (mp_args(args, nargs, 3, "watch(pidfd, fd, pid)") < 0)
        return NULL;
    long pidfd = PyLong_AsLong(args[0]), fd = PyLong_AsLong(args[1]);
    long long pid = PyLong_AsLongLong(args[2]);
    if (PyErr_Occurred())
        return NULL;
    if (pidfd < INT32_MIN || pidfd > INT32_MAX || fd < INT32_MIN || fd > INT32_MAX)
        return PyLong_FromLong(0);
    int64_t r = mp_watch((int)pidfd, (int)fd, (int64_t)pid);
    if (r < 0) {
        errno = (int)-r;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    return PyLong_FromLongLong((long long)r);
}

static PyObject *py_unwatch(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (mp_args(args, nargs, 1, "unwatch(pidfd)") < 0)
        return NULL;
    long pidfd = PyLong_AsLong(args[0]);
    if (PyErr_Occurred())
        return NULL;
    if (pidfd < INT32_MIN || pidfd > INT32_MAX)
        return PyLong_FromLong(0);
    return PyLong_FromLongLong((long long)mp_unwatch((int)pidfd));
}

static PyMethodDef mp_methods[] = {
    {"alive_page", (PyCFunction)(void (*)(void))py_alive_page, METH_FASTCALL, "this process's alive page (fd)"},
    {"watch", (PyCFunction)(void (*)(void))py_watch, METH_FASTCALL, "file an owner's alive page under its pidfd"},
    {"unwatch", (PyCFunction)(void (*)(void))py_unwatch, METH_FASTCALL, "unfile a pidfd before closing it"},
    {"mover", (PyCFunction)(void (*)(void))py_mover, METH_FASTCALL, "a bound pair's inline move, in C"},
    {"copy", (PyCFunction)(void (*)(void))py_copy, METH_FASTCALL, "memcpy, then the owner's liveness"},
    {"cma", (PyCFunction)(void (*)(void))py_cma, METH_FASTCALL, "one cross-memory-attach range"},
    {"check2", (PyCFunction)(void (*)(void))py_check2, METH_FASTCALL, "mp_check2 over int64 arrays"},
    {"copy_many", (PyCFunction)(void (*)(void))py_copy_many, METH_FASTCALL, "mp_copy_many over int64 arrays"},
    {"cma_many", (PyCFunction)(void (*)(void))py_cma_many, METH_FASTCALL, "mp_cma_many over int64 arrays"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef mp_module = {PyModuleDef_HEAD_INIT, "_mpcomm_copyloop", NULL, -1, mp_methods,
                                       NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__mpcomm_copyloop(void) {
    if (PyType_Ready(&MoverType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&mp_module);
    if (m != NULL && PyModule_AddIntConstant(m, "ABI", MP_ABI) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
#endif
