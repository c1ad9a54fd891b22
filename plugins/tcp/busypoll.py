"""Bounded busy-polling of a socket, for the round trips of small requests.

A thread blocked in ``recv`` that the peer's next frame wakes pays the
scheduler's cross-CPU wake-up; on the virtual machines we measured that is
25-30 µs per wake, more than a whole round trip between two threads that poll.
So the tcp transport polls, briefly, where a frame is due soon:

* the **target**, after it answered a request, for the connection's next
  request (``busy_poll_us``);
* the **initiator**'s ``result()`` caller, for the reply it waits for.

The poll runs in a small compiled helper (``_busypoll.c``, built when mpcomm
was installed into the extension module ``mpcomm.plugins.tcp._mpcomm_busypoll``;
never at run time), which releases the GIL: the other threads of the process
run meanwhile. At most ``limit()`` threads of a process poll at a time
(counted by the module); the others block as before. Where the install built
no helper, or with ``MPCOMM_TCP_BUSY_POLL=0``, nobody polls: everything
works, each wait simply blocks (:data:`reason` says why).

The extension module also has the two waits of a small request whole
(:data:`next_request` for the target, :data:`next_reply` for the initiator's
driver; None without the module): one call each instead of a handful of
Python-level ones. server.py and client.py keep their Python twins for the
library without the module, or with ``MPCOMM_TCP_NATIVE_WAITS=0``.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any, Callable

from mpcomm import native_helper

log = logging.getLogger("mpcomm.transport.tcp")

ABI = 3
MODULE = "mpcomm.plugins.tcp._mpcomm_busypoll"
_ENV = "MPCOMM_TCP_BUSY_POLL"
_ENV_WAITS = "MPCOMM_TCP_NATIVE_WAITS"  # 0: the Python twins of next_request/next_reply (diagnostics, tests)

_lock = threading.Lock()
_spin: Callable[[int, int], int] | None = None
_module: Any = None  # the extension module, where it loaded (it counts its pollers itself)
_tried = False
#: ``next_request(fd, spin_ns, head) -> bytes received | -errno`` (see _busypoll.c), or None.
next_request: Callable[[int, int, bytearray], int] | None = None
#: ``next_reply(fd, spin_ns, wait_ms, max_len, head) -> REPLY_*`` (see _busypoll.c), or None.
next_reply: Callable[[int, int, int, int, bytearray], int] | None = None
#: next_reply's answers: nothing yet, a whole reply's header in ``head``, a reply partly there,
#: not one for a driver (the reader thread takes it).
REPLY_NONE, REPLY_GOT, REPLY_SHORT, REPLY_LEAVE = 0, 1, 2, 3
#: ``await_reply(fd, flags, handoff_ns, idle_ns, max_ms) -> AWAIT_*`` (see _busypoll.c): the initiator's
#: reader thread waits there without the GIL, so a reply its result() caller reads itself wakes
#: no Python on that thread. None: the reader waits on its condition (the Python twin).
await_reply: Callable[[int, Any, int, int, int], int] | None = None
AWAIT_NONE, AWAIT_REPLY, AWAIT_END = 0, 1, 3
#: What ``Conn.hand_to_reader`` adds to the reader's bell (an eventfd): no driver will come, so
#: ``await_reply`` goes on at once, without the HANDOFF a leaving driver's ring (1) waits first.
BELL_NOW = 1 << 32
#: Why busy-polling is or is not available (shown in the transport's availability).
reason = "not loaded yet"


def limit() -> int:
    """How many threads of this process may poll at the same time: half its CPUs, at least one."""
    return max(1, len(os.sched_getaffinity(0)) // 2)


def load() -> Callable[[int, int], int] | None:
    """The compiled ``spin_readable(fd, budget_ns)``, or None (see :data:`reason`)."""
    global _spin, _tried, reason, _module, next_request, next_reply, await_reply
    with _lock:
        if _tried:
            return _spin
        _tried = True
        if os.environ.get(_ENV, "1") == "0":
            reason = f"disabled by {_ENV}=0"
            return None
        try:
            h = native_helper.load(MODULE, ABI, "mpcomm_tcp_abi")
        except Exception as exc:  # noqa: BLE001 - optional: without it every wait blocks
            h = f"loading the helper failed ({exc})"
        if isinstance(h, str):
            reason = h
            log.debug("tcp: busy-polling not available: %s", reason)
            return None
        h.module.set_spin_limit(limit())  # the module counts its pollers (see _busypoll.c)
        _module = h.module
        _spin = h.module.spin_readable
        if os.environ.get(_ENV_WAITS, "1") != "0":
            next_request, next_reply = h.module.next_request, h.module.next_reply
            await_reply = h.module.await_reply
        reason = f"compiled helper ({h.path})"
        return _spin


def wait_readable(fd: int, budget_ns: int) -> bool:
    """Poll ``fd`` for up to ``budget_ns`` without sleeping: True once readable (or closed).

    False when nothing came, when busy-polling is unavailable, or when
    :func:`limit` threads already poll: the caller then blocks as it would have.
    """
    spin = _spin if _tried else load()
    if spin is None or budget_ns <= 0:
        return False
    return spin(fd, budget_ns) == 1
