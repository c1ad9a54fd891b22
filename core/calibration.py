"""Measured bandwidth classes: the calibration file the default route reads.

Every transport *declares* a :attr:`~mpcomm.Capabilities.bandwidth_class`;
``mpcomm topology --calibrate`` (``cli/calibrate.py``) *measures* each
transport running on this node, between two processes, and writes what it
found to a per-user cache file. With ``transport.bandwidth = "measured"`` (the
default) the route policy's default order (no ``[[route]]`` rule matching)
ranks a transport by its measured class when this file holds a measurement
of it for this node and this transport version, and by its declared class
otherwise. Nothing is measured when an engine starts: it only reads the file.

**Classes.** A measurement is the median, over a few rounds, of the write
throughput of 4 MiB requests, one in flight, between two engines in two
processes. It maps to a class by :data:`THRESHOLDS_GBPS` (GB/s = 10**9
bytes/s), chosen so that the classes keep the meaning the declarations give
them (:class:`~mpcomm.Capabilities`):

* ``memory`` >= 8 GB/s: memory-to-memory copies (one core's memcpy bandwidth);
* ``high``   >= 3 GB/s: RDMA-class paths (a 25 Gb/s NIC and up);
* ``medium`` >= 0.8 GB/s: fast kernel or fabric paths (a 10 Gb/s NIC);
* ``low``    below that.

Classes are coarse on purpose: on a shared host the ratio between two runs
can be 1.5x, so the policy ranks by class and never by raw GB/s (ties fall
back to zero-copy, one-sided and the preference order, as for declared
classes).

**Where.** :func:`calibration_path`: ``transport.calibration_file`` if set,
else ``$MPCOMM_CALIBRATION_FILE``, else ``$XDG_CACHE_HOME/mpcomm/bandwidth.json``
(``~/.cache/mpcomm/bandwidth.json`` without ``XDG_CACHE_HOME``).

**Which node.** The file holds one entry per node, keyed by hostname and
kernel boot id (``/proc/sys/kernel/random/boot_id``), so a home directory
shared by a cluster's nodes keeps each node's figures; a reboot changes the
boot id and asks for a new calibration (the hardware or its settings may have
changed). Each measurement records the transport's plugin version and native
library version (:meth:`~mpcomm.Transport.version`) and ``transport.mode``;
one whose versions or mode no longer match what runs is ignored. A missing file is silent; a
malformed file, a file with no entry for this node, or a stale measurement
is ignored with the reason logged (logger ``mpcomm.calibration``), and the
declared classes are used.

**Which routes.** A measurement records the kind of route it measured:
``same_host: true`` for the two processes on this node that ``--calibrate``
spawns. Same-host measurements rank only same-host routes; routes to other
hosts keep the declared classes unless a ``same_host: false`` measurement
exists.

The file (JSON)::

    {"format": 1,
     "nodes": {"<hostname>/<boot id>": {
        "node": {"hostname": "...", "boot_id": "..."},
        "measured_at": 1718000000.0, "mpcomm_version": "0.1.0",
        "thresholds_gbps": {"memory": 8.0, "high": 3.0, "medium": 0.8},
        "measurements": [
          {"transport": "shm", "same_host": true, "gbps": 21.4, "rounds_gbps": [20.9, 21.4, 22.0],
           "p50_us": 9.1, "class": "memory", "declared_class": "memory",
           "version": "0.1.0", "native_version": "", "message_size": 4194304,
           "latency_size": 4096, "measured_at": 1718000000.0, "mode": "zero-copy"}]}}}

Public API: :class:`Measurement`, :class:`Calibration`, :func:`classify`,
:func:`calibration_path`, :func:`node_identity`, :func:`load`, :func:`save`,
:func:`resolve`, :func:`route_classes`, :class:`Resolution`, :data:`THRESHOLDS_GBPS`, :data:`ENV_VAR`.
"""

from __future__ import annotations

import json
import logging
import math
import os
import socket
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .transport import BANDWIDTH_CLASSES

__all__ = [
    "ENV_VAR",
    "FORMAT",
    "THRESHOLDS_GBPS",
    "Calibration",
    "CalibrationError",
    "Measurement",
    "calibration_path",
    "classify",
    "load",
    "node_identity",
    "Resolution",
    "resolve",
    "route_classes",
    "save",
    "transport_versions",
]

log = logging.getLogger("mpcomm.calibration")

FORMAT = 1
ENV_VAR = "MPCOMM_CALIBRATION_FILE"
#: Lower bound (GB/s) of each class but ``low``, highest first (see the module docstring).
THRESHOLDS_GBPS: tuple[tuple[str, float], ...] = (("memory", 8.0), ("high", 3.0), ("medium", 0.8))
#: A calibration file larger than this is not one (the engine reads it at start).
MAX_FILE_BYTES = 1 << 20
MAX_NODES = 256


class CalibrationError(ValueError):
    """The calibration file cannot be used; the message says why."""


def classify(gbps: float) -> str:
    """The bandwidth class of a measured throughput in GB/s."""
    for name, low in THRESHOLDS_GBPS:
        if gbps >= low:
            return name
    return "low"


def node_identity() -> dict[str, str]:
    """What a calibration is valid for: this hostname and this kernel boot."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot_id = f.read().strip()
    except OSError:
        boot_id = ""
    return {"hostname": socket.gethostname(), "boot_id": boot_id}


def _node_key(node: Mapping[str, str]) -> str:
    return f"{node.get('hostname', '')}/{node.get('boot_id', '')}"


def calibration_path(config: Any = None) -> Path:
    """The calibration file for ``config`` (see the module docstring for the order)."""
    configured = getattr(getattr(config, "transport", None), "calibration_file", "") if config is not None else ""
    if configured:
        return Path(configured).expanduser()
    env = os.environ.get(ENV_VAR, "").strip()
    if env:
        return Path(env).expanduser()
    cache = os.environ.get("XDG_CACHE_HOME", "").strip()
    base = Path(cache) if cache and os.path.isabs(cache) else Path.home() / ".cache"  # the XDG spec: absolute only
    return base / "mpcomm" / "bandwidth.json"


@dataclass(frozen=True)
class Measurement:
    """One transport, measured on one kind of route."""

    transport: str
    same_host: bool
    gbps: float  # median of rounds_gbps
    rounds_gbps: tuple[float, ...]
    p50_us: float  # small-write latency as the caller sees it (submit to result)
    bandwidth_class: str
    declared_class: str
    version: str  # the plugin's distribution version
    native_version: str  # Transport.version(): the native library behind it
    message_size: int = 4 << 20
    latency_size: int = 4096
    measured_at: float = 0.0
    mode: str = "zero-copy"  # transport.mode it was measured in

    def to_dict(self) -> dict[str, Any]:
        return {"transport": self.transport, "same_host": self.same_host, "gbps": self.gbps,
                "rounds_gbps": list(self.rounds_gbps), "p50_us": self.p50_us, "class": self.bandwidth_class,
                "declared_class": self.declared_class, "version": self.version,
                "native_version": self.native_version, "message_size": self.message_size,
                "latency_size": self.latency_size, "measured_at": self.measured_at, "mode": self.mode}

    @classmethod
    def from_dict(cls, d: Any) -> Measurement:
        if not isinstance(d, Mapping):
            raise CalibrationError(f"a measurement must be an object, not {type(d).__name__}")

        def get(key: str, kind: type | tuple[type, ...]) -> Any:
            if key not in d:
                raise CalibrationError(f"a measurement lacks {key!r}")
            v = d[key]
            if not isinstance(v, kind) or (isinstance(v, bool) and kind is not bool):
                raise CalibrationError(f"measurement {key!r} has the wrong type ({type(v).__name__})")
            return v

        transport = get("transport", str)
        gbps = float(get("gbps", (int, float)))
        if not transport or not math.isfinite(gbps) or gbps <= 0:
            raise CalibrationError(f"measurement of {transport!r}: gbps must be a positive number, not {gbps}")
        klass = get("class", str)
        if klass not in BANDWIDTH_CLASSES:
            raise CalibrationError(f"measurement of {transport!r}: class {klass!r} is not one of "
                                   f"{', '.join(BANDWIDTH_CLASSES)}")
        rounds = d.get("rounds_gbps", [gbps])
        if not isinstance(rounds, list) or not all(isinstance(r, (int, float)) and not isinstance(r, bool)
                                                   for r in rounds):
            raise CalibrationError(f"measurement of {transport!r}: rounds_gbps must be a list of numbers")
        return cls(transport=transport, same_host=get("same_host", bool), gbps=gbps,
                   rounds_gbps=tuple(float(r) for r in rounds), p50_us=float(d.get("p50_us", 0.0)),
                   bandwidth_class=klass, declared_class=str(d.get("declared_class", "")),
                   version=get("version", str), native_version=get("native_version", str),
                   message_size=int(d.get("message_size", 4 << 20)), latency_size=int(d.get("latency_size", 4096)),
                   measured_at=float(d.get("measured_at", 0.0)), mode=str(d.get("mode", "zero-copy")))


@dataclass(frozen=True)
class Calibration:
    """This node's entry of the calibration file."""

    node: dict[str, str]
    measurements: tuple[Measurement, ...]
    measured_at: float = 0.0
    mpcomm_version: str = ""
    path: Path | None = field(default=None, compare=False)

    def classes(self, same_host: bool) -> dict[str, str]:
        """Measured class per transport for this kind of route (the latest measurement wins)."""
        return {m.transport: m.bandwidth_class for m in self.measurements if m.same_host == same_host}

    def to_dict(self) -> dict[str, Any]:
        return {"node": dict(self.node), "measured_at": self.measured_at, "mpcomm_version": self.mpcomm_version,
                "thresholds_gbps": dict(THRESHOLDS_GBPS),
                "measurements": [m.to_dict() for m in self.measurements]}


def _read_raw(path: Path) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_FILE_BYTES + 1)
    except OSError as exc:
        raise CalibrationError(f"cannot read it: {exc.strerror or exc}") from exc
    if len(data) > MAX_FILE_BYTES:
        raise CalibrationError(f"it is larger than {MAX_FILE_BYTES} bytes")
    try:
        raw = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise CalibrationError(f"not valid JSON: {exc}") from exc
    if not isinstance(raw, dict):
        raise CalibrationError("not a JSON object")
    if raw.get("format") != FORMAT:
        raise CalibrationError(f"format {raw.get('format')!r}, this mpcomm reads format {FORMAT}")
    if not isinstance(raw.get("nodes"), dict):
        raise CalibrationError("no 'nodes' object")
    return raw


def _parse_entry(entry: Any, path: Path) -> Calibration:
    if not isinstance(entry, dict):
        raise CalibrationError("this node's entry is not an object")
    node = entry.get("node")
    ms = entry.get("measurements")
    if not isinstance(node, dict) or not isinstance(ms, list):
        raise CalibrationError("this node's entry lacks 'node' or 'measurements'")
    return Calibration(node={k: str(v) for k, v in node.items()},
                       measurements=tuple(Measurement.from_dict(m) for m in ms),
                       measured_at=float(entry.get("measured_at", 0.0)),
                       mpcomm_version=str(entry.get("mpcomm_version", "")), path=path)


def _load(path: Path, node: Mapping[str, str]) -> tuple[Calibration | None, str, int]:
    """(calibration, why not, log level of the reason)."""
    if not path.exists():
        return None, f"no calibration file at {path}", logging.DEBUG
    try:
        raw = _read_raw(path)
        entry = raw["nodes"].get(_node_key(node))
        if entry is None:
            others = [k for k in raw["nodes"] if k.split("/", 1)[0] == node["hostname"]]
            why = ("it was measured before this node last booted (the boot id changed)" if others
                   else f"it has no entry for this node ({node['hostname']})")
            return None, f"calibration file {path} ignored: {why}", logging.INFO
        return _parse_entry(entry, path), "", logging.DEBUG
    except CalibrationError as exc:
        return None, f"calibration file {path} ignored: {exc}", logging.WARNING


def load(path: Path, node: Mapping[str, str] | None = None) -> Calibration | None:
    """This node's calibration from ``path``, or None (the reason is logged:
    a missing file at debug level, another node's file at info, a malformed
    one as a warning). Versions are not checked here (see :func:`resolve`)."""
    cal, why, level = _load(path, dict(node or node_identity()))
    if cal is None:
        log.log(level, "%s; using declared bandwidth classes", why)
    return cal


def save(path: Path, calibration: Calibration) -> None:
    """Write ``calibration`` as this node's entry of ``path``, atomically.

    Other nodes' entries stay (a shared home directory); an entry for this
    hostname from an earlier boot is dropped; measurements of transports
    that ``calibration`` did not measure again are kept. An unreadable old
    file is replaced.
    """
    nodes: dict[str, Any] = {}
    if path.exists():
        try:
            nodes = _read_raw(path)["nodes"]
        except CalibrationError as exc:
            log.warning("calibration file %s is replaced: %s", path, exc)
    key = _node_key(calibration.node)
    kept: list[Measurement] = []
    old = nodes.get(key)
    if old is not None:
        try:
            fresh = {(m.transport, m.same_host) for m in calibration.measurements}
            kept = [m for m in _parse_entry(old, path).measurements if (m.transport, m.same_host) not in fresh]
        except CalibrationError:
            kept = []
    host = calibration.node.get("hostname", "")
    nodes = {k: v for k, v in nodes.items() if k.split("/", 1)[0] != host}
    merged = Calibration(calibration.node, (*kept, *calibration.measurements), calibration.measured_at,
                         calibration.mpcomm_version)
    nodes[key] = merged.to_dict()
    if len(nodes) > MAX_NODES:  # the oldest go first
        for k in sorted(nodes, key=lambda k: nodes[k].get("measured_at", 0))[: len(nodes) - MAX_NODES]:
            del nodes[k]
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd, tmp = tempfile.mkstemp(prefix=".bandwidth-", suffix=".json", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump({"format": FORMAT, "nodes": nodes}, f, indent=1)
            f.write("\n")
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def transport_versions(entry: Any) -> tuple[str, str]:
    """(plugin distribution version, native library version) of a registry entry."""
    try:
        native = entry.cls.version() or ""
    except Exception:  # noqa: BLE001 - a version check must never stop an engine
        native = ""
    return str(entry.version or ""), str(native)


@dataclass
class Resolution:
    """What :func:`resolve` found: the file, this node's entry, the classes in use, and why
    anything was left out (one line each)."""

    path: Path
    calibration: Calibration | None
    classes: dict[bool, dict[str, str]] | None
    notes: list[str]
    #: Measurements in use, by (transport, same_host).
    used: dict[tuple[str, bool], Measurement] = field(default_factory=dict)


def resolve(config: Any, plugins: Mapping[str, Any], running: Any = None) -> Resolution:
    """The measured classes for ``config``, per kind of route, with the reasons logged.

    ``classes`` is None when ``transport.bandwidth = "declared"`` or no
    usable calibration exists for this node. ``plugins`` maps transport
    names to their registry entries (:attr:`~mpcomm.registry.PluginSet.transports`):
    a measurement whose plugin or native version, or ``transport.mode``,
    differs from what runs now is left out. ``running`` limits the check to
    these transports (the others are not ranked anyway).
    """
    path = calibration_path(config)
    if getattr(config.transport, "bandwidth", "measured") == "declared":
        return Resolution(path, None, None, ["transport.bandwidth = \"declared\": the calibration is not read"])
    cal, why, level = _load(path, node_identity())
    if cal is None:
        log.log(level, "%s; using declared bandwidth classes", why)
        return Resolution(path, None, None, [why])
    notes: list[str] = []
    wanted = set(plugins if running is None else running)
    mode = getattr(config.transport, "mode", "zero-copy")
    out: dict[bool, dict[str, str]] = {True: {}, False: {}}
    used: dict[tuple[str, bool], Measurement] = {}
    for m in cal.measurements:
        entry = plugins.get(m.transport)
        if m.transport not in wanted or entry is None:
            continue
        version, native = transport_versions(entry)
        if (m.version, m.native_version) != (version, native):
            notes.append(f"calibration of {m.transport} ignored: measured with version {m.version or '?'}"
                         + (f" (native {m.native_version})" if m.native_version else "")
                         + f", installed {version or '?'}" + (f" (native {native})" if native else ""))
        elif m.mode != mode:
            notes.append(f"calibration of {m.transport} ignored: measured in mode {m.mode!r}, "
                         f"transport.mode is {mode!r}")
        else:
            out[m.same_host][m.transport] = m.bandwidth_class
            used[(m.transport, m.same_host)] = m
    for note in notes:
        log.info("%s (%s); using its declared bandwidth class", note, path)
    if not used:
        return Resolution(path, cal, None, notes)
    log.debug("measured bandwidth classes from %s: %s", path, out)
    return Resolution(path, cal, out, notes, used)


def route_classes(config: Any, plugins: Mapping[str, Any], running: Any = None) -> dict[bool, dict[str, str]] | None:
    """:func:`resolve`'s classes: what :class:`~mpcomm.routing.RoutePolicy` takes as ``measured``."""
    return resolve(config, plugins, running).classes
