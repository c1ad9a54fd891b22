"""The engine: one per process (or more), owning regions, peers and transports.

Threads an engine runs, all blocked while idle (no CPU without traffic): the
control listener and one thread per control connection, one deadline timer,
``runtime.worker_threads`` pool workers (started on demand), and whatever its
transports start.

Back-pressure: at most ``runtime.queue_depth`` requests are in flight per
engine. Beyond that, ``write``/``read``/``submit`` block until a slot frees
or the request's deadline passes (then :class:`~mpcomm.BackPressureError`),
or raise BackPressureError at once with ``runtime.backpressure = "raise"``.
Memory used per request is bounded; nothing queues without limit.
"""

from __future__ import annotations

import logging
import queue
import secrets
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import CancelledError, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from .config import Config, load_config
from .control import ControlServer, PeerLink
from .deadlines import DeadlineTimer
from .errors import (
    AccessError,
    BackPressureError,
    ConfigError,
    EngineClosedError,
    MpcommError,
    OutOfBoundsError,
    PeerConnectionError,
    PermissionDeniedError,
    RegionClosedError,
    RegionError,
    StaleRegionError,
    TransferTimeout,
    TransportUnavailable,
    UnknownRegionError,
)
from .memory import Region, allocate_host, as_byte_view
from .metadata import MetadataStore, NodeRecord, PeerToPeerMetadata, RegionRecord, open_metadata  # issue 10
from .peer import PeerInfo, format_endpoint, host_identity, is_wildcard, parse_endpoint, same_host
from .registry import PluginSet, load_plugins
from .remote import RemoteRegion
from .routing import RoutePolicy, RouteQuery  # issue 10
from .telemetry import Telemetry
from .topology import discover as discover_topology, numa_node_of  # issue 10
from .transfer import Batch, Operation, Request, Transfer, timeout_error
from .transport import Availability, Transport, TransportContext

__all__ = ["Engine", "Notification", "TransportStatus"]

log = logging.getLogger("mpcomm.engine")

MAX_NOTIFY = 64 << 10


@dataclass(frozen=True)
class Notification:
    """A message a peer attached to a request; delivered after the data landed."""

    peer: str  # the sender's node id
    region: str  # the target region the data went to ("" for bare notifications)
    data: bytes


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


class RegionTable:
    """Local regions by name and id; serves peers' accesses (target side)."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self._by_name: dict[str, Region] = {}
        self._by_id: dict[int, Region] = {}
        self._lock = threading.Lock()

    def add(self, region: Region) -> None:
        with self._lock:
            if region.name in self._by_name:
                raise RegionError(f"a region named {region.name!r} is already registered", region=region.name)
            self._by_name[region.name] = region
            self._by_id[region.id] = region

    def remove(self, region: Region) -> None:
        with self._lock:
            self._by_name.pop(region.name, None)
            self._by_id.pop(region.id, None)

    def by_name(self, name: str) -> Region:
        with self._lock:
            region = self._by_name.get(name)
        if region is None:
            raise UnknownRegionError(f"no region named {name!r} is registered here", region=name)
        return region

    def all(self) -> list[Region]:
        with self._lock:
            return list(self._by_name.values())

    def serve(self, region_id: int, token: int, epoch: str | None, offset: int, length: int, access: str) -> Region:
        """Check a peer's access and lease the region; the caller must ``release()`` it.

        Raises the AccessError subclass that says why nothing may be touched.
        """
        if epoch is not None and epoch != self._engine.epoch:
            raise StaleRegionError("descriptor is from an earlier epoch of this node; open the region again")
        with self._lock:
            region = self._by_id.get(region_id)
        if region is None:
            raise UnknownRegionError(f"no region with id {region_id} is registered here")
        if token != region.token:
            raise PermissionDeniedError(f"wrong token for region {region.name!r}", region=region.name)
        if access not in region.access:
            verb = "written" if access == "w" else "read"
            raise PermissionDeniedError(f"region {region.name!r} may not be {verb} by peers", region=region.name)
        if offset < 0 or length < 0 or offset + length > region.size:
            raise OutOfBoundsError(
                f"[{offset}, {offset + length}) is outside region {region.name!r} of {region.size} bytes",
                region=region.name,
            )
        try:
            region.acquire()
        except RegionClosedError as exc:
            raise UnknownRegionError(str(exc), region=region.name) from exc
        return region


class Engine:
    """A node of mpcomm: registers local memory and moves bytes to and from peers.

    ``Engine()`` runs on the embedded default: a control endpoint on a free
    loopback port, peer-to-peer region look-up, every available transport in
    the configured order. Use it as a context manager or call :meth:`close`.

    Args:
        config: a :class:`Config`, a TOML path, a dict, or None.
        endpoint: overrides ``transport.endpoint``.
        transports: exactly these transports, most preferred first (overrides
            ``transport.name`` and ``transport.order``).
        secret: overrides ``transport.secret`` (else ``MPCOMM_SECRET``).
        plugins: extra plugin objects (modules with hookimpls) to load.
        autoload: load entry-point plugins (default: unless
            ``MPCOMM_DISABLE_PLUGIN_AUTOLOAD`` is set).
        metadata: overrides ``cluster.metadata``: ``"etcd://host:2379"`` or
            a :class:`~mpcomm.metadata.MetadataStore` (issue 10).
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
        import os

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
        self.topology = discover_topology()  # issue 10: sent in the handshake
        self._metadata: MetadataStore = PeerToPeerMetadata()  # issue 10
        self._closed = False
        self._lock = threading.Lock()
        self._regions = RegionTable(self)
        self._links: dict[str, PeerLink] = {}
        self._link_lock = threading.Lock()
        self._known_epochs: dict[str, str] = {}
        self._inflight: set[Operation] = set()
        self._slots = _Slots(cfg.runtime.queue_depth)
        self._timer = DeadlineTimer()
        self._executor = ThreadPoolExecutor(cfg.runtime.worker_threads, thread_name_prefix="mpcomm-worker")
        self._notifications: queue.Queue[Notification] = queue.Queue()
        self._notify_callbacks: list[Callable[[Notification], None]] = []
        self._route_cache: dict[tuple[Any, ...], Transport] = {}
        self.telemetry = Telemetry(cfg)

        bind_host, port = parse_endpoint(cfg.transport.endpoint)
        self._bind_host = bind_host
        self._advertise_host = cfg.transport.advertise or (
            _default_advertise(bind_host) if is_wildcard(bind_host) else bind_host
        )
        self.plugin_set: PluginSet = load_plugins(plugins, autoload=autoload)
        self._transports: dict[str, Transport] = {}
        self._unavailable: dict[str, str] = {}
        self._server = ControlServer(
            bind_host,
            port,
            local_info=self.info,
            secret=cfg.transport.secret,
            handshake_timeout=cfg.transport.handshake_timeout_ms / 1000,
            handler=self._handle_control,
        )
        try:
            self._start_transports()
            self._start_routing_and_metadata(metadata)  # issue 10
        except BaseException:
            self.close()
            raise

    # -- issue 10: route policy and cluster metadata (integration points) ----------

    def _start_routing_and_metadata(self, metadata: str | MetadataStore | None) -> None:
        installed = {n: e.cls.capabilities for n, e in self.plugin_set.transports.items()}
        self.route_policy = RoutePolicy.for_config(self.config, installed, self._transports,
                                                   exact_order=self._exact_order)
        self._metadata = open_metadata(metadata if metadata is not None else self.config.cluster.metadata,
                                       ttl=self.config.cluster.lease_ttl_s)
        self._metadata.start(NodeRecord(node_id=self.node_id, address=self.address, epoch=self.epoch,
                                        hostname=self.host.get("hostname", ""), transports=tuple(self._transports),
                                        published_at=time.time()))

    @property
    def metadata(self) -> MetadataStore:
        """Where this engine publishes its regions (peer-to-peer unless configured)."""
        return self._metadata

    def _region_record(self, region: Region) -> RegionRecord:
        # No token, id or base address: finding a region must not grant access to it.
        node = numa_node_of(region.address) if region.kind == "host" else None
        return RegionRecord(name=region.name, node_id=self.node_id, address=self.address, epoch=self.epoch,
                            size=region.size, access=region.access, kind=region.kind, published_at=time.time(),
                            numa_node=-1 if node is None else node)

    # -- identity ----------------------------------------------------------

    @property
    def address(self) -> str:
        """The control endpoint peers dial (``host:port``)."""
        return format_endpoint(self._advertise_host, self._server.port)

    def info(self) -> PeerInfo:
        return PeerInfo(
            node_id=self.node_id,
            epoch=self.epoch,
            address=self.address,
            host=self.host,
            transports={name: t._mpcomm_info for name, t in self._transports.items()},  # type: ignore[attr-defined]
            topology=self.topology,  # issue 10
        )

    def __repr__(self) -> str:
        return f"<Engine {self.address} node={self.node_id} transports={list(self._transports)}>"

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- transports -----------------------------------------------------------

    def _transport_order(self) -> list[str]:
        if self._exact_order is not None:
            return self._exact_order
        t = self.config.transport
        if t.name != "auto":
            return [t.name]
        order = list(t.order)
        order += sorted(n for n in self.plugin_set.transports if n not in order)
        return order

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
            options = self.config.plugin_options(name, dict(entry.cls.default_options))
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
            )
            try:
                inst = entry.cls(ctx)
                inst._mpcomm_info = inst.start() or {}  # type: ignore[attr-defined]
            except ConfigError:
                raise
            except Exception as exc:  # noqa: BLE001 - a transport that cannot start is skipped, with its reason
                log.warning("transport %s failed to start: %s", name, exc)
                self._unavailable[name] = f"failed to start: {type(exc).__name__}: {exc}"
                continue
            self._transports[name] = inst
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
            out.append(TransportStatus(name, entry.plugin, entry.distribution, entry.version, avail,
                                       entry.cls.capabilities.to_dict(), running))
        return out

    # -- memory -----------------------------------------------------------------

    def register(self, buffer: Any, name: str | None = None, *, access: str | None = None) -> Region:
        """Register a buffer (any PEP 688 buffer) so peers can reach it.

        Read-only buffers register as sources only (``access="r"``). The
        buffer must stay alive and unmoved until :meth:`unregister`.
        Raises AlignmentError when it violates ``memory.alignment``.
        """
        self._check_open()
        view = as_byte_view(buffer)
        region = Region(view, name=name or "", access=access or ("r" if view.readonly else "rw"), owner=buffer)
        return self._add_region(region)

    def allocate(self, size: int, name: str | None = None, *, access: str = "rw") -> Region:
        """Allocate and register ``size`` bytes aligned to ``memory.alignment``.

        Transports may back it with what suits them (shared memory for shm);
        otherwise it is pre-faulted anonymous memory.
        """
        self._check_open()
        if size <= 0:
            raise RegionError(f"size must be positive, not {size}")
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
        self._regions.add(region)
        if self.config.memory.registration == "eager":
            try:
                self._register_with_transports(region)
            except BaseException:
                self._regions.remove(region)
                raise
        self.telemetry.on_register(1)
        self._metadata.publish_region(self._region_record(region))  # issue 10
        return region

    def _register_with_transports(self, region: Region) -> None:
        for name, t in self._transports.items():
            if name in region.transport_info:
                continue
            info = t.register(region)
            if info is not None:
                region.transport_info[name] = info

    def unregister(self, region: Region, timeout: float | None = None) -> None:
        """Unregister ``region``; refused (RegionBusyError) while a transfer holds it.

        With ``timeout`` it waits up to that many seconds for the leases to end.
        """
        region.close(timeout)
        self._regions.remove(region)
        self._metadata.unpublish_region(region.name)  # issue 10
        for name, t in self._transports.items():
            if name in region.transport_info:
                try:
                    t.unregister(region)
                except Exception:  # noqa: BLE001
                    log.exception("transport %s failed to unregister %s", name, region.name)
        region.transport_info.clear()
        _release_view(region)
        self.telemetry.on_register(-1)

    def regions(self) -> list[Region]:
        return self._regions.all()

    # -- peers --------------------------------------------------------------------

    def _peer(self, address: str, timeout: float | None = None) -> PeerLink:
        self._check_open()
        with self._link_lock:
            link = self._links.get(address)
            if link is not None and link.alive:
                return link
            link = PeerLink(
                address,
                local_info=self.info(),
                secret=self.config.transport.secret,
                timeout=min(timeout or 1e9, self.config.transport.handshake_timeout_ms / 1000),
                on_lost=self._on_link_lost,
            )
            old_epoch = self._known_epochs.get(link.info.node_id)
            self._links[address] = link
            self._known_epochs[link.info.node_id] = link.info.epoch
        if old_epoch is not None and old_epoch != link.info.epoch:
            self._forget_routes(address)
        return link

    def _on_link_lost(self, link: PeerLink) -> None:
        err = PeerConnectionError(f"peer {link.address} is gone", peer=link.address)
        with self._lock:
            ops = [op for op in self._inflight if op.remote.address == link.address]
        for op in ops:
            op.abort(err)
        self._forget_routes(link.address)
        for t in self._transports.values():
            try:
                t.peer_changed(link.info)
            except Exception:  # noqa: BLE001
                log.exception("transport %s failed to forget %s", t.name, link.address)

    def _forget_routes(self, address: str) -> None:
        with self._lock:
            for key in [k for k in self._route_cache if k[0] == address]:
                del self._route_cache[key]

    def open(self, address: str, name: str | None = None, timeout: float | None = None) -> RemoteRegion:
        """Look up the region ``name`` on the peer at ``address`` (through the peer itself).

        ``open(name)`` (issue 10) finds the owner in the cluster metadata
        (``cluster.metadata``) and then asks the owner, through its handshake,
        exactly as ``open(owner_address, name)`` does.
        """
        timeout = self.config.request_timeout if timeout is None else timeout
        if name is None:
            name, address = address, self._find_owner(address)
        link = self._peer(address, timeout)
        reply = link.request({"t": "lookup", "name": name}, timeout)
        desc = dict(reply["region"])
        desc["address"] = address
        return RemoteRegion.from_dict(desc)

    def _find_owner(self, name: str) -> str:
        """issue 10: the owner's address of region ``name`` from the cluster metadata."""
        if isinstance(self._metadata, PeerToPeerMetadata):
            raise UnknownRegionError(
                f"open({name!r}) without an address needs cluster metadata (cluster.metadata = \"etcd://...\"); "
                "with peer-to-peer look-up give the owner's address: open(address, name)", region=name)
        records = self._metadata.lookup(name)
        if not records:
            raise UnknownRegionError(f"no region named {name!r} is published in {self._metadata.url}", region=name)
        owners = sorted({r.address for r in records})
        if len(owners) > 1:
            raise UnknownRegionError(f"region name {name!r} is published by {len(owners)} nodes ({', '.join(owners)}); "
                                     "open it with the owner's address", region=name)
        return owners[0]

    def _transport_request(self, peer: PeerInfo, transport: str, body: dict[str, Any], timeout: float) -> dict[str, Any]:
        link = self._peer(peer.address, timeout)
        return link.request({"t": "transport", "name": transport, "body": body}, timeout)["body"]

    def _handle_control(self, peer: PeerInfo, msg: dict[str, Any]) -> dict[str, Any]:
        kind = msg.get("t")
        if kind == "lookup":
            region = self._regions.by_name(str(msg.get("name")))
            if self.config.memory.registration == "lazy":
                self._register_with_transports(region)
            return {"t": "region", "region": self._describe(region)}
        if kind == "notify":
            try:
                data = bytes.fromhex(str(msg.get("data", "")))
            except ValueError:
                raise AccessError("notification payload is not hex") from None
            self._deliver(Notification(peer.node_id, str(msg.get("region", "")), data))
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
            transports=dict(region.transport_info),
        ).to_dict()

    def describe(self, region: Region) -> RemoteRegion:
        """The descriptor peers get for ``region`` (to hand out of band)."""
        if self.config.memory.registration == "lazy":
            self._register_with_transports(region)
        return RemoteRegion.from_dict(self._describe(region))

    # -- notifications ----------------------------------------------------------

    def _deliver(self, note: Notification) -> None:
        for cb in list(self._notify_callbacks):
            try:
                cb(note)
            except Exception:  # noqa: BLE001
                log.exception("notification callback failed")
        self._notifications.put(note)

    def on_notification(self, callback: Callable[[Notification], None]) -> None:
        """Call ``callback(note)`` on the control thread for each notification received."""
        self._notify_callbacks.append(callback)

    def wait_notification(self, timeout: float | None = None) -> Notification:
        """Next notification received; raises TimeoutError after ``timeout`` seconds."""
        try:
            return self._notifications.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(f"no notification within {timeout}s") from None

    def notify(self, remote: RemoteRegion, data: bytes, timeout: float | None = None) -> None:
        """Send a bare notification about ``remote`` to its owner."""
        self._send_notify(remote, data, self.config.request_timeout if timeout is None else timeout)

    def _send_notify(self, remote: RemoteRegion, data: bytes, timeout: float) -> None:
        if len(data) > MAX_NOTIFY:
            raise MpcommError(f"notification of {len(data)} bytes exceeds {MAX_NOTIFY}")
        link = self._peer(remote.address, timeout)
        link.request({"t": "notify", "region": remote.name, "data": bytes(data).hex()}, max(timeout, 0.001))

    # -- transfers ---------------------------------------------------------------

    def write(self, src: Any, remote: RemoteRegion, remote_offset: int = 0, length: int | None = None, *,
              local_offset: int = 0, notify: bytes | None = None, timeout: float | None = None) -> Transfer:
        """Write ``length`` bytes of ``src`` (a Region or any buffer) into ``remote``.

        Returns at once with a :class:`Transfer` (small requests may already be
        done). Bad arguments raise before anything moves.
        """
        return self._submit_one(Request("write", src, remote, remote_offset, length, local_offset, notify, timeout))

    def read(self, dst: Any, remote: RemoteRegion, remote_offset: int = 0, length: int | None = None, *,
             local_offset: int = 0, notify: bytes | None = None, timeout: float | None = None) -> Transfer:
        """Read ``length`` bytes of ``remote`` into ``dst`` (a Region or a writable buffer)."""
        return self._submit_one(Request("read", dst, remote, remote_offset, length, local_offset, notify, timeout))

    def submit(self, requests: Sequence[Request], timeout: float | None = None, *, post: bool = True) -> Batch:
        """Submit many requests in one call; every request is validated before any is posted.

        From here until each handle is done, its local region is leased. With
        ``post=False`` the handles stay PENDING (cancel() always succeeds on
        them) until :meth:`post` is called: the staging step of a
        prepare-then-submit caller.
        """
        prepared = [self._prepare(r, timeout) for r in requests]
        for i, (op, _t) in enumerate(prepared):
            try:
                self._hold(op)
            except BaseException as exc:
                for earlier, _ in prepared[:i]:
                    self._abandon(earlier, exc)
                raise
        batch = Batch([t for _, t in prepared])
        batch._ops = [op for op, _ in prepared]  # type: ignore[attr-defined]
        if post:
            self.post(batch)
        return batch

    def post(self, batch: Batch) -> Batch:
        """Post the members of a ``submit(..., post=False)`` batch that were not cancelled."""
        ops: list[Operation] = getattr(batch, "_ops", [])
        for i, op in enumerate(ops):
            if op.transfer.done():
                continue
            try:
                self._launch(op)
            except BaseException as exc:
                for later in ops[i:]:
                    self._abandon(later, exc)
                raise
        return batch

    def _submit_one(self, request: Request) -> Transfer:
        op, transfer = self._prepare(request, None)
        self._hold(op)
        try:
            self._launch(op)
        except BaseException as exc:
            self._abandon(op, exc)
            raise
        return transfer

    def _hold(self, op: Operation) -> None:
        """Lease the local region until the handle is done (released by its finalizer)."""
        op.local.acquire()
        op.transfer._add_finalizer(op.local.release)
        if op._ephemeral:  # type: ignore[attr-defined]
            op.transfer._add_finalizer(lambda: self._drop_ephemeral(op.local))

    def _drop_ephemeral(self, region: Region) -> None:
        for name, t in self._transports.items():
            if name in region.transport_info:
                try:
                    t.unregister(region)
                except Exception:  # noqa: BLE001
                    log.exception("transport %s failed to unregister an ephemeral buffer", name)
        region.transport_info.clear()
        _release_view(region)

    def _prepare(self, req: Request, batch_timeout: float | None) -> tuple[Operation, Transfer]:
        self._check_open()
        if req.op not in ("write", "read"):
            raise MpcommError(f"request op must be 'write' or 'read', not {req.op!r}", request=req)
        remote = req.remote
        if not isinstance(remote, RemoteRegion):
            raise MpcommError(f"remote must be a RemoteRegion (from Engine.open), not {type(remote).__name__}", request=req)
        ephemeral = not isinstance(req.local, Region)
        if ephemeral:
            view = as_byte_view(req.local)
            local = Region(view, name=f"ephemeral-{id(req)}", access="r" if view.readonly else "rw", owner=req.local)
        else:
            local = req.local
            if local.closed:
                raise RegionClosedError(f"region {local.name!r} is unregistered", region=local.name, request=req)
        lo, ro = req.local_offset, req.remote_offset
        if lo < 0 or ro < 0:
            raise OutOfBoundsError("offsets must not be negative", request=req)
        length = req.length if req.length is not None else min(local.size - lo, remote.size - ro)
        if length < 0:
            raise OutOfBoundsError("length must not be negative", request=req)
        if lo + length > local.size:
            raise OutOfBoundsError(f"local [{lo}, {lo + length}) exceeds {local.name!r} of {local.size} bytes",
                                   region=local.name, request=req)
        if ro + length > remote.size:
            raise OutOfBoundsError(f"remote [{ro}, {ro + length}) exceeds {remote.name!r} of {remote.size} bytes",
                                   region=remote.name, peer=remote.address, request=req)
        if req.op == "write" and not remote.writable:
            raise PermissionDeniedError(f"remote region {remote.name!r} is read-only", region=remote.name, request=req)
        if req.op == "read" and "w" not in local.access:
            raise PermissionDeniedError(f"local buffer {local.name!r} is read-only; it cannot receive a read",
                                        region=local.name, request=req)
        if req.op == "read" and not remote.readable:
            raise PermissionDeniedError(f"remote region {remote.name!r} may not be read", region=remote.name, request=req)
        if req.notify is not None and len(req.notify) > MAX_NOTIFY:
            raise MpcommError(f"notification of {len(req.notify)} bytes exceeds {MAX_NOTIFY}", request=req)
        timeout = req.timeout if req.timeout is not None else batch_timeout
        timeout = self.config.request_timeout if timeout is None else timeout
        if timeout <= 0:
            raise MpcommError(f"timeout must be positive, not {timeout}", request=req)
        transfer = Transfer(req)
        op = Operation(
            kind=req.op, local=local, local_offset=lo, remote=remote, remote_offset=ro, length=length,
            deadline=time.monotonic() + timeout, deadline_wall=time.time() + timeout, transfer=transfer,
        )
        op.state = None
        op._ephemeral = ephemeral  # type: ignore[attr-defined]
        op._notify = req.notify  # type: ignore[attr-defined]
        return op, transfer

    def _abandon(self, op: Operation, exc: BaseException) -> None:
        """Finish a handle that never got posted (its leases go with it)."""
        if op.transfer.done():
            return
        if op.transfer.set_running_or_notify_cancel():
            op.transfer._fail(exc if isinstance(exc, MpcommError) else MpcommError(str(exc)))

    def _acquire_slot(self, op: Operation) -> None:
        if self.config.runtime.backpressure == "raise":
            ok = self._slots.acquire(blocking=False)
        else:
            ok = self._slots.acquire(timeout=max(0.0, op.time_left()))
        if not ok:
            raise BackPressureError(
                f"{self.config.runtime.queue_depth} requests already in flight (runtime.queue_depth)",
                request=op.transfer.request,
            )

    def _route(self, link: PeerLink, op: Operation) -> Transport:
        # issue 10: the route policy orders the candidates; the first that
        # reaches the peer carries the request (failover is the lead's retry loop).
        remote = op.remote
        query = RouteQuery(
            same_host=same_host(self.host, link.info.host, need=("net_ns",)),
            local_kind=op.local.kind, remote_kind=remote.kind, size=op.length,
            peer_transports=frozenset(n for n in remote.transports if n in link.info.transports),
        )
        try:
            route = self.route_policy.choose(query)
        except TransportUnavailable as exc:
            raise TransportUnavailable(f"no transport reaches {remote.address} for {remote.name!r}: {exc}",
                                       peer=remote.address, region=remote.name) from None
        op.transfer.route, op.transfer.route_rule = route.transports, route.rule
        key = (remote.address, remote.name, op.local.kind, route.transports)
        with self._lock:
            cached = self._route_cache.get(key)
        if cached is not None:
            return cached
        reasons = []
        for name in route.transports:
            t = self._transports[name]
            avail = t.reach(link.info)
            if not avail:
                reasons.append(f"{name}: {avail.reason}")
                continue
            with self._lock:
                self._route_cache[key] = t
            return t
        raise TransportUnavailable(f"no transport reaches {remote.address} for {remote.name!r} "
                                   f"(route {route.rule!r}): " + "; ".join(reasons),
                                   peer=remote.address, region=remote.name)

    def _launch(self, op: Operation) -> None:
        """Connect, route, lease, post. Errors before posting are raised to the caller."""
        transfer = op.transfer
        remote = op.remote
        link = self._peer(remote.address, op.time_left())
        if link.info.epoch != remote.epoch:
            raise StaleRegionError(
                f"{remote.address} restarted since {remote.name!r} was opened; open it again",
                region=remote.name, peer=remote.address, request=transfer.request,
            )
        op.peer = link.info
        transport = self._route(link, op)
        # A buffer passed for one request, like lazy registration, is registered
        # with the transport that carries it only.
        lazy = self.config.memory.registration == "lazy" or op._ephemeral  # type: ignore[attr-defined]
        if lazy and transport.name not in op.local.transport_info:
            info = transport.register(op.local)
            if info is not None:
                op.local.transport_info[transport.name] = info
        if transfer.done():  # cancelled while we connected
            return
        self._acquire_slot(op)
        transfer._add_finalizer(self._slots.release)
        op.transport = transport
        with self._lock:
            self._inflight.add(op)
        op._on_finish.append(self._on_op_finish)
        notify = op._notify  # type: ignore[attr-defined]
        if notify is not None:
            op.before_complete = lambda: self._send_notify(remote, notify, max(op.time_left(), 0.001))
        transfer._canceller = lambda timeout: self._cancel_posted(op, timeout)
        if not transfer._mark_posted(transport.name):
            with self._lock:
                self._inflight.discard(op)
            transfer._run_finalizers()  # cancelled meanwhile: finalizers added since then
            return
        if self.telemetry.enabled:
            self.telemetry.on_post(op, transport.name)
        if transport.post_may_block:
            self._arm_deadline(op)
        try:
            transport.post(op)
        except MpcommError as exc:
            op.fail(exc)
        except Exception as exc:  # noqa: BLE001 - a plugin bug fails the request, not the caller
            log.exception("transport %s failed to post", transport.name)
            op.fail(MpcommError(f"transport {transport.name} failed: {exc}"))
        if not transport.post_may_block and not op.done:
            self._arm_deadline(op)

    def _arm_deadline(self, op: Operation) -> None:
        op.deadline_entry = self._timer.schedule(op.deadline, lambda: self._on_deadline(op))  # type: ignore[attr-defined]

    def _on_op_finish(self, op: Operation, error: BaseException | None) -> None:
        with self._lock:
            self._inflight.discard(op)
        entry = getattr(op, "deadline_entry", None)
        if entry is not None:
            self._timer.cancel(entry)
        if self.telemetry.enabled and op.transport is not None:
            self.telemetry.on_finish(op, op.transport.name, error)

    def _on_deadline(self, op: Operation) -> None:
        if op.done:
            return
        op.abort(timeout_error(op))
        grace = self.config.runtime.abort_grace_ms / 1000
        self._timer.schedule(time.monotonic() + grace, lambda: self._on_abort_overdue(op))

    def _on_abort_overdue(self, op: Operation) -> None:
        if op.done:
            return
        name = op.transport.name if op.transport else "?"
        log.error("transport %s did not stop a timed-out %s within runtime.abort_grace_ms; failing it", name, op.kind)
        err = TransferTimeout(
            f"{op.kind} to {op.remote.address} timed out and transport {name} did not confirm that it stopped; "
            "bytes may still land in the destination range",
            region=op.remote.name, peer=op.remote.address,
        )
        err.confirmed = False
        if op._finish(err):
            op.transfer._fail(err)

    def _cancel_posted(self, op: Operation, timeout: float | None) -> bool:
        if op.transport is None or not op.transport.capabilities.inflight_cancel:
            return False
        op.abort(CancelledError())
        wait = timeout if timeout is not None else max(op.time_left(), 0) + self.config.runtime.abort_grace_ms / 1000
        try:
            op.transfer.exception(wait)
        except CancelledError:
            return True
        except TimeoutError:
            return False
        except Exception:  # noqa: BLE001
            return False
        return op.transfer.cancelled()

    # -- lifecycle ----------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise EngineClosedError("the engine is closed")

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self, timeout: float = 5.0) -> None:
        """Abort what is in flight, release every region and transport, stop serving.

        Releases its resources even if a graceful step fails.
        """
        if self._closed:
            return
        self._closed = True
        with self._lock:
            ops = list(self._inflight)
        for op in ops:
            op.abort(EngineClosedError("the engine was closed while the request was in flight"))
        deadline = time.monotonic() + timeout
        for op in ops:
            try:
                op.transfer.exception(max(0.0, deadline - time.monotonic()))
            except BaseException:  # noqa: BLE001
                pass
        try:
            self._metadata.close()  # issue 10: withdraw what this node published
        except Exception:  # noqa: BLE001
            log.exception("metadata close failed")
        server = getattr(self, "_server", None)
        if server is not None:
            server.close()
        with self._link_lock:
            links = list(self._links.values())
            self._links.clear()
        for link in links:
            link.close()
        for region in self._regions.all():
            try:
                self.unregister(region, timeout=0.0)
            except MpcommError:
                pass
        for t in reversed(list(self._transports.values())):
            try:
                t.close()
            except Exception:  # noqa: BLE001
                log.exception("transport %s failed to close", t.name)
        self._timer.close()
        self._executor.shutdown(wait=False, cancel_futures=True)


class _Slots:
    """A counting semaphore for ``runtime.queue_depth`` whose uncontended path is
    one C-level lock (``threading.BoundedSemaphore`` is a Python Condition)."""

    def __init__(self, n: int) -> None:
        self._free = n
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._waiting = 0

    def acquire(self, blocking: bool = True, timeout: float | None = None) -> bool:
        with self._lock:
            if self._free:
                self._free -= 1
                return True
            if not blocking:
                return False
            deadline = None if timeout is None else time.monotonic() + timeout
            self._waiting += 1
            try:
                while not self._free:
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        return False
                    self._cond.wait(left)
                self._free -= 1
                return True
            finally:
                self._waiting -= 1

    def release(self) -> None:
        with self._lock:
            self._free += 1
            if self._waiting:
                self._cond.notify()


def _release_view(region: Region) -> None:
    """Give the caller's buffer back (a bytearray can resize, an mmap can close).

    After the transports' unregister, which may still read the view.
    """
    try:
        region.view.release()
    except BufferError:
        pass  # something still exports from it; the reference drops with the region


def _default_advertise(bind_host: str) -> str:
    import socket

    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "::1" if ":" in bind_host else "127.0.0.1"
