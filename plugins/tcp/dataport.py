"""The tcp data port served below the interpreter (``_dataport.c``).

Why: :mod:`.server` serves each request in Python, so every request needs the
GIL. A target whose application keeps the interpreter busy (``while True:
pass`` in its main thread) answered a 4 KiB write in 5.3 ms instead of 75 µs.

What stays in Python: the accept loop and its connection limits
(:class:`~mpcomm.transport_kit.AcceptLoop`), HELLO and authentication
(:meth:`.server.Server._hello`), once per connection. Then the connection's
thread calls :meth:`Port.run <NativePort.run>`, which releases the GIL and
serves every request of that connection in C until it ends (WRITE, READ,
WRITEV, READV with server.py's checks, deadlines, replies and refusals), and
takes the GIL again only to return.

The region table the C loop consults lives in native memory: the transport
publishes a region at ``register`` (the table keeps an export of its buffer,
so the address stays valid) and revokes it at ``unregister`` (see
:meth:`NativePort.revoke`).

Notifications (NOTIFY frames) go into a native bounded queue (:attr:`NativePort.notes`,
the limits of ``[limits]``) without the GIL; the engine adopts that queue as
its one notification queue (``Transport.notification_queue``), so the control
channel delivers into it too.

Used for plain connections (no TLS, zero-copy mode) unless the
``native_server`` option is false (or ``MPCOMM_TCP_NATIVE_SERVER=0`` is
set in the target's environment); TLS and copy mode keep the Python server,
which also stays the readable template for plugin authors. Where the
install had no C compiler, the Python server serves (:data:`reason` says why).
"""

from __future__ import annotations

import logging
import os
import re
import threading
from typing import Any

from mpcomm import native_helper

from . import busypoll

log = logging.getLogger("mpcomm.transport.tcp")

ABI = 3
MODULE = "mpcomm.plugins.tcp._mpcomm_dataport"

#: The native loop busy-polls (``busy_poll_us``) only where the process may run on this many CPUs.
MIN_CPUS_TO_POLL = 2
ENV = "MPCOMM_TCP_NATIVE_SERVER"  # 0: the Python server serves every connection (comparisons, diagnostics)

_lock = threading.Lock()
_module: Any = None
_tried = False
#: Why the native data port is or is not available.
reason = "not loaded yet"
_EPOCH = re.compile(r"[0-9a-f]{16}")


def load() -> Any:
    """The extension module ``_mpcomm_dataport``, or None (see :data:`reason`)."""
    global _module, _tried, reason
    with _lock:
        if _tried:
            return _module
        _tried = True
        try:
            h = native_helper.load(MODULE, ABI, "mpcomm_dataport_abi")
        except Exception as exc:  # noqa: BLE001 - optional: the Python server serves without it
            h = f"loading the helper failed ({exc})"
        if isinstance(h, str):
            reason = h
        else:
            _module = h.module
            _module.set_spin_limit(busypoll.limit())
            reason = f"compiled helper ({h.path})"
        if _module is None:
            log.debug("tcp: native data port not available: %s", reason)
        return _module


class NativePort:
    """One transport's native region table and request loop."""

    def __init__(self, module: Any, ctx: Any) -> None:
        o = ctx.options
        epoch = ctx.epoch if isinstance(ctx.epoch, str) else ""
        ok = bool(_EPOCH.fullmatch(epoch))
        busy = int(o["busy_poll_us"]) * 1000 if os.environ.get("MPCOMM_TCP_BUSY_POLL", "1") != "0" else 0
        if len(os.sched_getaffinity(0)) < MIN_CPUS_TO_POLL:
            # A poller needs a CPU of its own: with one, it only takes turns with the application.
            # With 2 it polls, and pauses for some requests when it finds itself preempted
            # (_dataport.c spin_recv: 64 requests, doubling while a competitor stays): on a
            # quiet 2-CPU machine a blocking target thread answered a 4 KiB write in 66-70 us, a
            # polling one in 32-35 us, idle or with the application spinning.
            busy = 0
        self.grace = ctx.config.runtime.abort_grace_ms / 1000
        lim = ctx.config.limits
        #: The engine's notification queue once it adopts it (bounded as ``[limits]`` says), with
        #: the senders' notify_rate buckets: one per sender node id, whatever connection it uses.
        self.notes = module.Notes(max_count=int(lim.max_queued_notifications),
                                  max_bytes=int(lim.max_queued_notify_bytes), rate=int(lim.notify_rate),
                                  max_senders=int(lim.max_notify_senders))
        self._port = module.Port(epoch=int(epoch, 16) if ok else 0, epoch_ok=ok,
                                 idle_ms=float(o["idle_timeout_ms"]), max_request_ms=float(o["max_request_ms"]),
                                 grace_ms=float(ctx.config.runtime.abort_grace_ms),
                                 handshake_ms=float(ctx.config.transport.handshake_timeout_ms),
                                 max_batch=int(o["max_batch"]), chunk=int(o["chunk"]), busy_ns=busy,
                                 notes=self.notes, max_note=int(lim.max_notify_bytes))
        self.END_CLOSED, self.END_PROTOCOL, self.END_ERROR = module.END_CLOSED, module.END_PROTOCOL, module.END_ERROR
        # Ids in the table: unregister of a buffer never published (one request's ephemeral
        # registration) then costs no call that releases and retakes the GIL.
        self._ids: set[int] = set()

    def publish(self, region: Any) -> None:
        """Add ``region`` to the table (its buffer stays exported until :meth:`revoke`)."""
        self._port.publish(region.id, region.token, region.access, region.view, repr(region.name))
        self._ids.add(region.id)

    def revoke(self, region: Any) -> bool:
        """Remove ``region``; when this returns no request moves a byte of it.

        The entry is unlinked first (a request arriving now is refused as an
        unknown region), then the requests already moving its bytes may
        finish for up to ``runtime.abort_grace_ms``; the connections of any
        still moving them then are shut down (those requests fail as a lost
        connection), and this returns once they let go. The GIL is released
        while it waits.
        """
        if region.id not in self._ids:
            return False
        try:
            return bool(self._port.revoke(region.id, self.grace))
        finally:
            self._ids.discard(region.id)

    def check(self, region_id: int, token: int, epoch: int, offset: int, length: int,
              access: str) -> tuple[str, str] | None:
        """What the table would answer a request (None: admitted), moving nothing."""
        return self._port.check(region_id, token, epoch, offset, length, access)  # type: ignore[no-any-return]

    def run(self, fd: int, peer: str = "") -> tuple[int, str]:
        """Serve the connection ``fd`` (authenticated as node ``peer``) until it ends; the GIL is
        released meanwhile. Its notifications carry ``peer`` as their sender."""
        return self._port.run(fd, peer)  # type: ignore[no-any-return]

    def poll_stats(self) -> dict[str, int]:
        """Busy-poll counters over every connection: ``polls`` run, those that ``found`` the next
        request, those ``preempted`` (each starts a pause), requests waited for by blocking because
        of a pause (``paused``)."""
        return dict(self._port.poll_stats())

    def published(self) -> int:
        return int(self._port.published())

    def close(self) -> None:
        """Stop serving: every connection being served is shut down."""
        self._port.close()


def open_port(transport: Any) -> NativePort | None:
    """The native port for ``transport`` where it applies and loads, else None (the Python server serves)."""
    ctx = transport.ctx
    if not ctx.options.get("native_server", True) or ctx.mode == "copy" or transport.tls_server is not None:
        return None
    if os.environ.get(ENV, "1") == "0":
        return None
    module = load()
    if module is None:
        return None
    return NativePort(module, ctx)
