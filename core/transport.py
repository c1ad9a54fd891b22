"""The transport contract: what a plugin implements and what the engine gives it.

A transport moves bytes between a local :class:`~mpcomm.Region` and a
:class:`~mpcomm.RemoteRegion`. The engine does everything else: handshake and
peer identity, region look-ups, leases, deadlines, back-pressure, notifications
and tracing. A transport class:

* declares ``name`` and ``capabilities`` and answers :meth:`Transport.availability`
  without side effects (a missing native library makes it *unavailable with a
  reason*, never an ImportError: import pyverbs/ucp inside the methods);
* is instantiated once per engine with a :class:`TransportContext`;
* gets :meth:`post` called on the **caller's thread**. It may finish small
  requests right there (no thread hop) or hand work to
  ``ctx.executor``; either way it calls exactly one of ``op.complete()`` /
  ``op.fail()`` per operation;
* on :meth:`abort` stops the operation where it can, and calls ``op.fail()``
  only once no further byte of that operation can land. If it cannot abort
  in-flight work it must not declare ``inflight_cancel``; the engine then waits
  for the natural end, up to the deadline plus ``runtime.abort_grace_ms``;
* maps native errors onto :mod:`mpcomm.errors` (``map_errors``) before they
  reach ``op.fail``;
* releases everything in :meth:`close`, even when a graceful close fails.

The caller of a transport (the engine) guarantees: the local slice and the
remote range were bounds- and access-checked against the descriptor, the
local region is leased until the operation finishes, and ``post`` is never
called after ``close``.
"""

from __future__ import annotations

import logging
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    from .config import Config
    from .memory import Region
    from .peer import PeerInfo
    from .transfer import Operation

__all__ = ["Availability", "Capabilities", "Transport", "TransportContext"]


@dataclass(frozen=True)
class Availability:
    """Whether a transport (or a route to a peer) can be used, and why not."""

    available: bool
    reason: str = ""

    def __bool__(self) -> bool:
        return self.available

    @classmethod
    def yes(cls, reason: str = "") -> Availability:
        return cls(True, reason)

    @classmethod
    def no(cls, reason: str) -> Availability:
        return cls(False, reason)


#: Bandwidth classes a transport may declare, slowest first (route policy, issue 10).
BANDWIDTH_CLASSES = ("low", "medium", "high", "memory")


@dataclass(frozen=True)
class Capabilities:
    """What a transport can do; shown by ``mpcomm plugins`` and used for routing.

    ``bandwidth_class`` (one of :data:`BANDWIDTH_CLASSES`) ranks transports in
    the default route when no ``[[route]]`` rule matches: ``"memory"`` for
    memory-to-memory copies on one host, ``"high"`` for RDMA-class NICs,
    ``"medium"`` for transports that pick the best fabric at run time,
    ``"low"`` (the default) for kernel sockets.
    """

    memory_kinds: frozenset[str] = frozenset({"host"})
    intra_node: bool = True
    inter_node: bool = True
    one_sided: bool = True
    zero_copy: bool = True
    inflight_cancel: bool = False
    modes: frozenset[str] = frozenset({"zero-copy"})
    bandwidth_class: str = "low"

    def to_dict(self) -> dict[str, Any]:
        return {
            "memory_kinds": sorted(self.memory_kinds),
            "intra_node": self.intra_node,
            "inter_node": self.inter_node,
            "one_sided": self.one_sided,
            "zero_copy": self.zero_copy,
            "inflight_cancel": self.inflight_cancel,
            "modes": sorted(self.modes),
            "bandwidth_class": self.bandwidth_class,
        }


@dataclass
class TransportContext:
    """What the engine hands a transport.

    Attributes:
        config: the engine's whole :class:`~mpcomm.Config`.
        options: this transport's ``[plugins.<name>]`` table, defaults applied.
        mode: ``"zero-copy"`` or ``"copy"`` (``transport.mode``).
        node_id, epoch: this engine's identity.
        host: this engine's host identity (see :func:`mpcomm.peer.host_identity`).
        bind_host: the host the control endpoint is bound to; transports that
            listen should listen there too.
        advertise_host: the host peers should dial.
        executor: the engine's worker pool (``runtime.worker_threads``).
        regions: look-up of local regions for serving peers' requests.
        log: a logger named after the transport.
    """

    config: Config
    options: dict[str, Any]
    mode: str
    node_id: str
    epoch: str
    host: dict[str, Any]
    bind_host: str
    advertise_host: str
    executor: Executor
    regions: Any  # RegionTable: .serve(region_id, token, epoch, offset, length, access) -> lease ctx
    control: Any  # callable(peer, transport, body, timeout) -> dict: a request over the control channel
    log: logging.Logger = field(default_factory=lambda: logging.getLogger("mpcomm.transport"))


class Transport:
    """Base class of every transport (see the module docstring for the contract)."""

    #: Entry-point-independent identifier used in config and descriptors.
    name: ClassVar[str] = ""
    capabilities: ClassVar[Capabilities] = Capabilities()
    #: Accepted ``[plugins.<name>]`` keys and their defaults; others are config errors.
    default_options: ClassVar[dict[str, Any]] = {}
    #: True when :meth:`post` may wait on the peer (the network) on the caller's
    #: thread: the engine then arms the request's deadline before posting. A
    #: transport whose post() only runs bounded local work (or waits with the
    #: request's own deadline) sets False, and requests it finishes inline never
    #: touch the deadline timer.
    post_may_block: ClassVar[bool] = True

    def __init__(self, ctx: TransportContext) -> None:
        self.ctx = ctx

    @classmethod
    def availability(cls) -> Availability:
        """Can this transport run on this machine? Must be cheap and side-effect free."""
        return Availability.yes()

    @classmethod
    def version(cls) -> str:
        """Version of the native library behind the transport, if any."""
        return ""

    def start(self) -> dict[str, Any]:
        """Start listening if needed; return JSON-able info peers receive in the handshake."""
        return {}

    def reach(self, peer: PeerInfo) -> Availability:
        """Can this transport talk to ``peer`` (which published ``peer.transports[name]``)?"""
        return Availability.yes()

    def allocate(self, size: int, alignment: int) -> tuple[memoryview, Any] | None:
        """Optionally back ``Engine.allocate`` memory (shared or pinned memory).

        Returns ``(view, backing)`` or None to let the next transport or the
        engine's anonymous mapping serve it.
        """
        return None

    def register(self, region: Region) -> dict[str, Any] | None:
        """Prepare ``region`` for access (pin it, map it, make an rkey).

        Returns JSON-able info that peers receive in the RemoteRegion
        (``transports[name]``), or None when the transport cannot serve it.
        """
        return {}

    def unregister(self, region: Region) -> None:
        """Undo :meth:`register`; called only when the region holds no lease."""

    def post(self, op: Operation) -> None:
        """Start moving ``op``'s bytes; see the module docstring."""
        raise NotImplementedError

    def abort(self, op: Operation) -> None:
        """``op.abort_exc`` is set: stop ``op`` as soon as possible (thread-safe)."""

    def peer_changed(self, peer: PeerInfo) -> None:
        """``peer`` died or restarted: drop connections, mappings and keys for it."""

    def handle_control(self, peer: PeerInfo | None, body: dict[str, Any]) -> dict[str, Any]:
        """Answer a control-channel request a peer's instance of this transport sent."""
        return {}

    def close(self) -> None:
        """Release every resource; must not raise."""
