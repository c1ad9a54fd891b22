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
