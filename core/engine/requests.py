"""The request pipeline: prepare → lease → slot → route → post → report → settle.

One request is an :class:`~mpcomm.transport.Operation`; a vectorised batch is
one :class:`~mpcomm.transport.OperationGroup` (one lease, one slot, one
deadline, one ``post_many``), whatever its size. Both are "units" below and
take the same path:

1. **prepare** (caller's thread): every argument checked, bounds vectorised for
   groups; errors raised before anything is held.
2. **lease + slot**: the local region is leased and one of
   ``runtime.queue_depth`` slots taken (back-pressure: wait up to the deadline,
   or raise at once with ``runtime.backpressure = "raise"``).
3. **link**: a connected peer is used at once; otherwise the unit waits in
   that peer's queue and the connecting thread posts it (``write()`` returns
   at once either way).
4. **route + post**: the transport is chosen (cached per peer, region and
   memory kind) and handed the unit; it never waits on the peer there.
5. **report** (any thread): the transport says done/failed; the engine
   releases the slot, the lease and the deadline entry — only then is the
   outcome recorded on the handle, so when a callback runs nothing is held.
6. **settle**: on the posting thread if the unit finished inside ``post`` (no
   hop), else on the completion thread or the caller's completion queue.

**One request path.** Every single request (``write``/``read``) goes
through :meth:`Pipeline.single`: the engine's state, the route hint, the
local region, access, bounds and the timeout are checked there, by the one
rule of :mod:`.checks`, whatever happens next. A plain request (no
notification, hint, completion queue or ephemeral buffer; no telemetry, split
or size rule, no lazy registration) then looks up its pair's *binding*
(:mod:`.bound`): a cache of the routing decisions the full path made for that
(local region, remote region, kind) -- link, transport, candidates, rule,
route names and, where the transport offers it, its bound inline ``move``
(:meth:`~mpcomm.transport.Transport.inline_path`). A binding is made from the
route cache once the peer is linked and the pair's route cached (a pair's first
request already lands inline when its route is cached; otherwise its second
request binds it, after the first one's full routing cached the route). With one, the request is either moved by that ``move`` on this
thread (lease, move, release: a handle born COMPLETED, no slot, deadline or
table), or becomes one Operation handed to its transport with the cached
routing (steps 2 and 5-6 above, without the route decision). Whatever the
binding does not cover (a dead link, a failing path, no free slot, a closing
region, a declined move) and every request without one takes the full
routing (steps 2-6), which raises what it raises. The native form of the
inline step is ``_fastlane.c`` (:func:`.bound.native_step`): ``Engine.write``
and ``read`` try it before this path, and fall into it when it declines.

A unit is *claimed* exactly once by whoever moves it on from a waiting stage
(the poster, a canceller, the deadline, close), so a cancel racing a post
can neither double-post nor lose a request.

The pipeline's rooms, one module each (:class:`Pipeline` is their sum; each
room is a mixin whose state lives on the Pipeline):

* :mod:`.units` — what the engine keeps on a unit (stage, slot, batch, ...), the slots;
* :mod:`.admission` — arguments checked, a unit made, its lease and slot taken;
* :mod:`.planning` — many requests checked and grouped once (submit, prepare, write_many);
* :mod:`.bound` — the binding cache: a pair's routing decisions, kept for its later requests;
* :mod:`.posting` — link, route, admit on a healthy path, hand to the transport;
* :mod:`.retries` — failover to the next transport, a busy transport's backlog;
* :mod:`.stripes` — a request split over several transports;
* :mod:`.timeouts` — deadlines, aborts and their grace;
* :mod:`.notifying` — notifications sent after the data;
* :mod:`.endings` — reports, release, the outcome recorded and delivered;
* :mod:`.cancelling` — cancel, a lost peer, close.
"""

from __future__ import annotations

import threading
from collections import deque
from concurrent.futures import Executor
from typing import TYPE_CHECKING, Any

from ..errors import EngineClosedError, MpcommError
from ..memory import Region
from ..remote import RemoteRegion
from ..transfer import Dispatch, Transfer
from ..transport import Transport
from . import checks
from .admission import Admission
from .bound import BoundPairs
from .cancelling import Cancelling
from .endings import Endings
from .notify import MAX_NOTIFY
from .notifying import Notifying
from .planning import Planning, PreparedBatch
from .posting import Posting
from .retries import Retries
from .stripes import Stripes
from .timeouts import Timeouts
from .units import Slots

if TYPE_CHECKING:
    from . import Engine
    from .completions import CompletionThread
    from .deadlines import DeadlineTimer
    from .peers import PeerTable
    from .regions import RegionTable

__all__ = ["Pipeline", "PreparedBatch"]


class Pipeline(Admission, Planning, BoundPairs, Posting, Retries, Stripes, Timeouts, Notifying, Endings, Cancelling):
    """Every request of one engine goes through here (see the module docstring)."""

    def __init__(self, engine: Engine, *, peers: PeerTable, transports: dict[str, Transport], regions: RegionTable,
                 timer: DeadlineTimer, completions: CompletionThread, executor: Executor, notifier: Executor) -> None:
        self.e = engine
        #: Set by ``Engine.close`` together with its own flag: read first by single() and by the C step.
        self.closed = False
        #: The engine's parts the rooms use, handed over here (the engine keeps them private).
        self.peers, self.transports, self.regions = peers, transports, regions
        self.timer, self.executor, self.notifier = timer, executor, notifier
        cfg = engine.config
        self.slots = Slots(cfg.runtime.queue_depth)
        self._raise_on_full = cfg.runtime.backpressure == "raise"
        self.default_timeout = cfg.request_timeout
        self._grace = cfg.runtime.abort_grace_ms / 1000
        self._lazy = cfg.memory.registration == "lazy"
        # The units that outlived post() (for close() and peer loss). No lock: add, discard and
        # list() of a set of objects with identity hashing are each one C call, which no other
        # thread interleaves (the GIL; a free-threaded build locks the set itself).
        self._inflight: set[Any] = set()
        self._routes: dict[tuple[Any, ...], tuple[tuple[Transport, ...], str, tuple[str, ...]]] = {}
        self._backlog: dict[str, deque[Any]] = {}
        self._backlog_lock = threading.Lock()
        # Notifications waiting per peer, and how many notify workers each peer holds: a
        # stopped peer ties up at most _notify_per_peer of them (each waits out its
        # request's deadline), so notifications to every other peer keep flowing.
        self._notify_lanes: dict[str, list[Any]] = {}
        self._notify_lock = threading.Lock()
        self._notify_per_peer = max(1, cfg.runtime.worker_threads // 4)
        self.dispatch = Dispatch(completions.push, completions.on_thread, self.cancel)
        #: The binding cache (bound.Binding per (id(local), id(remote), kind)), and the C form of
        #: each binding's inline step (bound.native_step), which Engine.write/read try first.
        self.bindings: dict[tuple[int, int, str], Any] = {}
        self.native: dict[tuple[int, int, str], Any] = {}
        #: Whether a pair may be bound at all (set by policy_ready: no lazy registration,
        #: telemetry, split or size rule).
        self._inline_ok = False
        self._failing = engine.health.any_failures  # read per bound request

    def single(self, kind: str, buf: Any, remote: RemoteRegion, ro: int, length: int | None, lo: int,
               notify: bytes | None, timeout: float | None, cq: Any, route: Any = None) -> Transfer:
        """The one request path: every request checked here, then its pair's binding or the full routing."""
        if self.closed:
            raise EngineClosedError("the engine is closed")
        hint = None if route is None else self._hint(route)
        local, ephemeral = (buf, False) if isinstance(buf, Region) and not buf.closed else self._local(buf, "ephemeral")
        self._check_access(kind, local, remote)
        n = checks.span(lo, ro, length, local.size, remote.size)
        length = n if n is not None else checks.check_span(local.name, local.size, remote.name, remote.size,
                                                           remote.address, lo, ro, length)
        if notify is not None and len(notify) > MAX_NOTIFY:
            raise MpcommError(f"notification of {len(notify)} bytes exceeds {MAX_NOTIFY}")
        timeout = self.default_timeout if timeout is None else checks.timeout_seconds(timeout, self.default_timeout)
        if notify is None and hint is None and cq is None and self._inline_ok and not ephemeral:
            done = self._cached(kind, local, remote, lo, ro, length, timeout)
            if done is not None:
                return done
        op = self.new_op(kind, local, lo, remote, ro, length, timeout, self._dispatch_for(cq))
        op.ephemeral = ephemeral
        op.notify_after = notify
        op.route_hint = hint
        self._hold(op)
        self._launch(op, inline=True)
        return op.transfer
