"""Peers: control links, per-peer connection set-up, epochs, and control dispatch.

Connecting and handshaking happen per peer, never under an engine-wide lock:
one unresponsive peer delays only the requests addressed to it. Concurrent
first requests to the same peer share one connection attempt (single-flight).
Requests posted while their peer is not connected yet wait in that peer's
queue and are posted by the connecting thread once the handshake is done (or
failed with its error), so ``write()`` never waits on a peer.

Connects to a peer that is down are rate-limited per address
(:class:`~mpcomm.health.ConnectBackoff`, ``[health] connect_backoff_ms``):
after a failed attempt (refused, reset or timed out: a retryable error),
requests that would start a new one within the back-off window fail at once
with a retryable PeerConnectionError that says why the last attempt failed
and when the next is allowed, instead of dialling again. The window doubles
per consecutive failure up to ``connect_backoff_max_ms``; a successful connect
clears it. Callers already waiting on an attempt in flight share its outcome,
as before. A live link that is lost opens no window: the next request dials
at once (the peer may have restarted).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from ..config import Config
from ..control import PeerLink
from ..errors import EngineClosedError, MpcommError, PeerConnectionError
from ..health import ConnectBackoff
from ..peer import PeerInfo

__all__ = ["PeerTable"]

log = logging.getLogger("mpcomm.engine")


class _Attempt:
    """One connection attempt to one address, shared by everyone who needs it."""

    __slots__ = ("done", "link", "error", "waiters", "deadline")

    def __init__(self, deadline: float) -> None:
        self.done = threading.Event()
        self.link: PeerLink | None = None
        self.error: BaseException | None = None
        self.waiters: list[Callable[[PeerLink | None, BaseException | None], None]] = []
        self.deadline = deadline


class PeerTable:
    def __init__(self, *, config: Config, local_info: Callable[[], PeerInfo], secret: str, handshake_timeout: float,
                 on_lost: Callable[[PeerLink], None], on_epoch_change: Callable[[str], None],
                 backoff: ConnectBackoff | None = None) -> None:
        self._config = config
        self._local_info = local_info
        self._secret = secret
        self._handshake_timeout = handshake_timeout
        self._on_lost = on_lost
        self._on_epoch_change = on_epoch_change
        self._links: dict[str, PeerLink] = {}
        self._attempts: dict[str, _Attempt] = {}
        self._epochs: dict[str, str] = {}
        #: The epoch last seen at each address: a restarted process has a new
        #: node_id too, so only the address says it is the same peer again.
        self._addr_epochs: dict[str, str] = {}
        self._lock = threading.Lock()  # guards the three dicts; never held while connecting
        self._closed = False
        #: Per-address connect back-off (off when not given: every request may dial).
        self.backoff = backoff if backoff is not None else ConnectBackoff(0.0, 0.0)

    def ready(self, address: str) -> PeerLink | None:
        """The live link to ``address``, or None (no waiting)."""
        link = self._links.get(address)
        if link is not None and link.alive:
            return link
        return None

    def connect(self, address: str, timeout: float) -> PeerLink:
        """The link to ``address``, connecting if needed; waits up to ``timeout``.

        Within the connect back-off window of ``address`` it raises the
        back-off's PeerConnectionError at once, without dialling."""
        link = self.ready(address)
        if link is not None:
            return link
        attempt = self._attempt(address, time.monotonic() + timeout)
        if attempt.done.wait(max(timeout, 0.0)):
            if attempt.link is not None:
                return attempt.link
            assert attempt.error is not None
            raise attempt.error
        raise PeerConnectionError(f"connecting to {address} did not finish within {timeout:.3g}s", peer=address,
                                  retryable=True)

    def when_ready(self, address: str, deadline: float,
                   fn: Callable[[PeerLink | None, BaseException | None], None]) -> None:
        """Call ``fn(link, None)`` or ``fn(None, error)`` once ``address`` is connected or failed.

        Runs ``fn`` on the connecting thread (or at once when already known).
        Raises (and does not call ``fn``) when no attempt may start now: the
        engine is closed, or ``address`` is within its connect back-off window.
        """
        link = self.ready(address)
        if link is not None:
            fn(link, None)
            return
        attempt = self._attempt(address, deadline, fn)
        if attempt is None:  # finished between the checks
            self.when_ready(address, deadline, fn)

    def _attempt(self, address: str, deadline: float,
                 waiter: Callable[[PeerLink | None, BaseException | None], None] | None = None) -> Any:
        with self._lock:
            if self._closed:
                raise EngineClosedError("the engine is closed")
            att = self._attempts.get(address)
            if att is None:
                link = self._links.get(address)
                if link is not None and link.alive:
                    if waiter is not None:
                        return None
                    att = _Attempt(deadline)
                    att.link = link
                    att.done.set()
                    return att
                # Only a caller that would dial checks the back-off: one lock-free
                # look-up while the address has no failure recorded.
                refused = self.backoff.refusal(address)
                if refused is not None:
                    try:
                        raise refused
                    finally:
                        # A caller looping on a dead address raises thousands of
                        # these: no frame <-> traceback cycle left for the GC per call.
                        del refused
                att = self._attempts[address] = _Attempt(deadline)
                start = True
            else:
                start = False
                att.deadline = max(att.deadline, deadline)
            if waiter is not None:
                att.waiters.append(waiter)
        if start:
            threading.Thread(target=self._run_attempt, args=(address, att), name=f"mpcomm-connect-{address}",
                             daemon=True).start()
        return att

    def _run_attempt(self, address: str, att: _Attempt) -> None:
        link: PeerLink | None = None
        error: BaseException | None = None
        timeout = min(self._handshake_timeout, max(att.deadline - time.monotonic(), 0.001))
        try:
            link = PeerLink(address, local_info=self._local_info(), secret=self._secret, timeout=timeout,
                            on_lost=self._on_lost, config=self._config)
        except MpcommError as exc:
            error = exc
        except Exception as exc:  # noqa: BLE001 - whatever happened, the waiters get an error
            error = PeerConnectionError(f"cannot connect to {address}: {exc}", peer=address)
        changed = False
        with self._lock:
            self._attempts.pop(address, None)
            if link is not None:
                if self._closed:
                    error, closing = EngineClosedError("the engine is closed"), link
                    link = None
                else:
                    closing = None
                    old = self._epochs.get(link.info.node_id)
                    changed = old is not None and old != link.info.epoch
                    self._epochs[link.info.node_id] = link.info.epoch
                    prev = self._addr_epochs.get(address)
                    changed = changed or (prev is not None and prev != link.info.epoch)
                    self._addr_epochs[address] = link.info.epoch
                    self._links[address] = link
            else:
                closing = None
            if link is not None:
                self.backoff.succeeded(address)
            elif error is not None and not isinstance(error, EngineClosedError):
                self.backoff.metrics.count("connect_failures", address)
                # Only "the peer is not there" opens a window: a refused or timed-out
                # connect or handshake (retryable). An authentication or protocol
                # error is the configuration's; each caller keeps getting it as is.
                # An attempt cut short by its callers' deadline (shorter than the
                # handshake timeout) says nothing about the peer either.
                short = timeout < self._handshake_timeout and isinstance(error.__cause__, TimeoutError)
                if getattr(error, "retryable", False) and not short:
                    self.backoff.failed(address, error)
            att.link, att.error = link, error
            waiters, att.waiters = att.waiters, []
        if closing is not None:
            closing.close()
        if changed:
            self._on_epoch_change(address)
        att.done.set()
        for fn in waiters:
            try:
                fn(link, error)
            except Exception:  # noqa: BLE001
                log.exception("a request waiting for %s failed to continue", address)

    def links(self) -> list[PeerLink]:
        with self._lock:
            return list(self._links.values())

    def close(self) -> None:
        with self._lock:
            self._closed = True
            links = list(self._links.values())
            self._links.clear()
        for link in links:
            link.close()
