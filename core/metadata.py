"""Cluster metadata: where nodes and regions are published, and looked up by name.

Two implementations of :class:`MetadataStore`:

* :class:`PeerToPeerMetadata` (the embedded default): publishing is a no-op;
  a region is found by asking the node that owns it (``Engine.open(address,
  name)``), as the control channel always did.
* :class:`EtcdMetadata` (``metadata = "etcd://host:2379"``): the node and its
  region records are written to etcd under one lease per engine, so a dead
  engine's records vanish once the lease's TTL passes, and any engine can find
  a region by name (``Engine.open(name)``). It talks to etcd's HTTP/JSON
  gateway through the ``etcd3gw`` client (OpenStack's, maintained, pure
  Python: no gRPC or protobuf stack in the core; etcd >= 3.4 serves the
  gateway on its client port).

**No secret in etcd.** A published :class:`RegionRecord` holds the name, the
owner's control address, node id, epoch, size, access, memory kind and NUMA node, and
nothing that grants access: no region token, no id, no address in the owner's
process, no transport keys. A reader must still open the region through the
owner's handshake (and shared secret) to get a usable descriptor. Records read
back from etcd are validated like any peer input: anyone able to write to etcd
can put garbage there, and garbage is skipped with a warning.

**Leases and keep-alive.** A background thread refreshes the lease every
``ttl / 3`` seconds. When etcd restarted and lost the lease (or the lease ran
out while etcd was unreachable) the thread grants a new lease and republishes
the node and every live region; deletions that failed are retried the same
way. Publishing while etcd is unreachable does not fail the caller: the record
is kept and written when etcd answers again (a region stays reachable through
its owner meanwhile).

Keys (``prefix`` defaults to ``/mpcomm/v1``)::

    {prefix}/nodes/{node_id}                     -> NodeRecord JSON
    {prefix}/regions/{quoted name}/{node_id}     -> RegionRecord JSON
"""

from __future__ import annotations

import json
import logging
import threading
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from .errors import ConfigError, MpcommError
from .peer import format_endpoint, parse_endpoint

__all__ = [
    "EtcdMetadata",
    "MetadataError",
    "MetadataStore",
    "NodeRecord",
    "PeerToPeerMetadata",
    "RegionRecord",
    "open_metadata",
    "parse_metadata_url",
]

log = logging.getLogger("mpcomm.metadata")

DEFAULT_PREFIX = "/mpcomm/v1"
MAX_RECORD = 16 << 10
MAX_LIST = 10_000
_MAX_STR = 256


class MetadataError(MpcommError):
    """The metadata service failed or returned something unusable."""

    code = "metadata"


# -- records --------------------------------------------------------------------


def _s(d: dict[str, Any], key: str, where: str, *, empty: bool = False) -> str:
    v = d.get(key)
    if not isinstance(v, str) or len(v) > _MAX_STR or (not v and not empty):
        raise MetadataError(f"{where}: {key} must be a {'' if empty else 'non-empty '}string of at most {_MAX_STR} characters")
    return v


def _i(d: dict[str, Any], key: str, where: str, lo: int = 0, hi: int = 1 << 62) -> int:
    v = d.get(key)
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise MetadataError(f"{where}: {key} must be an integer in [{lo}, {hi}]")
    return v


@dataclass(frozen=True)
class NodeRecord:
    """One engine as published: who it is and where to reach it."""

    node_id: str
    address: str
    epoch: str
    hostname: str = ""
    transports: tuple[str, ...] = ()
    published_at: float = 0.0

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"), sort_keys=True)

    @classmethod
    def from_dict(cls, d: Any) -> NodeRecord:
        where = "node record"
        if not isinstance(d, dict):
            raise MetadataError(f"{where} is not an object")
        ts = d.get("transports", [])
        if not isinstance(ts, list) or len(ts) > 64 or not all(isinstance(t, str) and len(t) <= 64 for t in ts):
            raise MetadataError(f"{where}: transports must be a list of at most 64 names")
        pa = d.get("published_at", 0.0)
        return cls(node_id=_s(d, "node_id", where), address=_address(d, where), epoch=_s(d, "epoch", where),
                   hostname=_s(d, "hostname", where, empty=True) if "hostname" in d else "",
                   transports=tuple(ts), published_at=float(pa) if isinstance(pa, (int, float)) else 0.0)


@dataclass(frozen=True)
class RegionRecord:
    """A region as published: enough to find its owner, nothing to access it."""

    name: str
    node_id: str
    address: str
    epoch: str
    size: int
    access: str
    kind: str = "host"
    published_at: float = 0.0
    #: NUMA node of the region's first page on the owner (-1: unknown), for placement.
    numa_node: int = -1

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"), sort_keys=True)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Any) -> RegionRecord:
        where = "region record"
        if not isinstance(d, dict):
            raise MetadataError(f"{where} is not an object")
        access = _s(d, "access", where)
        if access not in ("r", "rw", "w"):
            raise MetadataError(f"{where}: access must be r, w or rw, not {access!r}")
        kind = _s(d, "kind", where) if "kind" in d else "host"
        pa = d.get("published_at", 0.0)
        return cls(name=_s(d, "name", where), node_id=_s(d, "node_id", where), address=_address(d, where),
                   epoch=_s(d, "epoch", where), size=_i(d, "size", where), access=access, kind=kind,
                   published_at=float(pa) if isinstance(pa, (int, float)) else 0.0,
                   numa_node=_i(d, "numa_node", where, -1, 4095) if "numa_node" in d else -1)


def _address(d: dict[str, Any], where: str) -> str:
    a = _s(d, "address", where)
    try:
        parse_endpoint(a)
    except ValueError as exc:
        raise MetadataError(f"{where}: {exc}") from None
    return a


# -- the interface ------------------------------------------------------------------


class MetadataStore:
    """Where an engine publishes itself and its regions (see the module docstring).

    Every method is thread-safe. ``publish_*``/``unpublish_*`` never raise
    because the service is down (they retry in the background); ``lookup``
    and ``list_*`` raise :class:`MetadataError` when it cannot be asked.
    """

    kind = "p2p"
    url = ""

    def start(self, node: NodeRecord) -> None:
        """Publish the node and start keeping its lease alive."""

    def publish_region(self, record: RegionRecord) -> None:
        """Publish (or replace) a region record under the node's lease."""

    def unpublish_region(self, name: str) -> None:
        """Remove this node's record of region ``name``."""

    def lookup(self, name: str) -> list[RegionRecord]:
        """Every live record of region ``name`` across the cluster."""
        return []

    def list_regions(self) -> list[RegionRecord]:
        return []

    def list_nodes(self) -> list[NodeRecord]:
        return []

    def keepalive(self) -> None:
        """One keep-alive round (the background thread calls it)."""

    def close(self) -> None:
        """Stop keeping alive and withdraw everything this node published."""


class PeerToPeerMetadata(MetadataStore):
    """The embedded default: nothing is published; owners answer look-ups."""


# -- etcd -----------------------------------------------------------------------------


def parse_metadata_url(url: str) -> tuple[str, list[tuple[str, int]], str]:
    """``""``/``"p2p"`` → ("p2p", [], ""); ``etcd://h:p[,h2:p2][/prefix]`` → ("etcd", endpoints, prefix).

    Raises ConfigError naming what is wrong.
    """
    url = (url or "").strip()
    if url in ("", "p2p", "none"):
        return "p2p", [], ""
    scheme, sep, rest = url.partition("://")
    if not sep or scheme not in ("etcd", "etcd+http"):
        raise ConfigError(f"metadata {url!r}: expected \"\" (peer-to-peer) or etcd://host:port[,host:port][/prefix]")
    hosts, slash, prefix = rest.partition("/")
    endpoints = []
    for part in hosts.split(","):
        if not part:
            continue
        if ":" not in part.strip("[]") or part.endswith("]"):
            part = format_endpoint(part.strip("[]"), 2379)
        try:
            endpoints.append(parse_endpoint(part))
        except ValueError as exc:
            raise ConfigError(f"metadata {url!r}: {exc}") from None
    if not endpoints:
        raise ConfigError(f"metadata {url!r}: no etcd endpoint given")
    prefix = "/" + prefix.strip("/") if slash and prefix.strip("/") else DEFAULT_PREFIX
    return "etcd", endpoints, prefix


def _quote(name: str) -> str:
    return urllib.parse.quote(name, safe="")


class EtcdMetadata(MetadataStore):
    """Records in etcd under one lease (see the module docstring).

    Args:
        endpoints: ``(host, port)`` of etcd members, tried in order.
        ttl: lease TTL in seconds: how long a killed engine's records outlive it.
        prefix: key prefix (one cluster per prefix).
        timeout: seconds per etcd request.
        clock: ``time.monotonic`` unless a test passes its own.
    """

    kind = "etcd"

    def __init__(self, endpoints: list[tuple[str, int]], *, ttl: int = 10, prefix: str = DEFAULT_PREFIX,
                 timeout: float = 2.0, clock: Callable[[], float] = time.monotonic) -> None:
        try:
            import etcd3gw  # noqa: F401 - imported here: only clusters need it
        except ImportError as exc:
            raise ConfigError("metadata etcd:// needs the etcd3gw package (pip install 'mpcomm[etcd]')") from exc
        if ttl < 2:
            raise ConfigError(f"metadata lease TTL must be at least 2 seconds, not {ttl}")
        self.endpoints = list(endpoints)
        self.url = "etcd://" + ",".join(format_endpoint(h, p) for h, p in endpoints) + prefix
        self.ttl = ttl
        self.prefix = prefix.rstrip("/")
        self.timeout = timeout
        self._clock = clock
        self._lock = threading.RLock()
        self._client: Any = None
        self._client_index = 0
        self._lease: int | None = None
        self._node: NodeRecord | None = None
        self._regions: dict[str, RegionRecord] = {}
        self._dirty = False  # something published/unpublished did not reach etcd yet
        self._tombstones: set[str] = set()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        #: How often the lease was re-created after etcd lost it (for tests and metrics).
        self.lease_renewals = 0

    # -- plumbing -------------------------------------------------------------------

    def _make_client(self) -> Any:
        import etcd3gw

        host, port = self.endpoints[self._client_index % len(self.endpoints)]
        return etcd3gw.Etcd3Client(host=host, port=port, timeout=self.timeout, api_path="/v3/")

    def _call(self, fn: Callable[[Any], Any], what: str) -> Any:
        """Run ``fn(client)``, trying each endpoint once on connection errors."""
        from etcd3gw import exceptions as ex

        last: Exception | None = None
        for _ in range(len(self.endpoints)):
            with self._lock:
                if self._client is None:
                    self._client = self._make_client()
                client = self._client
            try:
                return fn(client)
            except (ex.ConnectionFailedError, ex.ConnectionTimeoutError) as exc:
                last = exc
                with self._lock:
                    self._client = None
                    self._client_index += 1
            except ex.Etcd3Exception as exc:
                raise MetadataError(f"etcd {what} failed: {exc.detail_text or exc}", retryable=True) from exc
            except (ValueError, KeyError, TypeError) as exc:
                raise MetadataError(f"etcd {what}: malformed answer: {exc}") from exc
        raise MetadataError(f"etcd {what}: cannot reach {self.url}: {last}", retryable=True) from last

    def _node_key(self, node_id: str) -> str:
        return f"{self.prefix}/nodes/{node_id}"

    def _region_key(self, name: str, node_id: str) -> str:
        return f"{self.prefix}/regions/{_quote(name)}/{node_id}"

    def _grant(self) -> None:
        lease = self._call(lambda c: c.lease(self.ttl), "lease grant")
        with self._lock:
            self._lease = int(lease.id)

    @staticmethod
    def _bind(lease_id: int, client: Any) -> Any:
        # A Lease object remembers its client; bind the id to the client in use
        # (the endpoint may have changed since the grant).
        from etcd3gw.lease import Lease

        return Lease(lease_id, client)

    def _write_all(self) -> None:
        """(Re)write the node and every region under the current lease."""
        with self._lock:
            node, regions, tombs = self._node, list(self._regions.values()), set(self._tombstones)
            lease = self._lease
        if node is None or lease is None:
            return
        self._call(lambda c: c.put(self._node_key(node.node_id), node.to_json(), self._bind(lease, c)), "put node")
        for r in regions:
            self._call(lambda c, r=r: c.put(self._region_key(r.name, node.node_id), r.to_json(), self._bind(lease, c)),
                       "put region")
        for name in tombs:
            self._call(lambda c, n=name: c.delete(self._region_key(n, node.node_id)), "delete region")
        with self._lock:
            self._tombstones -= tombs

    # -- MetadataStore -----------------------------------------------------------------

    def start(self, node: NodeRecord) -> None:
        with self._lock:
            self._node = node
        try:
            self._grant()
            self._write_all()
        except MetadataError as exc:
            # Fail loudly when etcd is not there at start: a misconfigured
            # cluster address should not look like a working one.
            raise MetadataError(f"cannot publish node {node.node_id} to {self.url}: {exc}") from exc
        self._thread = threading.Thread(target=self._run, name="mpcomm-metadata", daemon=True)
        self._thread.start()

    def publish_region(self, record: RegionRecord) -> None:
        with self._lock:
            self._regions[record.name] = record
            self._tombstones.discard(record.name)
            node, lease = self._node, self._lease
        if node is None or lease is None:
            return
        try:
            self._call(lambda c: c.put(self._region_key(record.name, node.node_id), record.to_json(),
                                       self._bind(lease, c)), "put region")
        except MetadataError as exc:
            log.warning("region %s not published yet (%s); retrying in the background", record.name, exc)
            self._dirty = True

    def unpublish_region(self, name: str) -> None:
        with self._lock:
            self._regions.pop(name, None)
            node = self._node
        if node is None:
            return
        try:
            self._call(lambda c: c.delete(self._region_key(name, node.node_id)), "delete region")
        except MetadataError as exc:
            log.warning("region %s not unpublished yet (%s); retrying in the background", name, exc)
            with self._lock:
                self._tombstones.add(name)
            self._dirty = True

    def _get_prefix(self, key: str) -> list[Any]:
        end = key[:-1] + chr(ord(key[-1]) + 1)  # every key that starts with ``key``
        raw = self._call(lambda c: c.get(key, range_end=end, limit=MAX_LIST), "get")
        out = []
        for value in raw:
            if len(value) > MAX_RECORD:
                log.warning("skipping an etcd record of %d bytes under %s", len(value), key)
                continue
            try:
                out.append(json.loads(value))
            except ValueError:
                log.warning("skipping a record under %s that is not JSON", key)
        return out

    def _records(self, key: str) -> list[RegionRecord]:
        out = []
        for d in self._get_prefix(key):
            try:
                out.append(RegionRecord.from_dict(d))
            except MetadataError as exc:
                log.warning("skipping a malformed region record in etcd: %s", exc)
        return out

    def lookup(self, name: str) -> list[RegionRecord]:
        return [r for r in self._records(f"{self.prefix}/regions/{_quote(name)}/") if r.name == name]

    def list_regions(self) -> list[RegionRecord]:
        return sorted(self._records(f"{self.prefix}/regions/"), key=lambda r: (r.name, r.node_id))

    def list_nodes(self) -> list[NodeRecord]:
        out = []
        for d in self._get_prefix(f"{self.prefix}/nodes/"):
            try:
                out.append(NodeRecord.from_dict(d))
            except MetadataError as exc:
                log.warning("skipping a malformed node record in etcd: %s", exc)
        return sorted(out, key=lambda n: n.node_id)

    def keepalive(self) -> None:
        with self._lock:
            lease, node = self._lease, self._node
        if node is None:
            return  # not started, or closed
        if lease is None:
            self._grant()
            self.lease_renewals += 1
            self._write_all()
            self._dirty = False
            return
        ttl = self._call(lambda c: self._bind(lease, c).refresh(), "lease keep-alive")
        if ttl is None or int(ttl) <= 0:
            log.warning("etcd lost this node's lease (restarted or expired); publishing again")
            self._grant()
            self.lease_renewals += 1
            self._write_all()
            self._dirty = False
        elif self._dirty:
            self._write_all()
            self._dirty = False

    def _run(self) -> None:
        interval = max(self.ttl / 3.0, 0.5)
        while not self._stop.wait(interval):
            try:
                self.keepalive()
            except MetadataError as exc:
                log.warning("metadata keep-alive failed: %s", exc)
            except Exception:  # noqa: BLE001 - the thread must survive a client bug
                log.exception("metadata keep-alive failed")

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(self.timeout * 2 + 1)
        with self._lock:
            lease, self._lease = self._lease, None
            self._node = None  # later publish/unpublish calls are no-ops
        if lease is not None:
            try:
                self._call(lambda c: self._bind(lease, c).revoke(), "lease revoke")
            except MetadataError as exc:
                log.info("could not revoke the metadata lease (%s); records expire after %ss", exc, self.ttl)
        with self._lock:
            client, self._client = self._client, None
        if client is not None:
            try:
                client.session.close()
            except Exception:  # noqa: BLE001
                pass


def open_metadata(url: str | MetadataStore | None, *, ttl: int = 10, timeout: float = 2.0) -> MetadataStore:
    """A store for ``url`` (``""`` → peer-to-peer, ``etcd://...`` → etcd)."""
    if isinstance(url, MetadataStore):
        return url
    kind, endpoints, prefix = parse_metadata_url(url or "")
    if kind == "p2p":
        return PeerToPeerMetadata()
    return EtcdMetadata(endpoints, ttl=ttl, prefix=prefix, timeout=timeout)
