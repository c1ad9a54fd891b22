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
owner's control address, node id, epoch, size, access, memory kind (and device
ordinal: ``kind``/``device``, absent in older records = host) and NUMA node, and
nothing that grants access: no region token, no id, no address in the owner's
process, no transport keys. A reader must still open the region through the
owner's handshake (and shared secret) to get a usable descriptor. Records read
back from etcd are validated like any peer input: anyone able to write to etcd
can put garbage there, and garbage is skipped with a warning naming its key.

**What a reader accepts.** A record is used only when (1) it carries a lease
(every engine writes under one; a key written without a lease is not an
engine's), (2) it parses within :data:`MAX_RECORD` bytes and
:data:`MAX_RECORD_DEPTH` levels (:func:`mpcomm.wire.loads_bounded`, so a deep
record is one skipped key, never a ``RecursionError``), (3) it is a valid
record stored under its own key (a region record of node N under
``regions/{name}/N``), and (4) with a cluster secret (``transport.secret``),
it carries a valid ``mac``: HMAC-SHA256 over the key and the canonical record,
keyed with a key derived from the secret under the label
:data:`RECORD_MAC_LABEL` (the secret itself never reaches etcd). Whatever fails
is skipped with a warning naming its key. ``Engine.open(name)`` then checks
that the node its handshake reached is the record's node id and epoch.

**Listings page.** Every range read asks for :data:`PAGE` keys at a time and
continues after the last key while etcd says there are ``more`` (all pages at
the first page's revision, so the listing is one snapshot). A listing stops
after ``max_list`` keys and says so: ``list_*`` with a warning, ``lookup``
with :class:`MetadataError` (both name the prefix and the limit), never
silently.

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

import base64
import hashlib
import hmac
import json
import logging
import threading
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from .errors import ConfigError, MpcommError, ProtocolError
from .peer import format_endpoint, parse_endpoint
from .wire import loads_bounded

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
#: Deepest nesting a record may have: records are flat (a node's transports list is level 2).
MAX_RECORD_DEPTH = 4
#: Keys asked for per etcd range request; a listing pages on from the last key.
PAGE = 256
#: Most keys one listing reads before it stops (and says so).
MAX_LIST = 100_000
#: Bad records named one by one per listing; the rest are counted in one line.
_NAMED_SKIPS = 10
#: Label under which the record-signing key is derived from the cluster secret.
RECORD_MAC_LABEL = b"mpcomm/metadata-record/1"
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


def _when(d: dict[str, Any], where: str) -> float:
    """``published_at`` (a wall-clock time; 0.0 when absent or not a number)."""
    v = d.get("published_at", 0.0)
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return 0.0
    if not -(2.0 ** 53) <= v <= 2.0 ** 53:  # also NaN; float() of a 400-digit int would overflow
        raise MetadataError(f"{where}: published_at {str(v)[:40]} is not a time")
    return float(v)


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
        return cls(node_id=_s(d, "node_id", where), address=_address(d, where), epoch=_s(d, "epoch", where),
                   hostname=_s(d, "hostname", where, empty=True) if "hostname" in d else "",
                   transports=tuple(ts), published_at=_when(d, where))


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
    #: Device ordinal of device memory (``kind="cuda"``); -1 for host memory.
    device: int = -1

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
        return cls(name=_s(d, "name", where), node_id=_s(d, "node_id", where), address=_address(d, where),
                   epoch=_s(d, "epoch", where), size=_i(d, "size", where), access=access, kind=kind,
                   published_at=_when(d, where),
                   numa_node=_i(d, "numa_node", where, -1, 4095) if "numa_node" in d else -1,
                   device=_i(d, "device", where, -1, 1 << 20) if "device" in d else -1)


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
    and ``list_*`` raise :class:`MetadataError` when it cannot be asked, and
    ``lookup`` also when it could read only part of the keys (``max_list``).
    Records that fail the reader's checks are skipped with a warning, never raised.
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


def record_mac_key(secret: str) -> bytes:
    """The key records are signed with: derived from the cluster secret under its own label, so
    nothing signed here can stand for a proof made with the secret elsewhere, or the reverse."""
    return hmac.new(secret.encode(), RECORD_MAC_LABEL, hashlib.sha256).digest()


def record_mac(mac_key: bytes, key: str, canonical: str) -> str:
    """HMAC-SHA256 over the etcd key and the canonical record: a signed record is valid only
    where its owner wrote it."""
    return hmac.new(mac_key, key.encode() + b"\n" + canonical.encode(), hashlib.sha256).hexdigest()


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _after(prefix: bytes) -> bytes:
    """The first key past every key that starts with ``prefix``."""
    return prefix[:-1] + bytes([prefix[-1] + 1])


class _Skipped:
    """Bad records of one listing: the first few named in a warning each, the rest counted."""

    def __init__(self, where: str) -> None:
        self.where = where
        self.count = 0

    def add(self, key: str, why: str) -> None:
        self.count += 1
        if self.count <= _NAMED_SKIPS:
            log.warning("skipping etcd record %r: %s", key[:512], why)  # %r: a key may hold line breaks

    def done(self) -> None:
        if self.count > _NAMED_SKIPS:
            log.warning("skipped %d more bad etcd records under %s", self.count - _NAMED_SKIPS, self.where)


class EtcdMetadata(MetadataStore):
    """Records in etcd under one lease (see the module docstring).

    Args:
        endpoints: ``(host, port)`` of etcd members, tried in order.
        ttl: lease TTL in seconds: how long a killed engine's records outlive it.
        prefix: key prefix (one cluster per prefix).
        timeout: seconds per etcd request.
        clock: ``time.monotonic`` unless a test passes its own.
        secret: the cluster secret (``transport.secret``): records are signed with a key
            derived from it, and only records signed with it are read back. Empty: records
            are neither signed nor checked.
        max_list: most keys one listing reads (``lookup`` raises past it, ``list_*`` warn).
    """

    kind = "etcd"

    def __init__(self, endpoints: list[tuple[str, int]], *, ttl: int = 10, prefix: str = DEFAULT_PREFIX,
                 timeout: float = 2.0, clock: Callable[[], float] = time.monotonic, secret: str = "",
                 max_list: int = MAX_LIST) -> None:
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
        self.max_list = max_list
        self._clock = clock
        self._mac_key = record_mac_key(secret) if secret else None
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

    def _value(self, key: str, record: NodeRecord | RegionRecord) -> str:
        """What is stored at ``key``: the canonical record, plus its ``mac`` with a secret."""
        if self._mac_key is None:
            return record.to_json()
        d = asdict(record)
        d["mac"] = record_mac(self._mac_key, key, record.to_json())
        return json.dumps(d, separators=(",", ":"), sort_keys=True)

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
        nkey = self._node_key(node.node_id)
        self._call(lambda c: c.put(nkey, self._value(nkey, node), self._bind(lease, c)), "put node")
        for r in regions:
            rkey = self._region_key(r.name, node.node_id)
            self._call(lambda c, k=rkey, r=r: c.put(k, self._value(k, r), self._bind(lease, c)), "put region")
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
        key = self._region_key(record.name, node.node_id)
        try:
            self._call(lambda c: c.put(key, self._value(key, record), self._bind(lease, c)), "put region")
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

    def _range_page(self, start: bytes, end: bytes, revision: int) -> tuple[list[tuple[bytes, bytes, int]], bool, int]:
        """One page of ``[start, end)``: ((key, value, lease id), ...), whether etcd has more, its revision."""
        payload: dict[str, Any] = {"key": _b64(start), "range_end": _b64(end), "limit": PAGE}
        if revision:
            payload["revision"] = revision

        def call(c: Any) -> tuple[list[tuple[bytes, bytes, int]], bool, int]:
            # etcd3gw's get() drops the ``more`` flag and the lease: ask the gateway's range itself.
            res = c.post(c.get_url("/kv/range"), json=payload)
            kvs = [(base64.b64decode(kv["key"]), base64.b64decode(kv.get("value", "")), int(kv.get("lease", 0)))
                   for kv in res.get("kvs", [])]
            return kvs, bool(res.get("more", False)), int(res["header"]["revision"])

        return self._call(call, "range")

    def _scan(self, prefix: str, *, strict: bool) -> list[tuple[str, bytes, int]]:
        """Every (key, value, lease) under ``prefix``, page by page, in one snapshot.

        Past ``max_list`` keys it stops: ``strict`` raises MetadataError, else it warns;
        both name the prefix and the limit.
        """
        start = prefix.encode()
        end = _after(start)
        out: list[tuple[str, bytes, int]] = []
        revision = 0
        while True:
            kvs, more, rev = self._range_page(start, end, revision)
            revision = revision or rev
            out.extend((k.decode("utf-8", "replace"), v, lease) for k, v, lease in kvs)
            if not more or not kvs:
                return out
            if len(out) >= self.max_list:
                msg = (f"more than {self.max_list} keys under {prefix} in etcd (max_list = {self.max_list}): "
                       "the listing stops there")
                if strict:
                    raise MetadataError(msg + "; refusing to answer from part of it")
                log.warning("%s; records past them are not shown", msg)
                return out[:self.max_list]
            start = kvs[-1][0] + b"\0"

    def _read(self, prefix: str, cls: type[Any], key_of: Callable[[Any], str], *, strict: bool) -> list[Any]:
        """The valid records under ``prefix`` (module docstring: what a reader accepts)."""
        skipped = _Skipped(prefix)
        out = []
        for key, value, lease in self._scan(prefix, strict=strict):
            if not lease:
                skipped.add(key, "it has no lease (engines write every record under their lease)")
                continue
            try:
                d = loads_bounded(value, what="it", max_bytes=MAX_RECORD,
                                  max_depth=MAX_RECORD_DEPTH)
                record = cls.from_dict(d)
            except (ProtocolError, MetadataError) as exc:
                skipped.add(key, str(exc))
                continue
            if key_of(record) != key:
                skipped.add(key, f"it is a record for {key_of(record)[:512]!r}, not for this key")
                continue
            if self._mac_key is not None:
                mac = d.get("mac")
                if not isinstance(mac, str):
                    skipped.add(key, "it is not signed, and a cluster secret is configured")
                    continue
                if not hmac.compare_digest(mac, record_mac(self._mac_key, key, record.to_json())):
                    skipped.add(key, "its signature is wrong (written without this cluster's secret)")
                    continue
            out.append(record)
        skipped.done()
        return out

    def _region_records(self, prefix: str, *, strict: bool) -> list[RegionRecord]:
        return self._read(prefix, RegionRecord, lambda r: self._region_key(r.name, r.node_id), strict=strict)

    def lookup(self, name: str) -> list[RegionRecord]:
        return self._region_records(f"{self.prefix}/regions/{_quote(name)}/", strict=True)

    def list_regions(self) -> list[RegionRecord]:
        return sorted(self._region_records(f"{self.prefix}/regions/", strict=False), key=lambda r: (r.name, r.node_id))

    def list_nodes(self) -> list[NodeRecord]:
        nodes = self._read(f"{self.prefix}/nodes/", NodeRecord, lambda n: self._node_key(n.node_id), strict=False)
        return sorted(nodes, key=lambda n: n.node_id)

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


def open_metadata(url: str | MetadataStore | None, *, ttl: int = 10, timeout: float = 2.0,
                  secret: str = "") -> MetadataStore:
    """A store for ``url`` (``""`` → peer-to-peer, ``etcd://...`` → etcd); ``secret``: the
    cluster secret records are signed and checked with (see :class:`EtcdMetadata`)."""
    if isinstance(url, MetadataStore):
        return url
    kind, endpoints, prefix = parse_metadata_url(url or "")
    if kind == "p2p":
        return PeerToPeerMetadata()
    return EtcdMetadata(endpoints, ttl=ttl, prefix=prefix, timeout=timeout, secret=secret)
