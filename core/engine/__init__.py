"""The engine: one per process (or more), owning regions, peers and transports.

This module is the public facade and its wiring; each job has its own room:

* :mod:`.regions` — the region table, leases, registration and revocation;
* :mod:`.peers` — control links, per-peer connection set-up (single-flight), epochs;
* :mod:`.requests` — the request pipeline (prepare → lease → slot → route → post →
  report → settle), cancellation and close; its own rooms are :mod:`.units`,
  :mod:`.admission`, :mod:`.planning`, :mod:`.bound`, :mod:`.posting`, :mod:`.retries`,
  :mod:`.stripes`, :mod:`.timeouts`, :mod:`.notifying`, :mod:`.endings` and :mod:`.cancelling`;
* :mod:`.completions` — the completion thread and user-polled completion queues;
* :mod:`.deadlines` — the one timer thread for every deadline;
* :mod:`.notify` — the bounded notification queue.

Threads an engine runs, all blocked while idle (no CPU without traffic): the
control listener and one thread per control connection, one deadline timer,
one completion thread (user callbacks run there), ``runtime.worker_threads``
pool workers (started on demand), a short-lived thread per peer being
connected, and whatever its transports start.

Back-pressure: at most ``runtime.queue_depth`` requests (a vectorised batch
counts as one, staged ones included) are held by an engine. Beyond that,
``write``/``read``/``submit`` wait until a slot frees or the request's
deadline passes (then :class:`~mpcomm.BackPressureError`), or raise
BackPressureError at once with ``runtime.backpressure = "raise"``. Nothing
queues without limit: notifications are bounded by ``limits.max_queued_notifications``\nand ``limits.max_queued_notify_bytes`` (when full the sender is refused).
"""

from __future__ import annotations

import logging
import os
import secrets
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from ..calibration import route_classes
from ..config import Config, load_config
from ..control import ControlServer, PeerLink
from ..errors import (
    AccessError,
    ConfigError,
    EngineClosedError,
    MpcommError,
    PeerConnectionError,
    RegionError,
    TransportUnavailable,
    UnknownRegionError,
)
from ..health import ConnectBackoff, HealthTracker
from .. import native_helper
from ..memory import Region, allocate_host, region_of
from ..metadata import MetadataStore, NodeRecord, PeerToPeerMetadata, RegionRecord, open_metadata
from ..peer import PeerInfo, format_endpoint, host_identity, is_wildcard, parse_endpoint
from ..registry import PluginSet, load_plugins
from ..remote import RemoteRegion
from ..routing import RoutePolicy
from ..telemetry import Telemetry
from ..topology import discover as discover_topology
from ..transfer import Batch, Request, Transfer
from ..transport import Availability, Transport, TransportContext, effective_capabilities
from . import fastlane
from .completions import CompletionQueue, CompletionThread
from .deadlines import DeadlineTimer
from .notify import MAX_NOTIFY, Notification, Notifications
from .peers import PeerTable
from .regions import RegionTable, release_view
from .requests import Pipeline, PreparedBatch

__all__ = ["CompletionQueue", "Engine", "MAX_NOTIFY", "Notification", "PreparedBatch", "TransportStatus"]

log = logging.getLogger("mpcomm.engine")


@dataclass(frozen=True)
class TransportStatus:
    """What ``Engine.transport_status()`` and ``mpcomm plugins`` report per transport."""

    name: str
    plugin: str
    distribution: str
    version: str
    availability: Availability
    capabilities: dict[str, Any]
    running: bool


class Engine:
    """A node of mpcomm: registers local memory and moves bytes to and from peers.

    ``Engine()`` runs on the embedded default: a control endpoint on a free
    loopback port, peer-to-peer region look-up, every available transport in
    the configured order. Use it as a context manager or call :meth:`close`.
    Every method may be called from any thread.

    Transports are chosen per request by the route policy (``[[route]]`` rules
    in the config, else an order derived from the transports' capabilities);
    a request that fails with a retryable error is retried on the next
    transport of its route within its deadline, and paths that keep failing
    cool down (see :mod:`mpcomm.health`).

    Args:
        config: a :class:`Config`, a TOML path, a dict, or None.
        endpoint: overrides ``transport.endpoint``.
        transports: exactly these transports, most preferred first (overrides
            ``transport.name`` and ``transport.order``).
        secret: overrides ``transport.secret`` (else ``MPCOMM_SECRET``).
        plugins: extra plugin objects (modules with hookimpls) to load.
        autoload: load entry-point plugins (default: unless
            ``MPCOMM_DISABLE_PLUGIN_AUTOLOAD`` is set).
        metadata: overrides ``cluster.metadata``: ``"etcd://host:2379"`` or a
            :class:`~mpcomm.metadata.MetadataStore`; default peer-to-peer.
    """

    def __init__(
        self,
        config: Config | str | dict[str, Any] | None = None,
        *,
        endpoint: str | None = None,
        transports: Sequence[str] | None = None,
        secret: str | None = None,
        plugins: Iterable[Any] = (),
        autoload: bool | None = None,
        metadata: str | MetadataStore | None = None,
    ) -> None:
        native_helper.warn_missing_once()  # once per process: which compiled helpers the install lacks, and the cost
        cfg = load_config(config)
        overrides: dict[str, Any] = {}
        if endpoint is not None:
            overrides["endpoint"] = endpoint
        self._exact_order = list(transports) if transports is not None else None
        if secret is not None:
            overrides["secret"] = secret
        elif not cfg.transport.secret and os.environ.get("MPCOMM_SECRET"):
            overrides["secret"] = os.environ["MPCOMM_SECRET"]
        if overrides:
            cfg = cfg.with_overrides(transport=overrides)
        self.config = cfg
        self.node_id = uuid.uuid4().hex[:16]
        self.epoch = secrets.token_hex(8)
        self.host = host_identity()
        #: This node's hardware, sent to peers in the handshake.
        self.topology = discover_topology()
        #: Per-path cool-down and per-peer quarantine (policy from ``[health]``);
        #: ``.metrics`` counts retries, failovers, quarantines and failed connects.
        self.health = HealthTracker(cfg.health_policy())
        self._metadata: MetadataStore = PeerToPeerMetadata()
        self._closed = False
        self._transports: dict[str, Transport] = {}
        self._transport_info: dict[str, dict[str, Any]] = {}
        self._unavailable: dict[str, str] = {}
        self._regions = RegionTable(self.epoch)
        self._timer = DeadlineTimer()
        self._completions = CompletionThread()
        self._executor = ThreadPoolExecutor(cfg.runtime.worker_threads, thread_name_prefix="mpcomm-worker")
        # Notifications after the data wait for the target's answer: on their own threads, so
        # a stopped peer's notifications never hold the workers transports copy with.
        self._notifier = ThreadPoolExecutor(cfg.runtime.worker_threads, thread_name_prefix="mpcomm-notify")
        lim = cfg.limits
        self._notifications = Notifications(lim.max_queued_notifications, lim.max_queued_notify_bytes,
                                            lim.notify_rate, lim.max_notify_senders)
        self.telemetry = Telemetry(cfg)
        self.telemetry.watch_health(self.node_id, self._health_snapshot)
        self._peers = PeerTable(
            config=cfg,
            local_info=self.info,
            secret=cfg.transport.secret,
            handshake_timeout=cfg.transport.handshake_timeout_ms / 1000,
            on_lost=self._on_link_lost,
            on_epoch_change=self._on_epoch_change,
            backoff=ConnectBackoff.from_ms(cfg.health.connect_backoff_ms, cfg.health.connect_backoff_max_ms,
                                           metrics=self.health.metrics),
        )
        self._pipeline = Pipeline(self, peers=self._peers, transports=self._transports, regions=self._regions,
                                  timer=self._timer, completions=self._completions, executor=self._executor,
                                  notifier=self._notifier)
        #: The bound pairs' C inline steps (bound.native_step) by (id(local), id(remote), kind), which
        #: write()/read() try first.
        self._steps = self._pipeline.native

        bind_host, port = parse_endpoint(cfg.transport.endpoint)
        self._bind_host = bind_host
        self._advertise_host = cfg.transport.advertise or (
            _default_advertise(bind_host) if is_wildcard(bind_host) else bind_host
        )
        self.plugin_set: PluginSet = load_plugins(plugins, autoload=autoload)
        cfg.check_plugin_sections(self.plugin_set.transports)
        try:
            self._start_transports()
            self._adopt_notification_queue()
            # Listen only once the transports run: a peer that connects while we
            # start (a restarted node) must not learn a transport list that is
            # still empty — its link would keep that list for good.
            self._server = ControlServer(
                bind_host,
                port,
                local_info=self.info,
                secret=cfg.transport.secret,
                handshake_timeout=cfg.transport.handshake_timeout_ms / 1000,
                handler=self._handle_control,
                config=cfg,
            )
            # Running transports: declared kinds less those this machine lacks (a GPU, a CUDA
            # library). The others only need to be named (probing them would load their libraries).
            installed = {n: effective_capabilities(e.cls)[0] if n in self._transports else e.cls.capabilities
                         for n, e in self.plugin_set.transports.items()}
            #: Per running transport, the declared memory kinds it cannot move here, and why.
            self.memory_kinds_unavailable: dict[str, dict[str, str]] = {
                n: m for n in self._transports if (m := effective_capabilities(type(self._transports[n]))[1])}
            # Only reads this node's calibration file (`mpcomm topology --calibrate` measures).
            measured = route_classes(cfg, self.plugin_set.transports, self._transports)
            self.route_policy = RoutePolicy.for_config(cfg, installed, self._transports,
                                                       exact_order=self._exact_order, measured=measured)
            self._pipeline.policy_ready()
            self._metadata = open_metadata(metadata if metadata is not None else cfg.cluster.metadata,
                                           ttl=cfg.cluster.lease_ttl_s, secret=cfg.transport.secret)
            self._metadata.start(NodeRecord(node_id=self.node_id, address=self.address, epoch=self.epoch,
                                            hostname=str(self.host.get("hostname", "")),
                                            transports=tuple(self._transports), published_at=time.time()))
        except BaseException:
            self.close()
            raise

    # -- identity ----------------------------------------------------------------------

    @property
    def address(self) -> str:
        """The control endpoint peers dial (``host:port``)."""
        return format_endpoint(self._advertise_host, self._server.port)

    def info(self) -> PeerInfo:
        """What peers learn about this engine in the handshake."""
        return PeerInfo(
            node_id=self.node_id,
            epoch=self.epoch,
            address=self.address,
            host=self.host,
            transports={name: self._transport_info[name] for name in self._transports},
            topology=self.topology,
        )

    def __repr__(self) -> str:
        return f"<Engine {self.address} node={self.node_id} transports={list(self._transports)}>"

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- transports ----------------------------------------------------------------------

    def _transport_order(self) -> list[str]:
        if self._exact_order is not None:
            return self._exact_order
        t = self.config.transport
        if t.name != "auto":
            return [t.name]
        order = list(t.order)
        return order + sorted(n for n in self.plugin_set.transports if n not in order)

    def _start_transports(self) -> None:
        t = self.config.transport
        for name in self._transport_order():
            entry = self.plugin_set.transports.get(name)
            if entry is None:
                self._unavailable[name] = "no plugin provides it"
                continue
            try:
                avail = entry.cls.availability()
            except Exception as exc:  # noqa: BLE001
                avail = Availability.no(f"availability check failed: {exc}")
            if not avail:
                self._unavailable[name] = avail.reason
                continue
            if t.mode not in entry.cls.capabilities.modes:
                self._unavailable[name] = f"does not support mode {t.mode!r}"
                continue
            options = self.config.plugin_options(name, dict(entry.cls.default_options),
                                                 getattr(entry.cls, "option_ranges", None))
            ctx = TransportContext(
                config=self.config,
                options=options,
                mode=t.mode,
                node_id=self.node_id,
                epoch=self.epoch,
                host=self.host,
                bind_host=self._bind_host,
                advertise_host=self._advertise_host,
                executor=self._executor,
                regions=self._regions,
                control=self._transport_request,
                log=logging.getLogger(f"mpcomm.transport.{name}"),
                notifications=self._notifications,
            )
            try:
                inst = entry.cls(ctx)
                started = inst.start() or {}
            except ConfigError:
                raise
            except Exception as exc:  # noqa: BLE001 - a transport that cannot start is skipped, with its reason
                log.warning("transport %s failed to start: %s", name, exc)
                self._unavailable[name] = f"failed to start: {type(exc).__name__}: {exc}"
                continue
            self._transports[name] = inst
            self._transport_info[name] = started  # what start() returned: sent to peers
        if not self._transports:
            reasons = "; ".join(f"{k}: {v}" for k, v in self._unavailable.items()) or "no transport plugins found"
            raise TransportUnavailable(f"no transport could start ({reasons})")

    @property
    def transports(self) -> dict[str, Transport]:
        """Running transports by name, in preference order."""
        return dict(self._transports)

    def transport_status(self) -> list[TransportStatus]:
        """Every transport the plugins provide: running or not, and why."""
        out = []
        for name, entry in sorted(self.plugin_set.transports.items()):
            running = name in self._transports
            if running:
                avail = Availability.yes()
            elif name in self._unavailable:
                avail = Availability.no(self._unavailable[name])
            else:
                try:
                    avail = entry.cls.availability()
                except Exception as exc:  # noqa: BLE001
                    avail = Availability.no(str(exc))
                if avail:
                    avail = Availability.no("not selected by transport.name/order")
            caps, kinds_missing = effective_capabilities(entry.cls)
            caps_dict = caps.to_dict()
            if kinds_missing:
                caps_dict["memory_kinds_unavailable"] = dict(kinds_missing)
            out.append(TransportStatus(name, entry.plugin, entry.distribution, entry.version, avail,
                                       caps_dict, running))
        return out

    # -- memory ----------------------------------------------------------------------------

    def register(self, buffer: Any, name: str | None = None, *, access: str | None = None) -> Region:
        """Register a buffer so peers can reach it.

        ``buffer``: any PEP 688 buffer (host memory); an object exposing
        ``__dlpack__`` or ``__cuda_array_interface__`` (a torch or CuPy
        tensor: host or CUDA memory, by its DLPack device); or a
        :class:`~mpcomm.memory_kinds.DeviceBuffer` (raw device pointer, size,
        device). The region's ``location`` says which (docs/contract.md,
        "Device memory").
        Read-only buffers register as sources only (``access="r"``). The
        buffer must stay alive and unmoved until :meth:`unregister`; mpcomm
        holds a reference to it meanwhile.
        Raises AlignmentError when it violates ``memory.alignment``,
        RegionError when the name is taken or the object is not memory
        mpcomm understands.
        """
        self._check_open()
        region = region_of(buffer, name=name or "", access=access)
        return self._add_region(region)

    def allocate(self, size: int, name: str | None = None, *, access: str = "rw") -> Region:
        """Allocate and register ``size`` bytes aligned to ``memory.alignment``.

        Transports may back it with what suits them (shared memory for shm);
        otherwise it is pre-faulted anonymous memory. A size this node cannot
        hold is a RegionError before anything is allocated.
        """
        self._check_open()
        if not isinstance(size, int) or size <= 0:
            raise RegionError(f"size must be a positive number of bytes, not {size!r}")
        from .. import memory

        check = getattr(memory, "check_allocatable", None)
        if check is not None:
            check(size)
        alignment = max(self.config.memory.alignment, 64)
        got: tuple[memoryview, Any] | None = None
        for t in self._transports.values():
            got = t.allocate(size, alignment)
            if got is not None:
                break
        view, backing = got if got is not None else allocate_host(size, alignment)
        region = Region(view, name=name or "", access=access, owner=backing, engine_allocated=True, backing=backing)
        return self._add_region(region)

    def _add_region(self, region: Region) -> Region:
        if not region.name:
            region.name = f"region-{region.id}"
        region.check_alignment(self.config.memory.alignment)
        region.published = True
        if self.config.memory.registration == "eager":
            # Registered with every transport *before* a peer can look it up by
            # name: a look-up racing the registration would hand out a
            # descriptor missing some transports (seen with a restarted target).
            if region.name in {r.name for r in self._regions.all()}:
                raise RegionError(f"a region named {region.name!r} is already registered", region=region.name)
            try:
                self._regions.register_with(region, self._transports)
                self._regions.add(region)
            except BaseException:
                RegionTable.unregister_from(region, self._transports)
                raise
        else:
            self._regions.add(region)
        self.telemetry.on_register(1)
        self._metadata.publish_region(self._region_record(region))
        return region

    def _region_record(self, region: Region) -> RegionRecord:
        # No token, id or base address: finding a region must not grant access to it.
        node = region.numa_node
        return RegionRecord(name=region.name, node_id=self.node_id, address=self.address, epoch=self.epoch,
                            size=region.size, access=region.access, kind=region.kind, published_at=time.time(),
                            numa_node=-1 if node is None else node, device=region.device)

    @property
    def metadata(self) -> MetadataStore:
        """Where this engine publishes its regions (peer-to-peer unless configured)."""
        return self._metadata

    def unregister(self, region: Region, timeout: float | None = None) -> None:
        """Unregister ``region``; refused (RegionBusyError) while a transfer holds it.

        With ``timeout`` it waits up to that many seconds for the leases to end;
        while it waits the region grants no new lease (a new request on it fails
        with RegionClosedError), and if the wait times out (RegionBusyError) the
        region is open again, as it was.
        When it returns, no peer can read or write the region through any
        transport (each transport's ``unregister`` guarantees it on return) and
        the caller's buffer is released. A second call is a no-op.
        """
        if region.closed:
            return
        region.close(timeout)
        self._pipeline.forget_fast()  # its bound inline moves hold the region
        if not self._regions.remove(region):
            return
        self._metadata.unpublish_region(region.name)
        failed = RegionTable.unregister_from(region, self._transports)
        self.telemetry.on_register(-1)
        if failed:
            # A transport could not confirm that peers lost access: keep the
            # buffer referenced (it is not handed back) and say so.
            raise RegionError(f"region {region.name!r} is unregistered, but revocation was not confirmed "
                              f"({'; '.join(failed)}); peers may still reach the memory, so the buffer stays "
                              "referenced until the engine closes", region=region.name)
        release_view(region)

    def regions(self) -> list[Region]:
        """The regions registered here."""
        return self._regions.all()

    def describe(self, region: Region) -> RemoteRegion:
        """The descriptor peers get for ``region`` (to hand out of band)."""
        if self.config.memory.registration == "lazy":
            self._regions.register_with(region, self._transports)
        return RemoteRegion.from_dict(self._describe(region))

    def _describe(self, region: Region) -> dict[str, Any]:
        return RemoteRegion(
            address=self.address,
            node_id=self.node_id,
            epoch=self.epoch,
            name=region.name,
            region_id=region.id,
            size=region.size,
            base_address=region.address,
            access=region.access,
            token=region.token,
            kind=region.kind,
            device=region.device,
            transports=dict(region.transport_info),
        ).to_dict()

    # -- peers ------------------------------------------------------------------------------

    def _peer(self, address: str, timeout: float | None = None) -> PeerLink:
        """The control link to ``address``, connecting if needed (blocking, up to ``timeout``)."""
        self._check_open()
        return self._peers.connect(address, self.config.request_timeout if timeout is None else timeout)

    def _on_epoch_change(self, address: str) -> None:
        """The peer at ``address`` restarted: its routes and its failure history
        (cool-downs, quarantine) say nothing about the new process."""
        self._pipeline.forget_routes(address)
        self.health.forget(address)

    def _on_link_lost(self, link: PeerLink) -> None:
        err = PeerConnectionError(f"peer {link.address} is gone", peer=link.address)
        self._pipeline.abort_peer(link.address, err)
        self._pipeline.forget_routes(link.address)
        for t in self._transports.values():
            try:
                t.peer_changed(link.info)
            except Exception:  # noqa: BLE001
                log.exception("transport %s failed to forget %s", t.name, link.address)

    def open(self, address: str, name: str | None = None, timeout: float | None = None) -> RemoteRegion:
        """Look up the region ``name`` on the peer at ``address`` (through the peer itself).

        ``open(name)`` finds the owner in the cluster metadata
        (``cluster.metadata``) and then asks the owner, through its handshake,
        exactly as ``open(owner_address, name)`` does; the node the handshake
        reached must be the one the records name (node id and epoch), else
        AccessError and nothing is opened. Blocks up to ``timeout``
        (default ``runtime.request_timeout_ms``) for the connection, the
        handshake and the look-up together.
        """
        timeout = self.config.request_timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        records: list[RegionRecord] = []
        if name is None:
            name, records = address, self._find_owner(address)
            address = records[0].address
        link = self._peer(address, timeout)
        for r in records:
            # A record names who owns the region; an address is only where it was. A forged
            # or stale address must not send this node's reads and writes to another engine.
            if (r.node_id, r.epoch) != (link.info.node_id, link.info.epoch):
                raise AccessError(
                    f"the metadata record of region {name!r} names node {r.node_id} (epoch {r.epoch}) at "
                    f"{address}, but the node there is {link.info.node_id} (epoch {link.info.epoch}): a stale or "
                    "forged record; refusing to open it", peer=address, region=name)
        reply = link.request({"t": "lookup", "name": name}, max(deadline - time.monotonic(), 0.001))
        region = reply.get("region")
        if not isinstance(region, dict):
            raise AccessError(f"{address} answered the look-up of {name!r} without a region", peer=address)
        desc = dict(region)
        desc["address"] = address
        return RemoteRegion.from_dict(desc)

    def _find_owner(self, name: str) -> list[RegionRecord]:
        """The records of region ``name`` in the cluster metadata, all at one owner address."""
        if isinstance(self._metadata, PeerToPeerMetadata):
            raise UnknownRegionError(
                f"open({name!r}) without an address needs cluster metadata (cluster.metadata = \"etcd://...\"); "
                "with peer-to-peer look-up give the owner's address: open(address, name)", region=name)
        records = self._metadata.lookup(name)
        if not records:
            raise UnknownRegionError(f"no region named {name!r} is published in {self._metadata.url}", region=name)
        owners = sorted({r.address for r in records})
        if len(owners) > 1:
            raise UnknownRegionError(f"region name {name!r} is published by {len(owners)} nodes "
                                     f"({', '.join(owners)}); open it with the owner's address", region=name)
        return records

    def _transport_request(self, peer: PeerInfo, transport: str, body: dict[str, Any], timeout: float) -> dict[str, Any]:
        link = self._peer(peer.address, timeout)
        return link.request({"t": "transport", "name": transport, "body": body}, timeout)["body"]

    def _handle_control(self, peer: PeerInfo, msg: dict[str, Any]) -> dict[str, Any]:
        kind = msg.get("t")
        if kind == "lookup":
            region = self._regions.by_name(str(msg.get("name")))
            if self.config.memory.registration == "lazy":
                self._regions.register_with(region, self._transports)
            return {"t": "region", "region": self._describe(region)}
        if kind == "notify":
            data_hex = msg.get("data", "")
            if not isinstance(data_hex, str) or len(data_hex) > 2 * MAX_NOTIFY:
                raise AccessError(f"notification payload must be hex of at most {MAX_NOTIFY} bytes")
            try:
                data = bytes.fromhex(data_hex)
            except ValueError:
                raise AccessError("notification payload is not hex") from None
            self._notifications.deliver(Notification(peer.node_id, str(msg.get("region", ""))[:256], data))
            return {"t": "ok"}
        if kind == "transport":
            t = self._transports.get(str(msg.get("name")))
            if t is None:
                raise TransportUnavailable(f"transport {msg.get('name')!r} is not running here")
            body = msg.get("body")
            if not isinstance(body, dict):
                raise AccessError("transport message body must be an object")
            return {"t": "transport", "body": t.handle_control(peer, body)}
        if kind == "ping":
            return {"t": "pong", "epoch": self.epoch}
        raise AccessError(f"unknown control request {kind!r}")

    # -- notifications ------------------------------------------------------------------------

    def on_notification(self, callback: Callable[[Notification], None], *, consume: bool = False) -> None:
        """Call ``callback(note)`` for each notification received.

        With ``consume=True`` the callback takes the notification instead of the
        queue :meth:`wait_notification` reads. A notification that came over the
        control channel runs the callbacks on the control thread before its sender
        is answered; one that came over tcp's native data port (docs/tcp.md) is
        answered as soon as it is queued, and its callbacks run afterwards on the
        engine's ``mpcomm-notify-callbacks`` thread, in arrival order (until then it
        counts in ``stats()["notifications_awaiting_callbacks"]`` and against the
        queue's limits).
        """
        self._notifications.subscribe(callback, consume)

    def wait_notification(self, timeout: float | None = None) -> Notification:
        """Next notification received; raises TimeoutError after ``timeout`` seconds.

        At most ``limits.max_queued_notifications`` wait here; beyond that senders are refused.
        Where tcp's native data port runs, this waits on its native queue with the GIL released
        (docs/tcp.md).
        """
        return self._notifications.wait(timeout)

    def notify(self, remote: RemoteRegion, data: bytes, timeout: float | None = None) -> None:
        """Send a bare notification about ``remote`` to its owner (blocks up to ``timeout``)."""
        self._send_notify(remote, data, self.config.request_timeout if timeout is None else timeout)

    def _send_notify(self, remote: RemoteRegion, data: bytes, timeout: float) -> None:
        """Deliver a notification to ``remote``'s owner: on a transport that serves it there without
        the interpreter (tcp's native data port, whatever transport moved the data: it is sent
        only after the request completed), else on the control channel."""
        if len(data) > MAX_NOTIFY:
            raise MpcommError(f"notification of {len(data)} bytes exceeds {MAX_NOTIFY}")
        deadline = time.monotonic() + timeout
        link = self._peer(remote.address, timeout)
        payload = bytes(data)
        for t in list(self._transports.values()):
            if t.notify(link.info, remote, payload, deadline):
                return
        link.request({"t": "notify", "region": remote.name, "data": payload.hex()},
                     max(deadline - time.monotonic(), 0.001))

    def _adopt_notification_queue(self) -> None:
        """The first native notification queue a running transport offers becomes the engine's one
        queue (notify.py): the control channel delivers into it too."""
        for t in self._transports.values():
            notes = t.notification_queue()
            if notes is not None and self._notifications.adopt(notes):
                log.debug("notifications: %s's native queue", t.name)
                return

    # -- transfers ----------------------------------------------------------------------------

    def write(self, src: Any, remote: RemoteRegion, remote_offset: int = 0, length: int | None = None, *,
              local_offset: int = 0, notify: bytes | None = None, timeout: float | None = None,
              completion_queue: CompletionQueue | None = None, route: Sequence[str] | str | None = None) -> Transfer:
        """Write ``length`` bytes of ``src`` (a Region or any buffer) into ``remote``.

        ``length`` defaults to the rest of ``src`` from ``local_offset``; a range
        that does not fit the remote region is OutOfBoundsError. Returns at once
        with a :class:`Transfer` (small requests may already be done): it never
        waits on the peer. Bad arguments raise before anything moves.

        ``route`` (e.g. ``("shm", "tcp")``) is an ordered transport list that
        overrides the ``[[route]]`` rules for this request; failover walks it
        in that order and the handle's ``route_rule`` is ``"hint"``. Naming a
        transport that is not installed raises MpcommError.

        ``notify`` (at most 64 KiB) is delivered to the target after the data
        (docs/contract.md §7). Over tcp it rides on the data's frame: one
        request, one reply, and a refusal (the target's queue full:
        BackPressureError) comes before a byte is written.
        """
        if notify is None and completion_queue is None and route is None:
            run = self._steps.get((id(src), id(remote), "write"))
            landed = None if run is None else run(local_offset, remote_offset, length, timeout)
            if landed is not None:
                return landed
        return self._pipeline.single("write", src, remote, remote_offset, length, local_offset, notify, timeout,
                                     completion_queue, route)

    def read(self, dst: Any, remote: RemoteRegion, remote_offset: int = 0, length: int | None = None, *,
             local_offset: int = 0, notify: bytes | None = None, timeout: float | None = None,
             completion_queue: CompletionQueue | None = None, route: Sequence[str] | str | None = None) -> Transfer:
        """Read ``length`` bytes of ``remote`` into ``dst`` (a Region or a writable buffer); ``route`` as for :meth:`write`."""
        if notify is None and completion_queue is None and route is None:
            run = self._steps.get((id(dst), id(remote), "read"))
            landed = None if run is None else run(local_offset, remote_offset, length, timeout)
            if landed is not None:
                return landed
        return self._pipeline.single("read", dst, remote, remote_offset, length, local_offset, notify, timeout,
                                     completion_queue, route)

    def write_many(self, src: Any, remote: RemoteRegion, local_offsets: Any, remote_offsets: Any = None,
                   lengths: Any = None, *, remote_addresses: Any = None, timeout: float | None = None,
                   completion_queue: CompletionQueue | None = None, post: bool = True,
                   route: Sequence[str] | str | None = None) -> Batch:
        """Write N pieces of ``src`` into ``remote`` in one call: one handle, one posting.

        ``local_offsets``, ``remote_offsets`` (or ``remote_addresses``, raw
        addresses in the target process) and ``lengths`` are sequences or numpy
        integer arrays of equal length. Bounds are checked for all before any
        byte moves. The :class:`Batch` reports per-index status and byte
        counts; the whole group takes one ``queue_depth`` slot. ``route`` as
        for :meth:`write`.
        """
        return self._many("write", src, remote, local_offsets, remote_offsets, lengths, remote_addresses, timeout,
                          completion_queue, post, route)

    def read_many(self, dst: Any, remote: RemoteRegion, local_offsets: Any, remote_offsets: Any = None,
                  lengths: Any = None, *, remote_addresses: Any = None, timeout: float | None = None,
                  completion_queue: CompletionQueue | None = None, post: bool = True,
                  route: Sequence[str] | str | None = None) -> Batch:
        """Read N pieces of ``remote`` into ``dst`` in one call (see :meth:`write_many`)."""
        return self._many("read", dst, remote, local_offsets, remote_offsets, lengths, remote_addresses, timeout,
                          completion_queue, post, route)

    def _many(self, kind: str, buf: Any, remote: RemoteRegion, local_offsets: Any, remote_offsets: Any,
              lengths: Any, remote_addresses: Any, timeout: float | None, cq: Any, post: bool,
              route: Sequence[str] | str | None = None) -> Batch:
        if lengths is None:
            raise MpcommError(f"{kind}_many needs lengths")
        if (remote_offsets is None) == (remote_addresses is None):
            raise MpcommError(f"{kind}_many needs exactly one of remote_offsets and remote_addresses")
        if remote_addresses is not None:
            if not isinstance(remote, RemoteRegion):
                raise MpcommError(f"remote must be a RemoteRegion, not {type(remote).__name__}")
            from ..transport import int64_array

            addrs = int64_array(remote_addresses, None, "remote_addresses")
            base = remote.base_address
            remote_offsets = [a - base for a in addrs]
        return self._pipeline.vector(kind, buf, remote, local_offsets, remote_offsets, lengths, timeout, cq, post,
                                     route)

    def submit(self, requests: Sequence[Request], timeout: float | None = None, *, post: bool = True,
               completion_queue: CompletionQueue | None = None, route: Sequence[str] | str | None = None) -> Batch:
        """Submit many requests in one call; every request is validated before any is posted.

        Requests of the same kind between the same local buffer and remote
        region are moved as one vectorised group (one ``post_many``). From here
        until the batch is done, its local regions are leased. With
        ``post=False`` the batch stays PENDING (cancel() always succeeds on
        it; it holds its slots) until :meth:`post` is called: the staging
        step of a prepare-then-submit caller.

        ``route`` is the hint (see :meth:`write`) for requests whose own
        ``Request.route`` is None.
        """
        return self._pipeline.submit(requests, timeout, completion_queue, post, route)

    def prepare(self, requests: Sequence[Request], timeout: float | None = None) -> PreparedBatch:
        """Check and group ``requests`` once; ``prepared.post()`` then posts them again and again.

        For loops that move the same pieces repeatedly (KV-cache pages, weight
        shards): each posting skips the per-request checks and grouping. The
        requests must be between registered Regions, without ``notify``.
        """
        return self._pipeline.prepare(requests, timeout)

    def prepare_many(self, kind: str, local: Region, remote: RemoteRegion, local_offsets: Any,
                     remote_offsets: Any, lengths: Any, *, timeout: float | None = None) -> PreparedBatch:
        """:meth:`prepare` for one vectorised group given as arrays (see :meth:`write_many`)."""
        return self._pipeline.prepare_many(kind, local, remote, local_offsets, remote_offsets, lengths, timeout)

    # -- one buffer, many peers -------------------------------------------------------------

    @staticmethod
    def _targets(targets: Sequence[RemoteRegion | tuple[RemoteRegion, int]]) -> list[tuple[RemoteRegion, int]]:
        out = [(t, 0) if isinstance(t, RemoteRegion) else (t[0], int(t[1])) for t in targets]
        if not out:
            raise MpcommError("at least one target region is needed")
        return out

    def scatter(self, src: Any, targets: Sequence[RemoteRegion | tuple[RemoteRegion, int]], chunk: int, *,
                local_offset: int = 0, timeout: float | None = None) -> Batch:
        """Chunk ``i`` of ``src`` (from ``local_offset``) to ``targets[i]`` (a region, or ``(region, offset)``).

        One :class:`Batch` over every peer; each peer's part is vectorised.
        """
        reqs = [Request("write", src, r, off, chunk, local_offset + i * chunk)
                for i, (r, off) in enumerate(self._targets(targets))]
        return self.submit(reqs, timeout=timeout)

    def gather(self, dst: Any, sources: Sequence[RemoteRegion | tuple[RemoteRegion, int]], chunk: int, *,
               local_offset: int = 0, timeout: float | None = None) -> Batch:
        """``chunk`` bytes from each source into consecutive chunks of ``dst``; one Batch."""
        reqs = [Request("read", dst, r, off, chunk, local_offset + i * chunk)
                for i, (r, off) in enumerate(self._targets(sources))]
        return self.submit(reqs, timeout=timeout)

    def broadcast(self, src: Any, targets: Sequence[RemoteRegion | tuple[RemoteRegion, int]],
                  length: int | None = None, *, local_offset: int = 0, timeout: float | None = None) -> Batch:
        """The same ``length`` bytes of ``src`` (default: the rest from ``local_offset``) to every target."""
        reqs = [Request("write", src, r, off, length, local_offset) for r, off in self._targets(targets)]
        return self.submit(reqs, timeout=timeout)

    def post(self, batch: Batch) -> Batch:
        """Post a ``submit(..., post=False)`` batch (the parts not cancelled meanwhile)."""
        return self._pipeline.post_staged(batch)

    def completion_queue(self) -> CompletionQueue:
        """A queue to reap finished handles in bulk on your own thread (``q.poll()``)."""
        return CompletionQueue()

    def stats(self) -> dict[str, Any]:
        """Counts worth watching: requests held, queue depth, notifications queued and dropped, peers.

        ``health``: retries, failovers, quarantines, ``connect_failures``
        (connection attempts that failed) and ``connect_backoffs`` (requests
        failed at once by the connect back-off, without dialling) per peer
        (counters), ``connect_backoff`` (addresses held back now:
        ``{address: {"failures": n, "retry_in": s}}``), ``queue_backlog`` (requests waiting for a queue slot or a busy
        transport, now), ``connections`` (live control connections per peer,
        now) and ``failover_paths`` — also exported as OpenTelemetry metrics
        (``mpcomm.peer.*``, ``mpcomm.queue.backlog``) with ``observability.metrics``.
        ``inline_lane``: whether small requests of a bound pair may land through the
        transport's inline move, in the C inline step (``"in use"``), or are posted
        (``"disabled by MPCOMM_FASTLANE=0"``).
        ``notifications_awaiting_callbacks``: notifications queued by tcp's native
        data port whose ``on_notification`` callbacks have not run yet.
        ``notification_senders``: senders whose ``limits.notify_rate`` bucket is
        held now (at most ``limits.max_notify_senders``; idle ones are forgotten).
        """
        return {
            "requests_held": self._pipeline.slots.in_use,
            "inline_lane": "in use" if fastlane.inline_enabled() else "disabled by MPCOMM_FASTLANE=0",
            "queue_depth": self._pipeline.slots.capacity,
            "notifications_queued": len(self._notifications),
            "notifications_awaiting_callbacks": self._notifications.awaiting_callbacks(),
            "notification_senders": self._notifications.senders(),
            "peers": len(self._peers.links()),
            "health": self._health_snapshot(),
        }

    def _health_snapshot(self) -> dict[str, Any]:
        """The health metrics with the gauges (backlog, connections per peer) read now."""
        m = self.health.metrics
        m.set_backlog(self._pipeline.backlog())
        per: dict[str, int] = {}
        for link in self._peers.links():
            if link.alive:
                per[link.address] = per.get(link.address, 0) + 1
        for peer in set(m.snapshot()["connections"]) - set(per):
            m.set_connections(peer, 0)
        for peer, n in per.items():
            m.set_connections(peer, n)
        snap = m.snapshot()
        snap["connect_backoff"] = self._peers.backoff.snapshot()
        return snap

    # -- lifecycle ----------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise EngineClosedError("the engine is closed")

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self, timeout: float = 5.0) -> None:
        """Resolve every handle, release every region and transport, stop serving.

        Requests not posted yet fail with EngineClosedError at once; posted
        ones are aborted and waited for up to ``timeout``, then the transports
        are closed (after which no byte can land) and whatever is left fails
        with EngineClosedError. Leases end only then. Releases its resources
        even if a graceful step fails.
        """
        if self._closed:
            return
        self._closed = True
        pipeline = getattr(self, "_pipeline", None)
        if pipeline is not None:
            pipeline.closed = True
            pipeline.forget_fast()  # write()/read() find no bound pair's C step from now on (it reads no engine state)
        self.telemetry.unwatch_health(self.node_id)
        if pipeline is not None:
            pipeline.close(timeout)
        try:
            self._metadata.close()  # withdraw what this node published
        except Exception:  # noqa: BLE001
            log.exception("metadata close failed")
        server = getattr(self, "_server", None)
        if server is not None:
            server.close()
        self._unregister_all()
        peers = getattr(self, "_peers", None)
        if peers is not None:
            peers.close()
        for t in reversed(list(self._transports.values())):
            try:
                t.close()
            except Exception:  # noqa: BLE001
                log.exception("transport %s failed to close", t.name)
        if pipeline is not None:
            pipeline.resolve_leftovers()
        # Again: what a lease kept registered above is free now (its request ended while the
        # transports closed, or was failed just now), and a region left registered would keep
        # the caller's buffer exported after close().
        self._unregister_all()
        self._timer.close()
        self._completions.stop(timeout)
        self._executor.shutdown(wait=False, cancel_futures=True)
        # Not cancelled: with the links closed each pending notification fails at once with
        # EngineClosedError, so every notified request's handle is resolved before close returns.
        self._notifier.shutdown(wait=True, cancel_futures=False)
        self._notifications.close()


    def _unregister_all(self) -> None:
        for region in self._regions.all():
            try:
                self.unregister(region, timeout=0.0)
            except MpcommError as exc:
                log.warning("closing: %s", exc)


def _default_advertise(bind_host: str) -> str:
    import socket

    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "::1" if ":" in bind_host else "127.0.0.1"
