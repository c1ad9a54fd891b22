"""Configuration: a TOML file mirroring the design document's example.

::

    [transport]
    name = "auto"              # or one transport's name ("tcp", "shm", ...)
    order = ["shm", "rdma_zerocopy", "ucx", "tcp"]   # preference when name = "auto" (default: by capabilities)
    mode = "zero-copy"         # or "copy" (bounce buffers; for comparison)
    endpoint = "0.0.0.0:18400" # control endpoint; port 0 picks a free one
    advertise = ""             # host peers dial, when endpoint binds a wildcard
    reachable_at = []          # other "host:port" peers dial to reach this node (NAT, proxy); see docs/security.md
    secret = ""                # shared secret (HMAC handshake, >= 128 bits); or MPCOMM_SECRET
    handshake_timeout_ms = 5000
    tls = false                # TLS on the control channel (needs [tls])
    bandwidth = "measured"     # default route: measured classes where calibrated, or "declared"
    calibration_file = ""      # default: $MPCOMM_CALIBRATION_FILE, else ~/.cache/mpcomm/bandwidth.json

    [memory]
    types = ["host", "device"]
    registration = "eager"     # or "lazy": transports register on first use
    alignment = 4096

    [runtime]
    worker_threads = 8
    queue_depth = 1024
    request_timeout_ms = 5000
    backpressure = "block"     # or "raise"
    abort_grace_ms = 2000

    [observability]
    metrics = true
    trace_transfers = false

    [limits]                   # what one peer can make this node hold (docs/security.md)
    max_connections = 1024     # control connections in total
    max_connections_per_peer = 64   # per source address, counted from accept
    idle_timeout_ms = 600000   # a control connection with no request is closed
    frame_timeout_ms = 10000   # one frame must arrive whole once it started
    max_frame_bytes = 1048576  # largest control frame accepted
    max_notify_bytes = 65536   # largest notification payload accepted (<= 64 KiB)
    notify_rate = 10000        # notifications per second per sender node id, all its connections (burst as many)
    max_notify_senders = 4096  # senders' rate buckets held at once (idle ones are forgotten)
    max_queued_notifications = 16384     # notifications held for wait_notification()
    max_queued_notify_bytes = 16777216   # and their bytes

    [health]                   # failover and peer health (docs/topology.md)
    pause_after = 3            # consecutive failures before a path cools down
    base_cooldown_ms = 50      # first cool-down of a path or quarantine, doubling per failure
    max_cooldown_ms = 30000    # cool-down cap
    quarantine_after = 5       # consecutive failures across a peer's paths before quarantine
    max_attempts = 3           # transports one request may try (first one included)
    connect_backoff_ms = 100   # after a failed connect, no new dial to that address this long; 0 = off
    connect_backoff_max_ms = 2000   # doubling per consecutive failed connect, up to this

    [tls]                      # used when transport.tls = true
    cert = "node.pem"          # this node's certificate chain (PEM)
    key = "node.key"
    ca = "ca.pem"              # CA that signs every node's certificate
    require_client_cert = true # mutual authentication
    check_hostname = false     # also match the dialled host against the peer's certificate

    [plugins.tcp]              # per-transport options (each transport lists its keys)
    connections = 4
    # optional = true          # no error when this transport is not installed here

    [cluster]                  # issue 10: cluster metadata
    metadata = ""              # "" = peer-to-peer; "etcd://127.0.0.1:2379[,host:port][/prefix]"
    lease_ttl_s = 10           # a killed engine's published regions vanish after this

    [tent]                     # the MPComm provider (libmpcomm.so.1) for C++ hosts; see docs/tent.md
    python = ""                # the interpreter to embed when the host has none ("" = the installing env's)

    [[route]]                  # issue 10: route rules, matched in order (see mpcomm.routing)
    name = "same-host"
    same_host = true
    transports = ["shm", "ucx", "tcp"]

Unknown keys and bad values raise :class:`~mpcomm.ConfigError` naming the key
and the file. Every integer is range-checked (:data:`RANGES`); a
``[plugins.<name>]`` section naming no installed transport is an error that
lists the installed ones, unless it sets ``optional = true``. ``Config()`` is the embedded default: loopback endpoint on a free
port, no metadata service, no secret.
"""

from __future__ import annotations

import math
import os
import sys
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from .errors import ConfigError
from .health import HealthPolicy

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

__all__ = ["Config", "load_config"]

DAY_MS = 86_400_000

#: No plugin names in the core: an empty order means "rank by capabilities" (mpcomm.routing).
DEFAULT_ORDER: tuple[str, ...] = ()


@dataclass(frozen=True)
class TransportSection:
    name: str = "auto"
    order: tuple[str, ...] = tuple(DEFAULT_ORDER)
    mode: str = "zero-copy"
    endpoint: str = "127.0.0.1:0"
    advertise: str = ""
    #: Addresses (``host:port``) in front of this node that peers dial instead
    #: of the one its connections reach (a NAT mapping, a TCP proxy). With a
    #: secret, a proof for any other address is refused (mpcomm.auth).
    reachable_at: tuple[str, ...] = ()
    secret: str = ""
    handshake_timeout_ms: int = 5000
    tls: bool = False
    #: Rank the default route by measured bandwidth classes where this node has a
    #: calibration (mpcomm.calibration), or always by the declared ones.
    bandwidth: str = "measured"
    calibration_file: str = ""  # "": $MPCOMM_CALIBRATION_FILE, else the per-user cache


@dataclass(frozen=True)
class MemorySection:
    types: tuple[str, ...] = ("host",)
    registration: str = "eager"
    alignment: int = 1


@dataclass(frozen=True)
class RuntimeSection:
    worker_threads: int = 8
    queue_depth: int = 1024
    request_timeout_ms: int = 5000
    backpressure: str = "block"
    abort_grace_ms: int = 2000


@dataclass(frozen=True)
class ObservabilitySection:
    metrics: bool = False
    trace_transfers: bool = False


@dataclass(frozen=True)
class LimitsSection:
    """Bounds on what peers can make this node hold; see docs/security.md."""

    max_connections: int = 1024
    max_connections_per_peer: int = 64
    idle_timeout_ms: int = 600_000
    frame_timeout_ms: int = 10_000
    max_frame_bytes: int = 1 << 20
    max_notify_bytes: int = 64 << 10
    notify_rate: int = 10_000
    max_notify_senders: int = 4096
    max_queued_notifications: int = 16384
    max_queued_notify_bytes: int = 16 << 20


@dataclass(frozen=True)
class HealthSection:
    """Failover and peer health; see docs/topology.md ("Failover and peer health").

    The first five keys are :class:`mpcomm.health.HealthPolicy` in
    milliseconds; the connect back-off is applied by the engine's peer table.
    """

    pause_after: int = 3
    base_cooldown_ms: int = 50
    max_cooldown_ms: int = 30_000
    quarantine_after: int = 5
    max_attempts: int = 3
    connect_backoff_ms: int = 100
    connect_backoff_max_ms: int = 2000


@dataclass(frozen=True)
class TlsSection:
    cert: str = ""
    key: str = ""
    ca: str = ""
    require_client_cert: bool = True
    check_hostname: bool = False


@dataclass(frozen=True)
class TentSection:
    """The MPComm provider for C++ hosts. ``python`` is read by libmpcomm.so.1 itself (from the file
    MPCOMM_CONFIG names, before any Python runs); it is here so that the file validates."""

    python: str = ""


@dataclass(frozen=True)
class ClusterSection:  # issue 10
    metadata: str = ""
    lease_ttl_s: int = 10


_SECTIONS = {
    "transport": TransportSection,
    "memory": MemorySection,
    "runtime": RuntimeSection,
    "observability": ObservabilitySection,
    "limits": LimitsSection,
    "health": HealthSection,
    "tls": TlsSection,
    "cluster": ClusterSection,  # issue 10
    "tent": TentSection,
}

#: Inclusive ranges of every integer key; values outside are ConfigErrors naming the key.
RANGES: dict[tuple[str, str], tuple[int, int]] = {
    ("transport", "handshake_timeout_ms"): (1, 600_000),
    ("memory", "alignment"): (1, 1 << 30),
    ("runtime", "worker_threads"): (1, 1024),
    ("runtime", "queue_depth"): (1, 1 << 20),
    ("runtime", "request_timeout_ms"): (1, DAY_MS),
    ("runtime", "abort_grace_ms"): (1, 3_600_000),
    ("limits", "max_connections"): (1, 1 << 20),
    ("limits", "max_connections_per_peer"): (1, 1 << 20),
    ("limits", "idle_timeout_ms"): (100, DAY_MS),
    ("limits", "frame_timeout_ms"): (1, 3_600_000),
    ("limits", "max_frame_bytes"): (4096, 64 << 20),
    ("limits", "max_notify_bytes"): (1, 64 << 10),
    ("limits", "notify_rate"): (1, 1 << 24),
    ("limits", "max_notify_senders"): (1, 1 << 20),
    ("limits", "max_queued_notifications"): (1, 1 << 24),
    ("limits", "max_queued_notify_bytes"): (1, 1 << 36),
    ("health", "pause_after"): (1, 1000),
    ("health", "base_cooldown_ms"): (1, 3_600_000),
    ("health", "max_cooldown_ms"): (1, DAY_MS),
    ("health", "quarantine_after"): (1, 1_000_000),
    ("health", "max_attempts"): (1, 64),
    # 0 turns the connect back-off off (every request to a down peer dials again).
    ("health", "connect_backoff_ms"): (0, 600_000),
    ("health", "connect_backoff_max_ms"): (0, 3_600_000),
}

#: Plugin options without a declared range still get these: integers and floats within
#: +-2**53 (exact as floats, far below an OverflowError), floats finite, strings short,
#: and a key naming a timeout between 0 and one day in its unit (_ms, _us, else seconds).
_GENERIC_LIMIT = 1 << 53
_MAX_STRING = 4096

_CHOICES = {
    ("transport", "mode"): ("zero-copy", "copy"),
    ("transport", "bandwidth"): ("measured", "declared"),
    ("memory", "registration"): ("eager", "lazy"),
    ("runtime", "backpressure"): ("block", "raise"),
}


@dataclass(frozen=True)
class Config:
    """The whole configuration; ``Config()`` is the embedded default."""

    transport: TransportSection = field(default_factory=TransportSection)
    memory: MemorySection = field(default_factory=MemorySection)
    runtime: RuntimeSection = field(default_factory=RuntimeSection)
    observability: ObservabilitySection = field(default_factory=ObservabilitySection)
    limits: LimitsSection = field(default_factory=LimitsSection)
    health: HealthSection = field(default_factory=HealthSection)
    tls: TlsSection = field(default_factory=TlsSection)
    plugins: dict[str, dict[str, Any]] = field(default_factory=dict)
    cluster: ClusterSection = field(default_factory=ClusterSection)
    tent: TentSection = field(default_factory=TentSection)
    #: ``[[route]]`` tables as written (shape-checked here; transport names are
    #: checked against the installed plugins when an engine builds its RoutePolicy).
    route: tuple[dict[str, Any], ...] = ()
    source: str = "<defaults>"

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Config:
        p = Path(path)
        try:
            data = tomllib.loads(p.read_bytes().decode("utf-8"))  # TOML is UTF-8 whatever the locale
        except FileNotFoundError as exc:
            raise ConfigError(f"{p}: config file not found") from exc
        except OSError as exc:
            raise ConfigError(f"{p}: cannot read config file: {exc.strerror or exc}") from exc
        except UnicodeDecodeError as exc:
            raise ConfigError(f"{p}: not valid TOML: not UTF-8 ({exc})") from exc
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{p}: not valid TOML: {exc}") from exc
        return cls.from_dict(data, source=str(p))

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = "<dict>") -> Config:
        kwargs: dict[str, Any] = {"source": source}
        for key, value in data.items():
            if key == "plugins":
                if not isinstance(value, dict) or not all(isinstance(v, dict) for v in value.values()):
                    raise ConfigError(f"{source}: [plugins] must hold one table per transport")
                kwargs["plugins"] = {k: dict(v) for k, v in value.items()}
                continue
            if key == "route":  # issue 10: an array of tables
                kwargs["route"] = _route_rules(value, source)
                continue
            section_cls = _SECTIONS.get(key)
            if section_cls is None:
                raise ConfigError(f"{source}: unknown section [{key}] (known: {', '.join([*_SECTIONS, 'plugins', 'route'])})")
            if not isinstance(value, dict):
                raise ConfigError(f"{source}: [{key}] must be a table")
            kwargs[key] = _build_section(key, section_cls, value, source)
        cfg = cls(**kwargs)
        _check_whole(cfg)
        return cfg

    def with_overrides(self, **sections: dict[str, Any]) -> Config:
        """A copy with some keys replaced, validated like a file: ``with_overrides(runtime={"queue_depth": 8})``."""
        new = self
        for key, values in sections.items():
            if key == "plugins":
                merged = {k: dict(v) for k, v in self.plugins.items()}
                for name, opts in values.items():
                    merged.setdefault(name, {}).update(opts)
                new = replace(new, plugins=merged)
                continue
            if key == "route":  # issue 10: replaces the whole rule list
                new = replace(new, route=_route_rules(values, self.source))
                continue
            section_cls = _SECTIONS.get(key)
            if section_cls is None:
                raise ConfigError(f"{self.source}: unknown section [{key}]")
            current = {f.name: getattr(getattr(new, key), f.name) for f in fields(section_cls)}
            current.update(values)
            new = replace(new, **{key: _build_section(key, section_cls, current, self.source)})
        _check_whole(new)
        return new

    def check_plugin_sections(self, installed: Any) -> None:
        """Refuse a ``[plugins.<name>]`` section that names no installed transport.

        A typo would otherwise be ignored silently. A section for a transport
        that is only installed on some nodes sets ``optional = true``.
        """
        known = sorted(set(installed) | _installed_entry_points())
        for name, opts in self.plugins.items():
            if name in known or opts.get("optional") is True:
                continue
            raise ConfigError(
                f"{self.source}: [plugins.{name}] names no installed transport (installed: "
                f"{', '.join(known) or 'none'}); a typo? If {name!r} is only installed on some nodes, "
                f"set plugins.{name}.optional = true"
            )

    def plugin_options(self, name: str, defaults: dict[str, Any],
                       ranges: dict[str, Any] | None = None) -> dict[str, Any]:
        """``[plugins.<name>]`` merged over ``defaults``; unknown keys and bad values are errors.

        ``ranges`` is the transport's ``option_ranges`` (see docs/plugin-authors.md):
        ``key -> (low, high)`` inclusive, either side ``None`` for open, or a
        tuple/list/set of allowed values. Keys without a range get the generic
        checks (finite, within +-2**53, timeouts within a day).
        """
        given = {k: v for k, v in self.plugins.get(name, {}).items() if k != "optional"}
        opt = self.plugins.get(name, {}).get("optional")
        if opt is not None and not isinstance(opt, bool):
            raise ConfigError(f"{self.source}: plugins.{name}.optional must be true or false, not {opt!r}")
        unknown = sorted(set(given) - set(defaults))
        if unknown:
            raise ConfigError(
                f"{self.source}: unknown key plugins.{name}.{unknown[0]} (known: {', '.join(sorted(defaults)) or 'none'})"
            )
        ranges = ranges or {}
        out = dict(defaults)
        for k, v in given.items():
            d = defaults[k]
            where = f"{self.source}: plugins.{name}.{k}"
            if d is not None:
                ok = isinstance(v, type(d)) or (isinstance(d, float) and isinstance(v, int))
                if isinstance(v, bool) and not isinstance(d, bool):
                    ok = False
                if not ok:
                    raise ConfigError(f"{where} must be {type(d).__name__}, not {type(v).__name__}")
            _check_option(where, k, v, ranges.get(k))
            out[k] = v
        return out

    @property
    def request_timeout(self) -> float:
        return self.runtime.request_timeout_ms / 1000.0

    def health_policy(self) -> HealthPolicy:
        """``[health]`` as the :class:`mpcomm.health.HealthPolicy` an engine's tracker uses."""
        h = self.health
        return HealthPolicy(base_cooldown=h.base_cooldown_ms / 1000.0, max_cooldown=h.max_cooldown_ms / 1000.0,
                            quarantine_after=h.quarantine_after, max_attempts=h.max_attempts,
                            pause_after=h.pause_after)


def _build_section(key: str, section_cls: type, values: dict[str, Any], source: str) -> Any:
    known = {f.name: f for f in fields(section_cls)}
    out: dict[str, Any] = {}
    for name, value in values.items():
        f = known.get(name)
        if f is None:
            raise ConfigError(f"{source}: unknown key {key}.{name} (known: {', '.join(known)})")
        default = f.default
        where = f"{source}: {key}.{name}"
        if isinstance(default, bool):
            if not isinstance(value, bool):
                raise ConfigError(f"{where} must be true or false, not {value!r}")
        elif isinstance(default, int):
            if isinstance(value, bool) or not isinstance(value, int):
                raise ConfigError(f"{where} must be an integer, not {value!r}")
            lo, hi = RANGES.get((key, name), (1, _GENERIC_LIMIT))
            if not lo <= value <= hi:
                raise ConfigError(f"{where} must be between {lo} and {hi}, not {value}")
        elif isinstance(default, str):
            if not isinstance(value, str):
                raise ConfigError(f"{where} must be a string, not {value!r}")
        elif isinstance(default, tuple):
            if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
                raise ConfigError(f"{where} must be a list of strings, not {value!r}")
            value = tuple(value)
        choices = _CHOICES.get((key, name))
        if choices and value not in choices:
            raise ConfigError(f"{where} must be one of {', '.join(choices)}, not {value!r}")
        out[name] = value
    if key == "memory":
        alignment = out.get("alignment", 1)
        if alignment & (alignment - 1):
            raise ConfigError(f"{source}: memory.alignment must be a power of two, not {alignment}")
        bad = [t for t in out.get("types", ()) if t not in ("host", "device", "cuda")]
        if bad:
            raise ConfigError(f"{source}: memory.types may hold 'host' and 'device' (or 'cuda'), not {bad[0]!r}")
    if key == "transport" and out.get("secret"):
        from .auth import validate_secret

        try:
            validate_secret(out["secret"])
        except ConfigError as exc:
            raise ConfigError(f"{source}: transport.secret: {exc}") from None
    if key == "transport" and "endpoint" in out:
        from .peer import parse_endpoint

        try:
            parse_endpoint(out["endpoint"])
        except ValueError as exc:
            raise ConfigError(f"{source}: transport.endpoint: {exc}") from exc
    if key == "cluster" and "metadata" in out:  # issue 10
        from .metadata import parse_metadata_url

        try:
            parse_metadata_url(out["metadata"])
        except ConfigError as exc:
            raise ConfigError(f"{source}: cluster.{exc}") from exc
    if key == "health":
        _check_health(out, source)
    if key == "cluster" and out.get("lease_ttl_s", 10) < 2:
        raise ConfigError(f"{source}: cluster.lease_ttl_s must be at least 2, not {out['lease_ttl_s']}")
    return section_cls(**out)


def _check_health(values: dict[str, Any], source: str) -> None:
    """A cap below its start would make the back-off shrink: refuse it, naming both keys."""
    d = HealthSection()
    for start, cap in (("base_cooldown_ms", "max_cooldown_ms"), ("connect_backoff_ms", "connect_backoff_max_ms")):
        lo, hi = values.get(start, getattr(d, start)), values.get(cap, getattr(d, cap))
        if hi < lo:
            raise ConfigError(f"{source}: health.{cap} must be at least health.{start} ({lo}), not {hi}")


def _installed_entry_points() -> set[str]:
    """Transports installed on this node, loaded or not (disabled, failed to import)."""
    from importlib import metadata

    try:
        eps = metadata.entry_points()
        group = eps.select(group="mpcomm.transports") if hasattr(eps, "select") else eps.get("mpcomm.transports", [])
        return {ep.name for ep in group}
    except Exception:  # noqa: BLE001 - broken metadata must not break config checks
        return set()


def _check_whole(cfg: Config) -> None:
    """Checks that span sections."""
    if cfg.transport.tls:
        missing = [k for k in ("cert", "key", "ca") if not getattr(cfg.tls, k)]
        if missing:
            raise ConfigError(f"{cfg.source}: transport.tls = true needs tls.{missing[0]} "
                              "(the node's certificate, its key and the CA that signs every node)")


def _check_option(where: str, key: str, value: Any, rng: Any) -> None:
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{where} must be a finite number, not {value}")
    if isinstance(value, str) and len(value) > _MAX_STRING:
        raise ConfigError(f"{where} is longer than {_MAX_STRING} characters")
    numeric = isinstance(value, (int, float)) and not isinstance(value, bool)
    is_span = isinstance(rng, tuple) and len(rng) == 2 and all(
        r is None or (isinstance(r, (int, float)) and not isinstance(r, bool)) for r in rng)
    if is_span and numeric:
        lo, hi = rng
        if (lo is not None and value < lo) or (hi is not None and value > hi):
            span = f"between {lo} and {hi}" if lo is not None and hi is not None else (
                f"at least {lo}" if lo is not None else f"at most {hi}")
            raise ConfigError(f"{where} must be {span}, not {value}")
    elif rng is not None and not is_span:
        if value not in rng:
            raise ConfigError(f"{where} must be one of {', '.join(map(repr, rng))}, not {value!r}")
    if numeric:
        if abs(value) > _GENERIC_LIMIT:
            raise ConfigError(f"{where} is out of range: {value} (at most {_GENERIC_LIMIT} in magnitude)")
        if "timeout" in key:
            unit, top = ("ms", DAY_MS) if key.endswith("_ms") else (
                ("us", DAY_MS * 1000) if key.endswith("_us") else ("s", DAY_MS // 1000))
            if not 0 <= value <= top:
                raise ConfigError(f"{where} must be between 0 and {top} ({unit}; one day), not {value}")


def _route_rules(value: Any, source: str) -> tuple[dict[str, Any], ...]:
    """Shape-check ``[[route]]`` (issue 10); names are checked against plugins later."""
    from .routing import parse_rules

    parse_rules(value, None, source=source)
    return tuple(dict(r) for r in value)


def load_config(config: Config | str | os.PathLike[str] | dict[str, Any] | None) -> Config:
    """Accept a Config, a TOML path, a dict, or None (embedded default)."""
    if config is None:
        return Config()
    if isinstance(config, Config):
        return config
    if isinstance(config, dict):
        return Config.from_dict(config)
    return Config.load(config)
